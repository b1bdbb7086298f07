# One image for every orderly process (api, worker, beat, flower, migrate) and the report.
# Debian 12 (bookworm), pinned: its openjdk-17 is the Java Spark runs on here.
FROM python:3.11-slim-bookworm
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
COPY tooling ./tooling
# Installed (not editable): orderly and its migrations come from site-packages.
RUN pip install --no-cache-dir '.[all]'
# Your own handler modules: copy them in a derived image and name them, e.g.
#   FROM orderly:latest
#   COPY my_handlers.py /app/handlers/
#   ENV PYTHONPATH=/app/handlers ORDERLY_HANDLER_MODULES=my_handlers
RUN useradd --create-home orderly && mkdir -p /app/reports-out && chown orderly /app/reports-out
USER orderly
VOLUME ["/app/reports-out"]
CMD ["orderly", "--help"]
