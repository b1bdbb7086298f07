"""HTTP face of periodic schedules: create, list, show, change (enable, disable) and remove.

Changing what messages are produced needs ``produce``; reading needs ``operate``, as listing
messages does. A key bound to source systems acts on their schedules only (worker.schedules).
"""

from __future__ import annotations

import functools
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from orderly.api.http.answers import answers
from orderly.api.http.auth import Operator, Producer
from orderly.api.http.common import AppRuntime, json_body
from orderly.api.http.contract import body
from orderly.worker.messages import schedules
from orderly.worker.messages.schedules import ScheduleIn, SchedulePatchIn, ScheduleView
from orderly.worker.runtime import Runtime

router = APIRouter()


class ScheduleRemoved(BaseModel):
    name: str
    deleted: bool


def _answer(found: ScheduleView, status: int = 200) -> JSONResponse:
    return JSONResponse(status_code=status, content=jsonable_encoder(found.as_dict()))


def _check(runtime: Runtime) -> schedules.MessageCheck:
    return schedules.message_check(runtime.registry, runtime.settings.max_payload_bytes)


@router.post(
    "/schedules",
    responses=answers(ScheduleView, created=True),
    status_code=201,
    openapi_extra=body("ScheduleIn", ScheduleIn),
)
async def create_schedule(runtime: AppRuntime, request: Request, key: Producer) -> JSONResponse:
    """A schedule: one message per due instant of its cron expression, read in its time zone
    (``{{instant}}`` and ``{{name}}`` in the payload's strings replaced)."""
    data = await json_body(request)
    made = await run_in_threadpool(
        schedules.create_schedule, runtime.engine, data, _check(runtime), runtime.clock, key.owns
    )
    return _answer(made, 201)


@router.get("/schedules", responses=answers(list[ScheduleView]))
async def list_schedules(
    runtime: AppRuntime,
    key: Operator,
    limit: Annotated[int, Query(ge=1, le=schedules.MAX_LIST)] = 100,
    offset: Annotated[int, Query(ge=0, le=schedules.MAX_OFFSET)] = 0,
) -> JSONResponse:
    """The schedules by name."""
    found = await run_in_threadpool(
        functools.partial(
            schedules.list_schedules, runtime.engine, key.owns, limit=limit, offset=offset
        )
    )
    return JSONResponse(jsonable_encoder([s.as_dict() for s in found]))


@router.get("/schedules/{name}", responses=answers(ScheduleView))
async def show_schedule(runtime: AppRuntime, name: str, key: Operator) -> JSONResponse:
    found = await run_in_threadpool(schedules.show_schedule, runtime.engine, name, key.owns)
    return _answer(found)


@router.patch(
    "/schedules/{name}",
    responses=answers(ScheduleView),
    openapi_extra=body("SchedulePatchIn", SchedulePatchIn),
)
async def update_schedule(
    runtime: AppRuntime, name: str, request: Request, key: Producer
) -> JSONResponse:
    """Enable or disable a schedule, or change its cron expression, time zone or template.
    A new expression or time zone, or enabling it, makes it due at its first instant after
    now."""
    data = await json_body(request)
    changed = await run_in_threadpool(
        schedules.update_schedule,
        runtime.engine,
        name,
        data,
        _check(runtime),
        runtime.clock,
        key.owns,
    )
    return _answer(changed)


@router.delete("/schedules/{name}", responses=answers(ScheduleRemoved))
async def delete_schedule(runtime: AppRuntime, name: str, key: Producer) -> JSONResponse:
    """Remove a schedule; the messages it produced stay."""
    await run_in_threadpool(schedules.delete_schedule, runtime.engine, name, key.owns)
    return JSONResponse({"name": name, "deleted": True})
