"""The ``orderly`` command line: thin commands over the mechanisms in worker.*."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from models import NodeState
from worker import configuration, confirmations, nodes, operations
from worker.core.errors import OrderlyError
from worker.runtime import get_runtime
from worker.settings import get_settings
from worker.store import schema

app = typer.Typer(
    help="orderly: ordered delivery over Celery, Redis and PostgreSQL.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Read and change the configuration table.", no_args_is_help=True)
node_app = typer.Typer(
    help="List nodes and move them between RUN, drain and STOPPED.", no_args_is_help=True
)
conversation_app = typer.Typer(
    help="Conversations: register requests, add responses, ACK, inspect.", no_args_is_help=True
)
channel_app = typer.Typer(help="Delivery channels per origin.", no_args_is_help=True)
room_app = typer.Typer(help="Rooms: create, list, change, pause.", no_args_is_help=True)
subscription_app = typer.Typer(help="Subscriptions of a room.", no_args_is_help=True)
dead_app = typer.Typer(help="Dead-lettered deliveries: list and re-drive.", no_args_is_help=True)
message_app = typer.Typer(
    help="Messages: list by state and funnel, inspect, cancel, re-drive, respond.",
    no_args_is_help=True,
)
source_app = typer.Typer(help="Source systems and their confirmation URL.", no_args_is_help=True)
app.add_typer(message_app, name="message")
app.add_typer(source_app, name="source")
app.add_typer(room_app, name="room")
app.add_typer(subscription_app, name="subscription")
app.add_typer(dead_app, name="dead-letter")
app.add_typer(conversation_app, name="conversation")
app.add_typer(channel_app, name="channel")
app.add_typer(config_app, name="config")
app.add_typer(node_app, name="node")

console = Console()
err = Console(stderr=True)


def _show(msg_id: int, state: str, verb: str) -> None:
    console.print_json(json.dumps({"msg_id": msg_id, "state": state, "result": verb}))


def _fail(exc: Exception) -> typer.Exit:
    err.print(f"[bold red]error:[/] {exc}")
    return typer.Exit(code=2)


@app.command()
def migrate(
    create_database: Annotated[
        bool, typer.Option(help="Create the database first if the server lacks it")
    ] = False,
) -> None:
    """Create or upgrade the database schema and seed configuration defaults."""
    runtime = get_runtime()
    if create_database and schema.create_database(runtime.settings.database_url):
        console.print(f"created database {runtime.engine.url.database}")
    schema.upgrade(runtime.settings.database_url)
    runtime.startup_check()
    console.print("[green]database is at the latest revision[/]")


@app.command()
def submit(
    service: Annotated[str | None, typer.Option(help="Service name, e.g. customer")] = None,
    operation: Annotated[str | None, typer.Option(help="Operation name")] = None,
    correlation_id: Annotated[str | None, typer.Option(help="Unique per source system")] = None,
    source_system: Annotated[str | None, typer.Option(help="Sending system")] = None,
    payload: Annotated[str | None, typer.Option(help="Message payload (text)")] = None,
    msg_timestamp: Annotated[str | None, typer.Option(help="ISO 8601; default now")] = None,
    funnel_value: Annotated[str | None, typer.Option()] = None,
    object_id: Annotated[str | None, typer.Option()] = None,
    as_json: Annotated[
        str | None, typer.Option("--json", help="The whole message as JSON ('-' reads stdin)")
    ] = None,
) -> None:
    """Submit one message (the same path as POST /messages)."""
    from worker.celery import enqueue_processing

    data: Any
    if as_json is not None:
        text = sys.stdin.read() if as_json == "-" else as_json
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _fail(ValueError(f"body: malformed JSON: {exc}")) from None
    else:
        options = {
            "service": service,
            "operation": operation,
            "correlation_id": correlation_id,
            "source_system": source_system,
            "payload": payload,
            "msg_timestamp": msg_timestamp or datetime.now(UTC).isoformat(),
            "funnel_value": funnel_value,
            "object_id": object_id,
        }
        data = {k: v for k, v in options.items() if v is not None}
    runtime = get_runtime()
    try:
        result = runtime.intake(enqueue_processing).submit(data)
    except OrderlyError as exc:
        raise _fail(exc) from None
    _show(result.msg_id, result.state.value, "accepted" if result.created else "already known")


@app.command()
def show(msg_id: int) -> None:
    """Show one message's public fields."""
    try:
        row = operations.inspect_message(get_runtime().engine, msg_id)
    except OrderlyError as exc:
        raise _fail(exc) from None
    console.print_json(json.dumps(row, default=str))


