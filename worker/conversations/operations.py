"""Operators' conversation operations: the seed's Memory Sync Manager methods beyond the gate.

getConversationMessage (:func:`get_message`), deleteConversationRegister (:func:`delete`),
setAwaitedByRequestId / setAwaitedByResponseId (:func:`set_awaited`), updateAwaitedExpires
(:func:`set_awaited_date`) and removeAllReferencesAtTime (:func:`remove_at`). Each change is
one script in the conversation's shard (worker/lua/conv_*.lua); PostgreSQL then records what
the script did, so that a rebuild of Redis from the rows (worker/conversations/rebuild.py)
gives the same state. Input is validated before anything is read or written; an id orderly
does not know is :class:`NotFound`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, StringConstraints, field_validator

from orderly.worker import lua
from orderly.worker.conversations.context import Context
from orderly.worker.conversations.drains import wake
from orderly.worker.conversations.gate import find_ack
from orderly.worker.conversations.model import (
    ID_PATTERN,
    ID_RULE,
    MAX_ASYNC_ID,
    REQUEST_SOURCE,
    RESPONSE_SOURCE,
    Enqueue,
    Id,
    _Input,
    check_conversation_id,
)
from orderly.worker.conversations.rows import MsgId, OperatorRow
from orderly.worker.core import owners
from orderly.worker.core.errors import InvalidMessage, NotFound, OperationRefused
from orderly.worker.core.inputs import parse_input, parse_timestamp
from orderly.worker.core.owners import Owns
from orderly.worker.core.scripts import as_text

# The statuses a response has in Redis (deleteConversationRegister's status filter).
STATUSES = ("PENDING", "AWAITED", "SENT")
ERROR_AWAITED_BY_HAND = "E_AWAITED_BY_HAND"
# removeAllReferencesAtTime: the longest delay (30 days), far past any message's life.
MAX_DELAY_S = 30 * 24 * 3600
# What getConversationMessage can give: the response hash's fields, and the row's.
MESSAGE_FIELDS = (
    "conversationId",
    "origin",
    "requestId",
    "responseId",
    "requestTimestamp",
    "responseTimestamp",
    "status",
    "expiresAt",
    "expiresAtTS",
    "awaitedToDate",
    "awaitedToDateTS",
    "awaitedRetries",
    "taskItem",
    "msgId",
    "requestMsgId",
    "last",
    "reqSeq",
    "attempt",
    "notBefore",
    "member",
    "lateMs",
    "lastAccess",
    "corr",
    "asyncResponseId",
    "sentAt",
    "claimedAt",
    "lost",
    "removeAt",
    "state",
    "inRedis",
)

Note = Annotated[str, StringConstraints(strict=True, max_length=1000)]


class OperatorIn(_Input):
    """Who asked and why: the audit entry the rows get."""

    note: Note | None = None
    by: Id | None = None


class DeleteIn(OperatorIn):
    """deleteConversationRegister's filters."""

    status: Literal["PENDING", "AWAITED", "SENT"] | None = None
    all_origin_except: Id | None = None


class AwaitedDateIn(OperatorIn):
    awaited_to_date: datetime

    @field_validator("awaited_to_date", mode="before")
    @classmethod
    def _date(cls, value: Any) -> datetime:
        return parse_timestamp(value)


class RemovalIn(OperatorIn):
    delay_s: Annotated[StrictInt, Field(ge=0, le=MAX_DELAY_S)]


@dataclass
class Deleted:
    conversation_id: str
    request_id: str
    excepted: bool  # the request's origin was the excepted one: nothing was deleted
    request_cancelled: bool
    deleted: list[str] = field(default_factory=list)  # response ids
    msg_ids: list[int] = field(default_factory=list)  # the rows CANCEL now


@dataclass
class AwaitedSet:
    conversation_id: str
    # [{response_id, msg_id, awaited_to_date_ms, awaited_retries}]
    awaited: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)  # [{response_id, status}]


