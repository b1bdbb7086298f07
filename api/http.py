"""HTTP ingress (FastAPI): intake and message status. Thin: every rule lives in worker.*."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import choose_encoder
from starlette.concurrency import run_in_threadpool

from api import metrics
from worker import channels as channel_defs
from worker import confirmations, nodes, operations, pubsub
from worker.core.errors import (
    InvalidMessage,
    MessageNotFound,
    NodeNotAccepting,
    NotFound,
    OperationRefused,
    ResponseNotAwaited,
    UnknownAck,
    UnknownChannel,
    UnknownRequest,
)
from worker.intake import Intake
from worker.runtime import get_runtime

log = logging.getLogger("orderly.api")


class _MalformedBody(Exception):
    pass


def _problem(status: int, errors: list[dict[str, str]]) -> JSONResponse:
    return JSONResponse(status_code=status, content={"errors": errors})


def create_app() -> FastAPI:
    runtime = get_runtime()
    logging.basicConfig(
        level=runtime.settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    state: dict[str, Intake] = {}

    async def heartbeat() -> None:
        interval = runtime.settings.heartbeat_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            try:
                await run_in_threadpool(nodes.heartbeat, runtime.engine, runtime.node_id)
            except Exception:
                log.exception("node heartbeat failed")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        from worker.celery import enqueue_processing

        runtime.startup_check()
        state["intake"] = runtime.intake(enqueue_processing)
        beat = asyncio.create_task(heartbeat())
        yield
        beat.cancel()

    app = FastAPI(title="orderly", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(InvalidMessage)
    async def _invalid(_: Request, exc: InvalidMessage) -> JSONResponse:
        return _problem(422, [{"field": f, "problem": p} for f, p in exc.problems])

    @app.exception_handler(NodeNotAccepting)
    async def _node(_: Request, exc: NodeNotAccepting) -> JSONResponse:
        return _problem(503, [{"field": "node", "problem": str(exc)}])

    @app.exception_handler(MessageNotFound)
    async def _missing(_: Request, exc: MessageNotFound) -> JSONResponse:
        return _problem(404, [{"field": "msg_id", "problem": str(exc)}])

    @app.exception_handler(_MalformedBody)
    async def _malformed(_: Request, exc: _MalformedBody) -> JSONResponse:
        return _problem(400, [{"field": "body", "problem": str(exc)}])

    @app.exception_handler(UnknownChannel)
    async def _channel(_: Request, exc: UnknownChannel) -> JSONResponse:
        return _problem(422, [{"field": "origin", "problem": str(exc)}])

    @app.exception_handler(UnknownRequest)
    async def _request(_: Request, exc: UnknownRequest) -> JSONResponse:
        return _problem(404, [{"field": "request_id", "problem": str(exc)}])

    @app.exception_handler(UnknownAck)
    async def _ack(_: Request, exc: UnknownAck) -> JSONResponse:
        return _problem(404, [{"field": "async_response_id", "problem": str(exc)}])

    async def _json_body(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _MalformedBody(f"malformed JSON: {exc}") from None

    @app.post("/conversations/{conversation_id}/requests", status_code=201)
    async def register_request(conversation_id: str, request: Request) -> JSONResponse:
        data = await _json_body(request)
        result = await run_in_threadpool(
            runtime.conversations.register_request, conversation_id, data
        )
        return JSONResponse(
            status_code=201 if result.created else 200,
            content={"msg_id": result.msg_id, "state": result.state.value},
        )

    @app.post("/conversations/{conversation_id}/responses", status_code=201)
    async def add_response(conversation_id: str, request: Request) -> JSONResponse:
        from worker.celery import enqueue_drain

        data = await _json_body(request)
        result = await run_in_threadpool(
            runtime.conversations.add_response, conversation_id, data, enqueue_drain
        )
        return JSONResponse(
            status_code=201 if result.created else 200,
            content={"msg_id": result.msg_id, "state": result.state.value},
        )

    @app.get("/conversations/{conversation_id}")
    async def describe_conversation(conversation_id: str) -> JSONResponse:
        view = await run_in_threadpool(runtime.conversations.describe, conversation_id)
        return JSONResponse(view)

    @app.post("/acks/{async_response_id}")
    async def ack(async_response_id: str) -> JSONResponse:
        from worker.celery import enqueue_drain

        msg_id = await run_in_threadpool(
            runtime.conversations.ack, async_response_id, enqueue_drain
        )
        return JSONResponse({"msg_id": msg_id, "state": "OK"})

    @app.put("/channels/{origin}")
    async def put_channel(origin: str, request: Request) -> JSONResponse:
        data = await _json_body(request)
        if not isinstance(data, dict):
            raise InvalidMessage("body", f"must be a JSON object, got {type(data).__name__}")
        channel = channel_defs.validate(origin, data, runtime.settings)
        await run_in_threadpool(channel_defs.put_channel, runtime.engine, channel)
        runtime.channels.invalidate()
        return JSONResponse(channel.as_dict())

    @app.get("/channels")
    async def list_channels() -> JSONResponse:
        found = await run_in_threadpool(runtime.channels.all)
        return JSONResponse([c.as_dict() for c in found.values()])

    @app.exception_handler(NotFound)
    async def _not_found(_: Request, exc: NotFound) -> JSONResponse:
        return _problem(404, [{"field": exc.what, "problem": str(exc)}])

    @app.post("/rooms", status_code=201)
    async def create_room(request: Request) -> JSONResponse:
        data = await _json_body(request)
        room = await run_in_threadpool(pubsub.create_room, runtime.engine, data)
        return JSONResponse(status_code=201, content=room)

    @app.get("/rooms")
    async def list_rooms() -> JSONResponse:
        return JSONResponse(await run_in_threadpool(pubsub.list_rooms, runtime.engine))

    @app.patch("/rooms/{room}")
    async def update_room(room: str, request: Request) -> JSONResponse:
        data = await _json_body(request)
        return JSONResponse(await run_in_threadpool(pubsub.update_room, runtime.engine, room, data))

    @app.post("/rooms/{room}/event-types", status_code=201)
    async def add_event_type(room: str, request: Request) -> JSONResponse:
        data = await _json_body(request)
        added = await run_in_threadpool(pubsub.add_event_type, runtime.engine, room, data)
        return JSONResponse(status_code=201, content=added)

    @app.post("/rooms/{room}/publishers", status_code=201)
    async def add_publisher(room: str, request: Request) -> JSONResponse:
        data = await _json_body(request)
        name = data.get("name") if isinstance(data, dict) else None
        if not isinstance(name, str):
            raise InvalidMessage("name", "missing")
        await run_in_threadpool(pubsub.add_publisher, runtime.engine, room, name)
        return JSONResponse(status_code=201, content={"room": room, "name": name})

    @app.post("/rooms/{room}/subscriptions", status_code=201)
    async def create_subscription(room: str, request: Request) -> JSONResponse:
        data = await _json_body(request)
        sub = await run_in_threadpool(pubsub.create_subscription, runtime.engine, room, data)
        return JSONResponse(status_code=201, content=sub)

    @app.get("/rooms/{room}/subscriptions")
    async def list_subscriptions(room: str) -> JSONResponse:
        subs = await run_in_threadpool(pubsub.list_subscriptions, runtime.engine, room)
        return JSONResponse(subs)

    @app.patch("/subscriptions/{subscription_id}")
    async def change_subscription(subscription_id: int, request: Request) -> JSONResponse:
        data = await _json_body(request)
        changed = await run_in_threadpool(
            pubsub.update_subscription, runtime.engine, subscription_id, data
        )
        return JSONResponse(changed)

    @app.get("/rooms/{room}/event-types")
    async def list_event_types(room: str) -> JSONResponse:
        return JSONResponse(await run_in_threadpool(pubsub.list_event_types, runtime.engine, room))

    @app.post("/rooms/{room}/events", status_code=201)
    async def publish(room: str, request: Request) -> JSONResponse:
        from worker.celery import enqueue_event_deliveries

        data = await _json_body(request)
        result, due = await run_in_threadpool(
            functools.partial(
                pubsub.publish,
                runtime.engine,
                room,
                data,
                secret=runtime.settings.token_secret,
                token_ttl_ms=runtime.settings.token_ttl_ms,
            )
        )
        try:
            for i in range(0, len(due), pubsub.BATCH):
                enqueue_event_deliveries(due[i : i + pubsub.BATCH])
        except Exception:
            # Stored: the scheduler sends them once their lease runs out.
            log.exception("event %s stored but not enqueued", result.event_id)
        return JSONResponse(
            status_code=201,
            content={
                "correlation_id": result.correlation_id,
                "event_id": result.event_id,
                "deliveries": result.deliveries,
                "unroutable": result.unroutable,
            },
        )

    @app.get("/subscriptions/{subscription_id}/messages")
    async def pull(subscription_id: int, max: int = 10) -> JSONResponse:
        taken = await run_in_threadpool(pubsub.pull, runtime.engine, subscription_id, max)
        return JSONResponse(jsonable_encoder(taken))

    @app.post("/subscriptions/{subscription_id}/messages/{delivery_id}/ack")
    async def ack_pulled(subscription_id: int, delivery_id: int, request: Request) -> JSONResponse:
        data = await _json_body(request)
        receipt = data.get("receipt") if isinstance(data, dict) else None
        if not isinstance(receipt, str):
            raise InvalidMessage("receipt", "missing: give the receipt the pull returned")
        await run_in_threadpool(
            pubsub.ack_pulled, runtime.engine, subscription_id, delivery_id, receipt
        )
        return JSONResponse({"delivery_id": delivery_id, "state": "DELIVERED"})

    @app.get("/dead-letters")
    async def dead_letters(room: str | None = None) -> JSONResponse:
        return JSONResponse(await run_in_threadpool(pubsub.dead_letters, runtime.engine, room))

    @app.post("/dead-letters/redrive")
    async def redrive(request: Request) -> JSONResponse:
        data = await _json_body(request)
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

    @app.post("/messages", status_code=201)
    async def submit(request: Request) -> JSONResponse:
        raw = await request.body()
        try:
            data: Any = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _problem(400, [{"field": "body", "problem": f"malformed JSON: {exc}"}])
        result = await run_in_threadpool(state["intake"].submit, data)
        return JSONResponse(
            status_code=201 if result.created else 200,
            content={"msg_id": result.msg_id, "state": result.state.value},
        )

    @app.exception_handler(OperationRefused)
    async def _refused(_: Request, exc: OperationRefused) -> JSONResponse:
        return _problem(409, [{"field": "msg_id", "problem": str(exc)}])

    @app.exception_handler(ResponseNotAwaited)
    async def _not_awaited(_: Request, exc: ResponseNotAwaited) -> JSONResponse:
        return _problem(404, [{"field": "correlation_id", "problem": str(exc)}])

    @app.post("/messages/responses")
    async def receive_response(request: Request) -> JSONResponse:
        from worker.celery import enqueue_processing

        data = await _json_body(request)
        result = await run_in_threadpool(
            operations.receive_response, runtime.engine, data, enqueue_processing
        )
        return JSONResponse(
            status_code=201 if result.created else 200,
            content={"msg_id": result.msg_id, "state": result.state.value, "res_id": result.res_id},
        )

    @app.get("/messages")
    async def list_messages(
        state: str | None = None,
        funnel: str | None = None,
        service: str | None = None,
        limit: int = 100,
    ) -> JSONResponse:
        found = await run_in_threadpool(
            functools.partial(
                operations.list_messages,
                runtime.engine,
                state=state,
                funnel=funnel,
                service=service,
                limit=limit,
            )
        )
        return JSONResponse(jsonable_encoder(found))

    @app.get("/messages/{msg_id}")
    async def show(msg_id: int) -> JSONResponse:
        row = await run_in_threadpool(operations.inspect_message, runtime.engine, msg_id)
        return JSONResponse(jsonable_encoder(row))

    @app.post("/messages/{msg_id}/cancel")
    async def cancel(msg_id: int, request: Request) -> JSONResponse:
        from worker.celery import enqueue_processing

        data = await _json_body(request)
        done = await run_in_threadpool(
            operations.cancel, runtime.engine, msg_id, data, enqueue_processing
        )
        return JSONResponse({"msg_id": done.msg_id, "state": done.state.value})

    @app.post("/messages/{msg_id}/redrive")
    async def redrive_message(msg_id: int, request: Request) -> JSONResponse:
        from worker.celery import enqueue_processing

        data = await _json_body(request)
        done = await run_in_threadpool(
            operations.redrive, runtime.engine, msg_id, data, enqueue_processing
        )
        return JSONResponse(
            {"msg_id": done.msg_id, "state": done.state.value, "reopened": list(done.reopened)}
        )

    @app.put("/source-systems/{name}")
    async def put_source_system(name: str, request: Request) -> JSONResponse:
        data = await _json_body(request)
        saved = await run_in_threadpool(confirmations.set_source_system, runtime.engine, name, data)
        return JSONResponse(saved)

    @app.get("/source-systems")
    async def list_source_systems() -> JSONResponse:
        found = await run_in_threadpool(confirmations.list_source_systems, runtime.engine)
        return JSONResponse(found)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # Gathered at scrape time, in a thread: the figures take a few database and Redis trips.
    metrics_registry = metrics.make_registry(functools.partial(metrics.runtime_figures, runtime))

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        body = await run_in_threadpool(encode, metrics_registry)
        return Response(body, media_type=content_type)

    return app
