"""The HTTP face's one table from exception to status and erring field, and its handlers.

Every refusal answers ``{"errors": [{"field": ..., "problem": ...}]}``; a 503 (a service
unreachable, a node refusing input) and a 429 (a rate limit) also carry ``Retry-After``.
Driver exceptions that mean PostgreSQL, Redis or the broker cannot be reached are 503s naming
that service; any other exception is a 500 of the same shape, and the connection stays open
for the next request.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import kombu.exceptions
import psycopg2  # type: ignore[import-untyped]
import redis.exceptions
import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orderly.worker.core.errors import (
    ConflictingMessage,
    Forbidden,
    InvalidMessage,
    MessageNotFound,
    NodeNotAccepting,
    NotFound,
    OperationRefused,
    ResponseNotAwaited,
    ServiceUnavailable,
    SettingMissing,
    Unauthenticated,
    UnknownAck,
    UnknownChannel,
    UnknownRequest,
    first_line,
)
from orderly.worker.db.db import connection_lost

log = logging.getLogger("orderly.api")


class MalformedBody(Exception):
    """A request body that is not JSON (raised by the face, never by worker.*)."""


class PayloadTooLarge(Exception):
    """A request body over the size limit (raised by the face)."""


class RateLimited(Exception):
    """A client over one of its rate limits (raised by the face, api/http/ratelimit.py): 429
    with ``Retry-After``, whole seconds."""

    def __init__(self, problem: str, retry_after_s: int, field: str = "client") -> None:
        self.retry_after_s = retry_after_s
        self.field = field
        super().__init__(problem)


Problems = Callable[[Any], list[tuple[str, str]]]
# A field name reports the exception's message against that one field; a function names
# the fields itself.
Field = str | Problems


def _each_problem(exc: InvalidMessage) -> list[tuple[str, str]]:
    # All of them: a client fixes every refused field in one round trip.
    return list(exc.problems)


def _conflict(exc: ConflictingMessage) -> list[tuple[str, str]]:
    return [(exc.field, str(exc))]


def _what(exc: NotFound) -> list[tuple[str, str]]:
    return [(exc.what, str(exc))]


def _credential(exc: Unauthenticated) -> list[tuple[str, str]]:
    return [(exc.field, str(exc))]


def _rate(exc: RateLimited) -> list[tuple[str, str]]:
    return [(exc.field, str(exc))]


def _service(exc: ServiceUnavailable) -> list[tuple[str, str]]:
    return [(exc.service, str(exc))]


def _postgresql(exc: Exception) -> list[tuple[str, str]]:
    """PostgreSQL is gone; any other database error (a constraint, a deadlock) is re-raised and
    answered 500."""
    orig = getattr(exc, "orig", None) or exc
    if not connection_lost(exc):
        raise exc
    return _service(ServiceUnavailable("postgresql", first_line(orig)))


def _data(exc: Exception) -> list[tuple[str, str]]:
    orig = getattr(exc, "orig", None) or exc
    return [("input", f"a value PostgreSQL cannot store: {first_line(orig)}")]


def _unreachable(service: str) -> Problems:
    def problems(exc: Exception) -> list[tuple[str, str]]:
        return _service(ServiceUnavailable(service, first_line(exc)))

    return problems


ERRORS: dict[type[Exception], tuple[int, Field]] = {
    MalformedBody: (400, "body"),
    Unauthenticated: (401, _credential),
    Forbidden: (403, "scope"),
    PayloadTooLarge: (413, "body"),
    # A value PostgreSQL cannot take (an integer beyond bigint, a bad date): refused, and the
    # transaction it was in rolled back.
    InvalidMessage: (422, _each_problem),
    UnknownChannel: (422, "origin"),
    NotFound: (404, _what),
    MessageNotFound: (404, "msg_id"),
    UnknownRequest: (404, "request_id"),
    UnknownAck: (404, "async_response_id"),
    ResponseNotAwaited: (404, "correlation_id"),
    OperationRefused: (409, "msg_id"),
    ConflictingMessage: (409, _conflict),
    RateLimited: (429, _rate),
    NodeNotAccepting: (503, "node"),
    # The API runs without a setting the request needs: the operator's to fix, not the caller's.
    SettingMissing: (500, "setting"),
    # A service orderly needs is unreachable: the same request may succeed in a moment.
    ServiceUnavailable: (503, _service),
    sqlalchemy.exc.OperationalError: (503, _postgresql),
    sqlalchemy.exc.InterfaceError: (503, _postgresql),
    sqlalchemy.exc.DBAPIError: (503, _postgresql),  # only with connection_invalidated
    psycopg2.OperationalError: (503, _postgresql),  # the prepared statements' raw connections
    psycopg2.InterfaceError: (503, _postgresql),
    redis.exceptions.ConnectionError: (503, _unreachable("redis")),  # also BusyLoadingError
    redis.exceptions.TimeoutError: (503, _unreachable("redis")),
    kombu.exceptions.OperationalError: (503, _unreachable("broker")),
}


def problem(
    status: int, problems: list[tuple[str, str]], *, retry_after_s: int = 1
) -> JSONResponse:
    errors = [{"field": field, "problem": text} for field, text in problems]
    headers = None
    if status in (429, 503):
        headers = {"Retry-After": str(retry_after_s)}
    elif status == 401:
        headers = {"WWW-Authenticate": 'Bearer realm="orderly"'}
    return JSONResponse(status_code=status, content={"errors": errors}, headers=headers)


def _problems(field: Field, exc: Exception) -> list[tuple[str, str]]:
    return [(field, str(exc))] if isinstance(field, str) else field(exc)


def explain(exc: Exception) -> tuple[int, list[tuple[str, str]]] | None:
    """The status and the problems the API answers ``exc`` with; None for an exception it
    does not map (a bug: a 500). The console shows refusals with it."""
    for kind in type(exc).__mro__:
        if kind in ERRORS:
            status, field = ERRORS[kind]
            return status, _problems(field, exc)
    return None


def _handler(status: int, field: Field) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        found = _problems(field, exc)
        if status == 503:
            log.warning("%s %s: 503 %s", request.method, request.url.path, found)
        if isinstance(exc, RateLimited):
            return problem(status, found, retry_after_s=exc.retry_after_s)
        return problem(status, found, retry_after_s=request.app.state.retry_after_s)

    return handle


class ContainErrors:
    """Any other exception: a 500 in the errors shape, logged, and nothing re-raised, so the
    server keeps the client's connection open (an exception escaping the app makes it close
    the connection after the 500); a client gone before its body was read is no failure (not
    logged as one). A NUL character in the path or the query (no name or id
    holds one, and PostgreSQL refuses it) is a 400 before any route runs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        query = bytes(scope.get("query_string", b"")).lower()
        if "\x00" in scope.get("path", "") or b"%00" in query or b"\x00" in query:
            where = "path" if "\x00" in scope.get("path", "") else "query"
            refused = problem(400, [(where, "NUL characters are not accepted")])
            await refused(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except ClientDisconnect:
            # The client went away before its body was read: nothing failed, nobody to answer.
            log.debug("%s %s: the client disconnected", scope.get("method"), scope.get("path"))
        except Exception:
            if started:
                raise
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            answer = problem(500, [("server", "internal error (logged by the API)")])
            await answer(scope, receive, send)


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    """A path or query parameter FastAPI refused: 422 in orderly's shape, naming it."""
    assert isinstance(exc, RequestValidationError)
    found = [
        (str(err["loc"][-1]) if err.get("loc") else "request", str(err.get("msg", "invalid")))
        for err in exc.errors()
    ]
    return problem(422, found or [("request", "invalid")])


# SQLSTATEs of a value the caller gave that PostgreSQL cannot store: out of range, too long,
# not a number or date, not text. Any other data error is the server's (a 500, logged).
INPUT_SQLSTATES = frozenset(
    {"22001", "22003", "22007", "22008", "22021", "22P02", "22P05", "2200N", "22025"}
)


async def _data_error(request: Request, exc: Exception) -> JSONResponse:
    orig = getattr(exc, "orig", None) or exc
    if getattr(orig, "pgcode", None) in INPUT_SQLSTATES:
        return problem(400, _data(exc))
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return problem(500, [("server", "internal error (logged by the API)")])


def install(app: FastAPI, *, retry_after_s: int) -> None:
    """Register one handler per row of :data:`ERRORS`, and a 500 for anything else."""
    app.state.retry_after_s = retry_after_s
    app.add_exception_handler(sqlalchemy.exc.DataError, _data_error)
    app.add_exception_handler(psycopg2.DataError, _data_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    for cls, (status, field) in ERRORS.items():
        app.add_exception_handler(cls, _handler(status, field))
    app.add_middleware(ContainErrors)
