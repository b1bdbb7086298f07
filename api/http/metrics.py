"""GET /metrics: Prometheus exposition of the runtime's figures (api.metrics), per app; and
the count and duration of every HTTP request the app answers (worker.totals)."""

from __future__ import annotations

import functools
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orderly.api import metrics
from orderly.api.http.auth import requires
from orderly.worker import keys
from orderly.worker.runtime import Runtime
from orderly.worker.totals import HTTP_REQUESTS, HTTP_SECONDS, TALLY

router = APIRouter()


def make_registry(runtime: Runtime) -> CollectorRegistry:
    """The app's own registry: the figures are gathered at scrape time from ``runtime``."""
    return metrics.make_registry(functools.partial(metrics.runtime_figures, runtime))


@router.get(
    "/metrics",
    dependencies=requires(keys.METRICS),
    responses={
        200: {
            "description": "Prometheus' text exposition format (OpenMetrics when asked for)",
            "content": {"text/plain": {}, "application/openmetrics-text": {}},
        }
    },
)
async def prometheus_metrics(request: Request) -> Response:
    encode, content_type = choose_encoder(request.headers.get("accept", ""))
    # In a thread: the figures take a few database and Redis trips.
    body = await run_in_threadpool(encode, request.app.state.metrics_registry)
    return Response(body, media_type=content_type)


# A request no route matched is counted under this route (its path is the client's to choose),
# and a method not of HTTP's usual ones under OTHER (a client may send any token there).
UNMATCHED = "unmatched"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class CountRequests:
    """Pure ASGI: each HTTP request counted by method, route template and status, and timed
    from its arrival to the end of its answer (a dict increment; worker.totals writes)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # no answer started: the server's failure

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED
            method = scope.get("method", "")
            method = method if method in METHODS else "OTHER"
            TALLY.add(HTTP_REQUESTS, method, route, str(status))
            TALLY.observe(HTTP_SECONDS, method, route, seconds=time.perf_counter() - started)


def install(app: Starlette) -> None:
    """Count every request of ``app``: outermost, so refused ones (429, 413) count too."""
    app.add_middleware(CountRequests)
