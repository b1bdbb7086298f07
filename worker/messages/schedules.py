"""Periodic schedules: each produces one message per due instant of its cron expression.

A schedule (table ``schedule``) has a unique name, a five-field cron expression read in an
IANA time zone (worker.core.cron: daylight saving time follows the zone) and the template of
its messages: service, operation, source system, payload and the optional message fields.
Beat calls :func:`produce_due` every second; each due instant becomes one message submitted
through the intake (validated, stored, a worker woken after its commit) with

- ``correlation_id`` ``schedule:<name>:<instant>`` (the instant in ISO 8601, UTC, to the
  second: ``schedule:nightly:2026-03-29T01:00:00Z``),
- ``msg_timestamp`` the instant,
- ``payload`` the template with every ``{{instant}}`` (that ISO 8601 instant) and ``{{name}}``
  (the schedule's name) in its strings replaced: plain text substitution, in string values
  only (not in object keys), nothing evaluated.

**Exactly once.** A batch of due schedules (``next_at <= now``) is taken in one transaction,
``FOR UPDATE SKIP LOCKED``: a second producer (another beat) passes over what the first
holds, and once the first commits their next due instant has moved past now. Each message is
submitted through the intake, which commits it on its own connection; the schedule's advance
commits after it. A producer that dies in between leaves the schedule due: the next producer
submits the same instant's message again, and the store's unique (correlation_id,
source_system) answers with the stored message instead of a second one. So the produce is
idempotent and a crash between the two commits is harmless; the store's uniqueness, not the
lock alone, is what makes it once.

**Catch-up: one.** Instants missed while no beat ran (or while the node refused input)
produce one message, for the latest of them; the others are skipped. The next due instant is
always the first one after now. A schedule enabled again starts from now: the instants it
spent disabled are not made up.

**Refusals.** A message the intake refuses for good (a service no handler serves any more,
a payload over the limit) is not retried: the instant is passed over and ``last_error`` says
why. An unreachable service (PostgreSQL, the broker) or a node that takes no input leaves the
schedule due: the batch stops, what it did is committed, and beat tries again a second later.

**Ownership.** A schedule belongs to its messages' source system: a bound key (worker.core.
owners) sees and changes only the schedules of its source systems, checked in the statement
that reads or writes them; another tenant's schedule is not found. Its new schedules' names
begin with one of its source systems and a colon (``crm:nightly``), as its funnel values do,
so that no tenant's name can be taken by another.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StringConstraints
from sqlalchemy import Connection, Engine

from orderly.worker.core import cron as crons
from orderly.worker.core import owners
from orderly.worker.core.clock import SYSTEM, Clock, utcnow
from orderly.worker.core.cron import Cron
from orderly.worker.core.errors import (
    InvalidMessage,
    NodeNotAccepting,
    NodeNotFound,
    NotFound,
    OrderlyError,
    ServiceUnavailable,
)
from orderly.worker.core.inputs import parse_input
from orderly.worker.core.owners import Owns
from orderly.worker.db.queries import sql
from orderly.worker.messages.admission import parse_message
from orderly.worker.messages.handlers import HandlerRegistry
from orderly.worker.messages.inputs import LongName, MessageFields, Name, Payload
from orderly.worker.messages.intake import SubmitResult

log = logging.getLogger(__name__)

# Due schedules one transaction takes, and the batches one turn runs at most.
BATCH = 100
MAX_BATCHES = 10
MAX_LIST = 1000
MAX_OFFSET = 1_000_000
CORRELATION_PREFIX = "schedule"

# Letters, digits and . _ : - (a path segment as it is; a colon after a tenant's source
# system); 64 at most, so that the correlation id fits in 100 characters.
ScheduleName = Annotated[
    str,
    StringConstraints(
        strict=True, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
    ),
]
CronText = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=100)]
ZoneName = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=64)]

# The fields of a schedule's message template, as MessageIn names them.
TEMPLATE = (
    "service",
    "operation",
    "source_system",
    "payload",
    "object_id",
    "entity_type",
    "process_id",
    "funnel_value",
    "funnel_component_id",
    "guaranteed_order",
    "exclude_failed_state",
    "priority",
)
# What a schedule holds besides its name (what a change may set).
SETTABLE = ("cron", "time_zone", *TEMPLATE, "enabled")

_PLACEHOLDER = re.compile(r"\{\{(instant|name)\}\}")

# Validates a message as the intake would (worker.messages.admission.parse_message); raises
# InvalidMessage naming the bad fields.
MessageCheck = Callable[[dict[str, Any]], object]
Submit = Callable[[dict[str, Any]], SubmitResult]


class ScheduleIn(MessageFields):
    """A new schedule: its cron expression and time zone, and its messages' template (the
    message fields; {{instant}} and {{name}} in the payload's strings are replaced)."""

    name: ScheduleName
    cron: CronText
    time_zone: ZoneName = "UTC"
    # Given to each message as its priority (None: the intake's default).
    priority: StrictInt | None = None
    enabled: StrictBool = True


