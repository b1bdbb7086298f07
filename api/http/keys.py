"""HTTP face of API keys (scope ``admin``): create (the token is in this one answer), list,
revoke. ``orderly key ...`` does the same from the command line."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from orderly.api.http import answers as a
from orderly.api.http.answers import answers
from orderly.api.http.auth import key_cache, requires
from orderly.api.http.common import AppRuntime, json_body
from orderly.api.http.contract import body
from orderly.worker import keys
from orderly.worker.keys import KeyIn

router = APIRouter(dependencies=requires(keys.ADMIN))


@router.post(
    "/keys",
    responses=answers(a.KeyMade, created=True),
    status_code=201,
    openapi_extra=body("KeyIn", KeyIn),
)
async def create_key(runtime: AppRuntime, request: Request) -> JSONResponse:
    data = await json_body(request)
    made, token = await run_in_threadpool(keys.create_key, runtime.engine, data, runtime.clock)
    return JSONResponse(status_code=201, content={**made, "token": token})


@router.get("/keys", responses=answers(list[a.Key]))
async def list_keys(runtime: AppRuntime, revoked: bool = False) -> JSONResponse:
    return JSONResponse(await run_in_threadpool(keys.list_keys, runtime.engine, revoked=revoked))


@router.delete("/keys/{name}", responses=answers(a.Key))
async def revoke_key(runtime: AppRuntime, name: str, request: Request) -> JSONResponse:
    revoked = await run_in_threadpool(keys.revoke_key, runtime.engine, name, runtime.clock)
    key_cache(request.app).clear()
    return JSONResponse(revoked)
