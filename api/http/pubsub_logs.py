"""HTTP face of the pub/sub logs: the queue message log, its exceptions (one with its
traceback) and the published_messages rows, filtered by message and queue."""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from orderly.api.http import answers as a
from orderly.api.http.answers import answers
from orderly.api.http.auth import Operator
from orderly.api.http.common import AppRuntime, RowId
from orderly.worker import pubsub
from orderly.worker.keys import Principal
from orderly.worker.pubsub.logs import MAX_LOG_ROWS

router = APIRouter()

MAX_ID = 9_223_372_036_854_775_807
DeliveryId = Annotated[int | None, Query(ge=1, le=MAX_ID, description="one delivery's rows")]
CorrelationId = Annotated[
    str | None, Query(min_length=1, max_length=255, description="every delivery of one event")
]
SubscriptionId = Annotated[int | None, Query(ge=1, le=MAX_ID, description="one queue's rows")]
RoutingKey = Annotated[str | None, Query(min_length=1, max_length=255)]
Limit = Annotated[int, Query(ge=1, le=MAX_LOG_ROWS)]
Before = Annotated[int | None, Query(ge=1, le=MAX_ID, description="rows older than this id")]


async def _json(fn: Any, runtime: AppRuntime, key: Principal, **filters: Any) -> JSONResponse:
    asked = {k: v for k, v in filters.items() if v is not None}
    rows = await run_in_threadpool(functools.partial(fn, runtime.engine, key.owns, **asked))
    return JSONResponse(jsonable_encoder(rows))


@router.get("/queue-messages", responses=answers(list[a.QueueLogRow]))
async def queue_log(
    runtime: AppRuntime,
    key: Operator,
    delivery_id: DeliveryId = None,
    correlation_id: CorrelationId = None,
    subscription_id: SubscriptionId = None,
    routing_key: RoutingKey = None,
    state: Literal["Pending", "In process", "Completed", "Error"] | None = None,
    limit: Limit = 100,
    before: Before = None,
) -> JSONResponse:
    """The queue message log, newest first: a row per state a delivery entered."""
    return await _json(
        pubsub.queue_log,
        runtime,
        key,
        delivery_id=delivery_id,
        correlation_id=correlation_id,
        subscription_id=subscription_id,
        routing_key=routing_key,
        state=state,
        limit=limit,
        before=before,
    )


@router.get("/exceptions", responses=answers(list[a.ExceptionListed]))
async def exception_list(
    runtime: AppRuntime,
    key: Operator,
    delivery_id: DeliveryId = None,
    correlation_id: CorrelationId = None,
    subscription_id: SubscriptionId = None,
    routing_key: RoutingKey = None,
    type: Annotated[str | None, Query(min_length=1, max_length=255)] = None,
    limit: Limit = 100,
    before: Before = None,
) -> JSONResponse:
    """What went wrong in attempts, newest first (without tracebacks)."""
    return await _json(
        pubsub.exception_list,
        runtime,
        key,
        delivery_id=delivery_id,
        correlation_id=correlation_id,
        subscription_id=subscription_id,
        routing_key=routing_key,
        type=type,
        limit=limit,
        before=before,
    )


@router.get(
    "/exceptions/{exception_id}",
    responses=answers(a.ExceptionDetail),
)
async def exception_get(runtime: AppRuntime, exception_id: RowId, key: Operator) -> JSONResponse:
    """One exception with its traceback."""
    found = await run_in_threadpool(pubsub.exception_get, runtime.engine, exception_id, key.owns)
    return JSONResponse(jsonable_encoder(found))


@router.get(
    "/published-messages",
    responses=answers(list[a.PublishedRow]),
)
async def published_log(
    runtime: AppRuntime,
    key: Operator,
    delivery_id: DeliveryId = None,
    correlation_id: CorrelationId = None,
    subscription_id: SubscriptionId = None,
    routing_key: RoutingKey = None,
    state: Literal["PENDING", "DELIVERED", "FAILED", "DEAD", "EXPIRED"] | None = None,
    limit: Limit = 100,
    before: Before = None,
) -> JSONResponse:
    """published_messages, newest first: one row per attempt (``state``: its outcome)."""
    return await _json(
        pubsub.published_log,
        runtime,
        key,
        delivery_id=delivery_id,
        correlation_id=correlation_id,
        subscription_id=subscription_id,
        routing_key=routing_key,
        state=state,
        limit=limit,
        before=before,
    )
