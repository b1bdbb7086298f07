"""``orderly dead-letter ...``: deliveries that ran out of attempts, listed and sent again."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from orderly.api.cli.common import AsJson, console, fail, print_json
from orderly.worker import pubsub
from orderly.worker.runtime import get_runtime

dead_app = typer.Typer(help="Dead-lettered deliveries: list and re-drive.", no_args_is_help=True)


@dead_app.command("list")
def dead_list(room: Annotated[str | None, typer.Option()] = None, as_json: AsJson = False) -> None:
    found = pubsub.dead_letters(get_runtime().engine, room)
    if as_json:
        return print_json(found)
    table = Table("delivery", "subscription", "room", "routing key", "attempts", "reason")
    for d in found:
        table.add_row(
            str(d["delivery_id"]),
            str(d["subscription_id"]),
            d["room"],
            d["routing_key"],
            str(d["attempt"]),
            d["last_error"] or "",
        )
    console.print(table)


@dead_app.command("redrive")
def dead_redrive(
    delivery_id: Annotated[list[int] | None, typer.Option(help="Deliveries to send again")] = None,
    subscription: Annotated[int | None, typer.Option(help="All of a subscription's")] = None,
) -> None:
    """Send dead-lettered deliveries again (attempts start over)."""
    if not delivery_id and subscription is None:
        raise fail(ValueError("name --delivery-id or --subscription"))
    moved = pubsub.redrive(get_runtime().engine, delivery_id or None, subscription)
    console.print(f"re-driven: {moved}")
