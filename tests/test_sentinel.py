"""A Sentinel-managed plain Redis (``redis+sentinel://``): the URL is parsed and checked at
start-up, and orderly's clients of it (tracking, the wake key, the runtime's own) reach the
primary its Sentinel names and follow it across a failover. Real servers: a primary, its
replica and a Sentinel of their own on free ports."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from orderly.models.keys import TrackKeys
from orderly.worker.core.clients import SentinelUrl, async_redis_client, redis_client
from orderly.worker.messages.wake import Wake
from orderly.worker.settings import Settings
from orderly.worker.tracking import Tracker, TrackingPolicy
from tests.conftest import _unavailable
from tests.helpers import wait_until
from tooling.servers import RedisSentinel, RedisServer, ServerUnavailable

pytestmark = pytest.mark.xdist_group("sentinel")


class Managed:
    """A primary, its replica and a Sentinel watching them."""

    def __init__(self, primary: RedisServer, replica: RedisServer, sentinel: RedisSentinel):
        self.primary, self.replica, self.sentinel = primary, replica, sentinel

    def server(self, port: int) -> RedisServer:
        return self.primary if port == self.primary.port else self.replica

    def fail_over(self) -> RedisServer:
        """The Sentinel promotes the replica; the new primary, once it takes writes and the old
        one follows it."""
        before = self.sentinel.primary_port()

        def asked() -> bool:  # refused (NOGOODSLAVE) until it has heard the replica a while
            with self.sentinel.client() as c:
                try:
                    return bool(c.execute_command("SENTINEL", "FAILOVER", self.sentinel.service))
                except redis.ResponseError as exc:
                    if "INPROG" in str(exc):  # one of its own started: that one
                        return True
                    if "NOGOODSLAVE" not in str(exc):
                        raise
                    return False

        wait_until(asked, timeout=60, what="the Sentinel to take the failover")
        wait_until(lambda: self.sentinel.primary_port() != before, timeout=60, what="the failover")
        promoted = self.server(self.sentinel.primary_port())

        def writable() -> bool:
            with promoted.client() as c:
                return bool(c.info("replication")["role"] == "master")

        wait_until(writable, timeout=60, what="the new primary to take writes")
        demoted = self.server(before)

        def following() -> bool:  # until then the old one may still take writes, then lose them
            with demoted.client() as c:
                return bool(c.info("replication")["role"] == "slave")

        wait_until(following, timeout=60, what="the old primary to follow the new one")
        return promoted


@pytest.fixture
def managed() -> Iterator[Managed]:
    try:
        primary = RedisServer().start()
    except ServerUnavailable as exc:
        _unavailable("redis-server", exc)
    replica = RedisServer(replica_of=primary.port).start()
    try:

        def synced() -> bool:
            with replica.client() as c:
                return bool(c.info("replication").get("master_link_status") == "up")

        wait_until(synced, timeout=60, what="the replica to sync")
        with RedisSentinel(primary.port) as sentinel:

            def sees_replica() -> bool:
                with sentinel.client() as c:
                    return len(c.sentinel_slaves(sentinel.service)) == 1

            wait_until(sees_replica, timeout=60, what="the Sentinel to find the replica")
            yield Managed(primary, replica, sentinel)
    finally:
        replica.close()
        primary.close()


@pytest.mark.unit
def test_a_sentinel_url_is_parsed_and_a_bad_one_is_named() -> None:
    parsed = SentinelUrl.parse("redis+sentinel://:s%40cret@10.0.0.1:26379,[::1]:26380/main/3")
    assert parsed == SentinelUrl(
        (("10.0.0.1", 26379), ("::1", 26380)), "main", 3, username=None, password="s@cret"
    )
    assert SentinelUrl.parse("redis+sentinel://h:1/m").db == 0
    # A login split by hand: an @ in a password stays in it; a user alone is a user.
    assert SentinelUrl.parse("redis+sentinel://u:p%2Fw@d@h:1/m").password == "p/w@d"
    assert SentinelUrl.parse("redis+sentinel://u@h:1/m").username == "u"
    amqp = "amqp://guest@127.0.0.1//"
    for url, says in (
        ("redis+sentinel://h/m", "is not host:port"),
        ("redis+sentinel://h:0/m", "is not host:port"),
        ("redis+sentinel://h:26379", "names the primary's service"),
        ("redis+sentinel://h:26379/m/x", "names the primary's service"),
        ("redis+sentinel://h:26379/m/\u0663", "names the primary's service"),
        ("redis+sentinel://::1:26379/m", "is not host:port"),
        ("redis+sentinel://h:\u00b2/m", "is not host:port"),
        ("redis+sentinel://h:26379/m?db=3", "no spaces, query or fragment"),
        ("redis+sentinel://h:26379/m\n", "no spaces, query or fragment"),
        ("redis+sentinel://u:p/w@h:26379/m", "percent-encode a /"),
    ):
        with pytest.raises(ValueError, match=says):
            Settings(redis_url=url, broker_url=amqp)
        with pytest.raises(ValueError, match=says):
            Settings(track_redis_url=url)
    # The Celery broker is not taken to a Sentinel-managed Redis: RabbitMQ is the HA broker.
    with pytest.raises(ValueError, match="ORDERLY_BROKER_URL to RabbitMQ's amqp://"):
        Settings(redis_url="redis+sentinel://h:26379/m")
    with pytest.raises(ValueError, match="cannot carry the Celery broker"):
        Settings(broker_url="redis+sentinel://h:26379/m")
    settings = Settings(redis_url="redis+sentinel://h:26379/m", broker_url=amqp)
    assert settings.effective_broker_url == amqp


def _write_once_it_follows(client: redis.Redis, key: str, value: str) -> None:
    """A write through ``client``: the first after a failover may find its connection to the
    demoted primary dropped (raised); the next asks the Sentinel again."""

    def written() -> bool:
        try:
            return bool(client.set(key, value))
        except redis.ConnectionError:
            return False

    wait_until(written, timeout=30, what=f"a write of {key} after the failover")


@pytest.mark.e2e  # servers of its own
def test_tracking_and_the_wake_key_follow_the_primary_across_a_failover(
    managed: Managed,
) -> None:
    url = managed.sentinel.url()
    client = redis_client(url, socket_connect_timeout=5, socket_timeout=5)
    tracker = Tracker(client, TrackKeys("sentinel:track"), TrackingPolicy(), service="1")
    wake = Wake(client, key="sentinel:wake", ttl_ms=300_000)  # outlives the failover
    sent: list[int] = []
    first = tracker.register({"meta": {"id": "x-1"}})
    assert first > 0 and wake.wake(lambda: sent.append(1))
    assert client.wait(1, 10_000) == 1  # on the replica before it is promoted
    # On the primary the Sentinel names, not merely somewhere.
    with managed.primary.client() as direct:
        assert direct.exists(f"sentinel:track:message:{first}") == 1
        assert direct.get("sentinel:wake") is not None

    promoted = managed.fail_over()
    assert promoted is managed.replica
    _write_once_it_follows(client, "sentinel:after", "1")
    # The same client objects carry on, on the new primary, with what was replicated.
    second = tracker.register({"meta": {"id": "x-2"}})
    assert second == first + 1  # the id counter came over with the replica
    assert tracker.done(first) and tracker.done(second)
    assert not wake.wake(lambda: sent.append(2))  # the mark survived: no second task
    assert sent == [1]
    with promoted.client() as direct:
        assert direct.get("sentinel:after") == b"1"
        assert direct.exists(f"sentinel:track:message:{second}") == 1
    with managed.primary.client() as old:
        role = old.info("replication")["role"]
    assert role == "slave"  # the old primary follows the new one


@pytest.mark.e2e  # servers of its own
def test_the_runtime_and_an_asyncio_client_reach_the_primary_through_the_sentinel(
    managed: Managed,
) -> None:
    from orderly.worker.core.clock import SYSTEM
    from orderly.worker.core.ratelimit import REDIS_CONNECTIONS, Limit, Limiter
    from orderly.worker.readiness import evicting
    from orderly.worker.runtime import Runtime

    url, tracking = managed.sentinel.url(db=2), managed.sentinel.url(db=3)
    amqp = "amqp://guest@127.0.0.1//"
    settings = Settings(redis_url=url, track_redis_url=tracking, broker_url=amqp)
    runtime: Any = Runtime(settings)
    runtime.redis.set("sentinel:runtime", "r")
    runtime.tracking_redis.set("sentinel:tracking", "t")
    # The eviction check names the primary the Sentinel names.
    with managed.primary.client() as direct:
        direct.config_set("maxmemory", "1gb")
        direct.config_set("maxmemory-policy", "allkeys-lru")
    assert evicting(runtime.redis) == [
        f"127.0.0.1:{managed.primary.port}: maxmemory-policy allkeys-lru with maxmemory "
        f"{1 << 30} bytes"
    ]

    async def through_asyncio() -> Any:
        client = async_redis_client(url)
        try:
            await client.set("sentinel:async", "a")
            return await client.get("sentinel:runtime")
        finally:
            await client.aclose()

    assert asyncio.run(through_asyncio()) == b"r"
    with redis.Redis(port=managed.primary.port, db=2) as direct:
        assert direct.mget("sentinel:runtime", "sentinel:async") == [b"r", b"a"]
    with redis.Redis(port=managed.primary.port, db=3) as direct:
        assert direct.get("sentinel:tracking") == b"t"

    # The API's limiter: its buckets on the primary (a refusal: it did not fail open), its
    # connections capped as on a plain Redis while many requests take at once.
    limiter = Limiter(url, SYSTEM)
    slow = Limit(per_s=0.001, burst=2)

    async def takes() -> tuple[list[bool], list[bool], int]:
        first = [(await limiter.take("sentinel:one", slow)).allowed for _ in range(3)]
        many = await asyncio.gather(
            *(limiter.take(f"sentinel:b{i}", slow) for i in range(3 * REDIS_CONNECTIONS))
        )
        with managed.primary.client() as direct:  # while the loop's connections are open
            opened = sum(int(c.get("db", 0)) == 2 for c in direct.client_list())
        return first, [v.allowed for v in many], opened

    first, many, opened = asyncio.run(takes())
    assert first == [True, True, False] and all(many)
    # The limiter's pool and the runtime's one connection on db 2, no more.
    assert 1 < opened <= REDIS_CONNECTIONS + 1
