"""The ceiling of an HTTP intake: a bare ASGI app that reads a JSON body and answers 201
(``uvicorn benchmarks.peer_apps.asgi_app:app``)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


async def body_of(receive: Any) -> bytes:
    """A request's whole body."""
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


async def answer(send: Any, status: int, body: bytes) -> None:
    """A JSON answer."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def intake_app(msg_id_of: Callable[[bytes], Awaitable[int]]) -> App:
    """A bare intake: each POSTed body answered 201 with ``msg_id_of(body)``; a GET (its
    health check) answered 200."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await body_of(receive)
        if scope["method"] == "GET":
            await answer(send, 200, b"{}")
            return
        msg_id = await msg_id_of(body)
        await answer(send, 201, json.dumps({"msg_id": msg_id, "state": "NEW"}).encode())

    return app


async def _parsed(body: bytes) -> int:
    return len(json.loads(body))


app = intake_app(_parsed)
