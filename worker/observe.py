"""What orderly is doing now, read from PostgreSQL and Redis: the figures behind ``GET /metrics``
and ``orderly status``.

Plain functions over an Engine and Redis clients; they read and never change anything (but
``Services.live`` forgetting the ids of workers already gone). Each source is read in as few
round trips as it allows, and a source that cannot be reached leaves its part out and names
the error, so the others can still be shown.
"""

from __future__ import annotations

import enum
import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import redis
from redis.exceptions import RedisError
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from orderly.models.enums import MessageState
from orderly.models.keys import BridgeKeys, TrackKeys
from orderly.models.pubsub import DeliveryState
from orderly.worker.core.clients import OrderingRedis
from orderly.worker.core.scripts import as_text
from orderly.worker.db.queries import sql
from orderly.worker.totals import Total, Totals
from orderly.worker.tracking import Services, TrackingSnapshot, snapshot

# kombu's Redis transport (kombu/transport/redis.py, Channel): a queue is a list under its own
# name for priority 0 and one list per further priority step under name + sep + step; tasks
# a worker took and has not acknowledged yet wait in one hash for all queues.
BROKER_PRIORITY_SEP = "\x06\x16"
BROKER_PRIORITY_STEPS = (0, 3, 6, 9)
BROKER_UNACKED_KEY = "unacked"


class Source(enum.StrEnum):
    POSTGRESQL = "postgresql"
    REDIS = "redis"  # the conversation structures (bridge prefix)
    TRACKING = "tracking"  # the tracking and service keys (serviceRedis)
    BROKER = "broker"  # the Celery broker's queues


# Messages that wait for their due time (``message.due_at``, served by the messages' due
# source): NEW ones scheduled for later, PARTLY_FAILED retry waits, POSTPONED rests, IN_QUEUE
# retries after a timeout.
DUE_STATES = (
    MessageState.NEW,
    MessageState.PARTLY_FAILED,
    MessageState.POSTPONED,
    MessageState.IN_QUEUE,
)


class BlockReason(enum.StrEnum):
    REQUEST = "request"  # an earlier request still waits for its first response
    RETRY = "retry"  # a recoverable failure's backoff wait
    ACK = "ack"  # delivered with a 202, waiting for the client's ACK
    AWAITED = "awaited"  # attempts spent: waiting for its awaited retry


# A PUSH endpoint's circuit when it is not well (worker.pubsub.endpoints).
CIRCUITS = ("FAILING", "OPEN", "DISABLED")


@dataclass(frozen=True)
class StoreFigures:
    """PostgreSQL: every message state and delivery state present, 0 when absent."""

    messages: Mapping[MessageState, int]
    deliveries: Mapping[DeliveryState, int]
    deliveries_delayed: int  # PENDING and due in the future: a $delay or a retry wait
    oldest_blocked_head_age_s: float  # of the heads asked about; 0 when none
    # Conversation responses handed to their client after their request had expired
    # (MESSAGE_TTL): rows with ``late_ms`` set. Rows are never deleted: it only grows.
    late_responses: int = 0
    # Messages waiting for their due time, by state (every one of DUE_STATES, 0 when none).
    due_waiting: Mapping[MessageState, int] = field(
        default_factory=lambda: dict.fromkeys(DUE_STATES, 0)
    )
    # Seconds the earliest due time of those is past (0 when none is): the due work's ticker
    # should take a message within a tick of its time, so a growing lag says it is behind.
    due_lag_s: float = 0.0
    # PUSH endpoints not well, by circuit: FAILING (their last send failed, circuit closed),
    # OPEN (only probes go), DISABLED (nothing goes until an operator enables them).
    endpoints: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(CIRCUITS, 0))


