"""Guaranteed order throughput and release latency, beside the same messages without order.

    python -m benchmarks.funnel [--quick] [--funnels N] [--per-funnel M] [--rounds R]

Submits N funnels x M messages (Python API; round-robin over the funnels, msg_timestamp rising
within each) with ``guaranteed_order``, then starts two worker processes (one prefork child
each) and times them from the first task taken to the last message OK. Then the same messages
without funnel or order, timed the same way, with the same workers' layout. Rounds alternate
the two. Every message runs ``bench.stamp``, which keeps its handler's start and end time:
release latency is, for each message after the first of its funnel, the start of its handler
minus the end of its predecessor's (so it covers the predecessor's outcome, the release and
the claim); order violations count messages that started before their predecessor ended.
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta

from benchmarks.common import (
    pct,
    prepare,
    reset_messages,
    start_beat,
    start_workers,
    use_bench_services,
)

use_bench_services()  # before the app modules read their settings

import redis  # noqa: E402
from sqlalchemy import text  # noqa: E402

from orderly.worker.celery import PROCESS_QUEUE, enqueue_processing, wake_processing  # noqa: E402
from orderly.worker.messages.pipeline import Pipeline  # noqa: E402
from orderly.worker.runtime import get_runtime  # noqa: E402
from tooling.processes import ProcessGroup  # noqa: E402

BASE_TS = datetime(2026, 1, 1, tzinfo=UTC)


def submit(
    funnels: int, per_funnel: int, ordered: bool, batch: int = 1, *, pipelined: bool = False
) -> dict[str, int]:
    """Store every message, round-robin over the funnels, ``batch`` a call (1: ``submit``,
    more: ``submit_many``; ``pipelined``: one a call through a ``Pipeline``); how many were
    stored NEW and POSTPONED."""
    intake = get_runtime().intake(enqueue_processing, wake_processing, grouped=pipelined)
    run = uuid.uuid4().hex[:6]
    stored = {"NEW": 0, "POSTPONED": 0}
    bodies: list[dict[str, object]] = []
    for i in range(per_funnel):
        for f in range(funnels):
            body: dict[str, object] = {
                "service": "bench",
                "operation": "stamp",
                "correlation_id": f"{run}-{f}-{i}",
                "source_system": "bench",
                "msg_timestamp": (BASE_TS + timedelta(seconds=i, microseconds=f)).isoformat(),
                "payload": "{}",
            }
            if ordered:
                body.update(funnel_value=f"funnel-{f}", guaranteed_order=True)
            bodies.append(body)
    if pipelined:
        with Pipeline(intake) as pipeline:
            futures = [pipeline.submit(body) for body in bodies]
        for future in futures:
            stored[future.result().state.value] += 1
        return stored
    if batch <= 1:
        for body in bodies:
            stored[intake.submit(body).state.value] += 1
        return stored
    for start in range(0, len(bodies), batch):
        for result in intake.submit_many(bodies[start : start + batch]):
            stored[result.state.value] += 1
    return stored


def ok_count() -> int:
    with get_runtime().engine.connect() as conn:
        return int(
            conn.execute(text("SELECT count(*) FROM message WHERE state = 'OK'")).scalar_one()
        )


def run_workers(group: ProcessGroup, r: redis.Redis, n: int, tag: str) -> float:
    """Messages/s from the first task taken to the last message OK."""
    queued = r.llen(PROCESS_QUEUE)
    beat = start_beat(group, tag)
    workers = start_workers(group, tag, PROCESS_QUEUE)
    deadline = time.monotonic() + 600
    while r.llen(PROCESS_QUEUE) == queued:
        if time.monotonic() > deadline or not all(w.alive() for w in workers):
            raise RuntimeError(f"workers did not start; see {group.log_dir}")
        time.sleep(0.002)
    t0 = time.perf_counter()
    while ok_count() < n:
        if time.monotonic() > deadline or not all(w.alive() for w in workers):
            raise RuntimeError(f"stalled at {ok_count()} of {n}; see {group.log_dir}")
        time.sleep(0.01)
    elapsed = time.perf_counter() - t0
    for w in [*workers, beat]:
        group.stop(w)
    return n / elapsed


def release_figures() -> tuple[list[float], int]:
    """Release latencies (ms) along every funnel, and order violations."""
    with get_runtime().engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT funnel_value, custom_data FROM message WHERE operation_name = 'stamp'"
                " ORDER BY funnel_value, msg_timestamp, msg_id"
            )
        ).all()
    latencies: list[float] = []
    violations = 0
    previous: tuple[str, float] | None = None
    for funnel, stamps in rows:
        start, end = (float(v) for v in stamps.split(","))
        if previous is not None and previous[0] == funnel:
            gap_ms = (start - previous[1]) * 1000
            latencies.append(gap_ms)
            violations += gap_ms < 0
        previous = (funnel, end)
    return latencies, violations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run under 60 s")
    parser.add_argument("--funnels", type=int, default=None)
    parser.add_argument("--per-funnel", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=None, help="ordered/unordered pairs")
    args = parser.parse_args()
    funnels = args.funnels or (200 if args.quick else 1000)
    rounds = args.rounds or (1 if args.quick else 3)
    n = funnels * args.per_funnel

    r, group = prepare()
    ordered_runs: list[float] = []
    unordered_runs: list[float] = []
    latencies: list[float] = []
    violations = 0
    try:
        for round_no in range(1, rounds + 1):
            reset_messages(r)
            stored = submit(funnels, args.per_funnel, ordered=True)
            ordered_runs.append(run_workers(group, r, n, "ordered"))
            lat, bad = release_figures()
            latencies += lat
            violations += bad
            reset_messages(r)
            submit(funnels, args.per_funnel, ordered=False)
            unordered_runs.append(run_workers(group, r, n, "unordered"))
            print(
                f"round {round_no}: {funnels} funnels x {args.per_funnel}: guaranteed order "
                f"{ordered_runs[-1]:.0f} msg/s (stored {stored['NEW']} NEW, "
                f"{stored['POSTPONED']} POSTPONED), without order {unordered_runs[-1]:.0f} msg/s;"
                f" release p50 {pct(lat, 0.5):.2f} ms p99 {pct(lat, 0.99):.2f} ms",
                flush=True,
            )
    finally:
        group.stop_all()
        r.close()

    ordered_per_s = statistics.median(ordered_runs)
    unordered_per_s = statistics.median(unordered_runs)
    figures = {
        "messages": n,
        "funnels": funnels,
        "per_funnel": args.per_funnel,
        "rounds": rounds,
        "ordered_per_s": round(ordered_per_s, 1),
        "unordered_per_s": round(unordered_per_s, 1),
        "ratio": round(ordered_per_s / unordered_per_s, 3),
        "release_p50_ms": round(pct(latencies, 0.5), 3),
        "release_p99_ms": round(pct(latencies, 0.99), 3),
        "order_violations": violations,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
