"""Plain Celery at its best for no-op tasks on Redis (Celery's optimizing guide): results
ignored, no events, acknowledged on receipt (the default), a deep prefetch so a worker is
never idle between tasks, and the producer sending over one connection."""

from __future__ import annotations

import redis
from celery import Celery

from benchmarks.peer_apps import DONE_KEY, REDIS_URL, started

app = Celery("peers", broker=REDIS_URL)
app.conf.update(
    task_ignore_result=True,
    task_acks_late=False,
    worker_prefetch_multiplier=256,
    worker_send_task_events=False,
    task_send_sent_event=False,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
QUEUE = "peers.celery"
app.conf.task_default_queue = QUEUE

_done: redis.Redis | None = None


@app.task(name="peers.noop")  # type: ignore[untyped-decorator]
def noop(n: int) -> None:
    """Nothing, then counted done (one INCR)."""
    global _done
    if _done is None:
        _done = redis.Redis.from_url(REDIS_URL)
    _done.incr(DONE_KEY)


@app.task(name="peers.stamp")  # type: ignore[untyped-decorator]
def stamp(sent_at: float) -> None:
    """Its start latency recorded (benchmarks/light_load.py)."""
    global _done
    if _done is None:
        _done = redis.Redis.from_url(REDIS_URL)
    started(_done, sent_at)


def send_stamp(sent_at: float) -> None:
    stamp.apply_async((sent_at,))


def send(first: int, count: int) -> None:
    """``count`` tasks over one producer connection."""
    with app.producer_or_acquire() as producer:
        for n in range(first, first + count):
            noop.apply_async((n,), producer=producer)
