"""``orderly rebuild``: rebuild what Redis held from PostgreSQL (worker/rebuild.py)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated

import typer

from orderly.api.cli.common import console, err
from orderly.worker import rebuild as mechanism
from orderly.worker.runtime import get_runtime


def rebuild(
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Rebuild even if the Redis marker says Redis holds its state: what is "
            "missing is added, what is there is kept.",
        ),
    ] = False,
    check_only: Annotated[
        bool, typer.Option("--check", help="Only say whether Redis lost its state.")
    ] = False,
) -> None:
    """Rebuild Redis's conversation order, queued tasks and push hand-offs from PostgreSQL
    after Redis lost them (beat does it by itself within a tick)."""
    runtime = get_runtime()
    if check_only:
        reason = mechanism.check(runtime.conversations)
        console.print(f"Redis lost its state: {reason}" if reason else "Redis holds its state")
        raise typer.Exit(code=1 if reason else 0)
    report = mechanism.rebuild(
        runtime.engine,
        runtime.conversations,
        runtime.broker.enqueue_drain,
        runtime.wake_processing,
        force=force,
    )
    if report.busy:
        err.print("another rebuild is running; try again when it ends")
        raise typer.Exit(code=3)
    console.print(report.summary())
    console.print_json(json.dumps(asdict(report)))
