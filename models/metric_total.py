"""The ``metric_total`` table: the running totals of GET /metrics' counters and histograms
(worker/totals.py), summed over every process and kept across purges and restarts."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, Double, String, Text, func
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base


class MetricTotal(Base):
    __tablename__ = "metric_total"

    # a counter's name (…_total), or a histogram's …_bucket, …_sum or …_count
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    # the series' labels as JSON with sorted keys and no spaces ('{}': none)
    labels: Mapped[str] = mapped_column(Text, primary_key=True)
    value: Mapped[float] = mapped_column(Double, server_default="0")
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
