"""HTTP ingress (FastAPI): intake and message status. Thin: every rule lives in worker.*."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from worker import nodes
from worker.errors import InvalidMessage, MessageNotFound, NodeNotAccepting
from worker.intake import Intake, get_message
from worker.runtime import get_runtime

log = logging.getLogger("orderly.api")


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

    @app.get("/messages/{msg_id}")
    async def show(msg_id: int) -> JSONResponse:
        row = await run_in_threadpool(get_message, runtime.engine, msg_id)
        return JSONResponse(jsonable_encoder(row))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
