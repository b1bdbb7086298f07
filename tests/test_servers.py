"""The throwaway servers that fault tests and the fault benchmark kill and restart."""

from __future__ import annotations

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from tooling.servers import PostgresServer, RedisServer

pytestmark = pytest.mark.e2e


def test_a_redis_server_without_persistence_forgets_on_restart(redis_server: RedisServer) -> None:
    with redis_server.client() as client:
        client.set("k", "v")
    redis_server.restart(kill=True)
    with redis_server.client() as client:
        assert client.get("k") is None


def test_a_redis_server_with_aof_keeps_what_it_acknowledged() -> None:
    with RedisServer(appendonly=True) as server:
        with server.client() as client:
            client.set("k", "v")
        port = server.port
        server.restart(kill=True)
        assert server.port == port
        with server.client() as client:
            assert client.get("k") == b"v"


def test_a_stopped_redis_server_refuses_connections(redis_server: RedisServer) -> None:
    redis_server.stop(kill=True)
    with redis_server.client() as client, pytest.raises(redis.ConnectionError):
        client.ping()


def test_a_postgres_cluster_keeps_committed_rows_across_a_crash(pg_server: PostgresServer) -> None:
    engine = create_engine(pg_server.url(), pool_pre_ping=True)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (v int)"))
        conn.execute(text("INSERT INTO t VALUES (7)"))
    pg_server.stop(mode="immediate")
    with pytest.raises(OperationalError), engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    pg_server.start()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT v FROM t")).scalar_one() == 7
    engine.dispose()
