"""Subscriptions by event type version: one version (``event_version``) or a range
(``min_version``/``max_version``, either end open) is matched at publish; a subscription
without one takes every version; bad input is refused naming its field, and nothing is
stored. On the real store, through Python, the HTTP API and the command line."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from orderly.worker import pubsub
from orderly.worker.core.errors import InvalidMessage
from tests.helpers import OrderlyCli

SCHEMA = {"type": "object"}


@pytest.fixture
def room(db: Engine) -> Engine:
    pubsub.create_room(db, {"name": "orders"})
    for version in (1, 2, 3, 4):
        pubsub.add_event_type(
            db, "orders", {"name": "placed", "version": version, "schema": SCHEMA}
        )
    pubsub.add_event_type(db, "orders", {"name": "other", "version": 1, "schema": SCHEMA})
    return db


def _subscribe(engine: Engine, name: str, **selection: Any) -> int:
    body = {"name": name, "kind": "PULL", "event_type": "placed", **selection}
    return int(pubsub.create_subscription(engine, "orders", body)["subscription_id"])


def _reached(engine: Engine, version: int, event_type: str = "placed") -> set[str]:
    """The subscriptions a publish of ``event_type`` ``version`` reaches."""
    published, _ = pubsub.publish(
        engine, "orders", {"event_type": event_type, "version": version, "payload": {}}
    )
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT s.name FROM delivery d JOIN subscription s USING (subscription_id)"
                " WHERE d.event_id = :e"
            ),
            {"e": published.event_id},
        )
        return set(rows.scalars())


def test_versions_are_matched_at_publish(room: Engine) -> None:
    _subscribe(room, "every")  # no version: every version, as before
    _subscribe(room, "only-2", event_version=2)
    _subscribe(room, "2-to-3", min_version=2, max_version=3)
    _subscribe(room, "from-3", min_version=3)
    _subscribe(room, "up-to-1", max_version=1)
    pubsub.create_subscription(room, "orders", {"name": "all", "kind": "PULL"})
    assert _reached(room, 1) == {"every", "up-to-1", "all"}
    assert _reached(room, 2) == {"every", "only-2", "2-to-3", "all"}
    assert _reached(room, 3) == {"every", "2-to-3", "from-3", "all"}
    assert _reached(room, 4) == {"every", "from-3", "all"}
    # another event type with a version in every range: none of the typed ones
    assert _reached(room, 1, "other") == {"all"}
    listed = {s["name"]: s for s in pubsub.list_subscriptions(room, "orders")}
    assert (listed["only-2"]["min_version"], listed["only-2"]["max_version"]) == (2, 2)
    assert (listed["from-3"]["min_version"], listed["from-3"]["max_version"]) == (3, None)
    assert listed["every"]["event_type"] == "placed" and listed["all"]["event_type"] is None


@pytest.mark.parametrize(
    ("selection", "field", "problem"),
    [
        ({"min_version": 3, "max_version": 2}, "max_version", "below min_version 3"),
        ({"event_version": 2, "min_version": 1}, "min_version", "event_version or"),
        ({"event_version": 2, "max_version": 3}, "max_version", "event_version or"),
        ({"event_version": 9}, "event_version", "no version 9 (it has 1, 2, 3, 4)"),
        ({"event_version": 0}, "event_version", "greater than or equal to 1"),
        ({"min_version": -1}, "min_version", "greater than or equal to 1"),
        ({"max_version": "2"}, "max_version", "integer"),
        ({"event_type": None, "min_version": 1}, "min_version", "name one"),
        ({"event_type": None, "event_version": 1}, "event_version", "name one"),
    ],
)
def test_bad_version_selection_is_refused_and_nothing_stored(
    room: Engine, selection: dict[str, Any], field: str, problem: str
) -> None:
    body = {"name": "bad", "kind": "PULL", "event_type": "placed", **selection}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(InvalidMessage) as refused:
        pubsub.create_subscription(room, "orders", body)
    assert refused.value.field == field, refused.value.problems
    assert problem in refused.value.problem, refused.value.problems
    with room.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM subscription")).scalar_one() == 0


def test_the_api_and_the_cli_take_versions(
    room: Engine, client: TestClient, cli: OrderlyCli
) -> None:
    made = client.post(
        "/rooms/orders/subscriptions",
        json={"name": "v2", "kind": "PULL", "event_type": "placed", "event_version": 2},
    )
    assert made.status_code == 201, made.text
    assert (made.json()["min_version"], made.json()["max_version"]) == (2, 2)
    bad = client.post(
        "/rooms/orders/subscriptions",
        json={"name": "x", "kind": "PULL", "event_type": "placed", "min_version": 4,
              "max_version": 1},
    )  # fmt: skip
    assert bad.status_code == 422
    assert bad.json()["errors"][0]["field"] == "max_version"
    listed = client.get("/rooms/orders/subscriptions").json()
    assert [(s["name"], s["event_type"], s["min_version"], s["max_version"]) for s in listed] == [
        ("v2", "placed", 2, 2)
    ]
    ran = cli("subscription", "create", "orders", "range", "--pull", "--event-type", "placed",
              "--min-version", "2", "--max-version", "3")  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["max_version"] == 3
    refused = cli("subscription", "create", "orders", "wrong", "--pull", "--event-version", "2")
    assert refused.returncode == 2 and "event_version" in refused.stderr
    shown = cli("subscription", "list", "orders")
    assert "placed v2-3" in shown.stdout and "placed v2 " in shown.stdout
    assert _reached(room, 3) == {"range"}
    with room.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM subscription")).scalar_one() == 2
