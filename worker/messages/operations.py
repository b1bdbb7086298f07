"""Operator commands on the message store, and external responses that resume messages.

List and inspect messages by state and funnel; cancel a message not yet final (CANCEL), and
its HARD descendants not final with it; re-drive a FAILED or CANCEL message (IN_QUEUE again,
failures counted anew, an earlier wait for a response forgotten, and the HARD ancestors it had
failed waiting again). Each command stores an audit note on every message it changes.
A response (``POST /messages/responses``) resumes the message waiting for its correlation
id. Every change runs under the message's funnel lock and enqueues what it releases after
commit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    StrictBool,
    StringConstraints,
    ValidationInfo,
    field_validator,
)
from sqlalchemy import Connection, Engine

from orderly.models import FINAL_STATES, MessageState
from orderly.worker.core import owners
from orderly.worker.core.errors import (
    InvalidMessage,
    MessageNotFound,
    OperationRefused,
    ResponseNotAwaited,
)
from orderly.worker.core.inputs import parse_input, parse_timestamp
from orderly.worker.core.owners import Owns
from orderly.worker.db.queries import sql
from orderly.worker.messages.watchdogs import released_in

MAX_LIST = 1000
MAX_OFFSET = 1_000_000

Filter = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=100)]
# An ISO 8601 time (a number is not taken for one); without a zone, UTC.
Moment = Annotated[datetime, BeforeValidator(parse_timestamp)]


def _state_value(value: str) -> str:
    try:
        return MessageState(value.upper()).value
    except ValueError:
        known = ", ".join(s.value for s in MessageState)
        raise ValueError(f"unknown state {value!r} (one of {known})") from None


class MessageFilter(BaseModel):
    """Which messages a listing shows: every field given must match (None: any)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state: MessageState | None = None
    service: Filter | None = None
    operation: Filter | None = None
    source_system: Filter | None = None
    correlation_id: Filter | None = None
    funnel: Annotated[str, StringConstraints(strict=True, min_length=1, max_length=255)] | None = (
        None
    )
    process_id: Filter | None = None
    since: Moment | None = None  # msg_timestamp at or after
    until: Moment | None = None  # msg_timestamp before
    # how correlation_id matches: the whole id, its start, or anywhere in it
    correlation_match: Literal["exact", "prefix", "contains"] = "exact"

    @field_validator("state", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return _state_value(value) if isinstance(value, str) else value

    @field_validator("until")
    @classmethod
    def _window(cls, until: datetime | None, info: ValidationInfo) -> datetime | None:
        since = info.data.get("since")
        if until is not None and since is not None and until <= since:
            raise ValueError("must be later than since")
        return until

    def _like(self) -> str | None:
        """The LIKE pattern of a prefix or contains match (its own % and _ taken literally)."""
        if self.correlation_id is None or self.correlation_match == "exact":
            return None
        escaped = re.sub(r"([\\%_])", r"\\\1", self.correlation_id)
        return f"{escaped}%" if self.correlation_match == "prefix" else f"%{escaped}%"

    def params(self) -> dict[str, Any]:
        return {
            "state": None if self.state is None else self.state.value,
            "funnel": self.funnel,
            "process": self.process_id,
            "service": self.service,
            "operation": self.operation,
            "source": self.source_system,
            "cid": self.correlation_id if self.correlation_match == "exact" else None,
            "cid_like": self._like(),
            "since": self.since,
            "until": self.until,
        }


def message_filter(**given: Any) -> MessageFilter:
    """A MessageFilter from loose values (empty ones left out); InvalidMessage names a bad one."""
    return parse_input(MessageFilter, {k: v for k, v in given.items() if v not in (None, "")})


def list_messages(
    engine: Engine,
    found: MessageFilter | None = None,
    *,
    limit: int = 100,
    offset: int = 0,
    newest_first: bool = False,
    owns: Owns | None = None,
    **filters: Any,
) -> list[dict[str, Any]]:
    """Messages matching ``found`` (or the ``filters`` a MessageFilter takes), oldest
    msg_timestamp first, or newest first; ``limit`` of them after ``offset``. ``owns``: only
    the caller's (worker.core.owners; None: every message)."""
    if not 1 <= limit <= MAX_LIST:
        raise InvalidMessage("limit", f"must be 1 to {MAX_LIST}")
    if not 0 <= offset <= MAX_OFFSET:
        raise InvalidMessage("offset", f"must be 0 to {MAX_OFFSET}")
    chosen = found if found is not None else message_filter(**filters)
    params = {
        **chosen.params(),
        "limit": limit,
        "offset": offset,
        "newest": newest_first,
        "owned": owners.source_systems(owns),
    }
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sql("messages_list"), params)]