@app.command()
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


@app.command()
def report(
    since: Annotated[str | None, typer.Option(help="Window start (ISO; UTC if no offset).")] = None,
    until: Annotated[str | None, typer.Option(help="Window end, exclusive.")] = None,
    incremental: Annotated[
        bool, typer.Option(help="Read only rows after the stored watermark, then move it.")
    ] = False,
    watermark: Annotated[str, typer.Option(help="The watermark's name.")] = "default",
    lag_minutes: Annotated[
        float,
        typer.Option(help="Incremental: leave out the last minutes (rows not yet committed)."),
    ] = 1.0,
    output_dir: Annotated[
        str | None, typer.Option(help="Default: ORDERLY_REPORT_OUTPUT_DIR.")
    ] = None,
    to_postgres: Annotated[
        bool, typer.Option(help="Also append the aggregates to report_* tables.")
    ] = False,
    master: Annotated[
        str | None, typer.Option(help="Spark master (local[*], spark://...).")
    ] = None,
) -> None:
    """Spark report over the message store: Parquet, CSV and one HTML file per run."""
    from reports.job import main as report_main

    argv = ["--watermark", watermark, "--lag-minutes", str(lag_minutes)]
    for flag, value in (
        ("--since", since),
        ("--until", until),
        ("--output-dir", output_dir),
        ("--master", master),
    ):
        if value is not None:
            argv += [flag, value]
    if incremental:
        argv.append("--incremental")
    if to_postgres:
        argv.append("--to-postgres")
    raise typer.Exit(report_main(argv))


@config_app.command("list")
def config_list() -> None:
    table = Table("code", "value", "default", "type", "mandatory", "validation")
    for row in configuration.list_items(get_runtime().engine):
        table.add_row(
            row.code,
            row.current_value or "",
            row.default_value or "",
            row.data_type.value,
            str(row.mandatory),
            row.validation or "",
        )
    console.print(table)


@config_app.command("get")
def config_get(code: str) -> None:
    try:
        row = configuration.get_item(get_runtime().engine, code)
    except OrderlyError as exc:
        raise _fail(exc) from None
    value = row.current_value if row.current_value is not None else row.default_value
    console.print(value if value is not None else "")


@config_app.command("set")
def config_set(code: str, value: str) -> None:
    """Set a current value (validated against the item's type and regex)."""
    try:
        configuration.set_value(get_runtime().engine, code, value)
    except OrderlyError as exc:
        raise _fail(exc) from None
    console.print(f"{code} = {value}")


@config_app.command("unset")
def config_unset(code: str) -> None:
    """Clear the current value so the default applies."""
    try:
        configuration.set_value(get_runtime().engine, code, None)
    except OrderlyError as exc:
        raise _fail(exc) from None
    console.print(f"{code} uses its default")


def _move(code: str, state: NodeState) -> None:
    try:
        nodes.set_state(get_runtime().engine, code, state)
    except OrderlyError as exc:
        raise _fail(exc) from None
    console.print(f"node {code} is {state.value}")


@node_app.command("run")
def node_run(code: str) -> None:
    """Accept new messages and process (RUN)."""
    _move(code, NodeState.RUN)


