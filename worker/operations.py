"""Operator commands on the message store, and external responses that resume messages.

List and inspect messages by state and funnel; cancel a message not yet final (CANCEL);
re-drive a FAILED or CANCEL message (IN_QUEUE again, failures counted anew, an earlier wait
for a response forgotten, and the HARD ancestors it had failed waiting again). Each command
stores an audit note on the message.
A response (``POST /messages/responses``) resumes the message waiting for its correlation
id. Every change runs under the message's funnel lock and enqueues what it releases after
commit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, StrictBool, StringConstraints
from sqlalchemy import Connection, Engine

from models import MessageState
from worker.core.errors import InvalidMessage, MessageNotFound, OperationRefused, ResponseNotAwaited
from worker.core.inputs import parse_input
from worker.pool import released_in
from worker.store.queries import sql

MAX_LIST = 1000


def _state(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return MessageState(value.upper()).value
    except ValueError:
        known = ", ".join(s.value for s in MessageState)
        raise InvalidMessage("state", f"unknown state {value!r} (one of {known})") from None


def list_messages(
    engine: Engine,
    *,
    state: str | None = None,
    funnel: str | None = None,
    service: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    """Messages by state, funnel value and service, oldest msg_timestamp first."""
    if not 1 <= limit <= MAX_LIST:
        raise InvalidMessage("limit", f"must be 1 to {MAX_LIST}")
    params = {"state": _state(state), "funnel": funnel, "service": service, "limit": limit}
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sql("messages_list"), params)]


def inspect_message(engine: Engine, msg_id: int) -> dict[str, Any]:
    """One message with its children, external calls and logged exchanges."""
    with engine.connect() as conn:
        row = conn.execute(sql("message_show"), {"id": msg_id}).first()
        if row is None:
            raise MessageNotFound(msg_id)
        found = dict(row._mapping)
        for part, query in (
            ("children", "message_children"),
            ("external_calls", "message_external_calls"),
            ("exchanges", "message_exchanges"),
        ):
            found[part] = [dict(r._mapping) for r in conn.execute(sql(query), {"id": msg_id})]
    return found


Note = Annotated[str, StringConstraints(strict=True, strip_whitespace=True, min_length=1)]


class CommandIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    note: Annotated[Note, StringConstraints(max_length=1000)]
    by: Annotated[Note, StringConstraints(max_length=100)] | None = None


def _command(data: Any, key: str | None) -> tuple[CommandIn, str]:
    """The command and who the audit trail names: the API key's name when the command came
    through the API (with the ``by`` it gave, if any), else ``by`` or "operator"."""
    if not isinstance(data, dict):
        raise InvalidMessage("body", "must be a JSON object with a note")
    command = parse_input(CommandIn, data)
    if key is None:
        return command, command.by or "operator"
    if command.by is None or command.by == key:
        return command, f"key:{key}"
    return command, f"key:{key} for {command.by}"


def _refusal(conn: Connection, msg_id: int, wanted: str) -> OperationRefused | MessageNotFound:
    row = conn.execute(sql("message_state_of"), {"id": msg_id}).first()
    if row is None:
        return MessageNotFound(msg_id)
    if row.service_name == "conversation":
        return OperationRefused(msg_id, "conversation messages are settled by ordered delivery")
    return OperationRefused(msg_id, f"it is {row.state}; {wanted}")


@dataclass(frozen=True)
class CommandResult:
    msg_id: int
    state: MessageState
    reopened: tuple[int, ...] = ()


def cancel(
    engine: Engine,
    msg_id: int,
    data: Any,
    enqueue: Callable[[int], None],
    *,
    key: str | None = None,
) -> CommandResult:
    """CANCEL a message that is not final yet, with the operator's note (and the name of the
    API key that asked, ``key``)."""
    command, by = _command(data, key)
    with engine.begin() as conn:
        conn.execute(sql("lock_funnel_of"), {"id": msg_id})
        done = conn.execute(
            sql("message_cancel"), {"id": msg_id, "by": by, "note": command.note}
        ).first()
        if done is None:
            raise _refusal(conn, msg_id, "only a message not yet final can be cancelled")
        released = released_in(conn)
    for other in released:
        enqueue(other)
    return CommandResult(msg_id, MessageState.CANCEL)


def redrive(
    engine: Engine,
    msg_id: int,
    data: Any,
    enqueue: Callable[[int], None],
    *,
    key: str | None = None,
) -> CommandResult:
    """Send a FAILED or CANCEL message again (failures counted anew); the HARD ancestors that
    its failure had failed wait for it again. ``key``: as for :func:`cancel`."""
    command, by = _command(data, key)
    params = {"by": by, "note": command.note}
    reopened: list[int] = []
    with engine.begin() as conn:
        conn.execute(sql("lock_funnel_of"), {"id": msg_id})
        done = conn.execute(sql("message_redrive"), {"id": msg_id, **params}).first()
        if done is None:
            raise _refusal(conn, msg_id, "only a FAILED or CANCEL message can be re-driven")
        child, parent = msg_id, done.parent_msg_id
        while parent is not None:
            conn.execute(sql("lock_funnel_of"), {"id": parent})
            up = conn.execute(
                sql("message_reopen_parent"),
                {
                    "id": parent,
                    "because": f"child message {child} %",
                    "by": by,
                    "note": f"child {child} re-driven: {command.note}",
                },
            ).first()
            if up is None:
                break
            reopened.append(parent)
            child, parent = parent, up.parent_msg_id
        released = released_in(conn)
    enqueue(msg_id)
    for other in released:
        enqueue(other)
    return CommandResult(msg_id, MessageState.IN_QUEUE, tuple(reopened))


class ResponseIn(BaseModel):
    """An external system's response to a message parked in WAITING_FOR_RES."""

    model_config = ConfigDict(extra="forbid")

    correlation_id: Annotated[
        str, StringConstraints(strict=True, strip_whitespace=True, min_length=1, max_length=255)
    ]
    payload: str | dict[str, Any] | list[Any] | None = None
    failed: StrictBool = False
    reason: str | None = None


