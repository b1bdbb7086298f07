"""The peer systems benchmarks/peers.py runs beside orderly: plain Celery, dramatiq and
procrastinate, each configured as its own documentation advises for many short tasks, and a
minimal ASGI app (the ceiling of an HTTP intake). Only the benchmarks import them.

Each worker reports a finished task with one Redis INCR (``DONE_KEY``) or, for
procrastinate, its own job row; the benchmark subtracts that INCR from the Redis figures. The
``stamp`` tasks of the light-load benchmark record their start latency instead
(:func:`started`, one RPUSH each, orderly's ``bench.latency`` handler alike).
"""

import os
import time

import redis

REDIS_URL = os.environ.get("ORDERLY_BENCH_PEERS_REDIS_URL", "redis://127.0.0.1:6379/15")
PEERS_DSN = os.environ.get(
    "ORDERLY_BENCH_PEERS_DSN", "postgresql://postgres@127.0.0.1:5432/peers_bench"
)
DONE_KEY = "peers:done"
ORDER_KEY = "peers:order:"  # + ordering key: the sequence numbers in the order they ran
# benchmarks/light_load.py: each task's start, ms after it was sent (one RPUSH a task).
LATENCY_KEY = "peers:latency"


def started(client: redis.Redis, sent_at: float) -> None:
    """Record how long after ``sent_at`` (epoch s, the producer's clock: the same machine)
    the task calling this started."""
    client.rpush(LATENCY_KEY, f"{(time.time() - sent_at) * 1000:.3f}")
