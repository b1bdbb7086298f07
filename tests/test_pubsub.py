"""Rooms and subscriptions: routing, publish, backoff, delays, dead letters, on the real store
and, end to end, with real worker processes pushing to a real HTTP server."""

from __future__ import annotations

import itertools
import json
import threading
import time
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from orderly.worker import pubsub
from orderly.worker.celery import DELIVER_QUEUE
from orderly.worker.pubsub import topic_matches
from tests.helpers import OrderlyCli, queued, wait_until
from tests.push_recorder import Recorder
from tests.stack import Stack


@pytest.mark.parametrize(
    ("pattern", "key", "match"),
    [
        ("echo", "echo", True),
        ("echo", "echo.x", False),
        ("order.*", "order.created", True),
        ("order.*", "order.created.eu", False),
        ("order.#", "order", True),
        ("order.#", "order.created.eu", True),
        ("#.eu", "order.created.eu", True),
        ("*.created", "invoice.created", True),
        ("*.created", "created", False),
        ("#", "anything.at.all", True),
    ],
)
def test_topic_matching(pattern: str, key: str, match: bool) -> None:
    assert topic_matches(pattern, key) is match


ROOM = {
    "name": "orders",
    "delivery_delay_ms": 100,
    "delivery_delay_multiplier": 2.0,
    "delivery_attempts": 4,
}
SCHEMA = {
    "type": "object",
    "required": ["id", "customer"],
    "properties": {
        "id": {"type": "integer"},
        "customer": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}},
    },
}


def setup_room(client: TestClient, push_url: str = "http://127.0.0.1:9/in") -> None:
    assert client.post("/rooms", json=ROOM).status_code == 201
    answer = client.post(
        "/rooms/orders/event-types", json={"name": "order.created", "version": 1, "schema": SCHEMA}
    )
    assert answer.status_code == 201, answer.text


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "/rooms",
            {**ROOM, "name": "r2", "delivery_delay_multiplier": 1.0},
            "delivery_delay_multiplier",
        ),
        ("/rooms", {**ROOM, "name": "r2", "delivery_attempts": -1}, "delivery_attempts"),
        ("/rooms", {**ROOM, "name": "bad name"}, "name"),
        ("/rooms/orders/subscriptions", {"name": "s", "kind": "PUSH"}, "push_url"),
        ("/rooms/orders/subscriptions", {"name": "s", "kind": "HANDLER"}, "handler"),
        (
            "/rooms/orders/subscriptions",
            {"name": "s", "kind": "PUSH", "push_url": "http://x/in", "routing_key_pattern": "a..b"},
            "routing_key_pattern",
        ),
        (
            "/rooms/orders/subscriptions",
            {"name": "s", "kind": "PUSH", "push_url": "http://x/in", "event_type": "nope"},
            "event_type",
        ),
        ("/rooms/orders/event-types", {"name": "t", "version": 1, "schema": {"type": 5}}, "schema"),
    ],
)
def test_invalid_definitions_are_refused(
    client: TestClient, db: Engine, path: str, body: dict[str, Any], field: str
) -> None:
    setup_room(client)
    answer = client.post(path, json=body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["errors"][0]["field"] == field
    raw = b'{"name": "inf", "delivery_delay_ms": 1, "delivery_delay_multiplier": Infinity}'
    inf = client.post("/rooms", content=raw, headers={"content-type": "application/json"})
    assert inf.status_code == 422 and inf.json()["errors"][0]["field"] == (
        "delivery_delay_multiplier"
    )
    unknown = client.patch("/rooms/orders", json={"colour": "red"})
    assert unknown.status_code == 422 and unknown.json()["errors"][0]["field"] == "colour"
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM subscription")).scalar_one() == 0
        assert conn.execute(text("SELECT count(*) FROM room")).scalar_one() == 1
        assert conn.execute(text("SELECT count(*) FROM event_type")).scalar_one() == 1


def test_publish_fans_out_to_matching_active_subscriptions(
    client: TestClient, db: Engine, redis_client: redis.Redis
) -> None:
    setup_room(client)
    for name, pattern in (("all", None), ("created", "order.created"), ("eu", "order.*.eu")):
        body = {"name": name, "kind": "PUSH", "push_url": "http://127.0.0.1:9/in"}
        if pattern:
            body["routing_key_pattern"] = pattern
        assert client.post("/rooms/orders/subscriptions", json=body).status_code == 201
    paused = client.post(
        "/rooms/orders/subscriptions",
        json={"name": "paused", "kind": "PUSH", "push_url": "http://127.0.0.1:9/in"},
    ).json()["subscription_id"]
    client.patch(f"/subscriptions/{paused}", json={"status": "PAUSED"})
    answer = client.post(
        "/rooms/orders/events",
        json={"event_type": "order.created", "payload": {"id": 1, "customer": {"age": 30}}},
    )
    assert answer.status_code == 201, answer.text
    body = answer.json()
    assert len(body["deliveries"]) == 2 and not body["unroutable"]  # all + created
    # Due now: enqueued after the commit, the whole fan-out in one task.
    assert queued(DELIVER_QUEUE) == 1
    unroutable = client.post(
        "/rooms/orders/events", json={"routing_key": "order.deleted.us", "payload": {}}
    )
    assert unroutable.json()["unroutable"] is False  # "all" takes every event
    client.patch("/subscriptions/1", json={"status": "PAUSED"})
    lost = client.post("/rooms/orders/events", json={"routing_key": "x.y", "payload": {}}).json()
    assert lost["unroutable"] is True and lost["deliveries"] == []
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM event WHERE unroutable")).scalar_one() == 1
    assert client.get("/rooms").json()[0]["unroutable"] == 1  # counted


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"customer": {}}, "payload"),  # id missing
        ({"id": "one", "customer": {}}, "payload.id"),
        ({"id": 1, "customer": {"age": -3}}, "payload.customer.age"),
    ],
)
def test_schema_failures_name_the_path(
    client: TestClient, db: Engine, payload: dict[str, Any], field: str
) -> None:
    setup_room(client)
    answer = client.post(
        "/rooms/orders/events", json={"event_type": "order.created", "payload": payload}
    )
    assert answer.status_code == 422
    assert answer.json()["errors"][0]["field"] == field
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM event")).scalar_one() == 0


