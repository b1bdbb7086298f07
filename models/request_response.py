"""The ``request`` and ``response`` tables: exchanges with external systems."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Identity,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base


class Request(Base):
    __tablename__ = "request"
    __table_args__ = (UniqueConstraint("uri", "res_join_id"),)

    req_id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    msg_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("message.msg_id"), index=True)
    res_join_id: Mapped[str | None] = mapped_column(String(255))
    uri: Mapped[str] = mapped_column(String(500))
    req_envelope: Mapped[str] = mapped_column(Text)
    req_timestamp: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Response(Base):
    __tablename__ = "response"
    __table_args__ = (
        # The seed: a failed response has its reason; one without an envelope, its reason.
        CheckConstraint("NOT failed OR failed_reason IS NOT NULL", name="failed_reason"),
        CheckConstraint(
            "res_envelope IS NOT NULL OR failed_reason IS NOT NULL",
            name="envelope_or_reason",
        ),
    )

    res_id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    req_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("request.req_id"), index=True)
    res_envelope: Mapped[str | None] = mapped_column(Text)
    failed_reason: Mapped[str | None] = mapped_column(Text)
    res_timestamp: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    failed: Mapped[bool] = mapped_column(Boolean, default=False, server_default="false")
    msg_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("message.msg_id"), index=True)
