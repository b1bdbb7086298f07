"""Publish/subscribe: rooms (exchanges), subscriptions (bindings), publish and delivery.

One routing model speaks both seeds: a room has subscriptions that select events by event
type and/or routing-key pattern (topic rules: ``*`` one word, ``#`` zero or more), and each
names a destination: a PUSH url, a PULL queue of its own, or a consumer handler chosen by
name. PostgreSQL holds every event and delivery; the partial index on
``delivery.scheduled_at`` of PENDING rows is the due-time index a scheduler moves to the
queue when due, so a ``$delay`` or a retry wait is never held in worker memory nor in the
broker.
"""

from __future__ import annotations

import json
import logging
import re
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints
from sqlalchemy import Engine, func, insert, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from models import (
    Delivery,
    DeliveryState,
    Event,
    EventType,
    EventTypeVersion,
    Publisher,
    Room,
    Status,
    Subscription,
    SubscriptionKind,
)
from worker import tokens
from worker.conversations import parse_input
from worker.errors import InvalidMessage, OrderlyError

log = logging.getLogger(__name__)

Name = Annotated[str, StringConstraints(strict=True, pattern=r"^[A-Za-z0-9._~-]{1,100}$")]
WORD = r"[A-Za-z0-9_-]+"
ROUTING_KEY = re.compile(rf"^{WORD}(\.{WORD})*$")
PATTERN = re.compile(rf"^({WORD}|\*|#)(\.({WORD}|\*|#))*$")
PAYLOAD_PATH = rf"^{WORD}(\.{WORD})*$"  # a dotted path into an event's payload
# How long a delivery handed to the broker stays out of the scheduler's sight: a task lost
# with its worker comes back after this.
QUEUED_LEASE_S = 60.0
# Longest retry wait and $delay (a year), and the most retries a policy may ask for.
MAX_WAIT_MS = 366 * 86_400_000
MAX_ATTEMPTS = 100
# Deliveries one task carries: a publish that fans out to N subscriptions is one task.
BATCH = 50


class NotFound(OrderlyError):
    def __init__(self, what: str, name: object) -> None:
        self.what = what
        super().__init__(f"no {what} {name!r}")


# --- administration -------------------------------------------------------------------------


class RoomIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    message_expiration_ms: Annotated[StrictInt, Field(ge=0, le=MAX_WAIT_MS)] | None = None
    delivery_delay_ms: Annotated[StrictInt, Field(ge=1, le=86_400_000)] = 1000
    delivery_delay_multiplier: Annotated[float, Field(ge=1.01, le=100, allow_inf_nan=False)] = 1.5
    delivery_attempts: Annotated[StrictInt, Field(ge=0, le=MAX_ATTEMPTS)] = 3


class SubscriptionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    kind: SubscriptionKind
    push_url: (
        Annotated[str, StringConstraints(pattern=r"^https?://\S+$", max_length=1000)] | None
    ) = None
    handler: Name | None = None
    event_type: Name | None = None
    routing_key_pattern: Annotated[str, StringConstraints(max_length=255)] | None = None
    delivery_delay_ms: Annotated[StrictInt, Field(ge=1, le=86_400_000)] | None = None
    delivery_delay_multiplier: (
        Annotated[float, Field(ge=1.01, le=100, allow_inf_nan=False)] | None
    ) = None
    delivery_attempts: Annotated[StrictInt, Field(ge=0, le=MAX_ATTEMPTS)] | None = None
    timeout_ms: Annotated[StrictInt, Field(ge=1, le=600_000)] = 5000
    visibility_timeout_ms: Annotated[StrictInt, Field(ge=100, le=43_200_000)] = 30000
    order_key: (
        Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")] | None
    ) = None


class EventTypeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    version: Annotated[StrictInt, Field(ge=1)]
    json_schema: dict[str, Any] = Field(alias="schema")


def _room(session: Session, name: str) -> Room:
    room = session.scalar(select(Room).where(Room.name == name))
    if room is None:
        raise NotFound("room", name)
    return room


def create_room(engine: Engine, data: Any) -> dict[str, Any]:
    room_in = parse_input(RoomIn, data)
    with Session(engine) as session, session.begin():
        if session.scalar(select(Room).where(Room.name == room_in.name)) is not None:
            raise InvalidMessage("name", f"room {room_in.name!r} exists")
        room = Room(**room_in.model_dump(), status=Status.ACTIVE)
        session.add(room)
        session.flush()
        return room_view(room)


def update_room(engine: Engine, name: str, data: Any) -> dict[str, Any]:
    """Change a room's policy or status (``{"status": "PAUSED"}``)."""
    if not isinstance(data, Mapping):
        raise InvalidMessage("body", "must be a JSON object")
    for key in data:
        if key not in RoomIn.model_fields and key != "status":
            raise InvalidMessage(key, "unknown field" if key != "name" else "cannot be changed")
    with Session(engine) as session, session.begin():
        room = _room(session, name)
        current = room_view(room)
        status = data.get("status", current["status"])
        if status not in ("ACTIVE", "PAUSED"):
            raise InvalidMessage("status", "must be ACTIVE or PAUSED")
        merged = {k: v for k, v in {**current, **data}.items() if k in RoomIn.model_fields}
        checked = parse_input(RoomIn, {**merged, "name": name})
        for key, value in checked.model_dump().items():
            setattr(room, key, value)
        room.status = Status(status)
        return room_view(room)


def room_view(room: Room) -> dict[str, Any]:
    return {
        "name": room.name,
        "message_expiration_ms": room.message_expiration_ms,
        "delivery_delay_ms": room.delivery_delay_ms,
        "delivery_delay_multiplier": room.delivery_delay_multiplier,
        "delivery_attempts": room.delivery_attempts,
        "status": Status(room.status).value,
    }


def list_rooms(engine: Engine) -> list[dict[str, Any]]:
    """The rooms, each with how many of its events matched no subscription (unroutable)."""
    with Session(engine) as session:
        unroutable = dict(
            session.execute(
                select(Event.room_id, func.count())
                .where(Event.unroutable.is_(True))
                .group_by(Event.room_id)
            ).all()
        )
        return [
            {**room_view(r), "unroutable": int(unroutable.get(r.room_id, 0))}
            for r in session.scalars(select(Room).order_by(Room.name))
        ]


