"""Handler time limits: the soft limit raised inside the handler, the previous SIGALRM handler
and timer restored, the hard limit's watchdog, and the processor recording E_TIME_LIMIT with
a tracking deadline that covers the limit."""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

import pytest
import redis
from sqlalchemy import Engine

from orderly.models import MessageState
from orderly.models.keys import TrackKeys
from orderly.worker.configuration import ConfigReader
from orderly.worker.core.limits import TimeLimitExceeded, TimeLimits, Watchdog
from orderly.worker.handlers import HandlerRegistry, MessageContext, registry
from orderly.worker.messages.batches import process_message
from orderly.worker.messages.intake import Intake
from orderly.worker.messages.processing import (
    ERROR_TIME_LIMIT,
    LIMIT_TRACKING_MARGIN_MS,
    Outcome,
    Processor,
)
from orderly.worker.runtime import get_runtime
from orderly.worker.tracking import Tracker, TrackingPolicy
from tests.helpers import message, row, set_config

WAIT_S = 30.0  # generous: how long a function waits for the limit before the test fails


class Kills:
    """A watchdog's kill that records instead of killing the test process."""

    def __init__(self) -> None:
        self.what: list[str] = []
        self.event = threading.Event()

    def __call__(self, what: str) -> None:
        self.what.append(what)
        self.event.set()


@pytest.fixture
def kills() -> Kills:
    return Kills()


@pytest.fixture
def limits(kills: Kills) -> TimeLimits:
    return TimeLimits(0.5, Watchdog(kill=kills))


class _Previous:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.calls += 1


@pytest.fixture
def previous() -> Iterator[_Previous]:
    """A SIGALRM handler and a long timer set before the limited run."""
    handler = _Previous()
    before = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 100.0)
    yield handler
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, before)


