"""API keys (admin): listed with their scopes and use, created (the token shown once) and
revoked."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool

from orderly.api.console.render import CONSOLE, page
from orderly.api.console.session import Signed, act, attempt, form, require_admin
from orderly.api.http.auth import key_cache
from orderly.worker import keys
from orderly.worker.runtime import Runtime

router = APIRouter(prefix=CONSOLE)

# Ticked on the form; publish:<room> is typed.
PLAIN_SCOPES = list(keys.SCOPES)


@router.get("/keys")
async def key_list(request: Request, viewer: Signed) -> HTMLResponse:
    require_admin(viewer)
    runtime: Runtime = request.app.state.runtime
    found = await run_in_threadpool(functools.partial(keys.list_keys, runtime.engine, revoked=True))
    return page(request, "keys.html", viewer, keys=found, scopes=PLAIN_SCOPES)


@router.post("/keys")
async def create(request: Request, viewer: Signed) -> HTMLResponse:
    fields = await form(request, viewer)
    runtime: Runtime = request.app.state.runtime
    scopes = fields.all("scope") + [
        keys.publish_scope(room.strip()) for room in fields.get("rooms").split(",") if room.strip()
    ]
    expires = fields.text("expires_at")
    data = {
        "name": fields.get("name").strip(),
        "scopes": scopes,
        "expires_at": expires,  # datetime-local: no zone, taken as UTC (the form says so)
    }
    made, token = await attempt(
        functools.partial(keys.create_key, runtime.engine, data, runtime.clock)
    )
    return page(request, "key_created.html", viewer, status=201, key=made, token=token)


@router.post("/keys/{name}/revoke")
async def revoke(request: Request, viewer: Signed, name: str) -> Response:
    await form(request, viewer)
    runtime: Runtime = request.app.state.runtime
    call = functools.partial(keys.revoke_key, runtime.engine, name, runtime.clock)
    answer = await act(viewer, call, "/console/keys", f"key {name} revoked")
    key_cache(request.app).clear()  # the API refuses it from its next request on
    return answer
