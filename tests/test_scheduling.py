"""Scheduling in the message store, against the real PostgreSQL: messages due later
(``delay_ms``, ``not_before``), priorities, funnels taking turns, a funnel's limit of
messages in flight, a handler's retry policy (``delay * multiplier^attempt``, which errors
retry) and the one route back (every waiting message's due time, taken up by the due source)."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, text

from orderly.models import MessageState
from orderly.worker.configuration import ConfigReader
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.db.prepared import prepared_connection
from orderly.worker.handlers import HandlerRegistry, MessageContext, Retry
from orderly.worker.messages import operations, watchdogs
from orderly.worker.messages.batches import claim_due, process_batch, process_message
from orderly.worker.messages.intake import Intake
from orderly.worker.messages.processing import Outcome, Processor
from orderly.worker.messages.rates import StartRates
from orderly.worker.runtime import get_runtime
from tests.helpers import ManualClock, make_due, message, processor, row, set_config, take_due


def ignore(msg_id: int) -> None:
    """An enqueue that sends nothing."""


def due_in_ms(db: Engine, msg_id: int) -> float | None:
    with db.connect() as conn:
        found = conn.execute(
            text(
                "SELECT extract(epoch FROM due_at - receive_timestamp) * 1000 FROM message"
                " WHERE msg_id = :i"
            ),
            {"i": msg_id},
        ).scalar()
    return None if found is None else float(found)


class Recording:
    """A registry whose test.script handler records the order messages run in."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.registry = HandlerRegistry()
        self.registry.add("test", "script", self._run)

    def _run(self, ctx: MessageContext) -> None:
        self.ran.append(ctx.correlation_id)


def run_one_by_one(db: Engine, recording: Recording, limit: int = 100) -> None:
    """One slot: claims of one message, until none is due."""
    proc = processor(db, recording.registry)
    for _ in range(limit):
        _, due = process_batch(proc, 1, ignore)
        if not due:
            return
    raise AssertionError("messages still due after the limit")


def test_a_delayed_message_waits_for_its_time_then_is_claimable(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    now = intake.submit(message(1))
    later = intake.submit(message(2, delay_ms=60_000))
    at = intake.submit(message(3, not_before=(datetime.now(UTC) + timedelta(hours=1)).isoformat()))
    assert queue == [now.msg_id]  # nothing is handed to the broker before its time
    assert later.scheduled and at.scheduled and not now.scheduled
    assert due_in_ms(db, later.msg_id) == pytest.approx(60_000, abs=5)
    assert due_in_ms(db, at.msg_id) == pytest.approx(3_600_000, abs=2_000)
    recording = Recording()
    run_one_by_one(db, recording)
    assert recording.ran == ["corr-1"]  # the others are no claim's candidates yet
    assert take_due(db) == 0
    make_due(db, later.msg_id)
    assert take_due(db) == 1
    run_one_by_one(db, recording)
    assert recording.ran == ["corr-1", "corr-2"]
    assert row(db, at.msg_id).state is MessageState.NEW  # still waiting for its hour


def test_a_batch_schedules_each_message_on_its_own(db: Engine, intake: Intake) -> None:
    results = intake.submit_many(
        [message(1, delay_ms=5_000, priority=3), message(2), message(3, delay_ms=0)]
    )
    assert [r.scheduled for r in results] == [True, False, False]  # 0 ms: at once
    assert due_in_ms(db, results[0].msg_id) == pytest.approx(5_000, abs=5)
    assert row(db, results[0].msg_id).priority == 3


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"delay_ms": 1, "not_before": "2030-01-01T00:00:00Z"}, "not_before"),
        ({"delay_ms": -1}, "delay_ms"),
        ({"delay_ms": "soon"}, "delay_ms"),
        ({"not_before": "tomorrow"}, "not_before"),
        ({"priority": 101}, "priority"),
        ({"priority": 1.5}, "priority"),
    ],
)
def test_bad_scheduling_input_is_refused_naming_the_field(
    db: Engine, intake: Intake, fields: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidMessage) as refused:
        intake.submit(message(1, **fields))
    assert refused.value.field == named
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM message")).scalar() == 0


def test_higher_priority_is_claimed_first_then_the_oldest(db: Engine, intake: Intake) -> None:
    for n, priority in ((1, 0), (2, 5), (3, 0), (4, 5), (5, -2)):
        intake.submit(message(n, priority=priority))
    recording = Recording()
    run_one_by_one(db, recording)
    assert recording.ran == ["corr-2", "corr-4", "corr-1", "corr-3", "corr-5"]


