"""``orderly purge --before``: what goes, what stays and why, the archive, and the workers
going on while a large purge runs (worker/purge.py)."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

from orderly.worker import purge as mechanism
from orderly.worker.conversations import rebuild as conversations_rebuild
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.db.queries import sql
from orderly.worker.purge import Archive, purge, read_archive
from tests.helpers import OrderlyCli, message, wait_until
from tests.stack import Stack

NOW = datetime.now(UTC).replace(microsecond=0)
OLD = NOW - timedelta(days=30)
BEFORE = NOW - timedelta(days=7)
RECENT = NOW - timedelta(days=1)
KEYS = {"message": "msg_id", "external_call": "call_id", "request": "req_id", "response": "res_id"}
_serial = itertools.count()


@pytest.fixture
def node(db: Engine) -> int:
    with db.begin() as conn:
        return int(
            conn.execute(
                text(
                    "INSERT INTO node (code, name, state) VALUES ('purge', 'purge', 'RUN') "
                    "RETURNING node_id"
                )
            ).scalar_one()
        )


def put(db: Engine, node: int, state: str = "OK", at: datetime = OLD, **cols: Any) -> int:
    """A message row: finished (last_process_timestamp) at ``at``, sent a minute before."""
    n = next(_serial)
    row: dict[str, Any] = {
        "msg_timestamp": at - timedelta(minutes=1),
        "receive_timestamp": at - timedelta(minutes=1),
        "last_process_timestamp": at,
        "service_name": "test",
        "operation_name": "script",
        "correlation_id": f"purge-{n}",
        "source_system": "crm",
        "payload": "{}",
        "envelope": "{}",
        "state": state,
        "node_id": node,
        **cols,
    }
    names = ", ".join(row)
    values = ", ".join(f":{k}" for k in row)
    with db.begin() as conn:
        found = conn.execute(
            text(f"INSERT INTO message ({names}) VALUES ({values}) RETURNING msg_id"), row
        )
        return int(found.scalar_one())


def call(db: Engine, msg_id: int, entity_id: str, *, state: str = "OK", **cols: Any) -> int:
    row: dict[str, Any] = {
        "msg_id": msg_id,
        "operation_name": "erp.sync",
        "entity_id": entity_id,
        "state": state,
        "msg_timestamp": OLD,
        "creation_timestamp": OLD,
        "last_update_timestamp": OLD,
        **cols,
    }
    names, values = ", ".join(row), ", ".join(f":{k}" for k in row)
    with db.begin() as conn:
        return int(
            conn.execute(
                text(f"INSERT INTO external_call ({names}) VALUES ({values}) RETURNING call_id"),
                row,
            ).scalar_one()
        )


def exchange(db: Engine, msg_id: int, uri: str = "http://erp/x", join: str | None = None) -> int:
    """A request of the message and its response; the request's id."""
    with db.begin() as conn:
        req = conn.execute(
            text(
                "INSERT INTO request (msg_id, res_join_id, uri, req_envelope, req_timestamp) "
                "VALUES (:m, :j, :u, '{}', :t) RETURNING req_id"
            ),
            {"m": msg_id, "j": join or f"j-{next(_serial)}", "u": uri, "t": OLD},
        ).scalar_one()
        conn.execute(
            text(
                "INSERT INTO response (req_id, msg_id, res_envelope, res_timestamp) "
                "VALUES (:r, :m, '{}', :t)"
            ),
            {"r": req, "m": msg_id, "t": OLD},
        )
    return int(req)


def ids(db: Engine, table: str = "message") -> set[int]:
    with db.connect() as conn:
        return {int(v) for v in conn.execute(text(f"SELECT {KEYS[table]} FROM {table}")).scalars()}


