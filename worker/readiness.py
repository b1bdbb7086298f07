"""Readiness: can this process reach PostgreSQL, Redis and the broker now, does its Redis
keep orderly's keys (no eviction), and does it reach PostgreSQL itself (no pooler between)?

Each probe is a blocking call made in a thread by the face (GET /ready), which bounds its
wait; a probe that fails names its service (:class:`ServiceUnavailable`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import redis.exceptions
from redis import Redis
from redis.cluster import RedisCluster
from redis.sentinel import SentinelConnectionPool
from sqlalchemy import Engine

from orderly.worker.core.clients import OrderingRedis
from orderly.worker.core.errors import ServiceUnavailable, first_line
from orderly.worker.db.queries import sql

log = logging.getLogger(__name__)

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


def evicting(client: OrderingRedis) -> list[str]:
    """The servers of ``client`` (each primary of a cluster) that may evict keys: a maxmemory
    with a policy other than noeviction, each as 'host:port: policy with maxmemory N'. Read
    from INFO (managed services often disable CONFIG)."""
    if isinstance(client, RedisCluster):
        found = client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        servers = found if _per_node(found) else {"cluster": found}
    else:
        pool = client.connection_pool
        if isinstance(pool, SentinelConnectionPool):  # the primary its Sentinels name now
            host, port = pool.get_master_address()  # type: ignore[no-untyped-call]
        else:
            host, port = (
                pool.connection_kwargs.get("host", "?"),
                pool.connection_kwargs.get("port", "?"),
            )
        servers = {f"{host}:{port}": client.info("memory")}
    return [
        f"{name}: maxmemory-policy {info.get('maxmemory_policy')} with maxmemory "
        f"{info.get('maxmemory')} bytes"
        for name, info in servers.items()
        if int(info.get("maxmemory") or 0) > 0 and info.get("maxmemory_policy") != "noeviction"
    ]


def _per_node(found: Any) -> bool:
    return isinstance(found, dict) and all(isinstance(v, dict) for v in found.values())


def keeps_keys(
    clients: Sequence[OrderingRedis], allowed: bool, *, unreachable_ok: bool = False
) -> None:
    """Refuse (RedisMayEvict) a Redis that may evict orderly's keys unless ``allowed``
    (ORDERLY_REDIS_EVICTION_ALLOWED); allowed, it is logged. ``unreachable_ok``: a Redis that
    does not answer is passed over (another probe names it)."""
    found: set[str] = set()
    for client in clients:
        try:
            found.update(evicting(client))
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            if not unreachable_ok:
                raise
    if not found:
        return
    found_sorted = sorted(found)
    if not allowed:
        raise RedisMayEvict(found_sorted)
    log.warning(
        "Redis may evict orderly's keys (%s): ORDERLY_REDIS_EVICTION_ALLOWED is set; beat's "
        "sweep rebuilds conversations whose keys are gone",
        "; ".join(found_sorted),
    )


class RedisMayEvict(RuntimeError):
    """A Redis may evict orderly's keys and the operator did not allow it."""

    def __init__(self, servers: list[str]) -> None:
        super().__init__(
            f"Redis may evict orderly's keys ({'; '.join(servers)}): every conversation key "
            "has a TTL, so volatile-* policies evict them too, and a conversation whose keys "
            "are gone stalls until beat's sweep rebuilds it. Set maxmemory-policy noeviction, "
            "or ORDERLY_REDIS_EVICTION_ALLOWED=true to run anyway"
        )


def pooled(engine: Engine) -> str | None:
    """How a connection of ``engine`` shows a connection pooler between orderly and
    PostgreSQL, or None (it reaches the server itself). PostgreSQL gives a client its backend's
    pid at connect; a pooler (PgBouncer, Pgpool-II, ...) gives its client a key of its own and
    runs the client's queries on server connections it chooses."""
    with engine.connect() as conn:
        dbapi: Any = conn.connection.dbapi_connection
        given = int(dbapi.get_backend_pid())
        serving = int(conn.execute(sql("backend_pid")).scalar_one())
    if given == serving:
        return None
    return f"the connection was given backend pid {given}; its queries ran in backend {serving}"


def direct_postgresql(engine: Engine) -> None:
    """Refuse (PostgreSQLPooled) a database URL that reaches PostgreSQL through a pooler."""
    why = pooled(engine)
    if why is not None:
        raise PostgreSQLPooled(why)


class PostgreSQLPooled(RuntimeError):
    """ORDERLY_DATABASE_URL reaches PostgreSQL through a connection pooler."""

    def __init__(self, why: str) -> None:
        super().__init__(
            f"ORDERLY_DATABASE_URL reaches PostgreSQL through a connection pooler ({why}). "
            "orderly needs its own server connections: a claim is held by the backend that "
            "made it (a worker's death is seen when that backend ends), the rebuild takes a "
            "session advisory lock, and the hot path prepares its statements once per "
            "connection. Transaction pooling breaks all three and session pooling the first "
            "(a pooled backend outlives the worker that claimed). Point ORDERLY_DATABASE_URL "
            "at PostgreSQL itself; docs/how-to/scale-out.md gives the connections each process "
            "holds"
        )


def probe(service: str, check: Probe) -> ServiceUnavailable | None:
    """Run one probe: None when the service answered, else why not."""
    try:
        check()
    except Exception as exc:
        orig = getattr(exc, "orig", None) or exc
        return ServiceUnavailable(service, first_line(orig))
    return None
