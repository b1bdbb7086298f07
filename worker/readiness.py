"""Readiness: can this process reach PostgreSQL, Redis and the broker now?

Each probe is a blocking call made in a thread by the face (GET /ready), which bounds its
wait; a probe that fails names its service (:class:`ServiceUnavailable`).
"""

from __future__ import annotations

from collections.abc import Callable

from redis import Redis
from redis.cluster import RedisCluster
from sqlalchemy import Engine

from orderly.worker.core.clients import OrderingRedis
from orderly.worker.core.errors import ServiceUnavailable, first_line
from orderly.worker.db.queries import sql

Probe = Callable[[], None]


def ping_postgresql(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.execute(sql("ready_ping")).scalar()


def ping_redis(client: Redis) -> None:
    client.ping()


def ping_redis_cluster(client: Callable[[], OrderingRedis]) -> None:
    """Every primary of the cluster answers (the client is made here: making it asks the
    cluster for its slots, which fails as the cluster does)."""
    cluster = client()
    if isinstance(cluster, RedisCluster):
        cluster.ping(target_nodes=RedisCluster.PRIMARIES)
    else:
        cluster.ping()


def probe(service: str, check: Probe) -> ServiceUnavailable | None:
    """Run one probe: None when the service answered, else why not."""
    try:
        check()
    except Exception as exc:
        orig = getattr(exc, "orig", None) or exc
        return ServiceUnavailable(service, first_line(orig))
    return None
