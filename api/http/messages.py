"""HTTP face of messages: intake, listing and inspection, operator commands, external responses."""

from __future__ import annotations

import functools
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from orderly.api.http import answers as a
from orderly.api.http.answers import answers
from orderly.api.http.auth import Operator, Producer, checks_key, key_of
from orderly.api.http.common import (
    AppIntake,
    AppRuntime,
    RowId,
    intake_of,
    json_body,
    small_body,
)
from orderly.api.http.contract import body, conflict
from orderly.models import MessageState
from orderly.worker import keys
from orderly.worker.messages import operations
from orderly.worker.messages.inputs import MessageBatchIn, MessageIn, batch_items
from orderly.worker.messages.operations import CommandIn, ResponseIn

router = APIRouter()

ISO_8601 = "ISO 8601 (2026-01-31T12:00:00Z; without a zone, UTC)"

# Intake's 409: the ids are taken by another message (the stored one stands).
CONFLICTING = (
    "another message (another service, operation or payload) is stored under this "
    "`(correlation_id, source_system)`: refused, nothing stored; the problem (field "
    "`correlation_id`) names the stored msg_id. The same message again answers 200"
)


@router.post(
    "/messages",
    responses={**answers(a.Accepted, created=True, repeat=True), **conflict(CONFLICTING)},
    status_code=201,
    openapi_extra={**body("MessageIn", MessageIn), **checks_key(keys.PRODUCE)},
)
async def submit(request: Request) -> JSONResponse:
    """One message: 201 stored now (due at once, or scheduled by ``delay_ms`` or
    ``not_before``); 200 the same message stored before; 409 another message holds its
    (correlation_id, source_system)."""
    # The busiest route: its key checked and its intake taken without dependencies.
    key = await key_of(request, keys.PRODUCE)
    intake = intake_of(request)
    data = await json_body(request)
    if await small_body(request):  # with the others submitted now: one commit (group commit)
        result = await intake.submit_together(data, key.owns)
    else:
        result = await run_in_threadpool(intake.submit, data, key.owns)
    return JSONResponse(
        status_code=201 if result.created else 200,
        content={"msg_id": result.msg_id, "state": result.state.value},
    )


@router.post(
    "/messages:batch",
    responses={
        **answers(a.BatchAccepted, created=True, repeat=True),
        **conflict(f"{CONFLICTING}. One such message refuses the whole batch"),
    },
    status_code=201,
    openapi_extra=body("MessageBatchIn", MessageBatchIn),
)
async def submit_batch(
    intake: AppIntake, runtime: AppRuntime, request: Request, key: Producer
) -> JSONResponse:
    """Up to 1,000 messages at once, each idempotent as with POST /messages: all are
    validated first (one bad message refuses them all, named ``messages[i].field``), then
    stored in one transaction (one that conflicts with a stored message refuses them all:
    409). 201 when any was stored now, 200 when all were stored before."""
    data = await json_body(request, runtime.settings.max_batch_bytes)
    results = await run_in_threadpool(intake.submit_many, batch_items(data), key.owns)
    return JSONResponse(
        status_code=201 if any(r.created for r in results) else 200,
        content={
            "results": [
                {"msg_id": r.msg_id, "state": r.state.value, "created": r.created} for r in results
            ]
        },
    )


@router.post(
    "/messages/responses",
    responses=answers(a.ResponseAccepted, created=True, repeat=True),
    openapi_extra=body("ExternalResponseIn", ResponseIn),
)
async def receive_response(runtime: AppRuntime, request: Request, key: Producer) -> JSONResponse:
    data = await json_body(request)
    result = await run_in_threadpool(
        functools.partial(
            operations.receive_response,
            runtime.engine,
            data,
            runtime.broker.enqueue_processing,
            owns=key.owns,
        )
    )
    return JSONResponse(
        status_code=201 if result.created else 200,
        content={"msg_id": result.msg_id, "state": result.state.value, "res_id": result.res_id},
    )


@router.get("/messages", responses=answers(list[a.MessageRow]))
async def list_messages(
    runtime: AppRuntime,
    key: Operator,
    state: MessageState | None = None,
    funnel: str | None = None,
    process_id: Annotated[
        str | None, Query(description="the process the messages belong to (its process_id)")
    ] = None,
    service: str | None = None,
    operation: str | None = None,
    source_system: str | None = None,
    correlation_id: str | None = None,
    correlation_match: Annotated[
        Literal["exact", "prefix", "contains"],
        Query(description="how correlation_id matches: the whole id, its start, or a part"),
    ] = "exact",
    since: Annotated[str | None, Query(description=f"msg_timestamp from: {ISO_8601}")] = None,
    until: Annotated[str | None, Query(description=f"msg_timestamp before: {ISO_8601}")] = None,
    limit: Annotated[int, Query(ge=1, le=operations.MAX_LIST)] = 100,
    offset: Annotated[int, Query(ge=0, le=operations.MAX_OFFSET)] = 0,
) -> JSONResponse:
    """Messages matching every filter given, oldest msg_timestamp first."""
    found = operations.message_filter(
        state=state,
        funnel=funnel,
        process_id=process_id,
        service=service,
        operation=operation,
        source_system=source_system,
        correlation_id=correlation_id,
        correlation_match=correlation_match,
        since=since,
        until=until,
    )
    rows = await run_in_threadpool(
        functools.partial(
            operations.list_messages,
            runtime.engine,
            found,
            limit=limit,
            offset=offset,
            owns=key.owns,
        )
    )
    return JSONResponse(jsonable_encoder(rows))


@router.get("/messages/{msg_id}", responses=answers(a.MessageDetail))
async def show(runtime: AppRuntime, msg_id: RowId, key: Operator) -> JSONResponse:
    row = await run_in_threadpool(operations.inspect_message, runtime.engine, msg_id, key.owns)
    return JSONResponse(jsonable_encoder(row))


@router.post(
    "/messages/{msg_id}/cancel",
    responses=answers(a.Cancelled),
    openapi_extra=body("CommandIn", CommandIn),
)
async def cancel(
    runtime: AppRuntime, msg_id: RowId, request: Request, key: Operator
) -> JSONResponse:
    data = await json_body(request)
    done = await run_in_threadpool(
        functools.partial(
            operations.cancel,
            runtime.engine,
            msg_id,
            data,
            runtime.broker.enqueue_processing,
            key=key.name,
            owns=key.owns,
            announce=runtime.announce_aborts,
        )
    )
    return JSONResponse(
        {"msg_id": done.msg_id, "state": done.state.value, "cancelled": list(done.cancelled)}
    )


@router.post(
    "/messages/{msg_id}/redrive",
    responses=answers(a.Redriven),
    openapi_extra=body("CommandIn", CommandIn),
)
async def redrive_message(
    runtime: AppRuntime, msg_id: RowId, request: Request, key: Operator
) -> JSONResponse:
    data = await json_body(request)
    done = await run_in_threadpool(
        functools.partial(
            operations.redrive,
            runtime.engine,
            msg_id,
            data,
            runtime.broker.enqueue_processing,
            key=key.name,
            owns=key.owns,
        )
    )
    return JSONResponse(
        {"msg_id": done.msg_id, "state": done.state.value, "reopened": list(done.reopened)}
    )
