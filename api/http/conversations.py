"""HTTP face of conversations: register requests, add responses, ACK them, describe."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.http import answers as a
from api.http.answers import answers
from api.http.auth import ack_header, requires
from api.http.common import AppRuntime, json_body
from api.http.contract import body
from worker import keys
from worker.conversations.model import RequestIn, ResponseIn

router = APIRouter()
# The clients' ACKs: authenticated by their ACK token, not an API key.
acks = APIRouter()


@router.post(
    "/conversations/{conversation_id}/requests",
    responses=answers(a.Accepted, created=True, repeat=True),
    status_code=201,
    openapi_extra=body("ConversationRequestIn", RequestIn),
    dependencies=requires(keys.PRODUCE),
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
    responses=answers(a.Accepted, created=True, repeat=True),
    status_code=201,
    openapi_extra=body("ConversationResponseIn", ResponseIn),
    dependencies=requires(keys.PRODUCE),
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


@router.get(
    "/conversations/{conversation_id}",
    responses=answers(a.Conversation),
    dependencies=requires(keys.OPERATE),
)
async def describe_conversation(runtime: AppRuntime, conversation_id: str) -> JSONResponse:
    view = await run_in_threadpool(runtime.conversations.describe, conversation_id)
    return JSONResponse(view)


@acks.post("/acks/{async_response_id}", responses=answers(a.Acked))
async def ack(
    runtime: AppRuntime,
    async_response_id: str,
    token: Annotated[str, Depends(ack_header)],
) -> JSONResponse:
    """A client's ACK of a response it answered 202: no API key, but the response's ACK token
    (``X-Orderly-Ack-Token``, sent with the response) brought back."""
    from worker.celery import enqueue_drain

    msg_id = await run_in_threadpool(
        runtime.conversations.ack, async_response_id, enqueue_drain, token
    )
    return JSONResponse({"msg_id": msg_id, "state": "OK"})
