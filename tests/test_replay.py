"""Replay and backfill (worker/pubsub/replay.py) on the real PostgreSQL: events sent again in
their order, nothing in flight sent twice, events a subscription never had backfilled, bad
windows refused with nothing changed."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from orderly.worker import pubsub
from orderly.worker.core.errors import InvalidMessage, NotFound
from orderly.worker.core.owners import Owns
from orderly.worker.pubsub.replay import replay


def _publish(db: Engine, room: str, key: str, n: int) -> None:
    pubsub.publish(db, room, {"routing_key": key, "payload": {"n": n}})


def _pulled(db: Engine, sub: int) -> list[dict[str, Any]]:
    return pubsub.pull(db, sub, 100)


def _states(db: Engine, sub: int) -> list[tuple[int, str, int]]:
    with db.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT (e.payload->>'n')::int AS n, d.state, d.attempt FROM delivery d"
                " JOIN event e USING (event_id) WHERE d.subscription_id = :s ORDER BY d.delivery_id"
            ),
            {"s": sub},
        )
        return [(r.n, r.state, r.attempt) for r in rows]


def test_a_replay_sends_again_in_order_and_leaves_what_is_in_flight(db: Engine) -> None:
    pubsub.create_room(db, {"name": "r"})
    sub = pubsub.create_subscription(db, "r", {"name": "q", "kind": "PULL"})["subscription_id"]
    before = datetime.now(UTC) - timedelta(seconds=1)
    for n in range(4):
        _publish(db, "r", "a", n)
        time.sleep(0.01)
    taken = _pulled(db, sub)
    for m in taken[:3]:
        pubsub.ack_pulled(db, sub, m["delivery_id"], m["receipt"])
    # the fourth is pulled, not ACKed: in flight
    done = replay(db, sub, {"since": before.isoformat()})
    assert (done.replayed, done.backfilled) == (3, 0)
    assert _states(db, sub) == [(0, "PENDING", 0), (1, "PENDING", 0), (2, "PENDING", 0),
                                (3, "IN_PROCESS", 0)]  # fmt: skip
    again = _pulled(db, sub)
    assert [m["payload"]["n"] for m in again] == [0, 1, 2]  # in order, the fourth not twice
    for m in again:
        pubsub.ack_pulled(db, sub, m["delivery_id"], m["receipt"])
    # a window: only what was published in it
    with db.connect() as conn:
        third = conn.execute(
            text("SELECT published_at FROM event WHERE (payload->>'n')::int = 2")
        ).scalar_one()
    done = replay(
        db,
        sub,
        {"since": third.isoformat(), "until": (third + timedelta(microseconds=1)).isoformat()},
    )
    assert (done.replayed, done.backfilled) == (1, 0)
    assert [m["payload"]["n"] for m in _pulled(db, sub)] == [2]


def test_backfill_gives_a_subscription_the_events_it_never_had(db: Engine) -> None:
    pubsub.create_room(db, {"name": "r"})
    since = datetime.now(UTC) - timedelta(seconds=1)
    _publish(db, "r", "a.x", 0)
    _publish(db, "r", "b.x", 1)
    _publish(db, "r", "a.y", 2)
    made = pubsub.create_subscription(
        db,
        "r",
        {
            "name": "q",
            "kind": "PULL",
            "routing_key_pattern": "a.*",
            "backfill_since": since.isoformat(),
        },
    )
    assert made["backfilled"] == 2
    assert [m["payload"]["n"] for m in _pulled(db, made["subscription_id"])] == [0, 2]
    # a later subscription asking from after them gets none
    later = pubsub.create_subscription(
        db,
        "r",
        {"name": "late", "kind": "PULL", "backfill_since": datetime.now(UTC).isoformat()},
    )
    assert later["backfilled"] == 0
    # a replay of the later one from the start backfills all three, in order
    done = replay(db, later["subscription_id"], {"since": since.isoformat()})
    assert (done.replayed, done.backfilled) == (0, 3)
    assert [m["payload"]["n"] for m in _pulled(db, later["subscription_id"])] == [0, 1, 2]
    # again: the ones now in flight are not made twice
    assert replay(db, later["subscription_id"], {"since": since.isoformat()}).backfilled == 0


def test_a_bad_window_or_anothers_subscription_changes_nothing(db: Engine) -> None:
    pubsub.create_room(db, {"name": "r"})
    sub = pubsub.create_subscription(db, "r", {"name": "q", "kind": "PULL"})["subscription_id"]
    now = datetime.now(UTC)
    _publish(db, "r", "a", 0)
    [m] = _pulled(db, sub)
    pubsub.ack_pulled(db, sub, m["delivery_id"], m["receipt"])
    for body, field in (
        ({"since": now.isoformat(), "until": (now - timedelta(seconds=1)).isoformat()}, "until"),
        ({"since": "yesterday"}, "since"),
        ({"since": "0001-01-01T00:00:00+05:00"}, "since"),  # before the first year in UTC
        ({"since": now.isoformat(), "extra": 1}, "extra"),
    ):
        with pytest.raises(InvalidMessage) as refused:
            replay(db, sub, body)
        assert refused.value.problems[0][0] == field
    with pytest.raises(NotFound):
        replay(
            db,
            sub,
            {"since": (now - timedelta(days=1)).isoformat()},
            Owns(subscriptions=frozenset({sub + 1})),
        )
    assert _states(db, sub) == [(0, "DELIVERED", 0)]
    with pytest.raises(InvalidMessage, match="backfill_since"):
        pubsub.create_subscription(db, "r", {"name": "b", "kind": "PULL", "backfill_since": "soon"})
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM subscription")).scalar_one() == 1


def test_replay_over_http(client: TestClient) -> None:
    assert client.post("/rooms", json={"name": "h"}).status_code == 201
    sub = client.post("/rooms/h/subscriptions", json={"name": "q", "kind": "PULL"}).json()
    since = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    client.post("/rooms/h/events", json={"routing_key": "a", "payload": {}})
    answer = client.post(f"/subscriptions/{sub['subscription_id']}/replay", json={"since": since})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"replayed": 0, "backfilled": 0}  # its one delivery is PENDING
    missing = client.post("/subscriptions/999999/replay", json={"since": since})
    assert missing.status_code == 404


def test_a_window_in_any_offset_is_read_in_utc(db: Engine) -> None:
    pubsub.create_room(db, {"name": "r"})
    sub = pubsub.create_subscription(db, "r", {"name": "q", "kind": "PULL"})["subscription_id"]
    # an offset PostgreSQL would refuse (beyond 15:59), and a time without one (UTC)
    for since in ("0451-05-02T08:41:28.36-21:05", "2026-01-01T00:00:00"):
        assert replay(db, sub, {"since": since}).replayed == 0


def test_a_backfill_keeps_a_keys_publish_order_and_handlers_are_not_replayed(db: Engine) -> None:
    pubsub.create_room(db, {"name": "r"})
    since = datetime.now(UTC) - timedelta(seconds=1)
    pubsub.publish(db, "r", {"routing_key": "a", "payload": {"n": 1, "k": "A"}})
    sub = pubsub.create_subscription(db, "r", {"name": "q", "kind": "PULL", "order_key": "k"})
    pubsub.publish(db, "r", {"routing_key": "a", "payload": {"n": 2, "k": "A"}})
    # the older event, backfilled now, gets the newer delivery id: it still goes first
    assert replay(db, sub["subscription_id"], {"since": since.isoformat()}).backfilled == 1
    order = []
    for _ in range(2):
        [m] = _pulled(db, sub["subscription_id"])
        order.append(m["payload"]["n"])
        pubsub.ack_pulled(db, sub["subscription_id"], m["delivery_id"], m["receipt"])
    assert order == [1, 2]
    with db.connect() as conn:  # no longer counted unroutable
        assert conn.execute(text("SELECT bool_or(unroutable) FROM event")).scalar_one() is False
    handler = {"name": "h", "kind": "HANDLER", "handler": "test.record"}
    made = pubsub.create_subscription(db, "r", handler, token_secret="s" * 32)
    with pytest.raises(InvalidMessage, match="HANDLER"):
        replay(db, made["subscription_id"], {"since": since.isoformat()})
    with pytest.raises(InvalidMessage) as refused:
        pubsub.create_subscription(
            db,
            "r",
            {**handler, "name": "h2", "backfill_since": since.isoformat()},
            token_secret="s" * 32,
        )
    assert refused.value.problems[0][0] == "backfill_since"
