"""The processing state machine and the pool/repair, in process against the real store."""

from __future__ import annotations

import json
import threading

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

from orderly.models import MessageState, NodeState
from orderly.worker import nodes
from orderly.worker.configuration import ConfigReader
from orderly.worker.core.lease import ORPHAN_GRACE_S
from orderly.worker.db.prepared import prepared_connection
from orderly.worker.handlers import HandlerRegistry, MessageContext
from orderly.worker.messages import watchdogs
from orderly.worker.messages.batches import claim_due, process_message
from orderly.worker.messages.intake import Intake
from orderly.worker.messages.processing import ERROR_NO_HANDLER, Outcome
from orderly.worker.runtime import get_runtime
from tests.conftest import TEST_DB_URL
from tests.helpers import (
    make_due,
    message,
    processor,
    row,
    set_config,
    take_due,
    wait_until,
)


def script(**spec: object) -> str:
    return json.dumps(spec)


def test_success_moves_new_to_ok_and_records_node_and_custom_data(
    db: Engine, intake: Intake
) -> None:
    msg_id = intake.submit(message(1)).msg_id
    result = process_message(processor(db), msg_id)
    assert result.outcome is Outcome.OK
    stored = row(db, msg_id)
    assert stored.state is MessageState.OK
    assert stored.custom_data == "0;"
    assert stored.node_id == get_runtime().node_id
    assert stored.processing_pid is None


def _retry_wait_ms(db: Engine, msg_id: int) -> float | None:
    """How long after its outcome a failed message is due again (None: not waiting)."""
    with db.connect() as conn:
        found = conn.execute(
            text(
                "SELECT extract(epoch FROM due_at - last_process_timestamp) * 1000"
                " FROM message WHERE msg_id = :i"
            ),
            {"i": msg_id},
        ).scalar()
    return None if found is None else float(found)


def test_failures_count_up_then_fail_at_the_limit(db: Engine, intake: Intake) -> None:
    set_config(
        db,
        asynch__countPartlyFailsBeforeFailed="2",
        asynch__partlyFailedIntervalSec="3",
        asynch__partlyFailedMultiplier="2.5",
    )
    msg_id = intake.submit(message(1, payload=script(fail_times=10, code="E_DOWN"))).msg_id
    proc = processor(db)
    seen = []
    for _ in range(3):
        result = process_message(proc, msg_id)
        seen.append((result.outcome, row(db, msg_id).failed_count, _retry_wait_ms(db, msg_id)))
        if result.outcome is Outcome.PARTLY_FAILED:
            assert (
                process_message(proc, msg_id).outcome is Outcome.NOT_CLAIMABLE
            )  # not before its time
            make_due(db, msg_id)
            assert take_due(db) == 1
    # delay * multiplier ^ attempt: 3 s * 2.5 = 7.5 s, then 3 s * 2.5^2 = 18.75 s
    assert seen == [
        (Outcome.PARTLY_FAILED, 1, 7_500.0),
        (Outcome.PARTLY_FAILED, 2, 18_750.0),
        (Outcome.FAILED, 3, None),
    ]
    stored = row(db, msg_id)
    assert stored.failed_error_code == "E_DOWN"
    assert stored.failed_desc == "scripted failure 2"
    assert stored.custom_data == "0;1;2;"


def test_an_unexpected_exception_is_a_partial_failure_with_its_type(
    db: Engine, intake: Intake
) -> None:
    msg_id = intake.submit(message(1, operation="crash")).msg_id
    assert process_message(processor(db), msg_id).outcome is Outcome.PARTLY_FAILED
    stored = row(db, msg_id)
    assert stored.failed_error_code == "E_HANDLER"
    assert stored.failed_desc is not None and stored.failed_desc.startswith("RuntimeError")


def test_a_missing_handler_fails_the_message_at_once(db: Engine, intake: Intake) -> None:
    msg_id = intake.submit(message(1)).msg_id
    result = process_message(processor(db, HandlerRegistry()), msg_id)
    assert result.outcome is Outcome.FAILED
    stored = row(db, msg_id)
    assert stored.failed_error_code == ERROR_NO_HANDLER
    assert "test.script" in (stored.failed_desc or "")


@pytest.mark.parametrize("state", ["OK", "FAILED", "CANCEL", "PARTLY_FAILED", "WAITING"])
def test_a_message_in_another_state_is_not_claimed(db: Engine, intake: Intake, state: str) -> None:
    msg_id = intake.submit(message(1)).msg_id
    with db.begin() as conn:
        conn.execute(text("UPDATE message SET state=:s WHERE msg_id=:i"), {"s": state, "i": msg_id})
    result = process_message(processor(db), msg_id)
    assert result.outcome is Outcome.NOT_CLAIMABLE
    assert row(db, msg_id).state == state


