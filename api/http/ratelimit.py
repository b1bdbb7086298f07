"""The API's rate limits (worker/core/ratelimit.py; ORDERLY_RATE_*): every request per client
address (:class:`LimitRequests`, pure ASGI, before anything else runs), every authenticated
request per API key (api.http.auth), refused credentials per address (API keys, ACK tokens),
the console's sign-ins per address and per key tried. Over a limit: 429, ``Retry-After``.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from orderly.api.http.errors import RateLimited, problem
from orderly.models.keys import RateKeys
from orderly.worker import keys
from orderly.worker.core.clock import Clock
from orderly.worker.core.errors import Unauthenticated
from orderly.worker.core.ratelimit import Limit, Limiter, Verdict
from orderly.worker.runtime import Runtime
from orderly.worker.settings import Settings

# Addresses remembered as over their refused limit, at most: a flood of addresses costs their
# Redis takes, never memory.
BLOCKED_SIZE = 10_000


def client_address(scope: Scope) -> str:
    """The client's address as the server saw it (uvicorn puts a trusted proxy's
    X-Forwarded-For there)."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def _rate(limit: Limit, per: str = "s") -> str:
    per_s = limit.per_s * 60 if per == "min" else limit.per_s
    return f"{per_s:g}/{per}, burst {limit.burst}"


class ApiLimits:
    """One app's buckets and the limits its settings give them."""

    def __init__(self, settings: Settings, clock: Clock) -> None:
        self.settings = settings
        self.limiter = Limiter(settings.redis_url, clock)
        self.keys = RateKeys()
        self._clock = clock
        # address -> until when (monotonic) its refused bucket was found empty: such an
        # address is refused here, without a Redis call or the check it would need.
        self._blocked: dict[str, float] = {}

    async def request(self, address: str) -> RateLimited | None:
        limit = self.settings.address_limit
        verdict = await self.limiter.take(self.keys.address(address), limit)
        if verdict.allowed:
            return None
        why = f"over the rate limit of {address}: {_rate(limit)} (ORDERLY_RATE_ADDRESS_PER_S)"
        return _limited(why, verdict)

    async def key(self, name: str) -> None:
        """A request authenticated by the key ``name``: RateLimited over its limit."""
        limit = self.settings.key_limit
        verdict = await self.limiter.take(self.keys.key(name), limit)
        if not verdict.allowed:
            why = f"over the rate limit of the key {name!r}: {_rate(limit)}"
            raise _limited(f"{why} (ORDERLY_RATE_KEY_PER_S)", verdict, "Authorization")

    def refuse_if_blocked(self, address: str) -> None:
        """Before a check of a credential: RateLimited while the address is over its limit of
        refused credentials, as last found."""
        until = self._blocked.get(address)
        if until is None:
            return
        left = until - self._clock.monotonic()
        if left <= 0:
            del self._blocked[address]
            return
        raise _limited(self._refused_problem(address), Verdict(False, left, 0))

    async def refused(self, address: str) -> None:
        """A credential of ``address`` refused: counted; RateLimited (instead of the refusal)
        when that passes its limit."""
        verdict = await self.limiter.take(self.keys.refused(address), self.settings.refused_limit)
        if verdict.allowed:
            return
        if len(self._blocked) >= BLOCKED_SIZE:
            self._blocked.pop(next(iter(self._blocked)))  # the oldest
        self._blocked[address] = self._clock.monotonic() + verdict.retry_after_s
        raise _limited(self._refused_problem(address), verdict)

    def _refused_problem(self, address: str) -> str:
        limit = _rate(self.settings.refused_limit)
        return f"too many refused credentials from {address}: {limit} (ORDERLY_RATE_REFUSED_PER_S)"

    async def sign_in(self, address: str, token: str) -> RateLimited | None:
        """A console sign-in: counted against the address, then the key the token names."""
        limit = self.settings.login_limit
        verdict = await self.limiter.take(self.keys.login_address(address), limit)
        if not verdict.allowed:
            return _limited(f"too many sign-ins from {address}", verdict)
        try:
            prefix = keys.key_prefix(token)
        except Unauthenticated:
            return None  # no key named: the address's limit is the one
        verdict = await self.limiter.take(self.keys.login_key(prefix), limit)
        if not verdict.allowed:
            return _limited(f"too many sign-ins with the key {prefix!r}", verdict, "key")
        return None


def _limited(problem: str, verdict: Verdict, field: str = "client") -> RateLimited:
    retry = verdict.retry_after
    return RateLimited(f"{problem}: retry after {retry} s", retry, field)


def api_limits(app: Starlette) -> ApiLimits:
    """The app's limits (made on its first request, on the runtime's settings and clock)."""
    limits: ApiLimits | None = getattr(app.state, "rate_limits", None)
    if limits is None:
        runtime: Runtime = app.state.runtime
        limits = app.state.rate_limits = ApiLimits(runtime.settings, runtime.clock)
    return limits


def limits_of(request: Request) -> tuple[ApiLimits, str]:
    """A request's app limits and its client address."""
    return api_limits(request.app), client_address(request.scope)


async def sign_in_limited(request: Request, token: str) -> RateLimited | None:
    """A console sign-in over its limits (per address, per key tried), or None."""
    limits, address = limits_of(request)
    return await limits.sign_in(address, token)


class LimitRequests:
    """Pure ASGI: every HTTP request takes a token from its client address's bucket first;
    an empty bucket is 429 before any route, body or credential is looked at."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = await api_limits(scope["app"]).request(client_address(scope))
            if refused is not None:
                problems = [(refused.field, str(refused))]
                answer = problem(429, problems, retry_after_s=refused.retry_after_s)
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install(app: Starlette) -> None:
    """Limit every request of ``app`` per client address: outermost, so that a request over
    its limit costs one Redis call and nothing else."""
    app.add_middleware(LimitRequests)
