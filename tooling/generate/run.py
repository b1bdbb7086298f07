"""The run: ``generate`` and its checks."""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, text

from tooling.generate.catalogue import _Ahead
from tooling.generate.columns import (
    _KEYED,
    CALL_COLUMNS,
    DAY,
    KEYED_CALLS,
    MINUTE,
    TABLES,
    GenerateReport,
    _copy,
)
from tooling.generate.rows import _Generator
from tooling.generate.setup import _ensure_nodes, _ensure_pubsub


def _foreign_keys(conn: Connection) -> list[tuple[str, str, str, str]]:
    """(table, column, referenced table, referenced column) of the keyed tables' foreign keys;
    a key over several columns is returned with empty column names."""
    found = conn.execute(
        text(
            """
            SELECT c.conrelid::regclass::text, a.attname, c.confrelid::regclass::text,
                   af.attname, cardinality(c.conkey)
              FROM pg_constraint c
              JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]
              JOIN pg_attribute af ON af.attrelid = c.confrelid AND af.attnum = c.confkey[1]
             WHERE c.contype = 'f' AND c.conrelid::regclass::text = ANY(:tables)
             ORDER BY 1, 2
            """
        ),
        {"tables": list(_KEYED)},
    ).all()
    return [
        (t, col if n == 1 else "", ref, refcol if n == 1 else "")
        for t, col, ref, refcol, n in found
    ]


def _skip_row_triggers(conn: Connection) -> bool:
    """Skip the per-row foreign-key triggers for the rest of the transaction, when allowed.

    They dominate the cost of COPY here (a lookup and a row lock per reference); the
    references are checked set-wise afterwards instead (``_verify_references``). Needs a
    superuser (session_replication_role), and single-column keys only; otherwise the
    triggers stay and the run is slower.
    """
    superuser = conn.execute(text("SELECT current_setting('is_superuser')")).scalar() == "on"
    if not superuser or any(not col for _, col, _, _ in _foreign_keys(conn)):
        return False
    conn.execute(text("SET LOCAL session_replication_role = replica"))
    return True


def _upsert_keyed_calls(conn: Connection, data: bytes) -> int:
    """The entity-keyed calls, each taking over its key's row if its message is newer (as
    orderly_call_take does); how many rows are new."""
    if not data:
        return 0
    like = "LIKE external_call INCLUDING DEFAULTS"
    conn.execute(text(f"CREATE TEMP TABLE {KEYED_CALLS} ({like}) ON COMMIT DROP"))
    _copy(conn, KEYED_CALLS, data)
    columns = ", ".join(CALL_COLUMNS)
    taken = ", ".join(f"{c} = EXCLUDED.{c}" for c in CALL_COLUMNS if c not in ("call_id",))
    new = conn.execute(
        text(
            f"INSERT INTO external_call AS e ({columns}) SELECT {columns} FROM {KEYED_CALLS}"
            f" ON CONFLICT (operation_name, entity_id) DO UPDATE SET {taken}"
            " WHERE EXCLUDED.msg_timestamp > e.msg_timestamp"
            " RETURNING e.xmax = 0"
        )
    ).scalars()
    return sum(1 for inserted in new if inserted)


def _verify_references(conn: Connection, before: Mapping[str, int]) -> None:
    """Every reference of the new rows names an existing row (what the skipped triggers
    would have checked); raises, and so rolls everything back, if one does not."""
    conn.execute(text("SET LOCAL session_replication_role = origin"))
    for table in _KEYED:
        conn.execute(text(f"ANALYZE {table}"))
    for table, column, ref, ref_column in _foreign_keys(conn):
        new = f"t.{_KEYED[table]} > :first"
        if table == "external_call":
            new = f"({new} OR t.msg_id > :first_message)"  # a key's row taken over
        bad = conn.execute(
            text(
                f"SELECT t.{column} FROM {table} t WHERE {new}"
                f" AND t.{column} IS NOT NULL AND NOT EXISTS"
                f" (SELECT 1 FROM {ref} r WHERE r.{ref_column} = t.{column}) LIMIT 1"
            ),
            {"first": before[table], "first_message": before["message"]},
        ).first()
        if bad is not None:
            raise RuntimeError(
                f"generated {table}.{column} = {bad[0]} names no {ref}.{ref_column}; rolled back"
            )


