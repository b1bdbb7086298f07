"""What the benchmarks share: the bench database and Redis DB, and worker start-up."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis

    from tooling.processes import Managed, ProcessGroup
    from tooling.sink import Sink

BENCH_DB = os.environ.get("ORDERLY_BENCH_DATABASE", "orderly_bench")
BENCH_REDIS = os.environ.get("ORDERLY_BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")


def use_bench_services() -> None:
    """Point this process (and the processes it starts) at the bench database and Redis DB."""
    base = os.environ.get("ORDERLY_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1/x")
    os.environ["ORDERLY_DATABASE_URL"] = base.rsplit("/", 1)[0] + f"/{BENCH_DB}"
    os.environ["ORDERLY_REDIS_URL"] = BENCH_REDIS
    os.environ.pop("ORDERLY_BROKER_URL", None)
    os.environ["ORDERLY_NODE_CODE"] = "bench"
    os.environ.setdefault("ORDERLY_HANDLER_MODULES", "tooling.handlers")


def worker_argv(name: str, queue: str, pool: str, concurrency: int) -> list[str]:
    return [
        str(Path(sys.executable).parent / "celery"),
        "-A",
        "orderly.worker",
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


def prepare() -> tuple[redis.Redis, ProcessGroup]:
    """Create and migrate the bench database; a Redis client and a process group for the run."""
    import redis

    from orderly.worker.db import schema
    from orderly.worker.runtime import get_runtime
    from tooling.processes import ProcessGroup

    runtime = get_runtime()
    schema.create_database(runtime.settings.database_url)
    schema.upgrade(runtime.settings.database_url)
    runtime.startup_check()
    group = ProcessGroup.create(Path(tempfile.mkdtemp(prefix="orderly-bench-")))
    return redis.Redis.from_url(BENCH_REDIS), group


def start_workers(group: ProcessGroup, tag: str, queue: str, count: int = 2) -> list[Managed]:
    """``count`` workers of one prefork child each, consuming ``queue`` (not waited for)."""
    return [
        group.start(
            f"{tag}-w{i}",
            worker_argv(f"{tag}{i}", queue, "prefork", 1),
            {"ORDERLY_NODE_CODE": f"bench-{tag}{i}"},
        )
        for i in range(count)
    ]


def start_beat(group: ProcessGroup, tag: str) -> Managed:
    """Beat, whose ticker hands due work (delays, retries, wake-ups) to the broker; waited for."""
    from tooling.processes import wait_for_log

    beat = group.start_beat(f"{tag}-beat", {"ORDERLY_NODE_CODE": f"bench-{tag}-beat"})
    wait_for_log(beat, "ticker every", timeout=120)
    return beat


def sink_arrivals(
    group: ProcessGroup, workers: list[Managed], sink: Sink, expected: int
) -> list[dict[str, Any]]:
    """Wait until the sink has ``expected`` POSTs (10 minutes at most); all of them."""
    deadline = time.monotonic() + 600
    arrivals: list[dict[str, Any]] = []
    while len(arrivals) < expected:
        if time.monotonic() > deadline or not all(w.alive() for w in workers):
            raise RuntimeError(f"deliveries stalled at {len(arrivals)}; see {group.log_dir}")
        time.sleep(0.02)
        arrivals += sink.arrivals(since=len(arrivals))
    return arrivals


def reset_messages(r: redis.Redis) -> None:
    """Empty the message store tables of the bench database and its Redis DB."""
    from sqlalchemy import text

    from orderly.worker.runtime import get_runtime

    with get_runtime().engine.begin() as conn:
        conn.execute(text("TRUNCATE response, request, external_call, message RESTART IDENTITY"))
    r.flushdb()


def pct(values: list[float], q: float) -> float:
    """The q-quantile by rank (the value below which a share q of the values lie)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def reset_pubsub(r: redis.Redis) -> None:
    """Empty the publish/subscribe tables of the bench database and its Redis DB."""
    from sqlalchemy import text

    from orderly.worker.runtime import get_runtime

    with get_runtime().engine.begin() as conn:
        conn.execute(
            text(
                "TRUNCATE queue_message, published_messages, delivery, event, subscription,"
                " publisher, event_type_version, event_type, room RESTART IDENTITY CASCADE"
            )
        )
    r.flushdb()
