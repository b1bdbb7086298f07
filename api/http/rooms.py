"""HTTP face of pub/sub rooms: rooms, event types, publishers, subscriptions, publish, pull, ack."""

from __future__ import annotations

import functools
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from orderly.api.http import answers as a
from orderly.api.http.answers import answers
from orderly.api.http.auth import Consumer, caller, checks_key, key_of, requires
from orderly.api.http.common import AppRuntime, RowId, json_body, runtime_of, small_body
from orderly.api.http.contract import body
from orderly.worker import keys, pubsub
from orderly.worker.core.inputs import parse_input
from orderly.worker.keys import Principal
from orderly.worker.pubsub import endpoints, replay, waiting
from orderly.worker.pubsub.admin import (
    EventTypeIn,
    PublisherIn,
    RoomIn,
    RoomPatchIn,
    SubscriptionIn,
    SubscriptionPatchIn,
)
from orderly.worker.pubsub.publish import PublishIn
from orderly.worker.pubsub.pull import MAX_PULL, PulledAckIn, VisibilityIn

router = APIRouter()


@router.post(
    "/rooms",
    responses=answers(a.Room, created=True),
    status_code=201,
    openapi_extra=body("RoomIn", RoomIn),
    dependencies=requires(keys.ADMIN),
)
async def create_room(runtime: AppRuntime, request: Request) -> JSONResponse:
    data = await json_body(request)
    room = await run_in_threadpool(pubsub.create_room, runtime.engine, data)
    return JSONResponse(status_code=201, content=room)


@router.get("/rooms", responses=answers(list[a.RoomListed]), dependencies=requires(keys.ADMIN))
async def list_rooms(runtime: AppRuntime) -> JSONResponse:
    return JSONResponse(await run_in_threadpool(pubsub.list_rooms, runtime.engine))


@router.patch(
    "/rooms/{room}",
    responses=answers(a.Room),
    openapi_extra=body("RoomPatchIn", RoomPatchIn),
    dependencies=requires(keys.ADMIN),
)
async def update_room(runtime: AppRuntime, room: str, request: Request) -> JSONResponse:
    data = await json_body(request)
    return JSONResponse(await run_in_threadpool(pubsub.update_room, runtime.engine, room, data))


@router.post(
    "/rooms/{room}/event-types",
    responses=answers(a.EventTypeAdded, created=True),
    status_code=201,
    openapi_extra=body("EventTypeIn", EventTypeIn),
    dependencies=requires(keys.ADMIN),
)
async def add_event_type(runtime: AppRuntime, room: str, request: Request) -> JSONResponse:
    data = await json_body(request)
    added = await run_in_threadpool(pubsub.add_event_type, runtime.engine, room, data)
    return JSONResponse(status_code=201, content=added)


@router.post(
    "/rooms/{room}/publishers",
    responses=answers(a.PublisherAdded, created=True),
    status_code=201,
    openapi_extra=body("PublisherIn", PublisherIn),
    dependencies=requires(keys.ADMIN),
)
async def add_publisher(runtime: AppRuntime, room: str, request: Request) -> JSONResponse:
    data = await json_body(request)
    name = await run_in_threadpool(pubsub.add_publisher, runtime.engine, room, data)
    return JSONResponse(status_code=201, content={"room": room, "name": name})


@router.post(
    "/rooms/{room}/subscriptions",
    responses=answers(a.SubscriptionCreated, created=True),
    status_code=201,
    openapi_extra=body("SubscriptionIn", SubscriptionIn),
    dependencies=requires(keys.ADMIN),
)
async def create_subscription(runtime: AppRuntime, room: str, request: Request) -> JSONResponse:
    data = await json_body(request)
    sub = await run_in_threadpool(pubsub.create_subscription, runtime.engine, room, data)
    return JSONResponse(status_code=201, content=sub)


@router.get(
    "/rooms/{room}/subscriptions",
    responses=answers(list[a.SubscriptionListed]),
    dependencies=requires(keys.ADMIN),
)
async def list_subscriptions(runtime: AppRuntime, room: str) -> JSONResponse:
    subs = await run_in_threadpool(pubsub.list_subscriptions, runtime.engine, room)
    return JSONResponse(subs)


@router.patch(
    "/subscriptions/{subscription_id}",
    responses=answers(a.SubscriptionChanged),
    openapi_extra=body("SubscriptionPatchIn", SubscriptionPatchIn),
    dependencies=requires(keys.ADMIN),
)
async def change_subscription(
    runtime: AppRuntime, subscription_id: RowId, request: Request
) -> JSONResponse:
    data = await json_body(request)
    changed = await run_in_threadpool(
        pubsub.update_subscription, runtime.engine, subscription_id, data
    )
    return JSONResponse(changed)


@router.post(
    "/subscriptions/{subscription_id}/enable",
    responses=answers(a.SubscriptionChanged),
    openapi_extra=body("EnableIn", endpoints.EnableIn),
)
async def enable_subscription(
    runtime: AppRuntime,
    subscription_id: RowId,
    request: Request,
    key: Annotated[Principal, caller(keys.ADMIN)],
) -> JSONResponse:
    """Enable an endpoint again (disabled by its failures, or its circuit open): failures
    forgotten, its waiting deliveries due at once."""
    data = await json_body(request)
    await run_in_threadpool(
        functools.partial(
            endpoints.enable, runtime.engine, subscription_id, None, data, by=key.name
        )
    )
    return JSONResponse({"subscription_id": subscription_id, "status": "ACTIVE"})


