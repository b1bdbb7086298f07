"""``orderly purge --before``: final messages finished before a time leave the store, with
their rows (worker/purge.py), optionally archived first."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from orderly.api.cli.common import call, console, err, fail
from orderly.worker import purge as mechanism
from orderly.worker.core.clock import SYSTEM
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.db.db import get_engine


def purge(
    before: Annotated[
        str,
        typer.Option(
            "--before",
            help="ISO 8601 time (without an offset: UTC), not in the future: final messages "
            "(OK, FAILED, CANCEL) finished before it go, with their families and rows.",
        ),
    ],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Count what would go; delete nothing.")
    ] = False,
    batch_size: Annotated[
        int,
        typer.Option(
            "--batch-size",
            help=f"Families per batch, each batch one short transaction "
            f"(1..{mechanism.MAX_BATCH}).",
        ),
    ] = mechanism.DEFAULT_BATCH,
    archive: Annotated[
        Path | None,
        typer.Option(
            "--archive",
            help="Directory: write every row to <table>-<time>.jsonl.gz there before it is "
            "deleted (created if missing).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The report as one JSON object.")] = False,
    progress: Annotated[
        bool, typer.Option("--progress", help="A line on stderr after every batch.")
    ] = False,
) -> None:
    """Delete (or archive, then delete) final messages finished before a time, in batches
    that never make a worker wait; prints the rows per table and the time taken."""
    moment = call(mechanism.parse_before, before, SYSTEM)
    size = call(mechanism.check_batch_size, batch_size)
    store = None
    if archive is not None:
        if dry_run:
            raise fail(InvalidMessage("archive", "a dry run writes no archive"))
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        store = call(mechanism.Archive, archive, stamp)

    def _progress(report: mechanism.PurgeReport) -> None:
        if progress:
            err.print(f"batch {report.batches}: {report.total:,} rows, {report.seconds:.1f} s")

    report = call(
        mechanism.purge,
        get_engine(),
        moment,
        batch_size=size,
        dry_run=dry_run,
        archive=store,
        on_batch=_progress,
    )
    if as_json:
        print(json.dumps({**asdict(report), "total": report.total}, default=str))
    else:
        console.print(report.summary(), highlight=False, soft_wrap=True)
        for path in report.archive:
            console.print(f"archive: {path}", highlight=False)
