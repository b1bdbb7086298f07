"""Intake: the one synchronous path by which a message enters orderly.

Validate, insert NEW (idempotent on correlation_id + source_system), commit, then enqueue.
Bad input raises InvalidMessage before anything is written. The HTTP API, the CLI and the
Python API are thin faces over :class:`Intake`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    ValidationError,
    field_validator,
)
from sqlalchemy import Engine

from models import MessageState
from worker.errors import InvalidMessage, NodeNotAccepting
from worker.handlers import HandlerRegistry
from worker.prepared import Prepared, PreparedConnection, PreparedSet

log = logging.getLogger(__name__)

Name = Annotated[
    str, StringConstraints(strict=True, strip_whitespace=True, min_length=1, max_length=100)
]
LongName = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=255)]


def parse_timestamp(value: Any) -> datetime:
    """An ISO 8601 timestamp (or a datetime); one without an offset is taken as UTC."""
    if isinstance(value, datetime):
        parsed = value
    elif isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(
                f"{value!r} is not an ISO 8601 timestamp (e.g. 2026-01-31T12:00:00Z)"
            ) from None
    else:
        raise ValueError(f"must be an ISO 8601 timestamp string, got {type(value).__name__}")
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def invalid_from(exc: ValidationError) -> InvalidMessage:
    """A pydantic error as InvalidMessage: each bad field named once, with its problem."""
    seen: dict[str, str] = {}
    for err in exc.errors():
        # union members add their type to the location; keep the field name only
        field = _field_name(tuple(err["loc"])[:1])
        problem = "missing" if err["type"] == "missing" else err["msg"]
        if err["type"] == "extra_forbidden":
            problem = "unknown field"
        seen.setdefault(field, problem)
    items = list(seen.items())
    return InvalidMessage(items[0][0], items[0][1], *items[1:])


class MessageIn(BaseModel):
    """A message as a producer submits it."""

    model_config = ConfigDict(extra="forbid")

    service: Name
    operation: Name
    correlation_id: Name
    source_system: Name
    msg_timestamp: datetime
    payload: str | dict[str, Any] | list[Any]
    object_id: Name | None = None
    entity_type: Name | None = None
    process_id: Name | None = None
    funnel_value: LongName | None = None
    funnel_component_id: LongName | None = None
    guaranteed_order: StrictBool = False
    exclude_failed_state: StrictBool = False
    parent_msg_id: Annotated[StrictInt, Field(gt=0)] | None = None
    envelope: str | None = None

    @field_validator("msg_timestamp", mode="before")
    @classmethod
    def _timestamp(cls, value: Any) -> datetime:
        return parse_timestamp(value)

    @property
    def payload_text(self) -> str:
        if isinstance(self.payload, str):
            return self.payload
        return json.dumps(self.payload, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class SubmitResult:
    msg_id: int
    state: MessageState
    created: bool


def _field_name(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "body"


def parse_message(data: Any, *, max_payload_bytes: int, registry: HandlerRegistry) -> MessageIn:
    """Validate raw input; raise InvalidMessage naming every bad field."""
    if not isinstance(data, Mapping):
        raise InvalidMessage("body", f"must be a JSON object, got {type(data).__name__}")
    try:
        message = MessageIn.model_validate(dict(data))
    except ValidationError as exc:
        raise invalid_from(exc) from None
    size = len(message.payload_text.encode("utf-8"))
    if size > max_payload_bytes:
        raise InvalidMessage(
            "payload", f"{size} bytes is over the limit of {max_payload_bytes} bytes"
        )
    if registry.get(message.service, message.operation) is None:
        if not registry.has_service(message.service):
            raise InvalidMessage("service", f"unknown service {message.service!r}")
        raise InvalidMessage(
            "operation", f"unknown operation {message.operation!r} of service {message.service!r}"
        )
    if message.exclude_failed_state and not message.guaranteed_order:
        raise InvalidMessage("exclude_failed_state", "only meaningful with guaranteed_order true")
    return message


# The node check and the insert are one statement: a node that stops accepting input cannot
# race an insert; a duplicate (correlation_id, source_system) inserts nothing. A message of a
# funnel is stored POSTPONED (and not enqueued) when its funnel holds it back; it is sent
# before that under the funnel's lock (FUNNEL_LOCK), so a release cannot miss it.
_INSERT_COLUMNS = (
    "msg_timestamp",
    "service_name",
    "operation_name",
    "object_id",
    "entity_type",
    "correlation_id",
    "process_id",
    "payload",
    "envelope",
    "source_system",
    "parent_msg_id",
    "parent_binding_type",
    "funnel_value",
    "funnel_component_id",
    "guaranteed_order",
    "exclude_failed_state",
    "node_id",
)
FUNNEL_LOCK = "SELECT pg_advisory_xact_lock(orderly_funnel_key(%s, %s)); "
STATEMENTS = (
    Prepared(
        "orderly_insert_message",
        (
            "timestamptz",
            "text",
            "text",
            "text",
            "text",
            "text",
            "text",
            "text",
            "text",
            "text",
            "bigint",
            "text",
            "text",
            "text",
            "boolean",
            "boolean",
            "bigint",
            "boolean",
        ),
        f"""
        INSERT INTO message ({", ".join(_INSERT_COLUMNS)},
                             receive_timestamp, last_process_timestamp, state, failed_count)
        SELECT {", ".join(f"${i}" for i in range(1, len(_INSERT_COLUMNS) + 1))},
               now(), now(),
               CASE WHEN $13 IS NOT NULL
                         AND orderly_funnel_blocked(NULL, $13, $14, $1, $15, $16)
                    THEN 'POSTPONED' ELSE 'NEW' END,
               0
        -- $18: new input needs the node in RUN (a child of existing work does not)
        WHERE NOT $18 OR EXISTS (SELECT 1 FROM node WHERE node_id = $17 AND state = 'RUN')
        ON CONFLICT (correlation_id, source_system) DO NOTHING
        RETURNING msg_id, state
        """,
    ),
    Prepared(
        "orderly_find_message",
        ("text", "text"),
        "SELECT msg_id, state FROM message WHERE correlation_id = $1 AND source_system = $2",
    ),
    Prepared("orderly_node_state", ("bigint",), "SELECT code, state FROM node WHERE node_id = $1"),
)


def insert_values(message: MessageIn, node_id: int, binding: str | None = None) -> tuple[Any, ...]:
    """The arguments of ``orderly_insert_message`` but the last (whether RUN is needed)."""
    return (
        message.msg_timestamp,
        message.service,
        message.operation,
        message.object_id,
        message.entity_type,
        message.correlation_id,
        message.process_id,
        message.payload_text,
        message.envelope,
        message.source_system,
        message.parent_msg_id,
        binding or ("HARD" if message.parent_msg_id is not None else None),
        message.funnel_value,
        message.funnel_component_id,
        message.guaranteed_order,
        message.exclude_failed_state,
        node_id,
    )


def insert_message(
    conn: PreparedConnection, values: tuple[Any, ...], *, require_run: bool
) -> tuple[int, MessageState] | None:
    """Insert one message (NEW, or POSTPONED behind its funnel); None if it already exists or
    the node refuses input."""
    funnel, component = values[12], values[13]
    row = conn.run(
        "orderly_insert_message",
        *values,
        require_run,
        before=FUNNEL_LOCK if funnel is not None else "",
        before_args=(funnel, component) if funnel is not None else (),
    )
    return None if row is None else (int(row[0]), MessageState(row[1]))


class Intake:
    """Accepts messages through one node; ``enqueue`` is called with the msg_id after commit."""

    def __init__(
        self,
        engine: Engine,
        *,
        node_id: int,
        enqueue: Callable[[int], None],
        registry: HandlerRegistry,
        max_payload_bytes: int,
    ) -> None:
        self._engine = engine
        self._statements = PreparedSet(engine, STATEMENTS)
        self._node_id = node_id
        self._enqueue = enqueue
        self._registry = registry
        self._max_payload_bytes = max_payload_bytes

    def submit(self, data: Any) -> SubmitResult:
        message = parse_message(
            data, max_payload_bytes=self._max_payload_bytes, registry=self._registry
        )
        result = self._store(message)
        # A POSTPONED message waits for its funnel to release it; it has no task until then.
        if result.created and result.state is MessageState.NEW:
            try:
                self._enqueue(result.msg_id)
            except Exception:
                # The row is durable; repair moves a NEW message that was never picked up.
                log.exception(
                    "message %s stored but not enqueued; repair will retry it", result.msg_id
                )
        return result

    def _store(self, message: MessageIn) -> SubmitResult:
        with self._statements.connection() as conn:
            try:
                inserted = insert_message(
                    conn, insert_values(message, self._node_id), require_run=True
                )
            except self._engine.dialect.loaded_dbapi.IntegrityError as exc:
                if "parent_msg_id" in str(exc):
                    raise InvalidMessage(
                        "parent_msg_id", f"no message {message.parent_msg_id} exists"
                    ) from None
                raise
            if inserted is not None:
                return SubmitResult(inserted[0], inserted[1], created=True)
            existing = conn.run(
                "orderly_find_message", message.correlation_id, message.source_system
            )
            if existing is not None:
                return SubmitResult(int(existing[0]), MessageState(existing[1]), created=False)
            node = conn.run("orderly_node_state", self._node_id)
            assert node is not None, f"node {self._node_id} is not registered"
            raise NodeNotAccepting(node[0], node[1])


PUBLIC_FIELDS = (
    "msg_id",
    "state",
    "service_name",
    "operation_name",
    "correlation_id",
    "source_system",
    "msg_timestamp",
    "receive_timestamp",
    "last_process_timestamp",
    "start_in_queue_timestamp",
    "object_id",
    "entity_type",
    "process_id",
    "funnel_value",
    "funnel_component_id",
    "guaranteed_order",
    "exclude_failed_state",
    "parent_msg_id",
    "parent_binding_type",
    "failed_count",
    "failed_error_code",
    "failed_desc",
    "custom_data",
    "node_id",
    "obsolete_by",
    "wait_correlation_id",
    "response_deadline",
    "wait_res_id",
    "audit",
    "payload",
)
