# One image for every orderly process (api, worker, beat, flower, migrate) and the report.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Spark needs Java; the report reads PostgreSQL through Debian's JDBC driver.
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless libpostgresql-jdbc-java \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md alembic.ini ./
COPY models ./models
COPY worker ./worker
COPY beat ./beat
COPY api ./api
COPY reports ./reports
COPY migrations ./migrations
RUN pip install --no-cache-dir -e .
RUN useradd --create-home orderly
USER orderly
CMD ["orderly", "--help"]
