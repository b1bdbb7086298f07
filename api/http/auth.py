"""Who is calling: every route but /health, /ready and /docs needs an API key with a scope.

A route declares its scope with :func:`requires` (or takes the caller with :func:`caller`,
or :data:`Operator`); the scope goes into the OpenAPI document as the operation's security
requirement. ``publish:{room}`` is filled from the path. Keys live in worker.keys.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer, SecurityScopes
from starlette.concurrency import run_in_threadpool

from worker import keys
from worker.channels import ACK_TOKEN_HEADER
from worker.keys import Principal
from worker.runtime import Runtime

SCHEME = "ApiKey"

bearer = HTTPBearer(
    scheme_name=SCHEME,
    bearerFormat="orderly_<prefix>_<secret> (orderly key create)",
    description="An API key: `Authorization: Bearer orderly_...`. Each operation names the "
    "scope it needs; `publish:*` covers every room.",
    auto_error=False,
)


ACK_SCHEME = "AckToken"
_ack = APIKeyHeader(
    name=ACK_TOKEN_HEADER,
    scheme_name=ACK_SCHEME,
    description="A client's ACK: the token its response was sent with, brought back.",
    auto_error=False,
)


async def ack_header(token: Annotated[str | None, Depends(_ack)]) -> str:
    """The ACK token the request brought ("" when none: refused by the gate, naming it)."""
    return token or ""


async def _principal(
    scopes: SecurityScopes,
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Principal:
    runtime: Runtime = request.app.state.runtime
    token = None if credentials is None else credentials.credentials
    (scope,) = scopes.scopes  # one per route
    return await run_in_threadpool(
        functools.partial(
            keys.authenticate,
            runtime.engine,
            token,
            runtime.clock,
            scope=scope.format(**request.path_params),
        )
    )


def caller(scope: str) -> Any:
    """A parameter's default: the authenticated caller, who must hold ``scope``."""
    return Security(_principal, scopes=[scope])


def requires(scope: str) -> list[Any]:
    """A route's ``dependencies``: the caller must hold ``scope``."""
    return [caller(scope)]


Operator = Annotated[Principal, caller(keys.OPERATE)]
