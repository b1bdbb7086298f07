"""Requests and responses entering a conversation: the row in PostgreSQL first (the durable
truth), then the seed's structures in Redis (register_request.lua, add_response.lua)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from orderly.models import MessageState
from orderly.models.keys import min_message_info
from orderly.worker import lua, nodes
from orderly.worker.conversations import rows
from orderly.worker.conversations.context import Context
from orderly.worker.conversations.model import (
    ERROR_CANCELLED,
    REQUEST_SOURCE,
    RESPONSE_SOURCE,
    Enqueue,
    Registered,
    RequestIn,
    ResponseIn,
    check_conversation_id,
    payload_text,
)
from orderly.worker.core import owners, tracing
from orderly.worker.core.errors import InvalidMessage, NotFound, UnknownRequest
from orderly.worker.core.inputs import parse_input
from orderly.worker.core.lease import new_token
from orderly.worker.core.owners import Owns

log = logging.getLogger(__name__)


def _ms(ctx: Context, moment: datetime | None) -> int:
    return int(moment.timestamp() * 1000) if moment else ctx.now_ms()


def register_request(
    ctx: Context, conversation_id: str, data: Any, owns: Owns | None = None
) -> Registered:
    """createConversationRegister: the request waits (WAITING) for its responses. ``owns``:
    the caller's objects; an origin of another's, or a conversation that holds a request of
    another's origin, is not found, and nothing is written."""
    check_conversation_id(conversation_id)
    req = parse_input(RequestIn, data)
    owners.require_origin(owns, req.origin)
    ctx.channels.get(req.origin)  # UnknownChannel before anything is written
    payload = payload_text(req.payload, ctx.settings.max_payload_bytes)
    timestamp_ms = _ms(ctx, req.timestamp)
    moment = datetime.fromtimestamp(timestamp_ms / 1000, tz=UTC)
    with ctx.pg() as conn:
        row = conn.one(
            rows.Inserted,
            "conv_insert_request",
            req.request_id,
            conversation_id,
            req.origin,
            moment,
            payload,
            ctx.node_id,
            req.corr,
            owners.origins(owns),
            before=("conv_lock", [conversation_id]),
        )
        if row is None:
            found = conn.one(rows.Stored, "conv_find", req.request_id, REQUEST_SOURCE)
            if found is None:
                if owns is not None and conn.run(
                    "conv_foreign_request", conversation_id, owners.origins(owns)
                ):
                    raise NotFound("conversation", conversation_id)
                raise nodes.refusal(conn, ctx.node_id)
            msg_id, state, age_ms = found.msg_id, found.state, found.age_ms
            owner, origin, moment = found.conversation_id, found.origin, found.msg_timestamp
            if owns is not None and origin not in owns.origins:
                # Another tenant's request id: say it is taken, not where.
                raise InvalidMessage("request_id", f"{req.request_id!r} is taken: choose another")
            if owner != conversation_id:
                raise InvalidMessage(
                    "request_id", f"{req.request_id!r} belongs to conversation {owner!r}"
                )
            if state == MessageState.WAITING_FOR_RES and age_ms < ctx.settings.message_ttl:
                # A repeat after a failure between the row and Redis: register it there
                # now (the script does nothing if it is registered already).
                _register_in_redis(
                    ctx,
                    conversation_id,
                    origin,
                    req.request_id,
                    _ms(ctx, moment),
                    int(msg_id),
                    req.corr,
                )
            return Registered(int(msg_id), MessageState(state), created=False)
    _register_in_redis(
        ctx, conversation_id, req.origin, req.request_id, timestamp_ms, row.msg_id, req.corr
    )
    return Registered(row.msg_id, MessageState.WAITING_FOR_RES, created=True)


def _register_in_redis(
    ctx: Context,
    conversation_id: str,
    origin: str,
    request_id: str,
    timestamp_ms: int,
    msg_id: int,
    corr: str | None,
) -> None:
    k = ctx.keys
    lua.register_request(
        ctx.scripts,
        request=k.request(conversation_id, request_id),
        request_list=k.request_list(conversation_id),
        request_seq=k.request_seq(conversation_id),
        conversation_id=conversation_id,
        origin=origin,
        request_id=request_id,
        request_timestamp_ms=timestamp_ms,
        msg_id=msg_id,
        now_ms=ctx.now_ms(),
        message_ttl_ms=ctx.settings.message_ttl,
        awaited_message_ttl_ms=ctx.settings.awaited_message_ttl,
        corr=corr,
    )