def count_by_state(
    engine: Engine, found: MessageFilter, owns: Owns | None = None
) -> dict[MessageState, int]:
    """How many messages match ``found`` but its state, for every state (0 when none)."""
    counts = dict.fromkeys(MessageState, 0)
    with engine.connect() as conn:
        for row in conn.execute(
            sql("messages_count_by_state"),
            {**found.params(), "owned": owners.source_systems(owns)},
        ):
            counts[MessageState(row.state)] = int(row.n)
    return counts


@dataclass(frozen=True)
class ConversationHistory:
    """A conversation's requests in the order they were made, each with its responses in
    their order (``turns``); ``cut``: it has more rows than were read."""

    turns: list[tuple[dict[str, Any], list[dict[str, Any]]]]
    cut: bool


def conversation_history(
    engine: Engine, conversation_id: str, owns: Owns | None = None
) -> ConversationHistory:
    """A conversation's request and response rows, grouped by request (``owns``: of the
    caller's origins only)."""
    with engine.connect() as conn:
        rows = [
            dict(r._mapping)
            for r in conn.execute(
                sql("conversation_messages"),
                {"cid": conversation_id, "limit": MAX_LIST + 1, "owned": owners.origins(owns)},
            )
        ]
    cut = len(rows) > MAX_LIST
    rows = rows[:MAX_LIST]
    answers: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if r["operation_name"] == "response" and r["parent_msg_id"] is not None:
            answers.setdefault(r["parent_msg_id"], []).append(r)
    turns = [(r, answers.get(r["msg_id"], [])) for r in rows if r["operation_name"] == "request"]
    return ConversationHistory(turns, cut)


def late_responses(
    engine: Engine, limit: int = 50, owns: Owns | None = None
) -> list[dict[str, Any]]:
    """The newest conversation responses that were handed to their client late."""
    params = {"limit": limit, "owned": owners.origins(owns)}
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sql("late_responses_recent"), params)]


def inspect_message(engine: Engine, msg_id: int, owns: Owns | None = None) -> dict[str, Any]:
    """One message with its children, external calls and logged exchanges (``owns``: one of
    the caller's, else MessageNotFound)."""
    with engine.connect() as conn:
        row = conn.execute(
            sql("message_show"), {"id": msg_id, "owned": owners.source_systems(owns)}
        ).first()
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


def check_command(data: Any, key: str | None = None) -> None:
    """Refuse a command body (its note, its ``by``) before anything is done with it."""
    _command(data, key)


def _refusal(
    conn: Connection, msg_id: int, wanted: str, owns: Owns | None
) -> OperationRefused | MessageNotFound:
    owned = owners.source_systems(owns)
    row = conn.execute(sql("message_state_of"), {"id": msg_id, "owned": owned}).first()
    if row is None:
        return MessageNotFound(msg_id)
    if row.service_name == "conversation":
        return OperationRefused(msg_id, "conversation messages are settled by ordered delivery")
    return OperationRefused(msg_id, f"it is {row.state}; {wanted}")


def _require_own(conn: Connection, msg_id: int, owns: Owns | None) -> None:
    """A bound key's command on another tenant's message stops here, before it takes (or
    waits for) any lock of that tenant's; the command's own statement checks again."""
    if owns is None:
        return
    owned = owners.source_systems(owns)
    if conn.execute(sql("message_state_of"), {"id": msg_id, "owned": owned}).first() is None:
        raise MessageNotFound(msg_id)


@dataclass(frozen=True)
class CommandResult:
    msg_id: int
    state: MessageState
    reopened: tuple[int, ...] = ()
    cancelled: tuple[int, ...] = ()  # a cancel's HARD descendants, cancelled with it


def cancel(
    engine: Engine,
    msg_id: int,
    data: Any,
    enqueue: Callable[[int], None],
    *,
    key: str | None = None,
    owns: Owns | None = None,
    announce: Callable[[Sequence[int]], object] | None = None,
) -> CommandResult:
    """CANCEL a message that is not final yet, with the operator's note (and the name of the
    API key that asked, ``key``), and with it its HARD children not final yet, theirs, and so
    on down (each with an audit entry naming its parent); SOFT children go on. One
    transaction: the funnel locks of the whole tree first (in key order), then the rows.
    After the commit ``announce`` gets every message cancelled: a worker running one of them
    stops its handler (worker.messages.abort; ``Runtime.announce_aborts``)."""
    command, by = _command(data, key)
    params = {"by": by, "note": command.note, "owned": owners.source_systems(owns)}
    cancelled: list[int] = []
    with engine.begin() as conn:
        _require_own(conn, msg_id, owns)
        tree = [r.msg_id for r in conn.execute(sql("cancel_hard_descendants"), {"id": msg_id})]
        conn.execute(sql("lock_funnels_of_ids"), {"ids": [msg_id, *tree]})
        done = conn.execute(sql("message_cancel"), {"id": msg_id, **params}).first()
        if done is None:
            raise _refusal(conn, msg_id, "only a message not yet final can be cancelled", owns)
        # Level by level, each statement seeing what committed since the last: a child
        # stored meanwhile (by a handler that finished) is reached too.
        level = [msg_id]
        while level:
            conn.execute(sql("lock_funnels_of_hard_children"), {"ids": level})
            level = [
                r.msg_id
                for r in conn.execute(sql("message_cancel_hard_children"), {"ids": level, **params})
            ]
            cancelled.extend(level)
        released = released_in(conn)
    if announce is not None:
        announce([msg_id, *cancelled])
    for other in released:
        enqueue(other)
    return CommandResult(msg_id, MessageState.CANCEL, cancelled=tuple(sorted(cancelled)))


