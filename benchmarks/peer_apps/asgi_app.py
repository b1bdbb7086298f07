"""The ceiling of an HTTP intake: a bare ASGI app that reads a JSON body and answers 201
(``uvicorn benchmarks.peer_apps.asgi_app:app``)."""

from __future__ import annotations

import json
from typing import Any


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


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = await body_of(receive)
    if scope["method"] == "GET":  # its health check
        await answer(send, 200, b"{}")
        return
    await answer(send, 201, json.dumps({"msg_id": len(json.loads(body)), "state": "NEW"}).encode())
