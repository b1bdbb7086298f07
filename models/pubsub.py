"""Rooms and subscriptions: the tables of publish/subscribe delivery.

A room is an exchange, a subscription a binding: it selects events of a room by event type
and/or routing-key pattern and names a destination (a PUSH url, a PULL queue of its own, or a
registered handler). Every publish creates one ``delivery`` per matching active
subscription; every attempt of a delivery is a ``published_messages`` row; the broker seed's
queue log is ``queue_message``.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base, str_enum


class Status(enum.StrEnum):
    ACTIVE = "ACTIVE"
    PAUSED = "PAUSED"


class SubscriptionKind(enum.StrEnum):
    PUSH = "PUSH"  # POST to push_url
    PULL = "PULL"  # the subscriber fetches from its own queue and ACKs
    HANDLER = "HANDLER"  # a consumer registered in the workers, chosen by routing key


class DeliveryState(enum.StrEnum):
    PENDING = "PENDING"  # due at next_attempt_at (a $delay or a retry wait)
    IN_PROCESS = "IN_PROCESS"  # claimed by a worker (or pulled and not yet ACKed)
    DELIVERED = "DELIVERED"
    DEAD = "DEAD"  # attempts spent: dead-lettered with the reason, re-drivable
    EXPIRED = "EXPIRED"  # past the room's message expiration: never delivered late


class Outcome(enum.StrEnum):
    PENDING = "PENDING"
    DELIVERED = "DELIVERED"
    FAILED = "FAILED"
    DEAD = "DEAD"
    EXPIRED = "EXPIRED"


class QueueState(enum.StrEnum):
    PENDING = "Pending"
    IN_PROCESS = "In process"
    COMPLETED = "Completed"
    ERROR = "Error"


class Room(Base):
    __tablename__ = "room"
    __table_args__ = (
        CheckConstraint("message_expiration_ms IS NULL OR message_expiration_ms >= 0", name="exp"),
        CheckConstraint("delivery_delay_ms >= 1", name="delay"),
        CheckConstraint("delivery_delay_multiplier >= 1.01", name="multiplier"),
        CheckConstraint("delivery_attempts >= 0", name="attempts"),
    )

    room_id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    # null or 0: messages never expire
    message_expiration_ms: Mapped[int | None] = mapped_column(BigInteger)
    delivery_delay_ms: Mapped[int] = mapped_column(Integer)
    delivery_delay_multiplier: Mapped[float] = mapped_column(Float)
    delivery_attempts: Mapped[int] = mapped_column(Integer)
    status: Mapped[Status] = mapped_column(str_enum(Status, "room_status"), default=Status.ACTIVE)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class EventType(Base):
    __tablename__ = "event_type"
    __table_args__ = (UniqueConstraint("room_id", "name"),)

    event_type_id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    room_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("room.room_id"))
    name: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class EventTypeVersion(Base):
    __tablename__ = "event_type_version"

    event_type_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("event_type.event_type_id"), primary_key=True
    )
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    json_schema: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class Publisher(Base):
    __tablename__ = "publisher"
    __table_args__ = (UniqueConstraint("room_id", "name"),)

    publisher_id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    room_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("room.room_id"))
    name: Mapped[str] = mapped_column(String(100))


class Subscription(Base):
    __tablename__ = "subscription"
    __table_args__ = (
        UniqueConstraint("room_id", "name"),
        CheckConstraint(
            "(kind = 'PUSH') = (push_url IS NOT NULL)"
            " AND (kind = 'HANDLER') = (handler IS NOT NULL)",
            name="destination",
        ),
        CheckConstraint("delivery_delay_ms IS NULL OR delivery_delay_ms >= 1", name="delay"),
        CheckConstraint(
            "delivery_delay_multiplier IS NULL OR delivery_delay_multiplier >= 1.01",
            name="multiplier",
        ),
        CheckConstraint("delivery_attempts IS NULL OR delivery_attempts >= 0", name="attempts"),
        CheckConstraint(
            "(min_version IS NULL AND max_version IS NULL) OR (event_type_id IS NOT NULL"
            " AND COALESCE(min_version, 1) >= 1"
            " AND COALESCE(min_version, 1) <= COALESCE(max_version, 2147483647))",
            name="versions",
        ),
        CheckConstraint(
            "(rate_per_s IS NULL) = (burst IS NULL) AND (rate_per_s IS NULL OR"
            " (rate_per_s > 0 AND burst >= 1)) AND (max_in_flight IS NULL OR max_in_flight >= 1)",
            name="pace",
        ),
    )

    subscription_id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    room_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("room.room_id"))
    name: Mapped[str] = mapped_column(String(100))
    kind: Mapped[SubscriptionKind] = mapped_column(str_enum(SubscriptionKind, "subscription_kind"))
    push_url: Mapped[str | None] = mapped_column(String(1000))
    handler: Mapped[str | None] = mapped_column(String(200))
    # selection: an event type (any version, or the versions min_version..max_version,
    # either end open), a routing-key pattern (topic: * one word, # zero or more), or both;
    # neither selects every event of the room
    event_type_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("event_type.event_type_id")
    )
    min_version: Mapped[int | None] = mapped_column(Integer)
    max_version: Mapped[int | None] = mapped_column(Integer)
    routing_key_pattern: Mapped[str | None] = mapped_column(String(255))
    # overrides of the room's policy (never of its expiration)
    delivery_delay_ms: Mapped[int | None] = mapped_column(Integer)
    delivery_delay_multiplier: Mapped[float | None] = mapped_column(Float)
    delivery_attempts: Mapped[int | None] = mapped_column(Integer)
    timeout_ms: Mapped[int] = mapped_column(Integer, default=5000)
    visibility_timeout_ms: Mapped[int] = mapped_column(Integer, default=30000)
    # Ordered subscription: events with the same value at this payload path leave in order
    # (a retry waiting at the head holds its key).
    order_key: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[Status] = mapped_column(
        str_enum(Status, "subscription_status"), default=Status.ACTIVE
    )
    # A PUSH endpoint's pace: starts a second (a token bucket of ``burst``), sends at once.
    rate_per_s: Mapped[float | None] = mapped_column(Float)
    burst: Mapped[int | None] = mapped_column(Integer)
    max_in_flight: Mapped[int | None] = mapped_column(Integer)
    # Its health: failed sends in a row since ``failing_since``; ``probe_at`` set: its circuit
    # is open (one probe at that time); ``disabled_at`` set: failing too long, no sends until
    # an operator enables it.
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    failing_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    probe_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    disabled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    disabled_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class Event(Base):
    """One publish: what was sent to a room, by whom, when it may be delivered."""

    __tablename__ = "event"
    __table_args__ = (
        # a retried publish with the same key finds the event stored the first time
        Index(
            "ux_event_idempotency_key",
            "room_id",
            "idempotency_key",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
        # a replay's or a backfill's window of a room's events
        Index("ix_event_room_published", "room_id", "published_at", "event_id"),
    )

    event_id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    correlation_id: Mapped[str] = mapped_column(String(64), unique=True)
    room_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("room.room_id"))
    event_type_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("event_type.event_type_id")
    )
    version: Mapped[int | None] = mapped_column(Integer)
    routing_key: Mapped[str] = mapped_column(String(255))
    payload: Mapped[Any] = mapped_column(JSONB)
    publisher_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("publisher.publisher_id")
    )
    user_id: Mapped[str | None] = mapped_column(String(100))
    impersonator_id: Mapped[str | None] = mapped_column(String(100))
    # HMAC-signed: who produced it, for whom, until when (verified before a consumer runs)
    token: Mapped[str | None] = mapped_column(Text)
    published_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    deliver_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    unroutable: Mapped[bool] = mapped_column(Boolean, default=False)
    # the producer's Idempotency-Key, unique per room (None: none given)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    # SHA-256 of that publish's request: the same key with another body is refused
    idempotency_hash: Mapped[str | None] = mapped_column(String(64))
    # W3C traceparent of the span that published it: each delivery's send continues that trace
    trace_parent: Mapped[str | None] = mapped_column(String(64))


class Delivery(Base):
    """One event for one subscription: its state now, and when it is due."""

    __tablename__ = "delivery"
    __table_args__ = (
        UniqueConstraint("event_id", "subscription_id"),
        # The due-time index: what the scheduler moves to the queue when due (pull
        # deliveries wait for their subscriber instead).
        Index(
            "ix_delivery_due",
            "scheduled_at",
            postgresql_where=text("state = 'PENDING' AND NOT pull"),
        ),
        Index("ix_delivery_subscription_state", "subscription_id", "state"),
        # claims to release when their worker died
        Index("ix_delivery_claimed", "claimed_at", postgresql_where=text("state = 'IN_PROCESS'")),
        # what a pull subscriber can take
        Index(
            "ix_delivery_pull",
            "subscription_id",
            "delivery_id",
            postgresql_where=text("pull AND state = 'PENDING'"),
        ),
        # ordered subscriptions: the open deliveries of one key, in publish order
        Index(
            "ix_delivery_order",
            "subscription_id",
            "order_value",
            "event_id",
            postgresql_where=text("order_value IS NOT NULL AND state IN ('PENDING', 'IN_PROCESS')"),
        ),
    )

    delivery_id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    event_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("event.event_id"))
    subscription_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("subscription.subscription_id")
    )
    state: Mapped[DeliveryState] = mapped_column(str_enum(DeliveryState, "delivery_state"))
    pull: Mapped[bool] = mapped_column(Boolean, default=False)
    order_value: Mapped[str | None] = mapped_column(String(255))
    receipt: Mapped[str | None] = mapped_column(String(64))  # of the last pull
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    # due: not before this (a $delay, a retry wait)
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # when the scheduler looks at it: its due time, or, once handed to the broker, a lease
    # later (a task lost with its worker comes back then)
    scheduled_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    claimed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # the claim's token: only its holder may record the outcome
    claim: Mapped[str | None] = mapped_column(String(32))
    # the backend pid of the connection the claiming worker holds: gone, the worker died
    claim_pid: Mapped[int | None] = mapped_column(Integer)
    # claims that died with their worker (DEAD with E_WORKER_LOST at the limit)
    lost_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # the claim that holds (or last held) it took it alone: only then does its worker's death
    # count in lost_count; a worker that dies holding a batch of several cannot say which one
    # it was sending (deliveries_release_stuck)
    lone_claim: Mapped[bool] = mapped_column(Boolean, default=True, server_default="true")
    # its worker died holding it in a batch of several: claimed alone from then on
    # (deliveries_claim), where a death counts
    isolate: Mapped[bool] = mapped_column(Boolean, default=False, server_default="false")
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)


class PublishedMessage(Base):
    """Every publish and republish of an event to a subscription: one row per attempt, written
    PENDING when the attempt is scheduled (at the publish, a $delay included; at a retry or a
    re-drive) and updated with its outcome when the attempt ends."""

    __tablename__ = "published_messages"
    __table_args__ = (Index("ix_published_messages_delivery", "delivery_id"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    correlation_id: Mapped[str] = mapped_column(String(64))
    delivery_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("delivery.delivery_id"))
    event_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("event.event_id"))
    subscription_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("subscription.subscription_id")
    )
    attempt: Mapped[int] = mapped_column(Integer)
    # when this attempt was published (accepted, or republished after a failed one)
    published_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # when this attempt is due (a $delay, a retry's wait)
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    outcome: Mapped[Outcome] = mapped_column(str_enum(Outcome, "publish_outcome"))
    error: Mapped[str | None] = mapped_column(Text)
    # The seed's "next calculated delivery delay" of a failed attempt: the retry's wait (ms).
    next_delay_ms: Mapped[int | None] = mapped_column(Integer)


class LogException(Base):
    """What went wrong in one attempt of a delivery: the queue log's Error rows point here.

    ``traceback`` is the Python traceback when an exception was thrown (a consumer's, a
    sender's, a token refused); a failure nothing threw (an HTTP status, a pull not ACKed, an
    expiry, a worker lost) has its type and message only."""

    __tablename__ = "log_exception"
    __table_args__ = (Index("ix_log_exception_delivery_id", "delivery_id"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    type: Mapped[str] = mapped_column(String(200))
    message: Mapped[str] = mapped_column(Text)
    traceback: Mapped[str | None] = mapped_column(Text)
    # the message it belongs to: one event for one subscription (gone with it when purged)
    delivery_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("delivery.delivery_id", ondelete="CASCADE")
    )
    attempt: Mapped[int] = mapped_column(Integer)


class QueueMessage(Base):
    """The broker seed's queue message log: one row per state a delivery enters (Pending,
    In process, Completed, Error), for every consumer kind (PUSH, PULL, HANDLER)."""

    __tablename__ = "queue_message"
    __table_args__ = (Index("ix_queue_message_delivery_id", "delivery_id"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    delivery_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("delivery.delivery_id"))
    attempt: Mapped[int | None] = mapped_column(Integer)
    message: Mapped[str] = mapped_column(Text)
    routing_key: Mapped[str] = mapped_column(String(255))
    # Pending: when it is due (a $delay's or a retry's due time; None: at once)
    scheduled_start_time: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    start_time: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    end_time: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    state: Mapped[QueueState] = mapped_column(str_enum(QueueState, "queue_state"))
    exception_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("log_exception.id", ondelete="SET NULL")
    )
    # bytes the attempt itself allocated at its peak (tracemalloc), None where orderly did
    # not run it (a PULL subscriber's processing)
    memory_used: Mapped[int | None] = mapped_column(BigInteger)