def redrive(
    engine: Engine,
    msg_id: int,
    data: Any,
    enqueue: Callable[[int], None],
    *,
    key: str | None = None,
    owns: Owns | None = None,
) -> CommandResult:
    """Send a FAILED or CANCEL message again (failures counted anew); the HARD ancestors that
    its failure had failed wait for it again. ``key``: as for :func:`cancel`."""
    command, by = _command(data, key)
    params = {"by": by, "note": command.note, "owned": owners.source_systems(owns)}
    reopened: list[int] = []
    with engine.begin() as conn:
        _require_own(conn, msg_id, owns)
        conn.execute(sql("lock_funnel_of"), {"id": msg_id})
        done = conn.execute(sql("message_redrive"), {"id": msg_id, **params}).first()
        if done is None:
            raise _refusal(conn, msg_id, "only a FAILED or CANCEL message can be re-driven", owns)
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


def receive_response(
    engine: Engine,
    data: Any,
    enqueue: Callable[[int], None],
    *,
    note: str | None = None,
    key: str | None = None,
    msg_id: int | None = None,
    owns: Owns | None = None,
) -> ResponseResult:
    """Store the response, end the wait and take the message up again (IN_QUEUE). A response
    that comes before the handler has returned is kept: the message goes on when it does.

    ``note``: an operator answering by hand says why; it goes into the audit trail as
    RESPOND, under the API key's name ``key`` (as for :func:`cancel`). ``msg_id``: the
    message that must be the one waiting (else OperationRefused, and nothing is written).
    ``owns``: the caller's objects; a message of another source system does not wait for
    it (ResponseNotAwaited, nothing written)."""
    response = parse_input(ResponseIn, data)
    audit = None if note is None else _command({"note": note}, key)
    if response.failed and not response.reason:
        raise InvalidMessage("reason", "required when failed is true")
    if not response.failed and response.payload is None:
        # the seed: a response without its envelope is a failed one, with its reason
        raise InvalidMessage("payload", "required unless failed is true (with a reason)")
    envelope = (
        response.payload
        if isinstance(response.payload, str) or response.payload is None
        else json.dumps(response.payload, separators=(",", ":"), ensure_ascii=False)
    )
    with engine.begin() as conn:
        waiting = conn.execute(
            sql("response_waiting_message"),
            {"cid": response.correlation_id, "owned": owners.source_systems(owns)},
        ).first()
        if waiting is None:
            raise ResponseNotAwaited(response.correlation_id)
        if msg_id is not None and waiting.msg_id != msg_id:
            raise OperationRefused(msg_id, "it no longer waits for that response")
        if waiting.wait_res_id is not None:
            return ResponseResult(
                waiting.msg_id, MessageState(waiting.state), waiting.wait_res_id, created=False
            )
        if audit is not None:
            conn.execute(
                sql("message_audit"),
                {"id": waiting.msg_id, "action": "RESPOND", "by": audit[1], "note": audit[0].note},
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


def respond(
    engine: Engine,
    msg_id: int,
    data: Any,
    enqueue: Callable[[int], None],
    *,
    note: str | None,
    key: str | None = None,
    owns: Owns | None = None,
) -> ResponseResult:
    """An operator gives by hand the response message ``msg_id`` waits for (``data``: a
    response without its correlation_id), with a note for the audit trail."""
    if not isinstance(data, dict):
        raise InvalidMessage("body", "must be a JSON object")
    if "correlation_id" in data:
        raise InvalidMessage("correlation_id", "the message's own wait gives it: leave it out")
    with engine.connect() as conn:
        found = conn.execute(
            sql("message_wait_of"), {"id": msg_id, "owned": owners.source_systems(owns)}
        ).first()
    if found is None:
        raise MessageNotFound(msg_id)
    if found.wait_correlation_id is None or found.state in FINAL_STATES:
        raise OperationRefused(msg_id, "it waits for no response")
    response = {**data, "correlation_id": found.wait_correlation_id}
    return receive_response(
        engine, response, enqueue, note=note or "", key=key, msg_id=msg_id, owns=owns
    )
