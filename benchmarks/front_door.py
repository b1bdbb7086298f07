"""The front door: POST /messages answered by orderly's API against the floor of a durable
intake, both driven by a non-Python load generator (wrk, Debian's package).

Measured in one run, each with two uvicorn processes (one per core):

- ``durable``: a bare ASGI app doing one INSERT and one COMMIT per request with the same
  driver (benchmarks/peer_apps/durable_app.py): the floor orderly is held to;
- ``orderly``: the API with concurrent single submits sharing commits (group commit,
  ORDERLY_INTAKE_GROUP_MAX), and ``orderly-single`` with each submit its own transaction
  (ORDERLY_INTAKE_GROUP_MAX=0), as before group commit.

Each at 1 connection and at 16, for a fixed time, on emptied tables; then, on ``orderly`` and
``orderly-single`` at 16 connections, the other busy producer routes: conversation requests
(ten to a conversation), conversation responses (to 1,000 waiting requests in turn) and
publishes (to a room with one push subscription). Requests per second and
the server's CPU per request (its uvicorn processes, from /proc; the database's and Redis's
CPU are not counted, for either). Every answer must be a 201 (a message stored and
committed): any other answer, or a socket error, fails the run. The last line is one JSON
object.

    ./run.sh bench front_door [--quick] [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass

from benchmarks.common import prepare, use_bench_services, wrk
from benchmarks.peers import _children, _ticks
from tooling.apikeys import bearer
from tooling.processes import BIN, Managed, ProcessGroup, free_port, wait_http

PROCESSES = 2
TICK_S = os.sysconf("SC_CLK_TCK")
# The API's own limits would refuse a load generator's rate: lifted for the run.
UNLIMITED = {
    "ORDERLY_RATE_ADDRESS_PER_S": "1000000",
    "ORDERLY_RATE_ADDRESS_BURST": "1000000",
    "ORDERLY_RATE_KEY_PER_S": "1000000",
    "ORDERLY_RATE_KEY_BURST": "1000000",
}


@dataclass(frozen=True)
class Run:
    system: str
    connections: int
    requests: int
    seconds: float
    cpu_s: float
    non_201: int

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_ms(self) -> float:
        return 1000 * self.cpu_s / max(self.requests, 1)


def _cpu(managed: Managed) -> int:
    return sum(_ticks(p) for p in _children(managed.proc.pid))


# The other busy producer routes (benchmarks/wrk/post.lua's kinds), each at 16 connections.
ROUTES = ("requests", "responses", "events")
WAITING = 1000  # requests waiting for the "responses" kind's responses


def _wrk(
    port: int, connections: int, seconds: float, key: str, kind: str
) -> tuple[int, float, int]:
    """wrk's requests, seconds and answers that were not a 201 (a duplicate's 200 is no new
    message either)."""
    return wrk(f"http://127.0.0.1:{port}", kind, connections, seconds, {"KEY": key})


def _measure(
    managed: Managed,
    port: int,
    system: str,
    conns: int,
    secs: float,
    key: str,
    kind: str = "messages",
) -> Run:
    _wrk(port, conns, min(1.0, secs), key, kind)  # warm: connections, prepared statements
    before = _cpu(managed)
    requests, took, bad = _wrk(port, conns, secs, key, kind)
    cpu = (_cpu(managed) - before) / TICK_S
    name = system if kind == "messages" else f"{system} {kind}"
    return Run(name, conns, requests, took, cpu, bad)


def _routes_setup() -> None:
    """What the other routes' requests need: the origin "bench" (a channel to a closed
    port: nothing is delivered, no worker runs), requests q-i waiting in conversations
    bench-i, and the room "bench" with one push subscription."""
    from orderly.worker import pubsub
    from orderly.worker.channels import Channel, put_channel
    from orderly.worker.core.addresses import AddressPolicy
    from orderly.worker.core.errors import InvalidMessage
    from orderly.worker.runtime import get_runtime

    runtime = get_runtime()
    put_channel(runtime.engine, Channel("bench", "http://127.0.0.1:9/", 100, 2.0, 3, 5000))
    for i in range(WAITING):
        runtime.conversations.register_request(
            f"bench-{i}", {"request_id": f"q-{i}", "origin": "bench"}
        )
    try:
        pubsub.create_room(runtime.engine, {"name": "bench"})
        pubsub.create_subscription(
            runtime.engine,
            "bench",
            {"name": "push", "kind": "PUSH", "push_url": "http://127.0.0.1:9/"},
            policy=AddressPolicy.parse("127.0.0.1"),
        )
    except InvalidMessage:  # made by an earlier system's turn
        pass


def _fresh() -> None:
    """Each system starts on empty tables (a grown table would slow the later ones)."""
    from sqlalchemy import text

    from orderly.worker.runtime import get_runtime

    with get_runtime().engine.begin() as conn:
        conn.execute(text("TRUNCATE message RESTART IDENTITY CASCADE"))
        conn.execute(text("DROP TABLE IF EXISTS durable_intake"))


def _durable(group: ProcessGroup) -> tuple[Managed, int]:
    port = free_port()
    dsn = os.environ["ORDERLY_DATABASE_URL"].replace("postgresql+psycopg2://", "postgresql://")
    argv = [str(BIN / "uvicorn"), "benchmarks.peer_apps.durable_app:app", "--port", str(port),
            "--log-level", "warning", "--no-access-log", "--workers", str(PROCESSES)]  # fmt: skip
    managed = group.start("durable", argv, extra_env={"DURABLE_DATABASE_URL": dsn})
    wait_http(f"http://127.0.0.1:{port}/", managed, 60)
    return managed, port


def _orderly(group: ProcessGroup, name: str, grouped: bool) -> tuple[Managed, int]:
    port = free_port()
    env = {**UNLIMITED, "ORDERLY_INTAKE_GROUP_MAX": "256" if grouped else "0"}
    managed = group.start_api(port, name=name, extra_env=env, workers=PROCESSES)
    wait_http(f"http://127.0.0.1:{port}/health", managed, 60)
    return managed, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 s per measurement")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    seconds = 3.0 if args.quick else args.seconds
    if shutil.which("wrk") is None:
        raise SystemExit("front_door needs wrk (Debian's package wrk)")
    use_bench_services()
    _, group = prepare()
    from orderly.worker.runtime import get_runtime

    key = bearer(get_runtime().engine)["Authorization"].removeprefix("Bearer ")
    runs: list[Run] = []
    try:
        for system in ("durable", "orderly", "orderly-single"):
            _fresh()
            if system == "durable":
                managed, port = _durable(group)
            else:
                managed, port = _orderly(group, system, grouped=system == "orderly")
            measured = [(conns, "messages") for conns in (1, 16)]
            if system != "durable":
                _routes_setup()
                measured += [(16, kind) for kind in ROUTES]
            for conns, kind in measured:
                run = _measure(managed, port, system, conns, seconds, key, kind)
                runs.append(run)
                print(
                    f"{run.system:25} {conns:3} connections: {run.rps:8.0f} requests/s, "
                    f"{run.cpu_ms:6.3f} ms server CPU a request, {run.non_201} not 201",
                    flush=True,
                )
            group.stop(managed)
    finally:
        group.stop_all()
    by = {(r.system, r.connections): r for r in runs}
    figures = {
        "durable_rps_c1": round(by["durable", 1].rps, 1),
        "durable_rps_c16": round(by["durable", 16].rps, 1),
        "api_rps_c1": round(by["orderly", 1].rps, 1),
        "api_rps_c16": round(by["orderly", 16].rps, 1),
        "api_single_rps_c16": round(by["orderly-single", 16].rps, 1),
        "api_server_cpu_ms": round(by["orderly", 16].cpu_ms, 3),
        "api_server_cpu_ms_c1": round(by["orderly", 1].cpu_ms, 3),
        "durable_server_cpu_ms": round(by["durable", 16].cpu_ms, 3),
        "api_vs_durable_bare": round(by["orderly", 16].rps / by["durable", 16].rps, 3),
        "api_vs_durable_bare_c1": round(by["orderly", 1].rps / by["durable", 1].rps, 3),
        "group_commit_gain_c16": round(by["orderly", 16].rps / by["orderly-single", 16].rps, 3),
        **{f"api_{kind}_rps_c16": round(by[f"orderly {kind}", 16].rps, 1) for kind in ROUTES},
        **{f"api_{kind}_cpu_ms": round(by[f"orderly {kind}", 16].cpu_ms, 3) for kind in ROUTES},
        **{
            f"group_commit_gain_{kind}": round(
                by[f"orderly {kind}", 16].rps / by[f"orderly-single {kind}", 16].rps, 3
            )
            for kind in ROUTES
        },
        "non_201": sum(r.non_201 for r in runs),
        "seconds_each": seconds,
    }
    print(json.dumps(figures))
    if figures["non_201"]:
        raise SystemExit(f"{figures['non_201']} answers were not 201: the figures do not count")


if __name__ == "__main__":
    main()
