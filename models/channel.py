"""The ``channel`` table: where and how responses of one origin are delivered."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import CheckConstraint, DateTime, Float, Integer, String, func
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base


class Channel(Base):
    __tablename__ = "channel"
    __table_args__ = (
        CheckConstraint("delivery_delay_ms >= 1", name="delay"),
        CheckConstraint("multiplier >= 1", name="multiplier"),
        CheckConstraint("attempts >= 0", name="attempts"),
        CheckConstraint("timeout_ms >= 1", name="timeout"),
    )

    origin: Mapped[str] = mapped_column(String(100), primary_key=True)
    url: Mapped[str] = mapped_column(String(1000))
    delivery_delay_ms: Mapped[int] = mapped_column(Integer)
    multiplier: Mapped[float] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(Integer)
    timeout_ms: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )
