"""Plain messages in batches, against the real store and Redis: the wake-up intake sends, the
batch claim, OK outcomes written together, the time budget, the batch's tracking and its
take-back on timeout, and batch intake (all or nothing, idempotent)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, text

from orderly.models import MessageState, NodeState
from orderly.models.keys import PROCESS_WAKE_KEY, TrackKeys
from orderly.worker import nodes
from orderly.worker.configuration import ConfigReader
from orderly.worker.core.clock import now_ms
from orderly.worker.core.errors import InvalidMessage, NodeNotAccepting, ServiceUnavailable
from orderly.worker.core.limits import TimeLimits
from orderly.worker.core.scripts import as_text
from orderly.worker.handlers import HandlerRegistry, MessageContext, registry
from orderly.worker.messages import timeouts, watchdogs
from orderly.worker.messages.batches import BATCH_KIND, Pace, WokenRun, process_batch, run_woken
from orderly.worker.messages.inputs import MAX_BATCH
from orderly.worker.messages.intake import Intake
from orderly.worker.messages.processing import Outcome, Processor
from orderly.worker.messages.wake import STALE_MS, WAKE_TTL_MS, WOKEN, Holder, Wake
from orderly.worker.runtime import get_runtime
from orderly.worker.tracking import Tracker, TrackingPolicy, snapshot
from tests.conftest import make_intake
from tests.helpers import count_messages, message, row, states
from tests.stub_broker import StubBroker

KEYS = TrackKeys("test:batches")


def ignore(msg_id: int) -> None:
    """An enqueue that sends nothing (no message here is released or has children)."""


class Woken:
    """A Wake on the test's Redis whose task is a count."""

    def __init__(self, client: redis.Redis) -> None:
        self.wake = Wake(client, "test:wake")
        self.sent = 0

    def __call__(self) -> bool:
        return self.wake.wake(self._send)

    def _send(self) -> None:
        self.sent += 1


class Run:
    """``run_woken`` as a worker runs it, on the test's Redis, with a clock that moves only by
    the sleeps it asks for (each sleep may also run ``meanwhile``: a producer submitting)."""

    def __init__(self, client: redis.Redis) -> None:
        self.waker = Wake(client, "test:wake")
        self.owners = 0
        self.helpers = 0
        self.now = 0.0
        self.sleeps = 0
        self.waits = 0
        self.meanwhile: list[Any] = []

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        if self.meanwhile:
            self.meanwhile.pop(0)()

    def wait(self, holder: Holder, seconds: float) -> bool:
        """A wait for a poke, as Holder.wait (a producer submitting meanwhile pokes it), on
        this clock: a poke ends it a millisecond on, else it runs its whole time."""
        self.waits += 1
        if self.meanwhile:
            self.meanwhile.pop(0)()
        if holder.wait(0.001):
            self.now += 0.001
            return True
        self.now += seconds
        return False

    def _owner(self) -> None:
        self.owners += 1

    def _helper(self) -> None:
        self.helpers += 1

    def __call__(
        self, proc: Processor, limit: int, *, owner: bool = True, pace: Pace = Pace()
    ) -> WokenRun:
        return run_woken(
            proc, limit, ignore, waker=self.waker, owner=owner,
            send_owner=self._owner, send_helper=self._helper,
            pace=pace, clock=self, sleep=self.sleep, wait=self.wait,
        )  # fmt: skip


@pytest.fixture
def woken(redis_client: redis.Redis) -> Woken:
    return Woken(redis_client)


@pytest.fixture
def plain_intake(db: Engine, woken: Woken, queue: list[int]) -> Intake:
    """The ``intake`` fixture's, waking a worker as the product's does."""
    return make_intake(db, queue, wake=woken)


def batch_processor(
    db: Engine,
    redis_client: redis.Redis,
    reg: HandlerRegistry | None = None,
    *,
    time_limit_s: float | None = 5.0,
    timeout_ms: int = 10_000,
) -> Processor:
    """A processor as a worker has it: tracked, handlers under time limits."""
    return Processor(
        db,
        node_id=get_runtime().node_id,
        registry=registry if reg is None else reg,
        config=ConfigReader(db, ttl_seconds=0),
        tracker=Tracker(redis_client, KEYS, TrackingPolicy(timeout_ms, timeout_ms * 6)),
        limits=TimeLimits(1.0),
        default_time_limit_s=time_limit_s,
    )