def add_event_type(engine: Engine, room_name: str, data: Any) -> dict[str, Any]:
    """An event type's version with its JSON schema (the type is created with its first)."""
    if isinstance(data, Mapping) and "schema" in data and not isinstance(data["schema"], dict):
        raise InvalidMessage("schema", "must be a JSON object (a JSON schema)")
    type_in = parse_input(EventTypeIn, data)
    try:
        cls = jsonschema.validators.validator_for(type_in.json_schema)
        cls.check_schema(type_in.json_schema)
        # References are resolved while validating: one that leads nowhere shows here.
        samples: tuple[Any, ...] = ({}, [], "", 0, None)
        for instance in samples:
            list(cls(type_in.json_schema).iter_errors(instance))
    except jsonschema.SchemaError as exc:
        raise InvalidMessage("schema", f"not a valid JSON schema: {exc.message}") from None
    except Exception as exc:
        raise InvalidMessage("schema", f"cannot be used: {type(exc).__name__}: {exc}") from None
    with Session(engine) as session, session.begin():
        room = _room(session, room_name)
        etype = session.scalar(
            select(EventType).where(
                EventType.room_id == room.room_id, EventType.name == type_in.name
            )
        )
        if etype is None:
            etype = EventType(room_id=room.room_id, name=type_in.name)
            session.add(etype)
            session.flush()
        elif session.get(EventTypeVersion, (etype.event_type_id, type_in.version)) is not None:
            raise InvalidMessage("version", f"{type_in.name} v{type_in.version} exists")
        session.add(
            EventTypeVersion(
                event_type_id=etype.event_type_id,
                version=type_in.version,
                json_schema=type_in.json_schema,
            )
        )
    return {"room": room_name, "name": type_in.name, "version": type_in.version}


def add_publisher(engine: Engine, room_name: str, name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9._~-]{1,100}", name):
        raise InvalidMessage("name", "must be 1 to 100 of A-Z a-z 0-9 . _ ~ -")
    with Session(engine) as session, session.begin():
        room = _room(session, room_name)
        session.add(Publisher(room_id=room.room_id, name=name))
        try:
            session.flush()
        except IntegrityError:
            raise InvalidMessage("name", f"publisher {name!r} exists in {room_name}") from None


def create_subscription(engine: Engine, room_name: str, data: Any) -> dict[str, Any]:
    sub_in = parse_input(SubscriptionIn, data)
    if sub_in.kind is SubscriptionKind.PUSH and sub_in.push_url is None:
        raise InvalidMessage("push_url", "a PUSH subscription needs a push_url")
    if sub_in.kind is not SubscriptionKind.PUSH and sub_in.push_url is not None:
        raise InvalidMessage("push_url", f"only a PUSH subscription has one, not {sub_in.kind}")
    if sub_in.kind is SubscriptionKind.HANDLER and sub_in.handler is None:
        raise InvalidMessage("handler", "a HANDLER subscription names its handler")
    if sub_in.kind is not SubscriptionKind.HANDLER and sub_in.handler is not None:
        raise InvalidMessage("handler", f"only a HANDLER subscription has one, not {sub_in.kind}")
    if sub_in.routing_key_pattern is not None and not PATTERN.fullmatch(sub_in.routing_key_pattern):
        raise InvalidMessage(
            "routing_key_pattern", "dot-separated words, * (one word) or # (zero or more)"
        )
    with Session(engine) as session, session.begin():
        room = _room(session, room_name)
        event_type_id = None
        if sub_in.event_type is not None:
            etype = session.scalar(
                select(EventType).where(
                    EventType.room_id == room.room_id, EventType.name == sub_in.event_type
                )
            )
            if etype is None:
                raise InvalidMessage("event_type", f"no event type {sub_in.event_type!r}")
            event_type_id = etype.event_type_id
        values = sub_in.model_dump(exclude={"event_type"})
        sub = Subscription(
            room_id=room.room_id, event_type_id=event_type_id, status=Status.ACTIVE, **values
        )
        session.add(sub)
        try:
            session.flush()
        except IntegrityError:
            raise InvalidMessage("name", f"subscription {sub_in.name!r} exists") from None
        return {"subscription_id": sub.subscription_id, "room": room_name, **values}


_CHANGEABLE = (
    "push_url",
    "routing_key_pattern",
    "delivery_delay_ms",
    "delivery_delay_multiplier",
    "delivery_attempts",
    "timeout_ms",
    "visibility_timeout_ms",
)


def update_subscription(engine: Engine, subscription_id: int, data: Any) -> dict[str, Any]:
    """Change a subscription's destination, pattern, policy overrides or status."""
    if not isinstance(data, Mapping):
        raise InvalidMessage("body", "must be a JSON object")
    allowed = {*_CHANGEABLE, "status"}
    for name in data:
        if name not in allowed:
            raise InvalidMessage(name, f"cannot be changed (only {', '.join(sorted(allowed))})")
    with Session(engine) as session, session.begin():
        sub = session.get(Subscription, subscription_id)
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
        checked = parse_input(SubscriptionIn, {k: v for k, v in merged.items() if v is not None})
        if checked.kind is SubscriptionKind.PUSH and checked.push_url is None:
            raise InvalidMessage("push_url", "a PUSH subscription needs a push_url")
        if checked.kind is not SubscriptionKind.PUSH and checked.push_url is not None:
            raise InvalidMessage(
                "push_url", f"only a PUSH subscription has one, not {checked.kind}"
            )
        if checked.routing_key_pattern is not None and not PATTERN.fullmatch(
            checked.routing_key_pattern
        ):
            raise InvalidMessage(
                "routing_key_pattern", "dot-separated words, * (one word) or # (zero or more)"
            )
        if "status" in data:
            if data["status"] not in ("ACTIVE", "PAUSED"):
                raise InvalidMessage("status", "must be ACTIVE or PAUSED")
            sub.status = Status(data["status"])
        for key in _CHANGEABLE:
            if key in data:
                setattr(sub, key, getattr(checked, key))
        return {
            "subscription_id": subscription_id,
            "status": Status(sub.status).value,
            **{k: getattr(sub, k) for k in _CHANGEABLE},
        }


