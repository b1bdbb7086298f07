# One image for every orderly process (api, worker, beat, flower, migrate).
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md alembic.ini flowerconfig.py ./
COPY models ./models
COPY worker ./worker
COPY beat ./beat
COPY api ./api
COPY migrations ./migrations
RUN pip install --no-cache-dir -e .
RUN useradd --create-home orderly
USER orderly
CMD ["orderly", "--help"]
