"""Requests and responses entering a conversation: the row in PostgreSQL first (the durable
truth), then the seed's structures in Redis (register_request.lua, add_response.lua)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from orderly.models import MessageState
from orderly.worker import lua, nodes
from orderly.worker.conversations import joins, rows
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
from orderly.worker.core.errors import InvalidMessage, NotFound, OrderlyError, UnknownRequest
from orderly.worker.core.group_commit import ALONE, Alone
from orderly.worker.core.inputs import parse_input
from orderly.worker.core.lease import new_token
from orderly.worker.core.owners import Owns
from orderly.worker.core.scripts import Call
from orderly.worker.db.prepared import PreparedConnection

log = logging.getLogger(__name__)


def _ms(ctx: Context, moment: datetime | None) -> int:
    return int(moment.timestamp() * 1000) if moment else ctx.now_ms()


@dataclass(frozen=True)
class NewRequest:
    """A request as given, validated (:func:`parse_request`)."""

    conversation_id: str
    request: RequestIn
    payload: str
    timestamp_ms: int

    @property
    def moment(self) -> datetime:
        return datetime.fromtimestamp(self.timestamp_ms / 1000, tz=UTC)


@dataclass(frozen=True)
class NewResponse:
    """A response as given, validated (:func:`parse_response`)."""

    conversation_id: str
    response: ResponseIn
    payload: str
    timestamp_ms: int
    now_ms: int
    traced: str | None  # the span taking it in: its send continues this trace

    @property
    def moment(self) -> datetime:
        return datetime.fromtimestamp(self.timestamp_ms / 1000, tz=UTC)


def parse_request(
    ctx: Context, conversation_id: str, data: Any, owns: Owns | None = None
) -> NewRequest:
    """The request ``data`` is, or InvalidMessage naming the bad field; an origin ``owns``
    does not hold is not found. Reads nothing (a coroutine may call it)."""
    check_conversation_id(conversation_id)
    req = parse_input(RequestIn, data)
    owners.require_origin(owns, req.origin)
    payload = payload_text(req.payload, ctx.settings.max_payload_bytes)
    return NewRequest(conversation_id, req, payload, _ms(ctx, req.timestamp))


def register_request(
    ctx: Context, conversation_id: str, data: Any, owns: Owns | None = None
) -> Registered:
    """createConversationRegister: the request waits (WAITING) for its responses. ``owns``:
    the caller's objects; an origin of another's, or a conversation that holds a request of
    another's origin, is not found, and nothing is written."""
    return store_request(ctx, parse_request(ctx, conversation_id, data, owns), owns)


def store_request(ctx: Context, new: NewRequest, owns: Owns | None = None) -> Registered:
    """Store one request (:func:`parse_request`) on its own, as :func:`register_request`."""
    conversation_id, req, timestamp_ms = new.conversation_id, new.request, new.timestamp_ms
    ctx.channels.get(req.origin)  # UnknownChannel before anything is written
    moment = new.moment
    with ctx.pg() as conn:
        inserted = _insert_requests(ctx, conn, [(new, owns)])
        row = inserted[0] if inserted else None
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
                joins.register(
                    ctx,
                    conversation_id,
                    origin,
                    req.request_id,
                    _ms(ctx, moment),
                    int(msg_id),
                    req.corr,
                )
            return Registered(int(msg_id), MessageState(state), created=False)
    joins.register(
        ctx,
        conversation_id,
        req.origin,
        req.request_id,
        timestamp_ms,
        row.msg_id,
        req.corr,
        row.others_open,
    )
    return Registered(row.msg_id, MessageState.WAITING_FOR_RES, created=True)