def test_a_message_processing_on_a_live_connection_is_not_claimed_twice(
    db: Engine, intake: Intake
) -> None:
    msg_id = intake.submit(message(1, payload=script(sleep=1.0))).msg_id
    results = []
    first = threading.Thread(target=lambda: results.append(process_message(processor(db), msg_id)))
    first.start()
    while row(db, msg_id).state is not MessageState.PROCESSING:
        pass
    second = process_message(processor(db), msg_id)
    first.join()
    assert second.outcome is Outcome.NOT_CLAIMABLE
    assert [r.outcome for r in results] == [Outcome.OK]
    assert row(db, msg_id).custom_data == "0;"


def _orphan(db: Engine, msg_id: int) -> None:
    """Claim a message on a connection that then dies, as a killed worker's would."""
    other = create_engine(TEST_DB_URL, poolclass=None)
    conn = other.connect()
    conn.execute(
        text(
            "UPDATE message SET state='PROCESSING', processing_pid=pg_backend_pid(),"
            " lone_claim = true WHERE msg_id=:i"
        ),
        {"i": msg_id},
    )
    conn.commit()
    conn.invalidate()  # closes the socket: the backend exits
    other.dispose()


def _orphan_claim(db: Engine, size: int) -> list[int]:
    """A worker's claim of up to ``size`` due messages (claim_due) on a connection that then
    dies, as a killed worker's would: the ids it held."""
    other = create_engine(TEST_DB_URL, poolclass=NullPool)
    with prepared_connection(other) as conn:
        rows, _ = claim_due(conn, get_runtime().node_id, size, 5)
    other.dispose()  # no pool: the connection is closed, its backend exits
    return sorted(r.msg_id for r in rows)


def _orphaned_by_now(db: Engine, msg_id: int) -> bool:
    """By PostgreSQL's clock: the claiming backend is gone and the orphan's grace is over."""
    with db.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT last_process_timestamp <= now() - make_interval(secs => :g)"
                    " AND orderly_orphaned(processing_pid) FROM message WHERE msg_id = :i"
                ),
                {"g": ORPHAN_GRACE_S, "i": msg_id},
            ).scalar_one()
        )


def test_a_message_orphaned_by_a_dead_worker_is_claimed_again(db: Engine, intake: Intake) -> None:
    msg_id = intake.submit(message(1)).msg_id
    _orphan(db, msg_id)
    wait_until(lambda: _orphaned_by_now(db, msg_id), timeout=10, what="the backend's exit")
    assert process_message(processor(db), msg_id).outcome is Outcome.OK
    stored = row(db, msg_id)
    assert (stored.lost_count, stored.failed_count) == (1, 0)  # a death, not a failure


def test_an_orphan_at_the_lost_limit_is_not_claimed_but_quarantined(
    db: Engine, intake: Intake
) -> None:
    msg_id = intake.submit(message(1)).msg_id
    with db.begin() as conn:
        conn.execute(text("UPDATE message SET lost_count = 2 WHERE msg_id = :i"), {"i": msg_id})
    _orphan(db, msg_id)
    wait_until(lambda: _orphaned_by_now(db, msg_id), timeout=10, what="the backend's exit")
    result = process_message(processor(db), msg_id)  # the limit is 3: a third death is too many
    assert result.outcome is Outcome.NOT_CLAIMABLE
    assert row(db, msg_id).lost_count == 2
    enqueued: list[int] = []
    woken: list[bool] = []
    report = watchdogs.release_orphans(
        db, ConfigReader(db, ttl_seconds=0), 3, enqueued.append, lambda: woken.append(True)
    )
    assert (report.released, report.quarantined, enqueued, woken) == (0, 1, [], [])
    stored = row(db, msg_id)
    assert stored.state is MessageState.FAILED
    assert (stored.lost_count, stored.failed_count) == (3, 1)
    assert stored.failed_error_code == watchdogs.WORKER_LOST_CODE
    assert stored.failed_desc == "quarantined: its worker died 3 times while processing it"
    assert stored.processing_pid is None


