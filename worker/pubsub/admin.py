"""Rooms (exchanges), event types and their versions, publishers and subscriptions (bindings).

Each definition is validated whole (every bad field named) before one transaction writes it.
A room's retry policy is the one retry policy (worker.core.retry): deliveryDelay,
multiplier and attempts, which a subscription may override; message expiration is the
room's alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints
from sqlalchemy import Connection, Engine

from orderly.models import DeliveryState, Status, SubscriptionKind
from orderly.worker.core.addresses import AddressPolicy
from orderly.worker.core.errors import InvalidMessage, NotFound
from orderly.worker.core.inputs import UtcTime, parse_input
from orderly.worker.core.retry import MAX_ATTEMPTS, MAX_DELAY_MS, MAX_MULTIPLIER
from orderly.worker.db.queries import sql
from orderly.worker.pubsub import schemas
from orderly.worker.pubsub.replay import backfill, refuse_handler
from orderly.worker.pubsub.routing import PATTERN, PATTERN_RULE, Name

# A room's deliveryDelay is at most a day (a retry's wait can grow to MAX_DELAY_MS).
MAX_DELIVERY_DELAY_MS = 86_400_000
Delay = Annotated[StrictInt, Field(ge=1, le=MAX_DELIVERY_DELAY_MS)]
# The public schema's floor: a multiplier of 1 would be a constant delay, not a backoff.
Multiplier = Annotated[float, Field(ge=1.01, le=MAX_MULTIPLIER, allow_inf_nan=False)]
# Sends at most (the first and the retries; 0 and 1: no redelivery, as the seed has it).
Attempts = Annotated[StrictInt, Field(ge=0, le=MAX_ATTEMPTS + 1)]
# An endpoint's pace: sends a second (a token bucket of burst), sends at once.
Rate = Annotated[float, Field(gt=0, le=100_000, allow_inf_nan=False)]
Burst = Annotated[StrictInt, Field(ge=1, le=100_000)]
InFlight = Annotated[StrictInt, Field(ge=1, le=10_000)]
Version = Annotated[StrictInt, Field(ge=1, le=2_147_483_647)]


class RoomIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    message_expiration_ms: Annotated[StrictInt, Field(ge=0, le=MAX_DELAY_MS)] | None = None
    delivery_delay_ms: Delay = 1000
    delivery_delay_multiplier: Multiplier = 1.5
    delivery_attempts: Attempts = 3


class SubscriptionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    kind: SubscriptionKind
    push_url: (
        Annotated[str, StringConstraints(pattern=r"^https?://\S+$", max_length=1000)] | None
    ) = None
    handler: Name | None = None
    event_type: Name | None = None
    # the event type's versions: one (event_version), or a range (either end may be open)
    event_version: Version | None = None
    min_version: Version | None = None
    max_version: Version | None = None
    routing_key_pattern: Annotated[str, StringConstraints(max_length=255)] | None = None
    delivery_delay_ms: Delay | None = None
    delivery_delay_multiplier: Multiplier | None = None
    delivery_attempts: Attempts | None = None
    timeout_ms: Annotated[StrictInt, Field(ge=1, le=600_000)] = 5000
    visibility_timeout_ms: Annotated[StrictInt, Field(ge=100, le=43_200_000)] = 30000
    order_key: (
        Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")] | None
    ) = None
    rate_per_s: Rate | None = None
    burst: Burst | None = None
    max_in_flight: InFlight | None = None
    # made with the room's events published since then (that it selects, not expired)
    backfill_since: UtcTime | None = None


class RoomPatchIn(BaseModel):
    """What ``PATCH /rooms/{room}`` may change: the policy and the status."""

    model_config = ConfigDict(extra="forbid")

    message_expiration_ms: Annotated[StrictInt, Field(ge=0, le=MAX_DELAY_MS)] | None = None
    delivery_delay_ms: Delay | None = None
    delivery_delay_multiplier: Multiplier | None = None
    delivery_attempts: Attempts | None = None
    status: Literal["ACTIVE", "PAUSED"] | None = None


class PublisherIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name


class EventTypeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    version: Annotated[StrictInt, Field(ge=1)]
    json_schema: dict[str, Any] = Field(alias="schema")


_POLICY = ("delivery_delay_ms", "delivery_delay_multiplier", "delivery_attempts")


def room_view(row: Any) -> dict[str, Any]:
    return {
        "name": row.name,
        "message_expiration_ms": row.message_expiration_ms,
        "delivery_delay_ms": row.delivery_delay_ms,
        "delivery_delay_multiplier": row.delivery_delay_multiplier,
        "delivery_attempts": row.delivery_attempts,
        "status": Status(row.status).value,
    }


def room_row(conn: Connection, name: str, *, lock: bool = False) -> Any:
    row = conn.execute(sql("room_lock" if lock else "room_by_name"), {"name": name}).first()
    if row is None:
        raise NotFound("room", name)
    return row


def create_room(engine: Engine, data: Any) -> dict[str, Any]:
    room_in = parse_input(RoomIn, data)
    with engine.begin() as conn:
        row = conn.execute(sql("room_insert"), room_in.model_dump()).first()
    if row is None:
        raise InvalidMessage("name", f"room {room_in.name!r} exists")
    return room_view(row)


def update_room(engine: Engine, name: str, data: Any) -> dict[str, Any]:
    """Change a room's policy or status (``{"status": "PAUSED"}``)."""
    if not isinstance(data, Mapping):
        raise InvalidMessage("body", "must be a JSON object")
    for key in data:
        if key not in RoomPatchIn.model_fields:
            raise InvalidMessage(key, "unknown field" if key != "name" else "cannot be changed")
    with engine.begin() as conn:
        room = room_row(conn, name, lock=True)
        current = room_view(room)
        status = data.get("status", current["status"])
        if status not in ("ACTIVE", "PAUSED"):
            raise InvalidMessage("status", "must be ACTIVE or PAUSED")
        merged = {k: v for k, v in {**current, **data}.items() if k in RoomIn.model_fields}
        checked = parse_input(RoomIn, {**merged, "name": name})
        values = {**checked.model_dump(), "status": status, "room_id": room.room_id}
        return room_view(conn.execute(sql("room_update"), values).one())


