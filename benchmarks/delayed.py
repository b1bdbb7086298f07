"""Delayed messages: worker memory while many wait, beside Celery countdown, in the same run.

    python -m benchmarks.delayed [--quick] [--messages N]

orderly: two worker processes (two workers, one prefork child each) run; N messages with
delays spread over a window are published to a room whose subscription is a consumer
handler. Their waits live in PostgreSQL's due-time index, so the workers' resident memory
(every process of both workers, from /proc) is measured before scheduling and after it, and
then the share delivered on time (within 1 s of its due time) once all are due.
Celery countdown: the same N delays as no-op tasks sent with ``countdown`` to the same two
workers, which take them into memory until due; their resident memory once the broker's
queue is empty. The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from benchmarks.common import (
    prepare,
    reset_pubsub,
    start_beat,
    start_workers,
    use_bench_services,
)

use_bench_services()  # before the app modules read their settings
os.environ.setdefault("ORDERLY_TOKEN_SECRET", "bench-secret-not-for-production")
os.environ.setdefault("AURA_QUEUE_MANAGER_INTERVAL", "100")

from sqlalchemy import text  # noqa: E402

from orderly.worker import pubsub  # noqa: E402
from orderly.worker.celery import DELIVER_QUEUE, PROCESS_QUEUE, app  # noqa: E402
from orderly.worker.runtime import get_runtime  # noqa: E402
from tooling.processes import Managed, ProcessGroup  # noqa: E402

WORKERS = 2
ON_TIME_MS = 1000


def rss_mb(workers: list[Managed]) -> float:
    """Resident memory of the workers and their pool children, in MiB."""
    pids = []
    for w in workers:
        pids.append(w.proc.pid)
        children = Path(f"/proc/{w.proc.pid}/task/{w.proc.pid}/children")
        if children.exists():
            pids += [int(p) for p in children.read_text().split()]
    total_kb = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total_kb += int(line.split()[1])
    return total_kb / 1024


def started_workers(group: ProcessGroup, tag: str, queue: str) -> list[Managed]:
    workers = start_workers(group, tag, queue, WORKERS)
    deadline = time.monotonic() + 60
    for w in workers:  # (they log at WARNING: wait for their pool children instead)
        children = Path(f"/proc/{w.proc.pid}/task/{w.proc.pid}/children")
        while not (children.exists() and children.read_text().split()):
            if time.monotonic() > deadline or not w.alive():
                raise RuntimeError(f"{w.name} did not start; see {w.log_path}")
            time.sleep(0.1)
    time.sleep(2.0)  # settled: the pool children have imported everything
    return workers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run under 60 s")
    parser.add_argument("--messages", type=int, default=None)
    args = parser.parse_args()
    n = args.messages or (10_000 if args.quick else 100_000)
    # Due times spread so that the workers can keep up (a delay is not a burst test).
    first_s, window_s = (6.0, 12.0) if args.quick else (40.0, 150.0)
    rng = random.Random(7)
    delays = [int((first_s + rng.random() * window_s) * 1000) for _ in range(n)]

    runtime = get_runtime()
    r, group = prepare()
    try:
        reset_pubsub(r)
        pubsub.create_room(
            runtime.engine,
            {
                "name": "later",
                "delivery_delay_ms": 100,
                "delivery_delay_multiplier": 2.0,
                "delivery_attempts": 3,
            },
        )
        pubsub.create_subscription(
            runtime.engine, "later", {"name": "echo", "kind": "HANDLER", "handler": "echo"}
        )
        beat = start_beat(group, "delayed")
        workers = started_workers(group, "delayed", DELIVER_QUEUE)
        before = rss_mb(workers)
        t0 = time.monotonic()
        for i in range(0, n, 5000):
            chunk = [({"n": k}, "later.job", delays[k]) for k in range(i, min(n, i + 5000))]
            pubsub.publish_many(
                runtime.engine, "later", chunk, secret=runtime.settings.token_secret, user="bench"
            )
        scheduled_s = time.monotonic() - t0
        time.sleep(1.0)
        after = rss_mb(workers)
        print(
            f"scheduled {n} in {scheduled_s:.1f}s; workers {before:.1f} -> {after:.1f} MiB",
            flush=True,
        )
        deadline = time.monotonic() + first_s + window_s + 300
        with runtime.engine.connect() as conn:
            while True:
                done = conn.execute(
                    text("SELECT count(*) FROM delivery WHERE state = 'DELIVERED'")
                ).scalar_one()
                conn.rollback()
                if done >= n or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            on_time = conn.execute(
                text(
                    "SELECT count(*) FILTER (WHERE d.delivered_at - e.deliver_at"
                    "  <= make_interval(secs => :s)) FROM delivery d JOIN event e USING (event_id)"
                    " WHERE d.state = 'DELIVERED'"
                ),
                {"s": ON_TIME_MS / 1000},
            ).scalar_one()
        for w in [*workers, beat]:
            group.stop(w)
        print(f"delivered {done} of {n}, {on_time} within {ON_TIME_MS} ms of due", flush=True)

        reset_pubsub(r)
        countdown_workers = started_workers(group, "countdown", PROCESS_QUEUE)
        countdown_before = rss_mb(countdown_workers)
        for k, delay in enumerate(delays):
            app.send_task("orderly.process.bench_noop", args=(k,), countdown=delay / 1000)
        limit = time.monotonic() + 120
        while r.llen(PROCESS_QUEUE) > 0 and time.monotonic() < limit:
            time.sleep(0.2)  # the workers take every countdown task into memory
        left = r.llen(PROCESS_QUEUE)
        if left:
            print(f"countdown: {left} tasks still in the broker after 120 s", flush=True)
        time.sleep(1.0)
        countdown_after = rss_mb(countdown_workers)
        print(
            f"countdown: workers {countdown_before:.1f} -> {countdown_after:.1f} MiB with "
            f"{n} tasks waiting",
            flush=True,
        )
        for w in countdown_workers:
            group.stop(w)
        r.flushdb()
    finally:
        group.stop_all()
        r.close()
    print(
        json.dumps(
            {
                "scheduled": n,
                "rss_mb_before": round(before, 1),
                "rss_mb_after": round(after, 1),
                "countdown_rss_mb_before": round(countdown_before, 1),
                "countdown_rss_mb_after": round(countdown_after, 1),
                "delivered": int(done),
                "delivered_on_time_pct": round(100 * on_time / n, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
