"""Ordered conversation delivery, against the sink's own rate and beside its peers in one run.

    python -m benchmarks.ordered_delivery [--quick] [--conversations N] [--rounds R]

Two worker processes (two Celery workers, one prefork child each) deliver a seeded workload of
conversations (1-5 requests of 1-4 responses, as in the tests) to a real HTTP sink that answers
200. The responses are registered first; the clock runs from the first POST the sink receives
to the last, and all-in CPU (workers, beat, Redis, PostgreSQL, this process with the sink)
from the first POST seen. Against it, in the same run:

- the sink's own POST rate from a tight loop on one connection: wrk (``conversations_vs_sink``
  is the deliveries/s over it), and orderly's outbound client from a Python loop;
- procrastinate (two workers, ``--concurrency 4``, polling every 50 ms: peers.LOCK_POLLING_S)
  POSTing the same responses from a task deferred with ``lock=<conversation id>``, its ordering
  feature: given each conversation's responses already in order (it cannot hold one that came
  early), at most PEER_CONVERSATIONS conversations (orderly is timed again on the same ones
  for ``vs_procrastinate_lock``);
- plain Celery no-op tasks/s (benchmarks/peers.py: tuned, two worker processes), timed the
  same way (full queue, first taken to last done).

Also measured: release latency (the sink's answer to a predecessor -> the POST of its
successor, and with 202 + ACK: the ACK sent -> the successor's POST), Redis commands and
PostgreSQL statements per delivered message, and order violations. The last line printed is
one JSON object with the figures."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from benchmarks.common import (
    pct,
    prepare,
    reset_messages,
    sink_arrivals,
    start_beat,
    start_workers,
    use_bench_services,
    wrk,
)

use_bench_services()  # before the app modules read their settings
# The whole workload is registered before the workers start, which takes longer than the
# seed's MESSAGE_TTL (10 s) at this size: a request with no response by then would stop
# holding its conversation, by design, and its late responses become callbacks that go
# last. A request's real wait for its bot is not what is measured here.
os.environ.setdefault("AURA_QUEUE_MANAGER_MESSAGE_TTL", "600000")

import redis  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402

from benchmarks import peers  # noqa: E402
from benchmarks.peer_apps import REDIS_URL as PEERS_REDIS  # noqa: E402
from orderly.worker.celery import DELIVER_QUEUE, enqueue_drain  # noqa: E402
from orderly.worker.channels import Channel, put_channel  # noqa: E402
from orderly.worker.runtime import get_runtime  # noqa: E402
from tooling.processes import Managed, ProcessGroup, wait_http  # noqa: E402
from tooling.sink import Sink  # noqa: E402
from tooling.workload import Workload, check, generate  # noqa: E402

ORIGIN = "bench"
WORKERS = 2
# procrastinate's fetch slows with the depth of its queue when jobs carry locks (4,000
# conversations, 30,000 jobs queued: 339 delivered in ten minutes): it is given at most this
# many conversations, which favours it.
PEER_CONVERSATIONS = 200


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


@dataclass
class Delivered:
    per_s: float
    cpu_ms: float  # all-in CPU per delivery (peers.Meter), from the first POST on
    arrivals: list[dict[str, Any]]


def timed(
    group: ProcessGroup,
    meter: peers.Meter,
    roots: list[Managed],
    sink: Sink,
    expected: int,
) -> Delivered:
    """The sink's arrivals, with what they cost from the first POST seen to the last: the
    workers' start-up is not counted, and neither are the deliveries seen with the first."""
    first: list[int] = []

    def started(seen: int) -> None:
        first.append(seen)
        meter.start([w.proc.pid for w in roots])

    arrivals = sink_arrivals(group, roots, sink, expected, started)
    cpu_then = meter.sample([w.proc.pid for w in roots])
    elapsed = arrivals[-1]["t_arrival"] - arrivals[0]["t_arrival"]
    cost = meter.stop(cpu_then, elapsed)
    counted = max(1, expected - first[0])
    return Delivered(expected / elapsed, cost.cpu_s * 1000 / counted, arrivals)


def deliver(
    group: ProcessGroup, meter: peers.Meter, sink: Sink, workload: Workload, tag: str
) -> Delivered:
    """Start the workers on the preloaded conversations; deliveries/s, first POST to last."""
    beat = start_beat(group, tag)
    workers = start_workers(group, tag, DELIVER_QUEUE, WORKERS)
    done = timed(group, meter, [*workers, beat], sink, workload.responses)
    for w in [*workers, beat]:
        group.stop(w)
    return done


