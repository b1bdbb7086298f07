"""Live figures: the numbers of ``GET /metrics`` (the app's own registry, gathered now), as a
page and as JSON the page's script polls to redraw its charts without a reload; and charts of
the store's throughput, failures and backlog over the last hour and day (worker.history)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client.registry import CollectorRegistry
from starlette.concurrency import run_in_threadpool

from orderly.api.console.render import CONSOLE, HEADERS, page
from orderly.api.console.session import Signed, require_unbound
from orderly.worker.history import History, Window, message_history
from orderly.worker.runtime import Runtime

router = APIRouter(prefix=CONSOLE)


def samples(registry: CollectorRegistry) -> list[dict[str, Any]]:
    """Every sample of every family (histogram buckets left out), as /metrics has them."""
    found = []
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket") or sample.name.endswith("_created"):
                continue
            found.append({"name": sample.name, "labels": sample.labels, "value": sample.value})
    return found


# A chart's drawing box (SVG user units): bars below, the backlog's line over them.
WIDTH, HEIGHT = 600.0, 120.0


@dataclass(frozen=True)
class Chart:
    """One window drawn: a bar per bucket (OK, FAILED stacked), the backlog as a line."""

    title: str
    history: History
    bars: list[tuple[float, float, float, float]]  # x, width, OK height, FAILED height
    backlog: str  # polyline points
    most_ended: int
    most_backlog: int

    @property
    def totals(self) -> tuple[int, int, int]:
        b = self.history.buckets
        return sum(x.ok for x in b), sum(x.failed for x in b), sum(x.arrived for x in b)


def chart(history: History) -> Chart:
    buckets = history.buckets
    most_ended = max([b.ok + b.failed for b in buckets] + [1])
    most_backlog = max([b.backlog for b in buckets] + [1])
    step = WIDTH / max(len(buckets), 1)
    bars, points = [], []
    for i, b in enumerate(buckets):
        ok = HEIGHT * b.ok / most_ended
        failed = HEIGHT * b.failed / most_ended
        bars.append((round(i * step, 1), round(step * 0.85, 1), round(ok, 1), round(failed, 1)))
        y = HEIGHT - HEIGHT * b.backlog / most_backlog
        points.append(f"{i * step + step / 2:.1f},{y:.1f}")
    title = "Last hour, by minute" if history.window is Window.HOUR else "Last day, by 15 minutes"
    return Chart(title, history, bars, " ".join(points), most_ended, most_backlog)


def _charts(runtime: Runtime) -> list[Chart]:
    return [chart(message_history(runtime.engine, w, runtime.clock)) for w in Window]


@router.get("/figures")
async def figures_page(request: Request, viewer: Signed) -> HTMLResponse:
    require_unbound(viewer)
    found = await run_in_threadpool(samples, request.app.state.metrics_registry)
    charts = await run_in_threadpool(_charts, request.app.state.runtime)
    return page(
        request, "figures.html", viewer, samples=found, charts=charts, width=WIDTH, height=HEIGHT
    )


@router.get("/figures.json")
async def figures_json(request: Request, viewer: Signed) -> JSONResponse:
    require_unbound(viewer)
    found = await run_in_threadpool(samples, request.app.state.metrics_registry)
    return JSONResponse({"samples": found}, headers=HEADERS)
