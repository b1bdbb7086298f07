"""The Spark report beside the same aggregates as SQL in PostgreSQL, in the same run.

    python -m benchmarks.report [--quick] [--messages N] [--regenerate]

Generates N messages (1,000,000; --quick: 100,000) with ``orderly-tools generate``'s generator into
the database ``orderly_bench_report`` (kept between runs: the same N and seed are reused
unless --regenerate), then measures:
- ``spark_report_s``: the whole report as ``orderly report`` runs it: Spark's start, the
  partitioned JDBC reads, every aggregate, Parquet, CSV and the HTML file;
- ``sql_total_s``: every aggregate's SQL twin run one after the other in PostgreSQL;
- ``jdbc_rows_per_s_1p`` and ``_4p``: the message table's report columns read over JDBC with
  1 and with 4 partitions into Spark's no-op sink (every row and column materialised).
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DB = os.environ.get("ORDERLY_BENCH_REPORT_DATABASE", "orderly_bench_report")
SEED = 20261123


def _urls(name: str) -> tuple[str, str]:
    base = os.environ.get("ORDERLY_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1/x")
    root = base.rsplit("/", 1)[0]
    return root + "/postgres", root + f"/{name}"


def prepare(messages: int, regenerate: bool) -> tuple[str, Any]:
    """The database of ``messages`` generated messages (one database per size, kept)."""
    from sqlalchemy import create_engine, text

    from tooling.generate import generate
    from worker.store import schema

    name = f"{BENCH_DB}_{messages}"
    admin_url, url = _urls(name)
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        exists = conn.execute(
            text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
        ).first()
        if not exists:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    schema.upgrade(url)
    engine = create_engine(url)
    with engine.connect() as conn:
        have = conn.execute(text("SELECT count(*) FROM message")).scalar() or 0
    if regenerate or have != messages:
        with engine.begin() as conn:
            tables = conn.execute(
                text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            ).scalars()
            keep = {"alembic_version", "configuration"}
            names = ", ".join(t for t in tables if t not in keep)
            conn.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
        t0 = time.monotonic()
        made = generate(engine, messages, seed=SEED, days=30)
        took = time.monotonic() - t0
        with engine.connect() as conn:
            conn.execute(text("ANALYZE"))
            size = conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one()
        print(
            f"generated {made.total_rows:,} rows ({messages:,} messages) in {took:.1f}s; "
            f"{name}: {size / 1e9:.2f} GB"
        )
    else:
        print(f"reusing {have:,} generated messages in {name}")
    return url, engine


def sql_total(engine: Any) -> float:
    from sqlalchemy import text

    from reports.aggregates import AGGREGATES

    t0 = time.monotonic()
    with engine.connect() as conn:
        for aggregate in AGGREGATES:
            conn.execute(text(aggregate.sql), {"since": None, "until": None}).all()
    return time.monotonic() - t0


def jdbc_rate(url: str, partitions: int) -> tuple[int, float]:
    from reports.aggregates import MESSAGE
    from reports.source import Jdbc, read, spark_session
    from worker.settings import Settings

    settings = Settings(database_url=url, report_partitions=partitions)
    jdbc = Jdbc.from_settings(settings)
    spark = spark_session(jdbc, settings.report_master, settings.report_driver_memory)
    try:
        frame = read(spark, jdbc, MESSAGE, None, None)
        frame.write.format("noop").mode("overwrite").save()  # warm: JIT, connections
        t0 = time.monotonic()
        frame = read(spark, jdbc, MESSAGE, None, None)
        frame.write.format("noop").mode("overwrite").save()
        took = time.monotonic() - t0
        rows = frame.count()
    finally:
        spark.stop()
    return rows, rows / took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100,000 messages")
    parser.add_argument("--messages", type=int, default=None)
    parser.add_argument("--regenerate", action="store_true")
    args = parser.parse_args()
    messages = args.messages or (100_000 if args.quick else 1_000_000)

    from reports.job import ReportOptions, run_report
    from worker.settings import Settings

    url, engine = prepare(messages, args.regenerate)
    sql_s = sql_total(engine)
    print(f"SQL in PostgreSQL, every aggregate: {sql_s:.2f}s")
    with tempfile.TemporaryDirectory(prefix="orderly-bench-report-") as out:
        t0 = time.monotonic()
        result = run_report(ReportOptions(output_dir=Path(out)), Settings(database_url=url))
        spark_s = time.monotonic() - t0
    print(
        f"Spark report (start, reads, aggregates, Parquet, CSV, HTML): {spark_s:.2f}s; "
        f"rows read {sum(result.data.rows_read.values()):,}"
    )
    rows, rate_1 = jdbc_rate(url, 1)
    _, rate_4 = jdbc_rate(url, 4)
    print(f"JDBC read of {rows:,} message rows: {rate_1:,.0f} rows/s (1 partition), "
          f"{rate_4:,.0f} rows/s (4 partitions)")  # fmt: skip
    engine.dispose()
    print(
        json.dumps(
            {
                "rows": messages,
                "spark_report_s": round(spark_s, 2),
                "sql_total_s": round(sql_s, 2),
                "ratio": round(spark_s / sql_s, 3),
                "jdbc_rows_per_s_1p": round(rate_1, 1),
                "jdbc_rows_per_s_4p": round(rate_4, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
