"""PULL subscriptions (each its own queue) and dead letters: what subscribers and operators do
with deliveries."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints
from sqlalchemy import Engine

from orderly.models import Status, SubscriptionKind
from orderly.worker.core import owners
from orderly.worker.core.errors import InvalidMessage, NotFound
from orderly.worker.core.inputs import parse_input
from orderly.worker.core.lease import new_token
from orderly.worker.core.owners import Owns
from orderly.worker.db.queries import sql

# At most this many messages per pull.
MAX_PULL = 1000
RowId = Annotated[StrictInt, Field(ge=1, le=9_223_372_036_854_775_807)]


class PulledAckIn(BaseModel):
    """A pulled message processed: the receipt its pull returned."""

    model_config = ConfigDict(extra="forbid")

    receipt: Annotated[str, StringConstraints(strict=True, min_length=1, max_length=200)]


class VisibilityIn(BaseModel):
    """A pulled message's visibility moved: it comes back this long from now unless ACKed."""

    model_config = ConfigDict(extra="forbid")

    receipt: Annotated[str, StringConstraints(strict=True, min_length=1, max_length=200)]
    visibility_timeout_ms: Annotated[StrictInt, Field(ge=0, le=43_200_000)]


class RedriveIn(BaseModel):
    """Dead letters to send again: these deliveries, or every one of a subscription."""

    model_config = ConfigDict(extra="forbid")

    delivery_ids: Annotated[list[RowId], Field(max_length=10_000)] | None = None
    subscription_id: RowId | None = None


def pull(
    engine: Engine, subscription_id: int, max_messages: int = 10, owns: Owns | None = None
) -> list[dict[str, Any]]:
    """A PULL subscriber takes due messages; each must be ACKed within the visibility timeout
    with the receipt it came with. ``owns`` (here and below): the caller's objects
    (worker.core.owners); another's subscription is not found."""
    if not 1 <= max_messages <= MAX_PULL:
        raise InvalidMessage("max", f"must be 1 to {MAX_PULL}")
    with engine.begin() as conn:
        found = conn.execute(
            sql("pull_subscription"),
            {"s": subscription_id, "owned": owners.subscriptions(owns)},
        ).first()
        if found is None:
            raise NotFound("subscription", subscription_id)
        if found.status != Status.ACTIVE.value:
            return []
        if found.kind != SubscriptionKind.PULL.value:
            raise InvalidMessage(
                "subscription_id", f"subscription {subscription_id} is {found.kind}"
            )
        receipt = new_token()
        taken = conn.execute(
            sql("pull_take"),
            {
                "sub": subscription_id,
                "max": max_messages,
                "receipt": receipt,
                "visibility_s": found.visibility_timeout_ms / 1000,
            },
        )
        return [{**dict(r._mapping), "receipt": receipt} for r in taken]


def ack_pulled(
    engine: Engine,
    subscription_id: int,
    delivery_id: int,
    receipt: str,
    owns: Owns | None = None,
) -> None:
    """The subscriber processed a pulled message: delivered (only with the current receipt)."""
    with engine.begin() as conn:
        settled = conn.execute(
            sql("pull_ack"),
            {
                "d": delivery_id,
                "s": subscription_id,
                "r": receipt,
                "owned": owners.subscriptions(owns),
            },
        ).scalar_one()
    if not settled:
        raise NotFound("pulled message (or its visibility timeout passed)", delivery_id)


def extend_pulled(
    engine: Engine,
    subscription_id: int,
    delivery_id: int,
    data: Any,
    owns: Owns | None = None,
) -> None:
    """The subscriber needs more (or less) time for a pulled message (SQS
    ChangeMessageVisibility): it comes back ``visibility_timeout_ms`` from now unless ACKed;
    only with its current receipt (0: it comes back at once)."""
    asked = parse_input(VisibilityIn, data)
    with engine.begin() as conn:
        moved = conn.execute(
            sql("pull_extend"),
            {
                "d": delivery_id,
                "s": subscription_id,
                "r": asked.receipt,
                "visibility_s": asked.visibility_timeout_ms / 1000,
                "owned": owners.subscriptions(owns),
            },
        ).scalar_one()
    if not moved:
        raise NotFound("pulled message (or its visibility timeout passed)", delivery_id)


def redrive(
    engine: Engine,
    delivery_ids: list[int] | None = None,
    subscription_id: int | None = None,
    *,
    room: str | None = None,
    owns: Owns | None = None,
) -> list[int]:
    """An operator sends dead-lettered deliveries again: attempts start over, due now. With
    ``room``, only dead letters of that room's subscriptions."""
    if not delivery_ids and subscription_id is None:
        raise InvalidMessage("delivery_ids", "name the deliveries, or a subscription_id")
    with engine.begin() as conn:
        rows = conn.execute(
            sql("dead_letters_redrive"),
            {
                "ids": delivery_ids,
                "sub": subscription_id,
                "room": room,
                "owned": owners.subscriptions(owns),
            },
        )
        return [int(r.delivery_id) for r in rows]


def dead_letter_counts(engine: Engine, owns: Owns | None = None) -> dict[str, int]:
    """Dead letters per room (rooms without any left out)."""
    params = {"owned": owners.subscriptions(owns)}
    with engine.connect() as conn:
        return {r.room: int(r.n) for r in conn.execute(sql("dead_letters_per_room"), params)}


def dead_letters(
    engine: Engine, room_name: str | None = None, owns: Owns | None = None
) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sql("dead_letters_list"), {"room": room_name, "owned": owners.subscriptions(owns)}
        )
        return [dict(r._mapping) for r in rows]
