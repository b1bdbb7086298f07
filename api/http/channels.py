"""HTTP face of delivery channels: one per origin, set and listed."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from orderly.api.http import answers as a
from orderly.api.http.answers import answers
from orderly.api.http.auth import requires
from orderly.api.http.common import AppRuntime, json_body
from orderly.api.http.contract import body
from orderly.worker import channels as channel_defs
from orderly.worker import keys
from orderly.worker.core.errors import InvalidMessage

router = APIRouter()


@router.put(
    "/channels/{origin}",
    responses=answers(a.Channel),
    openapi_extra=body("ChannelIn", channel_defs.ChannelIn),
    dependencies=requires(keys.ADMIN),
)
async def put_channel(runtime: AppRuntime, origin: str, request: Request) -> JSONResponse:
    data = await json_body(request)
    if not isinstance(data, dict):
        raise InvalidMessage("body", f"must be a JSON object, got {type(data).__name__}")
    # In a thread: checking the URL resolves its host (the outbound address policy).
    channel = await run_in_threadpool(channel_defs.validate, origin, data, runtime.settings)
    await run_in_threadpool(channel_defs.put_channel, runtime.engine, channel)
    runtime.channels.invalidate()
    return JSONResponse(channel.as_dict())


@router.get("/channels", responses=answers(list[a.Channel]), dependencies=requires(keys.ADMIN))
async def list_channels(runtime: AppRuntime) -> JSONResponse:
    found = await run_in_threadpool(runtime.channels.all)
    return JSONResponse([c.as_dict() for c in found.values()])
