"""Nodes and their workers (moved between RUN, drain and STOPPED with a note), live, and the
configuration table (edited with its validation)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from orderly.api.console.render import CONSOLE, page
from orderly.api.console.session import Signed, act, form, require_admin, require_unbound
from orderly.models import NodeState
from orderly.worker import configuration, nodes
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.runtime import Runtime
from orderly.worker.tracking import ServiceInfo

router = APIRouter(prefix=CONSOLE)

HEARTBEAT_TIMEOUT = "cluster.nodeHeartbeatTimeoutSec"


def _gather(runtime: Runtime) -> tuple[list[nodes.NodeView], list[ServiceInfo], str]:
    found = nodes.list_nodes(runtime.engine, runtime.config.get_int(HEARTBEAT_TIMEOUT))
    try:
        return found, runtime.services.live(), ""
    except RedisError as exc:  # the nodes are still worth showing
        return found, [], f"workers unknown: the tracking Redis could not be read ({exc})"


@router.get("/nodes")
async def node_list(request: Request, viewer: Signed) -> HTMLResponse:
    require_unbound(viewer)
    runtime: Runtime = request.app.state.runtime
    found, workers, problem = await run_in_threadpool(_gather, runtime)
    items = await run_in_threadpool(configuration.list_items, runtime.engine)
    return page(
        request,
        "nodes.html",
        viewer,
        nodes=found,
        workers=workers,
        workers_problem=problem,
        items=items,
    )


@router.post("/configuration/{code}")
async def set_item(request: Request, viewer: Signed, code: str) -> Response:
    """A new current value (blank: back to the default), refused unless it validates."""
    fields = await form(request, viewer)
    runtime: Runtime = request.app.state.runtime

    def change() -> configuration.ConfigRow:
        row = configuration.set_value(runtime.engine, code, fields.text("value"))
        runtime.config.invalidate()  # this process reads the new value at once
        return row

    def done(row: configuration.ConfigRow) -> str:
        shown = row.current_value if row.current_value is not None else "(default)"
        return f"{row.code} set to {shown}"

    return await act(viewer, change, "/console/nodes#configuration", done)


_STATES = {
    "run": NodeState.RUN,
    "drain": NodeState.HANDLES_EXISTING_MESSAGES,
    "stop": NodeState.STOPPED,
}


@router.post("/nodes/{code}/state")
async def move_node(request: Request, viewer: Signed, code: str) -> Response:
    """RUN, drain (HANDLES_EXISTING_MESSAGES) or STOPPED, with the operator's note."""
    require_unbound(viewer)
    require_admin(viewer)
    fields = await form(request, viewer)
    runtime: Runtime = request.app.state.runtime

    def change() -> NodeState:
        wanted = fields.get("state")
        if wanted not in _STATES:
            raise InvalidMessage("state", "must be run, drain or stop")
        note = fields.text("note")
        if note is None:
            raise InvalidMessage("note", "say why: it is kept with the node's state")
        state = _STATES[wanted]
        nodes.set_state(runtime.engine, code, state, by=f"key:{viewer.key.name}", note=note)
        return state

    return await act(viewer, change, "/console/nodes", lambda s: f"node {code} is {s.value}")
