# One image for every orderly process (api, worker, beat, flower, migrate) and the report.
# The base is a build argument: Debian 12 (bookworm) by default, pinned: its openjdk-17 is the
# Java Spark runs on here. Any bookworm with python3 (3.11) and python3-venv will do, e.g. one
# built locally with mmdebstrap (tooling/image/, `./run.sh image`).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/orderly PATH=/opt/orderly/bin:$PATH
# Spark needs Java; the report reads PostgreSQL through Debian's JDBC driver; Celery and kombu
# need the time zone database (ZoneInfo("UTC")), which a bare Debian base lacks. (The man page
# directory: openjdk's post-install links its pages there, and slim images leave it out.)
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      openjdk-17-jre-headless libpostgresql-jdbc-java tzdata \
 && rm -rf /var/lib/apt/lists/*
# A virtualenv of its own: a Debian python3 refuses installs into the system (PEP 668).
RUN python3 -m venv /opt/orderly
# Exactly what the wheel is built from (pyproject.toml's packages and package-dir; README.md
# is the package's readme). tests/test_image.py builds the wheel from these COPY lines.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY orderly ./orderly
COPY api ./api
COPY beat ./beat
COPY models ./models
COPY reports ./reports
COPY worker ./worker
COPY migrations ./migrations
# Installed (not editable), then the sources go: orderly and its migrations come from the
# virtualenv's site-packages.
RUN pip install --no-cache-dir --disable-pip-version-check '.[all]' \
 && cd / && rm -rf /src
# Your own handler modules: copy them in a derived image and name them, e.g.
#   FROM orderly:latest
#   COPY my_handlers.py /app/handlers/
#   ENV PYTHONPATH=/app/handlers ORDERLY_HANDLER_MODULES=my_handlers
WORKDIR /app
# /app/reports-out: where `orderly report` writes; /app/metrics-key: where docker-compose's
# metrics-key service keeps Prometheus's API key (a new volume takes this owner).
RUN useradd --create-home orderly \
 && mkdir -p /app/reports-out /app/metrics-key \
 && chown orderly /app/reports-out /app/metrics-key
USER orderly
VOLUME ["/app/reports-out"]
CMD ["orderly", "--help"]