def test_funnels_take_turns_when_one_slot_serves_them(db: Engine, intake: Intake) -> None:
    """Hatchet's GROUP_ROUND_ROBIN: A x5, B x5, C x5 queued one key after the other, one slot:
    A B C A B C ..., not A's backlog first."""
    n = 0
    for key in "ABC":
        for _ in range(5):
            n += 1
            intake.submit(message(n, funnel_value=key, correlation_id=f"{key}{n}"))
    recording = Recording()
    run_one_by_one(db, recording)
    assert "".join(c[0] for c in recording.ran) == "ABC" * 5


def test_funnels_take_turns_in_a_batch_too(db: Engine, intake: Intake) -> None:
    items = [
        message(n, funnel_value=key, correlation_id=f"{key}{n}")
        for n, key in enumerate("A" * 4 + "B" * 4, start=1)
    ]
    intake.submit_many(items)
    recording = Recording()
    run_one_by_one(db, recording)
    assert "".join(c[0] for c in recording.ran) == "AB" * 4


def _claim(db: Engine, size: int = 50, rates: StartRates | None = None) -> list[int]:
    """One worker's claim (committed; the claim stays with its connection's backend, which
    the test keeps open as a running worker would): the ids it took."""
    conn_cm = prepared_connection(db)
    conn = conn_cm.__enter__()
    _OPEN.append(conn_cm)
    rows, _ = claim_due(conn, get_runtime().node_id, size, 5, rates)
    return sorted(r.msg_id for r in rows if r.running)


_OPEN: list[Any] = []


@pytest.fixture
def workers() -> Any:
    yield
    while _OPEN:
        _OPEN.pop().__exit__(None, None, None)


def test_funnels_take_turns_across_batches_and_their_budget(db: Engine, intake: Intake) -> None:
    """Batches of many, cut short by their budget: every round still takes each funnel's
    next in turn (equal places in line are taken oldest msg_id first)."""
    items = [
        message(n, funnel_value=key, correlation_id=f"{key}{n}")
        for key in "ABC"
        for n in range(1, 41)
    ]
    intake.submit_many(items)  # one statement: the k-th of each funnel has the same place
    recording = Recording()
    proc = processor(db, recording.registry)
    for _ in range(200):
        _, due = process_batch(proc, 50, ignore, budget_s=0.02)
        if not due:
            break
    assert "".join(c[0] for c in recording.ran) == "ABC" * 40


def test_a_funnel_limit_lets_that_many_run_at_once(
    db: Engine, intake: Intake, workers: None
) -> None:
    with db.begin() as conn:
        conn.execute(text("INSERT INTO funnel_limit (component_id, max_in_flight) VALUES ('c', 2)"))
    ids = [
        intake.submit(message(n, funnel_value="f", funnel_component_id="c")).msg_id
        for n in range(1, 6)
    ]
    plain = [intake.submit(message(n, funnel_value="g")).msg_id for n in range(6, 9)]
    # each worker's claim takes one of a funnel; funnel f may have two running, g one
    assert _claim(db) == [ids[0], plain[0]]
    assert row(db, ids[1]).state is MessageState.NEW  # left due for another worker
    assert row(db, plain[1]).state is MessageState.POSTPONED  # waits for a release
    assert _claim(db) == [ids[1]]
    assert _claim(db) == []  # f's two slots are taken
    assert {row(db, i).state for i in ids[2:]} == {MessageState.POSTPONED}
    # one outcome frees one slot: the next of f is released
    with db.begin() as conn:
        conn.execute(text("UPDATE message SET state = 'OK' WHERE msg_id = :i"), {"i": ids[0]})
    assert row(db, ids[2]).state is MessageState.IN_QUEUE
    assert row(db, ids[3]).state is MessageState.POSTPONED
    assert _claim(db) == [ids[2]]


def test_a_funnel_limit_releases_as_many_as_it_frees(
    db: Engine, intake: Intake, workers: None
) -> None:
    with db.begin() as conn:
        conn.execute(text("INSERT INTO funnel_limit (component_id, max_in_flight) VALUES ('c', 3)"))
    ids = [
        intake.submit(message(n, funnel_value="f", funnel_component_id="c")).msg_id
        for n in range(1, 7)
    ]
    assert _claim(db, 1) == [ids[0]]
    with db.begin() as conn:  # the rest wait behind it (as a claim of a bigger batch leaves them)
        conn.execute(
            text("UPDATE message SET state = 'POSTPONED' WHERE msg_id = ANY(:i)"), {"i": ids[1:]}
        )
        conn.execute(text("UPDATE message SET state = 'OK' WHERE msg_id = :i"), {"i": ids[0]})
    # three slots free: three released, oldest first
    assert [row(db, i).state for i in ids[1:]] == [MessageState.IN_QUEUE] * 3 + [
        MessageState.POSTPONED
    ] * 2


