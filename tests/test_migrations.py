"""`alembic upgrade head` on an empty database equals the models; downgrade to base works."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, create_engine, inspect, text

from models import Base
from tests.conftest import PG_ADMIN_URL
from worker import schema


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