# --- end to end -----------------------------------------------------------------------------


def test_push_backoff_overrides_expiry_delay_and_dead_letters(
    stack: Stack, db: Engine, redis_client: redis.Redis, recorder: Recorder
) -> None:
    stack.env(AURA_QUEUE_MANAGER_INTERVAL="20")  # the scheduler's turn
    stack.start_api()
    stack.workers({"w1": "w1", "w2": "w2"}, concurrency=1)
    stack.beat()  # due work goes to the broker from here
    http = stack.http
    assert http.post("/rooms", json=ROOM).status_code == 201
    assert (
        http.post(
            "/rooms", json={**ROOM, "name": "short", "message_expiration_ms": 450}
        ).status_code
        == 201
    )

    def subscribe(room: str, name: str, **extra: Any) -> int:
        body = {"name": name, "kind": "PUSH", "push_url": f"{recorder.base}/{name}", **extra}
        answer = http.post(f"/rooms/{room}/subscriptions", json=body)
        assert answer.status_code == 201, answer.text
        return int(answer.json()["subscription_id"])

    subscribe("orders", "retry")  # room policy: 100 ms x 2^n, 4 sends
    fast = subscribe("orders", "fast", delivery_delay_ms=50, delivery_delay_multiplier=3.0)
    never = subscribe("orders", "never", delivery_attempts=0)
    subscribe("short", "expiring")
    # Failures of the events with routing key "a" only: the delayed one never takes one.
    recorder.fail.update(
        {("/retry", "a"): 3, ("/fast", "a"): 2, ("/never", "a"): 1, ("/expiring", "a"): 10}
    )

    published = time.monotonic()
    assert (
        http.post(
            "/rooms/orders/events", json={"routing_key": "a", "payload": {"n": 1}}
        ).status_code
        == 201
    )
    assert (
        http.post("/rooms/short/events", json={"routing_key": "a", "payload": {}}).status_code
        == 201
    )
    delayed_at = time.monotonic()
    assert (
        http.post(
            "/rooms/orders/events", json={"routing_key": "later", "payload": {}, "$delay": 700}
        ).status_code
        == 201
    )

    wait_until(lambda: len(recorder.times("/retry")) >= 4, timeout=30, what="retries")
    wait_until(lambda: len(recorder.times("/fast")) >= 3, timeout=30, what="fast retries")

    # Each failed attempt's retry waits T = delay * multiplier ^ attempt: the waits recorded
    # for the attempts are exactly the formula's, and no retry came before its wait was over
    # (a retry's wait starts when its failed attempt was answered, after it arrived here).
    # How soon after the wait it came depends on the machine, not on orderly's rules.
    for name, waits in (("retry", [200, 400, 800]), ("fast", [150, 450])):
        assert next_delays(db, name) == waits, name
        times = recorder.times(f"/{name}")[: len(waits) + 1]
        gaps = [(b - a) * 1000 for a, b in itertools.pairwise(times)]
        for gap, want in zip(gaps, waits, strict=True):
            assert want <= gap <= want + 10_000, (name, gaps, want)
    assert recorder.times("/retry")[0] - published < 30

    # The delayed message came once, not before its delay.
    wait_until(
        lambda: len([a for a in recorder.arrivals if a["body"]["routing_key"] == "later"]) >= 3,
        timeout=20,
        what="delayed deliveries",
    )
    later = [a for a in recorder.arrivals if a["body"]["routing_key"] == "later"]
    assert all(a["t"] - delayed_at >= 0.7 for a in later)
    assert sorted(a["path"] for a in later) == ["/fast", "/never", "/retry"]  # once each

    def states() -> dict[str, str]:
        with db.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT s.name, d.state FROM delivery d JOIN subscription s"
                    " USING (subscription_id) JOIN event e USING (event_id)"
                    " WHERE e.routing_key = 'a'"
                )
            )
            return {r.name: r.state for r in rows}

    wait_until(lambda: states().get("expiring") == "EXPIRED", timeout=20, what="expiry")
    wait_until(lambda: states().get("never") == "DEAD", timeout=20, what="dead letter")
    assert len(recorder.times("/never")) == 1  # attempts 0: no redelivery
    assert states()["retry"] == "DELIVERED" and states()["fast"] == "DELIVERED"
    # Never delivered late: every try of the expiring one was made before its room's
    # expiration (each try's start is recorded), and those tries are all that arrived here.
    with db.connect() as conn:
        tries = conn.execute(
            text(
                "SELECT p.published_at < e.expires_at AS in_time FROM published_messages p"
                " JOIN event e USING (event_id) JOIN subscription s USING (subscription_id)"
                " WHERE s.name = 'expiring' AND p.error IS DISTINCT FROM"
                " 'past the room''s message expiration' ORDER BY p.attempt"
            )
        ).all()
    assert tries and all(t.in_time for t in tries)
    assert len(tries) == len(recorder.times("/expiring"))

    with db.connect() as conn:
        attempts = conn.execute(
            text(
                "SELECT p.attempt, p.outcome FROM published_messages p JOIN subscription s"
                " USING (subscription_id) JOIN event e USING (event_id)"
                " WHERE s.name = 'retry' AND e.routing_key = 'a' ORDER BY p.attempt"
            )
        ).all()
    assert [(a.attempt, a.outcome) for a in attempts] == [
        (0, "FAILED"),
        (1, "FAILED"),
        (2, "FAILED"),
        (3, "DELIVERED"),
    ]

    letters = http.get("/dead-letters", params={"room": "orders"}).json()
    assert [d["subscription_id"] for d in letters] == [never]
    assert "attempts spent" in letters[0]["last_error"]
    redriven = http.post("/dead-letters/redrive", json={"subscription_id": never}).json()
    assert len(redriven["redriven"]) == 1
    wait_until(lambda: states().get("never") == "DELIVERED", timeout=20, what="re-drive")
    with db.connect() as conn:  # the override's two failures, then delivered
        fast_attempts = conn.execute(
            text(
                "SELECT p.attempt, p.outcome FROM published_messages p JOIN event e"
                " USING (event_id) WHERE p.subscription_id = :s AND e.routing_key = 'a'"
                " ORDER BY p.attempt"
            ),
            {"s": fast},
        ).all()
    assert [(a.attempt, a.outcome) for a in fast_attempts] == [
        (0, "FAILED"),
        (1, "FAILED"),
        (2, "DELIVERED"),
    ]