def list_rooms(engine: Engine) -> list[dict[str, Any]]:
    """The rooms, each with how many of its events matched no subscription (unroutable)."""
    with engine.connect() as conn:
        return [
            {**room_view(r), "unroutable": int(r.unroutable)}
            for r in conn.execute(sql("room_list"))
        ]


def add_event_type(engine: Engine, room_name: str, data: Any) -> dict[str, Any]:
    """An event type's version with its JSON schema (the type is created with its first)."""
    if isinstance(data, Mapping) and "schema" in data and not isinstance(data["schema"], dict):
        raise InvalidMessage("schema", "must be a JSON object (a JSON schema)")
    type_in = parse_input(EventTypeIn, data)
    # Nested too deep, a pattern RE2 cannot run, not a JSON schema, a reference out of the
    # document, too costly: refused before anything is stored (nothing is ever fetched).
    schemas.check(type_in.json_schema)
    with engine.begin() as conn:
        room = room_row(conn, room_name)
        type_id = conn.execute(
            sql("event_type_insert"), {"room_id": room.room_id, "name": type_in.name}
        ).scalar_one()
        added = conn.execute(
            sql("event_type_version_insert"),
            {
                "event_type_id": type_id,
                "version": type_in.version,
                "json_schema": json.dumps(type_in.json_schema),
            },
        ).first()
        if added is None:
            raise InvalidMessage("version", f"{type_in.name} v{type_in.version} exists")
    return {"room": room_name, "name": type_in.name, "version": type_in.version}


