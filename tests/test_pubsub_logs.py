"""The pub/sub logs against real processes: the queue message log of a push, a pull and a
consumer delivery that fail once and then succeed (every state in order, the Error row's
exception), published_messages from the moment an event is accepted (a delayed one
included) to its outcome, and a pull nobody takes expiring."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

from orderly.client import Client
from tests.helpers import OrderlyCli, wait_until
from tests.push_recorder import Recorder
from tests.stack import Stack

SECRET = "test-secret-of-enough-length"
ROOT = Path(__file__).resolve().parent.parent
FAILED_ONCE = ["Pending", "In process", "Error", "Pending", "In process", "Completed"]


def _delivery(db: Engine, subscription_id: int, routing_key: str = "a") -> tuple[int, str]:
    with db.connect() as conn:
        row = conn.execute(
            text(
                "SELECT d.delivery_id, d.state FROM delivery d JOIN event e USING (event_id)"
                " WHERE d.subscription_id = :s AND e.routing_key = :k"
            ),
            {"s": subscription_id, "k": routing_key},
        ).one()
    return int(row.delivery_id), str(row.state)


def _oldest_first(rows: Sequence[Any]) -> list[Any]:
    return sorted(rows, key=lambda r: r["id"])


def test_queue_log_and_published_messages_of_push_pull_and_consumer(
    stack: Stack, db: Engine, recorder: Recorder, cli: OrderlyCli
) -> None:
    stack.env(
        AURA_QUEUE_MANAGER_INTERVAL="20",
        ORDERLY_TOKEN_SECRET=SECRET,
        ORDERLY_HANDLER_MODULES="tooling.handlers,tests.pubsub_consumers",
        PYTHONPATH=str(ROOT),  # the workers import this test's consumers
    )
    stack.start_api()
    stack.worker("w1", concurrency=1)
    stack.beat()  # retries, returns of unACKed pulls and expiries from here
    client = Client(stack.url, stack.token)
    http = stack.http
    room = {"name": "orders", "delivery_delay_ms": 50, "delivery_delay_multiplier": 2.0}
    assert http.post("/rooms", json={**room, "delivery_attempts": 3}).status_code == 201
    expiring = {**room, "name": "short", "message_expiration_ms": 1500}
    assert http.post("/rooms", json=expiring).status_code == 201
    push = client.subscribe(
        "orders",
        {"name": "push", "kind": "PUSH", "push_url": f"{recorder.base}/push",
         "routing_key_pattern": "a"},
    )["subscription_id"]  # fmt: skip
    consumer = client.subscribe(
        "orders",
        {"name": "consumer", "kind": "HANDLER", "handler": "test.fail_first",
         "routing_key_pattern": "a"},
    )["subscription_id"]  # fmt: skip
    puller = client.subscribe(
        "orders", {"name": "pull", "kind": "PULL", "visibility_timeout_ms": 100}
    )["subscription_id"]
    untaken = client.subscribe("short", {"name": "untaken", "kind": "PULL"})["subscription_id"]
    recorder.fail[("/push", "a")] = 1  # the first push answers 503

    # A delayed event has its published_messages row, PENDING, before it is due.
    delayed = client.publish("orders", {"routing_key": "later", "payload": {}, "$delay": 600_000})
    (pending,) = client.published(correlation_id=delayed.correlation_id)
    assert (pending["outcome"], pending["attempt"], pending["delivered_at"]) == ("PENDING", 0, None)
    assert pending["next_attempt_at"] > pending["published_at"]
    (waiting,) = client.queue_log(correlation_id=delayed.correlation_id)
    assert waiting["state"] == "Pending" and waiting["scheduled_start_time"] is not None
    assert waiting["scheduled_start_time"] == pending["next_attempt_at"]

    client.publish("orders", {"routing_key": "a", "payload": {"n": 1}})
    client.publish("short", {"routing_key": "a", "payload": {"n": 2}})
    taken = client.pull(puller, 10)  # taken, never ACKed: it comes back after 100 ms
    assert [m["routing_key"] for m in taken] == ["a"]

    again: list[Any] = []

    def returned() -> bool:
        again[:] = client.pull(puller, 10)
        return bool(again)

    wait_until(returned, timeout=30, what="the unACKed pull back")
    assert again[0]["attempt"] == 1
    client.ack_pulled(puller, again[0]["delivery_id"], again[0]["receipt"])
    for subscription in (push, consumer, puller):
        wait_until(
            lambda s=subscription: _delivery(db, s)[1] == "DELIVERED",  # type: ignore[misc]
            timeout=30,
            what=f"subscription {subscription} delivered",
        )
    wait_until(lambda: _delivery(db, untaken)[1] == "EXPIRED", timeout=30, what="expiry")

    errors: dict[int, Any] = {}
    for subscription in (push, consumer, puller):
        delivery_id, _ = _delivery(db, subscription)
        log = _oldest_first(client.queue_log(delivery_id=delivery_id))
        assert [r["state"] for r in log] == FAILED_ONCE, subscription
        assert [r["attempt"] for r in log] == [0, 0, 0, 1, 1, 1]
        assert {r["subscription_id"] for r in log} == {subscription}
        assert all(json.loads(r["message"]) == {"n": 1} and r["routing_key"] == "a" for r in log)
        error = log[2]
        assert error["exception_id"] is not None
        assert [r["exception_id"] for r in log if r is not error] == [None] * 5
        assert error["start_time"] is None or error["start_time"] <= error["end_time"]
        ran = [r for r in log if r["state"] in ("Error", "Completed")]
        if subscription == puller:  # processed by its subscriber, not by orderly
            assert [r["memory_used"] for r in ran] == [None, None]
        else:
            assert all(r["memory_used"] is not None for r in ran)
        errors[subscription] = client.exception(error["exception_id"])
        assert errors[subscription]["delivery_id"] == delivery_id
        assert errors[subscription]["attempt"] == 0
        published = _oldest_first(client.published(delivery_id=delivery_id))
        assert [(p["attempt"], p["outcome"]) for p in published] == [
            (0, "FAILED"),
            (1, "DELIVERED"),
        ]
        assert published[1]["delivered_at"] is not None

    # The consumer threw: its exception's type, message and traceback.
    thrown = errors[consumer]
    assert thrown["type"] == "tests.pubsub_consumers.FirstAttemptFails"
    assert thrown["message"].startswith("attempt 0 of ")
    assert thrown["traceback"].startswith("Traceback (most recent call last):")
    assert "pubsub_consumers.py" in thrown["traceback"]
    assert "FirstAttemptFails: attempt 0 of" in thrown["traceback"]
    # The consumer's second attempt allocated its 2 MB block (less what the attempt freed of
    # what was there before it: the peak is measured from the memory traced when it began).
    consumer_log = client.queue_log(delivery_id=_delivery(db, consumer)[0], state="Completed")
    assert 1_900_000 <= consumer_log[0]["memory_used"] < 10_000_000
    # A push and a pull fail without an exception in orderly: the answer, the timeout.
    assert errors[push]["type"] == "PushFailed"
    assert errors[push]["message"].startswith("HTTP 503")
    assert errors[push]["traceback"] is None
    assert errors[puller]["type"] == "NotAcknowledged"
    assert "100 ms" in errors[puller]["message"] and errors[puller]["traceback"] is None

    # A pull nobody took: expired, in published_messages and in the queue log.
    expired_id, _ = _delivery(db, untaken)
    (gone,) = client.published(delivery_id=expired_id)
    assert (gone["attempt"], gone["outcome"], gone["delivered_at"]) == (0, "EXPIRED", None)
    states = _oldest_first(client.queue_log(delivery_id=expired_id))
    assert [r["state"] for r in states] == ["Pending", "Error"]
    assert client.exception(states[1]["exception_id"])["type"] == "MessageExpired"

    # Filters: by queue and state; exceptions by type.
    assert {r["delivery_id"] for r in client.queue_log(subscription_id=push)} == {
        _delivery(db, push)[0]
    }
    assert len(client.queue_log(state="Error")) == 4
    listed = client.exceptions(type="NotAcknowledged")
    assert [x["id"] for x in listed] == [errors[puller]["id"]] and listed[0][
        "has_traceback"
    ] is False

    # The command line shows the same rows, and one exception with its traceback.
    consumer_id = _delivery(db, consumer)[0]
    shown = cli("log", "queue", "--delivery", str(consumer_id), "--json")
    assert shown.returncode == 0, shown.stderr
    assert [r["state"] for r in reversed(json.loads(shown.stdout))] == FAILED_ONCE
    detail = cli("log", "exception", str(errors[consumer]["id"]))
    assert detail.returncode == 0, detail.stderr
    assert "FirstAttemptFails: attempt 0 of" in detail.stdout and "Traceback" in detail.stdout
    missing = cli("log", "exception", "999999")
    assert missing.returncode == 2 and "exception" in missing.stderr
    bad = cli("log", "queue", "--state", "Done")
    assert bad.returncode == 2 and "state" in bad.stderr
    client.close()


def test_a_dead_letter_and_its_redrive_in_the_logs(db: Engine) -> None:
    """In process on the real store: a push with no retries left is dead-lettered (its
    attempt DEAD, an Error with its PushFailed exception); a re-drive publishes it again
    (attempt 0 PENDING, Pending in the queue log) and the next try completes."""
    from orderly.worker import pubsub
    from orderly.worker.pubsub import Attempt

    pubsub.create_room(db, {"name": "r", "delivery_attempts": 0})
    sub = pubsub.create_subscription(
        db, "r", {"name": "p", "kind": "PUSH", "push_url": "http://127.0.0.1:9/p"}
    )["subscription_id"]
    (delivery_id,) = pubsub.publish_many(db, "r", [({"n": 1}, "k", 0)])
    refused = Attempt(False, "HTTP 410: b'gone'")
    assert pubsub.deliver(db, delivery_id, lambda c: refused) == "DEAD"
    assert pubsub.redrive(db, subscription_id=sub) == [delivery_id]
    assert pubsub.deliver(db, delivery_id, lambda c: Attempt(True)) == "DELIVERED"
    log = _oldest_first(pubsub.queue_log(db, delivery_id=delivery_id))
    assert [(r["state"], r["attempt"]) for r in log] == [
        ("Pending", 0),
        ("In process", 0),
        ("Error", 0),
        ("Pending", 0),
        ("In process", 0),
        ("Completed", 0),
    ]
    failure = pubsub.exception_get(db, log[2]["exception_id"])
    assert (failure["type"], failure["message"], failure["traceback"]) == (
        "PushFailed",
        "HTTP 410: b'gone'",
        None,
    )
    published = _oldest_first(pubsub.published_log(db, delivery_id=delivery_id))
    assert [(p["attempt"], p["outcome"]) for p in published] == [(0, "DEAD"), (0, "DELIVERED")]
    assert "attempts spent" in published[0]["error"]
