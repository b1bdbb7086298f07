"""What the console's daily work stands on, against the real PostgreSQL: a correlation id found
by its start or a part of it (its own % and _ taken literally), re-drive and cancel of every
message a filter selects (the count confirmed first, an audit entry each), a node's change of
state with who and why, and the store's history in buckets with the backlog counted back."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from orderly.models import MessageState, NodeState
from orderly.worker import nodes
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.history import Window, message_history
from orderly.worker.messages import bulk, operations
from orderly.worker.messages.intake import Intake
from tests.helpers import ManualClock, message, row, states


def _states(db: Engine, ids: int | list[int]) -> dict[int, str]:
    wanted = [ids] if isinstance(ids, int) else ids
    return {k: v for k, v in states(db).items() if k in wanted}


def _ids(rows: list[dict[str, object]]) -> list[str]:
    return sorted(str(r["correlation_id"]) for r in rows)


def test_a_correlation_id_is_found_by_its_start_or_a_part(db: Engine, intake: Intake) -> None:
    for cid in ("seed-1", "seed-12", "seed-2", "weed-1", "a%b_c", "axbyc"):
        intake.submit(message(0, correlation_id=cid))

    def found(cid: str, how: str) -> list[str]:
        rows = operations.list_messages(db, correlation_id=cid, correlation_match=how)
        return _ids(rows)

    assert found("seed-", "exact") == []
    assert found("seed-", "prefix") == ["seed-1", "seed-12", "seed-2"]
    assert found("seed-1", "prefix") == ["seed-1", "seed-12"]
    assert found("eed-1", "contains") == ["seed-1", "seed-12", "weed-1"]
    # LIKE's wildcards in what was typed are plain characters
    assert found("a%b_", "prefix") == ["a%b_c"]
    assert found("%", "contains") == ["a%b_c"]
    counts = operations.count_by_state(
        db, operations.message_filter(correlation_id="seed-", correlation_match="prefix")
    )
    assert counts[MessageState.NEW] == 3
    with pytest.raises(InvalidMessage) as refused:
        operations.message_filter(correlation_id="x", correlation_match="fuzzy")
    assert refused.value.field == "correlation_match"


def test_the_prefix_search_uses_its_index(db: Engine) -> None:
    with db.connect() as conn:
        conn.execute(text("SET enable_seqscan = off"))
        plan = "\n".join(
            conn.execute(
                text("EXPLAIN SELECT msg_id FROM message WHERE correlation_id LIKE 'seed-%'")
            ).scalars()
        )
    assert "ix_message_correlation_pattern" in plan, plan


def test_the_list_route_takes_the_match(client: TestClient, intake: Intake) -> None:
    for cid in ("seed-1", "seed-2", "other"):
        intake.submit(message(0, correlation_id=cid))
    answer = client.get(
        "/messages", params={"correlation_id": "seed-", "correlation_match": "prefix"}
    )
    assert answer.status_code == 200, answer.text
    assert _ids(answer.json()) == ["seed-1", "seed-2"]
    refused = client.get(
        "/messages", params={"correlation_id": "s", "correlation_match": "sort of"}
    )
    assert refused.status_code == 422
    assert refused.json()["errors"][0]["field"] == "correlation_match"


def _fail(db: Engine, msg_ids: list[int]) -> None:
    with db.begin() as conn:
        conn.execute(
            text("UPDATE message SET state = 'FAILED', failed_count = 3 WHERE msg_id = ANY(:ids)"),
            {"ids": msg_ids},
        )


def test_every_failed_message_of_a_filter_is_redriven_once_its_count_is_confirmed(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    failed = [intake.submit(message(n)).msg_id for n in range(5)]
    other = intake.submit(message(9, source_system="erp")).msg_id
    _fail(db, [*failed, other])
    found = operations.message_filter(state="FAILED", source_system="crm")
    assert bulk.actions_for(found) == [bulk.Action.REDRIVE]
    assert bulk.matching(db, found, bulk.Action.REDRIVE, None) == failed
    queue.clear()

    # what was seen is not what matches now: nothing is done
    with pytest.raises(InvalidMessage) as refused:
        bulk.run(db, found, bulk.Action.REDRIVE, failed[:4], {"note": "fixed"}, queue.append)
    assert refused.value.field == "expected" and "5 messages match now" in refused.value.problem
    swapped = [*failed[:4], other]  # as many, but another one among them
    with pytest.raises(InvalidMessage) as refused:
        bulk.run(db, found, bulk.Action.REDRIVE, swapped, {"note": "fixed"}, queue.append)
    assert "not the 5 confirmed (others)" in refused.value.problem
    assert set(_states(db, failed).values()) == {"FAILED"} and queue == []
    # no note: refused before the first
    with pytest.raises(InvalidMessage):
        bulk.run(db, found, bulk.Action.REDRIVE, failed, {}, queue.append)
    assert set(_states(db, failed).values()) == {"FAILED"}

    done = bulk.run(
        db, found, bulk.Action.REDRIVE, failed, {"note": "ledger fixed"}, queue.append, key="ops"
    )
    assert done.done == failed and done.refused == {}
    assert _states(db, failed) == dict.fromkeys(failed, "IN_QUEUE")
    assert _states(db, other) == {other: "FAILED"}  # not of the filter
    assert sorted(queue) == failed
    for msg_id in failed:
        entries = row(db, msg_id).audit
        assert [(e["action"], e["by"], e["note"]) for e in entries] == [
            ("REDRIVE", "key:ops", "ledger fixed")
        ]


def test_every_waiting_message_of_a_filter_is_cancelled_and_a_filter_needs_its_state(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    ids = [intake.submit(message(n)).msg_id for n in range(3)]
    with pytest.raises(InvalidMessage) as refused:
        bulk.matching(db, operations.message_filter(), bulk.Action.CANCEL, None)
    assert refused.value.field == "state"
    with pytest.raises(InvalidMessage):  # FAILED ones are not cancelled
        bulk.matching(db, operations.message_filter(state="FAILED"), bulk.Action.CANCEL, None)
    found = operations.message_filter(state="NEW")
    done = bulk.run(db, found, bulk.Action.CANCEL, ids, {"note": "wrong batch"}, queue.append)
    assert done.done == ids
    assert _states(db, ids) == dict.fromkeys(ids, "CANCEL")
    assert all(row(db, i).audit[-1]["note"] == "wrong batch" for i in ids)


def test_a_bound_key_reaches_only_its_own_messages(db: Engine, intake: Intake) -> None:
    from orderly.worker.core.owners import Owns

    mine = [intake.submit(message(n, source_system="crm")).msg_id for n in range(2)]
    theirs = intake.submit(message(5, source_system="erp")).msg_id
    _fail(db, [*mine, theirs])
    owns = Owns(source_systems=frozenset({"crm"}))
    found = operations.message_filter(state="FAILED")
    assert bulk.matching(db, found, bulk.Action.REDRIVE, owns) == mine


def test_a_nodes_change_of_state_keeps_who_and_why(db: Engine) -> None:
    code = "node-notes"
    nodes.register_node(db, code)
    nodes.set_state(db, code, NodeState.HANDLES_EXISTING_MESSAGES, by="key:ops", note="deploy")
    seen = next(n for n in nodes.list_nodes(db, 60) if n.code == code)
    assert (seen.state, seen.state_changed_by, seen.state_note) == (
        NodeState.HANDLES_EXISTING_MESSAGES,
        "key:ops",
        "deploy",
    )
    assert seen.state_changed_at is not None
    with pytest.raises(InvalidMessage):
        nodes.set_state(db, code, NodeState.RUN, note="x" * 1001)
    assert next(n for n in nodes.list_nodes(db, 60) if n.code == code).state_note == "deploy"


def test_the_history_counts_each_bucket_and_the_backlog_back_from_now(
    db: Engine, intake: Intake
) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    clock = ManualClock(now.timestamp())

    def at(minutes_ago: float) -> datetime:
        return now - timedelta(minutes=minutes_ago)

    # (arrived, ended, state): two OK a minute after arriving, one FAILED, two still open
    plan = [
        (at(50.5), at(49.5), "OK"),
        (at(50.5), at(49.5), "OK"),
        (at(30.5), at(20.5), "FAILED"),
        (at(10.5), None, "IN_QUEUE"),
        (at(5.5), None, "NEW"),
        (at(120), at(119), "OK"),  # before the hour
    ]
    with db.begin() as conn:
        for n, (arrived, ended, state) in enumerate(plan):
            msg_id = intake.submit(message(n)).msg_id
            conn.execute(
                text(
                    "UPDATE message SET receive_timestamp = :a, state = :s,"
                    " last_process_timestamp = coalesce(:e, :a) WHERE msg_id = :id"
                ),
                {"a": arrived, "e": ended, "s": state, "id": msg_id},
            )
    hour = message_history(db, Window.HOUR, clock)
    assert len(hour.buckets) == 60 and hour.width == timedelta(minutes=1)
    by_start = {round((now - b.start).total_seconds() / 60): b for b in hour.buckets}
    assert by_start[51].arrived == 2 and by_start[50].ok == 2
    assert by_start[31].arrived == 1 and by_start[21].failed == 1
    assert sum(b.ok for b in hour.buckets) == 2  # the one before the hour is not in it
    # the backlog at each bucket's end, counted back from the 2 open now
    assert hour.buckets[-1].backlog == 2
    assert by_start[6].backlog == 2 and by_start[11].backlog == 1 and by_start[12].backlog == 0
    assert by_start[22].backlog == 1 and by_start[21].backlog == 0  # the FAILED one ended
    assert by_start[51].backlog == 2 and by_start[50].backlog == 0 and by_start[52].backlog == 0
    day = message_history(db, Window.DAY, clock)
    assert len(day.buckets) == 96
    assert sum(b.ok for b in day.buckets) == 3 and sum(b.failed for b in day.buckets) == 1
