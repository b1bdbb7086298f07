"""Conversations: the open ones with why each waits, live, and one conversation's requests
and responses in order, as PostgreSQL records them and as the ordering gate holds them now;
the operator calls on them (AWAITED by hand, a new awaited date, removal after a delay, a
request's deletion), each with a note."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from orderly.api.console.render import CONSOLE, Viewer, page
from orderly.api.console.session import Form, Refused, Signed, act, form, require_admin
from orderly.worker import observe
from orderly.worker.conversations.model import check_conversation_id
from orderly.worker.core.clock import now_ms
from orderly.worker.core.errors import InvalidMessage, NotFound
from orderly.worker.messages import operations
from orderly.worker.runtime import Runtime

router = APIRouter(prefix=CONSOLE)

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


# --- the operator calls (worker.conversations.operations), each with a note ----------------


def _conversation_back(conversation_id: str) -> str:
    return f"/console/conversations/{quote(conversation_id, safe='')}"


async def _operate(
    request: Request,
    viewer: Viewer,
    conversation_id: str,
    call: Callable[[Runtime, Form, str], Any],
    said: Callable[[Any], str],
) -> Response:
    require_admin(viewer)
    fields = await form(request, viewer)
    runtime: Runtime = request.app.state.runtime
    return await act(
        viewer,
        functools.partial(call, runtime, fields, viewer.key.name),
        _conversation_back(conversation_id),
        said,
    )


def _note(fields: Form) -> dict[str, Any]:
    return {"note": fields.get("note")}


@router.post("/conversations/{conversation_id}/{kind}/{ident}/awaited")
async def set_awaited(
    request: Request,
    viewer: Signed,
    conversation_id: str,
    kind: Literal["requests", "responses"],
    ident: str,
) -> Response:
    """setAwaitedByRequestId (a request's PENDING responses) or setAwaitedByResponseId (the
    response, if PENDING): AWAITED."""
    which = {"request_id" if kind == "requests" else "response_id": ident}

    def call(runtime: Runtime, fields: Form, key: str) -> Any:
        return runtime.conversations.set_awaited(
            conversation_id, _note(fields), **which, key=key, owns=viewer.key.owns
        )

    return await _operate(request, viewer, conversation_id, call, _awaited_said)


def _awaited_said(result: Any) -> str:
    done = ", ".join(a["response_id"] for a in result.awaited) or "none"
    skipped = ", ".join(f"{s['response_id']} ({s['status']})" for s in result.skipped)
    return f"AWAITED: {done}" + (f"; left as they were: {skipped}" if skipped else "")


@router.post("/conversations/{conversation_id}/responses/{response_id}/awaited-date")
async def response_awaited_date(
    request: Request, viewer: Signed, conversation_id: str, response_id: str
) -> Response:
    """updateAwaitedExpires: an AWAITED response's new awaited date (UTC)."""

    def call(runtime: Runtime, fields: Form, key: str) -> Any:
        when = fields.get("awaited_to_date")
        data = {**_note(fields), "awaited_to_date": f"{when}Z" if when else ""}
        return runtime.conversations.set_awaited_date(
            conversation_id, response_id, data, key=key, owns=viewer.key.owns
        )

    return await _operate(
        request, viewer, conversation_id, call, lambda _: f"response {response_id}: new date set"
    )


@router.post("/conversations/{conversation_id}/responses/{response_id}/remove-at")
async def response_remove_at(
    request: Request, viewer: Signed, conversation_id: str, response_id: str
) -> Response:
    """removeAllReferencesAtTime: the response's references leave Redis after a delay."""

    def call(runtime: Runtime, fields: Form, key: str) -> Any:
        delay = fields.get("delay_s").strip()
        data = {**_note(fields), "delay_s": int(delay) if delay.isdigit() else delay}
        return runtime.conversations.remove_at(
            conversation_id, response_id, data, key=key, owns=viewer.key.owns
        )

    return await _operate(
        request,
        viewer,
        conversation_id,
        call,
        lambda _: f"response {response_id}: removed from Redis after the delay",
    )


@router.post("/conversations/{conversation_id}/requests/{request_id}/delete")
async def request_delete(
    request: Request, viewer: Signed, conversation_id: str, request_id: str
) -> Response:
    """deleteConversationRegister: the request's responses (in a status, or all and the
    request) CANCEL."""

    def call(runtime: Runtime, fields: Form, key: str) -> Any:
        data = _note(fields)
        if fields.get("status"):
            data["status"] = fields.get("status")
        return runtime.conversations.delete_register(
            conversation_id,
            request_id,
            data,
            runtime.broker.enqueue_drain,
            key=key,
            owns=viewer.key.owns,
        )

    def said(result: Any) -> str:
        gone = ", ".join(result.deleted) or "no response"
        return f"request {request_id}: deleted {gone}" + (
            "; the request is cancelled" if result.request_cancelled else ""
        )

    return await _operate(request, viewer, conversation_id, call, said)