def next_delays(db: Engine, subscription: str) -> list[int]:
    """The retry waits recorded for a subscription's failed attempts of event "a"."""
    with db.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT p.next_delay_ms FROM published_messages p JOIN event e USING (event_id)"
                " JOIN subscription s USING (subscription_id)"
                " WHERE s.name = :s AND e.routing_key = 'a' AND p.outcome = 'FAILED'"
                " ORDER BY p.attempt"
            ),
            {"s": subscription},
        )
        return [int(r[0]) for r in rows]


def test_python_publish_and_the_cli(cli: OrderlyCli, db: Engine, redis_client: redis.Redis) -> None:
    from orderly.worker import pubsub

    done = cli("room", "create", "cli-room", "--delivery-delay-ms", "100", "--attempts", "0")
    assert done.returncode == 0, done.stderr
    refused = cli("room", "create", "bad", "--multiplier", "0.5")
    assert refused.returncode == 2 and "delivery_delay_multiplier" in refused.stderr
    done = cli(
        "subscription",
        "create",
        "cli-room",
        "hook",
        "--push-url",
        "http://127.0.0.1:9/in",
        "--pattern",
        "order.#",
    )
    assert done.returncode == 0, done.stderr
    done = cli("publish", "cli-room", '{"id": 1}', "--routing-key", "order.created")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["deliveries"]) == 1
    sent: list[list[int]] = []
    result = pubsub.publish_message(
        db, "cli-room", {"id": 2}, "order.paid", enqueue=sent.append, delay_ms=0
    )
    assert sent == [result.deliveries] and len(result.deliveries) == 1
    delayed = pubsub.publish_message(
        db, "cli-room", {"id": 3}, "order.paid", enqueue=sent.append, delay_ms=60_000
    )
    assert len(delayed.deliveries) == 1 and len(sent) == 1  # due later: the scheduler's
    listed = cli("room", "list")
    assert "cli-room" in listed.stdout
    changed = cli("subscription", "set", "1", "--attempts", "2")
    assert changed.returncode == 0 and json.loads(changed.stdout)["delivery_attempts"] == 2
    refused = cli("subscription", "set", "1", "--pattern", "a..b")
    assert refused.returncode == 2 and "routing_key_pattern" in refused.stderr
    # A handler subscription takes only signed events: a process without the secret may not
    # publish to it (its events would all go dead), and says which setting it lacks.
    secret = {"ORDERLY_TOKEN_SECRET": "cli-test-secret-of-enough-length"}
    handler = ["--handler", "test.record", "--pattern", "audit.#"]
    done = cli("subscription", "create", "cli-room", "audit", *handler, env=secret)
    assert done.returncode == 0, done.stderr
    with db.connect() as conn:
        events = conn.execute(text("SELECT count(*) FROM event")).scalar_one()
    refused = cli("publish", "cli-room", "{}", "--routing-key", "audit.login")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "ORDERLY_TOKEN_SECRET is not set" in refused.stderr
    assert "Traceback" not in refused.stderr
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM event")).scalar_one() == events
    done = cli("publish", "cli-room", "{}", "--routing-key", "audit.login", env=secret)
    assert done.returncode == 0, done.stderr