def list_event_types(engine: Engine, room_name: str) -> list[dict[str, Any]]:
    with Session(engine) as session:
        room = _room(session, room_name)
        rows = session.execute(
            select(EventType.name, EventTypeVersion.version, EventTypeVersion.json_schema)
            .join(EventTypeVersion, EventTypeVersion.event_type_id == EventType.event_type_id)
            .where(EventType.room_id == room.room_id)
            .order_by(EventType.name, EventTypeVersion.version)
        ).all()
        return [{"name": n, "version": v, "schema": schema} for n, v, schema in rows]


def set_subscription_status(engine: Engine, subscription_id: int, status: str) -> None:
    if status not in ("ACTIVE", "PAUSED"):
        raise InvalidMessage("status", "must be ACTIVE or PAUSED")
    with Session(engine) as session, session.begin():
        sub = session.get(Subscription, subscription_id)
        if sub is None:
            raise NotFound("subscription", subscription_id)
        sub.status = Status(status)


def list_subscriptions(engine: Engine, room_name: str) -> list[dict[str, Any]]:
    with Session(engine) as session:
        room = _room(session, room_name)
        subs = session.scalars(
            select(Subscription)
            .where(Subscription.room_id == room.room_id)
            .order_by(Subscription.subscription_id)
        )
        return [
            {
                "subscription_id": s.subscription_id,
                "name": s.name,
                "kind": SubscriptionKind(s.kind).value,
                "push_url": s.push_url,
                "handler": s.handler,
                "routing_key_pattern": s.routing_key_pattern,
                "delivery_delay_ms": s.delivery_delay_ms,
                "delivery_delay_multiplier": s.delivery_delay_multiplier,
                "delivery_attempts": s.delivery_attempts,
                "status": Status(s.status).value,
            }
            for s in subs
        ]


# --- routing --------------------------------------------------------------------------------


def topic_matches(pattern: str, routing_key: str) -> bool:
    """AMQP topic matching: ``*`` is exactly one word, ``#`` zero or more words."""
    words = routing_key.split(".")
    parts = pattern.split(".")

    def match(i: int, j: int) -> bool:
        if i == len(parts):
            return j == len(words)
        if parts[i] == "#":
            return any(match(i + 1, k) for k in range(j, len(words) + 1))
        if j == len(words):
            return False
        return (parts[i] == "*" or parts[i] == words[j]) and match(i + 1, j + 1)

    return match(0, 0)


def backoff_ms(delay_ms: int, multiplier: float, attempt: int) -> int:
    """T = deliveryDelay * deliveryDelayMultiplier ^ deliveryAttempt (at most MAX_WAIT_MS)."""
    try:
        return min(round(delay_ms * multiplier**attempt), MAX_WAIT_MS)
    except OverflowError:
        return MAX_WAIT_MS


# --- publish --------------------------------------------------------------------------------


class PublishIn(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    payload: Any
    event_type: Name | None = None
    version: Annotated[StrictInt, Field(ge=1)] | None = None
    routing_key: Annotated[str, StringConstraints(max_length=255)] | None = None
    publisher: Name | None = None
    user: Name | None = None
    impersonator: Name | None = None
    delay_ms: Annotated[StrictInt, Field(ge=0, le=366 * 86_400_000)] = Field(0, alias="$delay")


@dataclass(frozen=True)
class Published:
    correlation_id: str
    event_id: int
    deliveries: list[int]
    unroutable: bool


def _schema_path(error: jsonschema.ValidationError) -> str:
    return "payload" + "".join(
        f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path
    )


def order_value(payload: Any, path: str) -> str | None:
    """The value at a dotted payload path, as text (None when absent)."""
    value = payload
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)[:255]