def add_response(
    ctx: Context, conversation_id: str, data: Any, enqueue: Enqueue, owns: Owns | None = None
) -> Registered:
    """markPendingConversationRegister: the response joins its conversation's order.
    ``owns``: the caller's objects; a request of another origin is unknown (nothing written)."""
    check_conversation_id(conversation_id)
    res = parse_input(ResponseIn, data)
    payload = payload_text(res.payload, ctx.settings.max_payload_bytes)
    now_ms = ctx.now_ms()
    timestamp_ms = _ms(ctx, res.timestamp) if res.timestamp else now_ms
    moment = datetime.fromtimestamp(timestamp_ms / 1000, tz=UTC)
    traced = tracing.current_parent()  # its send continues this trace
    with ctx.pg() as conn:
        inserted = conn.one(
            rows.ResponseInserted,
            "conv_insert_response",
            res.response_id,
            res.request_id,
            conversation_id,
            moment,
            payload,
            ctx.node_id,
            res.last,
            res.corr,
            owners.origins(owns),
            traced,
        )
        if inserted is None:
            raise UnknownRequest(res.request_id, conversation_id)
        request_msg_id, request_state = inserted.request_msg_id, inserted.request_state
        origin, request_ts, request_done = (
            inserted.origin,
            inserted.request_ts,
            inserted.request_done,
        )
        created = inserted.msg_id is not None
        if inserted.msg_id is not None:
            msg_id, state = inserted.msg_id, str(inserted.state)
        else:
            found = conn.one(rows.Stored, "conv_find", res.response_id, RESPONSE_SOURCE)
            if found is None:
                raise nodes.refusal(conn, ctx.node_id)
            if found.request_msg_id != request_msg_id:
                raise InvalidMessage(
                    "response_id",
                    f"{res.response_id!r} already belongs to another request",
                )
            msg_id, state, age_ms = found.msg_id, found.state, found.age_ms
            if state != MessageState.IN_QUEUE or age_ms >= ctx.settings.awaited_message_ttl:
                return Registered(int(msg_id), MessageState(state), created=False)
            # Still queued: a repeat after a failure between the row and Redis puts it
            # there now (the script answers DUPLICATE if it is there already).
    if state == MessageState.CANCEL:
        return Registered(int(msg_id), MessageState.CANCEL, created=True)
    token = new_token()
    k = ctx.keys
    shard = k.shard(conversation_id)
    added = lua.add_response(
        ctx.scripts,
        request=shard.request(res.request_id),
        response=shard.response(res.response_id),
        response_order=k.response_list(conversation_id),
        pending_messages=shard.pending_messages,
        request_list=k.request_list(conversation_id),
        request_seq=k.request_seq(conversation_id),
        drain_lease=k.drain_lease(conversation_id),
        conversation_id=conversation_id,
        origin=origin,
        request_id=res.request_id,
        response_id=res.response_id,
        member=min_message_info(res.request_id, res.response_id, conversation_id),
        response_timestamp_ms=timestamp_ms,
        task_item=payload,
        msg_id=msg_id,
        request_msg_id=request_msg_id,
        last=bool(res.last),
        now_ms=now_ms,
        message_ttl_ms=ctx.settings.message_ttl,
        awaited_message_ttl_ms=ctx.settings.awaited_message_ttl,
        blocked_limit_ms=ctx.blocked_ms,
        request_timestamp_ms=int(request_ts.timestamp() * 1000),
        lease_token=token,
        lease_ms=ctx.lease_ms,
        request_completed=bool(request_done),
        corr=res.corr,
        trace_parent=traced,
    )
    if added.code is lua.AddCode.CANCELLED:
        # The group was cancelled between the insert and now.
        with ctx.pg() as conn:
            conn.run(
                "conv_group_cancel",
                request_msg_id,
                ERROR_CANCELLED,
                "its request was cancelled",
            )
        return Registered(int(msg_id), MessageState.CANCEL, created=True)
    if added.late_ms is not None:
        log.warning(
            "response %s is late: request %s expired (MESSAGE_TTL) before it; it goes after"
            " the conversation's later requests (%s ms past the request's timestamp + TTL)",
            res.response_id,
            res.request_id,
            added.late_ms,
        )
    elif request_state != MessageState.WAITING_FOR_RES:
        log.info(
            "response %s is a callback for request %s (%s)",
            res.response_id,
            res.request_id,
            request_state,
        )
    if added.lease_taken:
        enqueue(conversation_id, token)
    return Registered(int(msg_id), MessageState.IN_QUEUE, created=created)
