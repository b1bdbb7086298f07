"""Outbound delivery: signing cost, per-endpoint pacing, a down endpoint's circuit, long-poll PULL.

    python -m benchmarks.outbound [--quick]      (./run.sh bench outbound [--quick])

Every part runs the product's own due index and claim (worker.pubsub.due_deliveries,
deliver_batch) in this process, on the bench database and Redis, against a local HTTP
receiver (a threading http.server answering at once):

- ``signing_us``: CPU microseconds of one Standard Webhooks signature (headers for a 1 KB
  body, one secret); and pushes/s of a fan-out of N events to 4 PUSH subscriptions, delivered
  with signing and without it (same run, alternated), ``fanout_signed_per_s`` /
  ``fanout_unsigned_per_s``.
- ``pacing_error_pct``: one endpoint limited to R = 20 sends/s (its default burst, R) beside
  one without a limit, both with a backlog, driven for D s (30; 5 with --quick): the paced
  endpoint's received rate over the window against R, in percent (positive: over it).
- ``down_endpoint_requests_per_interval``: an endpoint that answers 503 for D s (300; 20
  with --quick) with 50 events waiting, a constant backoff interval of 1 s (delay 1000 ms,
  multiplier 1.01, probes at most 1 s apart): requests it received after its circuit opened
  per elapsed interval (1.0 is one probe per interval; without the circuit it would get every
  due retry of 50 events). Beside it a subscription ordered by one key is down too; then both
  come back, and ``down_backlog_drained_in_order`` says whether the ordered one's backlog
  arrived in publish order.
- ``longpoll_p50_ms`` / ``longpoll_p99_ms``: 100 consumers wait on ``GET …/messages?wait_ms=``
  (uvicorn, one process, in this process) on 100 PULL subscriptions; events are published one
  at a time to a random waiting one; publish-to-receive latency (from before the publish
  call). ``longpoll_pg_connections_waiting``: the API's PostgreSQL connections busy while all
  100 wait (pg_stat_activity, active, other than the one asking).

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import socket
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from benchmarks.common import pct, prepare, reset_pubsub, use_bench_services

use_bench_services()  # before the app modules read their settings

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from sqlalchemy import Engine, text  # noqa: E402

from orderly.client import webhooks  # noqa: E402
from orderly.worker import keys, pubsub  # noqa: E402
from orderly.worker.core.addresses import AddressPolicy  # noqa: E402
from orderly.worker.core.http import HttpOptions, OutboundHttp  # noqa: E402
from orderly.worker.core.ratelimit import Buckets  # noqa: E402
from orderly.worker.delivery import HttpSender  # noqa: E402
from orderly.worker.pubsub.endpoints import EndpointPolicy, Endpoints  # noqa: E402
from orderly.worker.runtime import get_runtime  # noqa: E402
from orderly.worker.signing import SigningSecrets  # noqa: E402

LOCAL = AddressPolicy.parse("127.0.0.1")


class Receiver(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.arrivals: list[tuple[float, str, int]] = []  # time, path, payload n
        self.down: set[str] = set()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def of(self, path: str) -> list[tuple[float, int]]:
        with self.lock:
            return [(t, n) for t, p, n in self.arrivals if p == path]


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.arrivals.append(
                (time.monotonic(), self.path, int(body["payload"].get("n", -1)))
            )
            status = 503 if self.path in self.server.down else 200
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _room(engine: Engine, name: str, **policy: Any) -> None:
    pubsub.create_room(engine, {"name": name, **policy})


def _push(engine: Engine, room: str, name: str, url: str, **extra: Any) -> int:
    body = {"name": name, "kind": "PUSH", "push_url": url, **extra}
    made = pubsub.create_subscription(engine, room, body, policy=LOCAL)
    return int(made["subscription_id"])


def _publish(engine: Engine, room: str, n: int, key: str | None = None) -> None:
    due = pubsub.due_deliveries(engine, lambda _: None)
    for i in range(n):
        payload = {"n": i} if key is None else {"n": i, "k": key}
        _, now_due = pubsub.publish(engine, room, {"routing_key": "a", "payload": payload})
        due.release(now_due)  # left to the due index, which the drive loop takes from


def _drive(engine: Engine, push: Any, endpoints: Endpoints) -> int:
    """One turn of beat and a worker: due deliveries taken and delivered; how many taken."""
    batches: list[list[int]] = []
    due = pubsub.due_deliveries(engine, batches.append)
    items = due.take(500)
    if items:
        due.hand_off(items)
    for batch in batches:
        pubsub.deliver_batch(engine, batch, push, "", endpoints=endpoints)
    return len(items)


def signing(engine: Engine, r: Any, events: int, rounds: int) -> dict[str, float]:
    body = json.dumps({"payload": "x" * 1000}).encode()
    secret = webhooks.new_secret()
    n = 20_000
    start = resource.getrusage(resource.RUSAGE_SELF)
    for i in range(n):
        webhooks.headers([secret], f"dlv_{i}", body)
    end = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (end.ru_utime - start.ru_utime) + (end.ru_stime - start.ru_stime)
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    secrets = SigningSecrets(engine)
    senders = {
        "signed": HttpSender(OutboundHttp(HttpOptions(policy=LOCAL), signer=secrets.for_send)),
        "unsigned": HttpSender(OutboundHttp(HttpOptions(policy=LOCAL))),
    }
    rates: dict[str, list[float]] = {"signed": [], "unsigned": []}
    for _ in range(rounds):
        for kind, sender in senders.items():
            reset_pubsub(r)
            _room(engine, "fan")
            for s in range(4):
                _push(engine, "fan", f"s{s}", f"{receiver.base}/s{s}")
            _publish(engine, "fan", events)
            endpoints = Endpoints()
            started = time.perf_counter()
            while _drive(engine, sender.push, endpoints):
                pass
            rates[kind].append(4 * events / (time.perf_counter() - started))
    receiver.shutdown()
    return {
        "signing_us": round(cpu / n * 1e6, 2),
        "fanout_signed_per_s": round(statistics.median(rates["signed"]), 1),
        "fanout_unsigned_per_s": round(statistics.median(rates["unsigned"]), 1),
    }


def pacing(engine: Engine, r: Any, seconds: float, rate: float = 20.0) -> dict[str, float]:
    reset_pubsub(r)
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    _room(engine, "paced")
    _push(engine, "paced", "slow", f"{receiver.base}/slow", rate_per_s=rate)  # burst: the rate
    _push(engine, "paced", "free", f"{receiver.base}/free")
    _publish(engine, "paced", int(rate * seconds * 1.5) + 20)
    endpoints = Endpoints(buckets=Buckets(r))
    sender = HttpSender(OutboundHttp(HttpOptions(policy=LOCAL)))
    started = time.monotonic()
    while time.monotonic() - started < seconds + 1.0:
        if not _drive(engine, sender.push, endpoints):
            time.sleep(0.005)
    slow = [t for t, _ in receiver.of("/slow")]
    free = [t for t, _ in receiver.of("/free")]
    receiver.shutdown()
    # the window: from the first paced send, D seconds
    window = [t for t in slow if slow[0] <= t < slow[0] + seconds]
    got = len(window) / seconds
    return {
        "pacing_rate_limit_per_s": rate,
        "pacing_received_per_s": round(got, 2),
        "pacing_error_pct": round((got - rate) / rate * 100, 2),
        "pacing_free_endpoint_received": len(free),
    }


def circuit(engine: Engine, r: Any, seconds: float) -> dict[str, Any]:
    reset_pubsub(r)
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    _room(engine, "down", delivery_delay_ms=1000, delivery_delay_multiplier=1.01,
          delivery_attempts=101)  # fmt: skip
    # a plain subscription (every event's retries due: the load a circuit spares), and one
    # ordered by a single key (its backlog must arrive in publish order when it is back)
    _push(engine, "down", "gone", f"{receiver.base}/gone")
    _push(engine, "down", "ordered", f"{receiver.base}/ordered", order_key="k")
    receiver.down.update({"/gone", "/ordered"})
    events = 50
    _publish(engine, "down", events, key="one")
    policy = EndpointPolicy(circuit_failures=5, probe_max_ms=1000)
    endpoints = Endpoints(policy)
    sender = HttpSender(OutboundHttp(HttpOptions(policy=LOCAL)))
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if not _drive(engine, sender.push, endpoints):
            time.sleep(0.01)
    down_for = time.monotonic() - started
    sent = receiver.of("/gone")
    opened_at = sent[policy.circuit_failures - 1][0] if len(sent) >= policy.circuit_failures else 0
    after = [t for t, _ in sent[policy.circuit_failures :]]
    intervals = (started + down_for - opened_at) / (policy.probe_max_ms / 1000)
    receiver.down.clear()
    back = time.monotonic()
    while time.monotonic() - back < 120:
        _drive(engine, sender.push, endpoints)
        with engine.connect() as conn:
            left = conn.execute(
                text("SELECT count(*) FROM delivery WHERE state <> 'DELIVERED'")
            ).scalar_one()
        if not left:
            break
        time.sleep(0.01)
    drained = [n for t, n in receiver.of("/gone") if t >= back]
    in_order = [n for t, n in receiver.of("/ordered") if t >= back]
    receiver.shutdown()
    return {
        "down_seconds": round(down_for, 1),
        "down_requests_total": len(sent),
        "down_requests_after_open": len(after),
        "down_endpoint_requests_per_interval": round(len(after) / max(intervals, 1e-9), 3),
        "down_backlog_delivered": len(set(drained)) == events == len(set(in_order)) and not left,
        "down_backlog_drained_in_order": in_order == sorted(in_order),
        "down_drain_seconds": round(time.monotonic() - back, 2),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _busy_connections(engine: Engine) -> int:
    """The database's connections running a statement, but this one."""
    with engine.connect() as conn:
        found = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND state = 'active' AND pid <> pg_backend_pid()"
            )
        ).scalar_one()
    return int(found)


