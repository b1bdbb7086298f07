"""The Redis clients: of a plain Redis (:func:`redis_client`, :func:`async_redis_client`),
reached directly or through its Sentinels (``redis+sentinel://``), and of the conversations'
ordering structures: that plain Redis, or a Redis Cluster (``ORDERLY_REDIS_CLUSTER``).

Both clients offer what the mechanisms use (single-key commands, registered scripts, pipelines
of single-key commands, ``scan_iter``); a script's keys are one slot by the key layout
(``orderly.models.keys``), so a script runs on the one node that holds them. What differs is here:
which server holds a key (:func:`run_ids`), and whether one command may name keys of several
slots (:func:`any_exist`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias
from urllib.parse import unquote

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from redis.cluster import ClusterNode, RedisCluster

OrderingRedis: TypeAlias = redis.Redis | RedisCluster

SENTINEL_SCHEME = "redis+sentinel://"


# How long a Sentinel may take to answer, unless the caller's own timeouts say otherwise.
SENTINEL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class SentinelUrl:
    """``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]``: the
    Sentinels to ask, the name they monitor the primary by, and the database and credentials
    of the primary (the Sentinels themselves are asked without: a password-protected
    Sentinel is not supported)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> SentinelUrl:
        """The URL's parts; ValueError naming what is wrong."""
        if not url.startswith(SENTINEL_SCHEME):
            raise ValueError(f"a Sentinel URL starts with {SENTINEL_SCHEME}")
        rest = url[len(SENTINEL_SCHEME) :]
        if any(c.isspace() or c in "?#" for c in rest):
            raise ValueError(
                "a Sentinel URL has no spaces, query or fragment (percent-encode such "
                "characters of a password: %3F for ?, %23 for #, %2F for /)"
            )
        userinfo, _, hosts_path = rest.rpartition("@")
        if "/" in userinfo:  # else the URL's path would start inside the password
            raise ValueError("percent-encode a / of a Sentinel URL's password as %2F")
        hosts, _, path = hosts_path.partition("/")
        sentinels = [_host_port(node) for node in hosts.split(",")]
        parts = path.split("/") if path else []
        digits = len(parts) == 2 and parts[1].isascii() and parts[1].isdigit()
        if not parts or not parts[0] or len(parts) > 2 or (len(parts) == 2 and not digits):
            raise ValueError(
                "a Sentinel URL names the primary's service and optionally its database after "
                "the Sentinels: redis+sentinel://host:26379,host2:26379/mymaster/0"
            )
        username = password = None
        if userinfo:
            user, colon, secret = userinfo.partition(":")
            username = unquote(user) or None
            password = unquote(secret) if colon else None
        db = int(parts[1]) if len(parts) == 2 else 0
        return cls(tuple(sentinels), unquote(parts[0]), db, username, password)

    @property
    def primary(self) -> dict[str, Any]:
        """The primary's database and login, as ``master_for`` takes them."""
        return {"db": self.db, "username": self.username, "password": self.password}


def _host_port(node: str) -> tuple[str, int]:
    """``host:port`` or ``[ipv6]:port``."""
    host, sep, port = node.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    loose = ("[" in host or "]" in host or ":" in host) and not bracketed
    if not sep or not host or loose or not (port.isascii() and port.isdigit()):
        raise ValueError(
            f"the Sentinel {node!r} is not host:port (a port 1..65535; an IPv6 address in [])"
        )
    if not 0 < int(port) < 65536:
        raise ValueError(f"the Sentinel {node!r} is not host:port (a port 1..65535)")
    return host[1:-1] if bracketed else host, int(port)


class _SentinelRedis(redis.Redis):
    """A client of a Sentinel's primary; closing it closes its Sentinels' connections too."""

    asked_through: redis.sentinel.Sentinel | None = None

    def close(self) -> None:
        super().close()
        for asked in self.asked_through.sentinels if self.asked_through is not None else ():
            asked.close()


class _AsyncSentinelRedis(redis.asyncio.Redis):
    """:class:`_SentinelRedis` for asyncio."""

    asked_through: redis.asyncio.sentinel.Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.asked_through is not None:
            await self.asked_through.aclose()


