"""Server-side prepared statements on pooled DB-API connections, for the hot path.

psycopg2 does not prepare statements, and planning plus SQLAlchemy's per-execute work cost
about as much as the statements themselves. A :class:`PreparedConnection` prepares a named
query (``-- prepare:`` in ``worker/db/sql``) the first time it runs on a physical
connection (remembered in the pool's ``connection.info``) and runs it with
``EXECUTE name(...)`` in autocommit: one round trip per statement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from sqlalchemy import Engine

from orderly.worker.db.queries import Query, query

# A typed row: a dataclass whose fields are a statement's column names.
R = TypeVar("R")
# A prepared statement and its arguments, sent before another in the same query.
Before = tuple[str, Sequence[Any]]


class PreparedConnection:
    def __init__(self, cursor: Any, prepared: set[str]) -> None:
        self._cursor = cursor
        self._prepared = prepared

    def _statement(self, name: str) -> Query:
        stmt = query(name)
        if stmt.arg_types is None:
            raise ValueError(f"query {name!r} is not a prepared statement (no '-- prepare:')")
        if name not in self._prepared:
            types = ", ".join(stmt.arg_types)
            self._cursor.execute(f"PREPARE {name}({types}) AS {stmt.sql}")
            self._prepared.add(name)
        return stmt

    def run(
        self, name: str, *args: Any, before: Before | list[Before] | None = None
    ) -> tuple[Any, ...] | None:
        """Execute a prepared statement; the first row it returns, if any.

        The statement's own prefix may use the leading arguments (``%s``, in order); ``before``
        is another prepared statement and its arguments (or several), sent first in the same
        query.
        Statements sent in one query run in one transaction (unless one is already open), each
        with its own snapshot: a lock taken by the first is held when the second reads.
        """
        self._send_after(name, args, before)
        if self._cursor.description is None:
            return None
        row = self._cursor.fetchone()
        return None if row is None else tuple(row)

    def _send_after(
        self, name: str, args: Sequence[Any], before: Before | list[Before] | None
    ) -> None:
        first = ""
        first_args: list[Any] = []
        befores = before if isinstance(before, list) else [] if before is None else [before]
        for stmt_name, stmt_args in befores:
            self._statement(stmt_name)
            first_args += stmt_args
            first += f"EXECUTE {stmt_name}({', '.join(['%s'] * len(stmt_args))}); "
        self._send(name, args, first, first_args)

    def _send(
        self, name: str, args: Sequence[Any], before: str, before_args: Sequence[Any]
    ) -> None:
        stmt = self._statement(name)
        placeholders = ", ".join(["%s"] * len(args))
        params = (*before_args, *args[: stmt.prefix.count("%s")], *args)
        self._cursor.execute(f"{before}{stmt.prefix}EXECUTE {name}({placeholders})", params)

    def run_all(self, name: str, *args: Any) -> list[tuple[Any, ...]]:
        """Execute a prepared statement; every row it returns."""
        self._send(name, args, "", ())
        if self._cursor.description is None:
            return []
        return [tuple(row) for row in self._cursor.fetchall()]

    def one(
        self,
        row_type: type[R],
        name: str,
        *args: Any,
        before: Before | list[Before] | None = None,
    ) -> R | None:
        """Execute a prepared statement (after ``before``, as :meth:`run`); its first row as
        ``row_type`` (a dataclass whose fields are the statement's column names), or None."""
        self._send_after(name, args, before)
        found = self._cursor.fetchone() if self._cursor.description is not None else None
        return None if found is None else row_type(*_picked(row_type, self._columns(), found))

    def all(
        self,
        row_type: type[R],
        name: str,
        *args: Any,
        before: Before | list[Before] | None = None,
    ) -> list[R]:
        """Execute a prepared statement (after ``before``, as :meth:`run`); every row as
        ``row_type`` (built by column name)."""
        self._send_after(name, args, before)
        if self._cursor.description is None:
            return []
        columns = self._columns()
        return [row_type(*_picked(row_type, columns, found)) for found in self._cursor.fetchall()]

    def _columns(self) -> tuple[str, ...]:
        return tuple(column[0] for column in self._cursor.description)

    def value(self, name: str) -> Any:
        """The one value a named query without parameters returns (not prepared: for the
        rare statement, such as reading a setting of the transaction)."""
        self._cursor.execute(query(name).sql)
        row = self._cursor.fetchone()
        return None if row is None else row[0]

    def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        """Plain SQL on the same connection (BEGIN / COMMIT / ROLLBACK around statements)."""
        self._cursor.execute(sql, params)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[PreparedConnection]:
        """The statements run inside as one transaction: committed when the block ends,
        rolled back when it raises."""
        self._cursor.execute("BEGIN")
        try:
            yield self
        except BaseException:
            self._cursor.execute("ROLLBACK")
            raise
        self._cursor.execute("COMMIT")

    @property
    def backend_pid(self) -> int:
        """The PostgreSQL backend pid of this connection (no round trip)."""
        return int(self._cursor.connection.get_backend_pid())

    def rowcount(self) -> int:
        """Rows the last statement changed."""
        return int(self._cursor.rowcount)


@functools.cache
def _order(row_type: type, columns: tuple[str, ...]) -> tuple[int, ...]:
    """Where each field of a row type is among a statement's columns (by name, once per pair):
    a statement whose columns are not exactly the type's fields is an error at once."""
    names = [f.name for f in dataclasses.fields(row_type)]
    if sorted(names) != sorted(columns):
        raise ValueError(f"{row_type.__name__} has fields {names}, the statement columns {columns}")
    return tuple(columns.index(name) for name in names)


def _picked(row_type: Any, columns: tuple[str, ...], found: Sequence[Any]) -> list[Any]:
    """A row's values in the order of the row type's fields."""
    return [found[i] for i in _order(row_type, columns)]


@contextlib.contextmanager
def prepared_connection(engine: Engine) -> Iterator[PreparedConnection]:
    """A pooled connection in autocommit on which named queries run prepared; the same one
    throughout (a claim tied to the backend pid needs that)."""
    pooled = engine.raw_connection()
    try:
        dbapi = pooled.dbapi_connection
        assert dbapi is not None
        dbapi.autocommit = True
        cursor = dbapi.cursor()
        # Statement names are global to the physical connection.
        prepared: set[str] = pooled.info.setdefault("orderly.prepared", set())
        try:
            yield PreparedConnection(cursor, prepared)
        finally:
            cursor.close()
            dbapi.autocommit = False  # the pool hands it to others in transaction mode
    except engine.dialect.loaded_dbapi.Error as exc:
        # A connection that died while checked out shows itself here: drop it from the pool.
        if engine.dialect.is_disconnect(exc, pooled.dbapi_connection, None):
            pooled.invalidate(exc)
        raise
    finally:
        pooled.close()