@dataclass(frozen=True)
class ConversationFigures:
    """The conversation structures in Redis.

    A conversation is *open* while it has an undelivered response (a member of its order and
    of ``pendingMessages``; a cancelled one's hash may stay, status CANCEL, out of both). Its
    *head* is the first of those in the conversation's order. The conversation is *blocked*
    when the ordering gate (worker/lua/advance.lua) would not send the head now:

    - ``request``: the request list's head is an earlier request still waiting for its
      first response (WAIT_REQUEST);
    - ``ack``: the head was delivered with a 202 and is SENT, waiting for its ACK (WAIT_ACK);
    - ``retry``: the head waits out the backoff of a recoverable failure (WAIT_RETRY);
    - ``awaited``: the head is AWAITED and its awaited retry is not due yet (WAIT_AWAITED).

    A head being sent (claimed, PENDING) is in flight, and a head that may go now but no
    drain has taken yet is ready: neither is blocked. The age of a blocked head is the time
    since its response reached orderly (its message's ``receive_timestamp``).
    """

    open: int
    responses_undelivered: int
    blocked: Mapping[BlockReason, int]
    ready: int
    in_flight: int
    awaited: int  # responses AWAITED, heads or not
    scheduled: int  # conversations with a wake-up time in ``scheduled``
    awaited_due: int  # ``pendingMessages`` members the awaited agent would take now
    blocked_head_msg_ids: tuple[int, ...]
    oldest_blocked_head_age_s: float | None = None  # from PostgreSQL; None when unknown

    @property
    def blocked_total(self) -> int:
        return sum(self.blocked.values())


@dataclass(frozen=True)
class BrokerFigures:
    queues: Mapping[str, int]  # tasks waiting in each queue, every priority included
    # tasks taken by workers and not yet acknowledged (all queues); None: the broker does not
    # tell its clients (RabbitMQ)
    unacked: int | None


@dataclass(frozen=True)
class Figures:
    """One gathering; a part is None when its source failed (``errors`` says why)."""

    store: StoreFigures | None
    conversations: ConversationFigures | None
    tracking: TrackingSnapshot | None
    workers_alive: Mapping[str, int] | None  # node code -> live workers
    broker: BrokerFigures | None
    errors: Mapping[Source, str] = field(default_factory=dict)
    # the running totals of the counters and histograms (worker.totals; None: not read)
    totals: Sequence[Total] | None = None
    gathered_at: float = 0.0  # seconds since the epoch
    # the Redis servers that may evict orderly's keys (worker.readiness.evicting; None: not
    # asked)
    redis_evicting: Sequence[str] | None = None


# --- PostgreSQL -------------------------------------------------------------------------------


def store_figures(engine: Engine, head_msg_ids: Sequence[int] = ()) -> StoreFigures:
    """Messages and deliveries by state, delayed deliveries, late conversation responses, the
    age (seconds) of the oldest of ``head_msg_ids`` (the blocked conversation heads), and the
    messages waiting for their due time with the earliest one's lag, in one round trip."""
    messages = dict.fromkeys(MessageState, 0)
    deliveries = dict.fromkeys(DeliveryState, 0)
    due = dict.fromkeys(DUE_STATES, 0)
    endpoints = dict.fromkeys(CIRCUITS, 0)
    delayed, late, age, lag = 0, 0, 0.0, 0.0
    with engine.connect() as conn:
        rows = conn.execute(sql("store_figures"), {"ids": list(head_msg_ids)}).all()
    for part, key, value in rows:
        if part == "message":
            messages[MessageState(key)] = int(value)
        elif part == "delivery":
            deliveries[DeliveryState(key)] = int(value)
        elif part == "delayed":
            delayed = int(value)
        elif part == "late":
            late = int(value)
        elif part == "due":
            due[MessageState(key)] = int(value)
        elif part == "due_lag":
            lag = float(value)
        elif part == "endpoint":
            endpoints[key] = int(value)
        else:
            age = max(0.0, float(value))
    return StoreFigures(messages, deliveries, delayed, age, late, due, lag, endpoints)


# --- conversations ----------------------------------------------------------------------------


def _int(value: Any, default: int = 0) -> int:
    if value is None or value in (b"", ""):
        return default
    return int(float(as_text(value)))


@dataclass(frozen=True)
class OpenConversation:
    """One open conversation as the gate sees it: its head response and why it waits."""

    conversation_id: str
    head_response_id: str
    head_msg_id: int | None
    head_status: str
    reason: BlockReason | None  # None: not blocked (ready, or in flight)
    in_flight: bool  # the head is being sent now
    undelivered: int  # responses of the conversation not delivered yet
    origin: str = ""  # the client its responses go to (the conversation's owner)


@dataclass(frozen=True)
class _Conversations:
    open: list[OpenConversation]
    live: dict[str, list[Any]]  # pendingMessages member -> its response hash's fields
    scheduled: int
    awaited_due: int