def _check(messages: int, days: float, start: datetime | None) -> None:
    if isinstance(messages, bool) or not isinstance(messages, int) or messages <= 0:
        raise ValueError(f"messages must be a positive integer, got {messages!r}")
    if isinstance(days, bool) or not isinstance(days, int | float):
        raise ValueError(f"days must be a number of days above 0, got {days!r}")
    if not math.isfinite(days) or days <= 0 or days > 3660:
        raise ValueError(f"days must be above 0 and at most 3660, got {days!r}")
    if start is not None and not isinstance(start, datetime):
        raise ValueError(f"start must be a datetime, got {type(start).__name__}")


def generate(
    engine: Engine,
    messages: int,
    *,
    seed: int = 0,
    start: datetime | None = None,
    days: float = 7.0,
    progress: Callable[[str], None] | None = None,
) -> GenerateReport:
    """Write ``messages`` messages and the rows around them over ``days`` from ``start``
    (default: ``days`` before now), in one transaction; raise ValueError on bad input before
    anything is written."""
    _check(messages, days, start)
    began = time.perf_counter()
    if start is None:
        # whole seconds: a default start can be given again to repeat a run
        start = datetime.now(UTC).replace(microsecond=0) - timedelta(days=days)
    elif start.tzinfo is None:
        start = start.replace(tzinfo=UTC)
    first = int(start.timestamp() * 1000)
    last = first + int(days * DAY)
    if last - first < MINUTE:
        raise ValueError(f"days must span at least a minute, got {days!r}")
    end = datetime.fromtimestamp(last / 1000, UTC)
    say = progress or (lambda _: None)
    rows = dict.fromkeys(TABLES, 0)
    with engine.begin() as conn:
        conn.execute(text(f"LOCK TABLE {', '.join(TABLES)} IN SHARE ROW EXCLUSIVE MODE"))
        nodes, rows["node"] = _ensure_nodes(conn, end)
        rooms, added = _ensure_pubsub(conn)
        rows.update(added)
        ids = {
            table: int(
                conn.execute(
                    text(
                        f"SELECT greatest((SELECT coalesce(max({column}), 0) FROM {table}),"
                        " coalesce(pg_sequence_last_value("
                        f"CAST(pg_get_serial_sequence('{table}', '{column}') AS regclass)), 0))"
                    )
                ).scalar_one()
            )
            for table, column in _KEYED.items()
        }
        common: dict[str, Any] = {
            "seed": seed,
            "messages": messages,
            "start": first,
            "end": last,
            "ids": ids,
            "nodes": nodes,
            "rooms": rooms,
        }
        # publish/subscribe has its own stream of randomness: its rows do not shift when the
        # message mix changes
        gen = _Generator(random.Random(seed), **common)
        pubs = _Generator(random.Random(f"orderly-pubsub-{seed}"), **common)
        fast = _skip_row_triggers(conn)
        batches = _Ahead(itertools.chain(gen.message_batches(), pubs.pubsub_batches()))
        keyed: list[bytes] = []
        try:
            for table, data, count in batches:
                if table == KEYED_CALLS:
                    keyed.append(data)
                elif count:
                    _copy(conn, table, data)
                    rows[table] += count
        finally:
            batches.close()
        rows["external_call"] += _upsert_keyed_calls(conn, b"".join(keyed))
        say(f"copied {sum(rows.values())} rows in {time.perf_counter() - began:.1f} s")
        if fast:
            _verify_references(conn, ids)
            say(f"references checked at {time.perf_counter() - began:.1f} s")
        for table, column in _KEYED.items():
            used = max(gen.ids[table], pubs.ids[table])
            if used > ids[table]:
                conn.execute(
                    text(f"SELECT setval(pg_get_serial_sequence('{table}', '{column}'), :v)"),
                    {"v": used},
                )
    return GenerateReport(rows, time.perf_counter() - began, seed, start, end)
