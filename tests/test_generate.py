"""`python -m tooling generate`: synthetic rows in every table, consistent, repeatable, atomic."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text
from typer.testing import CliRunner

import tooling.generate as generation
import tooling.generate.run as generation_run
from tests.conftest import TABLES as FIXTURE_TABLES
from tooling.cli import app
from tooling.generate import TABLES, GenerateReport, generate

N = 5000
# The window ends on a Wednesday afternoon: busy, so some messages are still on their way.
START = datetime(2026, 2, 25, 16, 0, tzinfo=UTC)
DAYS = 7.0
END = START + timedelta(days=DAYS)


def scalar(db: Engine, sql: str, **params: Any) -> Any:
    with db.connect() as conn:
        return conn.execute(text(sql), params).scalar()


def rows(db: Engine, sql: str, **params: Any) -> list[Any]:
    with db.connect() as conn:
        return list(conn.execute(text(sql), params).all())


def counts(db: Engine) -> dict[str, int]:
    return {table: int(scalar(db, f"SELECT count(*) FROM {table}")) for table in TABLES}


def empty(db: Engine) -> None:
    with db.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(FIXTURE_TABLES)} RESTART IDENTITY CASCADE"))


@pytest.fixture(scope="module")
def generated(pg_engine: Engine) -> Iterator[tuple[Engine, GenerateReport]]:
    """One generated data set for the read-only checks (made once: it takes a moment)."""
    empty(pg_engine)
    report = generate(pg_engine, N, seed=7, start=START, days=DAYS)
    yield pg_engine, report
    empty(pg_engine)


def test_report_matches_the_tables(generated: tuple[Engine, GenerateReport]) -> None:
    db, report = generated
    assert dict(report.rows) == counts(db)
    assert report.rows["message"] == N
    assert report.rows["node"] == 5
    assert report.rows["event"] == N // 10
    for table in ("external_call", "request", "response", "delivery", "published_messages"):
        assert N // 20 < report.rows[table] < 2 * N, table
    assert report.rows["queue_message"] > 0
    assert report.total_rows == sum(report.rows.values())
    assert report.seconds > 0 and report.rows_per_second > 0
    assert (report.start, report.end) == (START, END)
    first, last = rows(db, "SELECT min(receive_timestamp), max(receive_timestamp) FROM message")[0]
    assert first >= START and last < END


def test_messages_are_plausible(generated: tuple[Engine, GenerateReport]) -> None:
    db, _ = generated
    states = dict(rows(db, "SELECT state, count(*) FROM message GROUP BY state"))
    assert states["OK"] > 0.75 * N
    for state in ("FAILED", "PARTLY_FAILED", "CANCEL", "POSTPONED", "WAITING", "IN_QUEUE"):
        assert states.get(state, 0) > 0, state
    assert scalar(db, "SELECT count(*) FROM message WHERE state = 'FAILED'") == scalar(
        db, "SELECT count(*) FROM message WHERE state = 'FAILED' AND failed_error_code <> ''"
    )
    assert not scalar(
        db,
        "SELECT count(*) FROM message WHERE state = 'PARTLY_FAILED'"
        " AND (failed_count = 0 OR failed_error_code IS NULL)",
    )
    # final states were reached after the message arrived; nothing happened before it was sent
    assert not scalar(
        db,
        "SELECT count(*) FROM message WHERE state IN ('OK', 'FAILED', 'CANCEL')"
        " AND (last_process_timestamp IS NULL OR last_process_timestamp < receive_timestamp)",
    )
    assert not scalar(db, "SELECT count(*) FROM message WHERE msg_timestamp > receive_timestamp")
    failed_counts = dict(rows(db, "SELECT failed_count, count(*) FROM message GROUP BY 1"))
    assert failed_counts[0] > 0.8 * N and max(failed_counts) in (3, 4)
    codes = {code for (code,) in rows(db, "SELECT DISTINCT failed_error_code FROM message")}
    assert {"E_POSTPONED_TOO_LONG", "E_CANCELLED", "E_RETRIES_SPENT", "E_HANDLER"} <= codes
    assert len(codes - {None}) >= 8
    assert scalar(db, "SELECT count(DISTINCT source_system) FROM message") >= 6
    assert scalar(db, "SELECT count(DISTINCT service_name) FROM message") >= 6
    assert scalar(db, "SELECT count(*) FROM message WHERE funnel_value IS NOT NULL") > N // 20
    assert scalar(db, "SELECT count(*) FROM message WHERE guaranteed_order") > 0
    assert not scalar(
        db, "SELECT count(*) FROM message WHERE exclude_failed_state AND NOT guaranteed_order"
    )
    # every message on a generated node, the nodes' shares uneven
    shares = [
        n
        for (n,) in rows(
            db,
            "SELECT count(*) FROM message m JOIN node n USING (node_id)"
            " WHERE n.code LIKE 'gen-worker-%' GROUP BY n.code ORDER BY 1",
        )
    ]
    assert sum(shares) == N and len(shares) == 5 and shares[-1] > 2 * shares[0]
    # the guaranteed-order failures name an earlier FAILED message of their funnel
    for desc, funnel, msg_id in rows(
        db,
        "SELECT failed_desc, funnel_value, msg_id FROM message"
        " WHERE failed_error_code = 'E_POSTPONED_TOO_LONG'",
    ):
        blocker = int(desc.split("FAILED message ")[1].split(" ")[0])
        assert blocker < msg_id and f"of funnel {funnel}" in desc
        held_by = rows(db, "SELECT state, funnel_value FROM message WHERE msg_id = :m", m=blocker)
        assert held_by == [("FAILED", funnel)]


def test_children_and_conversations_point_at_their_parents(
    generated: tuple[Engine, GenerateReport],
) -> None:
    db, _ = generated
    assert not scalar(
        db,
        "SELECT count(*) FROM message c LEFT JOIN message p ON p.msg_id = c.parent_msg_id"
        " WHERE c.parent_msg_id IS NOT NULL"
        " AND (p.msg_id IS NULL OR p.msg_id >= c.msg_id OR c.parent_binding_type IS NULL)",
    )
    # business parents: WAITING while a HARD child runs, FAILED with a failed child's error
    assert scalar(
        db,
        "SELECT count(*) FROM message c JOIN message p ON p.msg_id = c.parent_msg_id"
        " WHERE c.service_name <> 'conversation' AND c.correlation_id = p.correlation_id || '/1'",
    )
    assert not scalar(
        db,
        "SELECT count(*) FROM message p WHERE p.state = 'WAITING' AND NOT EXISTS"
        " (SELECT 1 FROM message c WHERE c.parent_msg_id = p.msg_id"
        " AND c.parent_binding_type = 'HARD' AND c.state NOT IN ('OK', 'FAILED', 'CANCEL'))",
    )
    assert not scalar(
        db,
        "SELECT count(*) FROM message p WHERE p.service_name <> 'conversation'"
        " AND p.state = 'OK' AND EXISTS (SELECT 1 FROM message c WHERE c.parent_msg_id ="
        " p.msg_id AND c.parent_binding_type = 'HARD' AND c.state <> 'OK')",
    )
    # conversations: responses under a request of the same conversation, HARD
    conversation = dict(
        rows(
            db,
            "SELECT operation_name, count(*) FROM message"
            " WHERE service_name = 'conversation' GROUP BY 1",
        )
    )
    assert 0.04 * N < sum(conversation.values()) < 0.2 * N
    assert conversation["response"] >= conversation["request"]
    assert not scalar(
        db,
        "SELECT count(*) FROM message r LEFT JOIN message q ON q.msg_id = r.parent_msg_id"
        " WHERE r.service_name = 'conversation' AND r.operation_name = 'response'"
        " AND (q.operation_name IS DISTINCT FROM 'request' OR q.process_id <> r.process_id"
        " OR q.source_system <> 'bridge.request' OR r.source_system <> 'bridge.response'"
        " OR r.object_id <> q.correlation_id OR r.parent_binding_type <> 'HARD')",
    )
    per_conversation = [
        n
        for (n,) in rows(
            db,
            "SELECT count(*) FROM message WHERE operation_name = 'request'"
            " AND service_name = 'conversation' GROUP BY process_id",
        )
    ]
    assert max(per_conversation) <= 5 and min(per_conversation) >= 1
    # delivered responses leave in order: a later response of a conversation is delivered later
    assert not scalar(
        db,
        "SELECT count(*) FROM (SELECT last_process_timestamp AS t, lag(last_process_timestamp)"
        " OVER (PARTITION BY process_id ORDER BY msg_id) AS before FROM message"
        " WHERE operation_name = 'response' AND service_name = 'conversation'"
        " AND state = 'OK') d WHERE d.t < d.before",
    )
    # a cancelled group: the request and its undelivered responses, with orderly's code
    assert scalar(
        db,
        "SELECT count(*) FROM message WHERE service_name = 'conversation' AND state = 'CANCEL'"
        " AND operation_name = 'request'",
    )
    assert not scalar(
        db,
        "SELECT count(*) FROM message WHERE service_name = 'conversation' AND state = 'CANCEL'"
        " AND failed_error_code <> 'E_CANCELLED'",
    )
    assert scalar(
        db,
        "SELECT count(*) FROM message WHERE operation_name = 'response'"
        " AND failed_error_code = 'E_RETRIES_SPENT' AND failed_count > 0",
    )


def test_calls_and_exchanges(generated: tuple[Engine, GenerateReport]) -> None:
    db, _ = generated
    calls = dict(rows(db, "SELECT state, count(*) FROM external_call GROUP BY 1"))
    assert {"OK", "FAILED", "FAILED_END"} <= set(calls)
    # confirmations as the state trigger records them: entity = msg_id, for final messages
    confirmations = "SELECT count(*) FROM external_call WHERE operation_name = :op"
    assert scalar(db, confirmations, op="orderly.confirmation") > N // 20
    assert not scalar(
        db,
        "SELECT count(*) FROM external_call c JOIN message m USING (msg_id)"
        " WHERE c.operation_name = 'orderly.confirmation'"
        " AND (c.entity_id <> m.msg_id::text OR m.state NOT IN ('OK', 'FAILED', 'CANCEL')"
        " OR c.creation_timestamp < m.last_process_timestamp)",
    )
    assert not scalar(
        db,
        "SELECT count(*) FROM external_call"
        " WHERE last_update_timestamp < creation_timestamp"
        " OR (state = 'FAILED_END' AND failed_count = 0)",
    )
    # every response answers a request of the same message
    assert not scalar(
        db,
        "SELECT count(*) FROM response s LEFT JOIN request q USING (req_id)"
        " WHERE q.req_id IS NULL OR q.msg_id <> s.msg_id OR s.res_timestamp < q.req_timestamp"
        " OR s.failed <> (s.failed_reason IS NOT NULL)",
    )
    # a response that ended a wait is the one the message names
    assert not scalar(
        db,
        "SELECT count(*) FROM message m LEFT JOIN response s ON s.res_id = m.wait_res_id"
        " WHERE m.wait_res_id IS NOT NULL AND (s.msg_id IS DISTINCT FROM m.msg_id)",
    )


def test_deliveries_and_their_attempts(generated: tuple[Engine, GenerateReport]) -> None:
    db, _ = generated
    states = dict(rows(db, "SELECT state, count(*) FROM delivery GROUP BY 1"))
    assert states["DELIVERED"] > 0.8 * sum(states.values())
    assert {"DEAD", "EXPIRED"} <= set(states)
    assert not scalar(
        db,
        "SELECT count(*) FROM delivery d LEFT JOIN event e USING (event_id)"
        " LEFT JOIN subscription s USING (subscription_id)"
        " WHERE e.event_id IS NULL OR s.subscription_id IS NULL OR s.room_id <> e.room_id"
        " OR d.pull <> (s.kind = 'PULL')",
    )
    # published_messages: attempts 0..m-1 of the delivery, every one but the last FAILED,
    # the last one saying how the delivery ended
    for state, attempt, outcomes in rows(
        db,
        "SELECT d.state, d.attempt, coalesce(array_agg(p.outcome ORDER BY p.attempt)"
        " FILTER (WHERE p.id IS NOT NULL), '{}')"
        " FROM delivery d LEFT JOIN published_messages p USING (delivery_id)"
        " GROUP BY d.delivery_id, d.state, d.attempt",
    ):
        made = len(outcomes)
        assert all(o == "FAILED" for o in outcomes[:-1]), (state, outcomes)
        last = outcomes[-1] if outcomes else None
        if state == "DELIVERED":
            assert last == "DELIVERED" and attempt == made - 1
        elif state == "DEAD":
            assert last == "DEAD" and attempt == made
        elif state == "EXPIRED":
            assert last == "EXPIRED" and attempt in (made - 1, made)
        else:
            assert last in (None, "FAILED") and attempt == made, (state, attempt, outcomes)
    assert not scalar(
        db,
        "SELECT count(*) FROM published_messages p JOIN delivery d USING (delivery_id)"
        " JOIN event e ON e.event_id = p.event_id"
        " WHERE p.event_id <> d.event_id OR p.subscription_id <> d.subscription_id"
        " OR p.correlation_id <> e.correlation_id OR p.published_at < e.deliver_at"
        " OR (p.outcome = 'DELIVERED') <> (p.delivered_at IS NOT NULL)",
    )
    assert not scalar(
        db,
        "SELECT count(*) FROM (SELECT delivery_id, count(*) n, count(DISTINCT attempt) a,"
        " max(attempt) m FROM published_messages GROUP BY 1) x WHERE n <> a OR m <> n - 1",
    )
    # the queue log: one row per handler run, Completed exactly for the delivered one
    assert not scalar(
        db,
        "SELECT count(*) FROM queue_message q JOIN delivery d USING (delivery_id)"
        " JOIN subscription s USING (subscription_id)"
        " WHERE s.kind <> 'HANDLER' OR q.end_time < q.start_time"
        " OR (q.state = 'Completed' AND d.state <> 'DELIVERED')"
        " OR q.state NOT IN ('Completed', 'Error') OR q.exception_id IS NOT NULL",
    )
    assert scalar(
        db,
        "SELECT count(*) FROM queue_message WHERE state = 'Completed'",
    ) == scalar(
        db,
        "SELECT count(*) FROM delivery d JOIN subscription s USING (subscription_id)"
        " WHERE s.kind = 'HANDLER' AND d.state = 'DELIVERED'",
    )


def fingerprint(db: Engine) -> dict[str, str]:
    """A digest of every generated table's rows (in key order)."""
    keys = {"node": "node_id", **generation._KEYED}
    return {
        table: str(
            scalar(db, f"SELECT md5(string_agg(t::text, '|' ORDER BY {key})) FROM {table} t")
        )
        for table, key in keys.items()
        if table != "node"
    }