def _conversations(client: OrderingRedis, keys: BridgeKeys, now: int) -> _Conversations:
    """The gate's view of every open conversation, in three pipelined round trips: the
    pending responses (of every shard); their hashes with each open conversation's order and
    request list; the listed requests' positions."""
    pipe = client.pipeline(transaction=False)
    for shard in keys.every_shard:
        pipe.zrange(shard.pending_messages, 0, -1)
        pipe.zcard(shard.scheduled)
        pipe.zcard(shard.scheduled_leased)  # wake-ups being handed to the broker right now
        pipe.zcount(shard.pending_messages, "-inf", now)
    per_shard = pipe.execute()
    raw_members = [m for found in per_shard[0::4] for m in found]
    scheduled, waking = sum(per_shard[1::4]), sum(per_shard[2::4])
    awaited_due = sum(per_shard[3::4])

    members = [as_text(m) for m in raw_members]
    infos = [json.loads(m) for m in members]
    conversations = sorted({info["cnId"] for info in infos})
    pipe = client.pipeline(transaction=False)
    for info in infos:
        pipe.hmget(
            keys.response(info["cnId"], info["rsId"]),
            ["status", "notBefore", "sentAt", "claimedAt", "reqSeq", "msgId", "origin"],
        )
    for cid in conversations:
        pipe.zrange(keys.response_list(cid), 0, -1)
        pipe.lrange(keys.request_list(cid), 0, -1)
    raw = pipe.execute()
    # Responses whose hash is gone (their lifetime ran out) are no longer deliverable.
    live = {m: fields for m, fields in zip(members, raw[: len(members)], strict=True) if fields[0]}
    orders: dict[str, list[str]] = {}
    request_lists: dict[str, list[str]] = {}
    for i, cid in enumerate(conversations):
        orders[cid] = [as_text(m) for m in raw[len(members) + 2 * i]]
        request_lists[cid] = [as_text(k) for k in raw[len(members) + 2 * i + 1]]

    listed = sorted({k for ks in request_lists.values() for k in ks})
    seqs: dict[str, int | None] = {}
    if listed:
        pipe = client.pipeline(transaction=False)
        for key in listed:
            pipe.hget(key, "seq")
        seqs = {
            k: (None if v is None else _int(v)) for k, v in zip(listed, pipe.execute(), strict=True)
        }

    found: list[OpenConversation] = []
    for cid in conversations:
        undelivered = [m for m in orders[cid] if m in live]
        if not undelivered:
            continue
        head = undelivered[0]
        status, not_before, _sent_at, claimed_at, req_seq, msg_id, origin = (
            as_text(v) if v is not None else None for v in live[head]
        )
        # The gate skips request keys whose hash expired; the first one left is the head.
        head_request = next((k for k in request_lists[cid] if seqs.get(k) is not None), None)
        reason: BlockReason | None = None
        if (
            head_request is not None
            and head_request != keys.request(cid, json.loads(head)["rqId"])
            and (seqs[head_request] or 0) < _int(req_seq)
        ):
            reason = BlockReason.REQUEST
        elif status == "SENT":
            reason = BlockReason.ACK
        elif _int(not_before) > now:
            reason = BlockReason.AWAITED if status == "AWAITED" else BlockReason.RETRY
        in_flight = (
            reason is None
            and status == "PENDING"
            and bool(claimed_at)
            and _int(claimed_at) >= _int(not_before)
        )
        found.append(
            OpenConversation(
                conversation_id=cid,
                head_response_id=json.loads(head)["rsId"],
                head_msg_id=_int(msg_id) if msg_id else None,
                head_status=status or "",
                reason=reason,
                in_flight=in_flight,
                undelivered=len(undelivered),
                origin=origin or "",
            )
        )
    return _Conversations(found, live, int(scheduled) + int(waking), int(awaited_due))


