"""The one retry policy: T = deliveryDelay * multiplier ^ attempt, one rounding, one cap."""

from __future__ import annotations

import math

import pytest

from orderly.worker.core.errors import InvalidMessage
from orderly.worker.core.retry import MAX_DELAY_MS, RetryPolicy


def test_backoff_follows_the_formula() -> None:
    assert RetryPolicy(1000, 1.5, 3).delay(2) == 2250  # the public system's test vector
    assert [RetryPolicy(100, 2.0, 3).delay(n) for n in (1, 2, 3)] == [200, 400, 800]


def test_one_rounding_to_the_nearest_millisecond() -> None:
    policy = RetryPolicy(10, 1.55, 5)
    assert [policy.delay(n) for n in (1, 2, 3)] == [16, 24, 37]  # 15.5, 24.025, 37.23875
    assert RetryPolicy(1, 1.0, 1).delay(1) == 1


def test_waits_are_capped_and_never_overflow() -> None:
    policy = RetryPolicy(1_000, 10.0, 100, max_delay_ms=5_000)
    assert [policy.delay(n) for n in (1, 2, 50, 100)] == [5_000, 5_000, 5_000, 5_000]
    huge = RetryPolicy(86_400_000, 100.0, 100)
    assert huge.delay(100) == MAX_DELAY_MS  # 100 ** 100 overflows a float computation


def test_attempts_allow_exactly_that_many_retries() -> None:
    assert [RetryPolicy(1, 2.0, 2).allows(n) for n in (0, 1, 2, 3)] == [False, True, True, False]
    assert not RetryPolicy(1, 2.0, 0).allows(1)
    with pytest.raises(ValueError, match="start at 1"):
        RetryPolicy(1, 2.0, 2).delay(0)


@pytest.mark.parametrize(
    ("delay", "multiplier", "attempts", "field"),
    [
        (-1, 2.0, 3, "delay_ms"),
        (1.5, 2.0, 3, "delay_ms"),
        (True, 2.0, 3, "delay_ms"),
        (MAX_DELAY_MS + 1, 2.0, 3, "delay_ms"),
        (100, 0.5, 3, "multiplier"),
        (100, math.inf, 3, "multiplier"),
        (100, math.nan, 3, "multiplier"),
        (100, 101.0, 3, "multiplier"),
        (100, "2", 3, "multiplier"),
        (100, 2.0, -1, "attempts"),
        (100, 2.0, 101, "attempts"),
    ],
)
def test_bounds_are_validated_and_named(
    delay: object, multiplier: object, attempts: object, field: str
) -> None:
    with pytest.raises(InvalidMessage) as refused:
        RetryPolicy(delay, multiplier, attempts)  # type: ignore[arg-type]
    assert refused.value.field == field
