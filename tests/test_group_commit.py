"""Group commit (worker.core.group_commit) and the API's submits through it: calls that come
together are written at once, each told its own outcome only after the write; a lone call is
written at once; one item's refusal is its own; a call cancelled while queued is not written;
against the real PostgreSQL, concurrent submits all stored, duplicates and conflicts told
apart, a broker that is down told to every message it did not get."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Sequence

import pytest
from sqlalchemy import Engine

from orderly.worker.core.errors import ConflictingMessage, ServiceUnavailable
from orderly.worker.core.group_commit import Alone, GroupCommit
from orderly.worker.messages.intake import Intake, SubmitResult
from orderly.worker.runtime import get_runtime
from tests.conftest import make_intake
from tests.helpers import group_writes, message


class Writer:
    """A write that takes a while and records each group it got."""

    def __init__(self, seconds: float = 0.02) -> None:
        self.groups: list[list[int]] = []
        self.seconds = seconds
        self.lock = threading.Lock()

    def __call__(self, items: Sequence[int]) -> list[int | BaseException]:
        with self.lock:
            self.groups.append(list(items))
        time.sleep(self.seconds)
        return [ValueError(f"odd {i}") if i % 7 == 3 else i * 10 for i in items]


def test_a_lone_call_is_written_at_once_on_its_own() -> None:
    writer = Writer(0)
    group = GroupCommit(writer, max_batch=50)
    assert asyncio.run(group.run(2)) == 20
    assert asyncio.run(group.run(4)) == 40
    assert writer.groups == [[2], [4]]


def test_calls_that_come_together_share_writes_and_each_gets_its_own_outcome() -> None:
    writer = Writer(0.02)
    group = GroupCommit(writer, max_batch=16)

    async def call(i: int) -> int | str | Alone:
        try:
            return await group.run(i)
        except ValueError as exc:
            return str(exc)

    async def calls() -> list[int | str | Alone]:
        return list(await asyncio.gather(*(call(i) for i in range(200))))

    got = asyncio.run(calls())
    assert got == [f"odd {i}" if i % 7 == 3 else i * 10 for i in range(200)]
    written = sorted(i for g in writer.groups for i in g)
    assert written == list(range(200))  # each once
    assert max(len(g) for g in writer.groups) <= 16
    assert len(writer.groups) < 100  # shared: far fewer writes than calls


def test_a_write_that_fails_fails_its_whole_group_and_the_next_goes_on() -> None:
    calls: list[Sequence[int]] = []

    def write(items: Sequence[int]) -> list[int | BaseException]:
        calls.append(items)
        if 13 in items:
            raise ConnectionError("PostgreSQL went away")
        return list(items)

    group = GroupCommit(write, max_batch=8)
    with pytest.raises(ConnectionError):
        asyncio.run(group.run(13))
    assert asyncio.run(group.run(5)) == 5


def test_a_call_cancelled_while_queued_is_not_written() -> None:
    writer = Writer(0.2)
    group = GroupCommit(writer, max_batch=8)

    async def scenario() -> int | Alone:
        first = asyncio.create_task(group.run(1))
        while not writer.groups:  # the first group is being written
            await asyncio.sleep(0.001)
        queued = asyncio.create_task(group.run(2))
        await asyncio.sleep(0)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        return await first

    assert asyncio.run(scenario()) == 10
    assert writer.groups == [[1]]  # 2 never written


def _intake(db: Engine, queue: list[int], wake: Callable[[], object] | None = None) -> Intake:
    return make_intake(db, queue, wake or (lambda: None), group_max=64)


def test_concurrent_submits_are_all_stored_and_duplicates_and_conflicts_told_apart(
    db: Engine, queue: list[int]
) -> None:
    intake = _intake(db, queue)
    bodies = [message(i) for i in range(120)]
    bodies += [message(5), message(6)]  # the same messages again: 200, the same msg_id
    bodies += [message(7, payload='{"other": true}')]  # another one under 7's ids: 409

    async def submit(body: dict[str, object]) -> SubmitResult | ConflictingMessage:
        try:
            return await intake.submit_together(body)
        except ConflictingMessage as exc:
            return exc

    async def submits() -> list[SubmitResult | ConflictingMessage]:
        return list(await asyncio.gather(*(submit(b) for b in bodies)))

    results = asyncio.run(submits())
    # one of the two messages under 7's ids was stored, the other refused
    sevens = [results[7], results[122]]
    assert sum(isinstance(r, ConflictingMessage) for r in sevens) == 1
    stored = [r for r in results if isinstance(r, SubmitResult)]
    assert len({r.msg_id for r in stored}) == 120
    for again, first in ((results[120], results[5]), (results[121], results[6])):
        assert isinstance(again, SubmitResult) and isinstance(first, SubmitResult)
        assert again.msg_id == first.msg_id  # the same message: the same answer
        assert [again.created, first.created].count(True) == 1
    from tests.helpers import count_messages

    assert count_messages(db) == 120


def _together(intake: Intake, bodies: list[dict[str, object]]) -> list[object]:
    """Submitted at once on one event loop (the API's), each its outcome (a result or what it
    raised)."""

    async def submits() -> list[object]:
        return list(
            await asyncio.gather(
                *(intake.submit_together(b) for b in bodies), return_exceptions=True
            )
        )

    return asyncio.run(submits())


def test_submits_that_come_together_are_written_together(db: Engine, queue: list[int]) -> None:
    intake = _intake(db, queue)
    sizes = group_writes(intake)
    for round_ in range(5):
        got = _together(intake, [message(100 * round_ + i) for i in range(16)])
        assert all(isinstance(r, SubmitResult) and r.created for r in got)
    assert sum(sizes) == 80 and max(sizes) > 1  # shared, not one write each


def test_a_broker_that_is_down_is_told_to_each_message_it_did_not_get(
    db: Engine, queue: list[int]
) -> None:
    def down() -> object:
        raise ConnectionError("broker away")

    intake = _intake(db, queue, wake=down)
    sizes = group_writes(intake)
    later = message(99, delay_ms=60_000)  # scheduled: nobody is woken for it now
    got = _together(intake, [message(i) for i in range(8)] + [later])
    assert max(sizes) > 1
    refused = [r for r in got[:8] if isinstance(r, ServiceUnavailable)]
    assert len(refused) == 8
    named = [re.findall(r"messages? \[?([\d, ]+)\]? (?:is|are) stored", str(r)) for r in refused]
    assert all(len(n) == 1 and n[0].isdigit() for n in named)  # its own message, no other
    assert len({n[0] for n in named}) == 8
    assert isinstance(got[8], SubmitResult) and got[8].created and got[8].scheduled
    again = intake.submit(message(1))  # stored: the same message again is told so
    assert not again.created


def test_a_node_that_refuses_input_refuses_each_of_a_group(db: Engine, queue: list[int]) -> None:
    from orderly.models import NodeState
    from orderly.worker import nodes
    from orderly.worker.core.errors import NodeNotAccepting

    intake = _intake(db, queue)
    nodes.set_state(db, get_runtime().settings.node_code, NodeState.HANDLES_EXISTING_MESSAGES)
    got = _together(intake, [message(i) for i in range(6)])
    assert all(isinstance(r, NodeNotAccepting) for r in got)
    from tests.helpers import count_messages

    assert count_messages(db) == 0


def test_each_row_of_one_insert_keeps_its_own_trace_parent(db: Engine) -> None:
    from sqlalchemy import text

    from orderly.worker.db.prepared import prepared_connection
    from orderly.worker.messages import store
    from orderly.worker.messages.admission import new_message
    from orderly.worker.messages.inputs import MessageIn

    parents = ["00-" + "a" * 32 + "-" + "b" * 16 + "-01", None]
    rows = [new_message(MessageIn.model_validate(message(i))) for i in range(2)]
    with prepared_connection(db) as conn:
        store.insert(
            conn, rows, get_runtime().node_id, require_run=False, hold=False, traces=parents
        )
    with db.connect() as conn:
        found = conn.execute(text("SELECT trace_parent FROM message ORDER BY msg_id")).scalars()
        assert list(found) == parents


def test_a_group_stored_before_its_lookups_failed_tells_the_stored_theirs(
    db: Engine, queue: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group's one INSERT commits on its own: when looking up a duplicate fails after it,
    the messages it stored are answered 201 and only the duplicate's caller goes on alone."""
    import psycopg2  # type: ignore[import-untyped]

    from orderly.worker.messages import store
    from orderly.worker.messages.inputs import MessageIn
    from tests.helpers import count_messages

    intake = _intake(db, queue)
    first = intake.submit(message(1))
    sizes = group_writes(intake)

    def lost(*args: object) -> None:
        raise psycopg2.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(store, "find", lost)
    alone: list[str] = []
    store_alone = intake._store

    def recorded(m: MessageIn, owns: object, traces: object = None) -> SubmitResult:
        alone.append(m.correlation_id)
        return store_alone(m, None)

    monkeypatch.setattr(intake, "_store", recorded)
    got = _together(intake, [message(1), message(2), message(3)])
    assert sizes == [3]  # one group
    assert alone == [str(message(1)["correlation_id"])]  # the others are not stored again
    assert isinstance(got[0], psycopg2.OperationalError)  # alone, its lookup failed again
    new = [r for r in got[1:] if isinstance(r, SubmitResult)]
    assert len(new) == 2 and all(r.created for r in new)
    assert first.msg_id not in {r.msg_id for r in new}
    assert count_messages(db) == 3