def test_same_seed_same_data(db: Engine) -> None:
    generate(db, 2000, seed=11, start=START, days=2)
    first = fingerprint(db)
    empty(db)
    generate(db, 2000, seed=11, start=START, days=2)
    assert fingerprint(db) == first
    empty(db)
    generate(db, 2000, seed=12, start=START, days=2)
    other = fingerprint(db)
    assert other["message"] != first["message"] and other["event"] != first["event"]


def test_runs_add_up_and_sequences_move_on(db: Engine) -> None:
    one = generate(db, 1500, seed=1, start=START, days=1)
    two = generate(db, 1500, seed=1, start=START, days=1)  # the same keys meet again
    assert two.rows["node"] == 0 and two.rows["room"] == 0
    assert scalar(db, "SELECT count(*) FROM message") == 3000
    assert scalar(db, "SELECT count(*) FROM event") == one.rows["event"] + two.rows["event"]
    assert scalar(db, "SELECT count(*) FROM external_call") == (
        one.rows["external_call"] + two.rows["external_call"]
    )
    for table, column in generation._KEYED.items():
        assert scalar(
            db,
            f"SELECT nextval(pg_get_serial_sequence('{table}', '{column}'))"
            f" > (SELECT max({column}) FROM {table})",
        ), table
    with db.begin() as conn:
        node = conn.execute(text("SELECT min(node_id) FROM node")).scalar()
        new = conn.execute(
            text(
                "INSERT INTO message (msg_timestamp, receive_timestamp, service_name,"
                " operation_name, correlation_id, payload, envelope, source_system, state,"
                " node_id) VALUES (now(), now(), 'crm', 'createCustomer', 'after-generate',"
                " '{}', '{}', 'eshop', 'NEW', :node) RETURNING msg_id"
            ),
            {"node": node},
        ).scalar_one()
    assert new > 3000


