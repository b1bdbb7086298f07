"""HTTP face of conversations: register requests, add responses, ACK them, describe; the
operators' operations (worker/conversations/operations.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from orderly.api.http import answers as a
from orderly.api.http.answers import answers
from orderly.api.http.auth import Operator, ack_header, checks_key, key_of
from orderly.api.http.common import AppRuntime, json_body, runtime_of, small_body
from orderly.api.http.contract import body
from orderly.api.http.ratelimit import limits_of
from orderly.worker import keys
from orderly.worker.channels import ACK_TOKEN_FORM
from orderly.worker.conversations.model import RequestIn, ResponseIn
from orderly.worker.conversations.operations import AwaitedDateIn, OperatorIn, RemovalIn
from orderly.worker.core.errors import Unauthenticated, UnknownAck

router = APIRouter()
# The clients' ACKs: authenticated by their ACK token, not an API key.
acks = APIRouter()


@router.post(
    "/conversations/{conversation_id}/requests",
    responses=answers(a.Accepted, created=True, repeat=True),
    status_code=201,
    openapi_extra={**body("ConversationRequestIn", RequestIn), **checks_key(keys.PRODUCE)},
)
async def register_request(conversation_id: str, request: Request) -> JSONResponse:
    key = await key_of(request, keys.PRODUCE)  # a busy route: no dependencies (auth.key_of)
    runtime = runtime_of(request)
    data = await json_body(request)
    if await small_body(request):  # with the others registered now: one commit
        result = await runtime.conversations.register_request_together(
            conversation_id, data, key.owns
        )
    else:  # validated in a thread
        result = await run_in_threadpool(
            runtime.conversations.register_request, conversation_id, data, key.owns
        )
    return JSONResponse(
        status_code=201 if result.created else 200,
        content={"msg_id": result.msg_id, "state": result.state.value},
    )


@router.post(
    "/conversations/{conversation_id}/responses",
    responses=answers(a.Accepted, created=True, repeat=True),
    status_code=201,
    openapi_extra={**body("ConversationResponseIn", ResponseIn), **checks_key(keys.PRODUCE)},
)
async def add_response(conversation_id: str, request: Request) -> JSONResponse:
    key = await key_of(request, keys.PRODUCE)
    runtime = runtime_of(request)
    data = await json_body(request)
    enqueue = runtime.broker.enqueue_drain
    if await small_body(request):  # with the others added now: one commit
        result = await runtime.conversations.add_response_together(
            conversation_id, data, enqueue, key.owns
        )
    else:
        result = await run_in_threadpool(
            runtime.conversations.add_response, conversation_id, data, enqueue, key.owns
        )
    return JSONResponse(
        status_code=201 if result.created else 200,
        content={"msg_id": result.msg_id, "state": result.state.value},
    )


@router.get(
    "/conversations/{conversation_id}",
    responses=answers(a.Conversation),
)
async def describe_conversation(
    runtime: AppRuntime, conversation_id: str, key: Operator
) -> JSONResponse:
    view = await run_in_threadpool(runtime.conversations.describe, conversation_id, key.owns)
    return JSONResponse(view)


@router.get(
    "/conversation-messages",
    responses=answers(a.ConversationMessage),
)
async def get_message(
    runtime: AppRuntime,
    key: Operator,
    response_id: str | None = None,
    async_response_id: str | None = None,
    fields: Annotated[str | None, Query(description="Field names, comma-separated")] = None,
) -> JSONResponse:
    """getConversationMessage: one response by ``response_id`` or ``async_response_id``."""
    view = await run_in_threadpool(
        functools.partial(
            runtime.conversations.get_message,
            response_id=response_id,
            async_response_id=async_response_id,
            fields=fields,
            owns=key.owns,
        )
    )
    return JSONResponse(view)


@router.delete(
    "/conversations/{conversation_id}/requests/{request_id}",
    responses=answers(a.ConversationDeleted),
)
async def delete_register(
    runtime: AppRuntime,
    conversation_id: str,
    request_id: str,
    key: Operator,
    status: str | None = None,
    all_origin_except: str | None = None,
    note: str | None = None,
) -> JSONResponse:
    """deleteConversationRegister: the request's responses (only those in ``status``, if
    given; with no status the request too) CANCEL, unless its origin is
    ``all_origin_except``."""
    given = {"status": status, "all_origin_except": all_origin_except, "note": note}
    data = {name: value for name, value in given.items() if value is not None}
    return await _answer(
        runtime.conversations.delete_register,
        conversation_id,
        request_id,
        data,
        runtime.broker.enqueue_drain,
        key=key.name,
        owns=key.owns,
    )


async def _answer(call: Callable[..., Any], *args: Any, **kwargs: Any) -> JSONResponse:
    """An operator's operation, run off the event loop; its answer as JSON."""
    done = await run_in_threadpool(functools.partial(call, *args, **kwargs))
    return JSONResponse(asdict(done) if is_dataclass(done) and not isinstance(done, type) else done)