def test_messages_wake_one_worker_not_one_task_each(
    db: Engine, plain_intake: Intake, woken: Woken, queue: list[int]
) -> None:
    first = [plain_intake.submit(message(n)).msg_id for n in range(1, 6)]
    assert woken.sent == 1 and woken.wake.value() == "woken"  # the others found it woken
    plain_intake.submit(message(9, funnel_value="f", guaranteed_order=True))
    assert queue == [] and woken.sent == 1  # no task of its own either
    # The woken worker begins: while it looks (between claims), submissions wake no one.
    holder = woken.wake.hold()
    plain_intake.submit(message(10))
    assert woken.sent == 1
    # While it is busy (claiming, running handlers), the next one wakes another worker, and
    # the one after that finds that worker woken.
    assert holder.busy()
    plain_intake.submit(message(12))
    plain_intake.submit(message(13))
    assert woken.sent == 2 and woken.wake.value() == "woken"
    assert not holder.looking() and not holder.held  # the mark is the new worker's now
    assert not holder.release() and woken.wake.value() == "woken"
    assert all(row(db, m).state is MessageState.NEW for m in first)
    # Let go of: the next submission wakes again; one held back by its funnel is POSTPONED
    # and wakes no one.
    assert woken.wake.hold().release()
    held = plain_intake.submit(message(11, funnel_value="f", guaranteed_order=True))
    assert held.state is MessageState.POSTPONED and woken.sent == 2
    plain_intake.submit(message(14))
    assert woken.sent == 3


def test_funnels_advance_side_by_side_each_in_its_order(
    db: Engine, plain_intake: Intake, redis_client: redis.Redis
) -> None:
    # Three funnels of four, in guaranteed order, and two plain messages; stored round-robin,
    # so each funnel's first is NEW and the rest POSTPONED behind it.
    ids: dict[str, list[int]] = {}
    for i in range(4):
        for f in "abc":
            body = message(10 * i + ord(f), funnel_value=f, guaranteed_order=True)
            body["msg_timestamp"] = f"2026-01-01T00:00:{i:02d}+00:00"
            ids.setdefault(f, []).append(plain_intake.submit(body).msg_id)
    plain = [plain_intake.submit(message(100 + n)).msg_id for n in range(2)]
    proc = batch_processor(db, redis_client)
    leftover: list[int] = []
    done, _ = process_batch(proc, 10, leftover.append)
    assert leftover == []
    assert states(db) == {m: "OK" for m in [*plain, *(i for f in ids.values() for i in f)]}
    ran = [r.msg_id for r in done]
    # Round by round: the heads and the plain ones, then each funnel's next, released by the
    # round's one outcome statement and claimed together.
    assert set(ran[:5]) == {*plain, ids["a"][0], ids["b"][0], ids["c"][0]}
    for n in range(1, 4):
        assert set(ran[5 + 3 * (n - 1) : 5 + 3 * n]) == {ids[f][n] for f in "abc"}
    for f in "abc":
        order = [ran.index(m) for m in ids[f]]
        assert order == sorted(order)


def test_a_batchs_funnel_messages_are_stored_new_and_go_in_their_order(
    db: Engine, plain_intake: Intake, redis_client: redis.Redis
) -> None:
    # Stored in one statement, without the funnel's lock: the claim orders them.
    items = [message(n, funnel_value="f", guaranteed_order=True) for n in (3, 1, 2)]
    assert {r.state for r in plain_intake.submit_many(items)} == {MessageState.NEW}
    seen: list[str] = []
    own = HandlerRegistry()
    own.add("test", "script", lambda ctx: seen.append(ctx.correlation_id))
    done, due = process_batch(batch_processor(db, redis_client, own), 10, ignore)
    assert seen == ["corr-1", "corr-2", "corr-3"] and due == 3
    assert {r.outcome for r in done} == {Outcome.OK}


