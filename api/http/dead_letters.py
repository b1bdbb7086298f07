"""HTTP face of dead-lettered pub/sub deliveries: list them and send them again."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.http.common import AppRuntime, json_body
from worker import pubsub
from worker.core.errors import InvalidMessage

router = APIRouter()


@router.get("/dead-letters")
async def dead_letters(runtime: AppRuntime, room: str | None = None) -> JSONResponse:
    return JSONResponse(await run_in_threadpool(pubsub.dead_letters, runtime.engine, room))


@router.post("/dead-letters/redrive")
async def redrive(runtime: AppRuntime, request: Request) -> JSONResponse:
    data = await json_body(request)
    if not isinstance(data, dict):
        raise InvalidMessage("body", "must be a JSON object")
    ids = data.get("delivery_ids")
    if ids is not None and not (
        isinstance(ids, list)
        and all(isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in ids)
    ):
        raise InvalidMessage("delivery_ids", "must be a list of delivery ids")
    sub = data.get("subscription_id")
    if sub is not None and (not isinstance(sub, int) or isinstance(sub, bool)):
        raise InvalidMessage("subscription_id", "must be an integer")
    moved = await run_in_threadpool(pubsub.redrive, runtime.engine, ids, sub)
    return JSONResponse({"redriven": moved})