def list_event_types(engine: Engine, room_name: str) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        room = room_row(conn, room_name)
        rows = conn.execute(sql("event_type_list"), {"room_id": room.room_id})
        return [dict(r._mapping) for r in rows]


def add_publisher(engine: Engine, room_name: str, data: Any) -> str:
    """A publisher the room accepts (``{"name": ...}``); its name."""
    name = parse_input(PublisherIn, data).name
    with engine.begin() as conn:
        room = room_row(conn, room_name)
        added = conn.execute(
            sql("publisher_insert"), {"room_id": room.room_id, "name": name}
        ).first()
    if added is None:
        raise InvalidMessage("name", f"publisher {name!r} exists in {room_name}")
    return name


def _destination_problems(
    sub: SubscriptionIn, policy: AddressPolicy | None, *, url_changed: bool = True
) -> None:
    if sub.kind is SubscriptionKind.PUSH and sub.push_url is None:
        raise InvalidMessage("push_url", "a PUSH subscription needs a push_url")
    if sub.kind is not SubscriptionKind.PUSH and sub.push_url is not None:
        raise InvalidMessage("push_url", f"only a PUSH subscription has one, not {sub.kind}")
    if sub.routing_key_pattern is not None and not PATTERN.fullmatch(sub.routing_key_pattern):
        raise InvalidMessage("routing_key_pattern", PATTERN_RULE)
    if sub.push_url is not None and url_changed:
        (policy or _configured_policy()).check_url("push_url", sub.push_url)


def _configured_policy() -> AddressPolicy:
    from orderly.worker.settings import get_settings

    return get_settings().outbound_policy


def _configured_secret() -> str:
    from orderly.worker.settings import get_settings

    return get_settings().token_secret


def _version_range(sub: SubscriptionIn) -> tuple[int | None, int | None]:
    """The versions a subscription selects, as (min, max); refused naming the field."""
    for field in ("event_version", "min_version", "max_version"):
        if getattr(sub, field) is not None and sub.event_type is None:
            raise InvalidMessage(field, "selects versions of an event_type: name one")
    if sub.event_version is not None:
        if sub.min_version is not None or sub.max_version is not None:
            field = "min_version" if sub.min_version is not None else "max_version"
            raise InvalidMessage(field, "give event_version or a min_version/max_version range")
        return sub.event_version, sub.event_version
    if (
        sub.min_version is not None
        and sub.max_version is not None
        and sub.min_version > sub.max_version
    ):
        raise InvalidMessage(
            "max_version", f"{sub.max_version} is below min_version {sub.min_version}"
        )
    return sub.min_version, sub.max_version


def _paced(sub: SubscriptionIn) -> SubscriptionIn:
    """The pace checked: a burst goes with a rate (by default the rate a second, at least 1);
    a PULL subscription's consumer sets its own pace."""
    if sub.kind is SubscriptionKind.PULL:
        for field in ("rate_per_s", "burst", "max_in_flight"):
            if getattr(sub, field) is not None:
                raise InvalidMessage(field, "a PULL subscriber takes messages at its own pace")
    if sub.rate_per_s is None:
        if sub.burst is not None:
            raise InvalidMessage("burst", "is the bucket of a rate_per_s: give one")
        return sub
    if sub.burst is None:
        return sub.model_copy(update={"burst": max(1, math.ceil(sub.rate_per_s))})
    return sub