def test_a_death_in_a_claim_of_several_counts_against_none_and_isolates_them(
    db: Engine, intake: Intake
) -> None:
    """Which message a worker that died in a claim of several was running is not known:
    the death counts against none of them, and each is claimed alone from then on, where a
    death counts. So a poison message is quarantined, and those claimed with it are not."""
    ids = [intake.submit(message(i)).msg_id for i in range(1, 5)]
    held = _orphan_claim(db, 10)
    assert held == ids
    wait_until(lambda: _orphaned_by_now(db, ids[-1]), timeout=10, what="the backend's exit")
    enqueued: list[int] = []
    config = ConfigReader(db, ttl_seconds=0)
    report = watchdogs.release_orphans(db, config, 3, enqueued.append, lambda: None)
    assert (report.released, report.quarantined, sorted(enqueued)) == (4, 0, ids)
    for msg_id in ids:
        stored = row(db, msg_id)
        assert (stored.state, stored.lost_count, stored.isolate) == (
            MessageState.IN_QUEUE,
            0,
            True,
        )

    # Claimed alone now: the first in line, by itself, and its death counts.
    for deaths in (1, 2):
        assert _orphan_claim(db, 10) == [ids[0]]
        wait_until(lambda: _orphaned_by_now(db, ids[0]), timeout=10, what="the backend's exit")
        watchdogs.release_orphans(db, config, 3, lambda _: None, lambda: None)
        assert row(db, ids[0]).lost_count == deaths
    assert _orphan_claim(db, 10) == [ids[0]]
    wait_until(lambda: _orphaned_by_now(db, ids[0]), timeout=10, what="the backend's exit")
    report = watchdogs.release_orphans(db, config, 3, lambda _: None, lambda: None)
    assert report.quarantined == 1
    assert row(db, ids[0]).failed_error_code == watchdogs.WORKER_LOST_CODE
    # The others were never counted against: each runs, alone, and ends OK.
    for msg_id in ids[1:]:
        assert process_message(processor(db), msg_id).outcome is Outcome.OK
        assert (row(db, msg_id).state, row(db, msg_id).lost_count) == (MessageState.OK, 0)


def test_an_isolated_message_goes_before_the_others_alone(db: Engine, intake: Intake) -> None:
    """An isolated message is not held back behind messages that come first in line (a
    higher priority, an earlier turn): the next claim takes it, alone."""
    first, second = (intake.submit(message(i)).msg_id for i in (1, 2))
    with db.begin() as conn:
        conn.execute(text("UPDATE message SET isolate = true WHERE msg_id = :i"), {"i": second})
    urgent = intake.submit(message(3, priority=9)).msg_id
    assert _orphan_claim(db, 10) == [second]
    assert sorted(_orphan_claim(db, 10)) == sorted([first, urgent])  # then the rest together


def test_a_claim_of_one_that_dies_counts_and_an_orphan_taken_by_id_is_counted_once(
    db: Engine, intake: Intake
) -> None:
    msg_id = intake.submit(message(1)).msg_id
    assert _orphan_claim(db, 10) == [msg_id]  # alone in line: a claim of one
    wait_until(lambda: _orphaned_by_now(db, msg_id), timeout=10, what="the backend's exit")
    assert process_message(processor(db), msg_id).outcome is Outcome.OK
    stored = row(db, msg_id)
    assert (stored.lost_count, stored.isolate, stored.lone_claim) == (1, False, True)


def test_a_quarantined_funnel_message_lets_the_next_one_go(db: Engine, intake: Intake) -> None:
    order = {"funnel_value": "f", "guaranteed_order": True, "exclude_failed_state": True}
    first = intake.submit(message(1, **order)).msg_id
    with db.begin() as conn:
        conn.execute(text("UPDATE message SET lost_count = 2 WHERE msg_id = :i"), {"i": first})
    _orphan(db, first)
    second = intake.submit(message(2, **order)).msg_id
    assert row(db, second).state is MessageState.POSTPONED  # held behind the first
    wait_until(lambda: _orphaned_by_now(db, first), timeout=10, what="the backend's exit")
    enqueued: list[int] = []
    woken: list[bool] = []
    report = watchdogs.release_orphans(
        db, ConfigReader(db, ttl_seconds=0), 3, enqueued.append, lambda: woken.append(True)
    )
    assert report.quarantined == 1
    assert row(db, first).state is MessageState.FAILED
    # released by the quarantine, in the same transaction: a woken worker's claim takes it
    assert (enqueued, woken) == ([], [True])
    assert row(db, second).state is MessageState.IN_QUEUE
    assert process_message(processor(db), second).outcome is Outcome.OK


