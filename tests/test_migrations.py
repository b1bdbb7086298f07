"""`alembic upgrade head` on an empty database equals the models; downgrade to base works."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, create_engine, inspect, text

from orderly.models import Base
from orderly.worker.store import schema
from tests.conftest import PG_ADMIN_URL, TABLES


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
    SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')',
           pg_get_functiondef(p.oid)
      FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
     WHERE n.nspname = 'public' AND p.proname LIKE 'orderly\\_%'
    UNION ALL
    SELECT 'trigger ' || t.tgname, pg_get_triggerdef(t.oid)
      FROM pg_trigger t WHERE NOT t.tgisinternal AND t.tgname LIKE 'orderly\\_%'
    """
)


def test_functions_installed_by_migrations_equal_the_canonical_file(empty_db: str) -> None:
    """What `alembic upgrade head` installs is functions.sql, no more and no less: the file
    is applied again in a transaction that is rolled back, and nothing may change."""
    schema.upgrade(empty_db)
    engine = create_engine(empty_db)
    try:
        with engine.connect() as conn:
            installed = {str(k): str(v) for k, v in conn.execute(_FUNCTIONS)}
            conn.commit()
            trans = conn.begin()
            try:
                # Drop every orderly function and trigger, then install the file alone.
                for name in installed:
                    if name.startswith("trigger "):
                        conn.execute(text(f"DROP TRIGGER {name.split()[1]} ON message"))
                for name in installed:
                    if not name.startswith("trigger "):
                        conn.execute(text(f"DROP FUNCTION IF EXISTS {name} CASCADE"))
                cursor = conn.connection.cursor()
                schema.apply_functions(cursor.execute)
                from_file = {str(k): str(v) for k, v in conn.execute(_FUNCTIONS)}
            finally:
                trans.rollback()
        assert set(from_file) == set(installed)
        for name, definition in from_file.items():
            assert installed[name] == definition, name
        assert {"orderly_finish", "trigger orderly_message_transition"} <= {
            n.split("(")[0] for n in installed
        }
    finally:
        engine.dispose()


def test_the_newest_functions_migration_names_the_current_file() -> None:
    """A change to functions.sql needs a migration that applies it and records its hash."""
    versions = sorted((schema.migrations_dir() / "versions").glob("*.py"))
    recorded = [
        match.group(1)
        for path in versions
        if (match := re.search(r'^FUNCTIONS_SHA256 = "([0-9a-f]{64})"', path.read_text(), re.M))
    ]
    assert recorded, "no migration applies functions.sql"
    assert recorded[-1] == schema.functions_sha256()


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


@pytest.mark.integration
def test_the_per_test_reset_empties_every_table(pg_engine: Engine) -> None:
    """A table the ``db`` fixture leaves alone carries one test's rows into the next."""
    tables = set(inspect(pg_engine).get_table_names()) - {"alembic_version"}
    assert tables - set(TABLES) == set()