def test_a_claim_takes_one_message_of_a_funnel_and_postpones_one_held_back(
    db: Engine, plain_intake: Intake, redis_client: redis.Redis
) -> None:
    # Out of order: the newer came first, so both are NEW; the older must go first.
    newer = message(2, funnel_value="f", guaranteed_order=True)
    older = message(1, funnel_value="f", guaranteed_order=True)
    newer_id = plain_intake.submit(newer).msg_id
    older_id = plain_intake.submit(older).msg_id
    assert {row(db, m).state for m in (newer_id, older_id)} == {MessageState.NEW}
    busy = HandlerRegistry()
    seen: list[int] = []
    busy.add("test", "script", lambda ctx: seen.append(ctx.msg_id))
    done, _ = process_batch(batch_processor(db, redis_client, busy), 10, ignore)
    assert seen == [older_id, newer_id]  # the older, then the newer its outcome released
    assert [r.outcome for r in done] == [Outcome.OK, Outcome.OK]


def test_a_claim_takes_a_batch_oldest_first_and_writes_its_outcomes_together(
    db: Engine, plain_intake: Intake, redis_client: redis.Redis
) -> None:
    ids = [plain_intake.submit(message(n)).msg_id for n in range(1, 6)]
    proc = batch_processor(db, redis_client)
    done, due = process_batch(proc, 3, ignore)
    assert [r.msg_id for r in done] == ids[:3] and due == 3
    assert {r.outcome for r in done} == {Outcome.OK}
    got = states(db)
    assert [got[m] for m in ids] == ["OK", "OK", "OK", "NEW", "NEW"]
    assert row(db, ids[0]).custom_data == "0;" and row(db, ids[0]).processing_pid is None
    rest, due = process_batch(proc, 3, ignore)
    assert [r.msg_id for r in rest] == ids[3:] and due == 2
    assert process_batch(proc, 3, ignore) == ([], 0)
    # One tracked unit per claim, done.
    snap = snapshot(redis_client, KEYS)
    assert snap.done_waiting == 2 and snap.listed == 2


def test_other_outcomes_are_written_as_they_come_beside_the_batch(
    db: Engine, plain_intake: Intake, redis_client: redis.Redis
) -> None:
    ok = plain_intake.submit(message(1)).msg_id
    failing = plain_intake.submit(message(2, payload=json.dumps({"fail_times": 1}))).msg_id
    crash = plain_intake.submit(message(3, operation="crash")).msg_id
    done, _ = process_batch(batch_processor(db, redis_client), 10, ignore)
    assert {r.msg_id: r.outcome for r in done} == {
        ok: Outcome.OK,
        failing: Outcome.PARTLY_FAILED,
        crash: Outcome.PARTLY_FAILED,
    }
    assert row(db, failing).failed_desc == "scripted failure 0"
    assert row(db, crash).failed_error_code == "E_HANDLER"
    assert row(db, ok).state is MessageState.OK


def test_past_its_budget_a_batch_starts_no_handler_and_gives_the_rest_back(
    db: Engine, plain_intake: Intake, redis_client: redis.Redis
) -> None:
    ids = [plain_intake.submit(message(n)).msg_id for n in range(1, 5)]
    done, due = process_batch(batch_processor(db, redis_client), 10, ignore, budget_s=0.0)
    assert [r.msg_id for r in done] == ids[:1] and due == 4
    rest = [row(db, m) for m in ids[1:]]
    assert {(r.state, r.processing_pid) for r in rest} == {(MessageState.NEW, None)}
    # Back where they were in the queue: claimed again first, in their order.
    again, _ = process_batch(batch_processor(db, redis_client), 10, ignore)
    assert [r.msg_id for r in again] == ids[1:]


def test_while_a_handler_may_run_unlimited_a_claim_takes_one(
    db: Engine, plain_intake: Intake, redis_client: redis.Redis
) -> None:
    for n in range(1, 4):
        plain_intake.submit(message(n))
    run = Run(redis_client)
    unlimited = batch_processor(db, redis_client, time_limit_s=None)
    done = run(unlimited, 10)
    assert len(done.results) == 3 and done.claims[:4] == [1, 1, 1, 0]  # one a claim: full
    assert run.helpers == 1  # one helper however often a claim came back full
    for n in range(4, 7):
        plain_intake.submit(message(n))
    own = HandlerRegistry()
    own.add("test", "script", lambda ctx: None, time_limit_s=2)
    declared = batch_processor(db, redis_client, own, time_limit_s=None)
    assert run(declared, 10).claims[0] == 3


