"""The ``external_call`` table: calls to external systems, one row per (operation, entity)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base, str_enum
from orderly.models.enums import ExternalCallState


class ExternalCall(Base):
    __tablename__ = "external_call"
    __table_args__ = (
        UniqueConstraint("operation_name", "entity_id"),
        Index(
            "ix_external_call_due",
            "next_attempt_at",
            postgresql_where=text("next_attempt_at IS NOT NULL"),
        ),
    )

    call_id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    msg_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("message.msg_id"), index=True)
    operation_name: Mapped[str] = mapped_column(String(100))
    state: Mapped[ExternalCallState] = mapped_column(
        str_enum(ExternalCallState, "external_call_state"), index=True
    )
    entity_id: Mapped[str] = mapped_column(String(255))
    msg_timestamp: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    creation_timestamp: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_update_timestamp: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    failed_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Not in the seed: when the next attempt of a confirmation is due (NULL: none scheduled).
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Not in the seed: the fencing token of the confirmation try in flight (worker.core.lease).
    claim: Mapped[str | None] = mapped_column(String(32))
    # Not in the seed: the backend pid of the connection the worker trying it holds (gone:
    # the worker died), and the tries that died with their worker (FAILED_END at the limit).
    claim_pid: Mapped[int | None] = mapped_column(Integer)
    lost_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