def _who(command: OperatorIn, key: str | None) -> str:
    """The audit entry's ``by``: the API key's name through the API (with the ``by`` it gave),
    else the ``by`` given, else "operator" (as worker.messages.operations does)."""
    if key is None:
        return command.by or "operator"
    if command.by is None or command.by == key:
        return f"key:{key}"
    return f"key:{key} for {command.by}"


def _row(
    ctx: Context, conversation_id: str, ident: str, source: str, what: str, owns: Owns | None
) -> OperatorRow:
    """The PostgreSQL row of a request or response of this conversation, or NotFound (also
    when its origin is not one of ``owns``: worker.core.owners)."""
    with ctx.pg() as conn:
        row = conn.one(OperatorRow, "conv_op_find", ident, source, owners.origins(owns))
    if row is None or row.conversation_id != conversation_id:
        raise NotFound(what, f"{ident} in conversation {conversation_id}")
    return row


def _check_id(name: str, value: Any) -> str:
    if not isinstance(value, str) or not re.match(ID_PATTERN, value):
        raise InvalidMessage(name, f"must be {ID_RULE}")
    return value


def projection(fields: Any) -> list[str] | None:
    """getConversationMessage's projection: field names (a list, or one comma-separated
    text), each one of MESSAGE_FIELDS; None or empty: every field."""
    if fields is None:
        return None
    names = fields.split(",") if isinstance(fields, str) else fields
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise InvalidMessage("fields", "must be field names, comma-separated")
    names = [n.strip() for n in names if n.strip()]
    for name in names:
        if name not in MESSAGE_FIELDS:
            shown = name if len(name) <= 40 else name[:40] + "..."
            raise InvalidMessage(
                "fields", f"no field {shown!r}; known: {', '.join(MESSAGE_FIELDS)}"
            )
    return names or None


def get_message(
    ctx: Context,
    *,
    response_id: str | None = None,
    async_response_id: str | None = None,
    fields: Any = None,
    owns: Owns | None = None,
) -> dict[str, Any]:
    """getConversationMessage: one response by its responseId or its asyncResponseId (the
    seed's SyncMessageOptions), as Redis holds it (``inRedis``), with its row's ``state``
    and ``corr``; ``fields`` (the projection) keeps only the fields named."""
    wanted = projection(fields)
    if (response_id is None) == (async_response_id is None):
        raise InvalidMessage("response_id", "give either response_id or async_response_id")
    if async_response_id is not None:
        if not isinstance(async_response_id, str) or not 0 < len(async_response_id) <= MAX_ASYNC_ID:
            raise InvalidMessage("async_response_id", f"must be 1 to {MAX_ASYNC_ID} characters")
        unknown = NotFound("conversation message with async_response_id", async_response_id)
        found = find_ack(ctx, async_response_id)
        if found is None:
            raise unknown
        _, info = found
        response_id = str(json.loads(info)["rsId"])
    else:
        unknown = NotFound("conversation message", response_id)
    rid = _check_id("response_id", response_id)
    with ctx.pg() as conn:
        row = conn.one(OperatorRow, "conv_op_find", rid, RESPONSE_SOURCE, owners.origins(owns))
    if row is None:
        # Another tenant's is answered as one that does not exist, by the id asked for.
        raise unknown
    msg_id, state, cid, origin = row.msg_id, row.state, row.conversation_id, row.origin
    request_id, corr = row.request_id, row.corr
    raw = ctx.redis.hgetall(ctx.keys.response(cid, rid))
    view: dict[str, Any] = {as_text(f): as_text(v) for f, v in raw.items()}
    if "taskItem" in view:
        view["taskItem"] = json.loads(view["taskItem"])
    in_redis = bool(view)
    if not in_redis:
        view = {"conversationId": cid, "origin": origin, "requestId": request_id}
        view.update(responseId=rid, msgId=str(msg_id))
        if corr is not None:
            view["corr"] = corr
    view.update(state=str(state), inRedis=in_redis)
    if wanted is not None:
        view = {name: view[name] for name in wanted if name in view}
    return view


