"""The ``report_watermark`` table: how far each incremental report has read."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, String, func
from sqlalchemy.orm import Mapped, mapped_column

from orderly.models.base import Base


class ReportWatermark(Base):
    __tablename__ = "report_watermark"

    # The report's name: one watermark per independent series of incremental runs.
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    # Rows before this (on each table's time column) have been reported.
    read_until: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    run_id: Mapped[str] = mapped_column(String(64))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
