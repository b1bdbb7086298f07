"""Aborting the handler of a message cancelled while it runs: the abort in the time limits (a
handler that looks returns, one that does not is stopped after the grace, one that swallows
the stop is killed), the book of heard cancels (on a manual clock), the listener over the
real Redis stream (an announcement made while it was away is heard when it is back), and the
processor ending an aborted run with the cancel as the message's only outcome."""

from __future__ import annotations

import logging
import math
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from pydantic import ValidationError
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import Engine

import tests.abort_handlers  # noqa: F401  (the abort.* handlers, known to intake here)
from orderly.models.keys import PROCESS_ABORTS_KEY
from orderly.worker.configuration import ConfigReader
from orderly.worker.core.limits import Abort, Aborted, TimeLimitExceeded, TimeLimits, Watchdog
from orderly.worker.handlers import MessageContext, registry
from orderly.worker.messages import abort, batches, operations
from orderly.worker.messages.abort import AbortBook, AbortListener, AbortWatch
from orderly.worker.messages.batches import process_message
from orderly.worker.messages.intake import Intake
from orderly.worker.messages.processing import Outcome, Processor
from orderly.worker.runtime import get_runtime
from orderly.worker.settings import Settings
from tests.abort_handlers import EVENTS
from tests.conftest import TEST_REDIS_URL
from tests.helpers import ManualClock, message, row, wait_until

WAIT_S = 30.0  # generous: how long a wait lasts before the test fails
# What "within a second" allows of the time from the cancel to the handler's end.
WITHIN_S = 1.0


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


def _abort_when(started: threading.Event, target: Abort) -> list[float]:
    """Set ``target`` from another thread once ``started`` is set; when it did (monotonic)."""
    at: list[float] = []

    def run() -> None:
        if started.wait(WAIT_S):
            at.append(time.monotonic())
            target.set()

    threading.Thread(target=run, daemon=True).start()
    return at


def _assert_nothing_left(limits: TimeLimits) -> None:
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert not limits.watchdog.armed()


# --- the abort in the time limits -------------------------------------------------------------


def test_a_handler_that_looks_returns_and_its_run_ends_aborted(
    limits: TimeLimits, kills: Kills
) -> None:
    stop = Abort(WAIT_S)  # a grace it never needs: it returns by itself
    started = threading.Event()

    def handler() -> str:
        started.set()
        deadline = time.monotonic() + WAIT_S
        while not stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)
        return "its result"

    at = _abort_when(started, stop)
    with pytest.raises(Aborted) as raised:
        limits.run(60.0, "coop", handler, stop)
    assert time.monotonic() - at[0] < WITHIN_S
    assert raised.value.grace_s is None  # it ended by itself: its result is dropped
    assert str(raised.value) == "coop aborted"
    _assert_nothing_left(limits)
    assert kills.what == []


@pytest.mark.parametrize("limit_s", [None, 60.0])
def test_a_handler_that_never_looks_is_stopped_after_the_grace(
    limits: TimeLimits, limit_s: float | None
) -> None:
    """With a time limit and without: the SIGALRM handler is there for the abort either way."""
    stop = Abort(0.2)
    started = threading.Event()
    seen: list[str] = []

    def handler() -> None:
        started.set()
        try:
            time.sleep(WAIT_S)
        except Exception:  # a handler's catch-all does not swallow the stop
            seen.append("swallowed")
            raise
        except BaseException as exc:
            seen.append(type(exc).__name__)
            raise

    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 100.0)
    try:
        at = _abort_when(started, stop)
        with pytest.raises(Aborted) as raised:
            limits.run(limit_s, "sleeper", handler, stop)
        took = time.monotonic() - at[0]
        # The earlier handler and timer are back, less the time that passed.
        assert signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL
        assert 90.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 100.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert 0.2 <= took < WITHIN_S
    assert seen == ["Aborted"]
    assert raised.value.grace_s == 0.2
    assert "sleeper aborted; still running 0.2 s after it, stopped" in str(raised.value)
    assert not limits.watchdog.armed()


def test_a_run_aborted_before_it_began_does_not_begin(limits: TimeLimits) -> None:
    stop = Abort(0.2)
    stop.set()
    ran: list[bool] = []
    with pytest.raises(Aborted):
        limits.run(None, "late", lambda: ran.append(True), stop)
    assert ran == []
    _assert_nothing_left(limits)


