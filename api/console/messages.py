"""Messages: a filtered, paged list with counts by state (a NEW message due later reads
"scheduled"); one message with everything the store knows of it; cancel, re-drive and
respond, each with a note."""

from __future__ import annotations

import functools
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool

from orderly.api.console.render import Viewer, page
from orderly.api.console.session import Signed, act, attempt, form
from orderly.api.http.common import RowId
from orderly.models import MessageState
from orderly.worker.core.clock import utcnow
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.messages import operations
from orderly.worker.runtime import Runtime

router = APIRouter()

# operations.cancel and operations.redrive: (engine, msg_id, body, enqueue, *, key)
Command = Callable[..., operations.CommandResult]

PAGE_SIZE = 50
FILTERS = ("state", "service", "operation", "source_system", "correlation_id", "funnel")
WINDOW = ("since", "until")


def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


@router.get("/messages")
async def message_list(request: Request, viewer: Signed) -> HTMLResponse:
    given = {name: request.query_params.get(name, "") for name in FILTERS + WINDOW}
    try:
        number = int(request.query_params.get("page", "1") or "1")
    except ValueError:
        number = 0
    engine = _runtime(request).engine
    problems: list[tuple[str, str]] = []
    rows: list[dict[str, object]] = []
    counts: dict[MessageState, int] = {}
    try:
        if not 1 <= number <= operations.MAX_OFFSET // PAGE_SIZE:
            raise InvalidMessage("page", "must be a page number from 1")
        chosen = operations.message_filter(**given)
        rows = await run_in_threadpool(
            functools.partial(
                operations.list_messages,
                engine,
                chosen,
                limit=PAGE_SIZE + 1,
                offset=(number - 1) * PAGE_SIZE,
                newest_first=True,
                owns=viewer.key.owns,
            )
        )
        counts = await run_in_threadpool(operations.count_by_state, engine, chosen, viewer.key.owns)
    except InvalidMessage as exc:
        problems = list(exc.problems)
    return page(
        request,
        "messages.html",
        viewer,
        status=422 if problems else 200,
        given=given,
        states=list(MessageState),
        rows=rows[:PAGE_SIZE],
        more=len(rows) > PAGE_SIZE,
        number=number,
        counts=counts,
        problems=problems,
        # What "scheduled" is measured against: a NEW message due after it waits for a time.
        now=utcnow(_runtime(request).clock),
    )


@router.get("/messages/{msg_id}")
async def message_page(request: Request, viewer: Signed, msg_id: RowId) -> Response:
    found = await attempt(
        functools.partial(
            operations.inspect_message, _runtime(request).engine, msg_id, viewer.key.owns
        )
    )
    return page(request, "message.html", viewer, m=found)


def _back(msg_id: int) -> str:
    return f"/console/messages/{msg_id}"


async def _command(
    request: Request, viewer: Viewer, msg_id: int, command: Command, done: str
) -> Response:
    note = {"note": (await form(request, viewer)).get("note")}
    runtime = _runtime(request)
    call = functools.partial(
        command,
        runtime.engine,
        msg_id,
        note,
        runtime.broker.enqueue_processing,
        key=viewer.key.name,
    )

    def said(result: operations.CommandResult) -> str:
        with_it = ", ".join(map(str, result.cancelled))
        return f"message {msg_id} {done}" + (f" with {with_it}" if with_it else "")

    return await act(viewer, call, _back(msg_id), said)


@router.post("/messages/{msg_id}/cancel")
async def cancel(request: Request, viewer: Signed, msg_id: RowId) -> Response:
    command = functools.partial(operations.cancel, announce=_runtime(request).announce_aborts)
    return await _command(request, viewer, msg_id, command, "cancelled")


@router.post("/messages/{msg_id}/redrive")
async def redrive(request: Request, viewer: Signed, msg_id: RowId) -> Response:
    return await _command(request, viewer, msg_id, operations.redrive, "re-driven")


@router.post("/messages/{msg_id}/respond")
async def respond(request: Request, viewer: Signed, msg_id: RowId) -> Response:
    """The response the message waits for, given by hand, with a note."""
    fields = await form(request, viewer)
    response = {
        "payload": fields.get("payload") or None,
        "failed": fields.get("failed") == "on",
        "reason": fields.text("reason"),
    }
    runtime = _runtime(request)
    call = functools.partial(
        operations.respond,
        runtime.engine,
        msg_id,
        response,
        runtime.broker.enqueue_processing,
        note=fields.get("note"),
        key=viewer.key.name,
    )

    def done(result: operations.ResponseResult) -> str:
        if result.created:
            return f"message {msg_id} answered"
        return f"message {msg_id} had its response already: nothing changed"

    return await act(viewer, call, _back(msg_id), done)