def snapshot(db: Engine) -> dict[str, dict[int, Any]]:
    """Every row of the four tables as PostgreSQL renders it (row_to_json), by key."""
    found: dict[str, dict[int, Any]] = {}
    with db.connect() as conn:
        for table, key in KEYS.items():
            rows = conn.execute(text(f"SELECT {key}, row_to_json(t)::text FROM {table} t"))
            found[table] = {int(k): json.loads(v) for k, v in rows}
    return found


def run(db: Engine, **options: Any) -> mechanism.PurgeReport:
    return purge(db, BEFORE, **options)


# --- what goes ------------------------------------------------------------------------------


def test_only_final_messages_finished_before_the_time_go_with_their_rows(
    db: Engine, node: int
) -> None:
    ok, failed, cancel = put(db, node), put(db, node, "FAILED"), put(db, node, "CANCEL")
    later = put(db, node, at=RECENT)
    open_ = [put(db, node, s) for s in ("PARTLY_FAILED", "NEW", "WAITING", "POSTPONED")]
    call(db, ok, f"msg:crm:{ok}")
    call(db, later, f"msg:crm:{later}")
    gone_req = exchange(db, ok)
    kept_req = exchange(db, open_[0])
    report = run(db)
    assert ids(db) == {later, *open_}
    assert report.rows == {"response": 1, "request": 1, "external_call": 1, "message": 3}
    assert report.families == 3 and report.kept == {} and report.busy == 0
    assert ids(db, "request") == {kept_req} and gone_req not in ids(db, "request")
    assert len(ids(db, "external_call")) == 1 and len(ids(db, "response")) == 1
    assert {failed, cancel}.isdisjoint(ids(db))
    again = run(db)  # nothing left to do
    assert again.total == 0


def test_a_family_goes_whole_or_stays_whole(db: Engine, node: int) -> None:
    done = put(db, node)
    child = put(db, node, parent_msg_id=done, parent_binding_type="HARD")
    grandchild = put(db, node, "CANCEL", parent_msg_id=child, parent_binding_type="SOFT")
    late = put(db, node)
    put(db, node, at=RECENT, parent_msg_id=late, parent_binding_type="HARD")
    failing = put(db, node, "FAILED")
    put(db, node, "PARTLY_FAILED", parent_msg_id=failing, parent_binding_type="SOFT")
    waiting = put(db, node, "WAITING")
    put(db, node, parent_msg_id=waiting, parent_binding_type="HARD")
    before = ids(db)
    report = run(db)
    assert ids(db) == before - {done, child, grandchild}
    assert report.families == 1 and report.rows["message"] == 3
    assert report.kept == {"recent": 1, "open": 1}  # a WAITING parent is no candidate at all
    with db.connect() as conn:  # no child points at a message that is gone
        orphans = conn.execute(
            text(
                "SELECT count(*) FROM message c WHERE c.parent_msg_id IS NOT NULL AND NOT "
                "EXISTS (SELECT 1 FROM message p WHERE p.msg_id = c.parent_msg_id)"
            )
        ).scalar()
    assert orphans == 0


def _funnel_decisions(conn: Connection) -> dict[Any, bool]:
    """What orderly_funnel_blocked answers for every open funnel message, and for a new
    message of each funnel and flavour (msg_id NULL)."""
    rows = conn.execute(
        text(
            "SELECT msg_id, orderly_funnel_blocked(msg_id, funnel_value, funnel_component_id, "
            "msg_timestamp, guaranteed_order, exclude_failed_state) FROM message "
            "WHERE funnel_value IS NOT NULL AND state NOT IN ('OK', 'FAILED', 'CANCEL')"
        )
    ).all()
    found: dict[Any, bool] = {int(r[0]): bool(r[1]) for r in rows}
    for funnel in ("g", "h", "p"):
        for guaranteed, exclude in ((True, False), (True, True), (False, False)):
            found[(funnel, guaranteed, exclude)] = bool(
                conn.execute(
                    text("SELECT orderly_funnel_blocked(NULL, :f, NULL, now(), :g, :x)"),
                    {"f": funnel, "g": guaranteed, "x": exclude},
                ).scalar()
            )
    return found