def test_bad_input_writes_nothing(db: Engine) -> None:
    for messages, days, needle in (
        (0, 7.0, "positive integer"),
        (-5, 7.0, "positive integer"),
        (True, 7.0, "positive integer"),
        (10, 0.0, "days must be above 0"),
        (10, -1.0, "days must be above 0"),
        (10, float("nan"), "days must be above 0"),
        (10, 1e-9, "at least a minute"),
    ):
        with pytest.raises(ValueError, match=needle):
            generate(db, messages, days=days)
    assert sum(counts(db).values()) == 0


def test_a_failure_leaves_nothing(db: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Any) -> Iterator[Any]:
        yield from ()
        raise RuntimeError("generator broke")

    monkeypatch.setattr(generation._Generator, "pubsub_batches", broken)
    with pytest.raises(RuntimeError, match="generator broke"):
        generate(db, 3000, start=START, days=1)
    assert sum(counts(db).values()) == 0


def test_with_foreign_key_triggers(db: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the rights to skip them, the per-row checks run: same rows, just slower."""
    monkeypatch.setattr(generation_run, "_skip_row_triggers", lambda conn: False)
    report = generate(db, 2000, seed=11, start=START, days=2)
    assert dict(report.rows) == counts(db)
    slow = fingerprint(db)
    empty(db)
    monkeypatch.undo()
    generate(db, 2000, seed=11, start=START, days=2)
    assert fingerprint(db) == slow


def test_cli(db: Engine) -> None:
    runner = CliRunner()
    done = runner.invoke(
        app,
        ["generate", "300", "--seed", "3", "--days", "1", "--start", "2026-02-25T00:00:00Z"],
        env={"COLUMNS": "200"},
    )
    assert done.exit_code == 0, done.output
    assert "message" in done.output and "300" in done.output and "rows/s" in done.output
    assert scalar(db, "SELECT count(*) FROM message") == 300
    for args, needle in (
        (["generate", "0"], "positive integer"),
        (["generate", "--", "-3"], "positive integer"),
        (["generate", "10", "--days", "0"], "days must be above 0"),
        (["generate", "10", "--start", "yesterday"], "not an ISO 8601 timestamp"),
        (["generate", "many"], "Invalid value"),
    ):
        bad = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert bad.exit_code == 2, (args, bad.output)
        assert needle in bad.output, (args, bad.output)
    assert scalar(db, "SELECT count(*) FROM message") == 300
