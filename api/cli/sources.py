"""``orderly source ...``: source systems and where their messages' final states are confirmed."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from orderly.api.cli.common import AsJson, call, console, print_json
from orderly.worker.messages import confirmations
from orderly.worker.runtime import get_runtime

source_app = typer.Typer(help="Source systems and their confirmation URL.", no_args_is_help=True)


@source_app.command("set")
def source_set(
    name: str,
    confirmation_url: Annotated[str | None, typer.Option(help="None: no confirmations")] = None,
    timeout_ms: Annotated[int, typer.Option()] = 5000,
) -> None:
    """Where final states of this source system's messages are confirmed."""
    saved = call(
        confirmations.set_source_system,
        get_runtime().engine,
        name,
        {"confirmation_url": confirmation_url, "timeout_ms": timeout_ms},
    )
    console.print_json(json.dumps(saved))


@source_app.command("list")
def source_list(as_json: AsJson = False) -> None:
    found = confirmations.list_source_systems(get_runtime().engine)
    if as_json:
        return print_json(found)
    table = Table("name", "confirmation url", "timeout ms")
    for r in found:
        table.add_row(r["name"], r["confirmation_url"] or "", str(r["timeout_ms"]))
    console.print(table)
