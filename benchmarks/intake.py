"""Intake and processing throughput, beside plain Celery in the same run.

    python -m benchmarks.intake [--quick] [--messages N] [--rounds R]

Measures messages accepted/s through the HTTP API and through the Python API, processed/s
end to end with a no-op handler, and plain Celery no-op tasks/s (benchmarks/peer_apps/
celery_app.py: tuned as Celery's own guide advises) with two worker processes each, on the
same Redis. Both are timed alike (benchmarks/peers.queued_first): the queue is filled first,
then the workers start, and the clock runs from the first task taken to the last one done.
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.common import prepare, reset_messages, use_bench_services

use_bench_services()  # before the app modules read their settings

import redis  # noqa: E402
from sqlalchemy import create_engine  # noqa: E402

from benchmarks import peer_apps, peers  # noqa: E402
from orderly.worker.runtime import get_runtime  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run under 60 s")
    parser.add_argument("--messages", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="orderly/baseline pairs")
    parser.add_argument("--http-threads", type=int, default=4)
    args = parser.parse_args()
    n = args.messages or (1500 if args.quick else 20000)
    args.rounds = args.rounds or (2 if args.quick else 3)

    r, group = prepare()
    peers_redis = redis.Redis.from_url(peer_apps.REDIS_URL)
    pg_admin = create_engine(peers.PEERS_URL.set(database="postgres"))
    orderly = peers.OrderlyOneByOne(group, r, peers.Meter(r, pg_admin, [get_runtime().engine]))
    celery = peers.PlainCelery(group, peers_redis, peers.Meter(peers_redis, pg_admin, []))
    python_runs: list[float] = []
    processed_runs: list[float] = []
    celery_runs: list[float] = []
    try:
        reset_messages(r)
        api_per_s = (
            n / peers.http_intake(group, orderly.meter, n, args.http_threads, "messages").seconds
        )
        print(
            f"HTTP API intake:    {api_per_s:8.0f} msg/s ({n} messages, "
            f"{args.http_threads} client threads, 1 API process)",
            flush=True,
        )

        def python_intake() -> None:
            t0 = time.perf_counter()
            orderly.submit(0, n)
            python_runs.append(n / (time.perf_counter() - t0))

        # Rounds interleave orderly and the baseline, so drift on the machine hits both.
        for round_no in range(1, args.rounds + 1):
            processed_runs.append(n / peers.queued_first(orderly, n, python_intake).seconds)
            celery_runs.append(n / peers.queued_first(celery, n).seconds)
            print(
                f"round {round_no}: Python API intake {python_runs[-1]:.0f} msg/s, "
                f"processed {processed_runs[-1]:.0f} msg/s, plain Celery no-op "
                f"{celery_runs[-1]:.0f} tasks/s (2 worker processes each)",
                flush=True,
            )
    finally:
        group.stop_all()
        r.close()

    python_per_s = statistics.median(python_runs)
    processed_per_s = statistics.median(processed_runs)
    celery_noop_per_s = statistics.median(celery_runs)
    print(
        f"medians of {args.rounds} rounds: processed {processed_per_s:.0f}/s, "
        f"plain Celery {celery_noop_per_s:.0f}/s",
        flush=True,
    )
    figures = {
        "messages": n,
        "rounds": args.rounds,
        "api_per_s": round(api_per_s, 1),
        "python_per_s": round(python_per_s, 1),
        "processed_per_s": round(processed_per_s, 1),
        "celery_noop_per_s": round(celery_noop_per_s, 1),
        "ratio": round(processed_per_s / celery_noop_per_s, 3),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