def publish(
    engine: Engine, room_name: str, data: Any, *, secret: str = "", token_ttl_ms: int = 86_400_000
) -> tuple[Published, list[int]]:
    """Store an event and one delivery per active matching subscription.

    Returns the result and the deliveries due now, for the caller to enqueue after the
    commit (delayed ones are left to the scheduler).
    """
    pub = parse_input(PublishIn, data)
    try:
        payload_text = json.dumps(pub.payload, allow_nan=False)
    except ValueError:
        raise InvalidMessage("payload", "NaN and Infinity are not JSON") from None
    now = datetime.now(UTC)
    with Session(engine) as session, session.begin():
        room = _room(session, room_name)
        if room.status == Status.PAUSED:
            raise InvalidMessage("room", f"room {room_name!r} is paused")
        publishers = {
            p.name: p.publisher_id
            for p in session.scalars(select(Publisher).where(Publisher.room_id == room.room_id))
        }
        publisher_id = None
        if publishers:
            if pub.publisher is None:
                raise InvalidMessage("publisher", f"room {room_name!r} names its publishers")
            if pub.publisher not in publishers:
                raise InvalidMessage("publisher", f"{pub.publisher!r} may not publish here")
            publisher_id = publishers[pub.publisher]
        event_type_id = version = None
        if pub.event_type is not None:
            etype = session.scalar(
                select(EventType).where(
                    EventType.room_id == room.room_id, EventType.name == pub.event_type
                )
            )
            if etype is None:
                raise InvalidMessage("event_type", f"no event type {pub.event_type!r} here")
            event_type_id = etype.event_type_id
            version = pub.version or session.scalar(
                select(func.max(EventTypeVersion.version)).where(
                    EventTypeVersion.event_type_id == event_type_id
                )
            )
            schema_row = session.get(EventTypeVersion, (event_type_id, version))
            if schema_row is None:
                raise InvalidMessage("version", f"{pub.event_type} has no version {version}")
            validator = jsonschema.validators.validator_for(schema_row.json_schema)(
                schema_row.json_schema
            )
            error = jsonschema.exceptions.best_match(validator.iter_errors(pub.payload))
            if error is not None:
                raise InvalidMessage(_schema_path(error), error.message)
        routing_key = pub.routing_key or pub.event_type
        if routing_key is None:
            raise InvalidMessage("routing_key", "missing (or give an event_type)")
        if not ROUTING_KEY.fullmatch(routing_key):
            raise InvalidMessage("routing_key", "dot-separated words of A-Z a-z 0-9 _ -")
        deliver_at = now + timedelta(milliseconds=pub.delay_ms)
        expires_at = (
            now + timedelta(milliseconds=room.message_expiration_ms)
            if room.message_expiration_ms
            else None
        )
        subs = [
            s
            for s in session.scalars(
                select(Subscription).where(
                    Subscription.room_id == room.room_id, Subscription.status == Status.ACTIVE
                )
            )
            if (s.event_type_id is None or s.event_type_id == event_type_id)
            and (s.routing_key_pattern is None or topic_matches(s.routing_key_pattern, routing_key))
        ]
        correlation_id = uuid.uuid4().hex
        token = None
        if secret:
            token = tokens.sign(
                secret,
                tokens.Claims(
                    pub.user,
                    pub.impersonator,
                    correlation_id,
                    int(deliver_at.timestamp() * 1000) + token_ttl_ms,
                ),
            )
        event = Event(
            correlation_id=correlation_id,
            token=token,
            room_id=room.room_id,
            event_type_id=event_type_id,
            version=version,
            routing_key=routing_key,
            payload=json.loads(payload_text),
            publisher_id=publisher_id,
            user_id=pub.user,
            impersonator_id=pub.impersonator,
            published_at=now,
            deliver_at=deliver_at,
            expires_at=expires_at,
            unroutable=not subs,
        )
        session.add(event)
        session.flush()
        due_now = pub.delay_ms == 0
        # A delivery handed to the broker right after the commit is out of the scheduler's
        # sight for QUEUED_LEASE_S; if that enqueue is lost, the scheduler brings it back.
        queued = now + timedelta(seconds=QUEUED_LEASE_S) if due_now else deliver_at
        ids, pushed = [], []
        for sub in subs:
            pull = sub.kind == SubscriptionKind.PULL
            row = session.execute(
                text(
                    "INSERT INTO delivery (event_id, subscription_id, state, pull, order_value,"
                    " attempt, next_attempt_at, scheduled_at)"
                    " VALUES (:e, :s, 'PENDING', :pull, :ov, 0, :t, :q)"
                    " RETURNING delivery_id"
                ),
                {
                    "e": event.event_id,
                    "s": sub.subscription_id,
                    "pull": pull,
                    "ov": order_value(pub.payload, sub.order_key) if sub.order_key else None,
                    "t": deliver_at,
                    "q": deliver_at if pull else queued,
                },
            ).scalar_one()
            ids.append(int(row))
            if not pull:
                pushed.append(int(row))
        if not subs:
            log.info(
                "event %s in %s matched no subscription: unroutable", event.event_id, room_name
            )
        result = Published(event.correlation_id, event.event_id, ids, not subs)
    return result, (pushed if due_now else [])


def publish_message(
    engine: Engine,
    room_name: str,
    message: Any,
    routing_key: str,
    *,
    enqueue: Callable[[list[int]], None],
    delay_ms: int = 0,
    secret: str = "",
    **fields: Any,
) -> Published:
    """The broker seed's ``publish($message, $routingKey)`` with ``$delay``, for Python code."""
    data = {"payload": message, "routing_key": routing_key, "$delay": delay_ms, **fields}
    result, due = publish(engine, room_name, data, secret=secret)
    for i in range(0, len(due), BATCH):
        enqueue(due[i : i + BATCH])
    return result


def publish_many(
    engine: Engine,
    room_name: str,
    messages: list[tuple[Any, str, int]],
    *,
    secret: str = "",
    token_ttl_ms: int = 86_400_000,
    user: str | None = None,
) -> list[int]:
    """Many ``(payload, routing_key, delay_ms)`` at once, in one transaction (no event types).

    Every message is routed like a single publish; the deliveries due now are returned for
    the caller to enqueue, the delayed ones wait in the due-time index.
    """
    now = datetime.now(UTC)
    for i, (_, routing_key, delay_ms) in enumerate(messages):
        if not ROUTING_KEY.fullmatch(routing_key):
            raise InvalidMessage(f"messages[{i}].routing_key", "dot-separated words")
        if not 0 <= delay_ms <= 366 * 86_400_000:
            raise InvalidMessage(f"messages[{i}].delay_ms", "0 to one year")
    with Session(engine) as session, session.begin():
        room = _room(session, room_name)
        subs = list(
            session.scalars(
                select(Subscription).where(
                    Subscription.room_id == room.room_id,
                    Subscription.status == Status.ACTIVE,
                    Subscription.event_type_id.is_(None),
                )
            )
        )
        rows = []
        for payload, routing_key, delay_ms in messages:
            correlation_id = uuid.uuid4().hex
            deliver_at = now + timedelta(milliseconds=delay_ms)
            token = None
            if secret:
                exp = int(deliver_at.timestamp() * 1000) + token_ttl_ms
                token = tokens.sign(secret, tokens.Claims(user, None, correlation_id, exp))
            rows.append(
                {
                    "correlation_id": correlation_id,
                    "room_id": room.room_id,
                    "routing_key": routing_key,
                    "payload": payload,
                    "user_id": user,
                    "token": token,
                    "published_at": now,
                    "deliver_at": deliver_at,
                    "expires_at": now + timedelta(milliseconds=room.message_expiration_ms)
                    if room.message_expiration_ms
                    else None,
                    "unroutable": not any(
                        s.routing_key_pattern is None
                        or topic_matches(s.routing_key_pattern, routing_key)
                        for s in subs
                    ),
                }
            )
        ids = session.scalars(
            insert(Event).returning(Event.event_id, sort_by_parameter_order=True), rows
        ).all()
        lease = now + timedelta(seconds=QUEUED_LEASE_S)
        deliveries = []
        for event_id, row, (payload, _, delay_ms) in zip(ids, rows, messages, strict=True):
            for sub in subs:
                if sub.routing_key_pattern is None or topic_matches(
                    sub.routing_key_pattern, str(row["routing_key"])
                ):
                    pull = sub.kind == SubscriptionKind.PULL
                    deliveries.append(
                        {
                            "event_id": event_id,
                            "subscription_id": sub.subscription_id,
                            "state": DeliveryState.PENDING,
                            "pull": pull,
                            "order_value": order_value(payload, sub.order_key)
                            if sub.order_key
                            else None,
                            "attempt": 0,
                            "next_attempt_at": row["deliver_at"],
                            "scheduled_at": lease
                            if delay_ms == 0 and not pull
                            else row["deliver_at"],
                            "_due": delay_ms == 0 and not pull,
                        }
                    )
        due_flags = [d.pop("_due") for d in deliveries]
        delivery_ids = (
            session.scalars(
                insert(Delivery).returning(Delivery.delivery_id, sort_by_parameter_order=True),
                deliveries,
            ).all()
            if deliveries
            else []
        )
    return [int(i) for i, due in zip(delivery_ids, due_flags, strict=True) if due]


