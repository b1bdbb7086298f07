"""Conversations: the open ones with why each waits, and one conversation's requests and
responses in order, as PostgreSQL records them and as the ordering gate holds them now."""

from __future__ import annotations

import functools
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from orderly.api.console.render import page
from orderly.api.console.session import Refused, Signed
from orderly.worker import observe
from orderly.worker.conversations.model import check_conversation_id
from orderly.worker.core.clock import now_ms
from orderly.worker.core.errors import InvalidMessage, NotFound
from orderly.worker.messages import operations
from orderly.worker.runtime import Runtime

router = APIRouter()

SHOWN = 500
# Blocked first, in the order an operator looks at them.
_ORDER = {
    observe.BlockReason.AWAITED: 0,
    observe.BlockReason.RETRY: 1,
    observe.BlockReason.ACK: 2,
    observe.BlockReason.REQUEST: 3,
    None: 4,
}


@router.get("/conversations")
async def conversation_list(request: Request, viewer: Signed) -> Response:
    runtime: Runtime = request.app.state.runtime
    if wanted := request.query_params.get("id", "").strip():
        return RedirectResponse(f"/console/conversations/{quote(wanted, safe='')}", 303)
    keys = runtime.settings.bridge_keys
    found = await run_in_threadpool(
        functools.partial(
            observe.open_conversations, runtime.ordering_redis, keys, now_ms(runtime.clock)
        )
    )
    owns = viewer.key.owns
    if owns is not None:
        found = [c for c in found if c.origin in owns.origins]
    found.sort(key=lambda c: (_ORDER[c.reason], c.conversation_id))
    total, blocked = len(found), sum(1 for c in found if c.reason is not None)
    reason = request.query_params.get("reason", "")
    if reason:
        found = [c for c in found if (c.reason.value if c.reason else "none") == reason]
    late = await run_in_threadpool(
        functools.partial(operations.late_responses, runtime.engine, owns=owns)
    )
    return page(
        request,
        "conversations.html",
        viewer,
        conversations=found[:SHOWN],
        matching=len(found),
        total=total,
        blocked=blocked,
        late=late,
        reason=reason,
        reasons=[r.value for r in observe.BlockReason],
    )


@router.get("/conversations/{conversation_id}")
async def conversation_page(request: Request, viewer: Signed, conversation_id: str) -> HTMLResponse:
    runtime: Runtime = request.app.state.runtime
    try:
        check_conversation_id(conversation_id)
    except InvalidMessage as exc:
        raise Refused(422, list(exc.problems)) from None
    owns = viewer.key.owns
    history = await run_in_threadpool(
        operations.conversation_history, runtime.engine, conversation_id, owns
    )
    missing = Refused(404, [("conversation_id", f"no conversation {conversation_id!r}")])
    try:
        live = await run_in_threadpool(runtime.conversations.describe, conversation_id, owns)
    except NotFound:
        if owns is not None:
            raise missing from None
        raise
    if not history.turns and not live["requests"] and not live["responses"]:
        raise missing
    gate = {str(r["msgId"]): r for r in live["responses"] if r.get("msgId")}
    return page(
        request,
        "conversation.html",
        viewer,
        conversation_id=conversation_id,
        history=history,
        gate=gate,
        live=live,
    )