def test_the_woken_worker_keeps_its_wake_up_while_messages_keep_coming(
    db: Engine, plain_intake: Intake, woken: Woken, redis_client: redis.Redis
) -> None:
    plain_intake.submit(message(1))
    plain_intake.submit(message(2))
    assert woken.sent == 1
    run = Run(redis_client)
    # While the worker waits for more, a producer submits: its wake-up finds the mark held.
    run.meanwhile = [lambda: plain_intake.submit(message(3)), lambda: None]
    done = run(batch_processor(db, redis_client), 10)
    assert len(done.results) == 3 and woken.sent == 1
    assert done.claims[:2] == [2, 1]  # the claim after the sleep found the third
    # Then it waited for pokes, not polls (the third's poke, already taken, cost one more
    # look), linger_s after the last message it found; it let go of the mark and looked once
    # more: the next submission wakes a worker again.
    assert set(done.claims[2:]) == {0} and len(done.claims) <= 5
    assert run.now >= Pace().linger_s and run.sleeps == 2 and 1 <= run.waits <= 2
    assert run.waker.value() is None
    plain_intake.submit(message(4))
    assert woken.sent == 2 and run.owners == 0 and run.helpers == 0


def test_a_message_that_comes_while_a_handler_runs_wakes_another_worker(
    db: Engine, plain_intake: Intake, woken: Woken, redis_client: redis.Redis
) -> None:
    plain_intake.submit(message(1))
    late: list[int] = []

    def slow(ctx: MessageContext) -> None:
        if not late:  # the first handler: meanwhile a producer submits
            late.append(plain_intake.submit(message(2)).msg_id)

    own = HandlerRegistry()
    own.add("test", "script", slow)
    run = Run(redis_client)
    done = run(batch_processor(db, redis_client, own), 10)
    assert woken.sent == 2  # the second woke a worker of its own: this one was busy
    # This worker no longer held the mark: it went on while it found messages (the late one,
    # here, no other worker running), then stopped without a last look or a linger.
    assert [r.msg_id for r in done.results] == [1, late[0]]
    assert done.claims == [1, 1, 0] and run.sleeps == 2
    assert woken.wake.value() == "woken"  # the new worker's


def test_after_its_active_time_the_woken_worker_hands_the_wake_up_over(
    db: Engine, plain_intake: Intake, woken: Woken, redis_client: redis.Redis
) -> None:
    for n in range(1, 4):
        plain_intake.submit(message(n))
    run = Run(redis_client)
    done = run(batch_processor(db, redis_client), 2, pace=Pace(active_s=0.0))
    assert len(done.results) == 2 and done.claims == [2]  # one batch, then the hand-over
    assert run.helpers == 1  # the claim was full
    assert run.owners == 1 and run.waker.value() == "woken"  # a new task holds it now


def test_a_worker_past_its_active_time_that_lost_the_mark_still_hands_over(
    db: Engine, plain_intake: Intake, woken: Woken, redis_client: redis.Redis
) -> None:
    first = plain_intake.submit(message(1)).msg_id
    plain_intake.submit(message(2))
    run = Run(redis_client)

    def taken_over(ctx: MessageContext) -> None:
        # meanwhile another worker took the wake-up, found nothing yet and let it go
        redis_client.delete("test:wake")

    own = HandlerRegistry()
    own.add("test", "script", taken_over, time_limit_s=5)
    done = run(batch_processor(db, redis_client, own), 1, pace=Pace(active_s=0.0))
    assert [r.msg_id for r in done.results] == [first]
    # the second is still due and nobody looks: a new task is sent for it
    assert run.owners == 1 and run.waker.value() == "woken"