# --- the scheduler --------------------------------------------------------------------------

_MOVE_DUE = text(
    """
    UPDATE delivery d SET scheduled_at = now() + make_interval(secs => :lease)
     WHERE d.delivery_id IN (
           SELECT delivery_id FROM delivery
            WHERE state = 'PENDING' AND NOT pull AND scheduled_at <= now()
            ORDER BY scheduled_at
            LIMIT :limit
            FOR UPDATE SKIP LOCKED)
    RETURNING d.delivery_id
    """
)
# A claim whose worker died: back to PENDING, due at once (delivered at least once).
_RELEASE_STUCK = text(
    """
    UPDATE delivery d SET state = 'PENDING', scheduled_at = now(), claimed_at = NULL, claim = NULL
      FROM subscription s
     WHERE d.subscription_id = s.subscription_id AND d.state = 'IN_PROCESS' AND NOT d.pull
       AND d.claimed_at
           < now() - make_interval(secs => s.timeout_ms * :batch / 1000.0 + :grace)
    RETURNING d.delivery_id
    """
)
# A pulled delivery not ACKed within its subscription's visibility timeout comes back (or,
# its attempts spent, is dead-lettered).
_RETURN_UNACKED = text(
    """
    UPDATE delivery d
       SET state = CASE WHEN d.attempt + 1 > COALESCE(s.delivery_attempts, r.delivery_attempts)
                        THEN 'DEAD' ELSE 'PENDING' END,
           attempt = d.attempt + 1, next_attempt_at = now(), claimed_at = NULL, receipt = NULL,
           last_error = 'not ACKed within the visibility timeout'
      FROM subscription s, room r
     WHERE d.subscription_id = s.subscription_id AND r.room_id = s.room_id
       AND d.pull AND d.state = 'IN_PROCESS'
       AND d.claimed_at < now() - make_interval(secs => s.visibility_timeout_ms / 1000.0)
    RETURNING d.delivery_id, d.state
    """
)
# Pull deliveries nobody took before their room's expiration.
_EXPIRE_PULLED = text(
    """
    UPDATE delivery d SET state = 'EXPIRED', last_error = 'past the room''s message expiration'
      FROM event e
     WHERE e.event_id = d.event_id AND d.pull AND d.state = 'PENDING'
       AND e.expires_at IS NOT NULL AND e.expires_at <= now()
    """
)


def move_due(
    engine: Engine,
    enqueue: Callable[[list[int]], None],
    limit: int = 1000,
    *,
    maintain: bool = True,
) -> int:
    """The scheduler's turn: due deliveries (delays, retry waits) go to the queue in batches.

    With ``maintain`` it also releases dead workers' claims, expires untaken pull messages
    and returns pulled ones not ACKed in time (the worker's scheduler does that once a
    second, not every turn).
    """
    with engine.begin() as conn:
        if maintain:
            _maintain(conn)
        due = [
            int(r[0]) for r in conn.execute(_MOVE_DUE, {"lease": QUEUED_LEASE_S, "limit": limit})
        ]
    for i in range(0, len(due), BATCH):
        enqueue(due[i : i + BATCH])
    return len(due)


def _maintain(conn: Any) -> None:
    conn.execute(_RELEASE_STUCK, {"grace": QUEUED_LEASE_S, "batch": BATCH})
    conn.execute(_EXPIRE_PULLED)
    for delivery_id, state in conn.execute(_RETURN_UNACKED).all():
        # the pull's log row: that attempt failed (or was the last)
        conn.execute(
            text(
                "UPDATE published_messages SET outcome = :o, error = 'not ACKed in time'"
                " WHERE id = (SELECT max(id) FROM published_messages WHERE delivery_id = :d)"
            ),
            {"o": "DEAD" if state == "DEAD" else "FAILED", "d": delivery_id},
        )


# --- delivery -------------------------------------------------------------------------------

_CLAIM = text(
    # One round trip: the claim commits without waiting for the disk (see _ASYNC_COMMIT).
    """
    SET LOCAL synchronous_commit TO OFF;
    UPDATE delivery d SET state = 'IN_PROCESS', claimed_at = now(), claim = :claim
      FROM event e, subscription s, room r
     WHERE d.delivery_id = ANY(:ids) AND d.state = 'PENDING' AND NOT d.pull
       AND d.next_attempt_at <= now() AND s.status = 'ACTIVE'
       AND e.event_id = d.event_id AND s.subscription_id = d.subscription_id
       AND r.room_id = e.room_id
       -- an ordered subscription: an earlier open delivery of the same key goes first
       AND (d.order_value IS NULL OR NOT EXISTS (
             SELECT 1 FROM delivery o
              WHERE o.subscription_id = d.subscription_id AND o.order_value = d.order_value
                AND o.delivery_id < d.delivery_id AND o.state IN ('PENDING', 'IN_PROCESS')))
    RETURNING d.delivery_id, d.attempt, e.event_id, e.correlation_id, e.routing_key, e.payload,
              e.user_id, e.impersonator_id, e.deliver_at, e.expires_at, e.version,
              s.subscription_id, s.kind, s.push_url, s.handler, s.timeout_ms,
              COALESCE(s.delivery_delay_ms, r.delivery_delay_ms),
              COALESCE(s.delivery_delay_multiplier, r.delivery_delay_multiplier),
              COALESCE(s.delivery_attempts, r.delivery_attempts), r.name, e.token,
              d.order_value, e.deliver_at > e.published_at
    """
)


