"""The Spark report beside the same aggregates as SQL in PostgreSQL, in the same run.

    python -m benchmarks.report [--quick] [--messages N [N ...]] [--regenerate]
                                [--no-cluster] [--jdbc-rates]

Generates N messages (1,000,000; --quick: 100,000) with ``python -m tooling generate``'s
generator into the database ``orderly_bench_report_<N>`` (one per size, kept between runs:
reused while it holds N messages, unless --regenerate), then measures:
- ``sql_total_s``: every aggregate's SQL twin run one after the other in PostgreSQL;
- ``spark_report_s``: the whole report as ``orderly report`` runs it on local[*]: Spark's
  start, the partitioned JDBC reads, every aggregate, Parquet, CSV and the HTML file, and
  ``ratio`` = spark_report_s / sql_total_s;
- ``spark_cluster_report_s`` (unless --no-cluster): the same report against a standalone
  cluster of two one-core workers started on this machine (``tooling/spark_cluster.py``);
- ``read_s``: of spark_report_s, the job that reads into memory what several passes take
  (reports.tables.CACHED); ``read_rows`` the rows that came over JDBC in it (the names,
  PostgreSQL's partial aggregates and rank summaries: no row of the store as it is),
  ``read_rows_per_s`` =
  read_rows / read_s. The single-use read (reports.tables.SINGLE_USE: the message counts)
  is read by its aggregates' job, beside the others, and is not in these three;
  ``store_rows_per_s``: the rows of the store the report covers (every table it reads,
  counted in PostgreSQL) / spark_report_s;
- ``jdbc_limit_rows_per_s``: the JDBC read limit, measured in the same run: the store's
  largest set of rows a report could read (every finished message's latency: the report
  reads their rank summaries instead) over JDBC into Spark's no-op sink with the report's
  partitions (``ORDERLY_REPORT_PARTITIONS``), as fast as JDBC brings rows to Spark;
- ``day_report_s``: an incremental report of the store's last day (the watermark set one day
  before its newest message, ``day_messages`` in that day) as ``orderly report`` runs one,
  on local[*], tuned for the day's size;
- with --jdbc-rates, ``jdbc_rows_per_s_1p`` and ``_4p``: the same bare read with 1 and with 4
  partitions;
- ``load_before`` / ``load_after``: the machine's 1-minute load average around them.
Settings (e.g. ORDERLY_REPORT_DRIVER_MEMORY) come from the environment as for the command.
The last line printed is one JSON object: the figures, or with several sizes
``{"1M": {...}, "10M": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orderly.worker.settings import Settings

if TYPE_CHECKING:
    from orderly.reports.data import ReportData

BENCH_DB = os.environ.get("ORDERLY_BENCH_REPORT_DATABASE", "orderly_bench_report")
SEED = 20261123


def _urls(name: str) -> tuple[str, str]:
    base = os.environ.get("ORDERLY_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1/x")
    root = base.rsplit("/", 1)[0]
    return root + "/postgres", root + f"/{name}"


def prepare(messages: int, regenerate: bool) -> tuple[str, Any]:
    """The database of ``messages`` generated messages (one database per size, kept)."""
    from sqlalchemy import create_engine, text

    from orderly.worker.db import schema
    from tooling.generate import generate

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

    from orderly.reports.aggregates import AGGREGATES

    t0 = time.monotonic()
    with engine.connect() as conn:
        for aggregate in AGGREGATES:
            conn.execute(text(aggregate.sql), {"since": None, "until": None}).all()
    return time.monotonic() - t0


def jdbc_rate(url: str, partitions: int) -> tuple[int, float]:
    from orderly.reports.source import Jdbc, read, spark_session
    from orderly.reports.tables import FINISHED

    settings = Settings(database_url=url, report_partitions=partitions)
    jdbc = Jdbc.from_settings(settings)
    spark = spark_session(jdbc, settings.report_master, settings.report_driver_memory)
    try:
        frame = read(spark, jdbc, FINISHED, None, None)
        frame.write.format("noop").mode("overwrite").save()  # warm: JIT, connections
        t0 = time.monotonic()
        frame = read(spark, jdbc, FINISHED, None, None)
        frame.write.format("noop").mode("overwrite").save()
        took = time.monotonic() - t0
        rows = frame.count()
    finally:
        spark.stop()
    return rows, rows / took


def store_rows(engine: Any) -> int:
    """The rows of every table the report reads (its whole store)."""
    from sqlalchemy import text

    from orderly.reports.tables import TABLES

    names = sorted({t.from_.split()[0] for t in TABLES})  # the tables the reads select from
    counts = " + ".join(f"(SELECT count(*) FROM {name})" for name in names)
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT {counts}")).scalar_one())


DAY_MARK = "benchmark-last-day"


def day_report_s(url: str, engine: Any) -> tuple[float, int]:
    """An incremental report of the store's last day, as ``orderly report`` runs one: its
    seconds and the messages in that day."""
    from sqlalchemy import text

    from orderly.reports.job import ReportOptions, move_watermark, run_report

    with engine.begin() as conn:
        since = conn.execute(text("SELECT max(receive_timestamp) FROM message")).scalar_one()
        since -= timedelta(days=1)
        day = conn.execute(
            text("SELECT count(*) FROM message WHERE receive_timestamp >= :s"), {"s": since}
        ).scalar_one()
        conn.execute(text("DELETE FROM report_watermark WHERE name = :n"), {"n": DAY_MARK})
        move_watermark(conn, DAY_MARK, None, since, "benchmark")
    settings = Settings(database_url=url, **tuning(day))
    options = ReportOptions(incremental=True, watermark_name=DAY_MARK, lag=timedelta(0))
    with tempfile.TemporaryDirectory(prefix="orderly-bench-report-") as out:
        t0 = time.monotonic()
        result = run_report(replace(options, output_dir=Path(out)), settings, engine=engine)
        took = time.monotonic() - t0
    assert result.data.since == since
    return took, int(day)


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def tuning(messages: int) -> dict[str, Any]:
    """The settings a run of this size is given, as an operator would set them (and as
    docs/spark-cluster.md advises): the defaults at every size measured (up to 10 million
    messages). C1-only JVMs (ORDERLY_REPORT_QUICK_JIT's default) end sooner now that the
    reads come as partial aggregates and rank summaries; memory stays at driver 2g, executors
    1g: the cached reads of 10 million messages are 418 rows."""
    del messages  # every size alike, for now
    return {}


def report_s(url: str, messages: int, master: str | None = None) -> tuple[float, ReportData]:
    """The whole report as ``orderly report --full`` runs it: its seconds, and its data."""
    from orderly.reports.job import ReportOptions, run_report

    settings = Settings(database_url=url, **tuning(messages))
    with tempfile.TemporaryDirectory(prefix="orderly-bench-report-") as out:
        t0 = time.monotonic()
        result = run_report(ReportOptions(output_dir=Path(out), master=master), settings)
        took = time.monotonic() - t0
    return took, result.data


def cluster_report_s(url: str, messages: int) -> float:
    """The report against a standalone cluster of two one-core workers on this machine."""
    from tooling.spark_cluster import StandaloneCluster

    memory = Settings().report_executor_memory
    size = int(memory[:-1]) * {"k": 1, "m": 1 << 10, "g": 1 << 20, "t": 1 << 30}[memory[-1]]
    worker = f"{size + (512 << 10)}k"  # the executor and its overhead
    with StandaloneCluster(workers=2, cores=1, memory=worker) as cluster:
        took, _ = report_s(url, messages, cluster.url)
    return took


def measure(messages: int, regenerate: bool, cluster: bool, rates: bool) -> dict[str, Any]:
    url, engine = prepare(messages, regenerate)
    settings = Settings(**tuning(messages))
    figures: dict[str, Any] = {
        "rows": messages,
        "report_driver_memory": settings.report_driver_memory,
        "report_executor_memory": settings.report_executor_memory,
        "report_quick_jit": settings.report_quick_jit,
        "load_before": _load(),
    }
    sql_s = sql_total(engine)
    print(f"SQL in PostgreSQL, every aggregate: {sql_s:.2f}s (load {_load()})")
    covered = store_rows(engine)
    spark_s, data = report_s(url, messages)
    read = sum(data.rows_read.values())
    print(
        f"Spark report (start, reads, aggregates, Parquet, CSV, HTML): {spark_s:.2f}s; "
        f"{read:,} rows of the cached reads over JDBC in {data.read_s:.2f}s; the report covers "
        f"{covered:,} rows of the store (load {_load()})"
    )
    figures.update(
        spark_report_s=round(spark_s, 2),
        sql_total_s=round(sql_s, 2),
        ratio=round(spark_s / sql_s, 3),
        read_s=round(data.read_s, 2),
        read_rows=read,
        read_rows_per_s=round(read / data.read_s, 1),
        store_rows=covered,
        store_rows_per_s=round(covered / spark_s, 1),
    )
    _, limit = jdbc_rate(url, Settings().report_partitions)
    print(f"JDBC read limit (the finished messages read, report partitions): {limit:,.0f} rows/s")
    figures["jdbc_limit_rows_per_s"] = round(limit, 1)
    day_s, day = day_report_s(url, engine)
    print(f"incremental report of the last day ({day:,} messages): {day_s:.2f}s (load {_load()})")
    figures.update(day_report_s=round(day_s, 2), day_messages=day)
    engine.dispose()
    if cluster:
        cluster_s = cluster_report_s(url, messages)
        print(f"the same on a standalone cluster (2 workers x 1 core): {cluster_s:.2f}s")
        figures.update(
            spark_cluster_report_s=round(cluster_s, 2),
            cluster_ratio=round(cluster_s / sql_s, 3),
        )
    if rates:
        rows, rate_1 = jdbc_rate(url, 1)
        _, rate_4 = jdbc_rate(url, 4)
        print(f"JDBC read of {rows:,} finished message rows: {rate_1:,.0f} rows/s (1 partition), "
              f"{rate_4:,.0f} rows/s (4 partitions)")  # fmt: skip
        figures.update(jdbc_rows_per_s_1p=round(rate_1, 1), jdbc_rows_per_s_4p=round(rate_4, 1))
    figures["load_after"] = _load()
    return figures


def _size(messages: int) -> str:
    return f"{messages // 1_000_000}M" if messages % 1_000_000 == 0 else str(messages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100,000 messages")
    parser.add_argument("--messages", type=int, nargs="+", default=None, help="one or more sizes")
    parser.add_argument("--regenerate", action="store_true")
    parser.add_argument(
        "--no-cluster", action="store_true", help="leave out the standalone cluster's run"
    )
    parser.add_argument("--jdbc-rates", action="store_true", help="also time bare JDBC reads")
    args = parser.parse_args()
    sizes = args.messages or [100_000 if args.quick else 1_000_000]
    results = {
        _size(n): measure(n, args.regenerate, not args.no_cluster, args.jdbc_rates) for n in sizes
    }
    print(json.dumps(results[_size(sizes[0])] if len(sizes) == 1 else results))


if __name__ == "__main__":
    main()
