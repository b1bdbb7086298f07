"""Publish: store an event and one delivery per active matching subscription, in one
transaction; the deliveries due now are returned for the caller to hand to the broker after
the commit, delayed ones wait in the due-time index (``delivery.scheduled_at``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints
from sqlalchemy import Connection, Engine

from orderly.worker import tokens
from orderly.worker.core import tracing
from orderly.worker.core.clock import SYSTEM, Clock, utcnow
from orderly.worker.core.errors import Forbidden, InvalidMessage
from orderly.worker.core.inputs import parse_input
from orderly.worker.core.lease import new_token
from orderly.worker.core.retry import MAX_DELAY_MS
from orderly.worker.core.scopes import IMPERSONATE
from orderly.worker.db.queries import sql
from orderly.worker.pubsub import schemas
from orderly.worker.pubsub.event_rows import context, selected, store
from orderly.worker.pubsub.routing import ROUTING_KEY, Name, Route

log = logging.getLogger(__name__)

# Deliveries one task carries: a publish that fans out to N subscriptions is one task.
BATCH = 50


class PublishIn(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    payload: Any
    event_type: Name | None = None
    version: Annotated[StrictInt, Field(ge=1)] | None = None
    routing_key: Annotated[str, StringConstraints(max_length=255)] | None = None
    publisher: Name | None = None
    user: Name | None = None
    impersonator: Name | None = None
    delay_ms: Annotated[StrictInt, Field(ge=0, le=MAX_DELAY_MS)] = Field(0, alias="$delay")
    # subscriptions of the room (by name) the event goes to whatever they select; the room's
    # other subscriptions are chosen by their routing rules as always
    destinations: Annotated[list[Name], Field(min_length=1, max_length=100)] | None = None


@dataclass(frozen=True)
class Published:
    correlation_id: str
    event_id: int
    deliveries: list[int]
    unroutable: bool
    # False: a publish with the same idempotency key stored this event before
    created: bool = True
    # the PULL subscriptions it gave a delivery due now (their waiting pulls are told)
    pulled: tuple[int, ...] = ()


# An Idempotency-Key: printable ASCII, as an HTTP header carries it.
_KEY = re.compile(r"^[\x21-\x7e]{1,200}$")


def _payload_text(payload: Any) -> str:
    try:
        return json.dumps(payload, allow_nan=False)
    except ValueError:
        raise InvalidMessage("payload", "NaN and Infinity are not JSON") from None


def _as_caller(pub: PublishIn, caller: str | None, may_impersonate: bool) -> PublishIn:
    """The publish as the authenticated ``caller`` sends it: the caller is its user and, in a
    room that names its publishers, its publisher; another user or publisher needs
    ``may_impersonate`` (the caller is then the impersonator)."""
    if caller is None:
        return pub
    if pub.impersonator is not None:
        raise InvalidMessage("impersonator", "is the API key's name: leave it out")
    publisher = pub.publisher or caller
    if pub.user in (None, caller) and publisher == caller:
        return pub.model_copy(update={"user": caller, "publisher": publisher})
    if not may_impersonate:
        raise Forbidden(IMPERSONATE, caller)
    return pub.model_copy(
        update={"user": pub.user or caller, "publisher": publisher, "impersonator": caller}
    )


@dataclass(frozen=True)
class NewPublish:
    """A publish as given, checked without its room (:func:`parse_publish`)."""

    room: str
    pub: PublishIn
    payload_text: str
    idempotency_key: str | None = None
    trace_parent: str | None = None  # the span it was taken in: its deliveries continue it


@dataclass(frozen=True)
class Routed:
    """A publish checked against its room: the event to store and what it is stored with."""

    event: dict[str, Any]
    event_type_id: int | None
    version: int | None
    named: frozenset[str]


def parse_publish(
    room_name: str,
    data: Any,
    *,
    idempotency_key: str | None = None,
    max_payload_bytes: int | None = None,
    caller: str | None = None,
    may_impersonate: bool = False,
) -> NewPublish:
    """The publish ``data`` is, as the ``caller`` sends it (:func:`publish`), or
    InvalidMessage naming the bad field. Reads nothing (a coroutine may call it)."""
    pub = _as_caller(parse_input(PublishIn, data), caller, may_impersonate)
    payload_text = _payload_text(pub.payload)
    if max_payload_bytes is not None:
        size = len(payload_text.encode("utf-8", "surrogatepass"))
        if size > max_payload_bytes:
            raise InvalidMessage(
                "payload", f"{size} bytes is over the limit of {max_payload_bytes} bytes"
            )
    if idempotency_key is not None and not _KEY.fullmatch(idempotency_key):
        raise InvalidMessage("Idempotency-Key", "1 to 200 printable ASCII characters")
    return NewPublish(room_name, pub, payload_text, idempotency_key, tracing.current_parent())


def publish(
    engine: Engine,
    room_name: str,
    data: Any,
    *,
    secret: str = "",
    token_ttl_ms: int = 86_400_000,
    clock: Clock = SYSTEM,
    node_id: int | None = None,
    idempotency_key: str | None = None,
    max_payload_bytes: int | None = None,
    caller: str | None = None,
    may_impersonate: bool = False,
    schema_limits: schemas.Limits | None = None,
) -> tuple[Published, list[int]]:
    """Store an event and one delivery per active matching subscription; with ``node_id``,
    only through that node in RUN (NodeNotAccepting otherwise: a draining or stopped node
    takes no new events). With ``idempotency_key``, a publish to the same room with the same
    key returns the event stored the first time (``created`` False) and stores nothing.

    ``caller``: the authenticated publisher (the API key's name). The event's user is the
    caller; naming another ``user`` needs ``may_impersonate`` and makes the caller the
    impersonator (both are signed into the token). Without a caller (Python code, the CLI),
    ``user`` and ``impersonator`` are taken as given.

    ``schema_limits``: what validating the payload against its event type's schema may cost
    (worker.pubsub.schemas); the configured ones when not given.

    Returns the result and the deliveries due now, for the caller to enqueue after the
    commit (delayed ones are left to the ticker).
    """
    new = parse_publish(
        room_name,
        data,
        idempotency_key=idempotency_key,
        max_payload_bytes=max_payload_bytes,
        caller=caller,
        may_impersonate=may_impersonate,
    )
    return store_publish(
        engine,
        new,
        secret=secret,
        token_ttl_ms=token_ttl_ms,
        clock=clock,
        node_id=node_id,
        schema_limits=schema_limits,
    )


def store_publish(
    engine: Engine,
    new: NewPublish,
    *,
    secret: str = "",
    token_ttl_ms: int = 86_400_000,
    clock: Clock = SYSTEM,
    node_id: int | None = None,
    schema_limits: schemas.Limits | None = None,
) -> tuple[Published, list[int]]:
    """Store one publish (:func:`parse_publish`) on its own, as :func:`publish`."""
    pub, room_name, idempotency_key = new.pub, new.room, new.idempotency_key
    now = utcnow(clock)
    with engine.begin() as conn:
        room, publishers, subscriptions = context(conn, room_name)
        publisher_id = publisher_of(new, publishers)
        fingerprint = None
        if idempotency_key is not None:
            # The same key with another body is a mistake to report, not a repeat to answer.
            # (destinations only when named: a body without them hashes as it always did)
            fields = pub.model_dump(
                mode="json",
                by_alias=True,
                exclude={"destinations"} if pub.destinations is None else None,
            )
            canonical = json.dumps(fields, sort_keys=True)
            fingerprint = hashlib.sha256(canonical.encode()).hexdigest()
            key = {"room_id": room.room_id, "key": idempotency_key}
            conn.execute(sql("idempotency_key_lock"), key)
            before = conn.execute(sql("event_by_idempotency_key"), key).first()
            if before is not None:
                if before.idempotency_hash != fingerprint:
                    raise InvalidMessage(
                        "Idempotency-Key",
                        "was given to another publish to this room, with a different body",
                    )
                # Stored before (even if the room was paused since): its deliveries were
                # handed off then, or wait for the ticker.
                stored = Published(
                    before.correlation_id,
                    int(before.event_id),
                    [int(d) for d in before.deliveries],
                    bool(before.unroutable),
                    created=False,
                )
                return stored, []
        routed = route(
            conn, room, subscriptions, new, now,
            secret=secret, token_ttl_ms=token_ttl_ms, schema_limits=schema_limits,
        )  # fmt: skip
        inserted, deliveries = store(
            conn,
            room,
            now,
            [routed.event],
            subscriptions,
            event_type_id=routed.event_type_id,
            version=routed.version,
            publisher_id=publisher_id,
            user=pub.user,
            impersonator=pub.impersonator,
            node_id=node_id,
            idempotency_key=idempotency_key,
            idempotency_hash=fingerprint,
            named=routed.named,
        )
    event_id, _ = inserted[0]
    return result_of(new, routed, event_id, deliveries, subscriptions)


def publisher_of(new: NewPublish, publishers: dict[str, int]) -> int | None:
    """The publisher id the publish is stored with: a room that names its publishers takes
    only theirs."""
    if not publishers:
        return None
    if new.pub.publisher is None:
        raise InvalidMessage("publisher", f"room {new.room!r} names its publishers")
    if new.pub.publisher not in publishers:
        raise InvalidMessage("publisher", f"{new.pub.publisher!r} may not publish here")
    return publishers[new.pub.publisher]


def route(
    conn: Connection,
    room: Any,
    subscriptions: list[Route],
    new: NewPublish,
    now: datetime,
    *,
    secret: str,
    token_ttl_ms: int,
    schema_limits: schemas.Limits | None,
) -> Routed:
    """The publish checked against its room (paused, event type and schema, destinations,
    routing key) and its event, signed with ``secret`` when there is one."""
    pub, room_name = new.pub, new.room
    if room.status == "PAUSED":
        raise InvalidMessage("room", f"room {room_name!r} is paused")
    event_type_id = version = None
    if pub.event_type is not None:
        found = conn.execute(
            sql("publish_event_type"),
            {"room_id": room.room_id, "name": pub.event_type, "version": pub.version},
        ).first()
        if found is None:
            known = conn.execute(
                sql("event_type_exists"), {"room_id": room.room_id, "name": pub.event_type}
            ).first()
            if known is None:
                raise InvalidMessage("event_type", f"no event type {pub.event_type!r} here")
            raise InvalidMessage("version", f"{pub.event_type} has no version {pub.version}")
        event_type_id, version, schema = found
        # bounded, never fetching; one validator per event type version
        validator = schemas.validator(schema, (int(event_type_id), int(version)))
        limits = schema_limits or schemas.configured_limits()
        failed = schemas.errors(validator, pub.payload, limits)
        if failed is not None:
            raise InvalidMessage(*failed)
    named = frozenset(pub.destinations or ())
    missing = sorted(named - {s.name for s in subscriptions})
    if missing:
        raise InvalidMessage(
            "destinations",
            f"room {room_name!r} has no active subscription {', '.join(map(repr, missing))}",
        )
    routing_key = pub.routing_key or pub.event_type
    if routing_key is None:
        raise InvalidMessage("routing_key", "missing (or give an event_type)")
    if not ROUTING_KEY.fullmatch(routing_key):
        raise InvalidMessage("routing_key", "dot-separated words of A-Z a-z 0-9 _ -")
    deliver_at = now + timedelta(milliseconds=pub.delay_ms)
    correlation_id = new_token()
    token = None
    if secret:
        expires_ms = int(deliver_at.timestamp() * 1000) + token_ttl_ms
        claims = tokens.Claims(pub.user, pub.impersonator, correlation_id, expires_ms)
        token = tokens.sign(secret, claims)
    event = {
        "correlation_id": correlation_id,
        "token": token,
        "routing_key": routing_key,
        "payload": pub.payload,
        "payload_text": new.payload_text,
        "deliver_at": deliver_at,
        "trace_parent": new.trace_parent,
    }
    return Routed(
        event,
        None if event_type_id is None else int(event_type_id),
        None if version is None else int(version),
        named,
    )


def result_of(
    new: NewPublish,
    routed: Routed,
    event_id: int,
    deliveries: Sequence[tuple[int, int, bool]],
    subscriptions: list[Route],
) -> tuple[Published, list[int]]:
    """The stored event's result (its ``deliveries``), and its deliveries due now."""
    if not deliveries:
        log.info("event %s in %s matched no subscription: unroutable", event_id, new.room)
    chosen = selected(
        subscriptions, routed.named, routed.event_type_id, routed.version,
        routed.event["routing_key"],
    )  # fmt: skip
    pulled = tuple(s.subscription_id for s in chosen if s.pull and new.pub.delay_ms == 0)
    result = Published(
        routed.event["correlation_id"],
        event_id,
        [d for d, _, _ in deliveries],
        not deliveries,
        pulled=pulled,
    )
    return result, [d for d, _, due in deliveries if due]


def hand_off(due: list[int], enqueue: Callable[[list[int]], None]) -> None:
    """The deliveries due now, to the broker after the commit: one task per ``BATCH``."""
    for i in range(0, len(due), BATCH):
        enqueue(due[i : i + BATCH])


def publish_message(
    engine: Engine,
    room_name: str,
    message: Any,
    routing_key: str,
    *,
    enqueue: Callable[[list[int]], None],
    delay_ms: int = 0,
    secret: str = "",
    clock: Clock = SYSTEM,
    **fields: Any,
) -> Published:
    """The broker seed's ``publish($message, $routingKey)`` with ``$delay``, for Python code."""
    data = {"payload": message, "routing_key": routing_key, "$delay": delay_ms, **fields}
    result, due = publish(engine, room_name, data, secret=secret, clock=clock)
    hand_off(due, enqueue)
    return result


def publish_many(
    engine: Engine,
    room_name: str,
    messages: list[tuple[Any, str, int]],
    *,
    secret: str = "",
    token_ttl_ms: int = 86_400_000,
    user: str | None = None,
    clock: Clock = SYSTEM,
) -> list[int]:
    """Many ``(payload, routing_key, delay_ms)`` at once, in one transaction (no event types).

    Every message is routed like a single publish; the deliveries due now are returned for
    the caller to enqueue, the delayed ones wait in the due-time index.
    """
    now = utcnow(clock)
    events = []
    for i, (payload, routing_key, delay_ms) in enumerate(messages):
        if not ROUTING_KEY.fullmatch(routing_key):
            raise InvalidMessage(f"messages[{i}].routing_key", "dot-separated words")
        if not 0 <= delay_ms <= MAX_DELAY_MS:
            raise InvalidMessage(f"messages[{i}].delay_ms", "0 to one year")
        correlation_id = new_token()
        deliver_at = now + timedelta(milliseconds=delay_ms)
        token = None
        if secret:
            exp = int(deliver_at.timestamp() * 1000) + token_ttl_ms
            token = tokens.sign(secret, tokens.Claims(user, None, correlation_id, exp))
        events.append(
            {
                "correlation_id": correlation_id,
                "token": token,
                "routing_key": routing_key,
                "payload": payload,
                "payload_text": _payload_text(payload),
                "deliver_at": deliver_at,
            }
        )
    with engine.begin() as conn:
        room, _, subscriptions = context(conn, room_name)
        typeless = [s for s in subscriptions if s.event_type_id is None]
        _, deliveries = store(conn, room, now, events, typeless, user=user)
    return [d for d, _, due in deliveries if due]