def open_conversations(
    client: OrderingRedis, keys: BridgeKeys, now_ms: int | None = None
) -> list[OpenConversation]:
    """Every open conversation (see ConversationFigures), by conversation id."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    return _conversations(client, keys, now).open


def conversation_figures(
    client: OrderingRedis, keys: BridgeKeys, now_ms: int | None = None
) -> ConversationFigures:
    """The conversations' state by the gate's rules (see ConversationFigures)."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    seen = _conversations(client, keys, now)
    blocked = Counter(c.reason for c in seen.open if c.reason is not None)
    in_flight = sum(1 for c in seen.open if c.in_flight)
    heads = [c.head_msg_id for c in seen.open if c.reason is not None and c.head_msg_id]
    awaited = sum(1 for fields in seen.live.values() if as_text(fields[0]) == "AWAITED")
    return ConversationFigures(
        open=len(seen.open),
        responses_undelivered=len(seen.live),
        blocked={reason: blocked.get(reason, 0) for reason in BlockReason},
        ready=len(seen.open) - sum(blocked.values()) - in_flight,
        in_flight=in_flight,
        awaited=awaited,
        scheduled=seen.scheduled,
        awaited_due=seen.awaited_due,
        blocked_head_msg_ids=tuple(heads),
    )


# --- tracking, workers, broker ----------------------------------------------------------------


def workers_alive(client: redis.Redis, keys: TrackKeys) -> dict[str, int]:
    """Live workers (service keys not expired) per node code ('' when a worker gave none)."""
    counts = Counter(info.fields.get("node_code", "") for info in Services(client, keys).live())
    return dict(sorted(counts.items()))


def broker_figures(client: redis.Redis, queues: Sequence[str]) -> BrokerFigures:
    """Tasks waiting in each of ``queues`` (all priority lists) and the unacknowledged ones."""
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        for step in BROKER_PRIORITY_STEPS:
            pipe.llen(f"{queue}{BROKER_PRIORITY_SEP}{step}" if step else queue)
    pipe.hlen(BROKER_UNACKED_KEY)
    raw = pipe.execute()
    n = len(BROKER_PRIORITY_STEPS)
    depths = {q: sum(int(x) for x in raw[i * n : (i + 1) * n]) for i, q in enumerate(queues)}
    return BrokerFigures(depths, int(raw[-1]))


_FAILURES = (RedisError, SQLAlchemyError, OSError)


def _reason(exc: Exception) -> str:
    # SQLAlchemy's message carries the statement and a link; the first line says what failed.
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def gather(
    engine: Engine,
    bridge: OrderingRedis,
    bridge_keys: BridgeKeys,
    tracking: redis.Redis,
    track_keys: TrackKeys,
    broker: Callable[[], BrokerFigures | None] | None,
    *,
    now_ms: int | None = None,
) -> Figures:
    """Every figure; a source that fails leaves its part None and its error in ``errors``.

    ``broker`` reads the broker's figures (``Broker.figures``); None, or a reader that answers
    None: no broker figures.
    """
    errors: dict[Source, str] = {}
    conversations: ConversationFigures | None = None
    try:
        conversations = conversation_figures(bridge, bridge_keys, now_ms)
    except _FAILURES as exc:
        errors[Source.REDIS] = _reason(exc)
    store: StoreFigures | None = None
    totals: list[Total] | None = None
    try:
        heads = conversations.blocked_head_msg_ids if conversations else ()
        store = store_figures(engine, heads)
        if conversations is not None:
            conversations = replace(
                conversations, oldest_blocked_head_age_s=store.oldest_blocked_head_age_s
            )
        totals = Totals(engine).read()
    except _FAILURES as exc:
        errors[Source.POSTGRESQL] = _reason(exc)
    tracked: TrackingSnapshot | None = None
    alive: dict[str, int] | None = None
    try:
        tracked = snapshot(tracking, track_keys)
        alive = workers_alive(tracking, track_keys)
    except _FAILURES as exc:
        errors[Source.TRACKING] = _reason(exc)
    queued: BrokerFigures | None = None
    if broker is not None:
        try:
            queued = broker()
        except Exception as exc:  # any broker's client (redis-py, py-amqp): reported, not raised
            errors[Source.BROKER] = _reason(exc)
    return Figures(
        store=store,
        conversations=conversations,
        tracking=tracked,
        workers_alive=alive,
        broker=queued,
        errors=errors,
        gathered_at=time.time(),
        totals=totals,
    )


def verdict(figures: Figures) -> tuple[bool, list[str]]:
    """Healthy, or degraded and why: a source that could not be read, no live worker, a Redis
    that may evict orderly's keys."""
    why = [f"{source.value} could not be read" for source in figures.errors]
    if figures.workers_alive is not None and not sum(figures.workers_alive.values()):
        why.append("no live worker")
    if figures.redis_evicting:
        why.append(f"Redis may evict orderly's keys ({'; '.join(figures.redis_evicting)})")
    return not why, why