def test_a_funnel_start_rate_defers_what_its_bucket_cannot_start(
    db: Engine, intake: Intake, redis_client: redis.Redis, workers: None
) -> None:
    with db.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO funnel_limit (component_id, max_in_flight, rate_per_s, burst)"
                " VALUES ('c', 10, 0.5, 2)"
            )
        )
    clock = ManualClock(1_000.0)
    rates = StartRates(redis_client, clock)
    ids = [
        intake.submit(message(n, funnel_value="f", funnel_component_id="c")).msg_id
        for n in range(1, 5)
    ]
    other = intake.submit(message(9, funnel_value="g")).msg_id  # no rate: never deferred
    assert _claim(db, rates=rates) == [ids[0], other]
    assert _claim(db, rates=rates) == [ids[1]]  # the burst of two
    assert _claim(db, rates=rates) == []  # spent: due again when its token is there
    waiting = row(db, ids[2])
    assert waiting.state is MessageState.NEW and waiting.due_at is not None
    assert waiting.last_process_timestamp is not None
    wait = (waiting.due_at - datetime.now(UTC)).total_seconds()
    assert 1.0 < wait <= 2.0  # 0.5 a second: the next token in 2 s
    clock.now += 2.0
    make_due(db, ids[2])
    assert take_due(db) == 1
    assert _claim(db, rates=rates) == [ids[2]]


def test_a_funnel_limit_is_refused_outside_its_bounds(db: Engine) -> None:
    from sqlalchemy.exc import IntegrityError

    with pytest.raises(IntegrityError), db.begin() as conn:
        conn.execute(text("INSERT INTO funnel_limit (component_id, max_in_flight) VALUES ('c', 0)"))


class Flaky(Exception):
    """Retried by the policy below."""


def test_a_handler_retry_policy_sets_the_waits_and_which_errors_retry(
    db: Engine, intake: Intake
) -> None:
    reg = HandlerRegistry()
    errors: list[BaseException] = [Flaky("try 1"), Flaky("try 2"), ValueError("bad input")]

    def failing(ctx: MessageContext) -> None:
        raise errors.pop(0)

    policy = Retry(delay_s=0.2, multiplier=3.0, attempts=5, max_delay_s=1.0, retry_on=(Flaky,))
    reg.add("test", "script", failing, retry=policy)
    msg_id = intake.submit(message(1)).msg_id
    proc = processor(db, reg)
    waits = []
    for _ in range(3):
        result = process_message(proc, msg_id)
        stored = row(db, msg_id)
        if stored.due_at is not None:
            assert stored.last_process_timestamp is not None
            waits.append(
                (stored.due_at - stored.last_process_timestamp) / timedelta(milliseconds=1)
            )
            make_due(db, msg_id)
            assert take_due(db) == 1
    # 200 ms * 3^1 = 600 ms, then 200 * 3^2 = 1800 ms capped at 1000 ms; a ValueError is not
    # retried: FAILED at once
    assert waits == [600.0, 1000.0]
    assert result.outcome is Outcome.FAILED
    assert row(db, msg_id).failed_count == 3