def test_a_stopped_node_processes_nothing(db: Engine, intake: Intake) -> None:
    msg_id = intake.submit(message(1)).msg_id
    nodes.set_state(db, get_runtime().settings.node_code, NodeState.STOPPED)
    assert process_message(processor(db), msg_id).outcome is Outcome.NODE_STOPPED
    assert row(db, msg_id).state is MessageState.NEW
    nodes.set_state(db, get_runtime().settings.node_code, NodeState.HANDLES_EXISTING_MESSAGES)
    assert process_message(processor(db), msg_id).outcome is Outcome.OK


def test_handler_context_carries_the_message(db: Engine, intake: Intake) -> None:
    seen: list[MessageContext] = []
    reg = HandlerRegistry()
    reg.add("test", "script", seen.append)
    msg_id = intake.submit(message(7, payload="<x/>", object_id="o", funnel_value="f")).msg_id
    process_message(processor(db, reg), msg_id)
    ctx = seen[0]
    assert (
        ctx.msg_id,
        ctx.correlation_id,
        ctx.source_system,
        ctx.payload,
        ctx.object_id,
        ctx.funnel_value,
    ) == (msg_id, "corr-7", "crm", "<x/>", "o", "f")


# --- pool and repair ---------------------------------------------------------------------


def _set(db: Engine, msg_id: int, state: str, age_s: float, failed_count: int = 0) -> None:
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE message SET state=:s, failed_count=:f, last_process_timestamp="
                "now() - make_interval(secs => :a) WHERE msg_id=:i"
            ),
            {"s": state, "a": age_s, "i": msg_id, "f": failed_count},
        )


def _due_in(engine: Engine, msg_id: int, state: str, in_s: float) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE message SET state = :s, due_at = now() + make_interval(secs => :d)"
                " WHERE msg_id = :i"
            ),
            {"s": state, "d": in_s, "i": msg_id},
        )


def test_waiting_messages_become_claimable_when_their_due_time_comes(
    db: Engine, intake: Intake
) -> None:
    ids = [intake.submit(message(n)).msg_id for n in (5, 1, 3, 2, 4)]
    _due_in(db, ids[0], "PARTLY_FAILED", -1)  # due
    _due_in(db, ids[1], "PARTLY_FAILED", -120)  # due
    _due_in(db, ids[2], "PARTLY_FAILED", 30)  # not due yet
    _due_in(db, ids[3], "POSTPONED", -6)  # due
    _due_in(db, ids[4], "NEW", 60)  # scheduled for later
    wakes: list[int] = []
    assert take_due(db, wake=lambda: wakes.append(1)) == 3
    assert wakes == [1]  # one wake-up for the batch
    for i in (ids[0], ids[1], ids[3]):
        stored = row(db, i)
        assert stored.state is MessageState.IN_QUEUE and stored.due_at is None
        assert stored.start_in_queue_timestamp
    assert row(db, ids[2]).state is MessageState.PARTLY_FAILED
    assert row(db, ids[4]).state is MessageState.NEW and row(db, ids[4]).due_at is not None
    # the scheduled one is no candidate of a claim before its time
    assert [r.outcome for r in [process_message(processor(db), ids[4])]] == [Outcome.NOT_CLAIMABLE]
    assert take_due(db) == 0
    make_due(db, ids[4])
    assert take_due(db) == 1
    assert row(db, ids[4]).state is MessageState.NEW and row(db, ids[4]).due_at is None


def test_repair_releases_stuck_messages_and_fails_them_at_the_limit(
    db: Engine, intake: Intake
) -> None:
    set_config(db, asynch__repairRepeatTimeSec="300", asynch__countPartlyFailsBeforeFailed="3")
    ids = [intake.submit(message(n)).msg_id for n in range(5)]
    _set(db, ids[0], "NEW", 301)
    _set(db, ids[1], "IN_QUEUE", 400)
    _set(db, ids[2], "PROCESSING", 301, failed_count=3)  # at the limit -> FAILED
    _set(db, ids[3], "NEW", 10)  # not stuck
    _set(db, ids[4], "OK", 1000)  # final
    with db.begin() as conn:  # a live claimer: its own backend pid
        conn.execute(
            text("UPDATE message SET processing_pid = pg_backend_pid() WHERE msg_id=:i"),
            {"i": ids[2]},
        )
    report = watchdogs.repair(db, ConfigReader(db, ttl_seconds=0))
    assert (report.messages, report.failed) == (3, 1)
    assert row(db, ids[0]).state is MessageState.PARTLY_FAILED
    assert row(db, ids[0]).failed_error_code == watchdogs.REPAIR_CODE
    assert "stuck in NEW" in (row(db, ids[0]).failed_desc or "")
    assert row(db, ids[1]).state is MessageState.PARTLY_FAILED
    assert row(db, ids[2]).state is MessageState.FAILED
    assert row(db, ids[3]).state is MessageState.NEW
    assert row(db, ids[4]).state is MessageState.OK


