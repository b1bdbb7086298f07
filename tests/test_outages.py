"""Outages answered clearly: PostgreSQL or Redis stopped under a running API, worker and beat.

While a service is down every write (and read) answers 503 with Retry-After and names it,
/ready answers 503 listing it, /health still answers; nothing is half-written. Once it is back
the next request on the same client connection succeeds, and the processes go on without a
restart.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError

from orderly.worker import configuration
from orderly.worker.core.errors import ServiceUnavailable
from orderly.worker.db import schema
from orderly.worker.db.db import engine_for
from orderly.worker.messages.intake import Intake
from orderly.worker.runtime import Runtime, get_runtime
from orderly.worker.settings import Settings
from tests.helpers import api_key, message, set_config, take_due, wait_until
from tests.stack import Stack
from tooling.processes import BIN, free_port, wait_http
from tooling.servers import PostgresServer, RedisServer


def local_port(answer: httpx.Response) -> int:
    """The client side's port of the connection that carried ``answer``."""
    stream: Any = answer.extensions["network_stream"]
    return int(stream.get_extra_info("client_addr")[1])


def assert_unavailable(answer: httpx.Response, *services: str) -> list[dict[str, str]]:
    assert answer.status_code == 503, answer.text
    assert int(answer.headers["retry-after"]) >= 1
    errors: list[dict[str, str]] = answer.json()["errors"]
    assert sorted(e["field"] for e in errors) == sorted(services), errors
    for error in errors:
        assert "is unreachable: " in error["problem"], error
        assert "Traceback" not in error["problem"]
    return errors


def wait_ready(client: httpx.Client) -> None:
    wait_until(lambda: client.get("/ready").status_code == 200, 60, "/ready answering 200")


@pytest.fixture
def pg_stack(stack: Stack, pg_server: PostgresServer) -> Iterator[Stack]:
    """API, worker and beat on a PostgreSQL of the test's own (the run's Redis)."""
    url = pg_server.url("orderly")
    schema.create_database(url)
    schema.upgrade(url)
    engine = create_engine(url)
    configuration.ensure_defaults(engine)
    set_config(
        engine,
        asynch__partlyFailedIntervalSec="1",
        asynch__partlyFailedRepeatTimeSec="1",
    )
    stack.token = api_key(engine, name="outages")  # the key lives in that database
    engine.dispose()
    stack.env(ORDERLY_DATABASE_URL=url)
    stack.start_api()
    stack.worker()
    stack.beat()
    yield stack


