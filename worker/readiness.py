"""Readiness: can this process reach PostgreSQL, Redis and the broker now?

Each probe is a blocking call made in a thread by the face (GET /ready), which bounds its
wait; a probe that fails names its service (:class:`ServiceUnavailable`).
"""

from __future__ import annotations

from collections.abc import Callable

from redis import Redis
from sqlalchemy import Engine

from worker.core.errors import ServiceUnavailable, first_line
from worker.store.queries import sql

Probe = Callable[[], None]


def ping_postgresql(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.execute(sql("ready_ping")).scalar()


def ping_redis(client: Redis) -> None:
    client.ping()


def probe(service: str, check: Probe) -> ServiceUnavailable | None:
    """Run one probe: None when the service answered, else why not."""
    try:
        check()
    except Exception as exc:
        orig = getattr(exc, "orig", None) or exc
        return ServiceUnavailable(service, first_line(orig))
    return None