def test_a_handler_that_swallows_the_stop_is_killed_after_the_kill_grace(
    limits: TimeLimits, kills: Kills
) -> None:
    stop = Abort(0.1)
    started = threading.Event()
    swallowed = threading.Event()

    def stubborn() -> str:
        started.set()
        try:
            time.sleep(WAIT_S)
        except Aborted:
            swallowed.set()
        kills.event.wait(WAIT_S)  # stuck on: only the kill ends this (here it lets it go)
        return "let go"

    at = _abort_when(started, stop)
    with pytest.raises(Aborted):
        limits.run(None, "stubborn", stubborn, stop)
    assert swallowed.is_set()
    assert kills.what == ["stubborn aborted"]
    assert time.monotonic() - at[0] >= 0.1 + 0.5  # not before the grace and the kill grace
    _assert_nothing_left(limits)


def test_a_time_limit_that_stops_an_aborted_run_still_ends_it_aborted(limits: TimeLimits) -> None:
    stop = Abort(WAIT_S)
    stop_at_start = threading.Event()
    _abort_when(stop_at_start, stop)

    def handler() -> None:
        stop_at_start.set()
        time.sleep(WAIT_S)

    with pytest.raises(Aborted) as raised:
        limits.run(0.2, "both", handler, stop)
    assert isinstance(raised.value.__cause__, TimeLimitExceeded)
    _assert_nothing_left(limits)


def test_an_abort_that_comes_after_the_run_changes_nothing(limits: TimeLimits) -> None:
    stop = Abort(0.0)
    assert limits.run(None, "quick", lambda: 42, stop) == 42
    assert stop.set()
    assert not stop.set()  # once
    _assert_nothing_left(limits)


def test_off_the_main_thread_the_abort_is_only_seen(limits: TimeLimits, kills: Kills) -> None:
    stop = Abort(0.0)
    started = threading.Event()
    ended: list[BaseException] = []

    def handler() -> None:
        started.set()
        deadline = time.monotonic() + WAIT_S
        while not stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)

    def run() -> None:
        try:
            limits.run(None, "threaded", handler, stop)
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    _abort_when(started, stop)
    thread.join(WAIT_S)
    assert [type(e) for e in ended] == [Aborted]
    assert kills.what == [] and not limits.watchdog.armed()


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf])
def test_an_abort_grace_is_zero_or_more_seconds(bad: float) -> None:
    with pytest.raises(ValueError, match="abort grace"):
        Abort(bad)
    with pytest.raises(ValueError, match="abort grace"):
        AbortWatch(lambda: redis.Redis(), lambda msg_id: True, bad)


def test_the_grace_setting_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir("/")  # no .env file
    monkeypatch.delenv("ORDERLY_ABORT_GRACE_MS", raising=False)
    assert Settings().abort_grace_ms == 300
    for bad in ("-1", "60001", "soon"):
        monkeypatch.setenv("ORDERLY_ABORT_GRACE_MS", bad)
        with pytest.raises(ValidationError, match="ORDERLY_ABORT_GRACE_MS"):
            Settings()
    monkeypatch.setenv("ORDERLY_ABORT_GRACE_MS", "0")
    assert Settings().abort_grace_ms == 0


def test_the_context_says_whether_its_message_was_cancelled() -> None:
    ctx = MessageContext(
        msg_id=1,
        service="s",
        operation="o",
        correlation_id="c",
        source_system="crm",
        msg_timestamp=None,  # type: ignore[arg-type]
        payload="{}",
        object_id=None,
        entity_type=None,
        process_id=None,
        funnel_value=None,
        failed_count=0,
        custom_data=None,
    )
    assert ctx.aborted is False  # not running: nothing to abort
    stop = Abort(0.0)
    ctx.abort_flag = stop.is_set
    assert ctx.aborted is False
    stop.set()
    assert ctx.aborted is True
    with pytest.raises(AttributeError):
        ctx.aborted = False  # read-only: refused


# --- the book of heard cancels ------------------------------------------------------------------