def test_a_last_look_that_leaves_released_messages_behind_hands_the_wake_up_over(
    db: Engine, intake: Intake, redis_client: redis.Redis
) -> None:
    run = Run(redis_client)
    chain: list[int] = []

    def stored_unseen() -> None:
        # Stored while the worker waits, without a wake-up or a poke: only its last look
        # (after it let go of the mark) sees them.
        for n in (1, 2):
            body = message(n, funnel_value="f", guaranteed_order=True)
            chain.append(intake.submit(body).msg_id)

    run.meanwhile = [stored_unseen]
    done = run(batch_processor(db, redis_client), 10, pace=Pace(budget_s=0.0))
    # The last look ran the funnel's first; past its budget, the second it released waits
    # IN_QUEUE. Nobody looks any more: a new task is woken for it.
    assert [r.msg_id for r in done.results] == chain[:1]
    assert row(db, chain[1]).state is MessageState.IN_QUEUE
    assert run.owners == 1 and run.waker.value() == "woken"


def test_a_helper_stops_at_its_first_empty_claim_and_leaves_the_mark(
    db: Engine, plain_intake: Intake, woken: Woken, redis_client: redis.Redis
) -> None:
    plain_intake.submit(message(1))
    run = Run(redis_client)
    done = run(batch_processor(db, redis_client), 10, owner=False)
    assert done.claims == [1, 0] and run.sleeps == 1
    assert run.waker.value() == "woken"  # the owner's, untouched


def test_a_stopped_node_claims_nothing(
    db: Engine, plain_intake: Intake, redis_client: redis.Redis
) -> None:
    msg_id = plain_intake.submit(message(1)).msg_id
    nodes.set_state(db, get_runtime().settings.node_code, NodeState.STOPPED)
    assert process_batch(batch_processor(db, redis_client), 10, ignore) == ([], 0)
    assert row(db, msg_id).state is MessageState.NEW


def test_a_timed_out_batch_is_taken_back_message_by_message(
    db: Engine, plain_intake: Intake, redis_client: redis.Redis
) -> None:
    ids = [plain_intake.submit(message(n)).msg_id for n in range(1, 4)]
    proc_ref: list[Processor] = []
    turns: list[timeouts.TimeoutReport] = []

    def hang(ctx: MessageContext) -> None:
        # The monitor's turn long after the deadline, while this batch still runs.
        tracker = Tracker(redis_client, KEYS, TrackingPolicy(1000, 6000))
        turns.append(timeouts.monitor(db, tracker, ignore, now=now_ms() + 60_000))

    own = HandlerRegistry()
    own.add("test", "script", hang)
    proc_ref.append(batch_processor(db, redis_client, own, timeout_ms=1000))
    done, _ = process_batch(proc_ref[0], 10, ignore)
    [turn] = turns[:1]
    assert turn.timeouts == 1 and sorted(turn.retried) == ids
    # The batch's late outcomes are dropped: the messages were taken back.
    assert {r.outcome for r in done} == {Outcome.LOST_CLAIM}
    for msg_id in ids:
        stored = row(db, msg_id)
        assert (stored.state, stored.timeout_count) == (MessageState.IN_QUEUE, 1)
        assert stored.failed_error_code == "E_TIMEOUT"
    timed = snapshot(redis_client, KEYS).timeout
    assert timed.count == 1


def test_the_batch_tracking_names_its_claim(
    db: Engine, plain_intake: Intake, redis_client: redis.Redis
) -> None:
    plain_intake.submit(message(1))
    plain_intake.submit(message(2))
    seen: list[dict[str, Any]] = []

    def look(ctx: MessageContext) -> None:
        listed = [int(x) for x in redis_client.lrange(KEYS.message_ids, 0, -1)]
        seen.extend(
            {as_text(k): as_text(v) for k, v in redis_client.hgetall(KEYS.message(i)).items()}
            for i in listed
        )

    own = HandlerRegistry()
    own.add("test", "script", look)
    process_batch(batch_processor(db, redis_client, own, timeout_ms=2000), 10, ignore)
    first = seen[0]
    assert first["kind"] == BATCH_KIND
    pid, at = first["claim"].split(" ")
    assert first["xid"] == f"claim:{pid}:{at}"
    # The deadline covers the longest handler's limit and grace, the margin and the budget
    # (messageTimeout, 2 s here, is shorter).
    assert int(first["deadline"]) - int(first["timestamp"]) == 5_000 + 1_000 + 2_000 + 1_000