def delete(
    ctx: Context,
    conversation_id: str,
    request_id: str,
    data: Any,
    enqueue: Enqueue,
    *,
    key: str | None = None,
    owns: Owns | None = None,
) -> Deleted:
    """deleteConversationRegister: delete the responses of a request (only those in
    ``status``, if given; with no status the request goes too, CANCEL like a cancelled
    group), unless the request's origin is ``all_origin_except``. The rows deleted end
    CANCEL with an audit entry; the conversation is woken, so that its next response goes."""
    check_conversation_id(conversation_id)
    _check_id("request_id", request_id)
    command = parse_input(DeleteIn, data)
    request = _row(ctx, conversation_id, request_id, REQUEST_SOURCE, "conversation request", owns)
    request_msg_id, origin = request.msg_id, request.origin
    k = ctx.keys
    shard = k.shard(conversation_id)
    note = command.note or (
        f"deleted by an operator (status {command.status})"
        if command.status
        else "its request's messages deleted by an operator"
    )
    # The Redis step and its record in one locked transaction (Context.locked).
    with ctx.locked(conversation_id) as conn:
        result = lua.conv_delete(
            ctx.scripts,
            request=shard.request(request_id),
            response_order=k.response_list(conversation_id),
            pending_messages=shard.pending_messages,
            request_list=k.request_list(conversation_id),
            request_seq=k.request_seq(conversation_id),
            request_id=request_id,
            status=command.status,
            all_origin_except=command.all_origin_except,
            origin=origin,
            response_prefix=shard.response_prefix,
            async_prefix=shard.async_prefix,
            message_ttl_ms=ctx.settings.message_ttl,
            now_ms=ctx.now_ms(),
        )
        done = Deleted(conversation_id, request_id, result.excepted, result.request)
        if done.excepted:
            return done
        pairs = result.deleted
        done.deleted = [str(rid) for _, rid in pairs]
        ids = [int(i) for i, _ in pairs if i]
        cancelled = conn.all(
            MsgId,
            "conv_op_cancel",
            ids,
            request_msg_id if done.request_cancelled else None,
            _who(command, key),
            note,
            "DELETE",
        )
    done.msg_ids = sorted(r.msg_id for r in cancelled)
    wake(ctx, conversation_id, enqueue)
    return done


def set_awaited(
    ctx: Context,
    conversation_id: str,
    data: Any,
    *,
    request_id: str | None = None,
    response_id: str | None = None,
    key: str | None = None,
    owns: Owns | None = None,
) -> AwaitedSet:
    """setAwaitedByRequestId (``request_id``: every response of it) or
    setAwaitedByResponseId (``response_id``): PENDING responses become AWAITED as when their
    attempts run out (awaitedRetries + 1, awaitedToDate, pendingMessages). Responses SENT,
    in flight or AWAITED already are left as they are and named in ``skipped``."""
    check_conversation_id(conversation_id)
    if (request_id is None) == (response_id is None):
        raise InvalidMessage("request_id", "give either request_id or response_id")
    command = parse_input(OperatorIn, data)
    if request_id is not None:
        _check_id("request_id", request_id)
        _row(ctx, conversation_id, request_id, REQUEST_SOURCE, "conversation request", owns)
    else:
        _check_id("response_id", response_id)
        _row(ctx, conversation_id, str(response_id), RESPONSE_SOURCE, "conversation response", owns)
    k = ctx.keys
    shard = k.shard(conversation_id)
    result = lua.conv_set_awaited(
        ctx.scripts,
        response_order=k.response_list(conversation_id),
        pending_messages=shard.pending_messages,
        response_prefix=shard.response_prefix,
        now_ms=ctx.now_ms(),
        awaited_time_when_retries_end_ms=ctx.settings.awaited_time_when_retries_end,
        awaited_step_ms=ctx.awaited_step_ms,
        request_id=request_id,
        response_id=response_id,
    )
    done = AwaitedSet(conversation_id)
    rows = result.set
    done.awaited = [
        {
            "response_id": r.response_id,
            "msg_id": r.msg_id,
            "awaited_to_date_ms": r.awaited_to_date_ms,
            "awaited_retries": r.awaited_retries,
        }
        for r in rows
    ]
    done.skipped = [{"response_id": r, "status": s} for r, s in result.skipped]
    if rows:
        with ctx.pg() as conn:
            conn.run(
                "conv_op_awaited",
                [r.msg_id for r in rows],
                [r.awaited_to_date_ms for r in rows],
                [int(r.awaited_retries) for r in rows],
                "AWAITED",
                _who(command, key),
                command.note or "set AWAITED by an operator",
                ERROR_AWAITED_BY_HAND,
            )
    return done


