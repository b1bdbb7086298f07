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
    done = ctx.scripts.run(
        "conv_remove_due",
        [
            shard.response(rid),
            k.response_list(cid),
            shard.pending_messages,
            k.request_list(cid),
            k.request_seq(cid),
        ],
        [member, shard.request_prefix, shard.async_prefix, ctx.now_ms()],
    )
    if len(done) != 3:
        return False
    msg_id, completed, status = (v.decode() if isinstance(v, bytes) else str(v) for v in done)
    with ctx.pg() as conn:
        if status == "SENT":
            # The client took it (202); its ACK is no longer waited for.
            ids = [int(msg_id), int(completed)] if completed else [int(msg_id)]
            conn.run("conv_ok", ids, f"delivered: {REMOVED_NOTE}")
        else:
            conn.run(
                "conv_op_cancel", [int(msg_id)], None, "scheduled removal", REMOVED_NOTE, "REMOVE"
            )
            if completed:
                conn.run(
                    "conv_ok", [int(completed)], f"completed: its final response {REMOVED_NOTE}"
                )
    log.info("response %s of conversation %s: references removed (%s)", rid, cid, status)
    return True
