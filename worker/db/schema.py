"""Database schema management: Alembic migrations run programmatically, and the store's
functions and triggers as migrations install them.

``sql/functions.sql`` is the canonical text of the functions and triggers, as of the newest
migration. A migration that changes them does not read it: it applies its own frozen copy,
``migrations/sql/<revision>_functions.sql`` (:func:`apply_frozen`), the file as it stood when the
migration was written, so that upgrading an old database installs at each revision the text
written for that revision's tables. A change to ``functions.sql`` therefore needs a new migration
and a copy frozen from the file (``python -m tooling.freeze_functions <revision>``); the
migration records the copy's hash (``FUNCTIONS_SHA256``), and tests/test_migrations.py holds the
newest copy to the file and each copy to its hash.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, make_url, text

from orderly.worker.db.queries import FUNCTIONS_FILE


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


def frozen_functions_file(revision: str) -> Path:
    """The frozen copy of ``functions.sql`` that migration ``revision`` applies (it ships in the
    package ``orderly.migrations`` with the migrations)."""
    return migrations_dir() / "sql" / f"{revision}_functions.sql"


def apply_frozen(execute: Callable[[str], object], revision: str) -> None:
    """Install, from migration ``revision``, the functions and triggers it was written for: its
    frozen copy of ``functions.sql`` (every definition CREATE OR REPLACE, a removed one dropped).

    A migration's ``downgrade`` applies the copy of the functions migration before it, after
    dropping what it added, so a downgrade gives back the text of the revision below.
    """
    path = frozen_functions_file(revision)
    if not path.is_file():
        raise FileNotFoundError(
            f"migration {revision} has no frozen functions.sql ({path}); in a checkout, "
            f"python -m tooling.freeze_functions {revision} writes it"
        )
    _install(execute, path.read_text())


def apply_functions(execute: Callable[[str], object]) -> None:
    """Install ``functions.sql`` as it stands today: what the tests compare a database with.
    Not for a migration, which applies its own frozen copy (:func:`apply_frozen`)."""
    _install(execute, FUNCTIONS_FILE.read_text())


def _install(execute: Callable[[str], object], functions: str) -> None:
    # Bodies are not checked at creation: an SQL-language body naming a function defined
    # further down the file (or one this text drops and defines anew) would otherwise fail.
    execute("SET LOCAL check_function_bodies = off")
    execute(functions)