def test_subscriptions_change_and_event_types_list(client: TestClient) -> None:
    setup_room(client)
    sub = client.post(
        "/rooms/orders/subscriptions",
        json={"name": "s", "kind": "PUSH", "push_url": "http://127.0.0.1:9/in"},
    ).json()["subscription_id"]
    changed = client.patch(
        f"/subscriptions/{sub}", json={"delivery_attempts": 0, "routing_key_pattern": "a.#"}
    )
    assert changed.status_code == 200, changed.text
    assert changed.json()["delivery_attempts"] == 0
    for body, field in (
        ({"delivery_delay_multiplier": 1.0}, "delivery_delay_multiplier"),
        ({"routing_key_pattern": "a..b"}, "routing_key_pattern"),
        ({"kind": "PULL"}, "kind"),
        ({"status": "GONE"}, "status"),
    ):
        answer = client.patch(f"/subscriptions/{sub}", json=body)
        assert answer.status_code == 422 and answer.json()["errors"][0]["field"] == field
    listed = client.get("/rooms/orders/subscriptions").json()[0]
    assert listed["delivery_attempts"] == 0 and listed["routing_key_pattern"] == "a.#"
    types = client.get("/rooms/orders/event-types").json()
    assert types == [{"name": "order.created", "version": 1, "schema": SCHEMA}]
    assert client.patch("/subscriptions/999", json={"status": "PAUSED"}).status_code == 404


