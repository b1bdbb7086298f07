"""Periodic schedules: each with its cron expression, its messages and its next and last
instants (a key bound to source systems sees theirs only)."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from starlette.concurrency import run_in_threadpool

from orderly.api.console.render import CONSOLE, page
from orderly.api.console.session import Signed
from orderly.worker.messages import schedules
from orderly.worker.runtime import Runtime

router = APIRouter(prefix=CONSOLE)

SHOWN = 500


@router.get("/schedules")
async def schedule_list(request: Request, viewer: Signed) -> HTMLResponse:
    runtime: Runtime = request.app.state.runtime
    found = await run_in_threadpool(
        functools.partial(schedules.list_schedules, runtime.engine, viewer.key.owns, limit=SHOWN)
    )
    return page(request, "schedules.html", viewer, schedules=found, shown=SHOWN)