def in_conversation_order(workload: Workload) -> list[tuple[str, str, str]]:
    """(conversation, request, response) as the responses arrive, but each one the next of
    its conversation in order: the peer is given them already ordered (it has no way to
    hold a response that came before its predecessor)."""
    due: dict[str, list[tuple[str, str]]] = {
        cid: [(rid, sid) for rid, sids in turns for sid in sids]
        for cid, turns in workload.turns.items()
    }
    return [
        (e.conversation_id, *due[e.conversation_id].pop(0))
        for e in workload.events
        if e.kind == "response"
    ]


def deliver_procrastinate(
    group: ProcessGroup, proc: peers.Procrastinate, sink: Sink, workload: Workload
) -> Delivered:
    """The same responses as procrastinate jobs POSTing to the sink, deferred one a call
    (a ``lock`` is set per job) with ``lock=<conversation id>`` before its workers start."""
    proc.reset()
    task = proc.tasks.deliver
    with proc.app.open():
        for cid, rid, sid in in_conversation_order(workload):
            body = {
                "conversation_id": cid,
                "request_id": rid,
                "response_id": sid,
                "payload": {"text": "hello"},
            }
            task.configure(lock=cid).defer(url=sink.url, body=body)
    workers = proc.start_workers()
    done = timed(group, proc.meter, workers, sink, workload.responses)
    for w in workers:
        group.stop(w)
    return done