@dataclass(frozen=True)
class Claimed:
    delivery_id: int
    attempt: int
    event_id: int
    correlation_id: str
    routing_key: str
    payload: Any
    user: str | None
    impersonator: str | None
    deliver_at: datetime
    expires_at: datetime | None
    version: int | None
    subscription_id: int
    kind: str
    push_url: str | None
    handler: str | None
    timeout_ms: int
    delay_ms: int
    multiplier: float
    attempts: int
    room: str
    token: str | None
    order_value: str | None
    delayed: bool


@dataclass(frozen=True)
class Attempt:
    ok: bool
    error: str = ""


Push = Callable[[Claimed], Attempt]
ConsumerHandler = Callable[[Claimed], None]


class Consumers:
    """Handlers chosen by routing key (the broker seed's consumer classes)."""

    def __init__(self) -> None:
        self._handlers: dict[str, ConsumerHandler] = {}

    def register(self, name: str) -> Callable[[ConsumerHandler], ConsumerHandler]:
        def add(fn: ConsumerHandler) -> ConsumerHandler:
            self._handlers[name] = fn
            return fn

        return add

    def get(self, name: str) -> ConsumerHandler | None:
        return self._handlers.get(name)


consumers = Consumers()


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return 0


@dataclass
class _Done:
    """What happened to one claimed delivery, for the settling transaction."""

    claimed: Claimed
    started: datetime
    attempt: Attempt | None = None  # None: not sent (expired or refused)
    refused: str | None = None
    handler_ran: bool = False
    exception_id: str | None = None


# Each batch is two transactions: the claims, and the outcomes. Neither waits for the disk: a
# database crash in that instant can only make a delivery come again (at least once, with the
# same Idempotency-Key), never lose it.
_ASYNC_COMMIT = text("SET LOCAL synchronous_commit TO OFF")


def deliver_batch(
    engine: Engine, delivery_ids: list[int], push: Push, secret: str = ""
) -> list[str]:
    """Claim deliveries, send each, record every attempt and what comes next; new states."""
    claim = uuid.uuid4().hex
    with engine.begin() as conn:
        rows = conn.execute(_CLAIM, {"ids": delivery_ids, "claim": claim}).all()
        claimed = [Claimed(*row) for row in rows]
    done = [_attempt(c, push, secret) for c in claimed]
    states = dict.fromkeys(delivery_ids, "NOT_CLAIMABLE")
    # The common case, plain pushes delivered, is recorded for the whole batch at once.
    plain = [
        d.claimed.delivery_id
        for d in done
        if d.attempt is not None
        and d.attempt.ok
        and not d.handler_ran
        and d.claimed.order_value is None
    ]
    if plain:
        with engine.begin() as conn:
            held = {
                int(r[0])
                for r in conn.execute(
                    _SETTLE_DELIVERED, {"ids": plain, "claim": claim, "p": datetime.now(UTC)}
                )
            }
        for delivery_id in plain:
            states[delivery_id] = "DELIVERED" if delivery_id in held else "LOST_CLAIM"
        done = [d for d in done if d.claimed.delivery_id not in plain]
    if not done:
        return [states[i] for i in delivery_ids]
    try:
        with engine.begin() as conn:
            conn.execute(_ASYNC_COMMIT)
            for d in done:
                states[d.claimed.delivery_id] = _settle(conn, d, claim)
    except Exception:
        # One bad delivery must not hold back the batch: again, one savepoint each, and the
        # one that cannot be recorded is dead-lettered with the reason.
        log.exception("recording a batch of deliveries failed; recording one by one")
        with engine.begin() as conn:
            conn.execute(_ASYNC_COMMIT)
            for d in done:
                try:
                    with conn.begin_nested():
                        states[d.claimed.delivery_id] = _settle(conn, d, claim)
                except Exception as exc:
                    log.exception("recording delivery %s failed", d.claimed.delivery_id)
                    states[d.claimed.delivery_id] = _dead_letter(conn, d.claimed, claim, exc)
    return [states[i] for i in delivery_ids]


def _dead_letter(conn: Any, c: Claimed, claim: str, exc: Exception) -> str:
    conn.execute(
        text(
            "UPDATE delivery SET state = 'DEAD', claimed_at = NULL, claim = NULL,"
            " last_error = :why WHERE delivery_id = :id AND claim = :claim"
        ),
        {
            "why": f"cannot be recorded: {type(exc).__name__}: {exc}",
            "id": c.delivery_id,
            "claim": claim,
        },
    )
    return DeliveryState.DEAD.value


def deliver(engine: Engine, delivery_id: int, push: Push, secret: str = "") -> str:
    return deliver_batch(engine, [delivery_id], push, secret)[0]


