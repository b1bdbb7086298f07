"""The ``source_system`` table: where orderly confirms a message's final state to its sender."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, Integer, String, func
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base

# The operation name of confirmation calls in ``external_call``.
CONFIRMATION_OPERATION = "orderly.confirmation"


class SourceSystem(Base):
    __tablename__ = "source_system"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    # NULL: the source system is not told (no confirmation is recorded).
    confirmation_url: Mapped[str | None] = mapped_column(String(500))
    timeout_ms: Mapped[int] = mapped_column(Integer, default=5000, server_default="5000")
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