@node_app.command("drain")
def node_drain(code: str) -> None:
    """Refuse new messages, finish existing work (HANDLES_EXISTING_MESSAGES)."""
    _move(code, NodeState.HANDLES_EXISTING_MESSAGES)


@node_app.command("stop")
def node_stop(
    code: str,
    exit_: Annotated[
        bool,
        typer.Option(
            "--exit",
            help="Also end the node's worker processes: their service keys are deleted, and "
            "each finishes the tasks in hand and exits.",
        ),
    ] = False,
) -> None:
    """Refuse new messages and process nothing (STOPPED)."""
    _move(code, NodeState.STOPPED)
    if exit_:
        stopped = get_runtime().services.stop_node(code)
        ids = ", ".join(str(i) for i in stopped) or "none alive"
        console.print(f"workers of node {code} told to exit: {ids}")


@node_app.command("list")
def node_list() -> None:
    runtime = get_runtime()
    timeout = runtime.config.get_int("cluster.nodeHeartbeatTimeoutSec")
    workers: dict[str, list[str]] = {}
    try:
        live = runtime.services.live()
    except Exception as exc:
        err.print(f"[yellow]workers unknown: the tracking Redis could not be read: {exc}[/]")
        live = []
    for service in live:
        code = service.fields.get("node_code", "")
        where = f"{service.service_id} ({service.fields.get('hostname', '')})"
        workers.setdefault(code, []).append(where)
    table = Table("id", "code", "state", "last heartbeat", "alive", "workers (service keys)")
    for n in nodes.list_nodes(runtime.engine, timeout):
        table.add_row(
            str(n.node_id),
            n.code,
            n.state.value,
            str(n.last_heartbeat or ""),
            "yes" if n.alive else "no",
            ", ".join(workers.get(n.code, [])),
        )
    console.print(table)


