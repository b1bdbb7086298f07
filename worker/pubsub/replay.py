"""Replay and backfill: a subscription's events sent again from a point in time.

A replay covers the room's events published in ``[since, until)`` (``until`` open: up to now)
for one subscription, bounded by what retention kept (the purge's) and by the room's
expiration (an expired event is not sent again):

- the events it already had a delivery of are sent again whatever became of them
  (DELIVERED, DEAD, EXPIRED): attempts start over, due now. A delivery still PENDING or
  IN_PROCESS is in flight and left alone, so nothing is sent twice at once;
- the events it never had (published before it existed, or before its pattern selected
  them) and that it selects now are backfilled: new deliveries, due now.

Both keep each key's order on an ordered subscription: deliveries go in event order, and an
earlier delivery of a key still goes before a later one. A new subscription may ask for a
backfill when it is made (``backfill_since``), in the transaction that makes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import Connection, Engine

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
    ``owns``) is not found."""
    asked = parse_input(ReplayIn, data)
    if asked.until is not None and asked.until <= asked.since:
        raise InvalidMessage("until", f"must be after since ({asked.since.isoformat()})")
    with engine.begin() as conn:
        found = conn.execute(
            sql("replay_subscription"),
            {"s": subscription_id, "owned": owners.subscriptions(owns)},
        ).first()
        if found is None:
            raise NotFound("subscription", subscription_id)
        window = {"since": asked.since, "until": asked.until}
        moved = conn.execute(sql("deliveries_replay"), {"s": subscription_id, **window})
        replayed = int(moved.scalar_one())
        backfilled = backfill(conn, found, asked.since, asked.until)
    return Replayed(replayed, backfilled)


def backfill(conn: Connection, sub: Any, since: datetime, until: datetime | None) -> int:
    """Deliveries for the room's events in ``[since, until)`` that ``sub`` (a
    replay_subscription row) selects and has none of, due now, in event order; how many."""
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
    made, after = 0, 0
    while True:
        events = conn.execute(
            sql("backfill_candidates"),
            {
                "room_id": sub.room_id,
                "s": route.subscription_id,
                "after": after,
                "since": since,
                "until": until,
                "limit": BACKFILL_BATCH,
            },
        ).all()
        if not events:
            return made
        after = int(events[-1].event_id)
        chosen = [e for e in events if route.selects(e.event_type_id, e.version, e.routing_key)]
        if chosen:
            rows = conn.execute(
                sql("deliveries_insert"),
                {
                    "event_ids": [int(e.event_id) for e in chosen],
                    "subscription_ids": [route.subscription_id] * len(chosen),
                    "pulls": [route.pull] * len(chosen),
                    "order_values": [
                        order_value(_payload(e.payload), route.order_key)
                        if route.order_key
                        else None
                        for e in chosen
                    ],
                    # a $delay still ahead waits for it; the rest are due now
                    "next_attempt_ats": [e.deliver_at for e in chosen],
                    "scheduled_ats": [e.deliver_at for e in chosen],
                },
            ).all()
            made += len(rows)
        if len(events) < BACKFILL_BATCH:
            return made


def _payload(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value
