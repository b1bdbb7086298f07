"""``orderly room ...`` and ``orderly publish``: pub/sub rooms, their event types, publishing."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from orderly.api.cli.common import AsJson, call, console, json_option, parse_payload, print_json
from orderly.worker import pubsub
from orderly.worker.pubsub import waiting
from orderly.worker.runtime import get_runtime

room_app = typer.Typer(help="Rooms: create, list, change, pause.", no_args_is_help=True)


@room_app.command("create")
def room_create(
    name: str,
    delivery_delay_ms: Annotated[int, typer.Option(help="deliveryDelay")] = 1000,
    multiplier: Annotated[float, typer.Option(help="deliveryDelayMultiplier")] = 1.5,
    attempts: Annotated[int, typer.Option(help="deliveryAttempts: sends at most")] = 3,
    expiration_ms: Annotated[int | None, typer.Option(help="messageExpiration")] = None,
) -> None:
    """Create a room (an exchange)."""
    room = call(
        pubsub.create_room,
        get_runtime().engine,
        {
            "name": name,
            "delivery_delay_ms": delivery_delay_ms,
            "delivery_delay_multiplier": multiplier,
            "delivery_attempts": attempts,
            "message_expiration_ms": expiration_ms,
        },
    )
    console.print_json(json.dumps(room))


@room_app.command("list")
def room_list(as_json: AsJson = False) -> None:
    found = pubsub.list_rooms(get_runtime().engine)
    if as_json:
        return print_json(found)
    table = Table(
        "room", "delay ms", "multiplier", "attempts", "expiration ms", "status", "unroutable"
    )
    for r in found:
        table.add_row(
            r["name"],
            str(r["delivery_delay_ms"]),
            str(r["delivery_delay_multiplier"]),
            str(r["delivery_attempts"]),
            str(r["message_expiration_ms"] or "never"),
            r["status"],
            str(r["unroutable"]),
        )
    console.print(table)


@room_app.command("set")
def room_set(
    name: str,
    status: Annotated[str | None, typer.Option(help="ACTIVE or PAUSED")] = None,
    delivery_delay_ms: Annotated[int | None, typer.Option()] = None,
    multiplier: Annotated[float | None, typer.Option()] = None,
    attempts: Annotated[int | None, typer.Option()] = None,
) -> None:
    """Change a room's policy, or pause and resume it."""
    changes = {
        "status": status,
        "delivery_delay_ms": delivery_delay_ms,
        "delivery_delay_multiplier": multiplier,
        "delivery_attempts": attempts,
    }
    room = call(
        pubsub.update_room,
        get_runtime().engine,
        name,
        {k: v for k, v in changes.items() if v is not None},
    )
    console.print_json(json.dumps(room))


@room_app.command("event-type")
def room_event_type(
    room: str,
    name: str,
    version: Annotated[int, typer.Option(help="The version this schema defines")],
    schema: Annotated[str, typer.Option(help="JSON schema of the payload ('-' reads stdin)")],
) -> None:
    """Add an event type's version with its JSON schema."""
    parsed = json_option(schema, "schema")
    added = call(
        pubsub.add_event_type,
        get_runtime().engine,
        room,
        {"name": name, "version": version, "schema": parsed},
    )
    console.print_json(json.dumps(added))


@room_app.command("event-types")
def room_event_types(room: str) -> None:
    """List a room's event types and their versions."""
    for t in call(pubsub.list_event_types, get_runtime().engine, room):
        console.print(f"{t['name']} v{t['version']}: {json.dumps(t['schema'])}")


def publish(
    room: str,
    message: Annotated[str, typer.Argument(help="The payload: JSON, or text")],
    routing_key: Annotated[str | None, typer.Option(help="Default: the event type")] = None,
    event_type: Annotated[str | None, typer.Option()] = None,
    delay_ms: Annotated[int, typer.Option("--delay", help="$delay in ms")] = 0,
    user: Annotated[str | None, typer.Option(help="The producing user")] = None,
    publisher: Annotated[str | None, typer.Option()] = None,
    to: Annotated[
        list[str] | None,
        typer.Option("--to", help="A subscription it goes to, whatever it selects (repeat)"),
    ] = None,
) -> None:
    """Publish a message to a room (POST /rooms/{room}/events)."""
    runtime = get_runtime()
    body = {
        "payload": parse_payload(message),
        "routing_key": routing_key,
        "event_type": event_type,
        "$delay": delay_ms,
        "user": user,
        "publisher": publisher,
        "destinations": to or None,
    }
    result, due = call(
        pubsub.publish,
        runtime.engine,
        room,
        {k: v for k, v in body.items() if v is not None},
        secret=runtime.settings.token_secret,
        token_ttl_ms=runtime.settings.token_ttl_ms,
        node_id=runtime.node_id,
    )
    waiting.announce(runtime.redis, result.pulled)
    pubsub.hand_off(due, runtime.broker.enqueue_event_deliveries)
    console.print_json(
        json.dumps(
            {
                "correlation_id": result.correlation_id,
                "deliveries": result.deliveries,
                "unroutable": result.unroutable,
            }
        )
    )
