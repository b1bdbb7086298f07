"""Funnels, guaranteed order, obsolete messages, external calls, parent/child, responses,
confirmations and operator commands, in process against the real PostgreSQL."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError

from orderly.models import MessageState
from orderly.worker.configuration import ConfigReader
from orderly.worker.core.due import drain as drain_due
from orderly.worker.core.errors import (
    CallInProgress,
    InvalidMessage,
    MessageNotFound,
    OperationRefused,
    ResponseNotAwaited,
)
from orderly.worker.db.prepared import prepared_connection
from orderly.worker.db.queries import sql
from orderly.worker.messages import confirmations, extcall, operations, watchdogs
from orderly.worker.messages.batches import process_message
from orderly.worker.messages.extcall import CallKey, Skip
from orderly.worker.messages.intake import Intake
from orderly.worker.messages.processing import Outcome
from tests.helpers import (
    BASE_TS,
    local_http,
    make_due,
    message,
    processor,
    row,
    set_config,
    states,
    take_due,
    wait_until,
)
from tests.push_recorder import Recorder


def funnel_msg(n: int, funnel: str = "f1", **extra: Any) -> dict[str, Any]:
    return message(n, operation="script", funnel_value=funnel, guaranteed_order=True, **extra)


def drain(db: Engine, queue: list[int]) -> None:
    """Process what is queued (and what that enqueues) until nothing is left."""
    proc = processor(db)
    while queue:
        process_message(proc, queue.pop(0), queue.append)


# --- funnels and guaranteed order ---------------------------------------------------------


def test_guaranteed_order_stores_successors_postponed_and_releases_them_in_order(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    ids = [intake.submit(funnel_msg(n)).msg_id for n in (3, 1, 2)]
    # 3 came first: nothing older was there, so it is NEW; 1 is older than 3: NEW too;
    # 2 finds 1 older and not final: POSTPONED, with no task.
    assert [row(db, i).state for i in ids] == ["NEW", "NEW", "POSTPONED"]
    assert queue == [ids[0], ids[1]]
    first = process_message(processor(db), ids[0])  # 3 has older ones before it
    assert first.outcome is Outcome.POSTPONED
    result = process_message(processor(db), ids[1])  # 1 runs; its OK releases 2
    assert result.outcome is Outcome.OK and result.ready == (ids[2],)
    order: list[int] = []
    proc = processor(db)
    ready = list(result.ready)
    while ready:
        nxt = ready.pop(0)
        order.append(nxt)
        ready.extend(process_message(proc, nxt).ready)
    assert order == [ids[2], ids[0]]
    assert set(states(db).values()) == {"OK"}


def test_exclude_failed_state_decides_whether_a_failed_message_blocks(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    set_config(db, asynch__countPartlyFailsBeforeFailed="0")
    bad = intake.submit(funnel_msg(1, payload=json.dumps({"fail_times": 9}))).msg_id
    blocked = intake.submit(funnel_msg(2)).msg_id
    free = intake.submit(funnel_msg(3, funnel="f2")).msg_id
    intake.submit(funnel_msg(0, funnel="f2", correlation_id="f2-bad"))
    assert process_message(processor(db), bad).outcome is Outcome.FAILED
    # in f1, the FAILED message still holds message 2 (exclude_failed_state false)
    assert row(db, blocked).state == "POSTPONED"
    # in f2, an older FAILED message does not hold a message with exclude_failed_state
    with db.begin() as conn:
        conn.execute(text("UPDATE message SET state = 'FAILED' WHERE correlation_id = 'f2-bad'"))
        conn.execute(
            text(
                "UPDATE message SET exclude_failed_state = true, state = 'IN_QUEUE'"
                " WHERE msg_id = :i"
            ),
            {"i": free},
        )
    assert process_message(processor(db), free).outcome is Outcome.OK
    # and without it, the same FAILED message holds it
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE message SET exclude_failed_state = false, state = 'IN_QUEUE'"
                " WHERE msg_id = :i"
            ),
            {"i": free},
        )
    assert process_message(processor(db), free).outcome is Outcome.POSTPONED


def test_postponed_too_long_behind_a_failed_message_becomes_failed(
    db: Engine, intake: Intake
) -> None:
    set_config(db, asynch__postponedIntervalWhenFailedSec="1")
    head = intake.submit(funnel_msg(1)).msg_id
    waiting = intake.submit(funnel_msg(2)).msg_id
    excluded = intake.submit(funnel_msg(3, exclude_failed_state=True)).msg_id
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE message SET state = 'FAILED',"
                " last_process_timestamp = now() - interval '5 s' WHERE msg_id = :h"
            ),
            {"h": head},
        )
        conn.execute(
            text(
                "UPDATE message SET last_process_timestamp = now() - interval '5 s'"
                " WHERE msg_id IN (:a, :b)"
            ),
            {"a": waiting, "b": excluded},
        )
    woken: list[bool] = []
    assert (
        watchdogs.fail_postponed(db, ConfigReader(db, ttl_seconds=0), lambda: woken.append(True))
        == 1
    )
    stored = row(db, waiting)
    assert stored.state == "FAILED" and stored.failed_error_code == watchdogs.POSTPONED_CODE
    assert f"FAILED message {head}" in (stored.failed_desc or "")
    # 3 excludes FAILED messages: once 2 failed nothing held it, so it was released
    assert row(db, excluded).state == "IN_QUEUE" and woken == [True]


def test_a_plain_funnel_postpones_while_another_is_active(db: Engine, intake: Intake) -> None:
    a = intake.submit(message(1, funnel_value="cust-1", payload=json.dumps({"sleep": 0.6})))
    b = intake.submit(message(2, funnel_value="cust-1"))
    assert b.state is MessageState.NEW  # plain funnel: only an active message holds it
    results: list[Any] = []
    t = threading.Thread(target=lambda: results.append(process_message(processor(db), a.msg_id)))
    t.start()
    while row(db, a.msg_id).state != "PROCESSING":
        pass
    assert process_message(processor(db), b.msg_id).outcome is Outcome.POSTPONED
    t.join()
    assert results[0].outcome is Outcome.OK and results[0].ready == (b.msg_id,)


def test_an_obsolete_message_is_skipped_with_the_newer_one_named(
    db: Engine, intake: Intake
) -> None:
    newer = intake.submit(message(5, object_id="cust-9", entity_type="customer")).msg_id
    older = intake.submit(message(1, object_id="cust-9", entity_type="customer")).msg_id
    assert process_message(processor(db), newer).outcome is Outcome.OK
    result = process_message(processor(db), older)
    assert result.outcome is Outcome.OBSOLETE
    stored = row(db, older)
    assert stored.state == "OK" and stored.obsolete_by == newer
    assert stored.custom_data is None  # the handler never ran


# --- external calls ------------------------------------------------------------------------


def test_external_call_rules_older_duplicate_newer_and_in_progress(
    db: Engine, intake: Intake
) -> None:
    ids = [intake.submit(message(n)).msg_id for n in (1, 2, 3)]
    key = CallKey.entity("customer", "42")
    ts = {i: BASE_TS + timedelta(seconds=n) for i, n in zip(ids, (1, 2, 3), strict=True)}
    calls: list[int] = []
    with prepared_connection(db) as conn:

        def run(msg_id: int) -> Any:
            return extcall.external_call(
                conn, msg_id, ts[msg_id], "setCustomer", key, lambda: calls.append(msg_id)
            )

        assert run(ids[1]).called  # first call on the key
        assert run(ids[0]).skipped is Skip.OBSOLETE  # older than the last success
        assert run(ids[1]).skipped is Skip.DUPLICATE  # same timestamp, already OK
        # a newer message while another message's call is in progress: try later
        taken = extcall.take_call(conn, ids[1], ts[ids[1]] + timedelta(0), "other", key)
        assert isinstance(taken, int)
        with pytest.raises(CallInProgress):
            extcall.take_call(conn, ids[2], ts[ids[2]], "other", key)
        assert run(ids[2]).called  # newer than the last success
        with pytest.raises(RuntimeError):
            extcall.external_call(
                conn,
                ids[2],
                ts[ids[2]],
                "flaky",
                key,
                lambda: (_ for _ in ()).throw(RuntimeError()),
            )
        # the same message after a failed call: call again
        assert extcall.external_call(conn, ids[2], ts[ids[2]], "flaky", key, lambda: 1).called
    assert calls == [ids[1], ids[2]]
    with db.connect() as c:
        found = c.execute(
            text("SELECT state, failed_count FROM external_call WHERE operation_name='flaky'")
        ).one()
    assert tuple(found) == ("OK", 1)


def test_a_busy_key_postpones_the_message_and_the_pool_takes_it_up_later(
    db: Engine, intake: Intake
) -> None:
    first = intake.submit(message(1, operation="extcall", payload=json.dumps({"key": "k"})))
    second = intake.submit(message(2, operation="extcall", payload=json.dumps({"key": "k"})))
    with prepared_connection(db) as conn:
        extcall.take_call(conn, first.msg_id, BASE_TS, "test.op", CallKey.custom("k"))
    assert process_message(processor(db), second.msg_id).outcome is Outcome.POSTPONED
    assert row(db, second.msg_id).failed_count == 0  # a busy key is no failure
    waiting = row(db, second.msg_id)
    assert waiting.state is MessageState.POSTPONED and waiting.due_at is not None
    assert take_due(db) == 0  # due after postponedIntervalSec
    make_due(db, second.msg_id)
    assert take_due(db) == 1
    with prepared_connection(db) as conn:
        still_busy = process_message(processor(db), second.msg_id)
        assert still_busy.outcome is Outcome.POSTPONED
        call_id = extcall.take_call(conn, first.msg_id, BASE_TS, "test.op", CallKey.custom("k"))
        assert isinstance(call_id, int)
        extcall.finish_call(conn, call_id, first.msg_id, ok=True)
    make_due(db, second.msg_id)
    assert take_due(db) == 1
    assert process_message(processor(db), second.msg_id).outcome is Outcome.OK
    assert row(db, second.msg_id).custom_data == "CALLED"  # newer than the first call


def test_a_handler_may_not_split_into_its_own_funnel_nor_split_and_wait(
    db: Engine, intake: Intake
) -> None:
    # a child in its parent's funnel could never start while its parent holds the funnel
    own_funnel = {"children": [{"operation": "script", "funnel_value": "f"}]}
    both = {"children": [{"operation": "script"}], "wait": "ext-1"}
    ids = [
        intake.submit(
            message(1, operation="split", payload=json.dumps(own_funnel), funnel_value="f")
        ).msg_id,
        intake.submit(message(2, operation="split", payload=json.dumps(both))).msg_id,
    ]
    for msg_id in ids:
        assert process_message(processor(db), msg_id).outcome is Outcome.PARTLY_FAILED
        assert row(db, msg_id).failed_error_code == "E_INVALID_CHILD"
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM message")).scalar() == 2  # no child


# --- parent / child ----------------------------------------------------------------------


def split_payload(*children: dict[str, Any]) -> str:
    return json.dumps({"children": list(children)})


def test_hard_children_decide_the_parent_up_two_levels(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    grandchild_ok = {"operation": "script", "payload": {}}
    child = {"operation": "split", "payload": {"children": [grandchild_ok, grandchild_ok]}}
    root = intake.submit(message(1, operation="split", payload=split_payload(child, grandchild_ok)))
    drain(db, queue)
    assert set(states(db).values()) == {"OK"}
    assert len(states(db)) == 5
    with db.connect() as conn:
        kids = conn.execute(
            text("SELECT msg_id FROM message WHERE parent_msg_id = :p"), {"p": root.msg_id}
        ).all()
    assert len(kids) == 2


def test_a_failed_hard_grandchild_fails_the_chain_and_soft_ones_never_do(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    set_config(db, asynch__countPartlyFailsBeforeFailed="0")
    bad = {"operation": "script", "payload": {"fail_times": 5, "code": "E_GRAND"}}
    soft_bad = {"operation": "script", "payload": {"fail_times": 5}, "soft": True}
    child = {"operation": "split", "payload": {"children": [bad]}}
    root = intake.submit(message(1, operation="split", payload=split_payload(child))).msg_id
    soft_root = intake.submit(message(2, operation="split", payload=split_payload(soft_bad))).msg_id
    drain(db, queue)
    top = row(db, root)
    assert top.state == "FAILED" and top.failed_error_code == "E_GRAND"
    assert (top.failed_desc or "").startswith("child message ")
    assert row(db, soft_root).state == "OK"  # a SOFT child never affects its parent
    # re-driving the failed grandchild re-opens its ancestors, which then end OK
    grand = next(
        i
        for i, s in states(db).items()
        if s == "FAILED"
        and row(db, i).failed_error_code == "E_GRAND"
        and row(db, i).parent_msg_id not in (None, root)  # not the root, not its child
    )
    with db.begin() as conn:
        conn.execute(text("UPDATE message SET payload = '{}' WHERE msg_id = :i"), {"i": grand})
    done = operations.redrive(db, grand, {"note": "fixed the data"}, queue.append)
    assert len(done.reopened) == 2
    drain(db, queue)
    assert row(db, root).state == "OK"


# --- responses ----------------------------------------------------------------------------


def test_a_response_resumes_a_waiting_message_and_an_early_one_is_kept(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    waiting = intake.submit(
        message(1, operation="wait", payload=json.dumps({"correlation_id": "r-1"}))
    )
    assert process_message(processor(db), waiting.msg_id).outcome is Outcome.WAITING_FOR_RES
    with pytest.raises(ResponseNotAwaited):
        operations.receive_response(db, {"correlation_id": "nobody", "payload": "x"}, queue.append)
    with pytest.raises(InvalidMessage) as bad:
        operations.receive_response(db, {"correlation_id": "r-1", "failed": True}, queue.append)
    assert bad.value.field == "reason"
    with pytest.raises(InvalidMessage) as bad:  # the seed: no envelope, then a failed reason
        operations.receive_response(db, {"correlation_id": "r-1"}, queue.append)
    assert bad.value.field == "payload"
    assert row(db, waiting.msg_id).wait_res_id is None  # nothing half-written
    queue.clear()
    got = operations.receive_response(
        db, {"correlation_id": "r-1", "payload": {"ok": 1}}, queue.append
    )
    assert got.state is MessageState.IN_QUEUE and queue == [waiting.msg_id]
    again = operations.receive_response(db, {"correlation_id": "r-1", "payload": "x"}, queue.append)
    assert not again.created and again.res_id == got.res_id
    assert process_message(processor(db), queue.pop()).outcome is Outcome.OK
    assert row(db, waiting.msg_id).custom_data == '{"ok":1}'


def test_the_seed_constraints_hold_in_the_tables(db: Engine, intake: Intake) -> None:
    given = message(1, operation="script", payload={"n": 1})
    plain = intake.submit(given).msg_id
    enveloped = intake.submit({**message(2), "envelope": "<soap:Envelope/>"}).msg_id
    # without an envelope of its own, a message keeps itself as received
    kept = json.loads(row(db, plain).envelope)
    assert kept["correlation_id"] == given["correlation_id"] and kept["payload"] == {"n": 1}
    assert set(kept) == set(given)
    assert row(db, enveloped).envelope == "<soap:Envelope/>"
    refused = [
        "UPDATE message SET envelope = NULL WHERE msg_id = :m",
        "INSERT INTO response (msg_id, failed, res_envelope, res_timestamp) "
        "VALUES (:m, true, 'x', now())",
        "INSERT INTO response (msg_id, failed, res_timestamp) VALUES (:m, false, now())",
    ]
    for statement in refused:
        with pytest.raises(IntegrityError), db.begin() as conn:
            conn.execute(text(statement), {"m": plain})
    with db.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO response (msg_id, failed, failed_reason, res_timestamp) "
                "VALUES (:m, true, 'timeout', now())"
            ),
            {"m": plain},
        )


def test_an_operator_responds_by_hand_with_a_note_all_or_nothing(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    waiting = intake.submit(
        message(1, operation="wait", payload=json.dumps({"correlation_id": "r-9"}))
    ).msg_id
    other = intake.submit(message(2)).msg_id
    assert process_message(processor(db), waiting).outcome is Outcome.WAITING_FOR_RES
    queue.clear()
    # Refusals name the problem and write nothing: no note, a bad response, a message that
    # waits for nothing, an unknown one.
    for data, note, field in (
        ({"payload": "x"}, None, "note"),
        ({"payload": "x"}, "  ", "note"),
        ({"failed": True}, "phoned", "reason"),
        ({"correlation_id": "r-9"}, "phoned", "correlation_id"),
    ):
        with pytest.raises(InvalidMessage) as bad:
            operations.respond(db, waiting, data, queue.append, note=note, key="ops")
        assert bad.value.field == field, (data, note)
    with pytest.raises(OperationRefused):
        operations.respond(db, other, {}, queue.append, note="phoned")
    with pytest.raises(MessageNotFound):
        operations.respond(db, 10**9, {}, queue.append, note="phoned")
    stored = row(db, waiting)
    assert (stored.wait_res_id, stored.audit, queue) == (None, [], [])
    got = operations.respond(
        db, waiting, {"payload": {"ok": 2}}, queue.append, note="answered by phone", key="ops"
    )
    assert got.created and got.state is MessageState.IN_QUEUE and queue == [waiting]
    entry = row(db, waiting).audit[-1]
    assert (entry["action"], entry["by"], entry["note"], entry["from"]) == (
        "RESPOND",
        "key:ops",
        "answered by phone",
        "WAITING_FOR_RES",
    )
    assert process_message(processor(db), queue.pop()).outcome is Outcome.OK
    assert row(db, waiting).custom_data == '{"ok":2}'
    # Final now: nothing more to answer.
    with pytest.raises(OperationRefused):
        operations.respond(db, waiting, {}, queue.append, note="again")


def test_a_wait_that_runs_out_fails(db: Engine, intake: Intake) -> None:
    waiting = intake.submit(
        message(1, operation="wait", payload=json.dumps({"correlation_id": "r-2", "timeout_s": 1}))
    )
    process_message(processor(db), waiting.msg_id)
    with db.begin() as conn:
        conn.execute(text("UPDATE message SET response_deadline = now() - interval '1 s'"))
    assert watchdogs.expire_waits(db, ConfigReader(db, ttl_seconds=0), lambda: None) == 1
    stored = row(db, waiting.msg_id)
    assert stored.state == "FAILED" and stored.failed_error_code == watchdogs.TIMEOUT_CODE
    assert "r-2" in (stored.failed_desc or "")


# --- confirmations and operator commands -------------------------------------------------


def test_confirmations_retry_up_to_failed_end(
    db: Engine, intake: Intake, queue: list[int], recorder: Recorder
) -> None:
    set_config(db, asynch__confirmation__failedLimit="3", asynch__confirmation__intervalSec="0")
    with pytest.raises(InvalidMessage):
        confirmations.set_source_system(db, "crm", {"confirmation_url": "ftp://x"})
    confirmations.set_source_system(db, "crm", {"confirmation_url": recorder.base + "/confirm"})
    recorder.fail["/confirm"] = 5
    msg_id = intake.submit(message(1)).msg_id
    process_message(processor(db), msg_id)
    seen = []
    config = ConfigReader(db, ttl_seconds=0)
    http = local_http()
    due: list[tuple[int, str]] = []
    confirming = confirmations.due_confirmations(db, due.extend)  # the ticker's due work
    for _ in range(4):
        due.clear()
        drain_due(confirming, 100)
        seen += [confirmations.confirm(db, cid, claim, config, http) for cid, claim in due]
        # A second copy of a task (or one whose claim was taken over) settles nothing.
        assert [confirmations.confirm(db, cid, "stale", config, http) for cid, _ in due] == [
            "NOT_DUE"
        ] * len(due)
    assert seen == ["FAILED", "FAILED", "FAILED_END"]
    assert [a["body"]["state"] for a in recorder.arrivals] == ["OK"] * 3
    assert {a["key"] for a in recorder.arrivals} == {f"confirmation:{msg_id}"}
    with db.connect() as conn:
        logged = conn.execute(
            text("SELECT count(*) FROM response WHERE msg_id = :i AND failed"), {"i": msg_id}
        ).scalar()
    assert logged == 3


def test_a_try_in_flight_does_not_settle_a_final_state_recorded_anew(
    db: Engine, intake: Intake, recorder: Recorder
) -> None:
    confirmations.set_source_system(db, "crm", {"confirmation_url": recorder.base + "/confirm"})
    msg_id = intake.submit(message(1)).msg_id
    process_message(processor(db), msg_id)  # OK: a confirmation is recorded
    taken: list[tuple[int, str]] = []
    drain_due(confirmations.due_confirmations(db, taken.extend), 100)
    [(call_id, claim)] = taken
    with db.begin() as conn:  # the message becomes final again while that try is in flight
        conn.execute(
            text("UPDATE message SET state = 'PROCESSING' WHERE msg_id = :i"), {"i": msg_id}
        )
        conn.execute(text("UPDATE message SET state = 'FAILED' WHERE msg_id = :i"), {"i": msg_id})
    config = ConfigReader(db, ttl_seconds=0)
    assert confirmations.confirm(db, call_id, claim, config, local_http()) == "NOT_DUE"
    assert recorder.arrivals == []  # the stale try sent nothing
    again: list[tuple[int, str]] = []
    drain_due(confirmations.due_confirmations(db, again.extend), 100)
    [(_, fresh)] = again
    assert confirmations.confirm(db, call_id, fresh, config, local_http()) == "OK"
    assert [a["body"]["state"] for a in recorder.arrivals] == ["FAILED"]


def test_a_try_whose_worker_died_is_due_at_once_and_quarantined_at_the_limit(
    db: Engine, intake: Intake, recorder: Recorder
) -> None:
    confirmations.set_source_system(db, "crm", {"confirmation_url": recorder.base + "/confirm"})
    msg_id = intake.submit(message(1)).msg_id
    process_message(processor(db), msg_id)  # OK: a confirmation is recorded
    config = ConfigReader(db, ttl_seconds=0)

    def take() -> tuple[int, str]:
        taken: list[tuple[int, str]] = []
        drain_due(confirmations.due_confirmations(db, taken.extend), 100)
        [one] = taken
        return one

    def call() -> Any:
        with db.connect() as conn:
            return conn.execute(
                text(
                    "SELECT state, lost_count, claim_pid, next_attempt_at <= now() AS due"
                    " FROM external_call WHERE msg_id = :i"
                ),
                {"i": msg_id},
            ).one()

    def started_by_a_worker_that_dies(call_id: int, claim: str) -> None:
        conn = db.connect()
        assert conn.execute(sql("confirmation_start"), {"id": call_id, "claim": claim}).first()
        conn.commit()
        # A second copy of the task while that worker lives starts nothing.
        assert confirmations.confirm(db, call_id, claim, config, local_http()) == "NOT_DUE"
        conn.execute(
            text("UPDATE external_call SET last_update_timestamp = now() - interval '2 s'")
        )
        conn.commit()
        conn.invalidate()  # the worker is killed: its connection goes
        conn.close()

    def released() -> bool:
        return sum(confirmations.release_orphans(db, 3)) == 1

    for death in (1, 2):
        call_id, claim = take()
        started_by_a_worker_that_dies(call_id, claim)
        wait_until(released, timeout=10, what="the dead worker's try released")
        got = call()
        assert (got.state, got.lost_count, got.claim_pid, got.due) == (
            "PROCESSING",
            death,
            None,
            True,
        )
    call_id, claim = take()
    started_by_a_worker_that_dies(call_id, claim)
    wait_until(released, timeout=10, what="the third death")
    got = call()
    assert (got.state, got.lost_count, got.due) == ("FAILED_END", 3, None)
    assert recorder.arrivals == []  # no try got as far as sending


def test_cancel_and_redrive_need_a_note_and_the_right_state(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    head = intake.submit(funnel_msg(1)).msg_id
    behind = intake.submit(funnel_msg(2)).msg_id
    with pytest.raises(InvalidMessage):
        operations.cancel(db, head, {"note": " "}, queue.append)
    with pytest.raises(MessageNotFound):
        operations.cancel(db, 999, {"note": "x"}, queue.append)
    queue.clear()
    operations.cancel(db, head, {"note": "customer withdrew", "by": "ann"}, queue.append)
    assert queue == [behind]  # cancelling the head releases the next one at once
    stored = row(db, head)
    assert stored.state == "CANCEL"
    assert stored.audit[0]["note"] == "customer withdrew" and stored.audit[0]["by"] == "ann"
    with pytest.raises(OperationRefused):
        operations.cancel(db, head, {"note": "again"}, queue.append)
    with pytest.raises(OperationRefused):
        operations.redrive(db, behind, {"note": "not failed"}, queue.append)
    operations.redrive(db, head, {"note": "send it after all"}, queue.append)
    assert row(db, head).state == "IN_QUEUE"
    assert [a["action"] for a in row(db, head).audit] == ["CANCEL", "REDRIVE"]
    listed = operations.list_messages(db, state="in_queue", funnel="f1")
    assert [m["msg_id"] for m in listed] == [head, behind]
    with pytest.raises(InvalidMessage):
        operations.list_messages(db, state="DONE")


def test_messages_listed_by_every_filter_with_counts_by_state(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    ids = [
        intake.submit(message(1, source_system="erp")).msg_id,
        intake.submit(message(2, source_system="erp", operation="say")).msg_id,
        intake.submit(message(3, source_system="shop", service="bench", operation="noop")).msg_id,
        intake.submit(funnel_msg(4)).msg_id,
    ]
    operations.cancel(db, ids[1], {"note": "not wanted"}, queue.append)

    def listed(**filters: Any) -> list[int]:
        return [m["msg_id"] for m in operations.list_messages(db, **filters)]

    assert listed() == ids
    assert listed(source_system="erp") == ids[:2]
    assert listed(operation="say") == [ids[1]]
    assert listed(service="bench") == [ids[2]]
    assert listed(correlation_id="corr-2") == [ids[1]]
    assert listed(funnel="f1") == [ids[3]]
    assert listed(state="cancel") == [ids[1]]
    # msg_timestamp from (inclusive) and before (exclusive); a time without a zone is UTC
    assert listed(since="2026-01-01T00:00:02", until="2026-01-01T00:00:04Z") == ids[1:3]
    assert listed(limit=2, offset=1) == ids[1:3]
    assert listed(newest_first=True, limit=2) == [ids[3], ids[2]]
    chosen = operations.message_filter(source_system="erp")
    counts = operations.count_by_state(db, chosen)
    assert counts[MessageState.CANCEL] == 1 and sum(counts.values()) == 2
    assert set(counts) == set(MessageState)  # every state, 0 when none
    # Bad filters are named; nothing is listed.
    for bad, field in (
        ({"state": "DONE"}, "state"),
        ({"since": "yesterday"}, "since"),
        ({"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, "until"),
        ({"source_system": "x" * 101}, "source_system"),
        ({"offset": -1}, "offset"),
    ):
        with pytest.raises(InvalidMessage) as refused:
            operations.list_messages(db, **bad)
        assert field in {f for f, _ in refused.value.problems}, (bad, refused.value.problems)
