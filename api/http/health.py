"""GET /health: the API process answers (liveness; it checks nothing behind it).
GET /ready: PostgreSQL, Redis and the broker answer (and the Redis Cluster of the ordering
structures, with ORDERLY_REDIS_CLUSTER), each within ORDERLY_READY_TIMEOUT_MS; else 503
naming each one that does not."""

from __future__ import annotations

import asyncio
import functools

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from orderly.api.http import answers as a
from orderly.api.http.answers import answers
from orderly.api.http.common import AppRuntime
from orderly.api.http.errors import problem
from orderly.worker import readiness
from orderly.worker.core.errors import ServiceUnavailable

router = APIRouter()


@router.get("/health", responses=answers(a.Health))
async def health() -> JSONResponse:
    return JSONResponse({"status": "ok"})


async def _probe(
    service: str, check: readiness.Probe, timeout_s: float
) -> ServiceUnavailable | None:
    try:
        # In a thread: a hung server must not block the event loop, only this probe.
        return await asyncio.wait_for(run_in_threadpool(readiness.probe, service, check), timeout_s)
    except TimeoutError:
        return ServiceUnavailable(service, f"no answer within {round(timeout_s * 1000)} ms")


@router.get("/ready", responses=answers(a.Ready))
async def ready(runtime: AppRuntime) -> JSONResponse:
    from orderly.worker.celery import ping_broker

    timeout_s = runtime.settings.ready_timeout_ms / 1000
    checks: dict[str, readiness.Probe] = {
        "postgresql": functools.partial(readiness.ping_postgresql, runtime.engine),
        "redis": functools.partial(readiness.ping_redis, runtime.redis),
        "broker": functools.partial(ping_broker, timeout_s),
    }
    if runtime.settings.redis_cluster:
        # The conversations' ordering structures (docs/redis-cluster.md).
        checks["redis-cluster"] = functools.partial(
            readiness.ping_redis_cluster, lambda: runtime.ordering_redis
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
