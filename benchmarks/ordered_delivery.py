"""Ordered conversation delivery, beside plain Celery in the same run.

    python -m benchmarks.ordered_delivery [--quick] [--conversations N] [--rounds R]

Two worker processes (two Celery workers, one prefork child each) deliver a seeded workload of
conversations (1-5 requests of 1-4 responses, as in the tests) to a real HTTP sink that answers
200. The responses are registered first; the clock runs from the first POST the sink receives
to the last. The baseline is plain Celery no-op tasks/s (benchmarks/peers.py: tuned, two worker
processes) on the same Redis, timed the same way (full queue, first taken to last done); rounds
alternate the two. Also measured: release latency (the sink's answer to a predecessor -> the
POST of its successor, and with 202 + ACK: the ACK sent -> the successor's POST), Redis
commands and PostgreSQL statements per delivered message, and order violations. The last line
printed is one JSON object with the figures."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Iterable, Mapping
from typing import Any

from benchmarks.common import (
    pct,
    prepare,
    reset_messages,
    sink_arrivals,
    start_beat,
    start_workers,
    use_bench_services,
)

use_bench_services()  # before the app modules read their settings
# The whole workload is registered before the workers start, which takes longer than the
# seed's MESSAGE_TTL (10 s) at this size: a request with no response by then would stop
# holding its conversation, by design, and its late responses become callbacks that go
# last. A request's real wait for its bot is not what is measured here.
os.environ.setdefault("AURA_QUEUE_MANAGER_MESSAGE_TTL", "600000")

import redis  # noqa: E402
from sqlalchemy import text  # noqa: E402

from benchmarks import peers  # noqa: E402
from orderly.worker.celery import DELIVER_QUEUE, enqueue_drain  # noqa: E402
from orderly.worker.channels import Channel, put_channel  # noqa: E402
from orderly.worker.runtime import get_runtime  # noqa: E402
from tooling.processes import ProcessGroup, wait_http  # noqa: E402
from tooling.sink import Sink  # noqa: E402
from tooling.workload import Workload, check, generate  # noqa: E402

ORIGIN = "bench"
WORKERS = 2


def preload(workload: Workload) -> None:
    """Register every request and response through the Python API (drains are enqueued)."""
    conv = get_runtime().conversations
    for event in workload.events:
        if event.kind == "request":
            conv.register_request(
                event.conversation_id, {"request_id": event.request_id, "origin": ORIGIN}
            )
        else:
            conv.add_response(
                event.conversation_id,
                {
                    "request_id": event.request_id,
                    "response_id": event.response_id,
                    "payload": {"text": "hello"},
                    "last": event.last,
                },
                enqueue_drain,
            )


def counters(r: redis.Redis) -> tuple[int, int]:
    """Redis commands processed by the server, finished transactions of the bench database."""
    commands = int(r.info("stats")["total_commands_processed"])
    # A backend reports its statistics when it exits or, idle, about once a second: close
    # ours and wait, so that every statement so far is counted.
    engine = get_runtime().engine
    engine.dispose()
    time.sleep(1.2)
    with engine.connect() as conn:
        xacts = conn.execute(
            text(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database "
                "WHERE datname = current_database()"
            )
        ).scalar_one()
    return commands, int(xacts)


def release_ms(arrivals: Iterable[Mapping[str, Any]], after: str) -> list[float]:
    """Per conversation, the successor's POST minus the moment its predecessor was done.

    ``after`` is ``t_responded`` (the sink answered 200) or ``t_ack`` (the sink sent the ACK).
    """
    last: dict[str, Mapping[str, Any]] = {}
    out = []
    for a in sorted(arrivals, key=lambda a: float(a["t_arrival"])):
        if a["status"] not in (200, 202):
            continue
        pred = last.get(a["conversation_id"])
        if pred is not None and pred.get(after) is not None:
            out.append((float(a["t_arrival"]) - float(pred[after])) * 1000)
        last[a["conversation_id"]] = a
    return out


def deliver(
    group: ProcessGroup, r: redis.Redis, sink: Sink, workload: Workload, tag: str
) -> tuple[float, list[dict[str, Any]]]:
    """Start the workers on the preloaded conversations; deliveries/s, first POST to last."""
    beat = start_beat(group, tag)
    workers = start_workers(group, tag, DELIVER_QUEUE, WORKERS)
    arrivals = sink_arrivals(group, workers, sink, workload.responses)
    for w in [*workers, beat]:
        group.stop(w)
    elapsed = arrivals[-1]["t_arrival"] - arrivals[0]["t_arrival"]
    return workload.responses / elapsed, arrivals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run under 60 s")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    conversations = args.conversations or (200 if args.quick else 1000)
    rounds = args.rounds or (2 if args.quick else 3)

    runtime = get_runtime()
    r, group = prepare()
    rates: list[float] = []
    noop_rates: list[float] = []
    releases: list[float] = []
    redis_per_msg: list[float] = []
    pg_per_msg: list[float] = []
    violations = 0
    with Sink() as sink:
        put_channel(runtime.engine, Channel(ORIGIN, sink.url, 100, 2.0, 3, 5000))
        try:
            for round_no in range(1, rounds + 1):
                reset_messages(r)
                sink.reset()
                workload = generate(seed=round_no, conversations=conversations)
                before = counters(r)
                preload(workload)
                rate, arrivals = deliver(group, r, sink, workload, f"orderly{round_no}")
                after = counters(r)
                verdict = check(workload, arrivals)
                violations += verdict.order_violations + len(verdict.missing)
                if not verdict.ok:
                    print(f"order check: {verdict.violations[:3]} missing {verdict.missing[:3]}")
                rates.append(rate)
                releases += release_ms(arrivals, "t_responded")
                redis_per_msg.append((after[0] - before[0]) / workload.responses)
                pg_per_msg.append((after[1] - before[1]) / workload.responses)

                reset_messages(r)
                n = workload.responses
                noop_rates.append(peers.plain_celery_rate(group, n))
                print(
                    f"round {round_no}: {n} responses in {conversations} conversations: "
                    f"{rate:.0f} deliveries/s; plain Celery no-op {noop_rates[-1]:.0f} tasks/s "
                    f"(2 worker processes); {redis_per_msg[-1]:.1f} Redis commands "
                    f"and {pg_per_msg[-1]:.2f} PostgreSQL statements per delivery",
                    flush=True,
                )
            async_release = measure_async_release(group, r, sink)
        finally:
            group.stop_all()
            r.close()

    deliveries_per_s = statistics.median(rates)
    noop_per_s = statistics.median(noop_rates)
    figures = {
        "conversations": conversations,
        "rounds": rounds,
        "deliveries_per_s": round(deliveries_per_s, 1),
        "celery_noop_per_s": round(noop_per_s, 1),
        "ratio": round(deliveries_per_s / noop_per_s, 3),
        "release_p50_ms": round(pct(releases, 0.50), 2),
        "release_p99_ms": round(pct(releases, 0.99), 2),
        "release_ack_p50_ms": round(pct(async_release, 0.50), 2),
        "release_ack_p99_ms": round(pct(async_release, 0.99), 2),
        "redis_cmds_per_msg": round(statistics.median(redis_per_msg), 2),
        "pg_stmts_per_msg": round(statistics.median(pg_per_msg), 2),
        "order_violations": violations,
    }
    print(
        f"medians: {deliveries_per_s:.0f} deliveries/s vs plain Celery {noop_per_s:.0f}/s; "
        f"release p50 {figures['release_p50_ms']} ms, p99 {figures['release_p99_ms']} ms "
        f"(after an ACK: p50 {figures['release_ack_p50_ms']} ms, "
        f"p99 {figures['release_ack_p99_ms']} ms)",
        flush=True,
    )
    print(json.dumps(figures))


def measure_async_release(group: ProcessGroup, r: redis.Redis, sink: Sink) -> list[float]:
    """Every delivery answered 202 and ACKed through the API at once: ACK -> next POST.

    Four conversations of twenty responses, one API process: the figure is the release
    itself (API, Redis, broker, worker), not the backlog of a saturated API.
    """
    reset_messages(r)
    sink.reset()
    port = 18900
    api = group.start_api(port, name="bench-api", extra_env={"ORDERLY_NODE_CODE": "bench-api"})
    wait_http(f"http://127.0.0.1:{port}/health", api)
    sink.configure(p_async=1.0, ack_delay_ms=[0, 0], orderly_url=f"http://127.0.0.1:{port}")
    workload = generate(seed=99, conversations=4, requests=(5, 5), responses=(4, 4))
    preload(workload)
    _, arrivals = deliver(group, r, sink, workload, "ack")
    # Wait for the ACK of the last one, so the figures are complete.
    time.sleep(0.5)
    arrivals = sink.arrivals()
    sink.configure()
    group.stop(api)
    return release_ms(arrivals, "t_ack")


if __name__ == "__main__":
    main()
