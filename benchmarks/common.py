"""What the benchmarks share: the bench database and Redis DB, and worker start-up."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
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
    group: ProcessGroup,
    workers: list[Managed],
    sink: Sink,
    expected: int,
    on_first: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """Wait until the sink has ``expected`` POSTs (10 minutes at most); all of them.
    ``on_first`` is called once the first ones are seen, with how many there are then."""
    deadline = time.monotonic() + 600
    arrivals: list[dict[str, Any]] = []
    while len(arrivals) < expected:
        if time.monotonic() > deadline or not all(w.alive() for w in workers):
            raise RuntimeError(f"deliveries stalled at {len(arrivals)}; see {group.log_dir}")
        time.sleep(0.02)
        seen = len(arrivals)
        arrivals += sink.arrivals(since=seen)
        if on_first is not None and not seen and arrivals:
            on_first(len(arrivals))
    return arrivals


def reset_messages(r: redis.Redis) -> None:
    """Empty the message store tables of the bench database and its Redis DB."""
    from sqlalchemy import text

    from orderly.worker.rebuild import rebuild
    from orderly.worker.runtime import get_runtime

    with get_runtime().engine.begin() as conn:
        conn.execute(text("TRUNCATE response, request, external_call, message RESTART IDENTITY"))
    r.flushdb()
    # Mark the emptied Redis as holding what orderly put there (a rebuild of the empty store),
    # as a fresh deployment's first beat does: else the next beat finds the markers missing and
    # rebuilds whatever the benchmark has stored since, inside its timing.
    runtime = get_runtime()
    logging.getLogger("orderly.worker.rebuild").setLevel(logging.ERROR)  # its summary: noise here
    report = rebuild(runtime.engine, runtime.conversations, _no_drains, lambda: None, force=True)
    assert report.done, report.summary()


def _no_drains(conversation_id: str, token: str) -> None:
    raise AssertionError(f"an empty store has no conversation to drain: {conversation_id}")


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


WRK_SCRIPT = Path(__file__).resolve().parent / "wrk" / "post.lua"


def wrk(
    url: str, kind: str, connections: int, seconds: float, env: dict[str, str] | None = None
) -> tuple[int, float, int]:
    """A wrk run (Debian's package) of benchmarks/wrk/post.lua's ``kind`` of POST
    ("messages", "sink"): its requests, seconds, and the answers other than the kind's
    expected status plus socket errors."""
    threads, whole_s = min(2, connections), max(1, round(seconds))  # wrk takes whole seconds
    argv = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{whole_s}s", "-s", str(WRK_SCRIPT),
            url, "--", uuid.uuid4().hex[:8], kind]  # fmt: skip
    done = subprocess.run(
        argv, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=True
    )
    found = re.search(r"(\d+) requests in ([\d.]+)(m?s)", done.stdout)
    if found is None:
        raise RuntimeError(f"wrk said: {done.stdout} {done.stderr}")
    requests, took = int(found.group(1)), float(found.group(2))
    took = took / 1000 if found.group(3) == "ms" else took
    counted = re.search(r"not \d+: (\d+)", done.stdout)
    if counted is None:
        raise RuntimeError(f"wrk's script said nothing of its answers: {done.stdout}")
    wrong = int(counted.group(1))
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                       done.stdout)  # fmt: skip
    if errors is not None:
        wrong += sum(int(n) for n in errors.groups())
    return requests, took, wrong
