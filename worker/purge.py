"""Retention: final messages finished before a time leave the store, with their rows.

``purge(engine, before)`` deletes (or, with an :class:`Archive`, writes to gzip JSON lines and
then deletes) the messages that are final (OK, FAILED, CANCEL) and finished before ``before``
(``coalesce(last_process_timestamp, receive_timestamp)``), with every row that belongs to
them: their children (through ``parent_msg_id``, at any depth), their external calls and
confirmations, their ``request``/``response`` log; the audit trail is a column of the message.

It works in batches, each its own short transaction: up to ``batch_size`` families, taken in
``msg_id`` order (one pass over the table) with ``FOR UPDATE SKIP LOCKED``, so a worker never
waits for the purge and the purge passes over what a worker holds. The unit is a family: a
message without a parent and all its descendants go together, and only when every one of
them is final and finished before the time (no child ever points at a deleted parent; no
parent goes while a child is open). A conversation is such families (a request and its
responses): a request goes only with its responses all ended, so the order of what is still
open (Redis's, and the rebuild's from the rows) is untouched. A family also stays whole when
deleting one of its messages would change what the mechanisms decide for the messages that
remain (``purge_held`` in ``worker/db/sql/purge.sql``): a FAILED message of a
guaranteed-order funnel (it holds the funnel back), an OK message an older open message of
the same object would be made obsolete by, an external call an open message's call would be
judged against. What stays is counted by reason.

A dry run takes the same batches and counts, then rolls each back: nothing is deleted, and
nothing is written.
"""

from __future__ import annotations

import gzip
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine

from orderly.worker.core.clock import SYSTEM, Clock, utcnow
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.core.inputs import parse_timestamp
from orderly.worker.db.queries import sql

# The tables a message's rows are in, in the order they are deleted (references first).
TABLES = ("response", "request", "external_call", "message")
_DELETES = {
    "response": "purge_delete_responses",
    "request": "purge_delete_requests",
    "external_call": "purge_delete_calls",
    "message": "purge_delete_messages",
}
# Why a family stays, most telling first (purge_held).
REASONS = ("open", "recent", "funnel", "object", "call")
MAX_BATCH = 10_000
DEFAULT_BATCH = 500
# How often (s) a purge reads the oldest open message's time again (purge_oldest_open: a scan
# of the open messages, too dear for every batch).
OLDEST_OPEN_EVERY_S = 10.0


def parse_before(value: str, clock: Clock = SYSTEM) -> datetime:
    """The ``--before`` time: ISO 8601 (without an offset, UTC), not in the future."""
    try:
        before = parse_timestamp(value)
    except ValueError as exc:
        raise InvalidMessage("before", str(exc)) from None
    return check_before(before, clock)


def check_before(before: datetime, clock: Clock = SYSTEM) -> datetime:
    if before.tzinfo is None:
        raise InvalidMessage("before", f"{before.isoformat()} has no time zone")
    now = utcnow(clock)
    if before > now:
        raise InvalidMessage(
            "before",
            f"{before.isoformat()} is in the future (now is {now.isoformat(timespec='seconds')}):"
            " only messages finished before it can go",
        )
    return before


def check_batch_size(batch_size: int) -> int:
    if not 1 <= batch_size <= MAX_BATCH:
        raise InvalidMessage("batch_size", f"must be 1 to {MAX_BATCH}, got {batch_size}")
    return batch_size


class Archive:
    """Gzip JSON lines, one file per table (``<table>-<stamp>.jsonl.gz``), one line per row as
    PostgreSQL renders it (``row_to_json``: ``json_populate_record`` reads it back). Each
    batch is appended as a gzip member of its own and synced to disk before the batch's
    deletes commit; a batch whose commit fails leaves its rows in the store and in the
    archive (a later run archives them again)."""

    def __init__(self, directory: Path, stamp: str) -> None:
        if directory.exists() and not directory.is_dir():
            raise InvalidMessage("archive", f"{directory} exists and is not a directory")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidMessage("archive", f"cannot create {directory}: {exc}") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise InvalidMessage("archive", f"{directory} is not writable")
        self.paths = {t: directory / f"{t}-{stamp}.jsonl.gz" for t in TABLES}
        taken = [str(p) for p in self.paths.values() if p.exists()]
        if taken:
            raise InvalidMessage("archive", f"{taken[0]} exists already")

    def write(self, table: str, rows: Sequence[str]) -> None:
        if not rows:
            return
        data = gzip.compress(("\n".join(rows) + "\n").encode(), compresslevel=6)
        with self.paths[table].open("ab") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())

    def files(self) -> list[str]:
        return [str(p) for p in self.paths.values() if p.exists()]


def read_archive(path: Path) -> list[str]:
    """The JSON lines of an archive file (every member of it)."""
    with gzip.open(path, "rt") as lines:
        return [line.rstrip("\n") for line in lines if line.strip()]


