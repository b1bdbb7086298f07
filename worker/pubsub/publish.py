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

from orderly.worker import nodes, tokens
from orderly.worker.core import tracing
from orderly.worker.core.clock import SYSTEM, Clock, utcnow
from orderly.worker.core.due import DEFAULT_LEASE_MS
from orderly.worker.core.errors import Forbidden, InvalidMessage, NotFound, SettingMissing
from orderly.worker.core.inputs import parse_input
from orderly.worker.core.lease import new_token
from orderly.worker.core.retry import MAX_DELAY_MS
from orderly.worker.core.scopes import IMPERSONATE
from orderly.worker.db.queries import sql
from orderly.worker.pubsub import schemas
from orderly.worker.pubsub.routing import ROUTING_KEY, Name, Route, order_value, routes

log = logging.getLogger(__name__)

# Deliveries one task carries: a publish that fans out to N subscriptions is one task.
BATCH = 50
# A delivery handed to the broker right after the commit is out of the ticker's sight this
# long; if that hand-off is lost, the ticker brings it back (worker.core.due).
QUEUED_LEASE_S = DEFAULT_LEASE_MS / 1000


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


def _context(conn: Connection, room_name: str) -> tuple[Any, dict[str, int], list[Route]]:
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


def _store(
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
    """Insert events (dicts of correlation_id, token, routing_key, payload, deliver_at) and
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
            "trace_parent": tracing.current_parent(),  # each delivery's send continues it
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
    now = utcnow(clock)
    with engine.begin() as conn:
        room, publishers, subscriptions = _context(conn, room_name)
        publisher_id = None
        if publishers:
            if pub.publisher is None:
                raise InvalidMessage("publisher", f"room {room_name!r} names its publishers")
            if pub.publisher not in publishers:
                raise InvalidMessage("publisher", f"{pub.publisher!r} may not publish here")
            publisher_id = publishers[pub.publisher]
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
            "payload_text": payload_text,
            "deliver_at": deliver_at,
        }
        inserted, deliveries = _store(
            conn,
            room,
            now,
            [event],
            subscriptions,
            event_type_id=event_type_id,
            version=version,
            publisher_id=publisher_id,
            user=pub.user,
            impersonator=pub.impersonator,
            node_id=node_id,
            idempotency_key=idempotency_key,
            idempotency_hash=fingerprint,
            named=named,
        )
    event_id, _ = inserted[0]
    if not deliveries:
        log.info("event %s in %s matched no subscription: unroutable", event_id, room_name)
    pulled = tuple(
        s.subscription_id
        for s in selected(subscriptions, named, event_type_id, version, routing_key)
        if s.pull and pub.delay_ms == 0
    )
    result = Published(
        correlation_id, event_id, [d for d, _, _ in deliveries], not deliveries, pulled=pulled
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
        room, _, subscriptions = _context(conn, room_name)
        typeless = [s for s in subscriptions if s.event_type_id is None]
        _, deliveries = _store(conn, room, now, events, typeless, user=user)
    return [d for d, _, due in deliveries if due]
