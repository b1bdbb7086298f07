"""removeAllReferencesAtTime, when due: a response's references leave Redis at the time an
operator gave (worker.conversations.operations.remove_at).

The removal waits as a member of its shard's ``scheduled`` set, the conversations' wake-ups,
which the ticker walks as due work (agent.wakes): its member is the response's MinMessageInfo,
a JSON object, where a wake-up's member is a conversation id (never one: ID_PATTERN). The
hand-off runs the removal (conv_remove_due.lua), records it in PostgreSQL, and wakes the
conversation, whose next response may go now.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from orderly.worker import lua
from orderly.worker.conversations.context import Context

log = logging.getLogger(__name__)

REMOVED_NOTE = "its references were removed from Redis at the time an operator set"


def is_removal(member: str) -> bool:
    """A member of ``scheduled`` that is a removal (a MinMessageInfo), not a conversation id."""
    return member.startswith("{")


def conversation_of(member: str) -> str:
    """The conversation a member of ``scheduled`` belongs to."""
    if is_removal(member):
        return str(json.loads(member)["cnId"])
    return member


def remove_due(ctx: Context, member: str) -> bool:
    """Remove the response ``member`` names, if its removal is due; True when it was."""
    info: dict[str, Any] = json.loads(member)
    cid, rid = info["cnId"], info["rsId"]
    k = ctx.keys
    shard = k.shard(cid)
    # The Redis step and its record in one locked transaction (Context.locked).
    with ctx.locked(cid) as conn:
        done = lua.conv_remove_due(
            ctx.scripts,
            response=shard.response(rid),
            response_order=k.response_list(cid),
            pending_messages=shard.pending_messages,
            request_list=k.request_list(cid),
            request_seq=k.request_seq(cid),
            member=member,
            request_prefix=shard.request_prefix,
            async_prefix=shard.async_prefix,
            now_ms=ctx.now_ms(),
        )
        if done is None:
            return False
        msg_id, completed, status = done.msg_id, done.completed_request_msg_id, done.status
        if status == "SENT":
            # The client took it (202); its ACK is no longer waited for.
            conn.run("conv_ok", done.msg_ids, f"delivered: {REMOVED_NOTE}")
        else:
            conn.run("conv_op_cancel", [msg_id], None, "scheduled removal", REMOVED_NOTE, "REMOVE")
            if completed is not None:
                conn.run("conv_ok", [completed], f"completed: its final response {REMOVED_NOTE}")
    log.info("response %s of conversation %s: references removed (%s)", rid, cid, status)
    return True