@dataclass
class PurgeReport:
    before: datetime
    dry_run: bool
    batch_size: int
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TABLES, 0))
    families: int = 0
    kept: dict[str, int] = field(default_factory=dict)  # families that stay, by reason
    busy: int = 0  # families a worker held a row of (passed over)
    detached_requests: int = 0
    batches: int = 0
    seconds: float = 0.0
    archive: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.rows.values())

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        rate = self.total / self.seconds if self.seconds > 0 else 0.0
        counts = ", ".join(f"{t} {n:,}" for t, n in self.rows.items())
        kept = ", ".join(f"{r} {n:,}" for r, n in self.kept.items()) or "none"
        return (
            f"{verb} {self.total:,} rows of {self.families:,} families finished before "
            f"{self.before.isoformat()} ({counts}) in {self.seconds:.1f} s "
            f"({rate:,.0f} rows/s, {self.batches} batches); families kept: {kept}; "
            f"passed over while a worker held them: {self.busy:,}"
        )


def _families(conn: Connection, roots: list[int]) -> tuple[dict[int, list[int]], set[int]]:
    """Each root's family (root first), and the roots of families with a member locked now."""
    members: dict[int, list[int]] = {root: [root] for root in roots}
    busy: set[int] = set()
    for row in conn.execute(sql("purge_family"), {"roots": roots}):
        members[row.root].append(row.msg_id)
        if not row.locked:
            busy.add(row.root)
    return members, busy


def _batch(
    conn: Connection,
    report: PurgeReport,
    after: int,
    archive: Archive | None,
    oldest_open: datetime | None,
) -> int | None:
    """One batch in the caller's transaction; the last root's msg_id, None when none was left."""
    conn.execute(sql("purge_begin"))
    roots = list(
        conn.execute(
            sql("purge_roots"),
            {"after": after, "before": report.before, "limit": report.batch_size},
        ).scalars()
    )
    if not roots:
        return None
    members, busy = _families(conn, roots)
    report.busy += len(busy)
    candidates = [i for root in roots if root not in busy for i in members[root]]
    held = {
        row.msg_id: row.held
        for row in conn.execute(
            sql("purge_held"),
            {"ids": candidates, "before": report.before, "oldest_open": oldest_open},
        )
        if row.held
    }
    going: list[int] = []
    kept: Counter[str] = Counter()
    for root in roots:
        if root in busy:
            continue
        reasons = {held[i] for i in members[root] if i in held}
        if reasons:
            kept[next(r for r in REASONS if r in reasons)] += 1
        else:
            going.extend(members[root])
            report.families += 1
    for reason, n in kept.items():
        report.kept[reason] = report.kept.get(reason, 0) + n
    if going:
        _delete(conn, report, going, archive)
    report.batches += 1
    return roots[-1] if len(roots) == report.batch_size else None


def _delete(conn: Connection, report: PurgeReport, ids: list[int], archive: Archive | None) -> None:
    if report.dry_run:
        counts = conn.execute(sql("purge_count"), {"ids": ids}).one()
        for table in ("response", "request", "external_call"):
            report.rows[table] += int(getattr(counts, table))
        report.rows["message"] += len(ids)
        return
    found: dict[str, list[Any]] = {}
    for table in TABLES:
        if table == "message":
            report.detached_requests += len(
                conn.execute(sql("purge_detach_requests"), {"ids": ids}).all()
            )
        found[table] = list(
            conn.execute(sql(_DELETES[table]), {"ids": ids, "archive": archive is not None})
            .scalars()
            .all()
        )
    if len(found["message"]) != len(ids):  # every one is locked and final: cannot happen
        raise RuntimeError(f"purge: {len(ids) - len(found['message'])} messages changed")
    if archive is not None:
        for table in TABLES:
            archive.write(table, found[table])
    for table in TABLES:
        report.rows[table] += len(found[table])


def purge(
    engine: Engine,
    before: datetime,
    *,
    batch_size: int = DEFAULT_BATCH,
    dry_run: bool = False,
    archive: Archive | None = None,
    clock: Clock = SYSTEM,
    on_batch: Callable[[PurgeReport], None] | None = None,
) -> PurgeReport:
    """Delete (or count, on a dry run) the final messages finished before ``before`` and
    their rows, batch after batch; see the module's docstring for what stays."""
    check_before(before, clock)
    check_batch_size(batch_size)
    if dry_run and archive is not None:
        raise InvalidMessage("archive", "a dry run writes no archive")
    report = PurgeReport(before=before, dry_run=dry_run, batch_size=batch_size)
    started = clock.monotonic()
    read_at = started - OLDEST_OPEN_EVERY_S
    oldest_open: datetime | None = None
    after: int | None = 0
    while after is not None:
        if clock.monotonic() - read_at >= OLDEST_OPEN_EVERY_S:
            read_at = clock.monotonic()
            with engine.connect() as conn:
                oldest_open = conn.execute(sql("purge_oldest_open")).scalar()
        with engine.connect() as conn, conn.begin() as tx:
            after = _batch(conn, report, after, archive, oldest_open)
            if dry_run:
                tx.rollback()
        report.seconds = clock.monotonic() - started
        if on_batch is not None:
            on_batch(report)
    if archive is not None:
        report.archive = archive.files()
    return report
