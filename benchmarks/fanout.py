"""Publish and fan-out to PUSH subscriptions, beside plain Celery in the same run.

    python -m benchmarks.fanout [--quick] [--events N] [--subscriptions S] [--rounds R]

A room with S PUSH subscriptions on the client sink (answering 200). Events are published
through the Python API (publishes/s); then two worker processes (two workers, one prefork child
each) start and deliver every push: pushes/s from the first POST the sink receives to the last.
The baseline is plain Celery no-op tasks/s (benchmarks/peers.py: tuned, two worker processes)
on the same broker, timed the same way (full queue, first taken to last done); rounds alternate
the two. The units differ on purpose: orderly sends a publish's whole fan-out in one task, so
the ratio compares pushes delivered with tasks run, the cost a user of plain Celery would pay
for one task per push. The last line printed is one JSON object with the figures."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.common import (
    prepare,
    reset_pubsub,
    sink_arrivals,
    start_beat,
    start_workers,
    use_bench_services,
)

use_bench_services()  # before the app modules read their settings

from sqlalchemy import text  # noqa: E402

from benchmarks import peers  # noqa: E402
from orderly.worker import pubsub  # noqa: E402
from orderly.worker.celery import DELIVER_QUEUE, enqueue_event_deliveries  # noqa: E402
from orderly.worker.runtime import get_runtime  # noqa: E402
from tooling.processes import ProcessGroup  # noqa: E402
from tooling.sink import Sink  # noqa: E402

WORKERS = 2


def setup(sink: Sink, subscriptions: int) -> None:
    engine = get_runtime().engine
    pubsub.create_room(
        engine,
        {
            "name": "bench",
            "delivery_delay_ms": 100,
            "delivery_delay_multiplier": 2.0,
            "delivery_attempts": 3,
        },
    )
    for i in range(subscriptions):
        pubsub.create_subscription(
            engine, "bench", {"name": f"s{i}", "kind": "PUSH", "push_url": sink.url}
        )


def publish_all(events: int) -> float:
    engine = get_runtime().engine
    t0 = time.perf_counter()
    for n in range(events):
        pubsub.publish_message(
            engine, "bench", {"n": n}, "bench.event", enqueue=enqueue_event_deliveries
        )
    return events / (time.perf_counter() - t0)


def push_rate(group: ProcessGroup, sink: Sink, expected: int, tag: str) -> float:
    beat = start_beat(group, tag)
    workers = start_workers(group, tag, DELIVER_QUEUE, WORKERS)
    arrivals = sink_arrivals(group, workers, sink, expected)
    # The sink saw every POST; the last outcomes commit a moment later: let them, before
    # the workers stop.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with get_runtime().engine.connect() as conn:
            done = conn.execute(
                text("SELECT count(*) FROM delivery WHERE state = 'DELIVERED'")
            ).scalar_one()
        if done >= expected:
            break
        time.sleep(0.05)
    for w in [*workers, beat]:
        group.stop(w)
    first, last = float(arrivals[0]["t_arrival"]), float(arrivals[-1]["t_arrival"])
    return (expected - 1) / (last - first)  # intervals between the first and last POST


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run under 60 s")
    parser.add_argument("--events", type=int, default=None)
    parser.add_argument("--subscriptions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    events = args.events or (300 if args.quick else 2500)
    rounds = args.rounds or (2 if args.quick else 3)
    pushes = events * args.subscriptions

    r, group = prepare()
    publish_rates: list[float] = []
    push_rates: list[float] = []
    noop_rates: list[float] = []
    with Sink() as sink:
        try:
            for round_no in range(1, rounds + 1):
                reset_pubsub(r)
                sink.reset()
                setup(sink, args.subscriptions)
                publish_rates.append(publish_all(events))
                push_rates.append(push_rate(group, sink, pushes, f"fanout{round_no}"))
                with get_runtime().engine.connect() as conn:
                    delivered = conn.execute(
                        text("SELECT count(*) FROM delivery WHERE state = 'DELIVERED'")
                    ).scalar_one()
                if delivered != pushes:
                    raise RuntimeError(f"only {delivered} of {pushes} deliveries DELIVERED")
                reset_pubsub(r)
                noop_rates.append(peers.plain_celery_rate(group, pushes))
                print(
                    f"round {round_no}: {events} events x {args.subscriptions} subscriptions: "
                    f"publish {publish_rates[-1]:.0f}/s, pushes {push_rates[-1]:.0f}/s; plain "
                    f"Celery no-op {noop_rates[-1]:.0f} tasks/s (2 worker processes)",
                    flush=True,
                )
        finally:
            group.stop_all()
            r.close()
    publish_per_s = statistics.median(publish_rates)
    pushes_per_s = statistics.median(push_rates)
    noop_per_s = statistics.median(noop_rates)
    print(
        json.dumps(
            {
                "events": events,
                "subscriptions": args.subscriptions,
                "rounds": rounds,
                "publish_per_s": round(publish_per_s, 1),
                "pushes_per_s": round(pushes_per_s, 1),
                "celery_noop_per_s": round(noop_per_s, 1),
                "ratio": round(pushes_per_s / noop_per_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
