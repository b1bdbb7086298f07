"""Who is calling: every route but /health, /ready and /docs needs an API key with a scope.

A route declares its scope with :func:`requires` (or takes the caller with :func:`caller`,
or :data:`Operator`); the scope goes into the OpenAPI document as the operation's security
requirement. ``publish:{room}`` is filled from the path. The producers' busiest routes (POST
/messages, conversation requests and responses, publishes) make the same check themselves with
:func:`key_of`, documented by :func:`checks_key`: FastAPI's dependency solving cost a tenth of
their CPU. Keys live in worker.keys.

A key PostgreSQL verified is held in memory by the app (:class:`KeyCache`) for
:data:`KEY_CACHE_S` seconds, so that a busy producer costs no database trip and no thread per
request. Its expiry is still honoured to the instant; a revocation through this process (the
API or the console) is at once; one through another process (``orderly key revoke``, another
API process) takes effect here within :data:`KEY_CACHE_S`.

A token no key has is refused by the app's directory of keys (worker.key_directory) without a
lookup of its own, in the same time whether its prefix names a key or not. Each refusal of a
token in a key's form counts against the client address's refused limit, each authenticated
request against its key's (api.http.ratelimit).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer, SecurityScopes
from fastapi.security.utils import get_authorization_scheme_param
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool

from orderly.api.http.ratelimit import limits_of
from orderly.worker import keys
from orderly.worker.channels import ACK_TOKEN_HEADER
from orderly.worker.core.clock import Clock
from orderly.worker.core.errors import Unauthenticated
from orderly.worker.key_directory import KeyDirectory, key_digests
from orderly.worker.keys import Principal
from orderly.worker.runtime import Runtime

SCHEME = "ApiKey"

# How long a verified key is taken from memory: the longest a key revoked by another process
# may still be accepted here. ``last_used_at`` is written on the next lookup after it, so it
# may lag by this much beyond its minute.
KEY_CACHE_S = 5.0
# Keys held at most: a producer uses one key, so this is far above what a process sees; a
# flood of distinct valid keys costs their lookups, never memory.
KEY_CACHE_SIZE = 1024


class KeyCache:
    """Keys PostgreSQL verified lately, by the SHA-256 of their token (never the token).
    Refusals are not kept: each one asks PostgreSQL again and answers why. Used from the event
    loop only, so it needs no lock."""

    def __init__(
        self, clock: Clock, ttl_s: float = KEY_CACHE_S, size: int = KEY_CACHE_SIZE
    ) -> None:
        self._clock = clock
        self._ttl_s = ttl_s
        self._size = size
        # digest -> (the key, when verified on the monotonic clock, expiry as epoch seconds)
        self._held: dict[bytes, tuple[Principal, float, float | None]] = {}
        # Moved by clear(): a lookup that began before a revocation does not store its key.
        self.generation = 0

    @staticmethod
    def digest(token: str) -> bytes:
        return hashlib.sha256(token.encode()).digest()

    def get(self, digest: bytes) -> Principal | None:
        held = self._held.get(digest)
        if held is None:
            return None
        principal, verified, expires = held
        # A clock moved back (a test's) counts as stale, like one moved past the window.
        fresh = 0.0 <= self._clock.monotonic() - verified < self._ttl_s
        if fresh and (expires is None or self._clock.time() < expires):
            return principal
        # Asked again, PostgreSQL says why it is refused now (expired, revoked) or renews it.
        del self._held[digest]
        return None

    def put(self, digest: bytes, principal: Principal, generation: int) -> None:
        """Keep a key verified by a lookup that began at ``generation``."""
        if generation != self.generation:
            return
        if len(self._held) >= self._size:
            self._held.pop(next(iter(self._held)))  # the oldest verified
        expires = None if principal.expires_at is None else principal.expires_at.timestamp()
        self._held[digest] = (principal, self._clock.monotonic(), expires)

    def clear(self) -> None:
        """Forget every key: after a revocation through this process, so that it holds from
        the next request on."""
        self._held.clear()
        self.generation += 1


def key_cache(app: Starlette) -> KeyCache:
    """The app's cache of verified keys (made on its first request, on the runtime's clock)."""
    cache: KeyCache | None = getattr(app.state, "key_cache", None)
    if cache is None:
        runtime: Runtime = app.state.runtime
        cache = app.state.key_cache = KeyCache(runtime.clock)
    return cache


def key_directory(app: Starlette) -> KeyDirectory:
    """The app's directory of keys (made on its first request that needs it)."""
    directory: KeyDirectory | None = getattr(app.state, "key_directory", None)
    if directory is None:
        runtime: Runtime = app.state.runtime
        directory = KeyDirectory(functools.partial(key_digests, runtime.engine))
        app.state.key_directory = directory
    return directory


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
    (scope,) = scopes.scopes  # one per route
    token = "" if credentials is None else credentials.credentials
    return await authenticated(request, token, scope.format(**request.path_params))


async def authenticated(request: Request, token: str, scope: str) -> Principal:
    """The key ``token`` stands for, holding ``scope``, charged to its rate limit: the one
    way an API key is checked (the routes' and the console's)."""
    keys.key_prefix(token)  # none, or not in a key's form: refused here, uncounted
    cache = key_cache(request.app)
    digest = cache.digest(token)
    found = cache.get(digest) or await _look_up(request, cache, digest, token, scope)
    await limits_of(request)[0].key(found.name)
    found.require(scope)
    return found


async def _look_up(
    request: Request, cache: KeyCache, digest: bytes, token: str, scope: str
) -> Principal:
    """A token not held: refused at once when no key has its digest, else verified by
    PostgreSQL in a thread. A refusal counts against the client address's limit; over it, the
    answer is 429, and so are the next ones from there until the limit allows again."""
    limits, address = limits_of(request)
    limits.refuse_if_blocked(address)
    if not await key_directory(request.app).knows(digest):
        await limits.refused(address)
        raise Unauthenticated(keys.UNKNOWN_KEY)
    generation = cache.generation
    runtime: Runtime = request.app.state.runtime
    try:
        found = await run_in_threadpool(
            functools.partial(keys.authenticate, runtime.engine, token, runtime.clock, scope=scope)
        )
    except Unauthenticated:
        await limits.refused(address)
        raise
    cache.put(digest, found, generation)
    return found


def checks_key(scope: str) -> dict[str, Any]:
    """A busy route's ``openapi_extra`` when it checks the caller's key itself
    (:func:`key_of`): the security requirement :func:`caller` would document."""
    return {"security": [{SCHEME: [scope]}]}


async def key_of(request: Request, scope: str) -> Principal:
    """The caller's key, holding ``scope``: the check :func:`caller` makes, made by a busy
    route itself, without FastAPI's dependency solving (a tenth of such a route's CPU). As
    with :data:`bearer`, a header of another scheme is no key."""
    scheme, token = get_authorization_scheme_param(request.headers.get("authorization"))
    return await authenticated(request, token if scheme.lower() == "bearer" else "", scope)


def caller(scope: str) -> Any:
    """A parameter's default: the authenticated caller, who must hold ``scope``."""
    return Security(_principal, scopes=[scope])


def requires(scope: str) -> list[Any]:
    """A route's ``dependencies``: the caller must hold ``scope``."""
    return [caller(scope)]


Operator = Annotated[Principal, caller(keys.OPERATE)]
Producer = Annotated[Principal, caller(keys.PRODUCE)]
Consumer = Annotated[Principal, caller(keys.CONSUME)]