def test_funnels_decide_the_same_for_the_messages_that_stay(db: Engine, node: int) -> None:
    g: dict[str, Any] = {"funnel_value": "g", "guaranteed_order": True}
    put(db, node, **g)
    held_back_by = put(db, node, "FAILED", at=OLD + timedelta(minutes=1), **g)
    put(db, node, "CANCEL", at=OLD + timedelta(minutes=2), **g)
    waiting = put(db, node, "POSTPONED", at=OLD + timedelta(minutes=3), **g)
    h: dict[str, Any] = {"funnel_value": "h", "guaranteed_order": True}
    put(db, node, "FAILED", **h)
    free = put(db, node, "NEW", exclude_failed_state=True, **h)
    put(db, node, "FAILED", funnel_value="p")
    put(db, node, funnel_value="p")
    busy = put(db, node, "PROCESSING", at=NOW, funnel_value="p")
    with db.connect() as conn:
        decided = _funnel_decisions(conn)
    assert decided[waiting] is True and decided[free] is False and decided[busy] is False
    report = run(db)
    with db.connect() as conn:
        assert _funnel_decisions(conn) == decided
        states = {
            r.msg_id: r.state for r in conn.execute(text("SELECT msg_id, state FROM message"))
        }
    # The FAILED ones of guaranteed-order funnels stay (they hold their funnels back); the
    # rest of the funnels' final messages went.
    assert report.kept == {"funnel": 2} and report.rows["message"] == 4
    assert held_back_by in states and sorted(states.values()) == sorted(
        ["FAILED", "POSTPONED", "FAILED", "NEW", "PROCESSING"]
    )


def _obsolete_by(conn: Connection, msg_id: int) -> Any:
    """The claim's answer (orderly_claim_ids): the newest OK message of the same object,
    newer than this one."""
    return conn.execute(
        text(
            "SELECT (SELECT o.msg_id FROM message o WHERE o.object_id = m.object_id "
            "AND o.entity_type IS NOT DISTINCT FROM m.entity_type AND o.state = 'OK' "
            "AND o.msg_timestamp > m.msg_timestamp ORDER BY o.msg_timestamp DESC, o.msg_id "
            "DESC LIMIT 1) FROM message m WHERE m.msg_id = :id"
        ),
        {"id": msg_id},
    ).scalar()


def test_an_ok_message_that_makes_an_open_one_obsolete_stays(db: Engine, node: int) -> None:
    obj = {"object_id": "order-1", "entity_type": "order"}
    older = put(db, node, at=OLD - timedelta(hours=1), **obj)
    pending = put(db, node, "NEW", at=OLD, **obj)
    newer = put(db, node, at=OLD + timedelta(hours=1), **obj)
    other = put(db, node, object_id="order-2", entity_type="order")
    with db.connect() as conn:
        assert _obsolete_by(conn, pending) == newer
    report = run(db)
    with db.connect() as conn:
        assert _obsolete_by(conn, pending) == newer
    assert ids(db) == {pending, newer} and {older, other}.isdisjoint(ids(db))
    assert report.kept == {"object": 1}


def test_external_calls_another_message_is_judged_against_stay(db: Engine, node: int) -> None:
    open_ = put(db, node, "PARTLY_FAILED", at=OLD - timedelta(hours=2))
    entity = put(db, node)
    call(db, entity, "entity:customer:7", msg_timestamp=OLD)
    own = put(db, node)
    call(db, own, f"msg:crm:{own}", msg_timestamp=OLD)
    confirming = put(db, node)
    call(
        db,
        confirming,
        str(confirming),
        state="FAILED",
        operation_name="orderly.confirmation",
        next_attempt_at=NOW,
    )
    older_call = put(db, node)
    call(db, older_call, "entity:customer:8", msg_timestamp=OLD - timedelta(hours=3))
    report = run(db)
    assert ids(db) == {open_, entity, confirming}
    assert report.kept == {"call": 2}
    with db.begin() as conn:  # the open message ends: nothing is judged against the call now
        conn.execute(text("UPDATE message SET state = 'FAILED' WHERE msg_id = :id"), {"id": open_})
    run(db)
    assert ids(db) == {confirming}


