"""HTTP face of message tracking: tracked work reported done by its xid."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from orderly.api.http import answers as a
from orderly.api.http.answers import answers
from orderly.api.http.auth import Consumer
from orderly.api.http.common import AppRuntime, json_body
from orderly.api.http.contract import body
from orderly.worker.messages.done_reports import DoneIn, report_done

router = APIRouter()


@router.post(
    "/tracking/done", responses=answers(a.TrackedDone), openapi_extra=body("TrackedDoneIn", DoneIn)
)
async def tracked_done(runtime: AppRuntime, request: Request, key: Consumer) -> JSONResponse:
    """Report done the tracked work known by its xid (the seed's ``:message:xid:$xid``): a
    message's msg_id, a claim's or a drain's meta id. A key that owns some source systems
    reports the messages of those only."""
    data = await json_body(request)
    done = await run_in_threadpool(
        functools.partial(report_done, runtime.engine, runtime.tracker, data, key.owns)
    )
    return JSONResponse({"xid": done.xid, "track_id": done.track_id, "outcome": done.outcome})
