"""HTTP ingress (FastAPI): the app, its lifespan and one router per noun.

Thin: every rule lives in worker.*; the routers only decode, call and shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.concurrency import run_in_threadpool

from orderly.api import console
from orderly.api.http import (
    bodies,
    channels,
    contract,
    conversations,
    dead_letters,
    errors,
    funnel_limits,
    health,
    keys,
    messages,
    metrics,
    pubsub_logs,
    ratelimit,
    rooms,
    schedules,
    signing,
    source_systems,
    tracking,
)
from orderly.worker import nodes
from orderly.worker.broker import Broker
from orderly.worker.core import logs, tracing
from orderly.worker.runtime import Runtime, get_runtime

__all__ = ["create_app"]

log = logging.getLogger("orderly.api")

# Listed in this order in /openapi.json, and matched in it but for MATCHED_FIRST.
# Each with its tag in the document and the error answers it documents.
_ERRORS = contract.ERROR_RESPONSES
ROUTERS: tuple[tuple[APIRouter, str, dict[int | str, dict[str, Any]]], ...] = (
    (conversations.router, "conversations", _ERRORS),
    (conversations.acks, "conversations", contract.ACK_ERROR_RESPONSES),
    (channels.router, "channels", _ERRORS),
    (rooms.router, "rooms and subscriptions", _ERRORS),
    (dead_letters.router, "dead letters", _ERRORS),
    (pubsub_logs.router, "logs", _ERRORS),
    (messages.router, "messages", _ERRORS),
    (schedules.router, "schedules", _ERRORS),
    (funnel_limits.router, "funnel limits", _ERRORS),
    (source_systems.router, "source systems", _ERRORS),
    (signing.router, "signing secrets", _ERRORS),
    (keys.router, "API keys", _ERRORS),
    (health.router, "health", contract.PUBLIC_ERROR_RESPONSES),
    (metrics.router, "metrics", _ERRORS),
    (tracking.router, "tracking", _ERRORS),
)
# A request tries the routes one by one, each its path's pattern: POST /messages, by far the
# busiest route, is tried first rather than after twenty others. No other router has a path
# under /messages, so this shadows none.
MATCHED_FIRST = messages.router


async def _heartbeat(runtime: Runtime) -> None:
    interval = runtime.settings.heartbeat_interval_ms / 1000
    while True:
        await asyncio.sleep(interval)
        try:
            await run_in_threadpool(nodes.heartbeat, runtime.engine, runtime.node_id)
        except Exception:
            log.exception("node heartbeat failed")


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    runtime: Runtime = app.state.runtime
    runtime.startup_check()
    app.state.intake = runtime.intake(
        runtime.broker.enqueue_processing, runtime.wake_processing, grouped=True
    )
    app.state.heartbeat = asyncio.create_task(_heartbeat(runtime))
    # What start-up made lives as long as the process: kept out of the collector's reach, so
    # that a full collection (which refusals' garbage brings on) no longer walks it, a pause
    # of the whole process of 120 ms and more (docs/explanation/design-decisions.md).
    gc.collect()
    gc.freeze()
    yield
    app.state.heartbeat.cancel()


def create_app(broker: Broker | None = None) -> FastAPI:
    """A fresh app bound to the process's runtime (uvicorn ``--factory``; one per test), which
    sends through ``broker`` when one is given (a test's stub), else through the runtime's."""
    runtime = get_runtime()
    if broker is not None:
        runtime.use_broker(broker)
    settings = runtime.settings
    logs.configure(settings.log_level, settings.log_format, node=settings.node_code)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logs.adopt(logging.getLogger(name), settings.log_format)
    # /docs is served by orderly itself (contract.install), without a CDN; no ReDoc.
    app = FastAPI(
        title="orderly",
        version="0.1.0",
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
        # operationId: the route function's name (unique across the routers)
        generate_unique_id_function=lambda route: route.name,
    )
    app.state.runtime = runtime
    runtime.count_totals()
    app.state.metrics_registry = metrics.make_registry(runtime)
    errors.install(app, retry_after_s=runtime.settings.retry_after_s)
    for router, tag, documented in sorted(ROUTERS, key=lambda r: r[0] is not MATCHED_FIRST):
        app.include_router(router, tags=[tag], responses=documented)
    contract.install(app, [tag for _, tag, _ in ROUTERS])
    console.install(app)
    bodies.install(app, settings)
    ratelimit.install(app)
    metrics.install(app)
    if tracing.configure("orderly-api"):
        # The request's span, a child of the producer's traceparent: outermost.
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

        # Probes and scrapes make no spans (OTEL_PYTHON_ASGI_EXCLUDED_URLS says others).
        excluded = os.environ.get("OTEL_PYTHON_ASGI_EXCLUDED_URLS", "/health,/ready,/metrics")
        app.add_middleware(OpenTelemetryMiddleware, excluded_urls=excluded)
    return app