def _until_stopped() -> str:
    """Runs until the limit stops it (fails the test after WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.01)
    return "never stopped"


def _assert_restored(previous: _Previous) -> None:
    assert signal.getsignal(signal.SIGALRM) is previous
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    assert 90.0 < left <= 100.0  # the earlier timer goes on, less the time that passed


def test_a_function_within_its_limit_is_unaffected(
    limits: TimeLimits, previous: _Previous, kills: Kills
) -> None:
    assert limits.run(5.0, "quick", lambda: 42) == 42
    _assert_restored(previous)
    assert previous.calls == 0
    assert not limits.watchdog.armed()
    assert kills.what == []


def test_past_its_soft_limit_a_function_gets_the_exception_inside_it(
    limits: TimeLimits, previous: _Previous
) -> None:
    seen: list[str] = []

    def handler() -> str:
        try:
            return _until_stopped()
        except Exception:  # a handler's catch-all does not swallow the limit
            seen.append("swallowed")
            raise
        except BaseException as exc:
            seen.append(type(exc).__name__)
            raise

    started = time.monotonic()
    with pytest.raises(TimeLimitExceeded) as raised:
        limits.run(0.2, "slow.one", handler)
    assert 0.2 <= time.monotonic() - started < WAIT_S
    assert seen == ["TimeLimitExceeded"]
    assert raised.value.limit_s == 0.2
    assert "slow.one ran past its time limit of 0.2 s" in str(raised.value)
    _assert_restored(previous)
    assert not limits.watchdog.armed()  # stopped in time: no hard kill pending


def test_an_earlier_timer_that_fell_due_meanwhile_fires_at_once_after(limits: TimeLimits) -> None:
    fired = threading.Event()
    before = signal.signal(signal.SIGALRM, lambda *_: fired.set())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(TimeLimitExceeded):
            limits.run(0.3, "slow", _until_stopped)
        deadline = time.monotonic() + WAIT_S
        while not fired.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fired.is_set()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def test_a_function_that_swallows_the_limit_is_killed_after_the_grace(
    limits: TimeLimits, kills: Kills
) -> None:
    swallowed = threading.Event()

    def stubborn() -> str:
        try:
            _until_stopped()
        except TimeLimitExceeded:
            swallowed.set()
        # stuck on: only the hard limit ends this (here the recording kill lets it go)
        kills.event.wait(WAIT_S)
        return "let go"

    started = time.monotonic()
    assert limits.run(0.2, "stubborn.one", stubborn) == "let go"
    assert swallowed.is_set()
    assert kills.what == ["stubborn.one"]
    assert time.monotonic() - started >= 0.2 + 0.5  # not before the limit and the grace
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL


def test_off_the_main_thread_nothing_is_armed(limits: TimeLimits, kills: Kills) -> None:
    results: list[object] = []

    def work() -> str:
        time.sleep(0.3)  # longer than its limit: not stopped here
        return "finished"

    thread = threading.Thread(target=lambda: results.append(limits.run(0.05, "threaded", work)))
    thread.start()
    thread.join(WAIT_S)
    assert results == ["finished"]
    assert kills.what == [] and not limits.watchdog.armed()


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf])
def test_a_limit_must_be_a_positive_number(limits: TimeLimits, bad: float) -> None:
    with pytest.raises(ValueError, match="positive number of seconds"):
        limits.run(bad, "x", lambda: None)
    with pytest.raises(ValueError, match="grace"):
        TimeLimits(bad)


@pytest.mark.parametrize("bad", [0, -2, math.nan, True, "5"])
def test_a_handler_declares_only_a_positive_time_limit(bad: object) -> None:
    reg = HandlerRegistry()
    with pytest.raises(ValueError, match=r"time limit of svc\.op must be a positive number"):
        reg.add("svc", "op", lambda ctx: None, time_limit_s=bad)  # type: ignore[arg-type]
    assert reg.get("svc", "op") is None  # nothing half-registered


def test_a_declared_limit_is_kept_and_none_means_the_default() -> None:
    reg = HandlerRegistry()

    @reg.register("svc", "slow", time_limit_s=90)
    def slow(ctx: MessageContext) -> None: ...

    reg.add("svc", "plain", lambda ctx: None)
    assert reg.time_limit_s("svc", "slow") == 90.0
    assert reg.time_limit_s("svc", "plain") is None


# --- the processor ----------------------------------------------------------------------------

KEYS = TrackKeys("test:limits")


def _processor(db: Engine, tracker: Tracker, limits: TimeLimits, default_s: float) -> Processor:
    return Processor(
        db,
        node_id=get_runtime().node_id,
        registry=registry,
        config=ConfigReader(db, ttl_seconds=0),
        tracker=tracker,
        limits=limits,
        default_time_limit_s=default_s,
    )


def _events(client: redis.Redis, key: str) -> list[str]:
    return [e.decode().split(":")[0] for e in client.lrange(key, 0, -1)]  # type: ignore[union-attr]


def test_a_handler_past_its_limit_is_stopped_and_recorded_e_time_limit(
    db: Engine, intake: Intake, redis_client: redis.Redis, limits: TimeLimits
) -> None:
    set_config(db, asynch__countPartlyFailsBeforeFailed="3")
    tracker = Tracker(redis_client, KEYS, TrackingPolicy(timeout_ms=1_000, expire_ms=5_000))
    key = "test:limits:events"
    payload = json.dumps({"sleep": WAIT_S, "key": key})
    msg_id = intake.submit(message(1, operation="limited", payload=payload)).msg_id
    result = process_message(_processor(db, tracker, limits, 0.3), msg_id)
    assert result.outcome is Outcome.PARTLY_FAILED
    stored = row(db, msg_id)
    assert stored.state is MessageState.PARTLY_FAILED
    assert stored.failed_error_code == ERROR_TIME_LIMIT
    assert "ran past its time limit of 0.3 s" in (stored.failed_desc or "")
    assert stored.processing_pid is None
    assert _events(redis_client, key) == ["start", "stopped"]
    assert not limits.watchdog.armed()
    # Tracked with a deadline covering the limit, the grace and the margin, not messageTimeout.
    (track_id,) = [int(x) for x in redis_client.lrange(KEYS.message_ids, 0, -1)]
    tracked = redis_client.hgetall(KEYS.message(track_id))
    deadline = int(tracked[b"deadline"]) - int(tracked[b"timestamp"])
    assert deadline == round((0.3 + 0.5) * 1000) + LIMIT_TRACKING_MARGIN_MS
    assert redis_client.pttl(KEYS.message(track_id)) > 5_000  # lives as much longer


def test_a_handler_within_its_limit_ends_ok(
    db: Engine, intake: Intake, redis_client: redis.Redis, limits: TimeLimits
) -> None:
    tracker = Tracker(redis_client, KEYS, TrackingPolicy(timeout_ms=10_000, expire_ms=60_000))
    key = "test:limits:events"
    msg_id = intake.submit(message(1, operation="limited", payload=json.dumps({"key": key})))
    result = process_message(_processor(db, tracker, limits, 5.0), msg_id.msg_id)
    assert result.outcome is Outcome.OK
    assert _events(redis_client, key) == ["start", "end"]
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