def test_a_request_another_message_answered_through_loses_only_its_msg_id(
    db: Engine, node: int
) -> None:
    gone, stays = put(db, node), put(db, node, "WAITING_FOR_RES")
    req = exchange(db, gone, uri="http://erp/shared", join="j-shared")
    with db.begin() as conn:  # the other message's response to the same (uri, res_join_id)
        conn.execute(
            text(
                "INSERT INTO response (req_id, msg_id, res_envelope, res_timestamp) "
                "VALUES (:r, :m, '{}', now())"
            ),
            {"r": req, "m": stays},
        )
    report = run(db)
    assert report.detached_requests == 1 and report.rows["request"] == 0
    with db.connect() as conn:
        row = conn.execute(text("SELECT msg_id FROM request WHERE req_id = :r"), {"r": req})
        assert row.scalar() is None
        answered = conn.execute(text("SELECT msg_id FROM response")).scalars().all()
    assert list(answered) == [stays]


def _conversation(db: Engine, node: int, cid: str, request_state: str, *responses: str) -> int:
    conv: dict[str, Any] = {"service_name": "conversation", "process_id": cid, "entity_type": "web"}
    req = put(
        db,
        node,
        request_state,
        operation_name="request",
        source_system="bridge.request",
        correlation_id=f"{cid}-req-{next(_serial)}",
        **conv,
    )
    for state in responses:
        put(
            db,
            node,
            state,
            operation_name="response",
            source_system="bridge.response",
            parent_msg_id=req,
            parent_binding_type="HARD",
            response_last=False,
            **conv,
        )
    return req


def _rebuild_rows(db: Engine) -> list[dict[str, Any]]:
    """What a rebuild of Redis would read (worker/conversations/rebuild.py), but the ages."""
    rows = [row._asdict() for row in conversations_rebuild.read_rows(db)]
    return [
        {k: v for k, v in row.items() if not k.endswith(("age_ms", "idle_ms", "now_ms"))}
        for row in rows
    ]


def test_a_live_conversation_keeps_its_order(db: Engine, node: int) -> None:
    closed = _conversation(db, node, "c1", "OK", "OK", "OK")
    live = _conversation(db, node, "c1", "WAITING_FOR_RES", "OK", "IN_QUEUE")
    cancelled = _conversation(db, node, "c2", "CANCEL", "CANCEL")
    rebuilt = _rebuild_rows(db)
    report = run(db)
    assert _rebuild_rows(db) == rebuilt
    with db.connect() as conn:
        left = conn.execute(
            sql("conversation_messages"), {"cid": "c1", "limit": 100, "owned": None}
        ).scalars()
        assert closed not in set(left)
    assert report.families == 2 and report.rows["message"] == 5
    assert {closed, cancelled}.isdisjoint(ids(db)) and live in ids(db)
    assert report.kept == {}  # the live request is no candidate: it is not final


# --- input, dry run, archive, busy rows ---------------------------------------------------------


