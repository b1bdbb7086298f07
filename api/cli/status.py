"""``orderly status``: the figures of GET /metrics, printed as tables."""

from __future__ import annotations

import typer

from api.cli.common import console, err


def status() -> None:
    """What orderly is doing now: the figures of GET /metrics, as tables."""
    from api.metrics import runtime_figures
    from api.status import print_status

    figures = runtime_figures()
    print_status(figures, console)
    for source, reason in figures.errors.items():
        err.print(f"[bold red]error:[/] {source.value} could not be read: {reason}")
    if figures.errors:
        raise typer.Exit(code=2)
