"""``orderly log ...``: the pub/sub logs: the queue message log, its exceptions (one with its
traceback) and the published_messages rows, filtered by message and queue, newest first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.table import Table

from orderly.api.cli.common import AsJson, call, console, print_json
from orderly.worker import pubsub
from orderly.worker.runtime import get_runtime

log_app = typer.Typer(
    help="Pub/sub logs: queue messages, exceptions, published messages.", no_args_is_help=True
)

Delivery = Annotated[int | None, typer.Option("--delivery", help="one delivery's rows")]
Correlation = Annotated[
    str | None, typer.Option("--correlation-id", help="every delivery of one event")
]
Subscription = Annotated[int | None, typer.Option("--subscription", help="one queue's rows")]
RoutingKey = Annotated[str | None, typer.Option("--routing-key")]
Limit = Annotated[int, typer.Option(help="at most this many rows")]
Before = Annotated[int | None, typer.Option(help="rows older than this id")]


def _rows(fn: Callable[..., list[dict[str, Any]]], **filters: Any) -> list[dict[str, Any]]:
    asked = {k: v for k, v in filters.items() if v is not None}
    return call(fn, get_runtime().engine, **asked)


def _time(value: Any) -> str:
    return "" if value is None else value.isoformat(timespec="milliseconds")


@log_app.command("queue")
def queue(
    delivery: Delivery = None,
    correlation_id: Correlation = None,
    subscription: Subscription = None,
    routing_key: RoutingKey = None,
    state: Annotated[str | None, typer.Option(help="Pending, In process, Completed, Error")] = None,
    limit: Limit = 100,
    before: Before = None,
    as_json: AsJson = False,
) -> None:
    """The queue message log: a row per state a delivery entered."""
    rows = _rows(
        pubsub.queue_log,
        delivery_id=delivery,
        correlation_id=correlation_id,
        subscription_id=subscription,
        routing_key=routing_key,
        state=state,
        limit=limit,
        before=before,
    )
    if as_json:
        return print_json(rows)
    table = Table("id", "delivery", "attempt", "state", "routing key", "scheduled", "start",
                  "end", "exception", "memory")  # fmt: skip
    for r in rows:
        table.add_row(
            str(r["id"]),
            str(r["delivery_id"]),
            str(r["attempt"]),
            r["state"],
            r["routing_key"],
            _time(r["scheduled_start_time"]),
            _time(r["start_time"]),
            _time(r["end_time"]),
            "" if r["exception_id"] is None else str(r["exception_id"]),
            "" if r["memory_used"] is None else str(r["memory_used"]),
        )
    console.print(table)


@log_app.command("exceptions")
def exceptions(
    delivery: Delivery = None,
    correlation_id: Correlation = None,
    subscription: Subscription = None,
    routing_key: RoutingKey = None,
    type: Annotated[str | None, typer.Option("--type", help="the exception's type")] = None,
    limit: Limit = 100,
    before: Before = None,
    as_json: AsJson = False,
) -> None:
    """What went wrong in attempts (``orderly log exception ID`` shows one's traceback)."""
    rows = _rows(
        pubsub.exception_list,
        delivery_id=delivery,
        correlation_id=correlation_id,
        subscription_id=subscription,
        routing_key=routing_key,
        type=type,
        limit=limit,
        before=before,
    )
    if as_json:
        return print_json(rows)
    table = Table("id", "time", "delivery", "attempt", "type", "message")
    for r in rows:
        table.add_row(
            str(r["id"]),
            _time(r["time"]),
            str(r["delivery_id"]),
            str(r["attempt"]),
            r["type"],
            r["message"],
        )
    console.print(table)


@log_app.command("exception")
def exception(exception_id: int, as_json: AsJson = False) -> None:
    """One exception with its traceback."""
    found = call(pubsub.exception_get, get_runtime().engine, exception_id)
    if as_json:
        return print_json(found)
    console.print(
        f"exception {found['id']} at {_time(found['time'])}: delivery {found['delivery_id']} "
        f"attempt {found['attempt']} (event {found['correlation_id']}, subscription "
        f"{found['subscription_id']}, routing key {found['routing_key']})",
        markup=False,
    )
    console.print(f"{found['type']}: {found['message']}", markup=False)
    if found["traceback"]:
        console.print(found["traceback"], markup=False, highlight=False)


@log_app.command("published")
def published(
    delivery: Delivery = None,
    correlation_id: Correlation = None,
    subscription: Subscription = None,
    routing_key: RoutingKey = None,
    state: Annotated[
        str | None, typer.Option(help="the outcome: PENDING, DELIVERED, FAILED, DEAD, EXPIRED")
    ] = None,
    limit: Limit = 100,
    before: Before = None,
    as_json: AsJson = False,
) -> None:
    """published_messages: one row per attempt of an event for a subscription."""
    rows = _rows(
        pubsub.published_log,
        delivery_id=delivery,
        correlation_id=correlation_id,
        subscription_id=subscription,
        routing_key=routing_key,
        state=state,
        limit=limit,
        before=before,
    )
    if as_json:
        return print_json(rows)
    table = Table("id", "delivery", "subscription", "attempt", "outcome", "published",
                  "next attempt", "delivered", "error")  # fmt: skip
    for r in rows:
        table.add_row(
            str(r["id"]),
            str(r["delivery_id"]),
            str(r["subscription_id"]),
            str(r["attempt"]),
            r["outcome"],
            _time(r["published_at"]),
            _time(r["next_attempt_at"]),
            _time(r["delivered_at"]),
            r["error"] or "",
        )
    console.print(table)