def test_the_default_retry_policy_comes_from_the_configuration_table(
    db: Engine, intake: Intake
) -> None:
    set_config(
        db,
        asynch__partlyFailedIntervalSec="2",
        asynch__partlyFailedMultiplier="1.5",
        asynch__partlyFailedMaxIntervalSec="4",
        asynch__countPartlyFailsBeforeFailed="3",
    )
    reg = HandlerRegistry()

    def failing(ctx: MessageContext) -> None:
        raise RuntimeError("down")

    reg.add("test", "script", failing, retry=Retry(multiplier=2.0))  # the rest from the table
    declared, policy = processor(db, reg).retry_policy("test", "script")
    assert (policy.delay_ms, policy.multiplier, policy.attempts, policy.max_delay_ms) == (
        2_000,
        2.0,
        3,
        4_000,
    )
    assert [policy.delay(n) for n in (1, 2, 3)] == [4_000, 4_000, 4_000]
    assert declared.retries(RuntimeError())


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"delay_s": -1}, "delay"),
        ({"multiplier": 0.5}, "multiplier"),
        ({"attempts": 1000}, "attempts"),
        ({"retry_on": ()}, "retry_on"),
        ({"retry_on": ("ValueError",)}, "retry_on"),
    ],
)
def test_a_bad_retry_policy_is_refused_at_registration(
    kwargs: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        Retry(**kwargs)


def test_a_message_postponed_by_a_busy_key_waits_on_its_row(db: Engine, intake: Intake) -> None:
    set_config(db, asynch__postponedIntervalSec="7")
    first = intake.submit(message(1, operation="extcall", payload=json.dumps({"key": "k"})))
    second = intake.submit(message(2, operation="extcall", payload=json.dumps({"key": "k"})))
    from orderly.worker.messages import extcall
    from orderly.worker.messages.extcall import CallKey
    from tests.helpers import BASE_TS

    with prepared_connection(db) as conn:
        extcall.take_call(conn, first.msg_id, BASE_TS, "test.op", CallKey.custom("k"))
    assert process_message(processor(db), second.msg_id).outcome is Outcome.POSTPONED
    stored = row(db, second.msg_id)
    assert stored.due_at is not None and stored.last_process_timestamp is not None
    assert (stored.due_at - stored.last_process_timestamp) == timedelta(seconds=7)


def test_a_message_held_back_behind_a_failed_one_still_fails_when_it_stood_too_long(
    db: Engine, intake: Intake
) -> None:
    """A POSTPONED message the due source looks at and finds still held back keeps its
    time, so that fail_postponed sees how long it stood."""
    set_config(db, asynch__postponedIntervalWhenFailedSec="1")
    fields = {"funnel_value": "g", "guaranteed_order": True}
    head = intake.submit(message(1, **fields)).msg_id
    waiting = intake.submit(message(2, **fields)).msg_id
    held = row(db, waiting)
    # guaranteed order: only its funnel's release (or fail_postponed) moves it
    assert held.state is MessageState.POSTPONED and held.due_at is None
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE message SET state = 'FAILED', due_at = NULL,"
                " last_process_timestamp = now() - interval '5 s' WHERE msg_id = :h;"
                "UPDATE message SET last_process_timestamp = now() - interval '5 s',"
                " due_at = now() - interval '1 ms' WHERE msg_id = :w"
            ),
            {"h": head, "w": waiting},
        )
    assert take_due(db) == 0  # still held back: no due time any more, its time kept
    still = row(db, waiting)
    assert still.state is MessageState.POSTPONED and still.due_at is None
    assert watchdogs.fail_postponed(db, ConfigReader(db, ttl_seconds=0), lambda: None) == 1
    failed = row(db, waiting)
    assert failed.state is MessageState.FAILED and failed.due_at is None


def test_a_funnel_place_in_line_ignores_its_failed_and_running_messages(
    db: Engine, intake: Intake
) -> None:
    first = intake.submit(message(1, funnel_value="f")).msg_id
    with db.begin() as conn:  # a FAILED message far ahead in line (an old backlog's)
        conn.execute(
            text(
                "UPDATE message SET state = 'FAILED', fair_at = now() + interval '3 hours'"
                " WHERE msg_id = :i"
            ),
            {"i": first},
        )
    later = intake.submit(message(2, funnel_value="f")).msg_id
    place = row(db, later).fair_at
    assert place is not None and place - datetime.now(UTC) < timedelta(seconds=5)


def test_redrive_and_cancel_clear_a_due_time(db: Engine, intake: Intake) -> None:
    scheduled = intake.submit(message(1, delay_ms=3_600_000)).msg_id
    cancelled = operations.cancel(db, scheduled, {"note": "not needed"}, ignore)
    assert cancelled.state is MessageState.CANCEL and row(db, scheduled).due_at is None
    operations.redrive(db, scheduled, {"note": "needed after all"}, ignore)
    again = row(db, scheduled)
    assert again.state is MessageState.IN_QUEUE and again.due_at is None  # due now
    assert [r.outcome for r in [process_message(processor(db), scheduled)]] == [Outcome.OK]