def _waited_two_seconds(db: Engine, msg_id: int) -> None:
    """As if the message had waited due for two seconds."""
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE message SET last_process_timestamp = now() - interval '2 seconds'"
                " WHERE msg_id = :i"
            ),
            {"i": msg_id},
        )


def test_a_message_waiting_new_is_seen_by_beats_wake_up(db: Engine, plain_intake: Intake) -> None:
    assert not watchdogs.due_waiting(db, 1.0)
    msg_id = plain_intake.submit(message(1)).msg_id
    assert not watchdogs.due_waiting(db, 1.0)
    _waited_two_seconds(db, msg_id)
    assert watchdogs.due_waiting(db, 1.0)


def test_beats_wake_up_goes_out_past_a_mark_that_has_not_moved(
    redis_client: redis.Redis,
) -> None:
    """A worker killed while it looked leaves its mark ("looking"), and a task lost with a
    worker leaves "woken": a submission's wake-up sends nothing past them, beat's passes one
    that has not moved for STALE_MS. A live holder's mark (it moves at every claim) and a
    task just sent are left alone, so a backlog gets no task a second."""
    wake = Wake(redis_client, "test:wake")
    sent: list[str] = []
    holder = wake.hold()  # looking, just now
    assert not wake.wake(lambda: sent.append("submission"))
    assert not wake.wake(lambda: sent.append("beat"), stale_ms=STALE_MS)
    assert holder.busy() and holder.looking()  # still its own

    for mark in (f"looking:{'dead'}", WOKEN):  # set STALE_MS + 1 s ago
        redis_client.set("test:wake", mark, px=WAKE_TTL_MS - STALE_MS - 1000)
        assert not wake.wake(lambda: sent.append("submission"))
        assert wake.wake(lambda: sent.append("beat"), stale_ms=STALE_MS)
        assert wake.value() == WOKEN
        assert int(redis_client.pttl("test:wake")) > WAKE_TTL_MS - 1000  # a fresh mark
    assert sent == ["beat", "beat"]
    assert not holder.busy() and not holder.held  # the holder's mark is another's now


def test_beat_wakes_a_worker_for_waiting_messages_past_a_dead_holders_mark(
    db: Engine, redis_client: redis.Redis, plain_intake: Intake
) -> None:
    """The agent's own wiring (the runtime's engine, wake-up mark and broker, a stub): a
    message that waited over a second behind a mark a killed worker left gets a task; behind
    a live holder's mark it gets none from beat (the holder claims it)."""
    from orderly.beat import agents

    runtime = get_runtime()
    broker = StubBroker()
    runtime.use_broker(broker)
    msg_id = plain_intake.submit(message(1)).msg_id
    _waited_two_seconds(db, msg_id)
    redis_client.set(PROCESS_WAKE_KEY, "looking:live", px=WAKE_TTL_MS)
    assert agents.wake_due() is False and broker.due == []
    redis_client.set(PROCESS_WAKE_KEY, "looking:killed", px=WAKE_TTL_MS - STALE_MS - 1000)
    assert agents.wake_due() is True and broker.due == [True]
    assert redis_client.get(PROCESS_WAKE_KEY) == WOKEN.encode()


def test_a_wake_up_that_cannot_be_sent_leaves_no_mark_and_postpones(
    db: Engine, redis_client: redis.Redis
) -> None:
    wake = Wake(redis_client, "test:wake")

    def refuse() -> None:
        raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    runtime = get_runtime()
    intake = Intake(
        db,
        node_id=runtime.node_id,
        enqueue=ignore,
        registry=runtime.registry,
        max_payload_bytes=1000,
        wake=lambda: wake.wake(refuse),
    )
    with pytest.raises(ServiceUnavailable) as info:
        intake.submit(message(1))
    assert "is stored and will be processed" in str(info.value)
    assert wake.value() is None
    assert list(states(db).values()) == ["POSTPONED"]


