"""The one clock: every mechanism reads the time through a :class:`Clock` it is given.

Production code takes :data:`SYSTEM`; a test gives a clock it moves itself, so that a wait
(a backoff, an ACK deadline, a lease) passes without sleeping. Times the mechanisms hand to
Redis scripts are milliseconds since the epoch read here, never inside a script.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Seconds since the epoch (wall clock)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for intervals and caches)."""
        ...


class SystemClock:
    """The machine's clocks."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM: Clock = SystemClock()


def now_ms(clock: Clock = SYSTEM) -> int:
    """Milliseconds since the epoch."""
    return int(clock.time() * 1000)


def utcnow(clock: Clock = SYSTEM) -> datetime:
    """The clock's time as an aware UTC datetime."""
    return datetime.fromtimestamp(clock.time(), tz=UTC)
