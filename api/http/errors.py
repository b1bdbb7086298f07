"""The HTTP face's one table from exception to status and erring field, and its handlers.

Every refusal answers ``{"errors": [{"field": ..., "problem": ...}]}``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from worker.core.errors import (
    InvalidMessage,
    MessageNotFound,
    NodeNotAccepting,
    NotFound,
    OperationRefused,
    ResponseNotAwaited,
    UnknownAck,
    UnknownChannel,
    UnknownRequest,
)


class MalformedBody(Exception):
    """A request body that is not JSON (raised by the face, never by worker.*)."""


Problems = Callable[[Any], list[tuple[str, str]]]
# A field name reports the exception's message against that one field; a function names
# the fields itself.
Field = str | Problems


def _each_problem(exc: InvalidMessage) -> list[tuple[str, str]]:
    # All of them: a client fixes every refused field in one round trip.
    return list(exc.problems)


def _what(exc: NotFound) -> list[tuple[str, str]]:
    return [(exc.what, str(exc))]


ERRORS: dict[type[Exception], tuple[int, Field]] = {
    MalformedBody: (400, "body"),
    InvalidMessage: (422, _each_problem),
    UnknownChannel: (422, "origin"),
    NotFound: (404, _what),
    MessageNotFound: (404, "msg_id"),
    UnknownRequest: (404, "request_id"),
    UnknownAck: (404, "async_response_id"),
    ResponseNotAwaited: (404, "correlation_id"),
    OperationRefused: (409, "msg_id"),
    NodeNotAccepting: (503, "node"),
}


def problem(status: int, problems: list[tuple[str, str]]) -> JSONResponse:
    errors = [{"field": field, "problem": text} for field, text in problems]
    return JSONResponse(status_code=status, content={"errors": errors})


def _handler(status: int, field: Field) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    async def handle(_: Request, exc: Exception) -> JSONResponse:
        return problem(status, [(field, str(exc))] if isinstance(field, str) else field(exc))

    return handle


def install(app: FastAPI) -> None:
    """Register one handler per row of :data:`ERRORS`."""
    for cls, (status, field) in ERRORS.items():
        app.add_exception_handler(cls, _handler(status, field))