def create_subscription(
    engine: Engine,
    room_name: str,
    data: Any,
    *,
    policy: AddressPolicy | None = None,
    token_secret: str | None = None,
) -> dict[str, Any]:
    """A subscription; its push_url must be one the outbound address policy allows
    (``policy``, by default the settings'), and a HANDLER subscription needs a token secret
    (``token_secret``, by default ORDERLY_TOKEN_SECRET): its consumers verify each event's
    signed token, so without one every delivery would be dead-lettered."""
    sub_in = parse_input(SubscriptionIn, data)
    if sub_in.kind is SubscriptionKind.HANDLER and sub_in.handler is None:
        raise InvalidMessage("handler", "a HANDLER subscription names its handler")
    if sub_in.kind is not SubscriptionKind.HANDLER and sub_in.handler is not None:
        raise InvalidMessage("handler", f"only a HANDLER subscription has one, not {sub_in.kind}")
    if sub_in.kind is SubscriptionKind.HANDLER and not (
        _configured_secret() if token_secret is None else token_secret
    ):
        raise InvalidMessage(
            "kind",
            "a HANDLER subscription needs ORDERLY_TOKEN_SECRET (its consumers verify each "
            "event's signed token): set it for the API and the workers first",
        )
    _destination_problems(sub_in, policy)
    sub_in = _paced(sub_in)
    if sub_in.backfill_since is not None:
        refuse_handler(sub_in.kind.value, "backfill_since")
    min_version, max_version = _version_range(sub_in)
    values = {
        **sub_in.model_dump(exclude={"event_type", "event_version", "backfill_since"}),
        "min_version": min_version,
        "max_version": max_version,
    }
    with engine.begin() as conn:
        room = room_row(conn, room_name)
        event_type_id = None
        if sub_in.event_type is not None:
            event_type_id = conn.execute(
                sql("event_type_find"), {"room_id": room.room_id, "name": sub_in.event_type}
            ).scalar()
            if event_type_id is None:
                raise InvalidMessage("event_type", f"no event type {sub_in.event_type!r}")
        if sub_in.event_version is not None:
            versions = list(
                conn.execute(sql("event_type_versions"), {"event_type_id": event_type_id}).scalars()
            )
            if sub_in.event_version not in versions:
                raise InvalidMessage(
                    "event_version",
                    f"{sub_in.event_type} has no version {sub_in.event_version} "
                    f"(it has {', '.join(map(str, versions))})",
                )
        row = conn.execute(
            sql("subscription_insert"),
            {
                **values,
                "kind": sub_in.kind.value,
                "room_id": room.room_id,
                "event_type_id": event_type_id,
            },
        ).first()
        if row is None:
            raise InvalidMessage("name", f"subscription {sub_in.name!r} exists")
        backfilled = 0
        if sub_in.backfill_since is not None:
            made = conn.execute(
                sql("replay_subscription"), {"s": row.subscription_id, "owned": None}
            ).one()
            backfilled = backfill(conn, made, sub_in.backfill_since, None)
    return {
        "subscription_id": int(row.subscription_id),
        "room": room_name,
        "event_type": sub_in.event_type,
        **values,
        "backfilled": backfilled,
    }


class SubscriptionPatchIn(BaseModel):
    """What ``PATCH /subscriptions/{id}`` may change (each field as in SubscriptionIn)."""

    model_config = ConfigDict(extra="forbid")

    push_url: str | None = None
    routing_key_pattern: str | None = None
    delivery_delay_ms: Delay | None = None
    delivery_delay_multiplier: Multiplier | None = None
    delivery_attempts: Attempts | None = None
    timeout_ms: StrictInt | None = None
    visibility_timeout_ms: StrictInt | None = None
    rate_per_s: Rate | None = None
    burst: Burst | None = None
    max_in_flight: InFlight | None = None
    status: Literal["ACTIVE", "PAUSED"] | None = None


_CHANGEABLE = tuple(f for f in SubscriptionPatchIn.model_fields if f != "status")


