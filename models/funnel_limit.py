"""The ``funnel_limit`` table: how many messages of one funnel may run at once."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import CheckConstraint, DateTime, Double, Integer, String, text
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base


class FunnelLimit(Base):
    """Not in the seed: a funnel runs one message at a time (the seed's rule) unless its
    component has a row here. ``component_id`` is the messages' ``funnel_component_id`` (``""``
    for funnels without a component); ``max_in_flight`` messages of one funnel value may then
    run side by side, and with ``rate_per_s`` at most that many start a second (a token bucket
    of ``burst``, per funnel value). Guaranteed order always runs one at a time."""

    __tablename__ = "funnel_limit"
    __table_args__ = (
        CheckConstraint("max_in_flight BETWEEN 1 AND 10000", name="ck_funnel_limit_max_in_flight"),
        CheckConstraint(
            "rate_per_s IS NULL OR (rate_per_s > 0 AND rate_per_s <= 100000)",
            name="ck_funnel_limit_rate",
        ),
        CheckConstraint(
            "(rate_per_s IS NULL) = (burst IS NULL)"
            " AND (burst IS NULL OR burst BETWEEN 1 AND 10000)",
            name="ck_funnel_limit_burst",
        ),
    )

    component_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    max_in_flight: Mapped[int] = mapped_column(Integer)
    rate_per_s: Mapped[float | None] = mapped_column(Double)
    burst: Mapped[int | None] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=text("now()")
    )