# --- batch intake --------------------------------------------------------------------------


def test_a_batch_is_stored_in_order_each_idempotent(
    db: Engine, plain_intake: Intake, woken: Woken, queue: list[int]
) -> None:
    items = [message(n) for n in range(1, 4)]
    items.append(message(7, funnel_value="f"))
    items.append(message(1))  # the first item again, in the same batch
    results = plain_intake.submit_many(items)
    assert [r.created for r in results] == [True, True, True, True, False]
    assert results[4].msg_id == results[0].msg_id
    assert results[0].msg_id < results[1].msg_id < results[2].msg_id
    assert woken.sent == 1 and queue == []  # one wake-up for the batch, funnel or not
    assert count_messages(db) == 4
    again = plain_intake.submit_many(items[:2])
    assert [(r.msg_id, r.created) for r in again] == [(r.msg_id, False) for r in results[:2]]
    assert count_messages(db) == 4


def test_one_bad_item_refuses_the_whole_batch_and_stores_nothing(
    db: Engine, plain_intake: Intake, woken: Woken, queue: list[int]
) -> None:
    items = [message(1), message(2, service="nosuch"), message(3, msg_timestamp="noon")]
    with pytest.raises(InvalidMessage) as info:
        plain_intake.submit_many(items)
    fields = [f for f, _ in info.value.problems]
    assert fields == ["messages[1].service", "messages[2].msg_timestamp"]
    assert count_messages(db) == 0 and woken.sent == 0 and queue == []


def test_a_batch_with_a_missing_parent_is_refused_whole(
    db: Engine, plain_intake: Intake, woken: Woken
) -> None:
    with pytest.raises(InvalidMessage) as info:
        plain_intake.submit_many([message(1), message(2, parent_msg_id=999)])
    assert info.value.field == "messages[1].parent_msg_id"
    assert count_messages(db) == 0 and woken.sent == 0


@pytest.mark.parametrize("items", [[], [message(n) for n in range(MAX_BATCH + 1)], {"a": 1}])
def test_a_batch_must_hold_1_to_max_messages(db: Engine, plain_intake: Intake, items: Any) -> None:
    with pytest.raises(InvalidMessage) as info:
        plain_intake.submit_many(items)
    assert info.value.field == "messages"
    assert count_messages(db) == 0


def test_a_node_that_accepts_no_input_refuses_a_batch(
    db: Engine, plain_intake: Intake, woken: Woken
) -> None:
    nodes.set_state(db, get_runtime().settings.node_code, NodeState.HANDLES_EXISTING_MESSAGES)
    with pytest.raises(NodeNotAccepting):
        plain_intake.submit_many([message(1), message(2)])
    assert count_messages(db) == 0 and woken.sent == 0


def test_a_looking_worker_is_poked_by_a_submission_not_polling(redis_client: redis.Redis) -> None:
    """The woken worker's wait between claims (Holder.wait, a BLPOP) ends when a submission
    finds it looking; while busy, a submission sends a task instead; at most one poke waits."""
    waker = Wake(redis_client, "test:wake")
    sent: list[int] = []
    holder = waker.hold()  # looking
    assert not holder.wait(0.05)  # nothing came: the wait ran out
    assert not waker.wake(lambda: sent.append(1)) and not waker.wake(lambda: sent.append(1))
    assert redis_client.llen("test:wake:pokes") == 1 and sent == []
    assert holder.wait(30) and not holder.wait(0.05)  # the poke, once

    got: list[tuple[bool, float]] = []

    def waiting() -> None:
        t0 = time.monotonic()
        got.append((holder.wait(30), time.monotonic() - t0))

    waiter = threading.Thread(target=waiting)
    waiter.start()
    time.sleep(0.1)  # the worker waits meanwhile: a submission then ends its wait
    assert not waker.wake(lambda: sent.append(1))
    waiter.join(30)
    assert got and got[0][0] and got[0][1] < 15  # poked, not timed out
    assert holder.busy() and waker.wake(lambda: sent.append(1))
    assert sent == [1] and redis_client.llen("test:wake:pokes") == 0