def update_subscription(
    engine: Engine, subscription_id: int, data: Any, *, policy: AddressPolicy | None = None
) -> dict[str, Any]:
    """Change a subscription's destination, pattern, policy overrides or status."""
    if not isinstance(data, Mapping):
        raise InvalidMessage("body", "must be a JSON object")
    allowed = {*_CHANGEABLE, "status"}
    for name in data:
        if name not in allowed:
            raise InvalidMessage(name, f"cannot be changed (only {', '.join(sorted(allowed))})")
    if "status" in data and data["status"] not in ("ACTIVE", "PAUSED"):
        raise InvalidMessage("status", "must be ACTIVE or PAUSED")
    if isinstance(data.get("push_url"), str):
        # Before the row is locked: checking resolves the host, which may take a while.
        (policy or _configured_policy()).check_url("push_url", data["push_url"])
    with engine.begin() as conn:
        sub = conn.execute(sql("subscription_lock"), {"id": subscription_id}).first()
        if sub is None:
            raise NotFound("subscription", subscription_id)
        current = {
            "name": sub.name,
            "kind": SubscriptionKind(sub.kind).value,
            "handler": sub.handler,
            "order_key": sub.order_key,
            **{k: getattr(sub, k) for k in _CHANGEABLE},
        }
        merged = {**current, **{k: v for k, v in data.items() if k != "status"}}
        if data.get("rate_per_s", 0) is None:
            merged["burst"] = None  # no rate: no bucket
        checked = _paced(
            parse_input(SubscriptionIn, {k: v for k, v in merged.items() if v is not None})
        )
        # The new destination was checked above (one registered before is left as it is).
        _destination_problems(checked, policy, url_changed=False)
        # a new rate brings its bucket (the given burst, or the default for the rate)
        changed = {*data, "burst"} if "rate_per_s" in data else set(data)
        values = {k: getattr(checked, k) if k in changed else current[k] for k in _CHANGEABLE}
        status = data.get("status", Status(sub.status).value)
        conn.execute(
            sql("subscription_update"), {**values, "status": status, "id": subscription_id}
        )
    return {"subscription_id": subscription_id, "status": status, **values}


def set_subscription_status(engine: Engine, subscription_id: int, status: str) -> None:
    if status not in ("ACTIVE", "PAUSED"):
        raise InvalidMessage("status", "must be ACTIVE or PAUSED")
    with engine.begin() as conn:
        found = conn.execute(
            sql("subscription_set_status"), {"id": subscription_id, "status": status}
        ).first()
    if found is None:
        raise NotFound("subscription", subscription_id)


def list_subscriptions(engine: Engine, room_name: str) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        room = room_row(conn, room_name)
        rows = conn.execute(sql("subscription_list"), {"room_id": room.room_id})
        return [subscription_view(r) for r in rows]


def subscription_view(r: Any) -> dict[str, Any]:
    """A subscription as listed: its definition, its status and its endpoint's health
    (``circuit``: CLOSED, OPEN while its failures hold sends back, DISABLED)."""
    view = {**dict(r._mapping), "kind": SubscriptionKind(r.kind).value}
    view["status"] = Status(r.status).value
    for field in ("failing_since", "probe_at", "disabled_at"):
        at = view[field]
        view[field] = None if at is None else at.isoformat()
    view["circuit"] = (
        "DISABLED" if r.disabled_at is not None else "OPEN" if r.probe_at is not None else "CLOSED"
    )
    return view


@dataclass(frozen=True)
class DeliveryCounts:
    """A subscription's deliveries by state, and (PULL) how many are due now: PENDING and
    past their due time (``pull`` may still hold some back: expired, or behind an open one
    of their ordering key)."""

    by_state: dict[DeliveryState, int]
    due: int


def subscription_deliveries(engine: Engine, room_name: str) -> dict[int, DeliveryCounts]:
    """Every subscription of the room (by id) with its delivery counts."""
    with engine.connect() as conn:
        room = room_row(conn, room_name)
        rows = conn.execute(sql("subscription_deliveries"), {"room_id": room.room_id}).all()
    counts: dict[int, dict[DeliveryState, int]] = {}
    due: dict[int, int] = {}
    for r in rows:
        by_state = counts.setdefault(r.subscription_id, dict.fromkeys(DeliveryState, 0))
        if r.state is not None:
            by_state[DeliveryState(r.state)] = int(r.n)
        due[r.subscription_id] = due.get(r.subscription_id, 0) + int(r.due)
    return {i: DeliveryCounts(counts[i], due[i]) for i in counts}