def _payload(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # plain text is a string payload


@conversation_app.command("request")
def conversation_request(
    conversation_id: str,
    request_id: Annotated[str, typer.Option(help="The request's unique id")],
    origin: Annotated[str, typer.Option(help="The client channel, e.g. whatsapp")],
    payload: Annotated[str | None, typer.Option(help="JSON or text")] = None,
    timestamp: Annotated[str | None, typer.Option(help="ISO 8601; default now")] = None,
) -> None:
    """Register a user's request (POST /conversations/{id}/requests)."""
    data: dict[str, Any] = {"request_id": request_id, "origin": origin}
    if payload is not None:
        data["payload"] = _payload(payload)
    if timestamp is not None:
        data["timestamp"] = timestamp
    try:
        result = get_runtime().conversations.register_request(conversation_id, data)
    except OrderlyError as exc:
        raise _fail(exc) from None
    _show(result.msg_id, result.state.value, "registered" if result.created else "already known")


@conversation_app.command("respond")
def conversation_respond(
    conversation_id: str,
    request_id: Annotated[str, typer.Option(help="The request answered")],
    response_id: Annotated[str, typer.Option(help="The response's unique id")],
    payload: Annotated[str, typer.Option(help="JSON or text")],
    last: Annotated[bool, typer.Option(help="The request's final response")] = False,
    timestamp: Annotated[str | None, typer.Option(help="ISO 8601; default now")] = None,
) -> None:
    """Add a response to deliver in order (POST /conversations/{id}/responses)."""
    from worker.celery import enqueue_drain

    data: dict[str, Any] = {
        "request_id": request_id,
        "response_id": response_id,
        "payload": _payload(payload),
        "last": last,
    }
    if timestamp is not None:
        data["timestamp"] = timestamp
    try:
        result = get_runtime().conversations.add_response(conversation_id, data, enqueue_drain)
    except OrderlyError as exc:
        raise _fail(exc) from None
    _show(result.msg_id, result.state.value, "accepted" if result.created else "already known")


@conversation_app.command("ack")
def conversation_ack(async_response_id: str) -> None:
    """ACK a response the client answered with 202 (POST /acks/{id})."""
    from worker.celery import enqueue_drain

    try:
        msg_id = get_runtime().conversations.ack(async_response_id, enqueue_drain)
    except OrderlyError as exc:
        raise _fail(exc) from None
    console.print_json(json.dumps({"msg_id": msg_id, "state": "OK"}))


@conversation_app.command("show")
def conversation_show(conversation_id: str) -> None:
    """What Redis holds for a conversation: requests and responses in delivery order."""
    console.print_json(json.dumps(get_runtime().conversations.describe(conversation_id)))


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
    from worker import channels

    options = {
        "url": url,
        "delivery_delay_ms": delivery_delay_ms,
        "multiplier": multiplier,
        "attempts": attempts,
        "timeout_ms": timeout_ms,
    }
    runtime = get_runtime()
    try:
        channel = channels.validate(
            origin, {k: v for k, v in options.items() if v is not None}, runtime.settings
        )
    except OrderlyError as exc:
        raise _fail(exc) from None
    channels.put_channel(runtime.engine, channel)
    console.print_json(json.dumps(channel.as_dict()))


@channel_app.command("list")
def channel_list() -> None:
    table = Table("origin", "url", "delay ms", "multiplier", "attempts", "timeout ms")
    for c in get_runtime().channels.all().values():
        table.add_row(
            c.origin,
            c.url,
            str(c.delivery_delay_ms),
            str(c.multiplier),
            str(c.attempts),
            str(c.timeout_ms),
        )
    console.print(table)


def _run(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except OrderlyError as exc:
        raise _fail(exc) from None


@room_app.command("create")
def room_create(
    name: str,
    delivery_delay_ms: Annotated[int, typer.Option(help="deliveryDelay")] = 1000,
    multiplier: Annotated[float, typer.Option(help="deliveryDelayMultiplier")] = 1.5,
    attempts: Annotated[int, typer.Option(help="deliveryAttempts (0: no redelivery)")] = 3,
    expiration_ms: Annotated[int | None, typer.Option(help="messageExpiration")] = None,
) -> None:
    """Create a room (an exchange)."""
    from worker import pubsub

    room = _run(
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
def room_list() -> None:
    from worker import pubsub

    table = Table(
        "room", "delay ms", "multiplier", "attempts", "expiration ms", "status", "unroutable"
    )
    for r in pubsub.list_rooms(get_runtime().engine):
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
    from worker import pubsub

    changes = {
        "status": status,
        "delivery_delay_ms": delivery_delay_ms,
        "delivery_delay_multiplier": multiplier,
        "delivery_attempts": attempts,
    }
    room = _run(
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
    from worker import pubsub

    text_ = sys.stdin.read() if schema == "-" else schema
    try:
        parsed = json.loads(text_)
    except json.JSONDecodeError as exc:
        raise _fail(ValueError(f"schema: malformed JSON: {exc}")) from None
    added = _run(
        pubsub.add_event_type,
        get_runtime().engine,
        room,
        {"name": name, "version": version, "schema": parsed},
    )
    console.print_json(json.dumps(added))


@subscription_app.command("create")
def subscription_create(
    room: str,
    name: str,
    push_url: Annotated[str | None, typer.Option(help="PUSH: where to POST")] = None,
    handler: Annotated[str | None, typer.Option(help="HANDLER: the consumer's name")] = None,
    pull: Annotated[bool, typer.Option(help="PULL: the subscriber fetches")] = False,
    event_type: Annotated[str | None, typer.Option()] = None,
    pattern: Annotated[str | None, typer.Option(help="routing-key pattern (* and #)")] = None,
    delivery_delay_ms: Annotated[int | None, typer.Option()] = None,
    multiplier: Annotated[float | None, typer.Option()] = None,
    attempts: Annotated[int | None, typer.Option()] = None,
    order_key: Annotated[str | None, typer.Option(help="payload path to keep order by")] = None,
) -> None:
    """Subscribe to a room (a binding): PUSH, PULL or a consumer HANDLER."""
    from worker import pubsub

    kind = "PULL" if pull else "HANDLER" if handler else "PUSH"
    body = {
        "name": name,
        "kind": kind,
        "push_url": push_url,
        "handler": handler,
        "event_type": event_type,
        "routing_key_pattern": pattern,
        "delivery_delay_ms": delivery_delay_ms,
        "delivery_delay_multiplier": multiplier,
        "delivery_attempts": attempts,
        "order_key": order_key,
    }
    sub = _run(
        pubsub.create_subscription,
        get_runtime().engine,
        room,
        {k: v for k, v in body.items() if v is not None},
    )
    console.print_json(json.dumps(sub, default=str))


@subscription_app.command("list")
def subscription_list(room: str) -> None:
    from worker import pubsub

    subs = _run(pubsub.list_subscriptions, get_runtime().engine, room)
    table = Table("id", "name", "kind", "destination", "pattern", "status")
    for s_ in subs:
        table.add_row(
            str(s_["subscription_id"]),
            s_["name"],
            s_["kind"],
            s_["push_url"] or s_["handler"] or "pull",
            s_["routing_key_pattern"] or "",
            s_["status"],
        )
    console.print(table)


@subscription_app.command("set")
def subscription_set(
    subscription_id: int,
    push_url: Annotated[str | None, typer.Option()] = None,
    pattern: Annotated[str | None, typer.Option(help="routing-key pattern")] = None,
    delivery_delay_ms: Annotated[int | None, typer.Option()] = None,
    multiplier: Annotated[float | None, typer.Option()] = None,
    attempts: Annotated[int | None, typer.Option()] = None,
) -> None:
    """Change a subscription's destination, pattern or policy overrides."""
    from worker import pubsub

    changes = {
        "push_url": push_url,
        "routing_key_pattern": pattern,
        "delivery_delay_ms": delivery_delay_ms,
        "delivery_delay_multiplier": multiplier,
        "delivery_attempts": attempts,
    }
    changed = _run(
        pubsub.update_subscription,
        get_runtime().engine,
        subscription_id,
        {k: v for k, v in changes.items() if v is not None},
    )
    console.print_json(json.dumps(changed))


@room_app.command("event-types")
def room_event_types(room: str) -> None:
    """List a room's event types and their versions."""
    from worker import pubsub

    for t in _run(pubsub.list_event_types, get_runtime().engine, room):
        console.print(f"{t['name']} v{t['version']}: {json.dumps(t['schema'])}")


@subscription_app.command("pause")
def subscription_pause(subscription_id: int) -> None:
    from worker import pubsub

    _run(pubsub.set_subscription_status, get_runtime().engine, subscription_id, "PAUSED")
    console.print(f"subscription {subscription_id} is PAUSED")


@subscription_app.command("resume")
def subscription_resume(subscription_id: int) -> None:
    from worker import pubsub

    _run(pubsub.set_subscription_status, get_runtime().engine, subscription_id, "ACTIVE")
    console.print(f"subscription {subscription_id} is ACTIVE")


@app.command()
def publish(
    room: str,
    message: Annotated[str, typer.Argument(help="The payload: JSON, or text")],
    routing_key: Annotated[str | None, typer.Option(help="Default: the event type")] = None,
    event_type: Annotated[str | None, typer.Option()] = None,
    delay_ms: Annotated[int, typer.Option("--delay", help="$delay in ms")] = 0,
    user: Annotated[str | None, typer.Option(help="The producing user")] = None,
    publisher: Annotated[str | None, typer.Option()] = None,
) -> None:
    """Publish a message to a room (POST /rooms/{room}/events)."""
    from worker import pubsub
    from worker.celery import enqueue_event_deliveries

    runtime = get_runtime()
    body = {
        "payload": _payload(message),
        "routing_key": routing_key,
        "event_type": event_type,
        "$delay": delay_ms,
        "user": user,
        "publisher": publisher,
    }
    try:
        result, due = pubsub.publish(
            runtime.engine,
            room,
            {k: v for k, v in body.items() if v is not None},
            secret=runtime.settings.token_secret,
            token_ttl_ms=runtime.settings.token_ttl_ms,
        )
    except OrderlyError as exc:
        raise _fail(exc) from None
    if due:
        enqueue_event_deliveries(due)
    console.print_json(
        json.dumps(
            {
                "correlation_id": result.correlation_id,
                "deliveries": result.deliveries,
                "unroutable": result.unroutable,
            }
        )
    )


@dead_app.command("list")
def dead_list(room: Annotated[str | None, typer.Option()] = None) -> None:
    from worker import pubsub

    table = Table("delivery", "subscription", "room", "routing key", "attempts", "reason")
    for d in pubsub.dead_letters(get_runtime().engine, room):
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
    from worker import pubsub

    if not delivery_id and subscription is None:
        raise _fail(ValueError("name --delivery-id or --subscription"))
    moved = pubsub.redrive(get_runtime().engine, delivery_id or None, subscription)
    console.print(f"re-driven: {moved}")


@message_app.command("list")
def message_list(
    state: Annotated[str | None, typer.Option(help="e.g. FAILED, POSTPONED")] = None,
    funnel: Annotated[str | None, typer.Option(help="funnel value")] = None,
    service: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option()] = 100,
) -> None:
    """Messages by state and funnel, oldest msg_timestamp first."""
    try:
        rows = operations.list_messages(
            get_runtime().engine, state=state, funnel=funnel, service=service, limit=limit
        )
    except OrderlyError as exc:
        raise _fail(exc) from None
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
    from worker.celery import enqueue_processing

    command = operations.cancel if verb == "cancel" else operations.redrive
    try:
        done = command(get_runtime().engine, msg_id, {"note": note, "by": by}, enqueue_processing)
    except OrderlyError as exc:
        raise _fail(exc) from None
    _show(done.msg_id, done.state.value, verb)


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
    from worker.celery import enqueue_processing

    data: dict[str, Any] = {"correlation_id": correlation_id, "failed": failed}
    if payload is not None:
        data["payload"] = _payload(payload)
    if reason is not None:
        data["reason"] = reason
    try:
        result = operations.receive_response(get_runtime().engine, data, enqueue_processing)
    except OrderlyError as exc:
        raise _fail(exc) from None
    _show(result.msg_id, result.state.value, "resumed" if result.created else "already answered")


@source_app.command("set")
def source_set(
    name: str,
    confirmation_url: Annotated[str | None, typer.Option(help="None: no confirmations")] = None,
    timeout_ms: Annotated[int, typer.Option()] = 5000,
) -> None:
    """Where final states of this source system's messages are confirmed."""
    try:
        saved = confirmations.set_source_system(
            get_runtime().engine,
            name,
            {"confirmation_url": confirmation_url, "timeout_ms": timeout_ms},
        )
    except OrderlyError as exc:
        raise _fail(exc) from None
    console.print_json(json.dumps(saved))


@source_app.command("list")
def source_list() -> None:
    table = Table("name", "confirmation url", "timeout ms")
    for r in confirmations.list_source_systems(get_runtime().engine):
        table.add_row(r["name"], r["confirmation_url"] or "", str(r["timeout_ms"]))
    console.print(table)


def main() -> None:
    try:
        logging.basicConfig(
            level=get_settings().log_level, format="%(levelname)s %(name)s: %(message)s"
        )
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
        app()
    except OrderlyError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        raise SystemExit(2) from None
    except ValidationError as exc:
        err.print(f"[bold red]invalid settings:[/] {exc}")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