class SchedulePatchIn(BaseModel):
    """A change to a schedule: the fields given replace its own (null clears an optional one);
    the name stays."""

    model_config = ConfigDict(extra="forbid")

    cron: CronText | None = None
    time_zone: ZoneName | None = None
    service: Name | None = None
    operation: Name | None = None
    source_system: Name | None = None
    payload: Payload | None = None
    object_id: Name | None = None
    entity_type: Name | None = None
    process_id: Name | None = None
    funnel_value: LongName | None = None
    funnel_component_id: LongName | None = None
    guaranteed_order: StrictBool | None = None
    exclude_failed_state: StrictBool | None = None
    priority: StrictInt | None = None
    enabled: StrictBool | None = None


@dataclass(frozen=True)
class ScheduleView:
    """A schedule's row, read by column name."""

    name: str
    cron: str
    time_zone: str
    service: str
    operation: str
    source_system: str
    payload: Any
    object_id: str | None
    entity_type: str | None
    process_id: str | None
    funnel_value: str | None
    funnel_component_id: str | None
    guaranteed_order: bool
    exclude_failed_state: bool
    priority: int | None
    enabled: bool
    next_at: datetime | None
    last_at: datetime | None
    last_msg_id: int | None
    last_error: str | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> ScheduleView:
        return cls(**{f.name: row[f.name] for f in fields(cls)})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def settable(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SETTABLE}

    def message(self, instant: datetime) -> dict[str, Any]:
        """The message of one due instant, as the intake takes it."""
        return message_of(self.name, self.settable(), instant)


def correlation_id(name: str, instant: datetime) -> str:
    return f"{CORRELATION_PREFIX}:{name}:{crons.iso(instant)}"


def render(template: Any, name: str, instant: datetime) -> Any:
    """The payload template with ``{{instant}}`` and ``{{name}}`` replaced in its strings."""
    if isinstance(template, str):
        values = {"instant": crons.iso(instant), "name": name}
        return _PLACEHOLDER.sub(lambda found: values[found.group(1)], template)
    if isinstance(template, list):
        return [render(item, name, instant) for item in template]
    if isinstance(template, dict):
        return {key: render(value, name, instant) for key, value in template.items()}
    return template


def message_of(name: str, template: Mapping[str, Any], instant: datetime) -> dict[str, Any]:
    """A message from a template: the optional fields left unset are left out, so the intake
    applies its own defaults."""
    data = {k: template[k] for k in TEMPLATE if k != "payload" and template[k] is not None}
    data["payload"] = render(template["payload"], name, instant)
    data["correlation_id"] = correlation_id(name, instant)
    data["msg_timestamp"] = crons.iso(instant)
    return data


def message_check(registry: HandlerRegistry, max_payload_bytes: int) -> MessageCheck:
    """The intake's validation of a message, for the templates."""
    return functools.partial(parse_message, max_payload_bytes=max_payload_bytes, registry=registry)


def _require_owned(owns: Owns | None, given: ScheduleIn, *, new: bool) -> None:
    """What a bound key may schedule: messages of its source systems (else 404, as if the
    source system did not exist), in funnels and (when ``new``) under names that begin with
    one of them and a colon."""
    owners.require_source_system(owns, given.source_system)
    if owns is None:
        return
    prefixes = tuple(f"{s}:" for s in sorted(owns.source_systems))
    named = [("funnel_value", given.funnel_value)] + ([("name", given.name)] if new else [])
    for what, value in named:
        if value is not None and not value.startswith(prefixes):
            raise InvalidMessage(
                what,
                f"{value!r}: a bound key's {what.replace('_', ' ')}s begin with one of its "
                f"source systems and a colon (e.g. '{given.source_system}:{value}')",
            )