def test_bad_input_is_refused_before_anything_goes(db: Engine, node: int, tmp_path: Path) -> None:
    put(db, node)
    refusals: dict[str, list[Callable[[], object]]] = {
        "before": [
            lambda: mechanism.parse_before("last tuesday"),
            lambda: mechanism.parse_before((NOW + timedelta(hours=1)).isoformat()),
            lambda: purge(db, NOW + timedelta(days=1)),
            lambda: purge(db, datetime(2020, 1, 1)),
        ],
        "batch_size": [lambda: run(db, batch_size=0), lambda: run(db, batch_size=10_001)],
        "archive": [
            lambda: run(db, dry_run=True, archive=Archive(tmp_path, "x")),
            lambda: Archive(Path(__file__), "x"),
        ],
    }
    for field, attempts in refusals.items():
        for attempt in attempts:
            with pytest.raises(InvalidMessage) as refused:
                attempt()
            assert refused.value.field == field, refused.value
    with pytest.raises(InvalidMessage, match="in the future"):
        mechanism.parse_before((NOW + timedelta(hours=1)).isoformat())
    assert len(ids(db)) == 1 and list(tmp_path.iterdir()) == []


def test_a_dry_run_counts_what_a_run_then_deletes(db: Engine, node: int) -> None:
    parent = put(db, node)
    put(db, node, "FAILED", parent_msg_id=parent, parent_binding_type="HARD")
    for _ in range(5):
        msg = put(db, node)
        call(db, msg, f"msg:crm:{msg}")
        exchange(db, msg)
    put(db, node, "NEW")
    before = snapshot(db)
    counted = run(db, dry_run=True, batch_size=2)
    assert snapshot(db) == before
    done = run(db, batch_size=2)
    assert (
        counted.rows
        == done.rows
        == {
            "response": 5,
            "request": 5,
            "external_call": 5,
            "message": 7,
        }
    )
    assert counted.dry_run and counted.batches == done.batches == 3


def test_the_archive_holds_every_deleted_row_and_reads_back(
    db: Engine, node: int, tmp_path: Path
) -> None:
    parent = put(db, node, audit='[{"action": "CANCEL", "by": "ops"}]', custom_data="x\ny")
    put(db, node, "CANCEL", parent_msg_id=parent, parent_binding_type="HARD", payload='{"a":1}')
    for n in range(30):
        msg = put(db, node, "FAILED" if n % 3 else "OK", failed_desc='bad\t"quote"')
        call(db, msg, f"msg:crm:{msg}")
        exchange(db, msg)
    put(db, node, at=RECENT)
    before = snapshot(db)
    report = run(db, batch_size=7, archive=Archive(tmp_path / "arch", "t1"))
    after = snapshot(db)
    assert report.batches == 5 and len(report.archive) == 4
    for table, rows in before.items():
        archived = [
            json.loads(line) for line in read_archive(tmp_path / f"arch/{table}-t1.jsonl.gz")
        ]
        gone = {k: v for k, v in rows.items() if k not in after[table]}
        assert {row[KEYS[table]]: row for row in archived} == gone
        assert len(archived) == len(gone) == report.rows[table]
    with db.begin() as conn:  # back into the store, as PostgreSQL reads its own JSON
        for table in ("message", "external_call", "request", "response"):
            lines = read_archive(tmp_path / f"arch/{table}-t1.jsonl.gz")
            conn.execute(
                text(
                    f"INSERT INTO {table} SELECT r.* FROM unnest(CAST(:rows AS text[])) AS j, "
                    f"json_populate_record(NULL::{table}, j::json) AS r"
                ),
                {"rows": lines},
            )
    assert snapshot(db) == before


def test_rows_a_worker_holds_are_passed_over_without_waiting(db: Engine, node: int) -> None:
    parent = put(db, node)
    child = put(db, node, parent_msg_id=parent, parent_binding_type="HARD")
    alone = put(db, node)
    with db.connect() as holder, holder.begin():
        holder.execute(text("SELECT 1 FROM message WHERE msg_id = :id FOR UPDATE"), {"id": child})
        found: list[mechanism.PurgeReport] = []
        worker = threading.Thread(target=lambda: found.append(run(db)), daemon=True)
        worker.start()
        worker.join(30)
        assert found, "the purge waited for a row lock"
    assert found[0].busy == 1 and found[0].rows["message"] == 1
    assert ids(db) == {parent, child} and alone not in ids(db)
    assert run(db).rows["message"] == 2


