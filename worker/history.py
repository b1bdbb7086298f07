"""The message store over the last hour or day, in buckets: what arrived, what ended OK or
FAILED, and the backlog (messages not final) at the end of each bucket. The backlog is
counted back from now: the messages not final now, less what arrived after a bucket, plus
what ended after it. An approximation where rows moved since: a message purged meanwhile is
not counted (purges keep recent rows), and one that ended in the window and was re-driven
since counts as not ended then."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Engine

from orderly.worker.core.clock import SYSTEM, Clock, utcnow
from orderly.worker.db.queries import sql


class Window(enum.StrEnum):
    HOUR = "hour"
    DAY = "day"

    @property
    def span(self) -> timedelta:
        return timedelta(hours=1) if self is Window.HOUR else timedelta(days=1)

    @property
    def buckets(self) -> int:
        return 60 if self is Window.HOUR else 96  # a minute; a quarter of an hour


@dataclass(frozen=True)
class Bucket:
    start: datetime
    arrived: int
    ok: int
    failed: int
    backlog: int  # not final at the bucket's end


@dataclass(frozen=True)
class History:
    window: Window
    width: timedelta
    buckets: list[Bucket]


def message_history(engine: Engine, window: Window, clock: Clock = SYSTEM) -> History:
    """The last hour (60 buckets of a minute) or day (96 of a quarter hour), oldest first."""
    end = utcnow(clock)
    width = window.span / window.buckets
    t1 = end.timestamp()
    t0 = (end - window.span).timestamp()
    with engine.connect() as conn:
        rows = conn.execute(sql("message_history"), {"t0": t0, "t1": t1, "n": window.buckets})
        found = rows.all()
    backlog = int(found[0].open_now) if found else 0
    made: list[Bucket] = []
    for r in reversed(found):  # from now back
        start = end - window.span + width * int(r.i)
        made.append(Bucket(start, int(r.arrived), int(r.ok), int(r.failed), backlog))
        backlog = max(0, backlog - int(r.arrived) + int(r.final))
    made.reverse()
    return History(window, width, made)
