"""HTTP face of dead-lettered pub/sub deliveries: list them and send them again."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from orderly.api.http import answers as a
from orderly.api.http.answers import answers
from orderly.api.http.auth import Operator
from orderly.api.http.common import AppRuntime, json_body
from orderly.api.http.contract import body
from orderly.worker import pubsub
from orderly.worker.core.inputs import parse_input
from orderly.worker.pubsub.pull import RedriveIn

router = APIRouter()


@router.get("/dead-letters", responses=answers(list[a.DeadLetter]))
async def dead_letters(runtime: AppRuntime, key: Operator, room: str | None = None) -> JSONResponse:
    found = await run_in_threadpool(pubsub.dead_letters, runtime.engine, room, key.owns)
    return JSONResponse(found)


@router.post(
    "/dead-letters/redrive",
    responses=answers(a.RedrivenDeadLetters),
    openapi_extra=body("RedriveIn", RedriveIn),
)
async def redrive(runtime: AppRuntime, request: Request, key: Operator) -> JSONResponse:
    asked = parse_input(RedriveIn, await json_body(request))
    moved = await run_in_threadpool(
        functools.partial(
            pubsub.redrive,
            runtime.engine,
            asked.delivery_ids,
            asked.subscription_id,
            owns=key.owns,
        )
    )
    return JSONResponse({"redriven": moved})
