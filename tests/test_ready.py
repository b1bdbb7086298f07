"""GET /ready checked once per ORDERLY_READY_CACHE_MS however many ask (api/http/health.py):
its verdicts kept and shared, and a flood of /ready against a real API costing one check."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
from fastapi.responses import JSONResponse, Response

from orderly.api.http.health import Verdicts
from tests.helpers import ManualClock
from tests.stack import Stack
from tooling.servers import RedisServer


class Checks:
    """A check of the services that answers when the test lets it, counting its runs."""

    def __init__(self) -> None:
        self.runs = 0
        self.status = 200
        self.release = asyncio.Event()

    async def __call__(self) -> Response:
        self.runs += 1
        await self.release.wait()
        return JSONResponse({"run": self.runs}, status_code=self.status)


def test_callers_during_a_check_share_it_and_its_verdict_stands_for_its_time() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        verdicts = Verdicts(clock, ttl_s=1.0)
        checks = Checks()
        waiting = [asyncio.ensure_future(verdicts.answer(checks)) for _ in range(50)]
        while checks.runs == 0:
            await asyncio.sleep(0)
        checks.release.set()
        answers = await asyncio.gather(*waiting)
        assert checks.runs == 1
        assert {(a.status_code, a.body) for a in answers} == {(200, b'{"run":1}')}
        # Each caller its own answer, the verdict's status, body and headers.
        assert len({id(a) for a in answers}) == 50
        clock.advance(0.999)
        checks.status = 503
        assert (await verdicts.answer(checks)).status_code == 200 and checks.runs == 1
        clock.advance(0.001)
        later = await verdicts.answer(checks)
        assert (later.status_code, checks.runs) == (503, 2)

    asyncio.run(scenario())


def test_a_caller_that_hangs_up_leaves_the_check_to_the_others() -> None:
    async def scenario() -> None:
        verdicts = Verdicts(ManualClock(), ttl_s=0.0)
        checks = Checks()
        gone = asyncio.ensure_future(verdicts.answer(checks))
        stays = asyncio.ensure_future(verdicts.answer(checks))
        while checks.runs == 0:
            await asyncio.sleep(0)
        gone.cancel()
        checks.release.set()
        assert (await stays).status_code == 200
        # Without a time to stand, the next caller checks again.
        await verdicts.answer(checks)
        assert checks.runs == 2

    asyncio.run(scenario())


def connections_received(server: RedisServer) -> int:
    return int(server.client().info("stats")["total_connections_received"])


def test_a_flood_of_ready_costs_one_check_of_the_services(
    stack: Stack, redis_server: RedisServer
) -> None:
    # A Redis of the test's own: every connection it receives is the API's.
    stack.env(ORDERLY_REDIS_URL=redis_server.url, ORDERLY_READY_CACHE_MS="60000")
    stack.start_api()
    first = stack.http.get("/ready")
    assert first.status_code == 200, first.text
    before = connections_received(redis_server)
    url = f"{stack.url}/ready"
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: httpx.get(url, timeout=30), range(200)))
    assert [a.status_code for a in answers] == [200] * 200
    assert {a.text for a in answers} == {first.text}
    # Each check opens a broker connection of its own: 200 checks would be 200 of them. The
    # API's pools may grow by the 8 requests at once (the rate limits' client among them).
    assert connections_received(redis_server) - before <= 16
