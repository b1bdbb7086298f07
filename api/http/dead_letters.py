"""HTTP face of dead-lettered pub/sub deliveries: list them and send them again."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from orderly.api.http import answers as a
from orderly.api.http.answers import answers
from orderly.api.http.auth import requires
from orderly.api.http.common import AppRuntime, json_body
from orderly.api.http.contract import body
from orderly.worker import keys, pubsub
from orderly.worker.core.inputs import parse_input
from orderly.worker.pubsub.pull import RedriveIn

router = APIRouter()


@router.get(
    "/dead-letters", responses=answers(list[a.DeadLetter]), dependencies=requires(keys.OPERATE)
)
async def dead_letters(runtime: AppRuntime, room: str | None = None) -> JSONResponse:
    return JSONResponse(await run_in_threadpool(pubsub.dead_letters, runtime.engine, room))


@router.post(
    "/dead-letters/redrive",
    responses=answers(a.RedrivenDeadLetters),
    openapi_extra=body("RedriveIn", RedriveIn),
    dependencies=requires(keys.OPERATE),
)
async def redrive(runtime: AppRuntime, request: Request) -> JSONResponse:
    asked = parse_input(RedriveIn, await json_body(request))
    moved = await run_in_threadpool(
        pubsub.redrive, runtime.engine, asked.delivery_ids, asked.subscription_id
    )
    return JSONResponse({"redriven": moved})
