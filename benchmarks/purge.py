"""The store's size per million messages, and how fast ``orderly purge`` empties it.

    python -m benchmarks.purge [--quick] [--messages N] [--batch-size B] [--keep]

Creates the database ``orderly_bench_purge`` (dropped first, and again at the end unless
--keep), migrates it, generates N messages (1,000,000; --quick: 100,000) over 7 days with
``python -m tooling generate``'s generator, then measures:
- per table of the message store: rows, heap (``pg_relation_size``), indexes
  (``pg_indexes_size``) and total (``pg_total_relation_size``) bytes, and the totals scaled
  to a million messages;
- ``dry_run``: counting what a purge of the first 3 days would delete;
- ``archive``: that purge with ``--archive`` (gzip JSON lines in a temporary directory);
- ``delete``: a purge of the next 3 days without an archive;
- ``vacuum_s``: VACUUM of the four tables after it (their files keep their size).
Each purge figure is rows, seconds and rows/s as worker.purge reports them. The last line
printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, text

BENCH_DB = os.environ.get("ORDERLY_BENCH_PURGE_DATABASE", "orderly_bench_purge")
START = datetime(2026, 1, 5, tzinfo=UTC)
STORE = ("message", "external_call", "request", "response")


def _urls() -> tuple[str, str]:
    base = os.environ.get("ORDERLY_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1/x")
    root = base.rsplit("/", 1)[0]
    return root + "/postgres", root + f"/{BENCH_DB}"


def _admin(sql: str) -> None:
    admin = create_engine(_urls()[0], isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(sql))
    admin.dispose()


def sizes(engine: Engine) -> dict[str, dict[str, int]]:
    with engine.connect() as conn:
        conn.execute(text("ANALYZE"))
        rows = conn.execute(
            text(
                "SELECT c.relname, c.reltuples::bigint, pg_relation_size(c.oid), "
                "pg_indexes_size(c.oid), pg_total_relation_size(c.oid) FROM pg_class c "
                "WHERE c.relname = ANY(:t) AND c.relkind = 'r'"
            ),
            {"t": list(STORE)},
        ).all()
    return {
        name: {"rows": n, "heap": heap, "indexes": idx, "total": total}
        for name, n, heap, idx, total in rows
    }


def _purge(engine: Engine, before: datetime, batch: int, **options: Any) -> dict[str, Any]:
    from orderly.worker.purge import purge

    report = purge(engine, before, batch_size=batch, **options)
    print(report.summary())
    return {
        "rows": report.total,
        "by_table": report.rows,
        "families": report.families,
        "kept": report.kept,
        "seconds": round(report.seconds, 2),
        "rows_per_s": round(report.total / report.seconds) if report.seconds else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--messages", type=int)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    args = parser.parse_args()
    messages = args.messages or (100_000 if args.quick else 1_000_000)

    from orderly.worker.db import schema
    from orderly.worker.purge import Archive
    from tooling.generate import generate

    _admin(f'DROP DATABASE IF EXISTS "{BENCH_DB}" WITH (FORCE)')
    _admin(f'CREATE DATABASE "{BENCH_DB}"')
    url = _urls()[1]
    schema.upgrade(url)
    engine = create_engine(url)
    try:
        t0 = time.monotonic()
        made = generate(engine, messages, seed=1, start=START, days=7)
        generated_s = time.monotonic() - t0
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE"))
        before = sizes(engine)
        scale = 1_000_000 / messages
        per_million = {
            part: round(sum(t[part] for t in before.values()) * scale)
            for part in ("heap", "indexes", "total")
        }
        first, second = START + timedelta(days=3), START + timedelta(days=6)
        counted = _purge(engine, first, args.batch_size, dry_run=True)
        with tempfile.TemporaryDirectory() as tmp:
            archived = _purge(engine, first, args.batch_size, archive=Archive(Path(tmp), "bench"))
            archive_bytes = sum(p.stat().st_size for p in Path(tmp).iterdir())
        deleted = _purge(engine, second, args.batch_size)
        t0 = time.monotonic()
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f"VACUUM {', '.join(STORE)}"))
        vacuum_s = time.monotonic() - t0
        after = sizes(engine)
    finally:
        engine.dispose()
        if not args.keep:
            _admin(f'DROP DATABASE IF EXISTS "{BENCH_DB}" WITH (FORCE)')
    print(
        json.dumps(
            {
                "benchmark": "purge",
                "messages": messages,
                "generated_rows": made.total_rows,
                "generated_s": round(generated_s, 1),
                "batch_size": args.batch_size,
                "tables": before,
                "store_bytes_per_million_messages": per_million,
                "dry_run": counted,
                "archive": {**archived, "archive_bytes": archive_bytes},
                "delete": deleted,
                "vacuum_s": round(vacuum_s, 1),
                "tables_after": after,
                "load_average": os.getloadavg(),
            }
        )
    )


if __name__ == "__main__":
    main()
