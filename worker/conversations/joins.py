"""A stored request or response joins its conversation's structures in Redis
(register_request.lua, add_response.lua), its row in PostgreSQL already written (intake.py).

Under a live marker Redis may still have lost single keys (evicted by a Redis whose
``maxmemory-policy`` may evict keys with a TTL, deleted by hand). The scripts are checked
first: one that finds the conversation's counter gone while it numbered open rows, or the
request's key gone while PostgreSQL has the request open, writes nothing and answers
MISSING, for it would otherwise number the newcomer before older ones, or send a response
of a live request after its successors as if it had expired. PostgreSQL then decides
(reconcile.repair: the conversation rebuilt from its rows if they say the key should be
there), and the call runs again with one check fewer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from orderly.models import MessageState
from orderly.models.keys import min_message_info
from orderly.worker import lua
from orderly.worker.conversations import reconcile, rows
from orderly.worker.conversations.context import Context
from orderly.worker.conversations.model import Enqueue
from orderly.worker.core.scripts import Call

if TYPE_CHECKING:
    from orderly.worker.conversations.intake import NewRequest, NewResponse


def register(
    ctx: Context,
    conversation_id: str,
    origin: str,
    request_id: str,
    timestamp_ms: int,
    msg_id: int,
    corr: str | None,
    others_open: bool = False,
) -> None:
    def call(check: bool) -> Call:
        return request_call(
            ctx, conversation_id, origin, request_id, timestamp_ms, msg_id, corr, check,
            others_open,
        )  # fmt: skip

    if lua.register_request(ctx.scripts, call(True)) is lua.Registration.MISSING:
        registered_again(ctx, conversation_id, [(msg_id, call(False))])


def registered_again(ctx: Context, conversation_id: str, again: Sequence[tuple[int, Call]]) -> None:
    """Requests (msg_id, unchecked call) whose check answered MISSING: their conversation's
    counter or list gone while it has open rows. The conversation is rebuilt without them if its
    rows say so (reconcile.repair), then each is registered, in order."""
    k = ctx.keys
    gone = [k.request_seq(conversation_id), k.request_list(conversation_id)]
    reconcile.repair(ctx, conversation_id, gone, {msg_id for msg_id, _ in again})
    for _, call in again:
        lua.register_request(ctx.scripts, call)


def request_call(
    ctx: Context,
    conversation_id: str,
    origin: str,
    request_id: str,
    timestamp_ms: int,
    msg_id: int,
    corr: str | None,
    check: bool = True,
    others_open: bool = False,
) -> Call:
    k = ctx.keys
    return lua.register_request_call(
        request=k.request(conversation_id, request_id),
        request_list=k.request_list(conversation_id),
        request_seq=k.request_seq(conversation_id),
        response_order=k.response_list(conversation_id),
        conversation_id=conversation_id,
        origin=origin,
        request_id=request_id,
        request_timestamp_ms=timestamp_ms,
        msg_id=msg_id,
        now_ms=ctx.now_ms(),
        message_ttl_ms=ctx.settings.message_ttl,
        awaited_message_ttl_ms=ctx.settings.awaited_message_ttl,
        corr=corr,
        check=check,
        others_open=others_open,
    )


# A check of add_response.lua MISSING answered whose key PostgreSQL then found run out is left
# out of the next call: each key is checked once that way, at most.
_CHECKS = 3


def add(
    ctx: Context,
    new: NewResponse,
    inserted: rows.ResponseInserted,
    msg_id: int,
    token: str,
    enqueue: Enqueue,
    added: lua.ResponseAdded | None = None,
    without: frozenset[int] = frozenset(),
) -> lua.ResponseAdded:
    """The stored response in its conversation's order (add_response.lua; ``added``: its
    first answer if it was had already). A key it found missing is looked up in PostgreSQL
    (reconcile.repair, rebuilding without this response and the rows of ``without``): back,
    the call runs again as it was; run out, without that check."""
    cid = new.conversation_id
    checked = _checks(ctx, new, inserted)
    for _ in range(2 * _CHECKS + 1):
        if added is None:
            call = response_call(ctx, new, inserted, msg_id, token, checked)
            added = lua.add_response(ctx.scripts, call)
        if added.code is not lua.AddCode.MISSING:
            return added
        key = added.missing or ""
        if not reconcile.repair(ctx, cid, [key], {msg_id, *without}, enqueue):
            checked[key] = False
        added = None
    checked = dict.fromkeys(checked, False)
    return lua.add_response(ctx.scripts, response_call(ctx, new, inserted, msg_id, token, checked))


def _checks(ctx: Context, new: NewResponse, inserted: rows.ResponseInserted) -> dict[str, bool]:
    """add_response.lua's checks as the insert found the rows: the request's key (PostgreSQL
    has the request open), the counter (a callback's), the order (other responses open)."""
    k, cid = ctx.keys, new.conversation_id
    return {
        k.shard(cid).request(new.response.request_id): (
            inserted.request_state == MessageState.WAITING_FOR_RES
        ),
        k.request_seq(cid): True,
        k.response_list(cid): inserted.others_open,
    }


def response_call(
    ctx: Context,
    new: NewResponse,
    inserted: rows.ResponseInserted,
    msg_id: int,
    token: str,
    checked: dict[str, bool] | None = None,
) -> Call:
    """add_response.lua's call for the stored response; ``token``: the conversation's lease
    token should it take the lease; ``checked``: whether each of its keys (the request's, the
    counter, the order) is checked for, by default as the insert found the rows."""
    res, conversation_id = new.response, new.conversation_id
    k = ctx.keys
    request_key = k.shard(conversation_id).request(res.request_id)
    if checked is None:
        checked = _checks(ctx, new, inserted)
    shard = k.shard(conversation_id)
    return lua.add_response_call(
        request=shard.request(res.request_id),
        response=shard.response(res.response_id),
        response_order=k.response_list(conversation_id),
        pending_messages=shard.pending_messages,
        request_list=k.request_list(conversation_id),
        request_seq=k.request_seq(conversation_id),
        drain_lease=k.drain_lease(conversation_id),
        conversation_id=conversation_id,
        origin=inserted.origin,
        request_id=res.request_id,
        response_id=res.response_id,
        member=min_message_info(res.request_id, res.response_id, conversation_id),
        response_timestamp_ms=new.timestamp_ms,
        task_item=new.payload,
        msg_id=msg_id,
        request_msg_id=inserted.request_msg_id,
        last=bool(res.last),
        now_ms=new.now_ms,
        message_ttl_ms=ctx.settings.message_ttl,
        awaited_message_ttl_ms=ctx.settings.awaited_message_ttl,
        blocked_limit_ms=ctx.blocked_ms,
        request_timestamp_ms=int(inserted.request_ts.timestamp() * 1000),
        lease_token=token,
        lease_ms=ctx.lease_ms,
        request_completed=bool(inserted.request_done),
        corr=res.corr,
        trace_parent=new.traced,
        check=checked[k.request_seq(conversation_id)],
        request_open=checked[request_key],
        others_open=checked[k.response_list(conversation_id)],
    )


def new_request_call(
    ctx: Context, new: NewRequest, msg_id: int, others_open: bool, check: bool = True
) -> Call:
    req = new.request
    return request_call(
        ctx, new.conversation_id, req.origin, req.request_id, new.timestamp_ms, msg_id, req.corr,
        check, others_open,
    )  # fmt: skip
