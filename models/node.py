"""The ``node`` table: the processes (API, workers, beat) that take part, and their state."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, DateTime, Identity, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base, str_enum
from orderly.models.enums import NodeState


class Node(Base):
    __tablename__ = "node"

    node_id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    code: Mapped[str] = mapped_column(String(100), unique=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    description: Mapped[str | None] = mapped_column(Text)
    state: Mapped[NodeState] = mapped_column(str_enum(NodeState, "node_state"))
    # Renewed by the node while it lives; not in the seed, used to tell who is alive.
    last_heartbeat: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The last change of state an operator made: when, who (the key), and the note given.
    state_changed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    state_changed_by: Mapped[str | None] = mapped_column(String(200))
    state_note: Mapped[str | None] = mapped_column(Text)