def longpoll(engine: Engine, r: Any, events: int, waiting: int = 100) -> dict[str, Any]:
    reset_pubsub(r)
    from orderly.api.http import create_app

    _, token = keys.create_key(
        engine, {"name": f"bench-{time.time_ns()}", "scopes": list(keys.SCOPES)}
    )
    _room(engine, "lp")
    subs = []
    for i in range(waiting):
        body = {"name": f"q{i}", "kind": "PULL", "routing_key_pattern": f"k{i}"}
        subs.append(int(pubsub.create_subscription(engine, "lp", body)["subscription_id"]))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(), port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {token}"}
    latencies: list[float] = []
    busy: list[int] = []

    async def run() -> None:
        limits = httpx.Limits(max_connections=waiting + 10)
        async with (
            httpx.AsyncClient(base_url=base, headers=headers, timeout=30, limits=limits) as client,
            httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as publisher,
        ):
            sent_at: dict[int, float] = {}
            got: dict[int, asyncio.Event] = {i: asyncio.Event() for i in range(waiting)}

            async def consumer(i: int) -> None:
                while True:
                    answer = await client.get(
                        f"/subscriptions/{subs[i]}/messages", params={"wait_ms": 20_000}
                    )
                    for _ in answer.json():
                        latencies.append((time.perf_counter() - sent_at[i]) * 1000)
                        got[i].set()

            tasks = [asyncio.create_task(consumer(i)) for i in range(waiting)]
            await asyncio.sleep(1.0)  # every consumer waiting
            busy.append(_busy_connections(engine))
            rng = random.Random(7)
            for _ in range(events):
                i = rng.randrange(waiting)
                got[i].clear()
                sent_at[i] = time.perf_counter()
                await publisher.post(
                    "/rooms/lp/events", json={"routing_key": f"k{i}", "payload": {}}
                )
                await asyncio.wait_for(got[i].wait(), 25)
                await asyncio.sleep(0.01)
            for t in tasks:
                t.cancel()

    asyncio.run(run())
    server.should_exit = True
    return {
        "longpoll_waiting_clients": waiting,
        "longpoll_events": len(latencies),
        "longpoll_p50_ms": round(pct(latencies, 0.5), 2),
        "longpoll_p99_ms": round(pct(latencies, 0.99), 2),
        "longpoll_pg_connections_waiting": busy[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    r, _ = prepare()
    engine = get_runtime().engine
    figures: dict[str, Any] = {"quick": args.quick}
    figures |= signing(engine, r, 100 if args.quick else 500, 2 if args.quick else 3)
    print(json.dumps(figures), flush=True)
    figures |= pacing(engine, r, 5.0 if args.quick else 30.0)
    print(json.dumps(figures), flush=True)
    figures |= longpoll(engine, r, 50 if args.quick else 300)
    print(json.dumps(figures), flush=True)
    figures |= circuit(engine, r, 20.0 if args.quick else 300.0)
    reset_pubsub(r)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
