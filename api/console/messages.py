"""Messages: a filtered, paged list with counts by state (a NEW message due later reads
"scheduled"), live; the header's go-to (an id, or the start of a correlation id); one message
with everything the store knows of it; cancel, re-drive and respond, each with a note; and
re-drive or cancel of every message a filter selects, its count confirmed first."""

from __future__ import annotations

import functools
from collections.abc import Callable
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from orderly.api.console.render import CONSOLE, Viewer, page
from orderly.api.console.session import Signed, act, attempt, form, require_admin
from orderly.api.http.common import RowId
from orderly.models import MessageState
from orderly.worker.core.clock import utcnow
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.messages import bulk, operations
from orderly.worker.runtime import Runtime

router = APIRouter(prefix=CONSOLE)

# operations.cancel and operations.redrive: (engine, msg_id, body, enqueue, *, key)
Command = Callable[..., operations.CommandResult]

PAGE_SIZE = 50
FILTERS = (
    "state",
    "service",
    "operation",
    "source_system",
    "correlation_id",
    "correlation_match",
    "funnel",
    "process_id",
)
WINDOW = ("since", "until")


def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


def _given(request: Request) -> dict[str, str]:
    """The list's filters as the page was asked for them; a correlation id matches by its
    start unless the page says otherwise."""
    given = {name: request.query_params.get(name, "") for name in FILTERS + WINDOW}
    given["correlation_match"] = given["correlation_match"] or "prefix"
    return given


@router.get("/go")
async def go_to(request: Request, viewer: Signed) -> Response:
    """The header's search: a message by its id, else the messages whose correlation id
    starts with what was typed."""
    wanted = request.query_params.get("q", "").strip()
    if wanted.isdigit() and len(wanted) <= 18:
        return RedirectResponse(f"/console/messages/{int(wanted)}", 303)
    found = urlencode({"correlation_id": wanted, "correlation_match": "prefix"})
    return RedirectResponse(f"/console/messages?{found}" if wanted else "/console/messages", 303)


@router.get("/messages")
async def message_list(request: Request, viewer: Signed) -> HTMLResponse:
    given = _given(request)
    try:
        number = int(request.query_params.get("page", "1") or "1")
    except ValueError:
        number = 0
    engine = _runtime(request).engine
    problems: list[tuple[str, str]] = []
    rows: list[dict[str, object]] = []
    counts: dict[MessageState, int] = {}
    allowed: list[bulk.Action] = []
    try:
        if not 1 <= number <= operations.MAX_OFFSET // PAGE_SIZE:
            raise InvalidMessage("page", "must be a page number from 1")
        chosen = operations.message_filter(**given)
        allowed = bulk.actions_for(chosen)
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
        bulk=[(a.value, _BULK_LABEL[a]) for a in allowed],
        # What "scheduled" is measured against: a NEW message due after it waits for a time.
        now=utcnow(_runtime(request).clock),
    )


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


_BULK_LABEL = {bulk.Action.REDRIVE: "Re-drive all", bulk.Action.CANCEL: "Cancel all"}


@router.get("/messages/bulk")
async def bulk_confirm(request: Request, viewer: Signed) -> HTMLResponse:
    """What a command on every message of a filter would take: the count to confirm, a note."""
    require_admin(viewer)
    given = _given(request)
    problems: list[tuple[str, str]] = []
    ids: list[int] = []
    action = bulk.Action.REDRIVE
    try:
        action = _action(request.query_params.get("action", ""))
        chosen = operations.message_filter(**given)
        ids = await run_in_threadpool(
            bulk.matching, _runtime(request).engine, chosen, action, viewer.key.owns
        )
    except InvalidMessage as exc:
        problems = list(exc.problems)
    return page(
        request,
        "bulk.html",
        viewer,
        status=422 if problems else 200,
        given={k: v for k, v in given.items() if v},
        action=action.value,
        label=_BULK_LABEL[action],
        ids=ids,
        problems=problems,
    )


def _action(value: str) -> bulk.Action:
    try:
        return bulk.Action(value)
    except ValueError:
        raise InvalidMessage("action", "must be redrive or cancel") from None


@router.post("/messages/bulk")
async def bulk_run(request: Request, viewer: Signed) -> Response:
    """The confirmed command on every message of the filter, each with the note."""
    require_admin(viewer)
    fields = await form(request, viewer)
    runtime = _runtime(request)
    given = {name: fields.get(name) or "" for name in FILTERS + WINDOW}
    back = "/console/messages?" + urlencode({k: v for k, v in given.items() if v})

    def call() -> bulk.BulkResult:
        action = _action(fields.get("action") or "")
        expected = (fields.get("expected") or "").split(",")
        if not all(i.isdigit() and len(i) <= 18 for i in expected):
            raise InvalidMessage("expected", "must be the ids confirmed")
        return bulk.run(
            runtime.engine,
            operations.message_filter(**given),
            action,
            [int(i) for i in expected],
            {"note": fields.get("note")},
            runtime.broker.enqueue_processing,
            key=viewer.key.name,
            owns=viewer.key.owns,
            announce=runtime.announce_aborts,
        )

    def said(result: bulk.BulkResult) -> str:
        verb = "re-driven" if result.action is bulk.Action.REDRIVE else "cancelled"
        text = f"{len(result.done)} messages {verb}"
        if result.refused:
            first = next(iter(result.refused.values()))
            text += f"; {len(result.refused)} refused (changed meanwhile), e.g. {first}"
        return text

    return await act(viewer, call, back, said)


# After /messages/bulk: a path segment that is no id is not a message.
@router.get("/messages/{msg_id}")
async def message_page(request: Request, viewer: Signed, msg_id: RowId) -> Response:
    found = await attempt(
        functools.partial(
            operations.inspect_message, _runtime(request).engine, msg_id, viewer.key.owns
        )
    )
    return page(request, "message.html", viewer, m=found)