class Confirms:
    """``claim_gone`` as a test gives it: records what was asked, answers ``answer``."""

    def __init__(self, answer: bool = True) -> None:
        self.asked: list[int] = []
        self.answer = answer

    def __call__(self, msg_id: int) -> bool:
        self.asked.append(msg_id)
        return self.answer


def test_a_cancel_heard_while_the_message_runs_aborts_it() -> None:
    confirms = Confirms()
    book = AbortBook(confirms, 0.3, clock=ManualClock())
    with book.running(7) as stop:
        book.heard(8)  # another message's
        assert not stop.is_set() and confirms.asked == []
        book.heard(7)
        assert stop.is_set() and confirms.asked == [7]
        book.heard(7)  # heard twice: asked once
        assert confirms.asked == [7]
    book.heard(7)  # no longer running: nothing to ask
    assert confirms.asked == [7]
    assert stop.grace_s == 0.3


def test_a_cancel_heard_before_the_run_began_aborts_it_at_once() -> None:
    confirms = Confirms()
    book = AbortBook(confirms, 0.3, clock=ManualClock())
    book.heard(7)
    with book.running(7) as stop:
        assert stop.is_set()


def test_an_earlier_cancel_of_a_message_re_driven_since_aborts_nothing() -> None:
    confirms = Confirms(answer=False)  # the message is PROCESSING again: this run's own claim
    book = AbortBook(confirms, 0.3, clock=ManualClock())
    book.heard(7)
    with book.running(7) as stop:
        assert confirms.asked == [7]
        assert not stop.is_set()


def test_heard_cancels_are_forgotten_after_a_while_and_beyond_a_count() -> None:
    clock = ManualClock()
    confirms = Confirms()
    book = AbortBook(confirms, 0.3, clock=clock, remember_s=60.0, remember_max=3)
    book.heard(1)
    clock.advance(59.0)
    book.heard(2)
    assert book.remembered() == [1, 2]
    clock.advance(1.0)
    assert book.remembered() == [2]
    with book.running(1) as stop:
        assert not stop.is_set() and confirms.asked == []
    for msg_id in (3, 4, 5):
        book.heard(msg_id)
    assert book.remembered() == [3, 4, 5]
    book.heard(3)  # heard again: the newest now
    assert book.remembered() == [4, 5, 3]


def test_a_failed_check_aborts_nothing_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    def broken(msg_id: int) -> bool:
        raise OSError("database unreachable")

    book = AbortBook(broken, 0.3, clock=ManualClock())
    with book.running(7) as stop, caplog.at_level(logging.ERROR, "orderly.worker.messages.abort"):
        book.heard(7)
        assert not stop.is_set()
    assert "could not check whether message 7 was cancelled" in caplog.text


# --- the listener, over the real Redis stream ---------------------------------------------------


def _connect(names: list[str]) -> Callable[[], redis.Redis]:
    """Clients for a listener, named so that a test can kill their connections; without
    redis-py's own retries, so that a killed connection fails the read."""

    def connect() -> redis.Redis:
        name = f"aborts-test-{len(names)}"
        names.append(name)
        return redis.Redis.from_url(
            TEST_REDIS_URL, client_name=name, socket_timeout=5, retry=Retry(NoBackoff(), 0)
        )

    return connect


@pytest.fixture
def heard() -> queue.Queue[int]:
    return queue.Queue()


@pytest.fixture
def listener(redis_client: redis.Redis, heard: queue.Queue[int]) -> Iterator[AbortListener]:
    started = AbortListener(_connect([]), heard.put, block_ms=200)
    started.start()
    assert started.connected.wait(WAIT_S)
    yield started
    started.close()


def _heard(got: queue.Queue[int], count: int) -> list[int]:
    return [got.get(timeout=WAIT_S) for _ in range(count)]


def test_an_announced_cancel_is_heard_at_once(
    listener: AbortListener, redis_client: redis.Redis, heard: queue.Queue[int]
) -> None:
    started = time.monotonic()
    assert abort.announce(redis_client, [7, 8])
    assert _heard(heard, 2) == [7, 8]
    assert time.monotonic() - started < WITHIN_S
    assert 0 < redis_client.pttl(PROCESS_ABORTS_KEY) <= abort.KEEP_MS


