"""HTTP face of source systems: where final states of their messages are confirmed."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from orderly.api.http import answers as a
from orderly.api.http.answers import answers
from orderly.api.http.auth import requires
from orderly.api.http.common import AppRuntime, json_body
from orderly.api.http.contract import body
from orderly.worker import keys
from orderly.worker.messages import confirmations
from orderly.worker.messages.confirmations import SourceSystemIn

router = APIRouter()


@router.put(
    "/source-systems/{name}",
    responses=answers(a.SourceSystem),
    openapi_extra=body("SourceSystemIn", SourceSystemIn),
    dependencies=requires(keys.ADMIN),
)
async def put_source_system(runtime: AppRuntime, name: str, request: Request) -> JSONResponse:
    data = await json_body(request)
    saved = await run_in_threadpool(confirmations.set_source_system, runtime.engine, name, data)
    return JSONResponse(saved)


@router.get(
    "/source-systems", responses=answers(list[a.SourceSystem]), dependencies=requires(keys.ADMIN)
)
async def list_source_systems(runtime: AppRuntime) -> JSONResponse:
    found = await run_in_threadpool(confirmations.list_source_systems, runtime.engine)
    return JSONResponse(found)
