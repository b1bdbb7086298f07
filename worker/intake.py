"""Intake: the one synchronous path by which a message enters orderly.

Validate, insert NEW (idempotent on correlation_id + source_system), commit, then enqueue.
Bad input raises InvalidMessage before anything is written. The HTTP API, the CLI and the
Python API are thin faces over :class:`Intake`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    field_validator,
)
from sqlalchemy import Engine

from models import MessageState
from worker import nodes
from worker.core.errors import InvalidMessage, ServiceUnavailable, first_line
from worker.core.inputs import parse_input, parse_timestamp
from worker.handlers import HandlerRegistry
from worker.store.prepared import PreparedConnection, prepared_connection
from worker.store.queries import sql

log = logging.getLogger(__name__)

Name = Annotated[
    str, StringConstraints(strict=True, strip_whitespace=True, min_length=1, max_length=100)
]
LongName = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=255)]


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


def parse_message(data: Any, *, max_payload_bytes: int, registry: HandlerRegistry) -> MessageIn:
    """Validate raw input; raise InvalidMessage naming every bad field."""
    message = parse_input(MessageIn, data)
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
        # A funnel message is stored under its funnel's lock, taken in the same query, so a
        # release cannot miss it.
        before=("lock_funnel", (funnel, component)) if funnel is not None else None,
    )
    return None if row is None else (int(row[0]), MessageState(row[1]))


def hand_over(engine: Engine, msg_ids: list[int], enqueue: Callable[[int], None]) -> None:
    """Enqueue messages one by one; should the broker refuse one, it and the rest become
    POSTPONED (the pool hands them over again once the broker answers) and the error is
    raised."""
    for i, msg_id in enumerate(msg_ids):
        try:
            enqueue(msg_id)
        except Exception:
            hand_over_later(engine, msg_ids[i:])
            raise


def hand_over_later(engine: Engine, msg_ids: list[int]) -> None:
    with engine.begin() as conn:
        conn.execute(sql("hand_over_later"), {"ids": msg_ids})


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
            self._hand_over(result.msg_id)
        return result

    def _hand_over(self, msg_id: int) -> None:
        try:
            self._enqueue(msg_id)
        except Exception as exc:
            # The row is durable and stays processed: POSTPONED, the re-processing pool hands
            # it to the broker again once it answers (or, should even this fail, repair takes
            # up the NEW message). The producer is told; submitting again answers 200.
            log.warning("message %s stored but not handed to the broker: %s", msg_id, exc)
            try:
                hand_over_later(self._engine, [msg_id])
            except Exception:
                log.exception("message %s: left NEW for repair", msg_id)
            raise ServiceUnavailable(
                "broker",
                f"{first_line(exc)}; message {msg_id} is stored and will be processed when "
                "the broker answers again (submitting it again answers 200 with this msg_id)",
            ) from exc

    def _store(self, message: MessageIn) -> SubmitResult:
        with prepared_connection(self._engine) as conn:
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
            raise nodes.refusal(conn, self._node_id)
