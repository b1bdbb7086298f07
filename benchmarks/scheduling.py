"""Scheduling in the message store: lateness and memory of many scheduled messages, funnels
taking turns, per-funnel limits, retry gaps against their formula, aborts.

    python -m benchmarks.scheduling [--quick] [--messages N] [--window-s S] [--only PHASES]

1. Scheduled: N messages (100,000; --quick 5,000) due at random instants over a window (600 s;
   --quick 40 s) are submitted in batches of 1,000 with ``not_before``; two workers and beat
   run. Lateness is each handler's start (wall clock) less its message's due instant; RSS is
   the workers' (with their pool children) and beat's, after start-up and once all ran.
2. Fairness: 3 funnels x 1,000 messages (--quick 300), queued one funnel after the other,
   then one worker with one slot (one prefork child) runs them: the longest run of one funnel
   while the others still wait.
3. Limits: funnels whose component allows 1, 2 and 5 messages at once (funnel_limit), 40
   messages each of a handler that holds 50 ms, run by 2 workers of 4 slots: the most seen
   running at once per funnel (from the handlers' start and end times).
4. Retry gaps: 20 messages (--quick 10) of a handler that always fails, with
   ``Retry(delay_s=0.5, multiplier=2, attempts=4)``: each gap between a try's end and the next
   try's start against ``delay * multiplier^attempt``.
5. Abort: 20 running handlers (--quick 10; half look at ``ctx.aborted``, half ignore it) are
   cancelled; the time from the cancel to the handler's end.

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from benchmarks.common import (
    pct,
    prepare,
    reset_messages,
    start_beat,
    use_bench_services,
    worker_argv,
)

use_bench_services()  # before the app modules read their settings
os.environ["ORDERLY_HANDLER_MODULES"] = "tooling.handlers,benchmarks.scheduling_handlers"

import redis  # noqa: E402
from sqlalchemy import text  # noqa: E402

from benchmarks.scheduling_handlers import ABORTED, RETRY, SERVICE, TRIES  # noqa: E402
from orderly.worker.celery import (  # noqa: E402
    PROCESS_QUEUE,
    enqueue_processing,
    wake_processing,
)
from orderly.worker.messages import operations  # noqa: E402
from orderly.worker.runtime import get_runtime  # noqa: E402
from tooling.processes import Managed, ProcessGroup  # noqa: E402

BASE_TS = datetime(2026, 1, 1, tzinfo=UTC)


def rss_mb(procs: list[Managed]) -> float:
    """Resident memory of processes and their children, in MiB."""
    pids = []
    for p in procs:
        pids.append(p.proc.pid)
        children = Path(f"/proc/{p.proc.pid}/task/{p.proc.pid}/children")
        if children.exists():
            pids += [int(c) for c in children.read_text().split()]
    total_kb = 0
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except FileNotFoundError:
            continue
        total_kb += sum(int(line.split()[1]) for line in lines if line.startswith("VmRSS:"))
    return total_kb / 1024


def start_workers(group: ProcessGroup, tag: str, count: int, slots: int) -> list[Managed]:
    workers = [
        group.start(
            f"{tag}-w{i}",
            worker_argv(f"{tag}{i}", PROCESS_QUEUE, "prefork", slots),
            {"ORDERLY_NODE_CODE": f"bench-{tag}{i}"},
        )
        for i in range(count)
    ]
    deadline = time.monotonic() + 90
    for w in workers:
        children = Path(f"/proc/{w.proc.pid}/task/{w.proc.pid}/children")
        while not (children.exists() and len(children.read_text().split()) >= slots):
            if time.monotonic() > deadline or not w.alive():
                raise RuntimeError(f"{w.name} did not start; see {w.log_path}")
            time.sleep(0.1)
    time.sleep(2.0)  # settled: the pool children have imported everything
    return workers


def message(n: int, operation: str, **fields: Any) -> dict[str, Any]:
    return {
        "service": SERVICE,
        "operation": operation,
        "correlation_id": f"s-{n}",
        "source_system": "bench",
        "msg_timestamp": (BASE_TS + timedelta(milliseconds=n)).isoformat(),
        "payload": "{}",
        **fields,
    }


def submit(items: list[dict[str, Any]]) -> list[int]:
    intake = get_runtime().intake(enqueue_processing, wake_processing)
    ids: list[int] = []
    for start in range(0, len(items), 1000):
        ids += [r.msg_id for r in intake.submit_many(items[start : start + 1000])]
    return ids


def tries(r: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(x) for x in r.lrange(TRIES, 0, -1)]


def wait_for(what: str, done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not done after {timeout_s:.0f} s")
        time.sleep(0.2)


def ok_count(ids: list[int]) -> int:
    with get_runtime().engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM message WHERE msg_id = ANY(:i) AND state = 'OK'"),
                {"i": ids},
            ).scalar_one()
        )


def scheduled(r: redis.Redis, group: ProcessGroup, n: int, window_s: float) -> dict[str, Any]:
    beat = start_beat(group, "sched")
    workers = start_workers(group, "sched", 2, 1)
    before = rss_mb(workers) + rss_mb([beat])
    lead_s = 5.0 + n / 5000  # submitting takes a while: nothing is due before it is done
    t0 = datetime.now(UTC) + timedelta(seconds=lead_s)
    rng = random.Random(7)
    due = [t0 + timedelta(seconds=rng.random() * window_s) for _ in range(n)]
    ids = submit([message(k, "noop", not_before=due[k].isoformat()) for k in range(n)])
    due_ms = {msg_id: due[k].timestamp() * 1000 for k, msg_id in enumerate(ids)}
    peak = before
    deadline = time.monotonic() + lead_s + window_s + 120
    while r.llen(TRIES) < n and time.monotonic() < deadline:
        peak = max(peak, rss_mb(workers) + rss_mb([beat]))
        time.sleep(1.0)
    after = rss_mb(workers) + rss_mb([beat])
    ran = tries(r)
    late_s = [(t["start"] - due_ms[t["msg"]]) / 1000 for t in ran if t["msg"] in due_ms]
    early = sum(1 for x in late_s if x < -0.05)
    for p in [*workers, beat]:
        group.stop(p)
    print(
        f"scheduled: {len(ran)} of {n} ran; lateness p50 {pct(late_s, 0.5):.3f} s, p99 "
        f"{pct(late_s, 0.99):.3f} s, max {max(late_s):.3f} s, {early} early; RSS "
        f"{before:.1f} -> {after:.1f} MiB (peak {peak:.1f})",
        flush=True,
    )
    return {
        "scheduled": n,
        "ran": len(ran),
        "late_p50_s": round(pct(late_s, 0.5), 3),
        "late_p99_s": round(pct(late_s, 0.99), 3),
        "late_max_s": round(max(late_s), 3),
        "early": early,
        "rss_mb_before": round(before, 1),
        "rss_mb_after": round(after, 1),
        "rss_growth_mb": round(after - before, 1),
        "rss_peak_growth_mb": round(peak - before, 1),
    }


def fairness(r: redis.Redis, group: ProcessGroup, per_key: int) -> dict[str, Any]:
    keys = "ABC"
    items = [
        message(k * per_key + i, "noop", funnel_value=f"fair-{key}")
        for k, key in enumerate(keys)
        for i in range(per_key)
    ]
    ids = submit(items)
    beat = start_beat(group, "fair")
    workers = start_workers(group, "fair", 1, 1)
    wait_for("fairness run", lambda: r.llen(TRIES) >= len(ids), 300)
    for p in [*workers, beat]:
        group.stop(p)
    order = [t["key"][-1] for t in sorted(tries(r), key=lambda t: t["start"])]
    # runs of one funnel while every funnel still had messages waiting
    left = dict.fromkeys(keys, per_key)
    longest, run, previous = 0, 0, ""
    for key in order:
        if min(left.values()) == 0:
            break
        run = run + 1 if key == previous else 1
        previous = key
        longest = max(longest, run)
        left[key] -= 1
    seq = "".join(order)
    at = next((i for i in range(len(seq) - longest + 1) if len(set(seq[i : i + longest])) == 1), 0)
    print(
        f"fairness: first 12 {seq[:12]}; longest run {longest} at {at}: "
        f"{seq[max(0, at - 9) : at + longest + 9]}",
        flush=True,
    )
    return {"longest_run": longest, "fair_messages": len(order)}


def limits(r: redis.Redis, group: ProcessGroup, per_key: int) -> dict[str, Any]:
    allowed = {"n1": 1, "n2": 2, "n5": 5}
    with get_runtime().engine.begin() as conn:
        conn.execute(text("DELETE FROM funnel_limit"))
        for component, n in allowed.items():
            conn.execute(
                text("INSERT INTO funnel_limit (component_id, max_in_flight) VALUES (:c, :n)"),
                {"c": component, "n": n},
            )
    items = [
        message(
            10_000 * (k + 1) + i,
            "hold",
            funnel_value=f"lim-{component}",
            funnel_component_id=component,
        )
        for k, component in enumerate(allowed)
        for i in range(per_key)
    ]
    beat = start_beat(group, "lim")
    workers = start_workers(group, "lim", 2, 4)
    ids = submit(items)
    wait_for("limits run", lambda: ok_count(ids) >= len(ids), 300)
    for p in [*workers, beat]:
        group.stop(p)
    seen: dict[str, int] = {}
    for component in allowed:
        spans = [t for t in tries(r) if t["key"] == f"lim-{component}"]
        edges = sorted([(t["start"], 1) for t in spans] + [(t["end"], -1) for t in spans])
        running = most = 0
        for _, step in edges:
            running += step
            most = max(most, running)
        seen[str(allowed[component])] = most
    print(f"limits: allowed -> most seen at once {seen}", flush=True)
    return {
        "max_in_flight_seen": seen,
        "limits_respected": all(seen[str(n)] <= n for n in allowed.values()),
    }


def retry_gaps(r: redis.Redis, group: ProcessGroup, count: int) -> dict[str, Any]:
    beat = start_beat(group, "retry")
    workers = start_workers(group, "retry", 2, 1)
    ids = submit([message(50_000 + i, "fail") for i in range(count)])
    expected_tries = count * (RETRY.attempts or 0) + count
    wait_for("retry run", lambda: r.llen(TRIES) >= expected_tries, 300)
    for p in [*workers, beat]:
        group.stop(p)
    by_msg: dict[int, list[dict[str, Any]]] = {}
    for t in tries(r):
        by_msg.setdefault(t["msg"], []).append(t)
    errors: list[float] = []
    by_attempt: dict[int, list[float]] = {}
    for runs in by_msg.values():
        runs.sort(key=lambda t: t["try"])
        for before, after in itertools.pairwise(runs):
            attempt = after["try"]  # failed tries so far: this is retry number ``attempt``
            formula = 500 * 2.0**attempt
            errors.append(after["start"] - before["end"] - formula)
            by_attempt.setdefault(attempt, []).append(errors[-1])
    late = max(errors)
    worst = {n: round(max(e)) for n, e in sorted(by_attempt.items())}
    print(f"retry gaps: the most late by retry number (ms): {worst}", flush=True)
    print(
        f"retry gaps: {len(errors)} gaps of {len(ids)} messages; gap - formula: min "
        f"{min(errors):.0f} ms, p50 {pct(errors, 0.5):.0f} ms, max {late:.0f} ms",
        flush=True,
    )
    return {
        "retry_gaps": len(errors),
        "retry_gap_error_ms_max": round(max(abs(e) for e in errors), 1),
        "retry_gap_error_ms_p50": round(pct(errors, 0.5), 1),
    }


def _exists(r: redis.Redis, key: str) -> Callable[[], bool]:
    return lambda: bool(r.exists(key))


def _longer(r: redis.Redis, key: str, than: int) -> Callable[[], bool]:
    return lambda: int(r.llen(key)) > than


def aborts(r: redis.Redis, group: ProcessGroup, count: int) -> dict[str, Any]:
    runtime = get_runtime()
    beat = start_beat(group, "abort")
    workers = start_workers(group, "abort", 2, 4)
    took: list[float] = []
    for i in range(count):
        (msg_id,) = submit([message(60_000 + i, "long")])
        wait_for("a long handler's start", _exists(r, f"bench:sched:started:{msg_id}"), 60)
        cancelled_at = time.time() * 1000
        operations.cancel(
            runtime.engine,
            msg_id,
            {"note": "benchmark"},
            lambda _id: None,
            announce=runtime.announce_aborts,
        )
        wait_for("the aborted handler's end", _longer(r, ABORTED, i), 60)
        end = json.loads(r.lindex(ABORTED, i) or b"{}")
        took.append((end["end"] - cancelled_at) / 1000)
    for p in [*workers, beat]:
        group.stop(p)
    hows = [json.loads(x)["how"] for x in r.lrange(ABORTED, 0, -1)]
    print(
        f"abort: {count} cancels; cancel -> handler end p50 {pct(took, 0.5):.3f} s, p99 "
        f"{pct(took, 0.99):.3f} s ({hows.count('returned')} returned, "
        f"{hows.count('stopped')} stopped)",
        flush=True,
    )
    return {"abort_p50_s": round(pct(took, 0.5), 3), "abort_p99_s": round(pct(took, 0.99), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run of a few minutes")
    parser.add_argument("--messages", type=int, default=None)
    parser.add_argument("--window-s", type=float, default=None)
    parser.add_argument(
        "--only", default="", help="comma-separated phases: scheduled,fairness,limits,retries,abort"
    )
    args = parser.parse_args()
    n = args.messages or (5_000 if args.quick else 100_000)
    window_s = args.window_s or (40.0 if args.quick else 600.0)
    r, group = prepare()
    figures: dict[str, Any] = {}
    try:
        phases: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("scheduled", lambda: scheduled(r, group, n, window_s)),
            ("fairness", lambda: fairness(r, group, 300 if args.quick else 1000)),
            ("limits", lambda: limits(r, group, 40)),
            ("retries", lambda: retry_gaps(r, group, 10 if args.quick else 20)),
            ("abort", lambda: aborts(r, group, 10 if args.quick else 20)),
        ]
        wanted = set(args.only.split(",")) if args.only else {name for name, _ in phases}
        for name, phase in phases:
            if name not in wanted:
                continue
            reset_messages(r)
            figures.update(phase())
    finally:
        group.stop_all()
        reset_messages(r)
        r.close()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
