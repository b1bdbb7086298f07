"""The peer systems benchmarks/peers.py runs beside orderly: plain Celery, dramatiq and
procrastinate, each configured as its own documentation advises for many short tasks, and a
minimal ASGI app (the ceiling of an HTTP intake). Only the benchmarks import them.

Each worker reports a finished task with one Redis INCR (``DONE_KEY``) or, for
procrastinate, its own job row; the benchmark subtracts that INCR from the Redis figures.
"""

import os

REDIS_URL = os.environ.get("ORDERLY_BENCH_PEERS_REDIS_URL", "redis://127.0.0.1:6379/15")
PEERS_DSN = os.environ.get(
    "ORDERLY_BENCH_PEERS_DSN", "postgresql://postgres@127.0.0.1:5432/peers_bench"
)
DONE_KEY = "peers:done"
ORDER_KEY = "peers:order:"  # + ordering key: the sequence numbers in the order they ran
