"""``orderly submit|show`` and ``orderly message ...``: intake, inspection, operator commands
and external responses."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.table import Table

from orderly.api.cli.common import (
    AsJson,
    call,
    console,
    fail,
    json_option,
    parse_payload,
    print_json,
    show_result,
)
from orderly.worker.core.errors import OrderlyError
from orderly.worker.messages import operations
from orderly.worker.runtime import get_runtime

message_app = typer.Typer(
    help="Messages: list by state and funnel, inspect, cancel, re-drive, respond.",
    no_args_is_help=True,
)


def submit(
    service: Annotated[str | None, typer.Option(help="Service name, e.g. customer")] = None,
    operation: Annotated[str | None, typer.Option(help="Operation name")] = None,
    correlation_id: Annotated[str | None, typer.Option(help="Unique per source system")] = None,
    source_system: Annotated[str | None, typer.Option(help="Sending system")] = None,
    payload: Annotated[str | None, typer.Option(help="Message payload (text)")] = None,
    msg_timestamp: Annotated[str | None, typer.Option(help="ISO 8601; default now")] = None,
    funnel_value: Annotated[str | None, typer.Option()] = None,
    object_id: Annotated[str | None, typer.Option()] = None,
    delay_ms: Annotated[
        int | None, typer.Option(help="Process no earlier than this many ms from now")
    ] = None,
    not_before: Annotated[
        str | None, typer.Option(help="Process no earlier than this time (ISO 8601)")
    ] = None,
    priority: Annotated[
        int | None, typer.Option(help="-100 to 100, default 0: claims take higher first")
    ] = None,
    as_json: Annotated[
        str | None, typer.Option("--json", help="The whole message as JSON ('-' reads stdin)")
    ] = None,
) -> None:
    """Submit one message (the same path as POST /messages). Exit 2 when it is refused, 3
    when another message is stored under its correlation id and source system."""
    options = {
        "service": service,
        "operation": operation,
        "correlation_id": correlation_id,
        "source_system": source_system,
        "payload": payload,
        "msg_timestamp": msg_timestamp,
        "funnel_value": funnel_value,
        "object_id": object_id,
        "delay_ms": delay_ms,
        "not_before": not_before,
        "priority": priority,
    }
    given = {k: v for k, v in options.items() if v is not None}
    data: Any
    if as_json is None:
        data = {"msg_timestamp": datetime.now(UTC).isoformat(), **given}
    elif given:
        # Neither would silently win over the other.
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        raise fail(ValueError(f"--json holds the whole message: give {flags} in it instead"))
    else:
        data = json_option(as_json, "body")
    runtime = get_runtime()
    enqueue = runtime.broker.enqueue_processing
    try:
        result = runtime.intake(enqueue, runtime.wake_processing).submit(data)
    except OrderlyError as exc:
        raise fail(exc) from None
    show_result(
        result.msg_id, result.state.value, "accepted" if result.created else "already known"
    )


def show(msg_id: int) -> None:
    """Show one message's public fields."""
    row = call(operations.inspect_message, get_runtime().engine, msg_id)
    console.print_json(json.dumps(row, default=str))


@message_app.command("list")
def message_list(
    state: Annotated[str | None, typer.Option(help="e.g. FAILED, POSTPONED")] = None,
    funnel: Annotated[str | None, typer.Option(help="funnel value")] = None,
    process_id: Annotated[str | None, typer.Option(help="the process the messages belong to")] = (
        None
    ),
    service: Annotated[str | None, typer.Option()] = None,
    operation: Annotated[str | None, typer.Option()] = None,
    source_system: Annotated[str | None, typer.Option()] = None,
    correlation_id: Annotated[str | None, typer.Option()] = None,
    correlation_match: Annotated[
        str, typer.Option(help="exact, prefix or contains: how --correlation-id matches")
    ] = "exact",
    since: Annotated[str | None, typer.Option(help="msg_timestamp from (ISO 8601)")] = None,
    until: Annotated[str | None, typer.Option(help="msg_timestamp before (ISO 8601)")] = None,
    limit: Annotated[int, typer.Option()] = 100,
    offset: Annotated[int, typer.Option()] = 0,
    as_json: AsJson = False,
) -> None:
    """Messages by state, service, operation, source system, correlation id, funnel, process
    and time, oldest msg_timestamp first."""
    rows = call(
        operations.list_messages,
        get_runtime().engine,
        state=state,
        funnel=funnel,
        process_id=process_id,
        service=service,
        operation=operation,
        source_system=source_system,
        correlation_id=correlation_id,
        correlation_match=correlation_match,
        since=since,
        until=until,
        limit=limit,
        offset=offset,
    )
    if as_json:
        return print_json(rows)
    table = Table("id", "state", "service.operation", "correlation", "funnel", "fails", "error")
    for r in rows:
        table.add_row(
            str(r["msg_id"]),
            r["state"],
            f"{r['service_name']}.{r['operation_name']}",
            f"{r['source_system']}:{r['correlation_id']}",
            r["funnel_value"] or "",
            str(r["failed_count"]),
            r["failed_error_code"] or "",
        )
    console.print(table)


@message_app.command("show")
def message_show(msg_id: int) -> None:
    """One message with its children, external calls, exchanges and audit notes."""
    show(msg_id)


def _operator_command(verb: str, msg_id: int, note: str, by: str) -> None:
    runtime = get_runtime()
    extra_args = {"announce": runtime.announce_aborts} if verb == "cancel" else {}
    command = operations.cancel if verb == "cancel" else operations.redrive
    body = {"note": note, "by": by}
    done = call(
        command, runtime.engine, msg_id, body, runtime.broker.enqueue_processing, **extra_args
    )
    extra = {"cancelled": list(done.cancelled)} if verb == "cancel" else {}
    show_result(done.msg_id, done.state.value, verb, **extra)


@message_app.command("cancel")
def message_cancel(
    msg_id: int,
    note: Annotated[str, typer.Option(help="Why (stored on the message)")],
    by: Annotated[str, typer.Option(help="Who")] = "operator",
) -> None:
    """Cancel a message that is not final yet (CANCEL)."""
    _operator_command("cancel", msg_id, note, by)


@message_app.command("redrive")
def message_redrive(
    msg_id: int,
    note: Annotated[str, typer.Option(help="Why (stored on the message)")],
    by: Annotated[str, typer.Option(help="Who")] = "operator",
) -> None:
    """Send a FAILED or CANCEL message again."""
    _operator_command("redrive", msg_id, note, by)


@message_app.command("respond")
def message_respond(
    correlation_id: str,
    payload: Annotated[str | None, typer.Option(help="JSON or text")] = None,
    failed: Annotated[bool, typer.Option(help="The external system reports a failure")] = False,
    reason: Annotated[str | None, typer.Option()] = None,
) -> None:
    """Deliver an external response to the message waiting for it (POST /messages/responses)."""
    data: dict[str, Any] = {"correlation_id": correlation_id, "failed": failed}
    if payload is not None:
        data["payload"] = parse_payload(payload)
    if reason is not None:
        data["reason"] = reason
    runtime = get_runtime()
    result = call(
        operations.receive_response, runtime.engine, data, runtime.broker.enqueue_processing
    )
    show_result(
        result.msg_id, result.state.value, "resumed" if result.created else "already answered"
    )