def _events(db: Engine) -> int:
    with db.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM event")).scalar_one())


def test_a_publish_retried_with_its_idempotency_key_is_stored_once(
    client: TestClient, db: Engine
) -> None:
    setup_room(client)
    sub = {"name": "p", "kind": "PUSH", "push_url": "http://127.0.0.1:9/in"}
    assert client.post("/rooms/orders/subscriptions", json=sub).status_code == 201
    body = {"routing_key": "a", "payload": {"n": 1}}
    first = client.post("/rooms/orders/events", json=body, headers={"Idempotency-Key": "k-1"})
    again = client.post("/rooms/orders/events", json=body, headers={"Idempotency-Key": "k-1"})
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json()  # the same event, the same deliveries
    assert first.json()["deliveries"] != []
    # The same key with another body is a mistake, not a repeat: refused, nothing stored.
    changed = {"routing_key": "a", "payload": {"n": 2}}
    clash = client.post("/rooms/orders/events", json=changed, headers={"Idempotency-Key": "k-1"})
    assert clash.status_code == 422
    assert clash.json()["errors"][0]["field"] == "Idempotency-Key"
    other = client.post("/rooms/orders/events", json=body, headers={"Idempotency-Key": "k-2"})
    plain = client.post("/rooms/orders/events", json=body)
    assert (other.status_code, plain.status_code) == (201, 201)
    assert _events(db) == 3
    for bad in ("has space", "x" * 201):
        refused = client.post("/rooms/orders/events", json=body, headers={"Idempotency-Key": bad})
        assert refused.status_code == 422
        assert refused.json()["errors"][0]["field"] == "Idempotency-Key"
    assert _events(db) == 3


def test_concurrent_publishes_with_one_key_store_one_event(db: Engine) -> None:
    pubsub.create_room(db, {"name": "r"})
    pubsub.create_room(db, {"name": "elsewhere"})
    results: list[pubsub.Published] = []
    barrier = threading.Barrier(4)

    def publish() -> None:
        barrier.wait()
        result, _ = pubsub.publish(
            db, "r", {"routing_key": "a", "payload": {}}, idempotency_key="same"
        )
        results.append(result)

    threads = [threading.Thread(target=publish) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len({r.event_id for r in results}) == 1 and len(results) == 4
    assert sorted(r.created for r in results) == [False, False, False, True]
    # The key is the room's: the same key in another room is another event.
    elsewhere, _ = pubsub.publish(
        db, "elsewhere", {"routing_key": "a", "payload": {}}, idempotency_key="same"
    )
    assert elsewhere.created and elsewhere.event_id != results[0].event_id
    assert _events(db) == 2


def test_an_api_without_the_token_secret_refuses_a_publish_for_handlers(
    client: TestClient, db: Engine
) -> None:
    from orderly.worker import pubsub

    assert client.post("/rooms", json={**ROOM, "name": "audit"}).status_code == 201
    # made by a process that has the secret (this API has none)
    pubsub.create_subscription(
        db,
        "audit",
        {"name": "h", "kind": "HANDLER", "handler": "test.record"},
        token_secret="another-process-secret-of-enough-length",
    )
    answer = client.post("/rooms/audit/events", json={"routing_key": "login", "payload": {}})
    assert answer.status_code == 500, answer.text
    (error,) = answer.json()["errors"]
    assert error["field"] == "setting"
    assert error["problem"].startswith("ORDERLY_TOKEN_SECRET is not set in this process")
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM event")).scalar_one() == 0
        assert conn.execute(text("SELECT count(*) FROM delivery")).scalar_one() == 0