@dataclass(frozen=True)
class ResponseResult:
    msg_id: int
    state: MessageState
    res_id: int
    created: bool  # False: this wait had its response already (nothing changed)


def receive_response(engine: Engine, data: Any, enqueue: Callable[[int], None]) -> ResponseResult:
    """Store the response, end the wait and take the message up again (IN_QUEUE). A response
    that comes before the handler has returned is kept: the message goes on when it does."""
    response = parse_input(ResponseIn, data)
    if response.failed and not response.reason:
        raise InvalidMessage("reason", "required when failed is true")
    envelope = (
        response.payload
        if isinstance(response.payload, str) or response.payload is None
        else json.dumps(response.payload, separators=(",", ":"), ensure_ascii=False)
    )
    with engine.begin() as conn:
        waiting = conn.execute(
            sql("response_waiting_message"), {"cid": response.correlation_id}
        ).first()
        if waiting is None:
            raise ResponseNotAwaited(response.correlation_id)
        if waiting.wait_res_id is not None:
            return ResponseResult(
                waiting.msg_id, MessageState(waiting.state), waiting.wait_res_id, created=False
            )
        res_id = conn.execute(
            sql("response_insert"),
            {
                "msg": waiting.msg_id,
                "cid": response.correlation_id,
                "envelope": envelope,
                "failed": response.failed,
                "reason": response.reason,
            },
        ).scalar_one()
        state = conn.execute(
            sql("response_resume"), {"res": res_id, "msg": waiting.msg_id}
        ).scalar_one()
    if state == MessageState.IN_QUEUE:
        enqueue(waiting.msg_id)
    return ResponseResult(waiting.msg_id, MessageState(state), res_id, created=True)
