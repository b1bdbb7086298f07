"""Light load: how soon a task starts at a steady, modest rate, and what a system costs at rest,
orderly beside its peers in one run.

    ./run.sh bench light_load [--quick] [--rate R] [--seconds S] [--idle S]

Each system runs two worker processes, as benchmarks/peers.py starts them (Celery, dramatiq
with 8 threads a process, procrastinate, orderly). After a few warm-up tasks, the workers are
left alone for ``--idle`` seconds: the CPU of the workers, PostgreSQL and Redis meanwhile is
``idle_cpu_pct`` (of one core; orderly's beat, which production runs beside its workers, is
not started here: not counted). Then the producer (this process) sends one task a call at a
steady ``--rate`` a second for ``--seconds``, each send at its time on the clock (not a sleep
after the previous one), the send time in the task's arguments; each task, first thing, records
how long after its send it started (one RPUSH, orderly's ``bench.latency`` handler alike).
Figures per system: start latency p50 and p99 (ms) and all-in CPU per task (the workers, the
servers, the producer). ``ordered``: the same with each task under one of 50 ordering keys,
orderly's guaranteed order (``funnel_value``) beside procrastinate's ``lock=``, with the order
of every key checked. Run it on an idle machine. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from benchmarks.common import prepare, use_bench_services
from benchmarks.peer_apps import LATENCY_KEY, ORDER_KEY, REDIS_URL

use_bench_services()  # before the app modules read their settings

import redis  # noqa: E402
from sqlalchemy import create_engine  # noqa: E402

from benchmarks.peers import (  # noqa: E402
    PEERS_URL,
    Dramatiq,
    Meter,
    Orderly,
    PlainCelery,
    Procrastinate,
    System,
    _roots,
    order_violations_procrastinate,
    setup_peers_db,
)
from orderly.worker.runtime import get_runtime  # noqa: E402

KEYS = 50
WARM = 3
Send = Callable[[int, float], None]


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value at least ``q`` of them are not above."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _recorded(r: redis.Redis, want: int, system: System, workers: list[Any]) -> None:
    """Until ``want`` tasks have recorded their start."""
    deadline = time.monotonic() + 300
    while r.llen(LATENCY_KEY) < want:
        if time.monotonic() > deadline or not all(w.alive() for w in workers):
            raise RuntimeError(f"{system.name}: tasks not started; see {system.group.log_dir}")
        time.sleep(0.01)


def _forget(r: redis.Redis) -> None:
    """The latencies and order records so far (the brokers' own keys in the same database are
    left alone)."""
    r.delete(LATENCY_KEY, *r.scan_iter(f"{ORDER_KEY}*"))


def _warm(r: redis.Redis, send: Send, system: System, workers: list[Any], first: int) -> None:
    """A few tasks through (numbered ``first`` down, below the measured ones), then
    forgotten: connections made, workers running."""
    for i in range(WARM):
        send(first - i, time.time())
    _recorded(r, WARM, system, workers)
    _forget(r)


def measure(
    system: System, send: Send, r: redis.Redis, n: int, rate: float, idle_s: float
) -> dict[str, float]:
    system.reset()
    _forget(r)
    workers = system.start_workers()
    roots = _roots(workers)
    try:
        _warm(r, send, system, workers, -1)
        meter = system.meter
        meter.start(roots)
        time.sleep(idle_s)
        idle = meter.stop(meter.sample(roots), idle_s)
        _warm(r, send, system, workers, -1 - WARM)  # the meter closed the producer's pools
        meter.start(roots)
        start = time.perf_counter()
        for i in range(n):
            ahead = start + i / rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
            send(i, time.time())
        _recorded(r, n, system, workers)
        seconds = time.perf_counter() - start
        busy = meter.stop(meter.sample(roots), seconds)
    finally:
        for w in workers:
            system.group.stop(w)
    latencies = [float(v) for v in r.lrange(LATENCY_KEY, 0, -1)]
    return {
        "p50_ms": round(percentile(latencies, 0.5), 2),
        "p99_ms": round(percentile(latencies, 0.99), 2),
        "cpu_ms_per_msg": round(busy.cpu_s * 1000 / n, 3),
        "idle_cpu_pct": round(100 * idle.cpu_s / idle_s, 2),
    }


def _orderly_send(system: Orderly, *, ordered: bool) -> Send:
    run = uuid.uuid4().hex[:6]

    def send(i: int, sent_at: float) -> None:
        key = f"k{i % KEYS}" if i >= 0 else "warm"
        payload: dict[str, Any] = {"sent_at": sent_at}
        message: dict[str, Any] = {
            "service": "bench",
            "operation": "latency",
            "correlation_id": f"{run}-{i}",
            "source_system": "bench",
            "msg_timestamp": datetime.now(UTC).isoformat(),
        }
        if ordered:
            payload |= {"key": key, "n": i}
            message |= {"funnel_value": f"bench:{key}", "guaranteed_order": True}
        system.intake.submit({**message, "payload": payload})

    return send


def _procrastinate_send(system: Procrastinate, *, ordered: bool) -> Send:
    from benchmarks.peer_apps import procrastinate_app

    def send(i: int, sent_at: float) -> None:
        if not ordered:
            procrastinate_app.stamp.defer(sent_at=sent_at)
            return
        key = f"k{i % KEYS}" if i >= 0 else "warm"
        task = procrastinate_app.stamp_ordered.configure(lock=key)
        task.defer(key=key, n=i, sent_at=sent_at)

    return send


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 s of load and 3 s idle each")
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--idle", type=float, default=None)
    args = parser.parse_args()
    seconds = args.seconds or (5.0 if args.quick else 20.0)
    idle_s = args.idle or (3.0 if args.quick else 10.0)
    n = max(KEYS, round(args.rate * seconds) // KEYS * KEYS)  # whole rounds of the keys

    from benchmarks.peer_apps import celery_app, dramatiq_app

    orderly_redis, group = prepare()
    setup_peers_db()
    r = redis.Redis.from_url(REDIS_URL)
    pg_admin = create_engine(PEERS_URL.set(database="postgres"))
    runtime = get_runtime()
    peers_meter = Meter(r, pg_admin, [])
    orderly = Orderly(group, orderly_redis, Meter(orderly_redis, pg_admin, [runtime.engine]))
    procrastinate = Procrastinate(group, r, peers_meter)
    peers_meter.engines.append(procrastinate.engine)
    runs: list[tuple[str, System, Send]] = [
        ("celery", PlainCelery(group, r, peers_meter), lambda i, t: celery_app.send_stamp(t)),
        ("dramatiq", Dramatiq(group, r, peers_meter), lambda i, t: dramatiq_app.send_stamp(t)),
        ("procrastinate", procrastinate, _procrastinate_send(procrastinate, ordered=False)),
        ("orderly", orderly, _orderly_send(orderly, ordered=False)),
        ("procrastinate_lock", procrastinate, _procrastinate_send(procrastinate, ordered=True)),
        ("orderly_ordered", orderly, _orderly_send(orderly, ordered=True)),
    ]
    out: dict[str, Any] = {"rate": args.rate, "messages": n, "idle_s": idle_s}
    try:
        for name, system, send in runs:
            with procrastinate.app.open() if system is procrastinate else contextlib.nullcontext():
                out[name] = measure(system, send, r, n, args.rate, idle_s)
            if name in ("procrastinate_lock", "orderly_ordered"):
                out[name]["order_violations"] = order_violations_procrastinate(r, KEYS, n // KEYS)
            print(f"{name:20} {out[name]}", flush=True)
    finally:
        group.stop_all()
        pg_admin.dispose()
    celery, dramatiq = out["celery"], out["dramatiq"]
    out["targets"] = {
        kind: {
            "p50_le_celery": out[kind]["p50_ms"] <= celery["p50_ms"],
            "p99_le_dramatiq": out[kind]["p99_ms"] <= dramatiq["p99_ms"],
        }
        for kind in ("orderly", "orderly_ordered")
    }
    # The worse of plain and ordered: at most 1 meets the target.
    out["paced_p50_vs_celery"] = max(
        round(out[kind]["p50_ms"] / celery["p50_ms"], 3) for kind in ("orderly", "orderly_ordered")
    )
    out["paced_p99_vs_dramatiq"] = max(
        round(out[kind]["p99_ms"] / dramatiq["p99_ms"], 3)
        for kind in ("orderly", "orderly_ordered")
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