def test_an_orphan_is_released_at_once_and_repair_leaves_it_alone(
    db: Engine, intake: Intake
) -> None:
    msg_id = intake.submit(message(1)).msg_id
    _orphan(db, msg_id)
    wait_until(lambda: _orphaned_by_now(db, msg_id), timeout=10, what="the orphan's grace")
    assert watchdogs.repair(db, ConfigReader(db, ttl_seconds=0)).messages == 0
    enqueued: list[int] = []
    woken: list[bool] = []
    report = watchdogs.release_orphans(
        db, ConfigReader(db, ttl_seconds=0), 3, enqueued.append, lambda: woken.append(True)
    )
    assert (report.released, report.quarantined, enqueued, woken) == (1, 0, [msg_id], [])
    stored = row(db, msg_id)
    assert stored.state is MessageState.IN_QUEUE
    assert (stored.lost_count, stored.failed_count, stored.processing_pid) == (1, 0, None)
    # released once: a second turn finds nothing
    assert watchdogs.release_orphans(
        db, ConfigReader(db, ttl_seconds=0), 3, enqueued.append, lambda: woken.append(True)
    ) == (watchdogs.OrphanReport(released=0, quarantined=0))
    assert process_message(processor(db), msg_id).outcome is Outcome.OK


def test_repair_fails_external_calls_stuck_in_processing(db: Engine, intake: Intake) -> None:
    msg_id = intake.submit(message(1)).msg_id
    with db.begin() as conn:
        for op, age in (("old", 400), ("fresh", 10)):
            conn.execute(
                text(
                    "INSERT INTO external_call (msg_id, operation_name, state, entity_id, "
                    "msg_timestamp, creation_timestamp, last_update_timestamp, failed_count) "
                    "VALUES (:m, :op, 'PROCESSING', 'e1', now(), now(), "
                    "now() - make_interval(secs => :a), 0)"
                ),
                {"m": msg_id, "op": op, "a": age},
            )
    report = watchdogs.repair(db, ConfigReader(db, ttl_seconds=0))
    assert report.external_calls == 1
    with db.connect() as conn:
        got: dict[str, str] = dict(
            conn.execute(text("SELECT operation_name, state FROM external_call")).all()
        )
    assert got == {"old": "FAILED", "fresh": "PROCESSING"}


def test_two_concurrent_repairs_never_take_the_same_row(db: Engine, intake: Intake) -> None:
    set_config(db, asynch__pool__batchSize="50")
    ids = [intake.submit(message(n)).msg_id for n in range(400)]
    with db.begin() as conn:
        conn.execute(text("UPDATE message SET last_process_timestamp = now() - interval '1 hour'"))
    reports: list[watchdogs.RepairReport] = []
    threads = [
        threading.Thread(
            target=lambda: reports.append(watchdogs.repair(db, ConfigReader(db, ttl_seconds=0)))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.messages for r in reports) == len(ids)
    with db.connect() as conn:
        counts = conn.execute(text("SELECT failed_count, count(*) FROM message GROUP BY 1")).all()
    assert counts == [(1, len(ids))]


def test_a_claim_older_than_the_server_is_released_but_not_counted(
    db: Engine, intake: Intake
) -> None:
    """Its backend went with a PostgreSQL restart, not with its worker: no death to count."""
    msg_id = intake.submit(message(1)).msg_id
    _orphan(db, msg_id)
    wait_until(lambda: _orphaned_by_now(db, msg_id), timeout=10, what="the backend's exit")
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE message SET last_process_timestamp = pg_postmaster_start_time()"
                " - interval '1 second' WHERE msg_id = :i"
            ),
            {"i": msg_id},
        )
    enqueued: list[int] = []
    woken: list[bool] = []
    report = watchdogs.release_orphans(
        db, ConfigReader(db, ttl_seconds=0), 1, enqueued.append, lambda: woken.append(True)
    )
    assert (report.released, report.quarantined, enqueued, woken) == (1, 0, [msg_id], [])
    stored = row(db, msg_id)
    assert (stored.state, stored.lost_count) == (MessageState.IN_QUEUE, 0)
