"""The ``schedule`` table: periodic schedules, each producing one message per due instant of its
cron expression (worker.schedules)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Index,
    SmallInteger,
    String,
    Text,
    func,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base


class Schedule(Base):
    __tablename__ = "schedule"
    __table_args__ = (
        # An enabled schedule always has its next due instant; a disabled one has none.
        CheckConstraint("enabled = (next_at IS NOT NULL)", name="next_at"),
        # What beat's producer takes: the due schedules, earliest first.
        Index("ix_schedule_next_at", "next_at", postgresql_where=text("next_at IS NOT NULL")),
        # A bound key lists the schedules of its source systems.
        Index("ix_schedule_source_system", "source_system"),
    )

    # The id users give and use (``schedule:<name>:<instant>`` is each message's correlation id).
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    # Five fields (minute hour day-of-month month day-of-week), read in ``time_zone``.
    cron: Mapped[str] = mapped_column(String(100))
    # An IANA time zone (Europe/Berlin, UTC): daylight saving time follows it.
    time_zone: Mapped[str] = mapped_column(String(64), default="UTC", server_default="UTC")
    # The message template. ``payload``: a JSON value whose strings may hold {{instant}} and
    # {{name}} (kept as written: JSON, not JSONB, so its keys keep their order).
    service: Mapped[str] = mapped_column(String(100))
    operation: Mapped[str] = mapped_column(String(100))
    source_system: Mapped[str] = mapped_column(String(100))
    payload: Mapped[Any] = mapped_column(JSON)
    object_id: Mapped[str | None] = mapped_column(String(100))
    entity_type: Mapped[str | None] = mapped_column(String(100))
    process_id: Mapped[str | None] = mapped_column(String(100))
    funnel_value: Mapped[str | None] = mapped_column(String(255))
    funnel_component_id: Mapped[str | None] = mapped_column(String(255))
    guaranteed_order: Mapped[bool] = mapped_column(Boolean, default=False, server_default="false")
    exclude_failed_state: Mapped[bool] = mapped_column(
        Boolean, default=False, server_default="false"
    )
    # NULL: the message gets the intake's default priority.
    priority: Mapped[int | None] = mapped_column(SmallInteger)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, server_default="true")
    # The next due instant (UTC); NULL while disabled.
    next_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The last instant a message was produced for, that message, and why the last production
    # was refused (NULL: it was not).
    last_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_msg_id: Mapped[int | None] = mapped_column(BigInteger)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
