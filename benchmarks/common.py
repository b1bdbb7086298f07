"""What the benchmarks share: the bench database and Redis DB, and worker start-up."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BENCH_DB = os.environ.get("ORDERLY_BENCH_DATABASE", "orderly_bench")
BENCH_REDIS = os.environ.get("ORDERLY_BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")


def use_bench_services() -> None:
    """Point this process (and the processes it starts) at the bench database and Redis DB."""
    base = os.environ.get("ORDERLY_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1/x")
    os.environ["ORDERLY_DATABASE_URL"] = base.rsplit("/", 1)[0] + f"/{BENCH_DB}"
    os.environ["ORDERLY_REDIS_URL"] = BENCH_REDIS
    os.environ.pop("ORDERLY_BROKER_URL", None)
    os.environ["ORDERLY_NODE_CODE"] = "bench"


def worker_argv(name: str, queue: str, pool: str, concurrency: int) -> list[str]:
    return [
        str(Path(sys.executable).parent / "celery"),
        "-A",
        "worker",
        "worker",
        "-n",
        f"{name}@%h",
        "--pool",
        pool,
        "--concurrency",
        str(concurrency),
        "--loglevel",
        "WARNING",
        "--without-mingle",
        "--without-gossip",
        "-Q",
        queue,
        "--include",
        "benchmarks.celery_noop",
    ]
