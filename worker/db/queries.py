"""Named SQL queries, loaded once from the ``.sql`` files beside this module.

Every statement orderly runs lives in ``worker/db/sql/*.sql`` under a name::

    -- name: claim_deliveries
    -- What it does and why (comment lines up to the SQL are its documentation).
    -- prepare: bigint[], text            (optional: a server-side prepared statement)
    -- prefix: SET LOCAL synchronous_commit TO OFF;   (optional: sent before it, same query)
    UPDATE delivery ...

A query with ``prepare`` takes ``$1, $2, ...`` and runs through a
:func:`~worker.db.prepared.prepared_connection` (the hot path: one round trip, planned once per
connection); any other takes ``:name`` parameters and runs through SQLAlchemy (:func:`sql`).
Names are unique across files; a duplicate or an unknown name is an error at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from sqlalchemy import TextClause, text

SQL_DIR = Path(__file__).resolve().parent / "sql"
# The canonical PL/pgSQL of the store (functions and triggers); migrations apply it.
FUNCTIONS_FILE = SQL_DIR / "functions.sql"

_HEADER = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Query:
    name: str
    sql: str
    doc: str = ""
    arg_types: tuple[str, ...] | None = None  # set: a prepared statement ($1, $2, ...)
    prefix: str = ""


def _parse(path: Path) -> list[Query]:
    source = path.read_text()
    headers = list(_HEADER.finditer(source))
    queries = []
    for i, header in enumerate(headers):
        end = headers[i + 1].start() if i + 1 < len(headers) else len(source)
        doc: list[str] = []
        body: list[str] = []
        arg_types: tuple[str, ...] | None = None
        prefix = ""
        for line in source[header.end() : end].strip("\n").splitlines():
            stripped = line.strip()
            if not body and stripped.startswith("--"):
                comment = stripped[2:].strip()
                if comment.startswith("prepare:"):
                    types = comment.removeprefix("prepare:").strip()
                    arg_types = tuple(t.strip() for t in types.split(",") if t.strip())
                elif comment.startswith("prefix:"):
                    prefix = comment.removeprefix("prefix:").strip() + " "
                else:
                    doc.append(comment)
            elif body or stripped:
                body.append(line)
        sql = "\n".join(body).strip().rstrip(";")
        if not sql:
            raise ValueError(f"{path.name}: query {header.group(1)!r} has no SQL")
        queries.append(Query(header.group(1), sql, " ".join(doc), arg_types, prefix))
    return queries


@cache
def queries() -> dict[str, Query]:
    """Every named query of every file."""
    found: dict[str, Query] = {}
    for path in sorted(SQL_DIR.glob("*.sql")):
        if path == FUNCTIONS_FILE:
            continue
        for query in _parse(path):
            if query.name in found:
                raise ValueError(f"query {query.name!r} is defined twice ({path.name})")
            found[query.name] = query
    return found


def query(name: str) -> Query:
    try:
        return queries()[name]
    except KeyError:
        raise KeyError(f"no SQL query named {name!r} in {SQL_DIR}") from None


@cache
def sql(name: str) -> TextClause:
    """A ``:name``-parameter query as a SQLAlchemy text clause (compiled once)."""
    found = query(name)
    if found.arg_types is not None:
        raise ValueError(f"query {name!r} is a prepared statement: run it on prepared_connection")
    return text(found.sql)


def functions_sql() -> str:
    """The canonical functions and triggers (``functions.sql``)."""
    return FUNCTIONS_FILE.read_text()
