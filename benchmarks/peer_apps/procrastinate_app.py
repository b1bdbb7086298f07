"""procrastinate on the bench PostgreSQL: durable jobs; ``lock`` runs the jobs of one lock
one at a time in the order they were deferred (its ordering feature)."""

from __future__ import annotations

import procrastinate
import redis

from benchmarks.peer_apps import ORDER_KEY, PEERS_DSN, REDIS_URL, started

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=PEERS_DSN))
_order: redis.Redis | None = None


@app.task(name="noop", queue="peers")
async def noop(n: int) -> None:
    """Nothing: done is the job's own row."""


@app.task(name="ordered", queue="peers")
async def ordered(key: str, n: int) -> None:
    """Records that it ran (the order check), nothing else."""
    _client().rpush(ORDER_KEY + key, n)


def _client() -> redis.Redis:
    global _order
    if _order is None:
        _order = redis.Redis.from_url(REDIS_URL)
    return _order


@app.task(name="stamp", queue="peers")
async def stamp(sent_at: float) -> None:
    """Its start latency recorded (benchmarks/light_load.py)."""
    started(_client(), sent_at)


@app.task(name="stamp_ordered", queue="peers")
async def stamp_ordered(key: str, n: int, sent_at: float) -> None:
    """Its start latency recorded, and that it ran (the order check)."""
    started(_client(), sent_at)
    _client().rpush(ORDER_KEY + key, n)