def set_awaited_date(
    ctx: Context,
    conversation_id: str,
    response_id: str,
    data: Any,
    *,
    key: str | None = None,
    owns: Owns | None = None,
) -> dict[str, Any]:
    """updateAwaitedExpires: an AWAITED response's awaitedToDate becomes the date given (not
    after its AWAITED_MESSAGE_TTL ends; a past date: at once); the awaited agent takes it
    up then. Refused (OperationRefused) for a response not AWAITED."""
    check_conversation_id(conversation_id)
    _check_id("response_id", response_id)
    command = parse_input(AwaitedDateIn, data)
    at = int(command.awaited_to_date.timestamp() * 1000)
    msg_id = _row(
        ctx, conversation_id, response_id, RESPONSE_SOURCE, "conversation response", owns
    ).msg_id
    shard = ctx.keys.shard(conversation_id)
    now = ctx.now_ms()
    found = lua.conv_awaited_date(
        ctx.scripts,
        response=shard.response(response_id),
        pending_messages=shard.pending_messages,
        date_ms=at,
        now_ms=now,
    )
    if found.code is lua.AwaitedDateCode.UNKNOWN:
        raise OperationRefused(int(msg_id), "it is no longer in its conversation's order")
    if found.code is lua.AwaitedDateCode.NOT_AWAITED:
        raise OperationRefused(int(msg_id), f"it is {found.detail}, not AWAITED")
    if found.code is lua.AwaitedDateCode.PAST_EXPIRY:
        raise InvalidMessage(
            "awaited_to_date",
            f"after the response expires (AWAITED_MESSAGE_TTL) at {found.detail} ms",
        )
    date, retries = found.date_ms, found.retries
    with ctx.pg() as conn:
        conn.run(
            "conv_op_awaited",
            [int(msg_id)],
            [date],
            [retries],
            "AWAITED_DATE",
            _who(command, key),
            command.note or "awaited date set by an operator",
            None,
        )
    return {"response_id": response_id, "msg_id": int(msg_id), "awaited_to_date_ms": date}


def remove_at(
    ctx: Context,
    conversation_id: str,
    response_id: str,
    data: Any,
    *,
    key: str | None = None,
    owns: Owns | None = None,
) -> dict[str, Any]:
    """removeAllReferencesAtTime: the response's references leave Redis ``delay_s`` seconds
    from now, as due work of the conversations' wake-ups (worker.conversations.removal)."""
    check_conversation_id(conversation_id)
    _check_id("response_id", response_id)
    command = parse_input(RemovalIn, data)
    msg_id = _row(
        ctx, conversation_id, response_id, RESPONSE_SOURCE, "conversation response", owns
    ).msg_id
    shard = ctx.keys.shard(conversation_id)
    now = ctx.now_ms()
    at = now + command.delay_s * 1000
    code = lua.conv_remove_at(
        ctx.scripts,
        response=shard.response(response_id),
        scheduled=shard.scheduled,
        at_ms=at,
        now_ms=now,
        message_ttl_ms=ctx.settings.message_ttl,
    )
    if code is lua.RemoveAtCode.UNKNOWN:
        raise OperationRefused(int(msg_id), "it is no longer in its conversation's order")
    with ctx.pg() as conn:
        conn.run(
            "conv_op_audit_removal",
            int(msg_id),
            "REMOVE_AT",
            _who(command, key),
            command.note or f"references to be removed in {command.delay_s} s",
            at,
        )
    return {"response_id": response_id, "msg_id": int(msg_id), "remove_at_ms": at}