def count_rows(url: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM message")).scalar_one())
    finally:
        engine.dispose()


def test_postgresql_down_is_503_and_everything_goes_on_once_it_is_back(
    pg_stack: Stack, pg_server: PostgresServer
) -> None:
    client = pg_stack.http
    first = client.post("/messages", json=message(1))
    assert first.status_code == 201, first.text
    pg_stack.wait_state(first.json()["msg_id"], "OK")
    port = local_port(first)
    pg_server.stop(mode="fast")

    refused = client.post("/messages", json=message(2, payload='{"fail_times": 1}'))
    problem = assert_unavailable(refused, "postgresql")[0]["problem"]
    assert problem.startswith("PostgreSQL is unreachable: ")
    assert_unavailable(client.get(f"/messages/{first.json()['msg_id']}"), "postgresql")
    assert_unavailable(
        client.post("/conversations/c-1/requests", json={"request_id": "r-1", "origin": "x"}),
        "postgresql",
    )
    assert_unavailable(client.get("/ready"), "postgresql")
    assert client.get("/health").status_code == 200
    assert local_port(client.get("/health")) == port, "a 503 closed the client's connection"

    pg_server.start()

    # The next request on the same connection succeeds: the API's pool holds no dead one.
    again = client.post("/messages", json=message(2, payload='{"fail_times": 1}'))
    assert again.status_code == 201, again.text
    assert local_port(again) == port
    assert count_rows(pg_server.url("orderly")) == 2  # nothing was written by the refusal
    # The worker claims it (PARTLY_FAILED once), and beat's pool hands it over again: both
    # came back without a restart.
    done = pg_stack.wait_state(again.json()["msg_id"], "OK", timeout=60)
    assert done["failed_count"] == 1
    wait_ready(client)


@pytest.fixture
def redis_stack(stack: Stack, db: Engine, redis_server: RedisServer) -> Iterator[Stack]:
    """API, worker and beat on a Redis of the test's own (broker and ordering structures)."""
    set_config(db, asynch__postponedIntervalSec="1")
    stack.env(ORDERLY_REDIS_URL=redis_server.url)
    stack.start_api()
    stack.worker()
    stack.beat()
    yield stack


def test_an_unexpected_error_is_a_500_and_the_connection_stays_open(stack: Stack) -> None:
    port = free_port()
    argv = [str(BIN / "uvicorn"), "tests.buggy_app:create_app", "--factory", "--port", str(port)]
    api = stack.procs.start("buggy-api", argv)
    wait_http(f"http://127.0.0.1:{port}/health", api)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        before = client.get("/health")
        broken = client.get("/bug")
        assert broken.status_code == 500, broken.text
        assert broken.json() == {
            "errors": [{"field": "server", "problem": "internal error (logged by the API)"}]
        }
        after = client.get("/health")
        assert after.status_code == 200
        assert local_port(after) == local_port(before), "the 500 closed the connection"
    assert "RuntimeError: a bug" in api.log_path.read_text()


KOMBU_CRASH = "AttributeError: 'NoneType' object has no attribute 'hostname'"


@pytest.mark.redis_broker
def test_redis_down_is_503_and_a_stored_message_is_still_processed(
    redis_stack: Stack, redis_server: RedisServer
) -> None:
    client = redis_stack.http
    first = client.post("/messages", json=message(1))
    assert first.status_code == 201, first.text
    redis_stack.wait_state(first.json()["msg_id"], "OK")
    port = local_port(first)
    channel = client.put("/channels/web", json={"url": "http://127.0.0.1:9/in"})
    assert channel.status_code == 200, channel.text

    redis_server.stop()

    refused = client.post("/messages", json=message(2))
    problem = assert_unavailable(refused, "broker")[0]["problem"]
    # The row is durable; it is not left NEW for repair but waits for the pool's hand-over.
    stored = client.get("/messages", params={"state": "POSTPONED"}).json()
    assert [m["correlation_id"] for m in stored] == ["corr-2"], stored
    assert f"message {stored[0]['msg_id']} is stored" in problem
    request = client.post(
        "/conversations/c-1/requests", json={"request_id": "r-1", "origin": "web"}
    )
    assert_unavailable(request, "redis")
    assert_unavailable(client.get("/ready"), "redis", "broker")
    assert local_port(client.get("/health")) == port

    redis_server.start()

    # Beat's pool hands the stored message to the broker; the worker processes it. kombu
    # (the broker client) sometimes crashes the whole worker while it reconnects (an
    # AttributeError in kombu/transport/redis.py); a supervisor restarts it then, as here.
    def processed() -> bool:
        for worker in [p for p in redis_stack.procs.procs if p.name.startswith("w")]:
            if not worker.alive() and KOMBU_CRASH in worker.log_path.read_text(errors="replace"):
                redis_stack.procs.procs.remove(worker)
                redis_stack.worker(f"{worker.name}r")
        return redis_stack.state(stored[0]["msg_id"]) == "OK"

    wait_until(processed, 60, "the stored message processed")
    repeat = client.post("/messages", json=message(2))
    assert repeat.status_code == 200 and repeat.json()["msg_id"] == stored[0]["msg_id"]
    assert local_port(repeat) == port
    # The conversation request whose Redis step failed is completed by its repeat.
    request = client.post(
        "/conversations/c-1/requests", json={"request_id": "r-1", "origin": "web"}
    )
    assert request.status_code in (200, 201), request.text
    assert "r-1" in str(client.get("/conversations/c-1").json())
    wait_ready(client)


def test_a_message_the_broker_refused_waits_postponed_for_the_pool(db: Engine) -> None:
    def refuse(msg_id: int) -> None:
        raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    runtime = get_runtime()
    intake = Intake(
        db,
        node_id=runtime.node_id,
        enqueue=refuse,
        registry=runtime.registry,
        max_payload_bytes=1000,
    )
    with pytest.raises(ServiceUnavailable) as info:
        intake.submit(message(1))
    assert info.value.service == "broker"
    assert str(info.value).startswith("The broker is unreachable: Error 111")
    with db.connect() as conn:
        [(msg_id, state)] = conn.execute(text("SELECT msg_id, state FROM message")).all()
    assert state == "POSTPONED"  # the re-processing pool hands it over again
    assert f"message {msg_id} is stored" in str(info.value)
    again = intake.submit(message(1))
    assert (again.msg_id, again.created, again.state.value) == (msg_id, False, "POSTPONED")


def test_messages_no_worker_could_be_woken_for_are_due_again(db: Engine, intake: Intake) -> None:
    ids = [intake.submit(message(n)).msg_id for n in (1, 2)]
    with db.begin() as conn:
        conn.execute(text("UPDATE message SET state = 'POSTPONED', due_at = now()"))

    def refuse() -> None:
        raise ConnectionError("Connection refused.")

    with pytest.raises(ConnectionError):
        take_due(db, wake=refuse)
    with db.connect() as conn:
        found = conn.execute(text("SELECT state, due_at IS NOT NULL FROM message ORDER BY msg_id"))
        waiting = [tuple(r) for r in found]
    assert waiting == [("IN_QUEUE", True), ("IN_QUEUE", True)]  # due again: tried next tick
    woken: list[int] = []
    assert take_due(db, wake=lambda: woken.append(1)) == len(ids) and woken == [1]


@pytest.mark.integration  # a PostgreSQL connection attempt, to a server of its own
def test_a_server_that_never_answers_fails_a_connection_after_the_connect_timeout() -> None:
    """ORDERLY_CONNECT_TIMEOUT_S bounds a new connection (a /ready probe, a worker's first
    query): a listener that accepts and never speaks is given up on, not waited for."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    try:
        engine = engine_for(f"postgresql+psycopg2://postgres@127.0.0.1:{port}/x", 2)
        started = time.monotonic()
        with pytest.raises(OperationalError, match="timeout"):
            engine.connect()
        assert time.monotonic() - started < 30  # not forever
        client = Runtime(Settings(ORDERLY_CONNECT_TIMEOUT_S=3)).redis
        assert client.connection_pool.connection_kwargs["socket_connect_timeout"] == 3
    finally:
        silent.close()
