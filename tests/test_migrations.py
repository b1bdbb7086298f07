"""`alembic upgrade head` on an empty database equals the models; downgrade to base works; each
migration installs the functions and triggers of its own time (its frozen copy of
functions.sql), and the newest copy is the canonical file."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import Script, ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, inspect, text

from orderly.models import Base
from orderly.worker.db import schema
from orderly.worker.db.queries import FUNCTIONS_FILE
from tests.conftest import PG_ADMIN_URL, TABLES
from tooling.freeze_functions import FreezeError, freeze


@pytest.fixture
def empty_db(pg_engine: Engine) -> Iterator[str]:
    name = f"orderly_mig_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def test_upgrade_matches_models_and_downgrade_empties(empty_db: str) -> None:
    schema.upgrade(empty_db)
    engine = create_engine(empty_db)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
            )
        assert diff == []
        tables = set(inspect(engine).get_table_names())
        assert {
            "message",
            "external_call",
            "request",
            "response",
            "configuration",
            "node",
        } <= tables
        schema.downgrade(empty_db)
        engine.dispose()
        left = set(inspect(engine).get_table_names()) - {"alembic_version"}
        assert left == set()
    finally:
        engine.dispose()


_FUNCTIONS = text(
    """
    SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')' AS name,
           pg_get_functiondef(p.oid) AS definition,
           format('DROP FUNCTION IF EXISTS %s CASCADE', p.oid::regprocedure) AS dropping
      FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
     WHERE n.nspname = 'public' AND p.proname LIKE 'orderly\\_%'
    UNION ALL
    SELECT 'trigger ' || t.tgname, pg_get_triggerdef(t.oid),
           format('DROP TRIGGER %I ON %s', t.tgname, t.tgrelid::regclass)
      FROM pg_trigger t WHERE NOT t.tgisinternal AND t.tgname LIKE 'orderly\\_%'
    """
)


def _installed(conn: Connection) -> dict[str, str]:
    """Every orderly function and trigger of the database, by signature: its definition."""
    return {str(row.name): str(row.definition) for row in conn.execute(_FUNCTIONS)}


def _installed_alone(conn: Connection, functions: Path) -> dict[str, str]:
    """What the SQL file ``functions`` alone installs, in a transaction that is rolled back:
    every orderly function and trigger dropped first (triggers before functions)."""
    conn.commit()
    trans = conn.begin()
    try:
        rows = sorted(conn.execute(_FUNCTIONS), key=lambda row: not row.name.startswith("trigger "))
        for row in rows:
            conn.execute(text(row.dropping))
        cursor = conn.connection.cursor()
        cursor.execute("SET LOCAL check_function_bodies = off")
        cursor.execute(functions.read_text())
        return _installed(conn)
    finally:
        trans.rollback()


def _revisions() -> list[Script]:
    """Every migration, oldest first."""
    script = ScriptDirectory.from_config(schema.alembic_config(""))
    return list(reversed(list(script.walk_revisions())))


def _frozen() -> list[str]:
    """The revisions that have a frozen copy of functions.sql, oldest first."""
    return [
        rev.revision for rev in _revisions() if schema.frozen_functions_file(rev.revision).exists()
    ]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_functions_installed_by_migrations_equal_the_canonical_file(empty_db: str) -> None:
    """What `alembic upgrade head` installs is functions.sql, no more and no less: the file
    alone, installed in a transaction that is rolled back, gives the same definitions."""
    schema.upgrade(empty_db)
    engine = create_engine(empty_db)
    try:
        with engine.connect() as conn:
            installed = _installed(conn)
            from_file = _installed_alone(conn, FUNCTIONS_FILE)
        assert set(from_file) == set(installed)
        for name, definition in from_file.items():
            assert installed[name] == definition, name
        assert {"orderly_finish", "trigger orderly_message_transition"} <= {
            n.split("(")[0] for n in installed
        }
    finally:
        engine.dispose()


def test_each_migration_installs_the_functions_of_its_own_time(empty_db: str) -> None:
    """Upgrading one revision at a time from base, a migration that applies functions installs
    its frozen copy (the text of its time, not today's functions.sql), no more and no less; and
    downgrading one revision at a time gives back at each revision what the upgrade installed
    there."""
    revisions = [rev.revision for rev in _revisions()]
    frozen = set(_frozen())
    assert {"0006", "0015"} <= frozen
    engine = create_engine(empty_db)
    upgraded: dict[str, dict[str, str]] = {}
    try:
        for revision in revisions:
            schema.upgrade(empty_db, revision)
            with engine.connect() as conn:
                upgraded[revision] = _installed(conn)
                if revision in frozen:
                    alone = _installed_alone(conn, schema.frozen_functions_file(revision))
                    assert upgraded[revision] == alone, f"{revision} installs other functions"
        # Today's text at 0006 would bring 0015's orderly_lock_funnels_of along.
        assert not any(n.startswith("orderly_lock_funnels_of") for n in upgraded["0006"])
        assert any(n.startswith("orderly_lock_funnels_of") for n in upgraded["0015"])
        for above, below in reversed(list(zip(revisions[1:], revisions, strict=False))):
            schema.downgrade(empty_db, below)
            with engine.connect() as conn:
                assert _installed(conn) == upgraded[below], f"downgrading {above} to {below}"
    finally:
        engine.dispose()


def test_the_newest_frozen_copy_is_the_canonical_file() -> None:
    """functions.sql is the text the newest functions migration applies: a change to the file
    needs a new migration with its own frozen copy."""
    frozen = _frozen()
    assert frozen, "no migration applies a frozen copy of functions.sql"
    newest = schema.frozen_functions_file(frozen[-1])
    assert newest.read_bytes() == FUNCTIONS_FILE.read_bytes(), (
        f"functions.sql is not {newest.name}: a change to it needs a new migration and "
        "`python -m tooling.freeze_functions <its revision>`"
    )


def test_each_frozen_copy_is_the_text_its_migration_records() -> None:
    """A migration that applies functions applies its own frozen copy and records its sha256
    (a copy edited in place shows in its migration too); none applies today's functions.sql;
    no copy belongs to no migration."""
    revisions = {rev.revision: rev for rev in _revisions()}
    copies = {
        path.name.removesuffix("_functions.sql"): path
        for path in (schema.migrations_dir() / "sql").glob("*.sql")
    }
    assert set(copies) - set(revisions) == set(), "a frozen copy of no migration"
    for revision, rev in revisions.items():
        source = Path(rev.path).read_text()
        assert "apply_functions(" not in source, f"{revision} applies today's functions.sql"
        recorded = getattr(rev.module, "FUNCTIONS_SHA256", None)
        applies = f'apply_frozen(op.execute, "{revision}")' in source
        if revision not in copies:
            assert (recorded, applies) == (None, False), f"{revision} has no frozen copy"
            continue
        assert applies, f"{revision} does not apply {copies[revision].name}"
        assert recorded == _sha256(copies[revision]), f"{revision} records another hash"


def test_the_freeze_tool_copies_the_file_for_a_new_migration_only(tmp_path: Path) -> None:
    """tooling.freeze_functions: a migration with no frozen copy after it gets functions.sql
    byte for byte and its hash; an unknown revision, one with a copy after it and one with a
    copy of its own (without replace) are refused, and nothing is written."""
    head = _revisions()[-1].revision
    newest = _frozen()[-1]
    target = tmp_path / "copy.sql"
    for refused, why in (
        ("9999", "no migration"),
        ("0006", "0015 after 0006"),
        (newest, "--replace"),
    ):
        with pytest.raises(FreezeError, match=why):
            freeze(refused, target)
        assert not target.exists()
    if newest != head and schema.frozen_functions_file(newest).read_bytes() == (
        FUNCTIONS_FILE.read_bytes()
    ):
        # functions.sql has not changed since the newest copy: nothing to freeze for the head.
        with pytest.raises(FreezeError, match="nothing new"):
            freeze(head, target)
        assert not target.exists()
        return
    path, digest = freeze(head, target, replace=True)
    assert path == target and target.read_bytes() == FUNCTIONS_FILE.read_bytes()
    assert digest == _sha256(FUNCTIONS_FILE)


def test_0016_gives_open_deliveries_their_pending_attempt_and_clears_old_exception_ids(
    empty_db: str,
) -> None:
    """A delivery open at the upgrade gets its current attempt's PENDING published_messages
    row (as a publish now writes it); a queue log row's old text exception id, which pointed
    at nothing, is cleared for the foreign key."""
    schema.upgrade(empty_db, "0015")
    engine = create_engine(empty_db)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO room (name, delivery_delay_ms, delivery_delay_multiplier,"
                    " delivery_attempts, status, created_at)"
                    " VALUES ('r', 10, 2, 3, 'ACTIVE', now());"
                    "INSERT INTO subscription (room_id, name, kind, timeout_ms,"
                    " visibility_timeout_ms, status, created_at)"
                    " VALUES (1, 's', 'PULL', 10, 100, 'ACTIVE', now());"
                    "INSERT INTO event (correlation_id, room_id, routing_key, payload,"
                    " published_at, deliver_at, unroutable)"
                    " VALUES ('c1', 1, 'k', '{}', now(), now() + interval '1 hour', false),"
                    " ('c2', 1, 'k', '{}', now(), now(), false);"
                    "INSERT INTO delivery (event_id, subscription_id, state, pull, attempt,"
                    " next_attempt_at, scheduled_at, lost_count) VALUES"
                    " (1, 1, 'PENDING', true, 2, now() + interval '1 hour', now(), 0),"
                    " (2, 1, 'DELIVERED', true, 0, now(), now(), 0);"
                    "INSERT INTO published_messages (correlation_id, delivery_id, event_id,"
                    " subscription_id, attempt, published_at, outcome)"
                    " VALUES ('c1', 1, 1, 1, 1, now(), 'FAILED'),"
                    " ('c2', 2, 2, 1, 0, now(), 'DELIVERED');"
                    "INSERT INTO queue_message (delivery_id, message, routing_key, state,"
                    " exception_id) VALUES (1, '{}', 'k', 'Error', 'ab12')"
                )
            )
        schema.upgrade(empty_db)
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT delivery_id, attempt, outcome, next_attempt_at > now() AS later"
                    " FROM published_messages ORDER BY id"
                )
            ).all()
            cleared = conn.execute(text("SELECT exception_id FROM queue_message")).scalar_one()
        assert [tuple(r) for r in rows] == [
            (1, 1, "FAILED", None),
            (2, 0, "DELIVERED", None),
            (1, 2, "PENDING", True),
        ]
        assert cleared is None
    finally:
        engine.dispose()


def test_0026_fills_envelopes_and_failed_reasons_before_its_constraints(empty_db: str) -> None:
    """Rows from before the seed's constraints: a message without an envelope gets one built
    from its columns; a failed response without a reason, and one with neither envelope nor
    reason, get what the CHECKs ask."""
    schema.upgrade(empty_db, "0025")
    engine = create_engine(empty_db)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO node (code, name, state)"
                    " VALUES ('n', 'n', 'RUN');"
                    "INSERT INTO message (msg_timestamp, receive_timestamp, service_name,"
                    " operation_name, correlation_id, source_system, payload, state, node_id)"
                    " VALUES (now(), now(), 'crm', 'create', 'c1', 'eshop', 'x\"y', 'OK', 1);"
                    "INSERT INTO response (msg_id, failed, res_timestamp) VALUES"
                    " (1, true, now()), (1, false, now())"
                )
            )
        schema.upgrade(empty_db)
        with engine.connect() as conn:
            envelope = conn.execute(text("SELECT envelope FROM message")).scalar_one()
            responses = conn.execute(
                text("SELECT failed, res_envelope, failed_reason FROM response ORDER BY res_id")
            ).all()
        kept = json.loads(envelope)
        assert kept["correlation_id"] == "c1" and kept["payload"] == 'x"y'
        assert "object_id" not in kept  # NULL columns are left out
        assert [tuple(r) for r in responses] == [
            (True, None, "(not recorded)"),
            (False, "", None),
        ]
    finally:
        engine.dispose()


@pytest.mark.integration
def test_the_per_test_reset_empties_every_table(pg_engine: Engine) -> None:
    """A table the ``db`` fixture leaves alone carries one test's rows into the next."""
    tables = set(inspect(pg_engine).get_table_names()) - {"alembic_version"}
    assert tables - set(TABLES) == set()
