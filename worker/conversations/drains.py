"""Starting a conversation's drain: one at a time, under the conversation's lease."""

from __future__ import annotations

from orderly.worker.conversations.context import Context
from orderly.worker.conversations.model import Enqueue
from orderly.worker.core.lease import RedisLease, new_token


def wake(ctx: Context, conversation_id: str, enqueue: Enqueue) -> bool:
    """Start a drain unless one holds the conversation (it will see what is due)."""
    lease = RedisLease(ctx.scripts, ctx.keys.drain_lease(conversation_id))
    token = new_token()
    if not lease.take(token, ctx.lease_ms):
        return False
    try:
        enqueue(conversation_id, token)
    except BaseException:
        lease.give_up(token)  # nobody will drain under it: let the next wake take it
        raise
    return True
