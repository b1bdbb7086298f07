"""Delayed messages and worker deaths, with real worker processes on the real services."""

from __future__ import annotations

import os
import signal
import time

import httpx
import redis
from sqlalchemy import Engine, text

from tests.helpers import wait_until
from tests.push_recorder import Recorder
from tests.stack import Stack, pool_children
from tests.test_pubsub import ROOM


def _rooms(stack: Stack, recorder: Recorder, **env: str) -> httpx.Client:
    """The API and beat (the ticker), a room and a push subscription to the recorder."""
    stack.env(AURA_QUEUE_MANAGER_INTERVAL="50", **env)
    stack.start_api()
    stack.beat()
    http = stack.http
    assert http.post("/rooms", json=ROOM).status_code == 201
    body = {"name": "push", "kind": "PUSH", "push_url": f"{recorder.base}/push"}
    assert http.post("/rooms/orders/subscriptions", json=body).status_code == 201
    return http


def test_delay_longer_than_the_broker_visibility_timeout_is_delivered_once(
    stack: Stack, db: Engine, redis_client: redis.Redis, recorder: Recorder
) -> None:
    http = _rooms(stack, recorder, ORDERLY_BROKER_VISIBILITY_TIMEOUT="1")
    stack.workers({"w1": "w1", "w2": "w2"})
    sent = time.monotonic()
    answer = http.post(
        "/rooms/orders/events", json={"routing_key": "later", "payload": {}, "$delay": 2500}
    )
    assert answer.status_code == 201
    wait_until(lambda: recorder.times("/push", "later") != [], timeout=15, what="delivery")
    time.sleep(2.5)  # more than twice the visibility timeout: any redelivery would show
    arrivals = recorder.times("/push", "later")
    assert len(arrivals) == 1
    assert arrivals[0] - sent >= 2.5


def test_delayed_message_survives_sigkill_of_every_worker(
    stack: Stack, db: Engine, redis_client: redis.Redis, recorder: Recorder
) -> None:
    http = _rooms(stack, recorder)
    first = stack.worker("w1", concurrency=1, node="w1")
    sent = time.monotonic()
    assert (
        http.post(
            "/rooms/orders/events", json={"routing_key": "later", "payload": {}, "$delay": 1500}
        ).status_code
        == 201
    )
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait(10)
    time.sleep(0.5)
    stack.worker("w2", concurrency=1, node="w2")  # a new worker, nothing of the old one's memory
    wait_until(lambda: recorder.times("/push", "later") != [], timeout=20, what="delivery")
    time.sleep(0.5)
    arrivals = recorder.times("/push", "later")
    assert len(arrivals) == 1 and arrivals[0] - sent >= 1.5


def test_a_killed_pool_child_is_replaced_and_work_goes_on(
    stack: Stack, db: Engine, redis_client: redis.Redis, recorder: Recorder
) -> None:
    http = _rooms(stack, recorder)
    worker = stack.worker("w1", concurrency=2, node="w1")
    wait_until(lambda: len(pool_children(worker)) == 2, timeout=20, what="two children")
    before = pool_children(worker)
    os.kill(before[0], signal.SIGKILL)
    for n in range(20):
        answer = http.post("/rooms/orders/events", json={"routing_key": "a", "payload": {"n": n}})
        assert answer.status_code == 201
    wait_until(lambda: len(recorder.times("/push")) == 20, timeout=30, what="20 deliveries")
    assert worker.alive()
    after = pool_children(worker)
    assert len(after) == 2 and before[0] not in after  # the pool replaced the dead child


def test_a_poison_event_is_quarantined_within_seconds_while_the_others_are_delivered(
    stack: Stack, db: Engine, redis_client: redis.Redis, recorder: Recorder
) -> None:
    http = _rooms(stack, recorder, ORDERLY_TOKEN_SECRET="test-secret-of-enough-length")
    # Retries far apart: only the deaths, released by beat within a second each, bring the
    # delivery back in time (the lease fallback would take minutes).
    body = {
        "name": "poisoned",
        "kind": "HANDLER",
        "handler": "test.poison",
        "routing_key_pattern": "p",
        "delivery_attempts": 10,
        "delivery_delay_ms": 600_000,
    }
    assert http.post("/rooms/orders/subscriptions", json=body).status_code == 201
    worker = stack.worker("w1", concurrency=2, node="w1")
    started = time.monotonic()
    assert (
        http.post("/rooms/orders/events", json={"routing_key": "p", "payload": {}}).status_code
        == 201
    )
    for n in range(10):
        answer = http.post("/rooms/orders/events", json={"routing_key": "a", "payload": {"n": n}})
        assert answer.status_code == 201

    def poisoned() -> tuple[str, int, int, str]:
        with db.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT d.state, d.attempt, d.lost_count, d.last_error FROM delivery d"
                    " JOIN subscription s USING (subscription_id) WHERE s.name = 'poisoned'"
                )
            ).one()
        return str(row.state), int(row.attempt), int(row.lost_count), str(row.last_error)

    wait_until(lambda: poisoned()[0] == "DEAD", timeout=90, what="the poison event quarantined")
    _, attempt, lost, error = poisoned()
    # Three deaths in batches of its own; a first batch that held others too counts nothing
    # (which delivery killed it is not known) and isolates it: one try more.
    assert lost == 3 and attempt in (3, 4), (attempt, lost)
    assert error.startswith("E_WORKER_LOST: quarantined")
    with db.connect() as conn:  # each death logged: its attempt, its Error and exception
        logged = conn.execute(
            text(
                "SELECT p.attempt, p.outcome, x.type FROM published_messages p"
                " JOIN subscription s USING (subscription_id)"
                " LEFT JOIN log_exception x"
                " ON x.delivery_id = p.delivery_id AND x.attempt = p.attempt"
                " WHERE s.name = 'poisoned' ORDER BY p.id"
            )
        ).all()
    assert [tuple(r) for r in logged] == [
        *((n, "FAILED", "WorkerLost") for n in range(attempt - 1)),
        (attempt - 1, "DEAD", "WorkerLost"),
    ]
    wait_until(lambda: len(recorder.times("/push")) == 10, timeout=30, what="the other events")
    # The push subscription takes the poison event too: it may have shared the batch that
    # killed its worker, and is delivered all the same (at least once).
    wait_until(lambda: recorder.times("/push", "p") != [], timeout=30, what="the poison's push")
    with db.connect() as conn:  # no death counted against a delivery that only shared a batch
        innocent = conn.execute(
            text(
                "SELECT count(*), max(d.lost_count), count(*) FILTER (WHERE d.state = 'DEAD')"
                " FROM delivery d JOIN subscription s USING (subscription_id)"
                " WHERE s.name <> 'poisoned'"
            )
        ).one()
    assert (innocent[0], innocent[1], innocent[2]) == (11, 0, 0), innocent
    assert worker.alive()  # its pool replaced the killed children and went on
    assert time.monotonic() - started < 90
