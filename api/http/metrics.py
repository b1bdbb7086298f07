"""GET /metrics: Prometheus exposition of the runtime's figures (api.metrics), per app."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry
from starlette.concurrency import run_in_threadpool

from orderly.api import metrics
from orderly.api.http.auth import requires
from orderly.worker import keys
from orderly.worker.runtime import Runtime

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
