"""Node states govern every kind of input and work, end to end.

HANDLES_EXISTING_MESSAGES (draining) refuses new input through the node (messages,
conversation requests and responses, publishes) with 503 and finishes the work it has;
STOPPED processes nothing (no message, conversation, event), and its workers take the work up
again, in order, once it runs again. A task that reaches a STOPPED worker anyway goes back to
the broker, where a worker of a running node takes it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import Engine, text

from orderly.models import NodeState
from orderly.worker import nodes
from tests.helpers import message, queued, wait_until
from tests.push_recorder import Recorder
from tests.stack import Stack
from tooling.processes import wait_for_log
from tooling.sink import Sink

DRAINING = NodeState.HANDLES_EXISTING_MESSAGES
ROOM = {"name": "orders", "delivery_delay_ms": 100, "delivery_attempts": 3}


@pytest.fixture
def sink() -> Iterator[Sink]:
    with Sink() as s:
        yield s


def set_state(db: Engine, code: str, state: NodeState) -> None:
    nodes.register_node(db, code)  # a node a worker has not registered yet
    nodes.set_state(db, code, state)


def test_the_processes_of_a_new_node_may_register_it_at_once(db: Engine) -> None:
    # The API, the workers and beat of a new node start together: each registers it.
    for n in range(200):
        code = f"together-{n}"
        start = threading.Barrier(8)

        def register(code: str = code, start: threading.Barrier = start) -> int:
            start.wait(10)
            return nodes.register_node(db, code)

        with ThreadPoolExecutor(8) as pool:
            ids = set(pool.map(lambda _: register(), range(8)))
        assert len(ids) == 1
        with db.connect() as conn:
            query = text("SELECT node_id, state FROM node WHERE code = :c")
            rows = conn.execute(query, {"c": code})
            found = [tuple(r) for r in rows]
        assert found == [(ids.pop(), "RUN")]


def setup_outputs(http: httpx.Client, sink: Sink, recorder: Recorder) -> None:
    """Channel "web" to the sink; room "orders" pushing to the recorder."""
    assert http.put("/channels/web", json={"url": sink.url}).status_code == 200
    assert http.post("/rooms", json=ROOM).status_code == 201
    sub = {"name": "s", "kind": "PUSH", "push_url": f"{recorder.base}/s"}
    assert http.post("/rooms/orders/subscriptions", json=sub).status_code == 201


def request(http: httpx.Client, conversation: str, request_id: str) -> httpx.Response:
    body = {"request_id": request_id, "origin": "web"}
    return http.post(f"/conversations/{conversation}/requests", json=body)


def respond(
    http: httpx.Client, conversation: str, request_id: str, response_id: str, *, last: bool
) -> httpx.Response:
    body = {"request_id": request_id, "response_id": response_id, "payload": {}, "last": last}
    return http.post(f"/conversations/{conversation}/responses", json=body)


def publish(http: httpx.Client, n: int) -> httpx.Response:
    return http.post("/rooms/orders/events", json={"routing_key": "a", "payload": {"n": n}})


def counts(db: Engine) -> tuple[int, int]:
    with db.connect() as conn:
        messages = conn.execute(text("SELECT count(*) FROM message")).scalar_one()
        events = conn.execute(text("SELECT count(*) FROM event")).scalar_one()
    return int(messages), int(events)


def pushed(recorder: Recorder) -> list[Any]:
    with recorder.lock:
        return [a["body"]["payload"]["n"] for a in recorder.arrivals]


def delivered(sink: Sink) -> list[str]:
    return [a["response_id"] for a in sink.arrivals() if a["status"] == 200]


def assert_refused(answer: httpx.Response, state: NodeState) -> None:
    assert answer.status_code == 503, answer.text
    assert int(answer.headers["retry-after"]) >= 1
    [error] = answer.json()["errors"]
    assert error["field"] == "node" and state.value in error["problem"], error


def test_a_draining_node_refuses_new_input_and_finishes_existing_work(
    stack: Stack, sink: Sink, recorder: Recorder
) -> None:
    stack.start_api()
    http = stack.http
    setup_outputs(http, sink, recorder)
    # Existing work, accepted while the node runs; no worker takes it yet.
    m1 = stack.submit(message(1))
    assert request(http, "c-1", "r-1").status_code == 201
    assert respond(http, "c-1", "r-1", "rs-1", last=False).status_code == 201
    assert publish(http, 1).status_code == 201
    stored = counts(stack.db)

    set_state(stack.db, "api-node", DRAINING)
    set_state(stack.db, "worker-node", DRAINING)

    assert_refused(http.post("/messages", json=message(2)), DRAINING)
    assert_refused(request(http, "c-2", "r-2"), DRAINING)
    assert_refused(respond(http, "c-1", "r-1", "rs-2", last=True), DRAINING)
    assert_refused(publish(http, 2), DRAINING)
    assert counts(stack.db) == stored, "a refused input wrote something"
    # What it already holds is still answered as before.
    again = http.post("/messages", json=message(1))
    assert again.status_code == 200 and again.json()["msg_id"] == m1
    assert request(http, "c-1", "r-1").status_code == 200

    # A worker of the draining node finishes the existing work.
    stack.worker(node="worker-node", concurrency=1)
    stack.wait_state(m1, "OK")
    wait_until(lambda: delivered(sink) == ["rs-1"], 30, "rs-1 delivered")
    wait_until(lambda: pushed(recorder) == [1], 30, "event 1 pushed")
    assert counts(stack.db) == stored


def test_a_stopped_node_delivers_nothing_until_it_runs_again(
    stack: Stack, sink: Sink, recorder: Recorder, redis_client: redis.Redis
) -> None:
    stack.start_api()
    http = stack.http
    setup_outputs(http, sink, recorder)
    worker = stack.worker(node="worker-node", concurrency=1)
    set_state(stack.db, "worker-node", NodeState.STOPPED)
    wait_for_log(worker, "is STOPPED: no longer consuming")

    assert request(http, "c-1", "r-1").status_code == 201
    assert respond(http, "c-1", "r-1", "rs-1", last=False).status_code == 201
    assert respond(http, "c-1", "r-1", "rs-2", last=True).status_code == 201
    assert publish(http, 1).status_code == 201
    assert publish(http, 2).status_code == 201
    m1 = stack.submit(message(1))

    # The work waits in the broker: nobody consumes it.
    wait_until(
        lambda: queued("orderly.deliver") >= 2 and queued("orderly.process") >= 1,
        30,
        "tasks waiting in the broker",
    )
    assert delivered(sink) == [] and pushed(recorder) == []
    assert stack.state(m1) == "NEW"

    nodes.set_state(stack.db, "worker-node", NodeState.RUN)
    wait_for_log(worker, "consuming again")
    wait_until(lambda: len(delivered(sink)) >= 2, 30, "both responses delivered")
    assert delivered(sink) == ["rs-1", "rs-2"]
    wait_until(lambda: len(pushed(recorder)) >= 2, 30, "both events pushed")
    assert pushed(recorder) == [1, 2]
    stack.wait_state(m1, "OK")


def test_a_task_that_reaches_a_stopped_worker_goes_back_to_the_broker(
    stack: Stack, sink: Sink, recorder: Recorder
) -> None:
    stack.start_api()
    http = stack.http
    setup_outputs(http, sink, recorder)
    # This worker looks at its node only once a minute: a task reaches it while it is STOPPED.
    stack.env(ORDERLY_HEARTBEAT_INTERVAL="60000", ORDERLY_SERVICE_EXPIRE_MS="150000")
    slow = stack.worker("slow", node="slow-node", concurrency=1)
    stack.env(ORDERLY_HEARTBEAT_INTERVAL="300", ORDERLY_SERVICE_EXPIRE_MS="15000")
    set_state(stack.db, "slow-node", NodeState.STOPPED)

    assert request(http, "c-1", "r-1").status_code == 201
    assert respond(http, "c-1", "r-1", "rs-1", last=True).status_code == 201
    assert publish(http, 1).status_code == 201
    wait_for_log(slow, "orderly.deliver.conversation")
    wait_for_log(slow, "given back")
    assert delivered(sink) == [] and pushed(recorder) == []

    # A worker of a running node takes what was given back.
    stack.worker("w2", node="run-node", concurrency=1)
    wait_until(lambda: delivered(sink) == ["rs-1"], 30, "rs-1 delivered")
    wait_until(lambda: pushed(recorder) == [1], 30, "event 1 pushed")


def test_beat_of_a_stopped_node_hands_out_no_due_work_until_it_runs_again(
    stack: Stack, sink: Sink, recorder: Recorder
) -> None:
    stack.start_api()
    http = stack.http
    setup_outputs(http, sink, recorder)
    stack.worker(node="worker-node", concurrency=1)
    set_state(stack.db, "beat-node", NodeState.STOPPED)
    stack.beat(node="beat-node")
    # Delayed: only beat's ticker hands it to the broker, once it is due.
    answer = http.post(
        "/rooms/orders/events", json={"routing_key": "a", "payload": {"n": 1}, "$delay": 300}
    )
    assert answer.status_code == 201, answer.text

    def beat_went_on_past_the_due_time() -> bool:
        # Beat renews its node's heartbeat from its tick loop: a heartbeat a second after the
        # event was due shows the loop ran past it.
        with stack.db.connect() as conn:
            return bool(
                conn.execute(
                    text(
                        "SELECT n.last_heartbeat > e.deliver_at + interval '1 second'"
                        " FROM node n, event e WHERE n.code = 'beat-node'"
                    )
                ).scalar_one()
            )

    wait_until(beat_went_on_past_the_due_time, 30, "beat ticking past the due time")
    assert pushed(recorder) == []

    nodes.set_state(stack.db, "beat-node", NodeState.RUN)
    wait_until(lambda: pushed(recorder) == [1], 30, "event 1 pushed")
