"""Replay and backfill: a subscription's events sent again from a point in time.

A replay covers the room's events published in ``[since, until)`` (``until`` open: up to now)
for one subscription, bounded by what retention kept (the purge's) and by the room's
expiration (an expired event is not sent again):

- the events it already had a delivery of are sent again whatever became of them
  (DELIVERED, DEAD, EXPIRED): attempts start over, due now. A delivery still PENDING or
  IN_PROCESS is in flight and left alone, so nothing is sent twice at once;
- the events it never had (published before it existed, or before its pattern selected
  them) and that it selects now are backfilled: new deliveries, due now.

Both keep each key's order on an ordered subscription: a key's deliveries go in publish
order (by event, whatever their delivery ids), so a backfilled older event goes before the
later ones; a later delivery of the key already in flight is not waited for. A new
subscription may ask for a backfill when it is made (``backfill_since``), in the transaction
that makes it: an event whose publish commits while the subscription is being made may be
missed, and a replay from the same time picks it up. HANDLER subscriptions are not replayed:
their consumers take an event only with the token it was published with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import Connection, Engine

from orderly.models import SubscriptionKind
from orderly.worker.core import owners
from orderly.worker.core.errors import InvalidMessage, NotFound
from orderly.worker.core.inputs import UtcTime, parse_input
from orderly.worker.core.owners import Owns
from orderly.worker.db.queries import sql
from orderly.worker.pubsub.routing import Route, order_value

# Events read per round trip of a backfill.
BACKFILL_BATCH = 1000


class ReplayIn(BaseModel):
    """Send a subscription's events again: those published from ``since`` (until ``until``)."""

    model_config = ConfigDict(extra="forbid")

    since: UtcTime
    until: UtcTime | None = None


@dataclass(frozen=True)
class Replayed:
    replayed: int  # deliveries sent again
    backfilled: int  # deliveries made for events the subscription never had


def replay(engine: Engine, subscription_id: int, data: Any, owns: Owns | None = None) -> Replayed:
    """Replay a subscription's events in ``data`` (ReplayIn); another's subscription (not in
    ``owns``) is not found. The backfill goes a batch of events per transaction, so that the
    subscription's claims wait for one batch at most."""
    asked = parse_input(ReplayIn, data)
    if asked.until is not None and asked.until <= asked.since:
        raise InvalidMessage("until", f"must be after since ({asked.since.isoformat()})")
    owned = owners.subscriptions(owns)
    with engine.begin() as conn:
        found = _subscription(conn, subscription_id, owned)
        window = {"since": asked.since, "until": asked.until}
        moved = conn.execute(sql("deliveries_replay"), {"s": subscription_id, **window})
        replayed = int(moved.scalar_one())
        backfilled, after = backfill_batch(conn, found, asked.since, asked.until, None)
    while after is not None:
        with engine.begin() as conn:
            found = _subscription(conn, subscription_id, owned)
            made, after = backfill_batch(conn, found, asked.since, asked.until, after)
            backfilled += made
    return Replayed(replayed, backfilled)


def _subscription(conn: Connection, subscription_id: int, owned: list[int] | None) -> Any:
    found = conn.execute(sql("replay_subscription"), {"s": subscription_id, "owned": owned}).first()
    if found is None:
        raise NotFound("subscription", subscription_id)
    refuse_handler(found.kind, "subscription_id")
    return found


def refuse_handler(kind: str, field: str) -> None:
    """A HANDLER subscription's consumers take an event only with its token, signed when it
    was published and valid for ORDERLY_TOKEN_TTL_MS: its events are not sent again."""
    if kind == SubscriptionKind.HANDLER.value:
        raise InvalidMessage(
            field,
            "a HANDLER subscription's consumers take an event only with the token it was "
            "published with (valid for ORDERLY_TOKEN_TTL_MS): replay and backfill are for PUSH "
            "and PULL subscriptions",
        )


def backfill(conn: Connection, sub: Any, since: datetime, until: datetime | None) -> int:
    """Deliveries for the room's events in ``[since, until)`` that ``sub`` (a
    replay_subscription row) selects and has none of, in this transaction; how many."""
    made, after = backfill_batch(conn, sub, since, until, None)
    while after is not None:
        more, after = backfill_batch(conn, sub, since, until, after)
        made += more
    return made


After = tuple[datetime, int]


def backfill_batch(
    conn: Connection, sub: Any, since: datetime, until: datetime | None, after: After | None
) -> tuple[int, After | None]:
    """One batch of :func:`backfill` from ``after`` (None: the window's start): deliveries
    made, and where the next batch starts (None: the window is done). Due now, or at their
    ``$delay`` still ahead."""
    route = Route(
        subscription_id=int(sub.subscription_id),
        kind=str(sub.kind),
        event_type_id=sub.event_type_id,
        routing_key_pattern=sub.routing_key_pattern,
        order_key=sub.order_key,
        min_version=sub.min_version,
        max_version=sub.max_version,
        name=str(sub.name),
    )
    events = conn.execute(
        sql("backfill_candidates"),
        {
            "room_id": sub.room_id,
            "s": route.subscription_id,
            "since": since,
            "until": until,
            "after_at": None if after is None else after[0],
            "after_id": None if after is None else after[1],
            "limit": BACKFILL_BATCH,
        },
    ).all()
    if not events:
        return 0, None
    chosen = [e for e in events if route.selects(e.event_type_id, e.version, e.routing_key)]
    made = 0
    if chosen:
        rows = conn.execute(
            sql("deliveries_insert"),
            {
                "event_ids": [int(e.event_id) for e in chosen],
                "subscription_ids": [route.subscription_id] * len(chosen),
                "pulls": [route.pull] * len(chosen),
                "order_values": [
                    order_value(_payload(e.payload), route.order_key) if route.order_key else None
                    for e in chosen
                ],
                "next_attempt_ats": [e.deliver_at for e in chosen],
                "scheduled_ats": [e.deliver_at for e in chosen],
            },
        ).all()
        made = len(rows)
        conn.execute(sql("events_routed"), {"ids": [int(r.event_id) for r in rows]})
    last = events[-1]
    done = len(events) < BACKFILL_BATCH
    return made, None if done else (last.published_at, int(last.event_id))


def _payload(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value
