"""Request bodies bounded before they are read: every request's body limit by its route, a
declared Content-Length over it answered 413 at once, a streamed body cut with 413 at it."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orderly.api.http.common import ENVELOPE_BYTES
from orderly.api.http.errors import PayloadTooLarge, problem
from orderly.worker.settings import Settings

# A request that reads no body may still bring a few bytes (a client that sends "{}" with a
# GET): this many, and no more.
BODILESS_BYTES = 4_096
# A body left unread this small the server reads and drops at no cost (uvicorn buffers as
# much): its connection is kept. A larger one, or one of unknown length, closes it.
DROPPED_BYTES = 65_536
BODILESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE"})
# POST routes that read no body: the ACK carries its token in a header.
BODILESS_PREFIXES = ("/acks/",)
# The one route whose body is larger than a message's (json_body's limit there).
BATCH_PATH = "/messages:batch"
CONSOLE_PREFIX = "/console/"


@dataclass(frozen=True)
class BodyLimits:
    """What each route accepts: json_body's limit (one payload and its envelope), the batch
    limit for POST /messages:batch, the console's form limit, BODILESS_BYTES for a request
    that reads no body. ``ceiling``, the largest of them, bounds every request."""

    payload: int
    batch: int
    form: int

    @classmethod
    def of(cls, settings: Settings, form: int) -> BodyLimits:
        return cls(settings.max_payload_bytes + ENVELOPE_BYTES, settings.max_batch_bytes, form)

    @property
    def ceiling(self) -> int:
        return max(self.payload, self.batch, self.form, BODILESS_BYTES)

    def limit(self, method: str, path: str) -> int:
        """The most body bytes a request to ``path`` may bring (never above the ceiling)."""
        if method in BODILESS_METHODS or path.startswith(BODILESS_PREFIXES):
            return BODILESS_BYTES
        if path.startswith(CONSOLE_PREFIX):
            return self.form
        if path == BATCH_PATH:
            return self.batch
        return self.payload


class BodyTooLarge(PayloadTooLarge):
    """A streamed body passed its limit: raised from ``receive``, answered like any other
    PayloadTooLarge (the errors shape), and the connection closed."""


def _framing(scope: Scope) -> tuple[int | None, bool]:
    """The request's Content-Length (None without one), and whether the connection must close
    unless the app reads the body to its end: a body over DROPPED_BYTES or a chunked one. The
    server has refused a malformed length already."""
    declared = None
    chunked = False
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            declared = int(value) if value.isdigit() else None
        elif name == b"transfer-encoding":
            chunked = True
    if declared is None:
        return None, chunked
    return declared, declared > DROPPED_BYTES


def _closed(message: Message) -> Message:
    """A response start that tells the client, and the server, to close the connection."""
    headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
    return {**message, "headers": [*headers, (b"connection", b"close")]}


class LimitBodies:
    """Pure ASGI (nothing buffered, nothing awaited that the request did not ask for): a
    Content-Length over the route's limit is refused before the body is read; any other body
    is counted as the app reads it and refused past the limit.

    An answer given before a large or chunked body was read to its end (a refusal, a 401 that
    never needed the body) closes the connection (``Connection: close``): the server would
    otherwise go on reading, and throwing away, whatever the client still streams."""

    def __init__(self, app: ASGIApp, limits: BodyLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        root: str = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        limit = self.limits.limit(scope["method"], path)
        declared, pending = _framing(scope)
        if declared is not None and declared > limit:
            text = f"{declared} bytes is over the limit of {limit} bytes"
            await _refuse(scope, receive, send, text)
            return
        seen = 0
        started = cut = False

        async def counted() -> Message:
            nonlocal seen, pending, cut
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    cut = True
                    raise BodyTooLarge(f"more than {limit} bytes: over the limit of {limit} bytes")
                pending = pending and message.get("more_body", False)
            return message

        async def closing(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if pending:
                    message = _closed(message)
            await send(message)

        try:
            await self.app(scope, counted, closing)
        except BodyTooLarge as exc:
            # Raised past the app's own handlers (a middleware between read the body).
            if started:
                raise
            await _refuse(scope, receive, send, str(exc))
            return
        if cut and not started:
            # The app caught the refusal and answered nothing.
            await _refuse(scope, receive, send, f"more than {limit} bytes: over the limit")


async def _refuse(scope: Scope, receive: Receive, send: Send, text: str) -> None:
    answer = problem(413, [("body", text)])
    answer.headers["connection"] = "close"
    await answer(scope, receive, send)


def install(app: Starlette, settings: Settings) -> None:
    """Bound every request's body on ``app``, before its routes and error handlers run."""
    # Here, not at the top: the console's modules import this package.
    from orderly.api.console.session import MAX_FORM_BYTES

    app.add_middleware(LimitBodies, limits=BodyLimits.of(settings, MAX_FORM_BYTES))
