"""Live figures: the numbers of ``GET /metrics`` (the app's own registry, gathered now), as a
page and as JSON the page's script polls to redraw its charts without a reload."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client.registry import CollectorRegistry
from starlette.concurrency import run_in_threadpool

from orderly.api.console.render import HEADERS, page
from orderly.api.console.session import Signed, require_unbound

router = APIRouter()


def samples(registry: CollectorRegistry) -> list[dict[str, Any]]:
    """Every sample of every family (histogram buckets left out), as /metrics has them."""
    found = []
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket") or sample.name.endswith("_created"):
                continue
            found.append({"name": sample.name, "labels": sample.labels, "value": sample.value})
    return found


@router.get("/figures")
async def figures_page(request: Request, viewer: Signed) -> HTMLResponse:
    require_unbound(viewer)
    found = await run_in_threadpool(samples, request.app.state.metrics_registry)
    return page(request, "figures.html", viewer, samples=found)


@router.get("/figures.json")
async def figures_json(request: Request, viewer: Signed) -> JSONResponse:
    require_unbound(viewer)
    found = await run_in_threadpool(samples, request.app.state.metrics_registry)
    return JSONResponse({"samples": found}, headers=HEADERS)
