"""``orderly status``: a one-line verdict, then the figures of GET /metrics as tables (or all
of it as JSON)."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer

from orderly.api.cli.common import console, err
from orderly.worker.observe import verdict


def status(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """What orderly is doing now. Exit 0 when healthy, 1 when degraded, 2 when a source
    could not be read."""
    from orderly.api.metrics import runtime_figures
    from orderly.api.status import print_status

    figures = runtime_figures()
    healthy, why = verdict(figures)
    if as_json:
        found = {"healthy": healthy, "problems": why, **dataclasses.asdict(figures)}
        print(json.dumps(found, default=str, sort_keys=True))
    else:
        line = "healthy" if healthy else f"degraded: {'; '.join(why)}"
        console.print(f"[bold]{line}[/]", highlight=False)
        print_status(figures, console)
        for source, reason in figures.errors.items():
            err.print(f"[bold red]error:[/] {source.value} could not be read: {reason}")
    if figures.errors:
        raise typer.Exit(code=2)
    if not healthy:
        raise typer.Exit(code=1)
