"""orderly behind a connection pooler: refused at start-up, with the reason.

Claims are held by the backend that made them, the rebuild takes a session advisory lock and
the hot path prepares statements per connection; PgBouncer breaks these in transaction
pooling and the first in session pooling, so every process refuses a database URL that goes
through one (worker.readiness.direct_postgresql). Against Debian's pgbouncer in front of the
test database, in both modes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text

from orderly.worker import readiness
from orderly.worker.runtime import Runtime
from orderly.worker.settings import Settings
from tests.conftest import PG_ADMIN_URL, TEST_DB, TEST_DB_URL
from tests.helpers import OrderlyCli, wait_until
from tests.stack import Stack
from tooling.servers import PgBouncer


@pytest.fixture(params=["transaction", "session"])
def bouncer(request: pytest.FixtureRequest, pgbouncer: Callable[[str], PgBouncer]) -> PgBouncer:
    return pgbouncer(request.param)


def test_a_direct_connection_passes(db: Engine) -> None:
    assert readiness.pooled(db) is None
    readiness.direct_postgresql(db)
    Runtime(Settings(database_url=TEST_DB_URL)).startup_check(redis=False)


def test_a_pooler_is_named_and_refused(bouncer: PgBouncer) -> None:
    engine = create_engine(bouncer.url(TEST_DB))
    try:
        why = readiness.pooled(engine)
        assert why is not None and "backend pid" in why
        with pytest.raises(readiness.PostgreSQLPooled, match="through a connection pooler"):
            readiness.direct_postgresql(engine)
    finally:
        engine.dispose()
    runtime = Runtime(Settings(database_url=bouncer.url(TEST_DB)))
    with pytest.raises(readiness.PostgreSQLPooled, match="Point ORDERLY_DATABASE_URL"):
        runtime.startup_check(redis=False)  # migrations too


@pytest.mark.e2e
def test_api_worker_and_beat_refuse_to_start_behind_pgbouncer(
    stack: Stack, pgbouncer: Callable[[str], PgBouncer]
) -> None:
    stack.env(ORDERLY_DATABASE_URL=pgbouncer("transaction").url(TEST_DB))
    with pytest.raises(RuntimeError, match="exited"):
        stack.start_api()
    started = [stack.procs.start_worker("w-pooled"), stack.procs.start_beat("b-pooled")]
    wait_until(lambda: not any(m.alive() for m in started), 60, "worker and beat exited")
    for managed in [stack.process("api"), *started]:
        assert managed.proc.returncode != 0, managed.name
        text = managed.log_path.read_text(errors="replace")
        assert "through a connection pooler" in text, managed.name


@pytest.mark.e2e
def test_migrate_refuses_a_pooler_before_it_changes_anything(
    cli: OrderlyCli, pgbouncer: Callable[[str], PgBouncer]
) -> None:
    name = f"orderly_pooled_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        done = cli("migrate", env={"ORDERLY_DATABASE_URL": pgbouncer("session").url(name)})
        assert done.returncode != 0 and "through a connection pooler" in done.stderr
        empty = create_engine(PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}")
        try:
            with empty.connect() as conn:
                tables = conn.execute(
                    text("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
                ).scalar_one()
        finally:
            empty.dispose()
        assert tables == 0  # nothing migrated
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_the_pool_settings_bound_a_process_connections(db: Engine) -> None:
    settings = Settings(database_url=TEST_DB_URL, database_pool_size=2, database_max_overflow=1)
    engine = Runtime(settings).engine
    pool: Any = engine.pool
    try:
        with engine.connect(), engine.connect(), engine.connect():
            assert pool.checkedout() == 3 and pool.size() == 2
            assert pool.overflow() == 1 == pool._max_overflow  # a fourth would wait
        assert pool.checkedin() == 2  # the one beyond the pool size is closed
    finally:
        engine.dispose()