def _checked(
    given: ScheduleIn, check: MessageCheck, owns: Owns | None, now: datetime, *, new: bool
) -> Cron:
    """The schedule's cron in its time zone, after every check: the expression and the zone,
    the key's ownership, and the message of its next instant as the intake validates it."""
    found = crons.parse(given.cron, given.time_zone)
    _require_owned(owns, given, new=new)
    check(message_of(given.name, given.model_dump(), found.next_after(now)))
    return found


def _params(given: ScheduleIn, found: Cron, next_at: datetime | None) -> dict[str, Any]:
    values = given.model_dump()
    return {
        **values,
        "cron": found.expression,
        "payload": json.dumps(values["payload"], ensure_ascii=False),
        "next_at": next_at,
    }


def create_schedule(
    engine: Engine,
    data: Any,
    check: MessageCheck,
    clock: Clock = SYSTEM,
    owns: Owns | None = None,
) -> ScheduleView:
    """Store a new schedule, due at its first instant after now (when enabled). Every field
    is checked first; nothing is written when one is refused."""
    given = parse_input(ScheduleIn, data)
    now = utcnow(clock)
    found = _checked(given, check, owns, now, new=True)
    next_at = found.next_after(now) if given.enabled else None
    with engine.begin() as conn:
        row = (
            conn.execute(sql("schedule_insert"), {**_params(given, found, next_at), "now": now})
            .mappings()
            .first()
        )
    if row is None:
        raise InvalidMessage("name", f"schedule {given.name!r} exists")
    return ScheduleView.from_row(row)


def list_schedules(
    engine: Engine, owns: Owns | None = None, *, limit: int = 100, offset: int = 0
) -> list[ScheduleView]:
    """The schedules by name (``owns``: only the caller's)."""
    if not 1 <= limit <= MAX_LIST:
        raise InvalidMessage("limit", f"must be 1 to {MAX_LIST}")
    if not 0 <= offset <= MAX_OFFSET:
        raise InvalidMessage("offset", f"must be 0 to {MAX_OFFSET}")
    params = {"owned": owners.source_systems(owns), "limit": limit, "offset": offset}
    with engine.connect() as conn:
        rows = conn.execute(sql("schedule_list"), params).mappings().all()
    return [ScheduleView.from_row(r) for r in rows]


def show_schedule(engine: Engine, name: str, owns: Owns | None = None) -> ScheduleView:
    with engine.connect() as conn:
        row = (
            conn.execute(sql("schedule_show"), {"name": name, "owned": owners.source_systems(owns)})
            .mappings()
            .first()
        )
    if row is None:
        raise NotFound("schedule", name)
    return ScheduleView.from_row(row)


def update_schedule(
    engine: Engine,
    name: str,
    data: Any,
    check: MessageCheck,
    clock: Clock = SYSTEM,
    owns: Owns | None = None,
) -> ScheduleView:
    """Change a schedule (``SchedulePatchIn``), checked as a new one is. A new cron
    expression or time zone, or enabling it, makes it due at its first instant after now;
    disabling it clears its next instant. Waits for a producer that holds it."""
    changes = parse_input(SchedulePatchIn, data).model_dump(exclude_unset=True)
    now = utcnow(clock)
    with engine.begin() as conn:
        current = _locked(conn, name, owns)
        given = parse_input(ScheduleIn, {"name": name, **current.settable(), **changes})
        found = _checked(given, check, owns, now, new=False)
        same_times = (found.expression, given.time_zone) == (current.cron, current.time_zone)
        next_at = current.next_at if same_times else None
        if not given.enabled:
            next_at = None
        elif next_at is None:
            next_at = found.next_after(now)
        params = {**_params(given, found, next_at), "now": now}
        row = conn.execute(sql("schedule_update"), params).mappings().one()
    return ScheduleView.from_row(row)


