"""Funnel limits: how many messages of one funnel value each component runs at once, and
(``admin``) a form to set, change or remove one. A setting of the whole system, as the
configuration is: not for a key bound to its own objects."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool

from orderly.api.console.render import CONSOLE, page
from orderly.api.console.session import Form, Signed, act, form, require_unbound
from orderly.worker.messages import limits
from orderly.worker.runtime import Runtime

router = APIRouter(prefix=CONSOLE)

BACK = "/console/funnel-limits"


def _named(component_id: str) -> str:
    if component_id == limits.NO_COMPONENT:
        return "funnels without a component"
    return f"component {component_id!r}"


def _number(fields: Form, name: str, kind: type[int] | type[float] = int) -> Any:
    """A form field as a number when it is one (None when blank); else as typed, refused
    naming it."""
    value = fields.get(name).strip()
    if not value:
        return None
    try:
        return kind(value)
    except ValueError:
        return value


def _limit(fields: Form) -> dict[str, Any]:
    data = {
        "max_in_flight": _number(fields, "max_in_flight"),
        "rate_per_s": _number(fields, "rate_per_s", float),
        "burst": _number(fields, "burst"),
    }
    return {k: v for k, v in data.items() if v is not None or k == "max_in_flight"}


@router.get("/funnel-limits")
async def limit_list(request: Request, viewer: Signed) -> HTMLResponse:
    require_unbound(viewer)
    runtime: Runtime = request.app.state.runtime
    found = await run_in_threadpool(limits.list_limits, runtime.engine)
    return page(request, "funnel_limits.html", viewer, limits=found)


@router.post("/funnel-limits")
async def limit_set(request: Request, viewer: Signed) -> Response:
    """Make or replace a component's limit (a blank component: funnels without one)."""
    require_unbound(viewer)
    fields = await form(request, viewer)
    runtime: Runtime = request.app.state.runtime
    component = fields.get("component_id")
    data = _limit(fields)

    def change() -> limits.LimitSet:
        return limits.set_limit(runtime.engine, component, data, runtime.clock)

    def done(result: limits.LimitSet) -> str:
        found = result.limit
        return f"{_named(found.component_id)}: up to {found.max_in_flight} at once"

    return await act(viewer, change, BACK, done)


@router.post("/funnel-limits/remove")
async def limit_remove(request: Request, viewer: Signed) -> Response:
    require_unbound(viewer)
    fields = await form(request, viewer)
    runtime: Runtime = request.app.state.runtime
    component = fields.get("component_id")

    def change() -> None:
        limits.remove_limit(runtime.engine, component)

    return await act(viewer, change, BACK, f"{_named(component)}: one at a time again")