@router.post(
    "/subscriptions/{subscription_id}/replay",
    responses=answers(a.Replayed),
    openapi_extra=body("ReplayIn", replay.ReplayIn),
    dependencies=requires(keys.ADMIN),
)
async def replay_subscription(
    runtime: AppRuntime, subscription_id: RowId, request: Request
) -> JSONResponse:
    """Send a subscription's events published from ``since`` (until ``until``) again: the
    ones it had (whatever became of them; not those in flight) and the ones it never had but
    selects (backfilled); in order, due now."""
    data = await json_body(request)
    done = await run_in_threadpool(replay.replay, runtime.engine, subscription_id, data)
    return JSONResponse({"replayed": done.replayed, "backfilled": done.backfilled})


@router.get(
    "/rooms/{room}/event-types",
    responses=answers(list[a.EventTypeVersion]),
    dependencies=requires(keys.ADMIN),
)
async def list_event_types(runtime: AppRuntime, room: str) -> JSONResponse:
    return JSONResponse(await run_in_threadpool(pubsub.list_event_types, runtime.engine, room))


@router.post(
    "/rooms/{room}/events",
    responses=answers(a.Published, created=True, repeat=True),
    status_code=201,
    openapi_extra={**body("PublishIn", PublishIn), **checks_key(keys.publish_scope("{room}"))},
)
async def publish(room: str, request: Request) -> JSONResponse:
    key = await key_of(request, keys.publish_scope(room))  # a busy route: no dependencies
    runtime = runtime_of(request)
    data = await json_body(request)
    publisher = runtime.publisher
    given: dict[str, Any] = {
        "idempotency_key": request.headers.get("Idempotency-Key"),
        "caller": key.name,
        "may_impersonate": key.allows(keys.IMPERSONATE),
    }
    if await small_body(request):  # with the others published now: one commit
        result = await publisher.publish(room, data, **given)
    else:  # checked in a thread
        result = await run_in_threadpool(
            functools.partial(publisher.publish_alone, room, data, **given)
        )
    if result.pulled:
        await run_in_threadpool(waiting.announce, runtime.redis, result.pulled)
    return JSONResponse(
        # 200: a publish with this Idempotency-Key stored the event before
        status_code=201 if result.created else 200,
        content={
            "correlation_id": result.correlation_id,
            "event_id": result.event_id,
            "deliveries": result.deliveries,
            "unroutable": result.unroutable,
        },
    )


@router.get(
    "/subscriptions/{subscription_id}/messages",
    responses=answers(list[a.Pulled]),
)
async def pull(
    runtime: AppRuntime,
    subscription_id: RowId,
    key: Consumer,
    max: Annotated[int, Query(ge=1, le=MAX_PULL)] = 10,
    wait_ms: Annotated[int, Query(ge=0, le=waiting.MAX_WAIT_MS)] = 0,
) -> JSONResponse:
    """Take due messages; with ``wait_ms``, wait up to that long (at most
    ORDERLY_PULL_MAX_WAIT_MS) for one to come (a long poll that holds no database connection
    while it waits: worker.pubsub.waiting)."""
    waiters = runtime.pull_waiters
    wait_ms = min(wait_ms, runtime.settings.pull_max_wait_ms)
    deadline = time.monotonic() + wait_ms / 1000
    while True:
        woken = waiters.register(subscription_id)
        try:
            taken = await run_in_threadpool(
                pubsub.pull, runtime.engine, subscription_id, max, key.owns
            )
            left = deadline - time.monotonic()
            if taken or left <= 0:
                return JSONResponse(jsonable_encoder(taken))
            await waiters.wait(woken, left)
        finally:
            waiters.unregister(subscription_id, woken)


@router.post(
    "/subscriptions/{subscription_id}/messages/{delivery_id}/visibility",
    responses=answers(a.PulledVisibility),
    openapi_extra=body("VisibilityIn", VisibilityIn),
)
async def extend_pulled(
    runtime: AppRuntime, subscription_id: RowId, delivery_id: RowId, request: Request, key: Consumer
) -> JSONResponse:
    """A pulled message comes back ``visibility_timeout_ms`` from now unless ACKed (SQS
    ChangeMessageVisibility); only with its current receipt."""
    data = await json_body(request)
    await run_in_threadpool(
        pubsub.extend_pulled, runtime.engine, subscription_id, delivery_id, data, key.owns
    )
    return JSONResponse({"delivery_id": delivery_id, "state": "IN_PROCESS"})


@router.post(
    "/subscriptions/{subscription_id}/messages/{delivery_id}/ack",
    responses=answers(a.PulledAcked),
    openapi_extra=body("PulledAckIn", PulledAckIn),
)
async def ack_pulled(
    runtime: AppRuntime, subscription_id: RowId, delivery_id: RowId, request: Request, key: Consumer
) -> JSONResponse:
    acked = parse_input(PulledAckIn, await json_body(request))
    await run_in_threadpool(
        pubsub.ack_pulled, runtime.engine, subscription_id, delivery_id, acked.receipt, key.owns
    )
    return JSONResponse({"delivery_id": delivery_id, "state": "DELIVERED"})
