"""What one report holds once computed: the rows of every aggregate and where they came from.

Plain data (no Spark): the renderer, the writers and the tests take it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class AggregateRows:
    name: str  # e.g. "latency"; also the file names of its outputs
    title: str  # a heading for people
    columns: tuple[str, ...]
    rows: list[dict[str, Any]]  # sorted by ``columns``; values are str, int, float or None
    # column -> "long", "double" or "string": the type of its outputs, known even when empty
    types: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Reads:
    """What one report read: the rows that came over JDBC per read, and how long the job that
    read them into memory took."""

    rows: dict[str, int]
    seconds: float


@dataclass(frozen=True)
class ReportData:
    run_id: str
    generated_at: datetime  # UTC
    since: datetime | None  # the window [since, until) on each table's time column
    until: datetime | None
    aggregates: list[AggregateRows]
    # a read held in memory (reports.tables.CACHED: a table, or PostgreSQL's partial aggregates
    # of one) -> rows that came over JDBC; a single-use read is read by its aggregates' job
    rows_read: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the Spark part
    read_s: float = 0.0  # of which reading those into memory
    master: str = "local[*]"

    def get(self, name: str) -> AggregateRows:
        for aggregate in self.aggregates:
            if aggregate.name == name:
                return aggregate
        raise KeyError(name)