def _locked(conn: Connection, name: str, owns: Owns | None) -> ScheduleView:
    params = {"name": name, "owned": owners.source_systems(owns)}
    row = conn.execute(sql("schedule_lock"), params).mappings().first()
    if row is None:
        raise NotFound("schedule", name)
    return ScheduleView.from_row(row)


def set_enabled(
    engine: Engine,
    name: str,
    enabled: bool,
    check: MessageCheck,
    clock: Clock = SYSTEM,
    owns: Owns | None = None,
) -> ScheduleView:
    return update_schedule(engine, name, {"enabled": enabled}, check, clock, owns)


def delete_schedule(engine: Engine, name: str, owns: Owns | None = None) -> None:
    """Remove a schedule (the messages it produced stay). Waits for a producer that holds
    it."""
    with engine.begin() as conn:
        found = conn.execute(
            sql("schedule_delete"), {"name": name, "owned": owners.source_systems(owns)}
        ).first()
    if found is None:
        raise NotFound("schedule", name)


# --- production --------------------------------------------------------------------------


@dataclass
class ProduceReport:
    """What one turn did: the correlation ids of the messages stored now and of those stored
    before (a producer that died after submitting them), and the schedules whose message was
    refused, with why."""

    produced: list[str] = field(default_factory=list)
    repeated: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


# Failures after which the same submission may succeed: the schedule stays due.
_TRANSIENT = (ServiceUnavailable, NodeNotAccepting, NodeNotFound)


def produce_due(
    engine: Engine, submit: Submit, clock: Clock = SYSTEM, *, batch: int = BATCH
) -> ProduceReport:
    """Submit the message of every due schedule (``submit``: the intake's) and move each to
    its next instant; batches of ``batch``, each one transaction. Raises what made a batch
    stop (an unreachable service), after committing what it did."""
    report = ProduceReport()
    for _ in range(MAX_BATCHES):
        if _produce_batch(engine, submit, utcnow(clock), batch, report) < batch:
            break
    return report


def _produce_batch(
    engine: Engine, submit: Submit, now: datetime, batch: int, report: ProduceReport
) -> int:
    failure: Exception | None = None
    with engine.begin() as conn:
        taken = conn.execute(sql("schedules_take_due"), {"now": now, "limit": batch}).mappings()
        due = [ScheduleView.from_row(row) for row in taken.all()]
        for schedule in due:
            try:
                _produce(conn, schedule, submit, now, report)
            except Exception as exc:
                failure = exc
                break
    if failure is not None:
        raise failure
    return len(due)


def _produce(
    conn: Connection, schedule: ScheduleView, submit: Submit, now: datetime, report: ProduceReport
) -> None:
    """One schedule's message for its latest due instant, and its advance past now."""
    assert schedule.next_at is not None  # taken as due
    try:
        found = crons.parse(schedule.cron, schedule.time_zone)
    except InvalidMessage as exc:
        # Its time zone left the system's database: it cannot be due again until changed.
        _stop(conn, schedule, str(exc), report)
        return
    instant = found.latest_due(schedule.next_at, now)
    msg_id: int | None = None
    error: str | None = None
    try:
        result = submit(schedule.message(instant))
    except _TRANSIENT:
        raise
    except OrderlyError as exc:
        error = str(exc)
        msg_id = getattr(exc, "msg_id", None)  # one stored under the id with other content
        report.refused[schedule.name] = error
        log.warning("schedule %s: the message of %s was refused: %s", schedule.name, instant, exc)
    else:
        msg_id = result.msg_id
        (report.produced if result.created else report.repeated).append(
            correlation_id(schedule.name, instant)
        )
    params = {
        "name": schedule.name,
        "next_at": found.next_after(now),
        "last_at": instant,
        "last_msg_id": msg_id,
        "last_error": error,
    }
    conn.execute(sql("schedule_advance"), params)


def _stop(conn: Connection, schedule: ScheduleView, error: str, report: ProduceReport) -> None:
    report.refused[schedule.name] = error
    log.error("schedule %s disabled: %s", schedule.name, error)
    conn.execute(sql("schedule_stop"), {"name": schedule.name, "error": error})
