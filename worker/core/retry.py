"""The one retry policy: ``T = deliveryDelay * multiplier ^ attempt``, the design card's formula.

Retry number ``attempt`` (the first retry is attempt 1) waits ``delay(attempt)`` milliseconds:
the formula rounded to the nearest millisecond, at most ``max_delay_ms`` (as Artemis's
max-redelivery-delay). ``attempts`` retries are allowed; ``attempts = 0`` means none. Channels,
subscriptions, tracking retries and confirmations all compute their waits here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orderly.worker.core.errors import InvalidMessage

# The longest wait any policy may ask for (a year and a day), and the most retries.
MAX_DELAY_MS = 366 * 86_400_000
MAX_ATTEMPTS = 100
MAX_MULTIPLIER = 100.0


@dataclass(frozen=True)
class RetryPolicy:
    delay_ms: int
    multiplier: float
    attempts: int
    max_delay_ms: int = MAX_DELAY_MS

    def __post_init__(self) -> None:
        problems = policy_problems(self.delay_ms, self.multiplier, self.attempts, self.max_delay_ms)
        if problems:
            raise InvalidMessage(problems[0][0], problems[0][1], *problems[1:])

    def allows(self, attempt: int) -> bool:
        """Whether retry number ``attempt`` (1-based) may happen."""
        return 1 <= attempt <= self.attempts

    def delay(self, attempt: int) -> int:
        """Milliseconds before retry number ``attempt`` (1-based)."""
        if attempt < 1:
            raise ValueError(f"retry numbers start at 1, got {attempt}")
        try:
            wait = self.delay_ms * self.multiplier**attempt
        except OverflowError:
            return self.max_delay_ms
        if not math.isfinite(wait) or wait >= self.max_delay_ms:
            return self.max_delay_ms
        return math.floor(wait + 0.5)


def policy_problems(
    delay_ms: object, multiplier: object, attempts: object, max_delay_ms: object = MAX_DELAY_MS
) -> list[tuple[str, str]]:
    """Why these numbers make no policy (field, problem); empty when they do."""
    problems: list[tuple[str, str]] = []

    def whole(name: str, value: object, low: int, high: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append((name, f"must be a whole number, got {value!r}"))
        elif not low <= value <= high:
            problems.append((name, f"must be {low} to {high}, got {value}"))

    whole("delay_ms", delay_ms, 0, MAX_DELAY_MS)
    whole("attempts", attempts, 0, MAX_ATTEMPTS)
    whole("max_delay_ms", max_delay_ms, 0, MAX_DELAY_MS)
    if isinstance(multiplier, bool) or not isinstance(multiplier, int | float):
        problems.append(("multiplier", f"must be a number, got {multiplier!r}"))
    elif not math.isfinite(multiplier) or not 1.0 <= multiplier <= MAX_MULTIPLIER:
        problems.append(("multiplier", f"must be 1 to {MAX_MULTIPLIER:g}, got {multiplier}"))
    return problems


# What every delivery POST carries about its place in its retries (the backoff seed puts the
# attempt "in the message header"): the send's number (1: the first), and how long after
# its failure the next send comes (absent: no send follows a failure of this one).
ATTEMPT_HEADER = "X-Orderly-Attempt"
NEXT_DELAY_HEADER = "X-Orderly-Next-Delay-Ms"


def retry_headers(policy: RetryPolicy, attempt: int) -> dict[str, str]:
    """The headers of send number ``attempt`` under ``policy`` (its failure is retry number
    ``attempt``)."""
    headers = {ATTEMPT_HEADER: str(attempt)}
    if policy.allows(attempt):
        headers[NEXT_DELAY_HEADER] = str(policy.delay(attempt))
    return headers