def test_the_same_ids_twice_in_one_group_are_told_apart(db: Engine, queue: list[int]) -> None:
    """A group whose INSERT stores one row for ids submitted twice: the first submit is told
    it was stored (201), the same message again is told so (200), another message under the
    ids is refused (409), as if each came after."""
    intake = _intake(db, queue)
    sizes = group_writes(intake)
    other = message(1, payload='{"other": true}')
    got = _together(intake, [message(1), message(2), message(1), other])
    assert sizes == [4]  # one group
    first, second, again, conflict = got
    assert isinstance(first, SubmitResult) and first.created
    assert isinstance(second, SubmitResult) and second.created
    assert isinstance(again, SubmitResult) and not again.created
    assert again.msg_id == first.msg_id
    assert isinstance(conflict, ConflictingMessage)
    from tests.helpers import count_messages

    assert count_messages(db) == 2


def test_a_group_of_one_keeps_its_own_trace_parent(
    db: Engine, queue: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer stores a lone submit under that submit's trace parent, not the one of the
    request that started the writer."""
    import contextvars

    from sqlalchemy import text

    from orderly.worker.core import tracing

    parent: contextvars.ContextVar[str | None] = contextvars.ContextVar("parent", default=None)
    monkeypatch.setattr(tracing, "current_parent", parent.get)
    intake = _intake(db, queue, wake=lambda: time.sleep(0.1))  # A's write takes a while

    async def submit(i: int, trace: str) -> object:
        parent.set(trace)
        return await intake.submit_together(message(i))

    async def scenario() -> None:
        first = asyncio.create_task(submit(1, "trace-A"))
        await asyncio.sleep(0.03)  # A's group of one is being written: B's is the next
        await asyncio.gather(first, submit(2, "trace-B"))

    asyncio.run(scenario())
    with db.connect() as conn:
        found = conn.execute(text("SELECT trace_parent FROM message ORDER BY msg_id")).scalars()
        assert list(found) == ["trace-A", "trace-B"]


def test_a_group_commit_serves_one_event_loop_at_a_time() -> None:
    gate = threading.Event()

    def held(items: Sequence[int]) -> list[int | BaseException]:
        gate.wait(30)
        return list(items)

    group: GroupCommit[int, int] = GroupCommit(held)
    first: list[int | Alone] = []
    other = threading.Thread(target=lambda: first.append(asyncio.run(group.run(1))))
    other.start()
    try:
        deadline = time.monotonic() + 30
        while group._writer is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="one event loop"):
            asyncio.run(group.run(2))  # another loop while the first one's writer runs
    finally:
        gate.set()
        other.join(30)
    assert first == [1]
    assert asyncio.run(group.run(3)) == 3  # its writer done: another loop may use it
