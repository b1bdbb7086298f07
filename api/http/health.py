"""GET /health: the API process answers (liveness; it checks nothing behind it).
GET /ready: PostgreSQL, Redis and the broker answer (and the Redis Cluster of the ordering
structures, with ORDERLY_REDIS_CLUSTER), each within ORDERLY_READY_TIMEOUT_MS, and no Redis
may evict orderly's keys (unless ORDERLY_REDIS_EVICTION_ALLOWED); else 503 naming each one
that does not. Its verdict stands for ORDERLY_READY_CACHE_MS."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from orderly.api.http import answers as a
from orderly.api.http.answers import answers
from orderly.api.http.common import AppRuntime
from orderly.api.http.errors import problem
from orderly.worker import readiness
from orderly.worker.core.clock import Clock
from orderly.worker.core.errors import ServiceUnavailable
from orderly.worker.runtime import Runtime

router = APIRouter()


@router.get("/health", responses=answers(a.Health))
async def health() -> JSONResponse:
    return JSONResponse({"status": "ok"})


class Verdicts:
    """GET /ready's last verdict and the check under way. A check costs three threads, three
    round trips and a new broker connection, and /ready asks for no key: however many ask,
    the services are checked once per ``ttl_s``, and callers who come during a check wait for
    that one. Used from the event loop only, so it needs no lock."""

    def __init__(self, clock: Clock, ttl_s: float) -> None:
        self._clock = clock
        self._ttl_s = ttl_s
        self._last: Response | None = None
        self._checked_at = 0.0
        self._running: asyncio.Future[Response] | None = None

    async def answer(self, check: Callable[[], Awaitable[Response]]) -> Response:
        age = self._clock.monotonic() - self._checked_at
        if self._last is not None and 0.0 <= age < self._ttl_s:
            return _copy(self._last)
        if self._running is None:
            self._running = asyncio.ensure_future(self._check(check))
            # Retrieved even when every caller has gone (a client that hung up).
            self._running.add_done_callback(lambda done: done.cancelled() or done.exception())
        # Shielded: a caller that hangs up does not cancel the check the others wait for.
        return _copy(await asyncio.shield(self._running))

    async def _check(self, check: Callable[[], Awaitable[Response]]) -> Response:
        started = self._clock.monotonic()
        try:
            verdict = await check()
        finally:
            self._running = None
        self._last, self._checked_at = verdict, started
        return verdict


def _copy(answer: Response) -> Response:
    # Each request its own answer: a middleware may add to the headers it sends.
    return Response(answer.body, answer.status_code, headers=dict(answer.headers))


def verdicts(request: Request) -> Verdicts:
    """The app's /ready verdicts (made on its first /ready, on the runtime's clock)."""
    found: Verdicts | None = getattr(request.app.state, "ready_verdicts", None)
    if found is None:
        runtime: Runtime = request.app.state.runtime
        ttl_s = runtime.settings.ready_cache_ms / 1000
        found = request.app.state.ready_verdicts = Verdicts(runtime.clock, ttl_s)
    return found


async def _probe(
    service: str, check: readiness.Probe, timeout_s: float
) -> ServiceUnavailable | None:
    try:
        # In a thread: a hung server must not block the event loop, only this probe.
        return await asyncio.wait_for(run_in_threadpool(readiness.probe, service, check), timeout_s)
    except TimeoutError:
        return ServiceUnavailable(service, f"no answer within {round(timeout_s * 1000)} ms")


async def _check(runtime: Runtime) -> Response:
    timeout_s = runtime.settings.ready_timeout_ms / 1000
    checks: dict[str, readiness.Probe] = {
        "postgresql": functools.partial(readiness.ping_postgresql, runtime.engine),
        "redis": functools.partial(readiness.ping_redis, runtime.redis),
        "broker": functools.partial(runtime.broker.ping, timeout_s),
    }
    if runtime.settings.redis_cluster:
        # The conversations' ordering structures (docs/redis-cluster.md).
        checks["redis-cluster"] = functools.partial(
            readiness.ping_redis_cluster, lambda: runtime.ordering_redis
        )
    # A Redis that may evict orderly's keys, unless the operator allowed it.
    checks["redis-eviction"] = functools.partial(
        readiness.keeps_keys,
        runtime.redis_clients,
        runtime.settings.redis_eviction_allowed,
        unreachable_ok=True,  # a Redis down is the redis probe's to name
    )
    found = await asyncio.gather(
        *(_probe(name, check, timeout_s) for name, check in checks.items())
    )
    down = [each for each in found if each is not None]
    if down:
        return problem(
            503,
            [(each.service, str(each)) for each in down],
            retry_after_s=runtime.settings.retry_after_s,
        )
    return JSONResponse({"status": "ready", "checked": list(checks)})


@router.get("/ready", responses=answers(a.Ready))
async def ready(runtime: AppRuntime, request: Request) -> Response:
    return await verdicts(request).answer(functools.partial(_check, runtime))
