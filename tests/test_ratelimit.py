"""The token bucket (worker/lua/rate_take.lua, worker/core/ratelimit.py) against the real Redis,
on times the test gives: a bucket gives its burst, refuses with the exact wait, refills at its
rate and no further, expires when full again; parallel takes from threads never get more than
the burst; the API's limiter leases a fast bucket's tokens (one Redis take for many requests,
never more than the bucket gave, a refusal shared) and fails open while Redis is down and asks
it again after a pause."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from orderly.models.keys import RateKeys
from orderly.worker.core.ratelimit import (
    FAIL_OPEN_PAUSE_S,
    LEASE_HELD_S,
    Buckets,
    Limit,
    Limiter,
    lease_size,
    take,
)
from tests.conftest import TEST_REDIS_URL
from tests.helpers import ManualClock
from tooling.servers import RedisServer

T0 = 1_800_000_000_000  # ms: any time will do, the script reads none of its own
KEY = RateKeys().address("10.0.0.1")


@pytest.fixture
def buckets(redis_client: redis.Redis) -> Iterator[Buckets]:
    yield Buckets(redis_client)


def test_a_bucket_gives_its_burst_then_refuses_until_a_token_is_back(buckets: Buckets) -> None:
    limit = Limit(per_s=2, burst=3)
    taken = [buckets.take(KEY, limit, T0) for _ in range(3)]
    assert [(v.allowed, v.remaining) for v in taken] == [(True, 2), (True, 1), (True, 0)]
    refused = buckets.take(KEY, limit, T0)
    assert (refused.allowed, refused.retry_after_s, refused.remaining) == (False, 0.5, 0)
    assert refused.retry_after == 1  # Retry-After: whole seconds, rounded up
    later = buckets.take(KEY, limit, T0 + 499)
    assert not later.allowed and later.retry_after_s == 0.001
    assert buckets.take(KEY, limit, T0 + 500).allowed
    assert not buckets.take(KEY, limit, T0 + 500).allowed


def test_takes_from_several_buckets_in_one_pipeline_keep_their_order(
    buckets: Buckets, redis_client: redis.Redis
) -> None:
    one, two = Limit(per_s=1, burst=1), Limit(per_s=1, burst=2)
    other = KEY + ":other"
    verdicts = buckets.take_each(
        [(KEY, one), (other, two), (KEY, one), ("never", Limit(0, 0)), (other, two)], T0
    )
    # the first take of KEY empties it, the second is refused; "other" gives both; no limit
    # allows without a take
    assert [v.allowed for v in verdicts] == [True, True, False, True, True]
    assert verdicts[2].retry_after_s == 1.0
    assert redis_client.exists("never") == 0
    assert not buckets.take(other, two, T0).allowed  # both of its tokens went
    assert buckets.take_each([], T0) == []


def test_a_bucket_refills_at_its_rate_and_never_past_its_burst(buckets: Buckets) -> None:
    limit = Limit(per_s=4, burst=10)
    for _ in range(10):
        assert buckets.take(KEY, limit, T0).allowed
    # 1.5 s at 4 a second: 6 tokens, taken one by one, then none.
    back = [buckets.take(KEY, limit, T0 + 1_500).allowed for _ in range(7)]
    assert back == [True] * 6 + [False]
    # An hour idle fills the bucket to its burst, not to 14,400.
    assert buckets.take(KEY, limit, T0 + 3_600_000).remaining == 9


def test_a_cost_is_taken_whole_or_not_at_all(buckets: Buckets) -> None:
    limit = Limit(per_s=1, burst=5)
    assert buckets.take(KEY, limit, T0, cost=4).remaining == 1
    refused = buckets.take(KEY, limit, T0, cost=3)
    assert not refused.allowed and refused.retry_after_s == 2.0 and refused.remaining == 1
    assert buckets.take(KEY, limit, T0, cost=1).remaining == 0
    with pytest.raises(ValueError, match="can never be taken"):
        buckets.take(KEY, limit, T0, cost=6)


def test_a_retry_after_of_a_slow_bucket_is_rounded_up(buckets: Buckets) -> None:
    limit = Limit(per_s=0.4, burst=1)  # one token every 2.5 s
    assert buckets.take(KEY, limit, T0).allowed
    refused = buckets.take(KEY, limit, T0)
    assert (refused.retry_after_s, refused.retry_after) == (2.5, 3)


def test_the_key_expires_when_the_bucket_would_be_full_again(
    buckets: Buckets, redis_client: redis.Redis
) -> None:
    limit = Limit(per_s=2, burst=3)
    buckets.take(KEY, limit, T0)
    assert 0 < redis_client.pttl(KEY) <= 500  # one token short: full in 0.5 s
    buckets.take(KEY, limit, T0)
    buckets.take(KEY, limit, T0)
    assert 1_000 < redis_client.pttl(KEY) <= 1_500
    # A refused take writes nothing: the bucket is as the last take left it.
    held = redis_client.hgetall(KEY)
    assert not buckets.take(KEY, limit, T0 + 100).allowed
    assert redis_client.hgetall(KEY) == held


def test_a_clock_behind_the_bucket_refills_nothing(buckets: Buckets) -> None:
    limit = Limit(per_s=1, burst=2)
    assert buckets.take(KEY, limit, T0).allowed
    assert buckets.take(KEY, limit, T0).allowed
    # Another process's clock a second behind: no token comes back from the past.
    assert not buckets.take(KEY, limit, T0 - 1_000).allowed
    assert buckets.take(KEY, limit, T0 + 1_000).allowed


def test_an_unlimited_bucket_is_never_asked(buckets: Buckets, redis_client: redis.Redis) -> None:
    for _ in range(100):
        assert buckets.take(KEY, Limit(per_s=0, burst=1), T0).allowed
    assert redis_client.exists(KEY) == 0


def test_parallel_takes_from_threads_never_get_more_than_the_burst(
    redis_client: redis.Redis,
) -> None:
    limit = Limit(per_s=0.001, burst=100)  # no refill worth a token during the test
    start = threading.Barrier(8)

    def worker(_: int) -> int:
        client = redis.Redis.from_url(TEST_REDIS_URL)
        mine = Buckets(client)
        start.wait()
        got = sum(mine.take(KEY, limit, T0).allowed for _ in range(40))
        client.close()
        return got

    with ThreadPoolExecutor(8) as pool:
        allowed = sum(pool.map(worker, range(8)))
    assert allowed == 100  # 320 asked at once, from 8 connections: exactly the burst


def test_one_take_without_keeping_the_script(redis_client: redis.Redis) -> None:
    assert take(redis_client, KEY, Limit(1, 1), T0).allowed
    assert not take(redis_client, KEY, Limit(1, 1), T0).allowed


def test_the_limiter_fails_open_while_redis_is_down_and_asks_again_after_a_pause(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    limiter = Limiter(redis_server.url, clock)
    tight = Limit(per_s=0.001, burst=1)

    async def take_once() -> bool:
        return (await limiter.take(KEY, tight)).allowed

    def empty_bucket() -> None:
        with redis_server.client() as c:
            Buckets(c).take(KEY, tight, int(clock.time() * 1000))

    async def scenario() -> list[bool]:
        seen = [await take_once(), await take_once()]  # the burst, then refused
        redis_server.stop(kill=True)
        with caplog.at_level(logging.WARNING, logger="orderly.worker.core.ratelimit"):
            seen.append(await take_once())  # Redis down: let through
            seen.append(await take_once())
        redis_server.start()
        empty_bucket()
        seen.append(await take_once())  # within the pause: Redis not asked
        clock.advance(FAIL_OPEN_PAUSE_S)
        seen.append(await take_once())  # asked again: the bucket is empty
        return seen

    assert asyncio.run(scenario()) == [True, False, True, True, True, False]
    warnings = [r for r in caplog.records if "rate limits not applied" in r.getMessage()]
    assert len(warnings) == 1  # once, not per request


def _tokens(client: redis.Redis, key: str = KEY) -> float:
    return float(client.hget(key, "tokens") or -1)


def test_a_fast_bucket_is_leased_one_redis_take_for_many_requests(
    redis_client: redis.Redis,
) -> None:
    clock = ManualClock()
    limiter = Limiter(TEST_REDIS_URL, clock)
    fast = Limit(per_s=1_000, burst=2_000)
    lease = lease_size(fast)
    assert lease == 20  # 20 ms of its rate

    async def takes(n: int) -> list[bool]:
        return [(await limiter.take(KEY, fast)).allowed for _ in range(n)]

    assert asyncio.run(takes(1)) == [True]
    assert _tokens(redis_client) == 2_000 - lease  # the lease was spent in Redis at once
    assert asyncio.run(takes(lease - 1)) == [True] * (lease - 1)
    assert _tokens(redis_client) == 2_000 - lease  # handed out here: Redis not asked
    assert asyncio.run(takes(1)) == [True]
    assert _tokens(redis_client) == 2_000 - 2 * lease


def test_a_slow_bucket_is_taken_one_token_a_request(redis_client: redis.Redis) -> None:
    limiter = Limiter(TEST_REDIS_URL, ManualClock())
    slow = Limit(per_s=50, burst=100)
    assert lease_size(slow) == 1

    async def scenario() -> None:
        for n in range(1, 4):
            assert (await limiter.take(KEY, slow)).allowed
            assert _tokens(redis_client) == 100 - n

    asyncio.run(scenario())


def test_processes_leasing_together_never_get_more_than_the_bucket_gave(
    redis_client: redis.Redis,
) -> None:
    clock = ManualClock()  # stands still: nothing refills
    limit = Limit(per_s=1_000, burst=90)  # a lease of 20; the last one finds 10
    limiters = [Limiter(TEST_REDIS_URL, clock) for _ in range(3)]

    async def scenario() -> list[int]:
        asks = [limiter.take(KEY, limit) for _ in range(60) for limiter in limiters]
        verdicts = await asyncio.gather(*asks)
        return [sum(v.allowed for v in verdicts), len(verdicts)]

    allowed, asked = asyncio.run(scenario())
    assert (allowed, asked) == (90, 180)
    assert _tokens(redis_client) == 0


def test_requests_waiting_for_one_lease_share_its_refusal(redis_server: RedisServer) -> None:
    limiter = Limiter(redis_server.url, ManualClock())  # a server of its own: its asks counted
    limit = Limit(per_s=1_000, burst=40)

    async def scenario() -> list[bool]:
        verdicts = await asyncio.gather(*(limiter.take(KEY, limit) for _ in range(100)))
        return [v.allowed for v in verdicts]

    seen = asyncio.run(scenario())
    assert seen == [True] * 40 + [False] * 60
    with redis_server.client() as client:
        stats = client.info("commandstats")["cmdstat_evalsha"]
    # one ask a lease (10 tokens, a quarter of the burst) and the one refused: 60 waited for it
    # (the first EVALSHA fails, the script not loaded yet, and is sent again)
    assert stats["calls"] - stats["failed_calls"] == 5


def test_a_lease_unused_for_its_time_is_dropped_not_handed_out(
    redis_client: redis.Redis,
) -> None:
    clock = ManualClock()
    limiter = Limiter(TEST_REDIS_URL, clock)
    limit = Limit(per_s=1_000, burst=2_000)

    async def take_one() -> bool:
        return (await limiter.take(KEY, limit)).allowed

    assert asyncio.run(take_one())
    assert _tokens(redis_client) == 2_000 - 20
    clock.advance(LEASE_HELD_S)  # 19 tokens left in the lease, now too old
    redis_client.delete(KEY)  # a full bucket again: the next take must ask
    assert asyncio.run(take_one())
    assert _tokens(redis_client) == 2_000 - 20
