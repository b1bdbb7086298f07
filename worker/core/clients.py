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
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from redis.cluster import ClusterNode, RedisCluster

OrderingRedis: TypeAlias = redis.Redis | RedisCluster

SENTINEL_SCHEME = "redis+sentinel://"


@dataclass(frozen=True)
class SentinelUrl:
    """``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]``: the
    Sentinels to ask, the name they monitor the primary by, and the database and credentials
    of the primary (the Sentinels themselves are asked without)."""

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
        userinfo, _, hosts_path = rest.rpartition("@")
        hosts, _, path = hosts_path.partition("/")
        sentinels = []
        for node in (h.strip() for h in hosts.split(",")):
            host, sep, port = node.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"the Sentinel {node!r} is not host:port (a port 1..65535)")
            sentinels.append((host.strip("[]"), int(port)))
        parts = [p for p in path.split("/") if p]
        if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise ValueError(
                "a Sentinel URL names the primary's service and optionally its database after "
                "the Sentinels: redis+sentinel://host:26379,host2:26379/mymaster/0"
            )
        username = password = None
        if userinfo:
            split = urlsplit(f"redis://{userinfo}@x")
            username = unquote(split.username) if split.username else None
            password = unquote(split.password) if split.password is not None else None
        db = int(parts[1]) if len(parts) == 2 else 0
        return cls(tuple(sentinels), unquote(parts[0]), db, username, password)


def redis_client(url: str, **options: Any) -> redis.Redis:
    """A client of the plain Redis at ``url`` (``redis://``, ``rediss://``, ``unix://``); of
    a ``redis+sentinel://`` URL, of the primary its Sentinels name, asked again on a failover
    (a connection to a demoted primary is dropped). ``options`` as for ``redis.Redis``."""
    if not url.startswith(SENTINEL_SCHEME):
        return redis.Redis.from_url(url, **options)
    found = SentinelUrl.parse(url)
    asking = {k: v for k, v in options.items() if k in _SENTINEL_OPTIONS}
    sentinel = redis.sentinel.Sentinel(list(found.sentinels), sentinel_kwargs=asking)
    client: redis.Redis = sentinel.master_for(
        found.service, db=found.db, username=found.username, password=found.password, **options
    )
    return client


def async_redis_client(url: str, **options: Any) -> redis.asyncio.Redis:
    """:func:`redis_client` for asyncio."""
    if not url.startswith(SENTINEL_SCHEME):
        return redis.asyncio.Redis.from_url(url, **options)
    found = SentinelUrl.parse(url)
    asking = {k: v for k, v in options.items() if k in _SENTINEL_OPTIONS}
    sentinel = redis.asyncio.sentinel.Sentinel(list(found.sentinels), sentinel_kwargs=asking)
    client: redis.asyncio.Redis = sentinel.master_for(
        found.service, db=found.db, username=found.username, password=found.password, **options
    )
    return client


# What a Sentinel is asked with too (a slow Sentinel is as slow as a slow Redis).
_SENTINEL_OPTIONS = ("socket_connect_timeout", "socket_timeout")


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
