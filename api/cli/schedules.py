"""``orderly schedule ...``: periodic schedules that produce messages (worker.schedules)."""

from __future__ import annotations

import json
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
)
from orderly.worker.core.cron import iso
from orderly.worker.messages import schedules
from orderly.worker.runtime import get_runtime

schedule_app = typer.Typer(
    help="Periodic schedules: one message per due instant of a cron expression.",
    no_args_is_help=True,
)


def _check() -> schedules.MessageCheck:
    runtime = get_runtime()
    return schedules.message_check(runtime.registry, runtime.settings.max_payload_bytes)


def _show(found: schedules.ScheduleView) -> None:
    console.print_json(json.dumps(found.as_dict(), default=str, ensure_ascii=False))


@schedule_app.command("add")
def schedule_add(
    name: Annotated[str, typer.Argument(help="Unique; letters, digits and . _ : -")],
    cron: Annotated[str, typer.Argument(help="Five fields, e.g. '0 6 * * MON-FRI'")],
    service: Annotated[str, typer.Option(help="The messages' service")],
    operation: Annotated[str, typer.Option(help="The messages' operation")],
    source_system: Annotated[str, typer.Option(help="The messages' source system")],
    payload: Annotated[
        str, typer.Option(help="JSON, or text; {{instant}} and {{name}} are replaced")
    ] = "{}",
    time_zone: Annotated[str, typer.Option("--tz", help="IANA time zone")] = "UTC",
    object_id: Annotated[str | None, typer.Option()] = None,
    entity_type: Annotated[str | None, typer.Option()] = None,
    funnel_value: Annotated[str | None, typer.Option()] = None,
    priority: Annotated[int | None, typer.Option(help="Each message's priority")] = None,
    disabled: Annotated[bool, typer.Option("--disabled", help="Stored, not due yet")] = False,
) -> None:
    """Add a schedule (checked as POST /schedules checks it)."""
    options: dict[str, Any] = {
        "name": name,
        "cron": cron,
        "time_zone": time_zone,
        "service": service,
        "operation": operation,
        "source_system": source_system,
        "payload": parse_payload(payload),
        "object_id": object_id,
        "entity_type": entity_type,
        "funnel_value": funnel_value,
        "priority": priority,
        "enabled": not disabled,
    }
    data = {k: v for k, v in options.items() if v is not None}
    runtime = get_runtime()
    _show(call(schedules.create_schedule, runtime.engine, data, _check(), runtime.clock))


@schedule_app.command("list")
def schedule_list(
    limit: Annotated[int, typer.Option(min=1, max=schedules.MAX_LIST)] = 100,
    as_json: AsJson = False,
) -> None:
    """Every schedule with its next and last instants (UTC)."""
    found = call(schedules.list_schedules, get_runtime().engine, limit=limit)
    if as_json:
        return print_json([s.as_dict() for s in found])
    table = Table("name", "cron", "time zone", "message", "enabled", "next", "last", "last error")
    for s in found:
        table.add_row(
            s.name,
            s.cron,
            s.time_zone,
            f"{s.service}.{s.operation} ({s.source_system})",
            "yes" if s.enabled else "no",
            iso(s.next_at) if s.next_at else "",
            iso(s.last_at) if s.last_at else "",
            s.last_error or "",
        )
    console.print(table)


@schedule_app.command("show")
def schedule_show(name: str) -> None:
    _show(call(schedules.show_schedule, get_runtime().engine, name))


@schedule_app.command("set")
def schedule_set(
    name: str,
    cron: Annotated[str | None, typer.Option(help="A new expression")] = None,
    time_zone: Annotated[str | None, typer.Option("--tz", help="A new time zone")] = None,
    as_json: Annotated[
        str | None,
        typer.Option("--json", help="Fields to change, as PATCH /schedules/NAME takes them"),
    ] = None,
) -> None:
    """Change a schedule's cron expression, time zone or template."""
    changes: dict[str, Any] = {} if as_json is None else json_option(as_json, "body")
    if not isinstance(changes, dict):
        raise fail(ValueError("--json: must be a JSON object"))
    for field, value in (("cron", cron), ("time_zone", time_zone)):
        if value is not None:
            changes[field] = value
    runtime = get_runtime()
    update = schedules.update_schedule
    _show(call(update, runtime.engine, name, changes, _check(), runtime.clock))


def _enable(name: str, enabled: bool) -> None:
    runtime = get_runtime()
    found = call(schedules.set_enabled, runtime.engine, name, enabled, _check(), runtime.clock)
    if found.next_at is None:
        console.print(f"schedule {name} is disabled")
    else:
        console.print(f"schedule {name} is enabled, next due at {iso(found.next_at)}")


@schedule_app.command("enable")
def schedule_enable(name: str) -> None:
    """Due again from its first instant after now (missed ones are not made up)."""
    _enable(name, True)


@schedule_app.command("disable")
def schedule_disable(name: str) -> None:
    _enable(name, False)


@schedule_app.command("remove")
def schedule_remove(name: str) -> None:
    """Remove a schedule; the messages it produced stay."""
    call(schedules.delete_schedule, get_runtime().engine, name)
    console.print(f"schedule {name} removed")