def _attempt(c: Claimed, push: Push, secret: str) -> _Done:
    started = datetime.now(UTC)
    if c.expires_at is not None and c.expires_at <= started:
        return _Done(c, started)
    if c.kind != SubscriptionKind.HANDLER.value:
        try:
            return _Done(c, started, push(c))
        except Exception as exc:  # a sender's bug must not leave the delivery claimed
            log.exception("pushing delivery %s failed", c.delivery_id)
            return _Done(c, started, Attempt(False, f"{type(exc).__name__}: {exc}"))
    try:
        claims = tokens.verify(secret, c.token, now_ms=int(time.time() * 1000))
        if (claims.user, claims.impersonator, claims.correlation_id) != (
            c.user,
            c.impersonator,
            c.correlation_id,
        ):
            raise tokens.Unauthorized("the token was signed for another message or user")
    except tokens.Unauthorized as exc:
        log.warning("delivery %s refused: %s", c.delivery_id, exc)
        return _Done(c, started, refused=f"unauthorized: {exc}")
    handler = consumers.get(c.handler or "")
    try:
        if handler is None:
            raise LookupError(f"no consumer registered for {c.handler!r}")
        handler(c)
        return _Done(c, started, Attempt(True), handler_ran=True)
    except Exception as exc:
        exception_id = uuid.uuid4().hex
        log.error("consumer %s failed [%s]: %s", c.handler, exception_id, traceback.format_exc())
        failed = Attempt(False, f"{type(exc).__name__}: {exc} [{exception_id}]")
        return _Done(c, started, failed, handler_ran=True, exception_id=exception_id)


def _log_queue(
    conn: Any, c: Claimed, started: datetime, *, ok: bool, exception_id: str | None
) -> None:
    conn.execute(
        text(
            "INSERT INTO queue_message (delivery_id, message, routing_key,"
            " scheduled_start_time, start_time, end_time, state, exception_id, memory_used)"
            " VALUES (:d, :m, :rk, :sched, :start, now(), :state, :exc, :mem)"
        ),
        {
            "d": c.delivery_id,
            "m": json.dumps(c.payload),
            "rk": c.routing_key,
            "sched": c.deliver_at if c.delayed else None,  # a $delay's due time
            "start": started,
            "state": "Completed" if ok else "Error",
            "exc": exception_id,
            "mem": _rss_bytes(),
        },
    )


def _release_next(conn: Any, c: Claimed) -> None:
    """An ordered key's head reached a final state: its successor is due at once."""
    if c.order_value is None:
        return
    conn.execute(
        text(
            "UPDATE delivery SET next_attempt_at = now(), scheduled_at = now()"
            " WHERE delivery_id = ("
            " SELECT min(delivery_id) FROM delivery WHERE subscription_id = :s"
            " AND order_value = :v AND state = 'PENDING' AND delivery_id > :d)"
        ),
        {"s": c.subscription_id, "v": c.order_value, "d": c.delivery_id},
    )


_SETTLE_DELIVERED = text(
    """
    SET LOCAL synchronous_commit TO OFF;
    WITH held AS (
        UPDATE delivery SET state = 'DELIVERED', delivered_at = now(), claimed_at = NULL,
               claim = NULL, last_error = NULL
         WHERE delivery_id = ANY(:ids) AND state = 'IN_PROCESS' AND claim = :claim
        RETURNING delivery_id, event_id, subscription_id, attempt)
    INSERT INTO published_messages (correlation_id, delivery_id, event_id, subscription_id,
                                    attempt, published_at, delivered_at, outcome)
    SELECT e.correlation_id, held.delivery_id, held.event_id, held.subscription_id,
           held.attempt, :p, now(), 'DELIVERED'
      FROM held JOIN event e USING (event_id)
    RETURNING delivery_id
    """
)

_SETTLE = text(
    """
    WITH held AS (
        UPDATE delivery SET state = :state, attempt = :next_attempt,
               next_attempt_at = COALESCE(:at, next_attempt_at),
               scheduled_at = COALESCE(:at, scheduled_at),
               claimed_at = NULL, claim = NULL,
               delivered_at = CASE WHEN :state = 'DELIVERED' THEN now() END, last_error = :why
         WHERE delivery_id = :id AND state = 'IN_PROCESS' AND claim = :claim
        RETURNING delivery_id)
    INSERT INTO published_messages (correlation_id, delivery_id, event_id, subscription_id,
                                    attempt, published_at, delivered_at, outcome, error)
    SELECT :c, held.delivery_id, :e, :s, :a, :p,
           CASE WHEN :state = 'DELIVERED' THEN now() END, :o, :why
      FROM held
    """
)


def _set_state(
    conn: Any,
    c: Claimed,
    claim: str,
    state: str,
    next_attempt: int,
    at: datetime | None,
    why: str | None,
    outcome: str,
) -> bool:
    """Record the outcome and its published_messages row in one statement, only while this
    claim still holds the delivery."""
    done = conn.execute(
        _SETTLE,
        {
            "state": state,
            "next_attempt": next_attempt,
            "at": at,
            "why": why,
            "id": c.delivery_id,
            "claim": claim,
            "c": c.correlation_id,
            "e": c.event_id,
            "s": c.subscription_id,
            "a": c.attempt,
            "p": datetime.now(UTC),
            "o": outcome,
        },
    )
    return bool(done.rowcount)


def _settle(conn: Any, d: _Done, claim: str) -> str:
    c = d.claimed
    if d.refused is not None:
        # Consumer authorization failed: never processed, dead-lettered with the reason.
        state, why, outcome = "DEAD", d.refused, "DEAD"
        held = _set_state(conn, c, claim, state, c.attempt, None, why, outcome)
        if held:
            _log_queue(conn, c, d.started, ok=False, exception_id=None)
    elif d.attempt is None:
        state, why, outcome = "EXPIRED", "past the room's message expiration", "EXPIRED"
        held = _set_state(conn, c, claim, state, c.attempt, None, why, outcome)
    elif d.attempt.ok:
        state, why, outcome = "DELIVERED", None, "DELIVERED"
        held = _set_state(conn, c, claim, state, c.attempt, None, None, outcome)
    else:
        next_attempt = c.attempt + 1
        wait = backoff_ms(c.delay_ms, c.multiplier, next_attempt)  # at most MAX_WAIT_MS
        at = datetime.now(UTC) + timedelta(milliseconds=wait)
        if c.attempts == 0 or next_attempt > c.attempts:
            state, why = "DEAD", f"{d.attempt.error} (attempts spent: {c.attempts})"
        elif c.expires_at is not None and at >= c.expires_at:
            state, why = "EXPIRED", f"{d.attempt.error} (the next try would come after expiry)"
        else:
            state, why = "PENDING", d.attempt.error
        outcome = "FAILED" if state == "PENDING" else state
        held = _set_state(conn, c, claim, state, next_attempt, at, why, outcome)
    if not held:
        # The claim was released meanwhile (too slow) and the delivery taken over: its
        # outcome now belongs to the new holder.
        log.warning("delivery %s was taken over; this outcome is dropped", c.delivery_id)
        return "LOST_CLAIM"
    if d.handler_ran:
        _log_queue(conn, c, d.started, ok=state == "DELIVERED", exception_id=d.exception_id)
    if state != "PENDING":
        _release_next(conn, c)  # a retry waiting at the head keeps holding its key
    return state


