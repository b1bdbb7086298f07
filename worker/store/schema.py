"""Database schema management: Alembic migrations run programmatically, and the canonical
functions and triggers (``sql/functions.sql``) that migrations apply."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, make_url, text

from orderly.worker.store.queries import FUNCTIONS_FILE


def migrations_dir() -> Path:
    """Where the migrations are: ``migrations/`` of the repository, installed as the package
    ``orderly.migrations`` (pyproject.toml), so that an installed orderly finds them too."""
    from orderly import migrations

    return Path(migrations.__file__).resolve().parent


def alembic_config(url: str) -> Config:
    # No alembic.ini: that file serves the ``alembic`` command in a checkout.
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["url"] = url
    cfg.attributes["configure_logger"] = False
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def schema_problem(url: str) -> str | None:
    """What is wrong with the schema of the database at ``url`` for this orderly (None: it is
    at the head): migrations not applied, or a revision this orderly does not know."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config(url))
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            current = set(MigrationContext.configure(conn).get_current_heads())
    finally:
        engine.dispose()
    if current == set(script.get_heads()):
        return None
    known = {rev.revision for rev in script.walk_revisions()}
    unknown = sorted(current - known)
    if unknown:
        return f"the database is at {', '.join(unknown)}, a revision this orderly does not know"
    pending = []
    for rev in script.walk_revisions():
        if rev.revision in current:
            break
        pending.append(rev.revision)
    return f"migrations not applied: {', '.join(reversed(pending))} (run orderly migrate)"


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def create_database(url: str) -> bool:
    """Create the URL's database through the server's ``postgres`` database; False if it exists."""
    target = make_url(url)
    admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            found = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :name"),
                {"name": target.database},
            ).first()
            if found is not None:
                return False
            quoted = admin.dialect.identifier_preparer.quote(str(target.database))
            conn.execute(text(f"CREATE DATABASE {quoted}"))
            return True
    finally:
        admin.dispose()


def functions_sha256() -> str:
    """The hash a migration that applies ``functions.sql`` records (see ``apply_functions``)."""
    return hashlib.sha256(FUNCTIONS_FILE.read_bytes()).hexdigest()


def apply_functions(execute: Callable[[str], object]) -> None:
    """Install ``functions.sql`` (CREATE OR REPLACE) from a migration.

    Every migration that changes the functions applies the file as it stands and records its
    hash (``FUNCTIONS_SHA256``); a test holds the newest such migration to the file, so a
    changed file needs a new migration. Bodies are not checked against the tables here: an
    older migration may apply text written for columns a later one adds.
    """
    execute("SET LOCAL check_function_bodies = off")
    execute(FUNCTIONS_FILE.read_text())