def test_a_new_listener_hears_the_last_minute_only(
    redis_client: redis.Redis, heard: queue.Queue[int]
) -> None:
    now_ms = int(time.time() * 1000)
    redis_client.xadd(PROCESS_ABORTS_KEY, {"msg": "1"}, id=f"{now_ms - 120_000}-0")
    redis_client.xadd(PROCESS_ABORTS_KEY, {"msg": "2"}, id=f"{now_ms - 1_000}-0")
    redis_client.xadd(PROCESS_ABORTS_KEY, {"nothing": "here"}, id=f"{now_ms - 999}-0")
    started = AbortListener(_connect([]), heard.put, block_ms=200)
    started.start()
    try:
        assert _heard(heard, 1) == [2]
        assert abort.announce(redis_client, [3])
        assert _heard(heard, 1) == [3]  # the entry without a message was passed over
    finally:
        started.close()


def test_a_cancel_announced_while_the_listener_was_away_is_heard_when_it_is_back(
    redis_client: redis.Redis, heard: queue.Queue[int]
) -> None:
    names: list[str] = []
    connect = _connect(names)
    down = threading.Event()

    def flaky() -> redis.Redis:
        if down.is_set():
            raise redis.ConnectionError("Redis is away (the test says)")
        return connect()

    started = AbortListener(flaky, heard.put, block_ms=200)
    started.start()
    try:
        assert started.connected.wait(WAIT_S)
        assert abort.announce(redis_client, [1])
        assert _heard(heard, 1) == [1]
        down.set()
        clients = redis_client.client_list()
        assert [c for c in clients if c["name"] == names[-1]], f"no {names[-1]}: {clients}"

        def cut_off() -> bool:
            # A kill that lands between two reads finds the connection idle in its pool,
            # which redis-py opens again quietly (same name): kill until a read fails.
            for c in redis_client.client_list():
                if c["name"] == names[-1]:
                    redis_client.client_kill_filter(_id=c["id"])
            return not started.connected.is_set()

        wait_until(cut_off, WAIT_S, "the listener cut off")
        assert abort.announce(redis_client, [2, 3])  # while it is away
        down.clear()
        assert _heard(heard, 2) == [2, 3]
        assert started.connections >= 2
        assert heard.empty()  # nothing heard twice
    finally:
        started.close()