def parse_response(ctx: Context, conversation_id: str, data: Any) -> NewResponse:
    """The response ``data`` is, or InvalidMessage naming the bad field. Reads nothing (a
    coroutine may call it); the trace it continues is the caller's."""
    check_conversation_id(conversation_id)
    res = parse_input(ResponseIn, data)
    payload = payload_text(res.payload, ctx.settings.max_payload_bytes)
    now_ms = ctx.now_ms()
    timestamp_ms = _ms(ctx, res.timestamp) if res.timestamp else now_ms
    return NewResponse(
        conversation_id, res, payload, timestamp_ms, now_ms, tracing.current_parent()
    )


def add_response(
    ctx: Context, conversation_id: str, data: Any, enqueue: Enqueue, owns: Owns | None = None
) -> Registered:
    """markPendingConversationRegister: the response joins its conversation's order.
    ``owns``: the caller's objects; a request of another origin is unknown (nothing written)."""
    return store_response(ctx, parse_response(ctx, conversation_id, data), enqueue, owns)


def store_response(
    ctx: Context, new: NewResponse, enqueue: Enqueue, owns: Owns | None = None
) -> Registered:
    """Store one response (:func:`parse_response`) on its own, as :func:`add_response`."""
    res, conversation_id = new.response, new.conversation_id
    with ctx.pg() as conn:
        inserted = _insert_responses(ctx, conn, [(new, owns)])[0].found()
        if inserted is None:
            raise UnknownRequest(res.request_id, conversation_id)
        if inserted.msg_id is None:
            found = conn.one(rows.Stored, "conv_find", res.response_id, RESPONSE_SOURCE)
            if found is None:
                raise nodes.refusal(conn, ctx.node_id)
            if found.request_msg_id != inserted.request_msg_id:
                raise InvalidMessage(
                    "response_id",
                    f"{res.response_id!r} already belongs to another request",
                )
            if (
                found.state != MessageState.IN_QUEUE
                or found.age_ms >= ctx.settings.awaited_message_ttl
            ):
                return Registered(int(found.msg_id), MessageState(found.state), created=False)
            # Still queued: a repeat after a failure between the row and Redis puts it
            # there now (the script answers DUPLICATE if it is there already).
            return _queue_response(ctx, new, inserted, found.msg_id, found.state, enqueue, False)
    return _queue_response(ctx, new, inserted, inserted.msg_id, str(inserted.state), enqueue, True)


def _queue_response(
    ctx: Context,
    new: NewResponse,
    inserted: rows.ResponseInserted,
    msg_id: int,
    state: str,
    enqueue: Enqueue,
    created: bool,
) -> Registered:
    """The stored response (``msg_id`` in ``state``; its request as ``inserted`` found it)
    joins its conversation's order in Redis (add_response.lua); a drain is started when it
    took the conversation's lease."""
    if state == MessageState.CANCEL:
        return Registered(int(msg_id), MessageState.CANCEL, created=True)
    token = new_token()
    added = joins.add(ctx, new, inserted, msg_id, token, enqueue)
    return _response_queued(ctx, new, inserted, msg_id, token, added, enqueue, created)