def sink_floor(sink: Sink, seconds: float) -> tuple[float, float]:
    """The sink's own POST rate from a tight loop on one connection: wrk (a client that costs
    next to nothing), and orderly's outbound client (worker.core.http, what a delivery POSTs
    with) from a Python loop in this process, the sink's (so sharing its interpreter)."""
    requests, took, wrong = wrk(sink.url, "sink", 1, seconds)
    if wrong:
        raise RuntimeError(f"the sink answered {wrong} of wrk's POSTs with another status")
    http = get_runtime().http
    body = {"conversation_id": "loop", "request_id": "q", "payload": {"text": "hello"}}
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += 1
        reply = http.post_json(
            sink.url, body | {"response_id": f"r{n}"}, timeout_ms=5000, headers={}
        )
        if reply.status != 200:
            raise RuntimeError(f"the sink answered {reply.describe()}")
    python = n / (time.perf_counter() - t0)
    sink.reset()
    return requests / took, python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run of about 2 minutes")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    conversations = args.conversations or (200 if args.quick else 1000)
    rounds = args.rounds or (2 if args.quick else 3)

    runtime = get_runtime()
    r, group = prepare()
    peers.setup_peers_db()
    pg_admin = create_engine(peers.PEERS_URL.set(database="postgres"))
    meter = peers.Meter(r, pg_admin, [runtime.engine])
    peers_redis = redis.Redis.from_url(PEERS_REDIS)
    proc = peers.Procrastinate(group, peers_redis, peers.Meter(peers_redis, pg_admin, []))
    proc.meter.engines.append(proc.engine)
    proc.polling_s = peers.LOCK_POLLING_S
    mine: list[Delivered] = []
    theirs: list[Delivered] = []
    mine_same: list[Delivered] = []  # orderly on the peer's workload
    noop_rates: list[float] = []
    redis_per_msg: list[float] = []
    pg_per_msg: list[float] = []
    violations = peer_violations = 0
    with Sink() as sink:
        put_channel(runtime.engine, Channel(ORIGIN, sink.url, 100, 2.0, 3, 5000))
        try:
            wrk_per_s, python_per_s = sink_floor(sink, 3.0 if args.quick else 10.0)
            print(
                f"sink floor: {wrk_per_s:.0f} POSTs/s from wrk, {python_per_s:.0f}/s from "
                "orderly's client in a Python loop (one connection each)",
                flush=True,
            )
            for round_no in range(1, rounds + 1):
                reset_messages(r)
                sink.reset()
                workload = generate(seed=round_no, conversations=conversations)
                before = counters(r)
                preload(workload)
                done = deliver(group, meter, sink, workload, f"orderly{round_no}")
                after = counters(r)
                verdict = check(workload, done.arrivals)
                violations += verdict.order_violations + len(verdict.missing)
                if not verdict.ok:
                    print(f"order check: {verdict.violations[:3]} missing {verdict.missing[:3]}")
                mine.append(done)
                redis_per_msg.append((after[0] - before[0]) / workload.responses)
                pg_per_msg.append((after[1] - before[1]) / workload.responses)

                sink.reset()
                theirs_too = workload
                if conversations > PEER_CONVERSATIONS:
                    # orderly again on the peer's workload, for the ratio between them
                    theirs_too = generate(seed=round_no, conversations=PEER_CONVERSATIONS)
                    reset_messages(r)
                    preload(theirs_too)
                    same = deliver(group, meter, sink, theirs_too, f"same{round_no}")
                    verdict = check(theirs_too, same.arrivals)
                    violations += verdict.order_violations + len(verdict.missing)
                    sink.reset()
                else:
                    same = done
                mine_same.append(same)
                peer = deliver_procrastinate(group, proc, sink, theirs_too)
                verdict = check(theirs_too, peer.arrivals)
                peer_violations += verdict.order_violations + len(verdict.missing)
                theirs.append(peer)

                reset_messages(r)
                n = workload.responses
                noop_rates.append(peers.plain_celery_rate(group, n))
                print(
                    f"round {round_no}: {n} responses in {conversations} conversations: "
                    f"{done.per_s:.0f} deliveries/s at {done.cpu_ms:.2f} ms CPU each; "
                    f"procrastinate lock= {peer.per_s:.0f}/s at {peer.cpu_ms:.2f} ms "
                    f"({theirs_too.responses} responses); "
                    f"plain Celery no-op {noop_rates[-1]:.0f} tasks/s (2 worker processes); "
                    f"{redis_per_msg[-1]:.1f} Redis commands and {pg_per_msg[-1]:.2f} "
                    "PostgreSQL statements per delivery",
                    flush=True,
                )
            async_release = measure_async_release(group, meter, sink)
        finally:
            group.stop_all()
            r.close()

    deliveries_per_s = statistics.median(d.per_s for d in mine)
    peer_per_s = statistics.median(d.per_s for d in theirs)
    same_per_s = statistics.median(d.per_s for d in mine_same)
    noop_per_s = statistics.median(noop_rates)
    releases = [ms for d in mine for ms in release_ms(d.arrivals, "t_responded")]
    peer_releases = [ms for d in theirs for ms in release_ms(d.arrivals, "t_responded")]
    figures = {
        "conversations": conversations,
        "rounds": rounds,
        "deliveries_per_s": round(deliveries_per_s, 1),
        "cpu_ms_per_delivery": round(statistics.median(d.cpu_ms for d in mine), 3),
        "sink_wrk_per_s": round(wrk_per_s, 1),
        "sink_python_per_s": round(python_per_s, 1),
        "conversations_vs_sink": round(deliveries_per_s / wrk_per_s, 3),
        "procrastinate_conversations": min(conversations, PEER_CONVERSATIONS),
        "procrastinate_lock_per_s": round(peer_per_s, 1),
        "procrastinate_cpu_ms_per_delivery": round(statistics.median(d.cpu_ms for d in theirs), 3),
        "procrastinate_release_p50_ms": round(pct(peer_releases, 0.50), 2),
        "procrastinate_release_p99_ms": round(pct(peer_releases, 0.99), 2),
        "procrastinate_order_violations": peer_violations,
        "same_workload_per_s": round(same_per_s, 1),
        "vs_procrastinate_lock": round(same_per_s / peer_per_s, 3),
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
        f"medians: {deliveries_per_s:.0f} deliveries/s "
        f"({figures['conversations_vs_sink']} of the sink's {wrk_per_s:.0f} POSTs/s), "
        f"procrastinate lock= {peer_per_s:.0f}/s, plain Celery no-op {noop_per_s:.0f}/s; "
        f"release p50 {figures['release_p50_ms']} ms, p99 {figures['release_p99_ms']} ms "
        f"(after an ACK: p50 {figures['release_ack_p50_ms']} ms, "
        f"p99 {figures['release_ack_p99_ms']} ms)",
        flush=True,
    )
    print(json.dumps(figures))


def measure_async_release(group: ProcessGroup, meter: peers.Meter, sink: Sink) -> list[float]:
    """Every delivery answered 202 and ACKed through the API at once: ACK -> next POST.

    Four conversations of twenty responses, one API process: the figure is the release
    itself (API, Redis, broker, worker), not the backlog of a saturated API.
    """
    reset_messages(meter.r)
    sink.reset()
    port = 18900
    api = group.start_api(port, name="bench-api", extra_env={"ORDERLY_NODE_CODE": "bench-api"})
    wait_http(f"http://127.0.0.1:{port}/health", api)
    sink.configure(p_async=1.0, ack_delay_ms=[0, 0], orderly_url=f"http://127.0.0.1:{port}")
    workload = generate(seed=99, conversations=4, requests=(5, 5), responses=(4, 4))
    preload(workload)
    deliver(group, meter, sink, workload, "ack")
    # Wait for the ACK of the last one, so the figures are complete.
    time.sleep(0.5)
    arrivals = sink.arrivals()
    sink.configure()
    group.stop(api)
    return release_ms(arrivals, "t_ack")


if __name__ == "__main__":
    main()
