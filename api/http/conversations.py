"""HTTP face of conversations: register requests, add responses, ACK them, describe."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.http.common import AppRuntime, json_body
from api.http.contract import body
from worker.conversations.model import RequestIn, ResponseIn

router = APIRouter()


@router.post(
    "/conversations/{conversation_id}/requests",
    status_code=201,
    openapi_extra=body("ConversationRequestIn", RequestIn),
)
async def register_request(
    runtime: AppRuntime, conversation_id: str, request: Request
) -> JSONResponse:
    data = await json_body(request)
    result = await run_in_threadpool(runtime.conversations.register_request, conversation_id, data)
    return JSONResponse(
        status_code=201 if result.created else 200,
        content={"msg_id": result.msg_id, "state": result.state.value},
    )


@router.post(
    "/conversations/{conversation_id}/responses",
    status_code=201,
    openapi_extra=body("ConversationResponseIn", ResponseIn),
)
async def add_response(runtime: AppRuntime, conversation_id: str, request: Request) -> JSONResponse:
    from worker.celery import enqueue_drain

    data = await json_body(request)
    result = await run_in_threadpool(
        runtime.conversations.add_response, conversation_id, data, enqueue_drain
    )
    return JSONResponse(
        status_code=201 if result.created else 200,
        content={"msg_id": result.msg_id, "state": result.state.value},
    )


@router.get("/conversations/{conversation_id}")
async def describe_conversation(runtime: AppRuntime, conversation_id: str) -> JSONResponse:
    view = await run_in_threadpool(runtime.conversations.describe, conversation_id)
    return JSONResponse(view)


@router.post("/acks/{async_response_id}")
async def ack(runtime: AppRuntime, async_response_id: str) -> JSONResponse:
    from worker.celery import enqueue_drain

    msg_id = await run_in_threadpool(runtime.conversations.ack, async_response_id, enqueue_drain)
    return JSONResponse({"msg_id": msg_id, "state": "OK"})