@router.post(
    "/conversations/{conversation_id}/requests/{request_id}/awaited",
    responses=answers(a.ConversationAwaited),
    openapi_extra=body("ConversationOperatorIn", OperatorIn),
)
async def set_awaited_by_request(
    runtime: AppRuntime, conversation_id: str, request_id: str, request: Request, key: Operator
) -> JSONResponse:
    """setAwaitedByRequestId: the request's PENDING responses AWAITED."""
    data = await json_body(request)
    return await _answer(
        runtime.conversations.set_awaited,
        conversation_id,
        data,
        request_id=request_id,
        key=key.name,
        owns=key.owns,
    )


@router.post(
    "/conversations/{conversation_id}/responses/{response_id}/awaited",
    responses=answers(a.ConversationAwaited),
    openapi_extra=body("ConversationOperatorIn", OperatorIn),
)
async def set_awaited_by_response(
    runtime: AppRuntime, conversation_id: str, response_id: str, request: Request, key: Operator
) -> JSONResponse:
    """setAwaitedByResponseId: the response AWAITED, if PENDING."""
    data = await json_body(request)
    return await _answer(
        runtime.conversations.set_awaited,
        conversation_id,
        data,
        response_id=response_id,
        key=key.name,
        owns=key.owns,
    )


@router.put(
    "/conversations/{conversation_id}/responses/{response_id}/awaited-date",
    responses=answers(a.AwaitedDate),
    openapi_extra=body("AwaitedDateIn", AwaitedDateIn),
)
async def set_awaited_date(
    runtime: AppRuntime, conversation_id: str, response_id: str, request: Request, key: Operator
) -> JSONResponse:
    """updateAwaitedExpires: an AWAITED response's new awaitedToDate."""
    data = await json_body(request)
    return await _answer(
        runtime.conversations.set_awaited_date,
        conversation_id,
        response_id,
        data,
        key=key.name,
        owns=key.owns,
    )


@router.post(
    "/conversations/{conversation_id}/responses/{response_id}/removal",
    responses=answers(a.RemovalScheduled),
    openapi_extra=body("RemovalIn", RemovalIn),
)
async def remove_at(
    runtime: AppRuntime, conversation_id: str, response_id: str, request: Request, key: Operator
) -> JSONResponse:
    """removeAllReferencesAtTime: the response's references leave Redis after ``delay_s``."""
    data = await json_body(request)
    return await _answer(
        runtime.conversations.remove_at,
        conversation_id,
        response_id,
        data,
        key=key.name,
        owns=key.owns,
    )


@acks.post("/acks/{async_response_id}", responses=answers(a.Acked))
async def ack(
    runtime: AppRuntime,
    request: Request,
    async_response_id: str,
    token: Annotated[str, Depends(ack_header)],
) -> JSONResponse:
    """A client's ACK of a response it answered 202: no API key, but the response's ACK token
    (``X-Orderly-Ack-Token``, sent with the response) brought back. A refused ACK whose token
    has the right form (a guess) counts against the client address's refused limit."""
    limits, address = limits_of(request)
    limits.refuse_if_blocked(address)
    try:
        msg_id = await run_in_threadpool(
            runtime.conversations.ack, async_response_id, runtime.broker.enqueue_drain, token
        )
    except (UnknownAck, Unauthenticated):
        if ACK_TOKEN_FORM.fullmatch(token):
            await limits.refused(address)
        raise
    return JSONResponse({"msg_id": msg_id, "state": "OK"})