def _response_queued(
    ctx: Context,
    new: NewResponse,
    inserted: rows.ResponseInserted,
    msg_id: int,
    token: str,
    added: lua.ResponseAdded,
    enqueue: Enqueue,
    created: bool,
) -> Registered:
    """What add_response.lua's answer (``added``) leads to: a cancelled group's response
    cancelled, a late one or a callback logged, a drain started with the lease it took."""
    res = new.response
    if added.code is lua.AddCode.CANCELLED:
        # The group was cancelled between the insert and now.
        with ctx.pg() as conn:
            conn.run(
                "conv_group_cancel",
                inserted.request_msg_id,
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
    elif inserted.request_state != MessageState.WAITING_FOR_RES:
        log.info(
            "response %s is a callback for request %s (%s)",
            res.response_id,
            res.request_id,
            inserted.request_state,
        )
    if added.lease_taken:
        with tracing.within(new.traced):  # the drain's task goes on the response's trace
            enqueue(new.conversation_id, token)
    return Registered(int(msg_id), MessageState.IN_QUEUE, created=created)


# Group commit (worker.core.group_commit): the API's requests and responses arriving together
# are inserted with one statement each group, in the order they came, then put in Redis with
# one pipelined round trip (a server's). What the statement does not settle (a repeat, an
# unknown request, a conversation with another caller's request, a node refusing input, a
# failed statement) is stored by its own caller after it, on its own (ALONE), as without a
# group.

Outcome = Registered | Alone | Exception


def store_requests(ctx: Context, items: Sequence[tuple[NewRequest, Owns | None]]) -> list[Outcome]:
    """The requests of a group (:func:`store_request` for each, one INSERT for all)."""
    out: list[Outcome] = [ALONE] * len(items)
    callers: dict[str, tuple[str, ...] | None] = {}
    grouped: list[int] = []
    for i, (new, owns) in enumerate(items):
        try:
            ctx.channels.get(new.request.origin)  # UnknownChannel before anything is written
        except OrderlyError as exc:
            out[i] = exc
            continue
        origins = owners.origins(owns)
        caller = None if origins is None else tuple(origins)
        # One statement sees a new conversation as empty for each of its rows: requests of
        # other callers' to one conversation go alone, after it (conv_lock, in turn).
        if callers.setdefault(new.conversation_id, caller) == caller:
            grouped.append(i)
    if not grouped:
        return out
    try:
        with ctx.pg() as conn:
            found = _insert_requests(ctx, conn, [items[i] for i in grouped])
    except Exception as exc:
        log.warning("a group of %d requests failed (%s): each alone", len(grouped), exc)
        return out
    # A row is the item's of its request id and conversation (another with that id, in
    # another conversation, may have been refused by the statement: it is not this one).
    inserted = {(row.request_id, row.conversation_id): row for row in found}
    stored: list[tuple[int, int, Call]] = []
    for i in grouped:
        new = items[i][0]
        row = inserted.pop((new.request.request_id, new.conversation_id), None)
        if row is None:
            continue  # a repeat (or the second of a group), another's conversation: alone
        stored.append(
            (i, row.msg_id, joins.new_request_call(ctx, new, row.msg_id, row.others_open))
        )
    # In Redis in one round trip (a server's); one that fails is stored: a repeat registers it
    replies: list[lua.Registration | Exception]
    try:
        replies = lua.register_request_each(ctx.scripts, [call for _, _, call in stored])
    except Exception as exc:  # the round trip itself: those stored answer it, no others
        replies = [exc] * len(stored)
    again: dict[str, dict[int, tuple[int, Call]]] = {}
    for (i, msg_id, _), reply in zip(stored, replies, strict=True):
        if isinstance(reply, Exception):
            out[i] = reply
            continue
        out[i] = Registered(msg_id, MessageState.WAITING_FOR_RES, created=True)
        if reply is lua.Registration.MISSING:
            new = items[i][0]
            unchecked = joins.new_request_call(ctx, new, msg_id, False, check=False)
            again.setdefault(new.conversation_id, {})[i] = (msg_id, unchecked)
    for conversation_id, calls in again.items():
        try:
            joins.registered_again(ctx, conversation_id, list(calls.values()))
        except Exception as exc:
            for i in calls:
                out[i] = exc
    return out


def store_responses(
    ctx: Context, items: Sequence[tuple[NewResponse, Owns | None, Enqueue]]
) -> list[Outcome]:
    """The responses of a group (:func:`store_response` for each, one INSERT for all)."""
    try:
        with ctx.pg() as conn:
            found = _insert_responses(ctx, conn, [(new, owns) for new, owns, _ in items])
    except Exception as exc:
        log.warning("a group of %d responses failed (%s): each alone", len(items), exc)
        return [ALONE] * len(items)
    out: list[Outcome] = [ALONE] * len(items)
    taken: set[str] = set()
    queued: list[tuple[int, rows.ResponseInserted, int, str, Call]] = []
    for i, ((new, _, _), row) in enumerate(zip(items, found, strict=True)):
        response_id = new.response.response_id
        inserted = row.found()
        if inserted is None or row.msg_id is None or response_id in taken:
            continue  # a repeat, an unknown request, a node refusing input: alone
        taken.add(response_id)
        if row.state == MessageState.CANCEL:
            out[i] = Registered(row.msg_id, MessageState.CANCEL, created=True)
            continue
        token = new_token()
        call = joins.response_call(ctx, new, inserted, row.msg_id, token)
        queued.append((i, inserted, row.msg_id, token, call))
    # In Redis in one round trip (a server's); one that fails is stored: a repeat queues it
    replies: list[lua.ResponseAdded | Exception]
    try:
        replies = lua.add_response_each(ctx.scripts, [call for *_, call in queued])
    except Exception as exc:  # the round trip itself: those stored answer it, no others
        replies = [exc] * len(queued)
    # A response whose check answered MISSING is added again after PostgreSQL decided, those
    # of its conversation that did too left out of the rebuild (each is added by its own call).
    missing: dict[str, set[int]] = {}
    for (i, _, msg_id, _, _), added in zip(queued, replies, strict=True):
        if isinstance(added, lua.ResponseAdded) and added.code is lua.AddCode.MISSING:
            missing.setdefault(items[i][0].conversation_id, set()).add(msg_id)
    for (i, inserted, msg_id, token, _), added in zip(queued, replies, strict=True):
        new, _, enqueue = items[i]
        try:
            if isinstance(added, Exception):
                raise added
            if added.code is lua.AddCode.MISSING:
                # checked again (a repair for an earlier one may have brought its key back),
                # the conversation's others not yet added left out of a repair
                waiting = missing[new.conversation_id]
                waiting.discard(msg_id)
                without = frozenset(waiting)
                added = joins.add(ctx, new, inserted, msg_id, token, enqueue, None, without)
            out[i] = _response_queued(ctx, new, inserted, msg_id, token, added, enqueue, True)
        except Exception as exc:
            out[i] = exc
    return out


def _insert_requests(
    ctx: Context, conn: PreparedConnection, items: Sequence[tuple[NewRequest, Owns | None]]
) -> list[rows.RequestInserted]:
    """Insert requests in one statement, under their conversations' locks: those inserted."""
    news = [new for new, _ in items]
    return conn.all(
        rows.RequestInserted,
        "conv_insert_requests",
        [n.request.request_id for n in news],
        [n.conversation_id for n in news],
        [n.request.origin for n in news],
        [n.moment for n in news],
        [n.payload for n in news],
        ctx.node_id,
        [n.request.model_dump_json(exclude_unset=True) for n in news],
        [_origins_json(owns) for _, owns in items],
        ctx.settings.awaited_message_ttl,
        ctx.settings.message_ttl,
        before=("conv_lock_all", [sorted({n.conversation_id for n in news})]),
    )


def _insert_responses(
    ctx: Context, conn: PreparedConnection, items: Sequence[tuple[NewResponse, Owns | None]]
) -> list[rows.GroupedResponse]:
    """Insert responses in one statement: one row each, in order."""
    news = [new for new, _ in items]
    return conn.all(
        rows.GroupedResponse,
        "conv_insert_responses",
        [n.response.response_id for n in news],
        [n.response.request_id for n in news],
        [n.conversation_id for n in news],
        [n.moment for n in news],
        [n.payload for n in news],
        ctx.node_id,
        [n.response.last for n in news],
        [n.response.model_dump_json(exclude_unset=True) for n in news],
        [_origins_json(owns) for _, owns in items],
        [n.traced for n in news],
        ctx.settings.awaited_message_ttl,
    )


def _origins_json(owns: Owns | None) -> str | None:
    origins = owners.origins(owns)
    return None if origins is None else json.dumps(origins)
