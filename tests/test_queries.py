"""The named queries of worker/db/sql: every one used, every use defined, the prepared ones
valid on the real database."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from sqlalchemy import Engine

from orderly.worker.core.scripts import SCRIPT_NAMES
from orderly.worker.db import queries
from orderly.worker.db.prepared import prepared_connection
from orderly.worker.messages import watchdogs

ROOT = Path(__file__).resolve().parent.parent
# sql("name"), conn.run("name", ...), before=("name", ...), take/release
# query names of due sources, and the names of prepared statements sent by the processor.
_USE = re.compile(r"""(?:sql|run)\(\s*"([a-z_]+)"|\(\s*"([a-z_]+)",\s*\(""")
_DUE = re.compile(r'"([a-z_]+_(?:take|take_due|release))"')


def _used() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "worker").rglob("*.py"):
        source = path.read_text()
        names |= {a or b for a, b in _USE.findall(source)}
        names |= set(_DUE.findall(source))
    return names - set(SCRIPT_NAMES)  # scripts.run("advance", ...) runs Lua, not SQL


def _literals() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "worker").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def test_every_named_query_is_used_and_every_use_is_defined() -> None:
    defined = set(queries.queries())
    assert _used() - defined == set(), "run but not defined"
    assert defined - _literals() == set(), "defined but never named in the code"


def test_a_query_name_is_defined_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.sql").write_text("-- name: same\nSELECT 1;\n")
    (tmp_path / "b.sql").write_text("-- name: same\nSELECT 2;\n")
    monkeypatch.setattr(queries, "SQL_DIR", tmp_path)
    queries.queries.cache_clear()
    try:
        with pytest.raises(ValueError, match="defined twice"):
            queries.queries()
    finally:
        monkeypatch.undo()
        queries.queries.cache_clear()
    with pytest.raises(KeyError, match="no SQL query named"):
        queries.query("no_such_query")


def test_every_prepared_statement_prepares_on_the_migrated_database(db: Engine) -> None:
    prepared = [q for q in queries.queries().values() if q.arg_types is not None]
    assert len(prepared) >= 20
    with prepared_connection(db) as conn:
        for query in prepared:
            conn._statement(query.name)  # PREPARE: the text and its types are valid
    with pytest.raises(ValueError, match="is a prepared statement"):
        queries.sql("orderly_claim_ids")


def test_the_codes_python_names_are_the_ones_the_queries_write() -> None:
    """Error codes, sources and operations are literals in the SQL and constants in Python
    (for the tooling and the tests): the two must agree."""
    from orderly.models import CONFIRMATION_OPERATION
    from orderly.worker import conversations
    from orderly.worker.db.queries import functions_sql
    from orderly.worker.messages import timeouts

    expected = {
        watchdogs.REPAIR_CODE: ["repair_messages"],
        watchdogs.POSTPONED_CODE: ["fail_postponed"],
        watchdogs.TIMEOUT_CODE: ["expire_waits"],
        timeouts.TIMEOUT_CODE: ["timeout_take_back"],
        conversations.SERVICE: ["conv_insert_requests", "conv_expire_responses"],
        conversations.REQUEST_SOURCE: ["conv_insert_requests", "conv_insert_responses"],
        conversations.RESPONSE_SOURCE: ["conv_insert_responses", "conv_failed_by_response"],
        conversations.ERROR_CANCELLED: ["conv_insert_responses"],
        conversations.ERROR_EXPIRED: ["conv_expire_responses"],
        CONFIRMATION_OPERATION: ["confirmation_take", "repair_calls"],
    }
    for literal, names in expected.items():
        for name in names:
            assert f"'{literal}'" in queries.query(name).sql, (literal, name)
    assert f"'{CONFIRMATION_OPERATION}'" in functions_sql()
