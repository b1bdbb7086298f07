"""``python -m tooling``: the main job (``demo``) and synthetic data (``generate``)."""

from __future__ import annotations

import os

# The main job's sink and the stack it starts listen on loopback, which the outbound address
# policy refuses unless allowed: allowed explicitly (an operator's own setting wins).
os.environ.setdefault("ORDERLY_OUTBOUND_ALLOW", "127.0.0.1")

from datetime import datetime
from typing import Annotated

import typer
from rich.table import Table

from orderly.api.cli.common import console, fail, run
from orderly.worker.runtime import get_runtime

app = typer.Typer(
    help="orderly's demo and data tooling (not needed to run orderly).", no_args_is_help=True
)


@app.command()
def demo(
    messages: Annotated[int, typer.Option(help="How many messages to submit")] = 3000,
    workers: Annotated[int, typer.Option(help="Worker processes")] = 2,
    port: Annotated[int, typer.Option(help="Port for the API")] = 8765,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for final states")] = 300,
    conversations: Annotated[int, typer.Option(help="Conversations to deliver")] = 200,
) -> None:
    """The main job: migrate, start API + workers + beat, submit, watch, report, stop."""
    from tooling.mainjob import run_main_job

    raise typer.Exit(
        run_main_job(
            messages=messages,
            workers=workers,
            port=port,
            timeout=timeout,
            console=console,
            conversations=conversations,
        )
    )


@app.command()
def generate(
    messages: Annotated[int, typer.Argument(help="How many messages (a positive number)")],
    seed: Annotated[int, typer.Option(help="The same seed, N and start give the same rows")] = 0,
    days: Annotated[float, typer.Option(help="Length of the time window in days")] = 7.0,
    start: Annotated[
        str | None, typer.Option(help="Window start, ISO 8601 (default: DAYS before now)")
    ] = None,
) -> None:
    """Fill the store with realistic synthetic data: N messages and the rows around them."""
    from tooling.generate import generate as run_generate

    moment = None
    if start is not None:
        try:
            moment = datetime.fromisoformat(start.strip().replace("Z", "+00:00"))
        except ValueError:
            raise fail(ValueError(f"--start {start!r} is not an ISO 8601 timestamp")) from None
    try:
        done = run_generate(get_runtime().engine, messages, seed=seed, start=moment, days=days)
    except ValueError as exc:
        raise fail(exc) from None
    table = Table("table", "new rows")
    for name, count in done.rows.items():
        table.add_row(name, f"{count:,}")
    table.add_row("total", f"{done.total_rows:,}")
    console.print(table)
    console.print(
        f"{done.start.isoformat()} .. {done.end.isoformat()}: {done.total_rows:,} rows in "
        f"{done.seconds:.1f} s ({done.rows_per_second:,.0f} rows/s)"
    )


def main() -> None:
    run(app)


if __name__ == "__main__":
    main()
