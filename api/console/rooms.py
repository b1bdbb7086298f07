"""Rooms and subscriptions: delivery counts, pull backlogs, and dead letters to re-drive."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool

from orderly.api.console.render import CONSOLE, page
from orderly.api.console.session import Refused, Signed, act, attempt, form
from orderly.models import DeliveryState
from orderly.worker import pubsub
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.core.inputs import parse_input
from orderly.worker.pubsub import endpoints
from orderly.worker.pubsub.pull import RedriveIn
from orderly.worker.runtime import Runtime

router = APIRouter(prefix=CONSOLE)


@router.get("/rooms")
async def room_list(request: Request, viewer: Signed) -> HTMLResponse:
    runtime: Runtime = request.app.state.runtime
    rooms = await run_in_threadpool(pubsub.list_rooms, runtime.engine)
    dead = await run_in_threadpool(pubsub.dead_letter_counts, runtime.engine, viewer.key.owns)
    return page(request, "rooms.html", viewer, rooms=rooms, dead=dead)


@router.get("/rooms/{room}")
async def room_page(request: Request, viewer: Signed, room: str) -> HTMLResponse:
    engine = request.app.state.runtime.engine
    owns = viewer.key.owns
    subscriptions = await attempt(functools.partial(pubsub.list_subscriptions, engine, room))
    counts = await run_in_threadpool(pubsub.subscription_deliveries, engine, room)
    if owns is not None:
        # A bound key sees its own subscriptions of the room, nothing of another's.
        subscriptions = [s for s in subscriptions if s["subscription_id"] in owns.subscriptions]
        counts = {s: n for s, n in counts.items() if s in owns.subscriptions}
    dead = await run_in_threadpool(pubsub.dead_letters, engine, room, owns)
    return page(
        request,
        "room.html",
        viewer,
        room=room,
        subscriptions=subscriptions,
        counts=counts,
        states=list(DeliveryState),
        dead=dead,
    )


@router.post("/rooms/{room}/redrive")
async def redrive(request: Request, viewer: Signed, room: str) -> Response:
    """The ticked dead letters sent again (only the room's own)."""
    fields = await form(request, viewer)
    try:
        asked = parse_input(
            RedriveIn, {"delivery_ids": [int(d) for d in fields.all("delivery_id")]}
        )
    except ValueError:
        raise Refused(422, [("delivery_ids", "must be row ids")]) from None
    except InvalidMessage as exc:
        raise Refused(422, list(exc.problems)) from None
    call = functools.partial(
        pubsub.redrive, request.app.state.runtime.engine, asked.delivery_ids, room=room
    )
    return await act(
        viewer, call, f"/console/rooms/{room}", lambda moved: f"{len(moved)} dead letters re-driven"
    )


@router.post("/rooms/{room}/subscriptions/{subscription_id}/enable")
async def enable(request: Request, viewer: Signed, room: str, subscription_id: int) -> Response:
    """An endpoint enabled again: its circuit closed, its waiting deliveries due."""
    await form(request, viewer)
    owns = viewer.key.owns
    call = functools.partial(
        endpoints.enable,
        request.app.state.runtime.engine,
        subscription_id,
        None if owns is None else sorted(owns.subscriptions),
    )
    return await act(
        viewer, call, f"/console/rooms/{room}", lambda _: f"subscription {subscription_id} enabled"
    )
