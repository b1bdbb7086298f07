"""An event's rows: its room as a publish needs it (one round trip), the subscriptions it goes
to, and the event with its deliveries inserted (worker.pubsub.publish stores through here)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from orderly.worker import nodes
from orderly.worker.core import tracing
from orderly.worker.core.due import DEFAULT_LEASE_MS
from orderly.worker.core.errors import NotFound, SettingMissing
from orderly.worker.db.queries import sql
from orderly.worker.pubsub.routing import Route, order_value, routes

# A delivery handed to the broker right after the commit is out of the ticker's sight this
# long; if that hand-off is lost, the ticker brings it back (worker.core.due).
QUEUED_LEASE_S = DEFAULT_LEASE_MS / 1000


def context(conn: Connection, room_name: str) -> tuple[Any, dict[str, int], list[Route]]:
    room = conn.execute(sql("publish_context"), {"name": room_name}).first()
    if room is None:
        raise NotFound("room", room_name)
    return room, dict(room.publishers), routes(room.subscriptions)


def selected(
    subscriptions: list[Route],
    named: frozenset[str],
    event_type_id: int | None,
    version: int | None,
    routing_key: str,
) -> list[Route]:
    """The subscriptions an event goes to: the ones it names, and the ones that select it."""
    return [
        s
        for s in subscriptions
        if s.name in named or s.selects(event_type_id, version, routing_key)
    ]


def store(
    conn: Connection,
    room: Any,
    now: datetime,
    events: Sequence[dict[str, Any]],
    subscriptions: list[Route],
    *,
    event_type_id: int | None = None,
    version: int | None = None,
    publisher_id: int | None = None,
    user: str | None = None,
    impersonator: str | None = None,
    node_id: int | None = None,
    idempotency_key: str | None = None,
    idempotency_hash: str | None = None,
    named: frozenset[str] = frozenset(),
) -> tuple[list[tuple[int, str]], list[tuple[int, int, bool]]]:
    """Insert events (dicts of correlation_id, token, routing_key, payload, deliver_at, and
    trace_parent when not the span running now) and
    their deliveries; ``[(event_id, correlation_id)]`` and ``[(delivery_id, event_id, due)]``
    where due means handed to the broker after the commit (not delayed, not pulled).

    With ``node_id``, only through that node in RUN (NodeNotAccepting otherwise)."""
    expires_at = (
        now + timedelta(milliseconds=room.message_expiration_ms)
        if room.message_expiration_ms
        else None
    )
    matched = [
        selected(subscriptions, named, event_type_id, version, e["routing_key"]) for e in events
    ]
    unsigned = (
        e["token"] is None and any(s.handler for s in m)
        for e, m in zip(events, matched, strict=True)
    )
    if any(unsigned):
        # Its consumers would refuse every unsigned event: dead letters, not deliveries.
        raise SettingMissing(
            "ORDERLY_TOKEN_SECRET",
            "the event matches handler subscriptions, whose consumers take only events "
            "signed with it; set it (the workers' value) and publish again",
        )
    current = tracing.current_parent()
    inserted = conn.execute(
        sql("events_insert"),
        {
            "room_id": room.room_id,
            "event_type_id": event_type_id,
            "version": version,
            "publisher_id": publisher_id,
            "user_id": user,
            "impersonator_id": impersonator,
            "published_at": now,
            "expires_at": expires_at,
            "correlation_ids": [e["correlation_id"] for e in events],
            "tokens": [e["token"] for e in events],
            "routing_keys": [e["routing_key"] for e in events],
            "payloads": [e["payload_text"] for e in events],
            "deliver_ats": [e["deliver_at"] for e in events],
            "unroutables": [not m for m in matched],
            "node_id": node_id,
            "idempotency_key": idempotency_key,
            "idempotency_hash": idempotency_hash,
            # each delivery's send continues its publish's trace (the span running now, or
            # the one its publish was taken in, when stored with others: group commit)
            "trace_parents": [e.get("trace_parent", current) for e in events],
        },
    ).all()
    if not inserted and events and node_id is not None:
        raise nodes.refusal(conn, node_id)
    ids = {row.correlation_id: int(row.event_id) for row in inserted}
    lease = now + timedelta(seconds=QUEUED_LEASE_S)
    rows: dict[str, list[Any]] = {
        k: [] for k in ("event_ids", "subscription_ids", "pulls", "order_values")
    }
    rows["next_attempt_ats"], rows["scheduled_ats"] = [], []
    due: dict[tuple[int, int], bool] = {}
    for event, subs in zip(events, matched, strict=True):
        event_id = ids[event["correlation_id"]]
        for sub in subs:
            now_due = event["deliver_at"] <= now and not sub.pull
            rows["event_ids"].append(event_id)
            rows["subscription_ids"].append(sub.subscription_id)
            rows["pulls"].append(sub.pull)
            rows["order_values"].append(
                order_value(event["payload"], sub.order_key) if sub.order_key else None
            )
            rows["next_attempt_ats"].append(event["deliver_at"])
            rows["scheduled_ats"].append(lease if now_due else event["deliver_at"])
            due[(event_id, sub.subscription_id)] = now_due
    if not due:
        return [(int(r.event_id), r.correlation_id) for r in inserted], []
    made = conn.execute(sql("deliveries_insert"), rows).all()
    deliveries = sorted(
        (int(r.delivery_id), int(r.event_id), due[(int(r.event_id), int(r.subscription_id))])
        for r in made
    )
    return [(int(r.event_id), r.correlation_id) for r in inserted], deliveries
