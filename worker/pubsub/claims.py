"""A claimed delivery, as a batch's claim returns it, and one try of it: what a push or a
consumer gets (Claimed), what it answers (Attempt), and what a failure's log_exception row
records (Failure). worker.pubsub.delivery sends and settles them."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from orderly.worker.core.retry import RetryPolicy


@dataclass(frozen=True)
class Claimed:
    delivery_id: int
    attempt: int
    event_id: int
    correlation_id: str
    routing_key: str
    payload: Any
    user: str | None
    impersonator: str | None
    deliver_at: datetime
    expires_at: datetime | None
    version: int | None
    subscription_id: int
    kind: str
    push_url: str | None
    handler: str | None
    timeout_ms: int
    delay_ms: int
    multiplier: float
    attempts: int  # sends at most (delivery_attempts; 0 and 1: no redelivery)
    room: str
    token: str | None
    order_value: str | None
    delayed: bool
    max_in_flight: int | None = None
    unhealthy: bool = False  # its endpoint had failed sends in a row when claimed
    rate_per_s: float | None = None  # its endpoint's pace (a token bucket of burst)
    burst: int | None = None
    probe: bool = False  # the one send its endpoint's open circuit lets through
    trace_parent: str | None = None  # the span that published its event (worker.core.tracing)

    @property
    def policy(self) -> RetryPolicy:
        """The retry policy: ``attempts`` sends are the first and ``attempts - 1`` retries."""
        return RetryPolicy(self.delay_ms, self.multiplier, max(self.attempts - 1, 0))


@dataclass(frozen=True)
class Attempt:
    ok: bool
    error: str = ""
    # what the failure's log_exception row is typed as (nothing was thrown: a status, a
    # connection refused)
    error_type: str = "PushFailed"
    # the receiver's Retry-After (429, 503): the next try's wait instead of the policy's
    retry_after_ms: int | None = None
    # the receiver asked that this delivery be tried no more (worker.core.http.STOP_HEADER)
    stop: bool = False


Push = Callable[[Claimed], Attempt]


@dataclass(frozen=True)
class Failure:
    """What a failed attempt's log_exception row records; ``traceback`` when it was thrown."""

    type: str
    message: str
    traceback: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        kind = type(exc)
        name = (
            kind.__qualname__
            if kind.__module__ == "builtins"
            else (f"{kind.__module__}.{kind.__qualname__}")
        )
        return cls(name, str(exc), "".join(traceback.format_exception(exc)))
