"""The Redis client of the conversations' ordering structures: a plain Redis, or a Redis
Cluster (``ORDERLY_REDIS_CLUSTER``).

Both clients offer what the mechanisms use (single-key commands, registered scripts, pipelines
of single-key commands, ``scan_iter``); a script's keys are one slot by the key layout
(``orderly.models.keys``), so a script runs on the one node that holds them. What differs is here:
which server holds a key (:func:`run_ids`), and whether one command may name keys of several
slots (:func:`any_exist`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import redis
from redis.cluster import ClusterNode, RedisCluster

OrderingRedis: TypeAlias = redis.Redis | RedisCluster


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
    return redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s)


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
