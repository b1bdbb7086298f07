"""dramatiq with its Redis broker, default middleware and settings (its documentation's own
advice): ``dramatiq benchmarks.peer_apps.dramatiq_app --processes 2`` (8 threads each)."""

from __future__ import annotations

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker

from benchmarks.peer_apps import DONE_KEY, REDIS_URL, started

broker = RedisBroker(url=REDIS_URL)  # type: ignore[no-untyped-call]
dramatiq.set_broker(broker)
_done = redis.Redis.from_url(REDIS_URL)


@dramatiq.actor(queue_name="peers")
def noop(n: int) -> None:
    """Nothing, then counted done (one INCR)."""
    _done.incr(DONE_KEY)


@dramatiq.actor(queue_name="peers")
def stamp(sent_at: float) -> None:
    """Its start latency recorded (benchmarks/light_load.py)."""
    started(_done, sent_at)


def send_stamp(sent_at: float) -> None:
    stamp.send(sent_at)


def send(first: int, count: int) -> None:
    for n in range(first, first + count):
        noop.send(n)