def test_a_cancel_is_not_announced_without_redis_and_the_caller_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gone = redis.Redis(port=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    with caplog.at_level(logging.WARNING, "orderly.worker.messages.abort"):
        assert not abort.announce(gone, [7])
    assert "the cancel of messages [7] was not announced" in caplog.text


# --- the processor ------------------------------------------------------------------------------


@pytest.fixture
def watch(db: Engine, redis_client: redis.Redis) -> Iterator[AbortWatch]:
    started = AbortWatch(
        _connect([]), lambda msg_id: abort.claim_gone(db, msg_id), 0.2, block_ms=200
    )
    started.started()[1].connected.wait(WAIT_S)
    yield started
    started.close()


def _processor(db: Engine, limits: TimeLimits, watch: AbortWatch) -> Processor:
    return Processor(
        db,
        node_id=get_runtime().node_id,
        registry=registry,
        config=ConfigReader(db, ttl_seconds=0),
        limits=limits,
        default_time_limit_s=None,  # abort.spinning runs unlimited
        aborts=watch,
    )


def _events(client: redis.Redis, key: str = EVENTS) -> list[tuple[str, float]]:
    raw: Any = client.lrange(key, 0, -1)
    return [(e.split(":")[0], float(e.split(":")[2])) for e in (x.decode() for x in raw)]


def _cancel_once_started(
    db: Engine, client: redis.Redis, msg_ids: list[int], key: str = EVENTS
) -> list[float]:
    """Cancel the messages (first to last) from another thread once a handler started; the
    time it did (time.time(), as the handlers record)."""
    at: list[float] = []

    def run() -> None:
        deadline = time.monotonic() + WAIT_S
        while not client.llen(key) and time.monotonic() < deadline:
            time.sleep(0.005)
        at.append(time.time())
        for msg_id in msg_ids:
            operations.cancel(
                db,
                msg_id,
                {"note": "withdrawn", "by": "ann"},
                lambda _: None,
                announce=lambda ids: abort.announce(client, ids),
            )

    threading.Thread(target=run, daemon=True).start()
    return at


def _assert_cancelled_once(db: Engine, msg_id: int) -> None:
    stored = row(db, msg_id)
    assert stored.state == "CANCEL"
    assert [(a["action"], a["by"]) for a in stored.audit] == [("CANCEL", "ann")]
    assert (stored.failed_count, stored.failed_error_code, stored.lost_count) == (0, None, 0)


@pytest.mark.parametrize(
    ("operation", "end"),
    [("cooperative", "noticed"), ("sleeping", "stopped"), ("spinning", "stopped")],
)
def test_a_cancelled_message_s_handler_stops_within_a_second_and_the_cancel_is_its_outcome(
    db: Engine,
    intake: Intake,
    redis_client: redis.Redis,
    limits: TimeLimits,
    watch: AbortWatch,
    caplog: pytest.LogCaptureFixture,
    operation: str,
    end: str,
) -> None:
    processor = _processor(db, limits, watch)
    msg_id = intake.submit(message(1, service="abort", operation=operation)).msg_id
    cancelled_at = _cancel_once_started(db, redis_client, [msg_id])
    with caplog.at_level(logging.INFO):
        result = process_message(processor, msg_id)
    assert result.outcome is Outcome.ABORTED
    events = _events(redis_client)
    assert [kind for kind, _ in events] == ["start", end]
    assert events[-1][1] - cancelled_at[0] < WITHIN_S
    _assert_cancelled_once(db, msg_id)
    assert f"message {msg_id} aborted by cancel" in caplog.text
    assert "taken over" not in caplog.text
    _assert_nothing_left(limits)

    # The process goes on with the next message as usual.
    redis_client.delete(EVENTS)
    following = intake.submit(message(2, service="abort", operation="quick")).msg_id
    assert process_message(processor, following).outcome is Outcome.OK
    assert [kind for kind, _ in _events(redis_client)] == ["done"]


def test_a_batch_message_cancelled_before_its_handler_began_never_begins(
    db: Engine,
    intake: Intake,
    redis_client: redis.Redis,
    limits: TimeLimits,
    watch: AbortWatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    processor = Processor(
        db,
        node_id=get_runtime().node_id,
        registry=registry,
        config=ConfigReader(db, ttl_seconds=0),
        limits=limits,
        default_time_limit_s=10.0,  # every handler limited: a claim takes a batch
        aborts=watch,
    )
    first = intake.submit(message(1, service="abort", operation="sleeping")).msg_id
    second = intake.submit(message(2, service="abort", operation="quick")).msg_id
    # The second first: it is claimed and waits behind the first when its cancel is heard.
    _cancel_once_started(db, redis_client, [second, first])
    with caplog.at_level(logging.INFO):
        results, due = batches.process_batch(processor, 10, lambda _: None)
    assert due == 2
    assert {r.msg_id: r.outcome for r in results} == {
        first: Outcome.ABORTED,
        second: Outcome.ABORTED,
    }
    assert [kind for kind, _ in _events(redis_client)] == ["start", "stopped"]  # no "done"
    _assert_cancelled_once(db, first)
    _assert_cancelled_once(db, second)
    assert "taken over" not in caplog.text


def test_a_message_re_driven_after_its_cancel_runs_to_its_end(
    db: Engine,
    intake: Intake,
    redis_client: redis.Redis,
    limits: TimeLimits,
    watch: AbortWatch,
) -> None:
    """The stream still holds the earlier cancel: the run of the re-driven message is not
    the cancelled one, and ends OK."""
    processor = _processor(db, limits, watch)
    msg_id = intake.submit(message(1, service="abort", operation="quick")).msg_id
    operations.cancel(
        db,
        msg_id,
        {"note": "by mistake"},
        lambda _: None,
        announce=lambda ids: abort.announce(redis_client, ids),
    )
    book = watch.started()[0]
    wait_until(lambda: msg_id in book.remembered(), WAIT_S, "the cancel heard")
    operations.redrive(db, msg_id, {"note": "after all"}, lambda _: None)
    assert process_message(processor, msg_id).outcome is Outcome.OK
    assert [kind for kind, _ in _events(redis_client)] == ["done"]
    assert [a["action"] for a in row(db, msg_id).audit] == ["CANCEL", "REDRIVE"]
