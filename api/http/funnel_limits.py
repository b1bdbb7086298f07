"""HTTP face of funnel limits (worker.messages.limits): list, show, set and remove how many
messages of one funnel value a funnel component runs at once.

A system-wide setting, as the configuration table is: every route needs ``admin``, a scope no
key bound to its own objects can hold. The component is the path's last segment, escaped as a
path segment (``/`` as ``%2F``); funnels without a component are ``-`` (a segment of dashes
only stands for one dash fewer: ``--`` is the component ``-``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from orderly.api.http.answers import answers
from orderly.api.http.auth import requires
from orderly.api.http.common import AppRuntime, json_body
from orderly.api.http.contract import body
from orderly.worker import keys
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.messages import limits
from orderly.worker.messages.limits import FunnelLimitIn, FunnelLimitView

router = APIRouter(dependencies=requires(keys.ADMIN))

# ``:path``: a component may hold a ``/`` (sent as %2F, which the server decodes before routing).
ONE = "/funnel-limits/{component_id:path}"


class FunnelLimitRemoved(BaseModel):
    component_id: str
    deleted: bool


def _component(segment: str) -> str:
    if not segment:
        raise InvalidMessage(
            "component_id", "empty: funnels without a component are addressed as '-'"
        )
    return limits.from_word(segment)


def _answer(found: FunnelLimitView, status: int = 200) -> JSONResponse:
    return JSONResponse(status_code=status, content=jsonable_encoder(found.as_dict()))


_SET: dict[int | str, dict[str, Any]] = {
    201: {"model": FunnelLimitView, "description": "created: the component had no limit"},
    200: {"model": FunnelLimitView, "description": "replaced the component's limit"},
}


@router.get("/funnel-limits", responses=answers(list[FunnelLimitView]))
async def list_funnel_limits(runtime: AppRuntime) -> JSONResponse:
    """Every funnel limit, by component (``""``: funnels without a component). A component
    not listed runs one message of a funnel value at a time."""
    found = await run_in_threadpool(limits.list_limits, runtime.engine)
    return JSONResponse(jsonable_encoder([f.as_dict() for f in found]))


@router.get(ONE, responses=answers(FunnelLimitView))
async def show_funnel_limit(runtime: AppRuntime, component_id: str) -> JSONResponse:
    """One component's limit (``-``: funnels without a component); 404 when it has none."""
    key = _component(component_id)
    return _answer(await run_in_threadpool(limits.get_limit, runtime.engine, key))


@router.put(
    ONE,
    responses=_SET,
    status_code=201,
    openapi_extra=body("FunnelLimitIn", FunnelLimitIn),
)
async def set_funnel_limit(
    runtime: AppRuntime, component_id: str, request: Request
) -> JSONResponse:
    """Let the component's funnels run up to ``max_in_flight`` (1 to 10,000) messages of one
    funnel value at once, and with ``rate_per_s`` start at most that many a second (bursts
    of ``burst``), from the next claim on. Guaranteed order still runs one at a time."""
    key = _component(component_id)
    data = await json_body(request)
    done = await run_in_threadpool(limits.set_limit, runtime.engine, key, data, runtime.clock)
    return _answer(done.limit, 201 if done.created else 200)


@router.delete(ONE, responses=answers(FunnelLimitRemoved))
async def delete_funnel_limit(runtime: AppRuntime, component_id: str) -> JSONResponse:
    """Remove the component's limit: its funnels run one message at a time again (those
    running go on)."""
    key = _component(component_id)
    await run_in_threadpool(limits.remove_limit, runtime.engine, key)
    return JSONResponse({"component_id": key, "deleted": True})