# --- the command ------------------------------------------------------------------------------


def test_the_command_reports_counts_and_refuses_bad_input(
    cli: OrderlyCli, db: Engine, node: int, tmp_path: Path
) -> None:
    for _ in range(3):
        msg = put(db, node)
        exchange(db, msg)
    cutoff = BEFORE.isoformat()
    for args, problem in (
        (["--before", "yesterday-ish"], "before: 'yesterday-ish' is not an ISO 8601"),
        (["--before", (NOW + timedelta(days=2)).isoformat()], "is in the future"),
        (["--before", cutoff, "--batch-size", "0"], "batch_size: must be 1 to 10000"),
        (["--before", cutoff, "--dry-run", "--archive", str(tmp_path)], "a dry run writes no"),
    ):
        refused = cli("purge", *args)
        assert refused.returncode == 2 and problem in refused.stderr, refused.stderr
    assert len(ids(db)) == 3
    counted = cli("purge", "--before", cutoff, "--dry-run", "--json")
    assert counted.returncode == 0, counted.stderr
    assert json.loads(counted.stdout)["rows"]["message"] == 3 and len(ids(db)) == 3
    done = cli("purge", "--before", cutoff, "--archive", str(tmp_path / "a"), "--progress")
    assert done.returncode == 0, done.stderr
    assert "batch 1: 9 rows" in done.stderr
    assert "deleted 9 rows of 3 families" in done.stdout and "rows/s" in done.stdout
    assert ids(db) == set() and len(list((tmp_path / "a").iterdir())) == 3


# --- workers during a large purge -----------------------------------------------------------------


@pytest.fixture
def generated(db: Engine) -> Iterator[int]:
    """Generated history (two weeks, ended a week ago): its final rows are the purge's."""
    from tooling.generate import generate

    report = generate(db, 70_000, seed=3, start=OLD - timedelta(days=14), days=14)
    yield report.rows["message"]


def test_workers_go_on_while_100000_rows_are_purged(
    stack: Stack, db: Engine, generated: int
) -> None:
    stack.start_api()
    stack.worker("w1", concurrency=2)
    sent: list[int] = []
    stop = threading.Event()

    def produce() -> None:
        n = 0
        while not stop.is_set():
            sent.append(stack.submit(message(n, correlation_id=f"live-{n}")))
            n += 1
            time.sleep(0.02)

    def done() -> int:
        with db.connect() as conn:
            return int(
                conn.execute(
                    text("SELECT count(*) FROM message WHERE state = 'OK' AND msg_id = ANY(:ids)"),
                    {"ids": list(sent)},
                ).scalar_one()
            )

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    wait_until(lambda: done() >= 5, 60, "the workers process new messages")
    seen: list[tuple[int, int]] = []  # (rows purged so far, new messages done) after each batch
    report = purge(db, BEFORE, batch_size=200, on_batch=lambda r: seen.append((r.total, done())))
    stop.set()
    producer.join(10)
    print(f"{report.summary()}; new messages done during it: {seen[0][1]} -> {seen[-1][1]}")
    assert report.total >= 100_000, report.summary()
    # Messages were completed between the purge's first batch and its last, not only after.
    first, last = seen[0][1], seen[-2][1]
    assert last > first, seen[:: max(1, len(seen) // 20)]
    assert report.busy == 0 or report.busy < report.families
    wait_until(lambda: done() == len(sent), 60, "every new message processed")
    with db.connect() as conn:
        left = conn.execute(
            text(
                "SELECT count(*) FROM message WHERE state IN ('OK', 'FAILED', 'CANCEL') "
                "AND last_process_timestamp < :b AND parent_msg_id IS NULL"
            ),
            {"b": BEFORE},
        ).scalar_one()
    assert left == sum(report.kept.values()) + report.busy
