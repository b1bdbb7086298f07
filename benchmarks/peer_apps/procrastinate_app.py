"""procrastinate on the bench PostgreSQL: durable jobs; ``lock`` runs the jobs of one lock
one at a time in the order they were deferred (its ordering feature)."""

from __future__ import annotations

from typing import Any

import httpx
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


_http: httpx.AsyncClient | None = None


@app.task(name="deliver", queue="peers")
async def deliver(url: str, body: dict[str, Any]) -> None:
    """A conversation response POSTed to its client (benchmarks/ordered_delivery.py): deferred
    with ``lock=<conversation id>``, so a conversation's responses go one after another, in
    the order they were deferred. Over one kept-alive client per worker, as httpx advises; a
    non-2xx answer fails the job."""
    global _http
    if _http is None:
        _http = httpx.AsyncClient(timeout=5.0)
    answer = await _http.post(url, json=body, headers={"Idempotency-Key": body["response_id"]})
    answer.raise_for_status()
