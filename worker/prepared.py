"""Server-side prepared statements on pooled DB-API connections, for the hot path.

psycopg2 does not prepare statements, and planning plus SQLAlchemy's per-execute work cost
about as much as the statements themselves. A :class:`PreparedSet` prepares its statements
once per physical connection (remembered in the pool's ``connection.info``) and runs them
with ``EXECUTE name(...)`` in autocommit: one round trip per statement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine


@dataclass(frozen=True)
class Prepared:
    name: str
    arg_types: tuple[str, ...]
    sql: str  # with $1, $2, ... placeholders
    prefix: str = ""  # sent in the same simple query, e.g. "SET LOCAL ...;"


class PreparedConnection:
    def __init__(self, cursor: Any, statements: dict[str, Prepared]) -> None:
        self._cursor = cursor
        self._statements = statements

    def run(
        self, name: str, *args: Any, before: str = "", before_args: Sequence[Any] = ()
    ) -> tuple[Any, ...] | None:
        """Execute a prepared statement; the first row it returns, if any.

        The statement's own prefix may use the leading arguments (``%s``, in order); ``before``
        is more SQL sent first in the same query, with ``before_args``. Statements sent in one
        query run in one transaction (unless one is already open), each with its own snapshot.
        """
        self._send(name, args, before, before_args)
        if self._cursor.description is None:
            return None
        row = self._cursor.fetchone()
        return None if row is None else tuple(row)

    def rows(self, name: str, *args: Any) -> list[tuple[Any, ...]]:
        """Execute a prepared statement; every row it returns."""
        self._send(name, args, "", ())
        return [tuple(r) for r in self._cursor.fetchall()]

    def _send(
        self, name: str, args: Sequence[Any], before: str, before_args: Sequence[Any]
    ) -> None:
        stmt = self._statements[name]
        placeholders = ", ".join(["%s"] * len(args))
        params = (*before_args, *args[: stmt.prefix.count("%s")], *args)
        self._cursor.execute(f"{before}{stmt.prefix}EXECUTE {name}({placeholders})", params)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        """Plain SQL on the same connection (e.g. BEGIN / COMMIT around prepared statements)."""
        self._cursor.execute(sql, params)

    def rowcount(self) -> int:
        """Rows the last statement changed."""
        return int(self._cursor.rowcount)

    def columns(self) -> list[str]:
        return [c.name for c in self._cursor.description or ()]


class PreparedSet:
    def __init__(self, engine: Engine, statements: Sequence[Prepared]) -> None:
        self._engine = engine
        self._statements = {s.name: s for s in statements}

    @contextlib.contextmanager
    def connection(self) -> Iterator[PreparedConnection]:
        """A pooled connection in autocommit with the statements prepared; same one throughout."""
        pooled = self._engine.raw_connection()
        try:
            dbapi = pooled.dbapi_connection
            assert dbapi is not None
            dbapi.autocommit = True
            cursor = dbapi.cursor()
            # Statement names are global to the connection: several sets may share one.
            prepared: set[str] = pooled.info.setdefault("orderly.prepared", set())
            for stmt in self._statements.values():
                if stmt.name not in prepared:
                    types = ", ".join(stmt.arg_types)
                    cursor.execute(f"PREPARE {stmt.name}({types}) AS {stmt.sql}")
                    prepared.add(stmt.name)
            try:
                yield PreparedConnection(cursor, self._statements)
            finally:
                cursor.close()
                dbapi.autocommit = False  # the pool hands it to others in transaction mode
        except self._engine.dialect.loaded_dbapi.Error as exc:
            # Without pre-ping, a dead connection shows itself here: drop it from the pool.
            if self._engine.dialect.is_disconnect(exc, pooled.dbapi_connection, None):
                pooled.invalidate(exc)
            raise
        finally:
            pooled.close()
