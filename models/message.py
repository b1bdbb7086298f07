"""The ``message`` table: every asynchronous message orderly has accepted."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base, str_enum
from orderly.models.enums import BindingType, MessageState


class Message(Base):
    __tablename__ = "message"
    __table_args__ = (
        UniqueConstraint("correlation_id", "source_system"),
        # Pool and repair look for non-final messages idle since a time. Partial, so that the
        # move to a final state (most updates) adds no entry to it.
        Index(
            "ix_message_pending",
            "state",
            "last_process_timestamp",
            postgresql_where=text("state NOT IN ('OK', 'FAILED', 'CANCEL')"),
        ),
        # Funnels and guaranteed order look at the messages of a funnel that still count:
        # OK and CANCEL never block, so they leave the index.
        Index(
            "ix_message_funnel_open",
            "funnel_value",
            "msg_timestamp",
            "msg_id",
            postgresql_where=text("funnel_value IS NOT NULL AND state NOT IN ('OK', 'CANCEL')"),
        ),
        # One message at a time waits for a response under a correlation id.
        Index(
            "ix_message_wait_correlation",
            "wait_correlation_id",
            unique=True,
            postgresql_where=text(
                "wait_correlation_id IS NOT NULL AND state NOT IN ('OK', 'FAILED', 'CANCEL')"
            ),
        ),
        # The response timeout looks for waits whose deadline passed.
        Index(
            "ix_message_response_deadline",
            "response_deadline",
            postgresql_where=text("state = 'WAITING_FOR_RES' AND response_deadline IS NOT NULL"),
        ),
        # obsolete-call detection: the newest message for an object
        Index(
            "ix_message_object",
            "object_id",
            "entity_type",
            postgresql_where=text("object_id IS NOT NULL"),
        ),
        Index(
            "ix_message_parent", "parent_msg_id", postgresql_where=text("parent_msg_id IS NOT NULL")
        ),
        # An operator's search by the start of a correlation id (LIKE 'prefix%', whatever the
        # database's collation).
        Index(
            "ix_message_correlation_pattern",
            "correlation_id",
            postgresql_ops={"correlation_id": "text_pattern_ops"},
        ),
        # What a claim takes: messages due now, higher priority first, then by place in line.
        Index(
            "ix_message_ready",
            text("priority DESC"),
            "fair_at",
            "msg_id",
            postgresql_where=text(
                "state IN ('NEW', 'IN_QUEUE') AND due_at IS NULL AND service_name <> 'conversation'"
            ),
        ),
        # Messages waiting for a time (scheduled, retry waits): the ticker's next due time.
        Index(
            "ix_message_due",
            "due_at",
            postgresql_where=text(
                "due_at IS NOT NULL AND state IN ('NEW', 'IN_QUEUE', 'PARTLY_FAILED', 'POSTPONED')"
            ),
        ),
        # Late conversation responses, counted for GET /metrics and listed by operators.
        Index("ix_message_late", "msg_id", postgresql_where=text("late_ms IS NOT NULL")),
        # A conversation's requests and responses (its id is their process_id), for operators.
        Index(
            "ix_message_conversation",
            "process_id",
            "msg_timestamp",
            "msg_id",
            postgresql_where=text("service_name = 'conversation'"),
        ),
        # A conversation's open rows (a request waiting, a response not yet delivered): what a
        # request's insert asks for and the rebuild and the reconciliation sweep read.
        Index(
            "ix_message_conversation_open",
            "process_id",
            "receive_timestamp",
            postgresql_where=text(
                "service_name = 'conversation'"
                " AND state IN ('WAITING_FOR_RES', 'IN_QUEUE', 'PARTLY_FAILED')"
            ),
        ),
        # The other messages of a process (a listing's process_id filter, which asks both).
        Index(
            "ix_message_process",
            "process_id",
            "msg_timestamp",
            "msg_id",
            postgresql_where=text("process_id IS NOT NULL AND service_name <> 'conversation'"),
        ),
    )

    msg_id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    msg_timestamp: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    receive_timestamp: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    service_name: Mapped[str] = mapped_column(String(100))
    operation_name: Mapped[str] = mapped_column(String(100))
    object_id: Mapped[str | None] = mapped_column(String(100))
    entity_type: Mapped[str | None] = mapped_column(String(100))
    correlation_id: Mapped[str] = mapped_column(String(100))
    process_id: Mapped[str | None] = mapped_column(String(100))
    payload: Mapped[str] = mapped_column(Text)
    # The whole input as received (the seed's NOT NULL): the producer's envelope, or the
    # message's own JSON when it gave none.
    envelope: Mapped[str] = mapped_column(Text)
    source_system: Mapped[str] = mapped_column(String(100))
    state: Mapped[MessageState] = mapped_column(str_enum(MessageState, "message_state"))
    failed_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    failed_error_code: Mapped[str | None] = mapped_column(String(64))
    failed_desc: Mapped[str | None] = mapped_column(Text)
    last_process_timestamp: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    start_in_queue_timestamp: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    custom_data: Mapped[str | None] = mapped_column(Text)
    # W3C traceparent of the span that stored it: its handler's span continues that trace
    trace_parent: Mapped[str | None] = mapped_column(String(64))
    parent_msg_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("message.msg_id", ondelete="RESTRICT")
    )
    parent_binding_type: Mapped[BindingType | None] = mapped_column(
        str_enum(BindingType, "binding_type")
    )
    funnel_value: Mapped[str | None] = mapped_column(String(255))
    funnel_component_id: Mapped[str | None] = mapped_column(String(255))
    guaranteed_order: Mapped[bool] = mapped_column(Boolean, default=False, server_default="false")
    exclude_failed_state: Mapped[bool] = mapped_column(
        Boolean, default=False, server_default="false"
    )
    node_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("node.node_id"))
    # Not in the seed: the PostgreSQL backend pid of the worker connection that claimed the
    # message. A PROCESSING message whose backend is gone was orphaned by a dead worker.
    processing_pid: Mapped[int | None] = mapped_column(Integer)
    # Not in the seed: what operators did to the message and decisions they should see, as a
    # list of {"at", "action", "by", "note", ...} objects, oldest first.
    audit: Mapped[list[dict[str, Any]]] = mapped_column(
        JSONB, default=list, server_default=text("'[]'::jsonb")
    )
    # Not in the seed: the newer processed message that made this one obsolete (it was skipped).
    obsolete_by: Mapped[int | None] = mapped_column(BigInteger)
    # Not in the seed: the wait for an external response (WAITING_FOR_RES): the correlation id
    # the response will name, when the wait times out, and the response that ended it.
    wait_correlation_id: Mapped[str | None] = mapped_column(String(255))
    response_deadline: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    wait_res_id: Mapped[int | None] = mapped_column(BigInteger)
    # Not in the seed: how often the timeout monitor took this message back from a worker that
    # did not finish it within messageTimeout (worker.messages.timeouts).
    timeout_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Not in the seed: a conversation response handed to its client after its request had
    # expired (MESSAGE_TTL): by how many ms it came after the request's timestamp +
    # MESSAGE_TTL (>= 0). NULL when not late. Set when the delivery is recorded.
    late_ms: Mapped[int | None] = mapped_column(BigInteger)
    # Not in the seed: how often a worker died while it held this message's claim (SIGKILL, OOM,
    # a crash in native code). At ORDERLY_WORKER_LOST_LIMIT the message is quarantined: FAILED
    # with E_WORKER_LOST (worker.messages.watchdogs.release_orphans).
    lost_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Not in the seed: the claim that holds (or last held) this message took it alone. Only
    # then does its worker's death count in lost_count: a worker that dies holding a claim of
    # several cannot say which one it was running (worker.messages.watchdogs.release_orphans).
    lone_claim: Mapped[bool] = mapped_column(Boolean, default=False, server_default="false")
    # Not in the seed: its worker died holding it in a claim of several: it is claimed alone
    # from then on (worker.messages.batches.claim_due), where a death counts.
    isolate: Mapped[bool] = mapped_column(Boolean, default=False, server_default="false")
    # Not in the seed: a conversation response's ``last`` flag (its request's final response);
    # NULL for every other message. Redis's rebuild from the rows needs it (worker.rebuild).
    response_last: Mapped[bool | None] = mapped_column(Boolean)
    # Not in the seed: when a waiting message is due (NULL: it is due now, or it waits for
    # something that is not a time). A NEW message scheduled for later (``delay_ms``,
    # ``not_before``), a PARTLY_FAILED one until its retry (``delay * multiplier^attempt``), a
    # POSTPONED one until the pool looks at it again. The due-work ticker makes it claimable
    # when the time comes (worker.messages.due).
    due_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Not in the seed: claims take higher priority first, then the oldest; funnel and
    # guaranteed-order rules win over it.
    priority: Mapped[int] = mapped_column(SmallInteger, default=0, server_default="0")
    # Not in the seed: a waiting message's place in line among those of the same priority
    # (fair queueing by a virtual clock): the time it came, or for the k-th waiting message of
    # a funnel, one second after the one before it in that funnel. Many funnels then take
    # turns (A B C A B C ...) and a busy one cannot starve the rest; a message that comes back
    # (a retry, a release) keeps its place. Set by intake.
    fair_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