def redrive(
    engine: Engine, delivery_ids: list[int] | None = None, subscription_id: int | None = None
) -> list[int]:
    """An operator sends dead-lettered deliveries again: attempts start over, due now."""
    if not delivery_ids and subscription_id is None:
        raise InvalidMessage("delivery_ids", "name the deliveries, or a subscription_id")
    where = "state = 'DEAD'"
    params: dict[str, Any] = {}
    if delivery_ids is not None:
        where += " AND delivery_id = ANY(:ids)"
        params["ids"] = delivery_ids
    if subscription_id is not None:
        where += " AND subscription_id = :sub"
        params["sub"] = subscription_id
    with engine.begin() as conn:
        rows = conn.execute(
            text(
                f"UPDATE delivery SET state = 'PENDING', attempt = 0, next_attempt_at = now(),"
                f" scheduled_at = now(),"
                f" last_error = 'redriven: ' || COALESCE(last_error, '') WHERE {where}"
                " RETURNING delivery_id"
            ),
            params,
        )
        return [int(r[0]) for r in rows]


def dead_letters(engine: Engine, room_name: str | None = None) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT d.delivery_id, d.subscription_id, d.attempt, d.last_error,"
                " e.correlation_id, e.routing_key, r.name AS room"
                " FROM delivery d JOIN event e USING (event_id) JOIN room r USING (room_id)"
                " WHERE d.state = 'DEAD' AND (CAST(:room AS text) IS NULL OR r.name = :room)"
                " ORDER BY d.delivery_id"
            ),
            {"room": room_name},
        )
        return [dict(r._mapping) for r in rows]


# --- pull -----------------------------------------------------------------------------------

_PULL = text(
    """
    UPDATE delivery d SET state = 'IN_PROCESS', claimed_at = now(), receipt = md5(random()::text)
     WHERE d.delivery_id IN (
           SELECT o.delivery_id FROM delivery o JOIN event e USING (event_id)
            WHERE o.subscription_id = :sub AND o.pull AND o.state = 'PENDING'
              AND o.next_attempt_at <= now()
              AND (e.expires_at IS NULL OR e.expires_at > now())
              AND (o.order_value IS NULL OR NOT EXISTS (
                    SELECT 1 FROM delivery p
                     WHERE p.subscription_id = o.subscription_id AND p.order_value = o.order_value
                       AND p.delivery_id < o.delivery_id AND p.state IN ('PENDING', 'IN_PROCESS')))
            ORDER BY o.delivery_id
            LIMIT :max
            FOR UPDATE OF o SKIP LOCKED)
    RETURNING d.delivery_id, d.receipt, d.attempt, d.event_id
    """
)


def pull(engine: Engine, subscription_id: int, max_messages: int = 10) -> list[dict[str, Any]]:
    """A PULL subscriber takes due messages; each must be ACKed within the visibility timeout."""
    if not 1 <= max_messages <= 1000:
        raise InvalidMessage("max", "must be 1 to 1000")
    with engine.begin() as conn:
        found = conn.execute(
            text("SELECT kind, status FROM subscription WHERE subscription_id = :s"),
            {"s": subscription_id},
        ).first()
        if found is None:
            raise NotFound("subscription", subscription_id)
        kind, status = found
        if status != Status.ACTIVE.value:
            return []
        if kind != SubscriptionKind.PULL.value:
            raise InvalidMessage("subscription_id", f"subscription {subscription_id} is {kind}")
        taken = conn.execute(_PULL, {"sub": subscription_id, "max": max_messages}).all()
        out = []
        for delivery_id, receipt, attempt, event_id in taken:
            event = conn.execute(
                text(
                    "SELECT correlation_id, routing_key, payload, user_id, impersonator_id"
                    " FROM event WHERE event_id = :e"
                ),
                {"e": event_id},
            ).one()
            conn.execute(
                text(
                    "INSERT INTO published_messages (correlation_id, delivery_id, event_id,"
                    " subscription_id, attempt, published_at, outcome)"
                    " VALUES (:c, :d, :e, :s, :a, now(), 'PENDING')"
                ),
                {
                    "c": event.correlation_id,
                    "d": delivery_id,
                    "e": event_id,
                    "s": subscription_id,
                    "a": attempt,
                },
            )
            out.append(
                {
                    "delivery_id": delivery_id,
                    "receipt": receipt,
                    "attempt": attempt,
                    "correlation_id": event.correlation_id,
                    "routing_key": event.routing_key,
                    "payload": event.payload,
                    "user": event.user_id,
                    "impersonator": event.impersonator_id,
                }
            )
        return out


def ack_pulled(engine: Engine, subscription_id: int, delivery_id: int, receipt: str) -> None:
    """The subscriber processed a pulled message: delivered (only with the current receipt)."""
    with engine.begin() as conn:
        done = conn.execute(
            text(
                "UPDATE delivery SET state = 'DELIVERED', delivered_at = now(), receipt = NULL"
                " WHERE delivery_id = :d AND subscription_id = :s AND pull"
                " AND state = 'IN_PROCESS' AND receipt = :r RETURNING attempt"
            ),
            {"d": delivery_id, "s": subscription_id, "r": receipt},
        ).first()
        if done is None:
            raise NotFound("pulled message (or its visibility timeout passed)", delivery_id)
        conn.execute(
            text(
                "UPDATE published_messages SET outcome = 'DELIVERED', delivered_at = now()"
                " WHERE id = (SELECT max(id) FROM published_messages WHERE delivery_id = :d)"
            ),
            {"d": delivery_id},
        )
