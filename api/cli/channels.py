"""``orderly channel ...``: the delivery channel of each origin."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from orderly.api.cli.common import AsJson, call, console, print_json
from orderly.worker import channels as channel_defs
from orderly.worker.runtime import get_runtime

channel_app = typer.Typer(help="Delivery channels per origin.", no_args_is_help=True)


@channel_app.command("set")
def channel_set(
    origin: str,
    url: Annotated[str, typer.Option(help="Where responses of this origin are POSTed")],
    delivery_delay_ms: Annotated[int | None, typer.Option()] = None,
    multiplier: Annotated[float | None, typer.Option()] = None,
    attempts: Annotated[int | None, typer.Option()] = None,
    timeout_ms: Annotated[int | None, typer.Option()] = None,
) -> None:
    """Create or change a channel (PUT /channels/{origin})."""
    options = {
        "url": url,
        "delivery_delay_ms": delivery_delay_ms,
        "multiplier": multiplier,
        "attempts": attempts,
        "timeout_ms": timeout_ms,
    }
    runtime = get_runtime()
    channel = call(
        channel_defs.validate,
        origin,
        {k: v for k, v in options.items() if v is not None},
        runtime.settings,
    )
    channel_defs.put_channel(runtime.engine, channel)
    console.print_json(json.dumps(channel.as_dict()))


@channel_app.command("list")
def channel_list(as_json: AsJson = False) -> None:
    found = list(get_runtime().channels.all().values())
    if as_json:
        return print_json([c.as_dict() for c in found])
    table = Table("origin", "url", "delay ms", "multiplier", "attempts", "timeout ms")
    for c in found:
        table.add_row(
            c.origin,
            c.url,
            str(c.delivery_delay_ms),
            str(c.multiplier),
            str(c.attempts),
            str(c.timeout_ms),
        )
    console.print(table)
