"""The pipelined submit (worker.messages.pipeline) against the real PostgreSQL: every message
handed over is stored and answered after its commit, handed-over messages share commits, a bad
message raises at once with nothing stored, a conflict is its own message's answer, a funnel's
messages go in groups (stored NEW), a child message waits for those before it, and close waits
for every one."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import Engine

from orderly.models import MessageState
from orderly.worker.core.errors import ConflictingMessage, InvalidMessage
from orderly.worker.messages.intake import Intake, SubmitResult
from orderly.worker.messages.pipeline import Pipeline
from tests.conftest import make_intake
from tests.helpers import count_messages, group_writes, message


def _grouped(db: Engine, queue: list[int]) -> Intake:
    return make_intake(db, queue, lambda: None, group_max=64)


def test_every_message_handed_over_is_stored_and_they_share_commits(
    db: Engine, queue: list[int]
) -> None:
    intake = _grouped(db, queue)
    gate = threading.Event()
    sizes = group_writes(intake, gate)
    with Pipeline(intake) as pipeline:
        futures = [pipeline.submit(message(i)) for i in range(150)]
        assert not any(f.done() for f in futures)  # nothing answered before its commit
        _queued(intake, sizes, 150)  # the rest behind the held first write
        gate.set()
    results = [f.result(0) for f in futures]
    assert all(isinstance(r, SubmitResult) and r.created for r in results)
    assert len({r.msg_id for r in results}) == 150
    assert count_messages(db) == 150
    # The first group held the writer while the rest queued: they went in shared writes.
    assert sum(sizes) == 150 and len(sizes) <= 1 + 3  # the held group, then by 64


def test_a_bad_message_raises_at_once_and_nothing_of_it_is_stored(
    db: Engine, queue: list[int]
) -> None:
    with Pipeline(_grouped(db, queue)) as pipeline:
        with pytest.raises(InvalidMessage) as refused:
            pipeline.submit(message(1, service="no-such-service"))
        assert refused.value.field == "service"
        with pytest.raises(InvalidMessage):
            pipeline.submit({"service": "test"})
    assert count_messages(db) == 0


def test_duplicates_and_conflicts_are_each_their_own_answer(db: Engine, queue: list[int]) -> None:
    with Pipeline(_grouped(db, queue)) as pipeline:
        first = pipeline.submit(message(1)).result(30)
        again = pipeline.submit(message(1))
        other = pipeline.submit(message(1, payload='{"other": true}'))
        fine = pipeline.submit(message(2))
    assert first.created and again.result(0).msg_id == first.msg_id
    assert not again.result(0).created
    with pytest.raises(ConflictingMessage):
        other.result(0)
    assert fine.result(0).created
    assert count_messages(db) == 2


def _queued(intake: Intake, sizes: list[int], n: int) -> None:
    """Wait (a condition, not a time) until ``n`` are in the held write or queued behind it."""
    assert intake._group is not None
    deadline = time.monotonic() + 30
    while sum(sizes) + len(intake._group._queue) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_child_message_waits_for_those_handed_over_before_it(
    db: Engine, queue: list[int]
) -> None:
    intake = _grouped(db, queue)
    parent = intake.submit(message(1)).msg_id
    gate = threading.Event()
    sizes = group_writes(intake, gate)
    returned = threading.Event()
    with Pipeline(intake) as pipeline:
        before = [pipeline.submit(message(i)) for i in range(2, 6)]
        _queued(intake, sizes, 4)
        early: list[bool] = []

        def open_gate() -> None:
            early.append(returned.is_set())  # the child's submit has not come back yet
            gate.set()

        threading.Timer(0.2, open_gate).start()
        child = pipeline.submit(message(9, parent_msg_id=parent))
        returned.set()
        # By the time the child is answered (its parent checked), every earlier one is.
        assert child.done() and all(f.done() for f in before)
    assert early == [False]
    got = child.result(0)
    assert got.created and got.state is MessageState.NEW
    assert got.msg_id > max(f.result(0).msg_id for f in before)  # stored after them
    assert count_messages(db) == 6


def test_a_funnels_messages_go_in_groups_stored_new(db: Engine, queue: list[int]) -> None:
    intake = _grouped(db, queue)
    gate = threading.Event()
    sizes = group_writes(intake, gate)
    with Pipeline(intake) as pipeline:
        futures = [
            pipeline.submit(message(i, funnel_value="crm:f1", guaranteed_order=True))
            for i in range(40)
        ]
        _queued(intake, sizes, 40)
        gate.set()
    results = [f.result(0) for f in futures]
    # NEW, as in a batch: the claim holds back all but the funnel's first.
    assert all(r.created and r.state is MessageState.NEW for r in results)
    assert sum(sizes) == 40 and len(sizes) <= 2


def test_a_closed_pipeline_takes_nothing_and_a_pipeline_needs_group_commit(
    db: Engine, queue: list[int]
) -> None:
    pipeline = Pipeline(_grouped(db, queue))
    pipeline.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipeline.submit(message(1))
    with pytest.raises(ValueError, match="group commit"):
        Pipeline(make_intake(db, queue))
    assert count_messages(db) == 0


def test_in_flight_messages_are_bounded(db: Engine, queue: list[int]) -> None:
    intake = _grouped(db, queue)
    gate = threading.Event()
    group_writes(intake, gate)
    handed: list[object] = []
    with Pipeline(intake, max_pending=3) as pipeline:

        def produce() -> None:
            for i in range(6):
                handed.append(pipeline.submit(message(i)))

        producer = threading.Thread(target=produce)
        producer.start()
        try:
            deadline = time.monotonic() + 30
            while len(handed) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            producer.join(0.3)  # a while longer: the fourth still waits for a slot
            assert producer.is_alive() and len(handed) == 3
        finally:
            gate.set()
        producer.join(30)
    assert len(handed) == 6 and count_messages(db) == 6


def test_a_future_cannot_be_cancelled_and_close_waits_for_it(db: Engine, queue: list[int]) -> None:
    intake = _grouped(db, queue)
    gate = threading.Event()
    group_writes(intake, gate)
    with Pipeline(intake) as pipeline:
        handed = pipeline.submit(message(1))
        assert not handed.cancel()
        threading.Timer(0.2, gate.set).start()
    assert handed.result(0).created and count_messages(db) == 1


def test_a_callback_may_not_wait_for_the_pipeline(db: Engine, queue: list[int]) -> None:
    intake = _grouped(db, queue)
    gate = threading.Event()
    group_writes(intake, gate)
    refused: list[BaseException] = []
    with Pipeline(intake) as pipeline:

        def callback(_: object) -> None:
            try:
                pipeline.wait()
            except RuntimeError as exc:
                refused.append(exc)

        pipeline.submit(message(1)).add_done_callback(callback)  # before it is answered
        gate.set()
    assert len(refused) == 1 and "callback" in str(refused[0])
    assert count_messages(db) == 1
