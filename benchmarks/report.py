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
- with --jdbc-rates, ``jdbc_rows_per_s_1p`` and ``_4p``: the message table's report columns
  read over JDBC with 1 and with 4 partitions into Spark's no-op sink;
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
    from orderly.reports.aggregates import MESSAGE
    from orderly.reports.source import Jdbc, read, spark_session
    from orderly.worker.settings import Settings

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


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def tuning(messages: int) -> dict[str, Any]:
    """The settings a run of this size is given, as an operator would set them (and as
    docs/spark-cluster.md advises): heaps that hold the cached tables (about 150 MB per
    million messages), C1-only JVMs below a few million messages."""
    gigabytes = max(2, 1 + messages // 3_000_000)
    return {
        "report_driver_memory": f"{gigabytes}g",
        "report_executor_memory": f"{max(1, gigabytes // 2)}g",
        "report_quick_jit": messages < 3_000_000,
    }


def report_s(url: str, messages: int, master: str | None = None) -> tuple[float, int]:
    """The whole report as ``orderly report`` runs it; its seconds and the rows it read."""
    from orderly.reports.job import ReportOptions, run_report
    from orderly.worker.settings import Settings

    settings = Settings(database_url=url, **tuning(messages))
    with tempfile.TemporaryDirectory(prefix="orderly-bench-report-") as out:
        t0 = time.monotonic()
        result = run_report(ReportOptions(output_dir=Path(out), master=master), settings)
        took = time.monotonic() - t0
    return took, sum(result.data.rows_read.values())


def cluster_report_s(url: str, messages: int) -> float:
    """The report against a standalone cluster of two one-core workers on this machine."""
    from tooling.spark_cluster import StandaloneCluster

    memory = str(tuning(messages)["report_executor_memory"])
    size = int(memory[:-1]) * {"k": 1, "m": 1 << 10, "g": 1 << 20, "t": 1 << 30}[memory[-1]]
    worker = f"{size + (512 << 10)}k"  # the executor and its overhead
    with StandaloneCluster(workers=2, cores=1, memory=worker) as cluster:
        took, _ = report_s(url, messages, cluster.url)
    return took


def measure(messages: int, regenerate: bool, cluster: bool, rates: bool) -> dict[str, Any]:
    url, engine = prepare(messages, regenerate)
    figures: dict[str, Any] = {"rows": messages, **tuning(messages), "load_before": _load()}
    sql_s = sql_total(engine)
    engine.dispose()
    print(f"SQL in PostgreSQL, every aggregate: {sql_s:.2f}s (load {_load()})")
    spark_s, read = report_s(url, messages)
    print(
        f"Spark report (start, reads, aggregates, Parquet, CSV, HTML): {spark_s:.2f}s; "
        f"rows read {read:,} (load {_load()})"
    )
    figures.update(
        spark_report_s=round(spark_s, 2),
        sql_total_s=round(sql_s, 2),
        ratio=round(spark_s / sql_s, 3),
    )
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
        print(f"JDBC read of {rows:,} message rows: {rate_1:,.0f} rows/s (1 partition), "
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
