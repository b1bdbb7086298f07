"""``orderly subscription ...``: a room's subscriptions (PUSH, PULL or HANDLER) and their state."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from orderly.api.cli.common import AsJson, call, console, print_json
from orderly.worker import pubsub
from orderly.worker.pubsub import endpoints, replay
from orderly.worker.runtime import get_runtime

subscription_app = typer.Typer(help="Subscriptions of a room.", no_args_is_help=True)


@subscription_app.command("create")
def subscription_create(
    room: str,
    name: str,
    push_url: Annotated[str | None, typer.Option(help="PUSH: where to POST")] = None,
    handler: Annotated[str | None, typer.Option(help="HANDLER: the consumer's name")] = None,
    pull: Annotated[bool, typer.Option(help="PULL: the subscriber fetches")] = False,
    event_type: Annotated[str | None, typer.Option()] = None,
    event_version: Annotated[int | None, typer.Option(help="only this version")] = None,
    min_version: Annotated[int | None, typer.Option(help="versions from")] = None,
    max_version: Annotated[int | None, typer.Option(help="versions up to")] = None,
    pattern: Annotated[str | None, typer.Option(help="routing-key pattern (* and #)")] = None,
    delivery_delay_ms: Annotated[int | None, typer.Option()] = None,
    multiplier: Annotated[float | None, typer.Option()] = None,
    attempts: Annotated[int | None, typer.Option(help="sends at most")] = None,
    rate: Annotated[float | None, typer.Option(help="sends a second at most")] = None,
    burst: Annotated[int | None, typer.Option(help="the rate's bucket (default: the rate)")] = None,
    max_in_flight: Annotated[int | None, typer.Option(help="sends at once at most")] = None,
    order_key: Annotated[str | None, typer.Option(help="payload path to keep order by")] = None,
) -> None:
    """Subscribe to a room (a binding): PUSH, PULL or a consumer HANDLER."""
    kind = "PULL" if pull else "HANDLER" if handler else "PUSH"
    body = {
        "name": name,
        "kind": kind,
        "push_url": push_url,
        "handler": handler,
        "event_type": event_type,
        "event_version": event_version,
        "min_version": min_version,
        "max_version": max_version,
        "routing_key_pattern": pattern,
        "delivery_delay_ms": delivery_delay_ms,
        "delivery_delay_multiplier": multiplier,
        "delivery_attempts": attempts,
        "rate_per_s": rate,
        "burst": burst,
        "max_in_flight": max_in_flight,
        "order_key": order_key,
    }
    sub = call(
        pubsub.create_subscription,
        get_runtime().engine,
        room,
        {k: v for k, v in body.items() if v is not None},
    )
    console.print_json(json.dumps(sub, default=str))


@subscription_app.command("list")
def subscription_list(room: str, as_json: AsJson = False) -> None:
    subs = call(pubsub.list_subscriptions, get_runtime().engine, room)
    if as_json:
        return print_json(subs)
    table = Table(
        "id", "name", "kind", "destination", "event type", "pattern", "status", "endpoint"
    )
    for s_ in subs:
        table.add_row(
            str(s_["subscription_id"]),
            s_["name"],
            s_["kind"],
            s_["push_url"] or s_["handler"] or "pull",
            _selected_type(s_),
            s_["routing_key_pattern"] or "",
            s_["status"],
            s_["circuit"] + (f" ({s_['failures']} failures)" if s_["failures"] else ""),
        )
    console.print(table)


def _selected_type(sub: dict[str, Any]) -> str:
    """``order.created``, ``order.created v2``, ``order.created v2-v4``, ``v2-`` ..."""
    if sub["event_type"] is None:
        return ""
    low, high = sub["min_version"], sub["max_version"]
    if low is None and high is None:
        return str(sub["event_type"])
    if low == high:
        return f"{sub['event_type']} v{low}"
    return f"{sub['event_type']} v{low or 1}-{'' if high is None else high}"


@subscription_app.command("set")
def subscription_set(
    subscription_id: int,
    push_url: Annotated[str | None, typer.Option()] = None,
    pattern: Annotated[str | None, typer.Option(help="routing-key pattern")] = None,
    delivery_delay_ms: Annotated[int | None, typer.Option()] = None,
    multiplier: Annotated[float | None, typer.Option()] = None,
    attempts: Annotated[int | None, typer.Option(help="sends at most")] = None,
    rate: Annotated[float | None, typer.Option(help="sends a second at most")] = None,
    burst: Annotated[int | None, typer.Option(help="the rate's bucket (default: the rate)")] = None,
    max_in_flight: Annotated[int | None, typer.Option(help="sends at once at most")] = None,
) -> None:
    """Change a subscription's destination, pattern or policy overrides."""
    changes = {
        "push_url": push_url,
        "routing_key_pattern": pattern,
        "delivery_delay_ms": delivery_delay_ms,
        "delivery_delay_multiplier": multiplier,
        "delivery_attempts": attempts,
        "rate_per_s": rate,
        "burst": burst,
        "max_in_flight": max_in_flight,
    }
    changed = call(
        pubsub.update_subscription,
        get_runtime().engine,
        subscription_id,
        {k: v for k, v in changes.items() if v is not None},
    )
    console.print_json(json.dumps(changed))


@subscription_app.command("pause")
def subscription_pause(subscription_id: int) -> None:
    call(pubsub.set_subscription_status, get_runtime().engine, subscription_id, "PAUSED")
    console.print(f"subscription {subscription_id} is PAUSED")


@subscription_app.command("enable")
def subscription_enable(subscription_id: int) -> None:
    """Enable an endpoint disabled by its failures (or close its open circuit): its waiting
    deliveries go at once."""
    call(endpoints.enable, get_runtime().engine, subscription_id)
    console.print(f"subscription {subscription_id}'s endpoint is enabled")


@subscription_app.command("replay")
def subscription_replay(
    subscription_id: int,
    since: Annotated[str, typer.Option(help="ISO time with its offset: events published from")],
    until: Annotated[str | None, typer.Option(help="ISO time: published before")] = None,
) -> None:
    """Send a subscription's events again (and backfill the ones it never had)."""
    body = {"since": since} if until is None else {"since": since, "until": until}
    done = call(replay.replay, get_runtime().engine, subscription_id, body)
    console.print(f"{done.replayed} deliveries sent again, {done.backfilled} backfilled")


@subscription_app.command("resume")
def subscription_resume(subscription_id: int) -> None:
    call(pubsub.set_subscription_status, get_runtime().engine, subscription_id, "ACTIVE")
    console.print(f"subscription {subscription_id} is ACTIVE")