class _BlockingSentinelPool(
    redis.asyncio.sentinel.SentinelConnectionPool, redis.asyncio.BlockingConnectionPool
):
    """A Sentinel's pool of at most ``max_connections`` that waits ``timeout`` for a free one
    (as BlockingConnectionPool), not one that raises."""


def _asking(options: dict[str, Any]) -> dict[str, Any]:
    """What a Sentinel is asked with: the caller's timeouts, else SENTINEL_TIMEOUT_S."""
    return {
        "socket_connect_timeout": options.get("socket_connect_timeout") or SENTINEL_TIMEOUT_S,
        "socket_timeout": options.get("socket_timeout") or SENTINEL_TIMEOUT_S,
    }


def redis_client(url: str, **options: Any) -> redis.Redis:
    """A client of the plain Redis at ``url`` (``redis://``, ``rediss://``, ``unix://``); of
    a ``redis+sentinel://`` URL, of the primary its Sentinels name, asked again when a
    connection finds the primary demoted (a write refused READONLY, a lost connection).
    ``options`` as for ``redis.Redis``."""
    if not url.startswith(SENTINEL_SCHEME):
        return redis.Redis.from_url(url, **options)
    found = SentinelUrl.parse(url)
    sentinel = redis.sentinel.Sentinel(list(found.sentinels), sentinel_kwargs=_asking(options))
    client: _SentinelRedis = sentinel.master_for(
        found.service, redis_class=_SentinelRedis, **found.primary, **options
    )
    client.asked_through = sentinel
    return client


def async_redis_client(
    url: str, *, max_connections: int | None = None, wait_s: float = 20.0, **options: Any
) -> redis.asyncio.Redis:
    """:func:`redis_client` for asyncio. With ``max_connections``, at most that many, and a
    command waits up to ``wait_s`` for a free one."""
    blocking = {"max_connections": max_connections, "timeout": wait_s} if max_connections else {}
    if not url.startswith(SENTINEL_SCHEME):
        if not blocking:
            return redis.asyncio.Redis.from_url(url, **options)
        pool = redis.asyncio.BlockingConnectionPool.from_url(url, **blocking, **options)
        return redis.asyncio.Redis(connection_pool=pool)
    found = SentinelUrl.parse(url)
    sentinel = redis.asyncio.sentinel.Sentinel(
        list(found.sentinels), sentinel_kwargs=_asking(options)
    )
    pool_class = (
        _BlockingSentinelPool if blocking else redis.asyncio.sentinel.SentinelConnectionPool
    )
    client: _AsyncSentinelRedis = sentinel.master_for(
        found.service,
        redis_class=_AsyncSentinelRedis,
        connection_pool_class=pool_class,
        **found.primary,
        **blocking,
        **options,
    )
    client.asked_through = sentinel
    return client


def ordering_client(
    url: str, cluster_nodes: Sequence[tuple[str, int]] = (), connect_timeout_s: float = 5
) -> OrderingRedis:
    """A RedisCluster client on ``cluster_nodes`` when there are any, else a plain client of
    ``url``."""
    if cluster_nodes:
        return RedisCluster(
            startup_nodes=[
                ClusterNode(host, port)  # type: ignore[no-untyped-call]
                for host, port in cluster_nodes
            ],
            socket_connect_timeout=connect_timeout_s,
        )
    return redis_client(url, socket_connect_timeout=connect_timeout_s)


def run_ids(client: OrderingRedis, keys: Sequence[str]) -> list[str]:
    """The ``run_id`` of the server holding each key (INFO once per server): a key's server
    restarted when the id it recorded differs."""
    if not isinstance(client, RedisCluster):
        run_id = str(client.info("server")["run_id"])
        return [run_id] * len(keys)
    by_node: dict[str, str] = {}
    found = []
    for key in keys:
        node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        if node.name not in by_node:
            by_node[node.name] = str(client.info("server", target_nodes=node)["run_id"])
        found.append(by_node[node.name])
    return found


def any_exist(client: OrderingRedis, keys: Sequence[str]) -> bool | None:
    """Whether any of ``keys`` exists, in one command (an empty set or hash does not exist):
    what an idle agent asks before it walks every shard. None on a Redis Cluster, where one
    command names keys of one slot only: the caller walks the shards."""
    if isinstance(client, RedisCluster):
        return None
    return bool(client.exists(*keys))