def test_a_single_message_takes_its_funnels_start_token_too(
    db: Engine, intake: Intake, redis_client: redis.Redis
) -> None:
    with db.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO funnel_limit (component_id, max_in_flight, rate_per_s, burst)"
                " VALUES ('c', 10, 0.5, 1)"
            )
        )
    ids = [
        intake.submit(message(n, funnel_value="f", funnel_component_id="c")).msg_id for n in (1, 2)
    ]
    proc = Processor(
        db,
        node_id=get_runtime().node_id,
        registry=get_runtime().registry,
        config=ConfigReader(db, ttl_seconds=0),
        rates=StartRates(redis_client, ManualClock(5_000.0)),
    )
    assert process_message(proc, ids[0]).outcome is Outcome.OK
    refused = process_message(proc, ids[1])
    assert refused.outcome is Outcome.POSTPONED and "start rate" in refused.detail
    waiting = row(db, ids[1])
    assert waiting.state is MessageState.NEW and waiting.due_at is not None
    assert waiting.processing_pid is None  # not left claimed


def test_a_plain_funnel_looks_at_a_held_back_message_again_after_its_interval(
    db: Engine, intake: Intake
) -> None:
    set_config(db, asynch__postponedIntervalSec="7")
    head = intake.submit(message(1, funnel_value="p")).msg_id
    assert process_message(processor(db), head).outcome is Outcome.OK
    with db.begin() as conn:  # the head runs (a long handler): the next one is held back
        conn.execute(text("UPDATE message SET state = 'PROCESSING' WHERE msg_id = :i"), {"i": head})
    held = intake.submit(message(2, funnel_value="p")).msg_id
    waiting = row(db, held)
    assert waiting.state is MessageState.POSTPONED and waiting.due_at is not None
    assert (waiting.due_at - waiting.receive_timestamp) == timedelta(seconds=7)


def test_an_outcome_releases_a_held_back_message_that_the_due_take_holds_meanwhile(
    db: Engine, intake: Intake
) -> None:
    """Beat's due take locks a POSTPONED message while its funnel is still busy (it pushes the
    due time on); an outcome of that funnel at that moment waits for the row and releases it,
    instead of skipping it and leaving the funnel with nothing to run."""
    head = intake.submit(message(1, funnel_value="p")).msg_id
    with db.begin() as conn:  # the head runs: the next one is held back
        conn.execute(text("UPDATE message SET state = 'PROCESSING' WHERE msg_id = :i"), {"i": head})
    held = intake.submit(message(2, funnel_value="p")).msg_id
    assert row(db, held).state is MessageState.POSTPONED
    outcome_pid: list[int] = []

    def finish_head() -> None:
        with db.begin() as conn:
            outcome_pid.append(int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one()))
            conn.execute(text("UPDATE message SET state = 'OK' WHERE msg_id = :i"), {"i": head})

    with db.connect() as taker:
        taker.execute(text("SELECT 1 FROM message WHERE msg_id = :i FOR UPDATE"), {"i": held})
        worker = threading.Thread(target=finish_head)
        worker.start()
        with db.connect() as watch:  # the outcome waits for the row, it does not skip it
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                waiting = (
                    outcome_pid
                    and watch.execute(
                        text(
                            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :p"
                        ),
                        {"p": outcome_pid[0]},
                    ).scalar()
                )
                if waiting:
                    break
                time.sleep(0.01)
            else:
                raise AssertionError("the outcome did not wait for the held row")
        taker.commit()
        worker.join(30)
    assert row(db, head).state is MessageState.OK
    assert row(db, held).state is MessageState.IN_QUEUE


def test_a_release_does_not_wait_for_a_childs_insert_or_the_purge(
    db: Engine, intake: Intake
) -> None:
    """A transaction that inserts a child of a held-back message holds its foreign key's
    share lock on that row (the purge's lock of an open family member is KEY SHARE too): the
    release, which changes no key, goes on at once."""
    head = intake.submit(message(1, funnel_value="p")).msg_id
    with db.begin() as conn:
        conn.execute(text("UPDATE message SET state = 'PROCESSING' WHERE msg_id = :i"), {"i": head})
    held = intake.submit(message(2, funnel_value="p")).msg_id
    assert row(db, held).state is MessageState.POSTPONED
    with db.connect() as other:
        other.execute(text("SELECT 1 FROM message WHERE msg_id = :i FOR KEY SHARE"), {"i": held})
        with db.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '5s'"))
            conn.execute(text("UPDATE message SET state = 'OK' WHERE msg_id = :i"), {"i": head})
        assert row(db, held).state is MessageState.IN_QUEUE
        other.rollback()
