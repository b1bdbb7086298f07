"""Engine and session factory for the PostgreSQL store (one engine per process and URL)."""

from __future__ import annotations

from functools import lru_cache

from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker

from worker.settings import get_settings


@lru_cache(maxsize=8)
def engine_for(url: str) -> Engine:
    # No pre-ping: it would cost a round trip per checkout on the hot path. A connection found
    # dead raises once and is replaced; the message stays where it was for a retry or repair.
    return create_engine(url, pool_size=10, max_overflow=20, pool_recycle=3600)


def get_engine() -> Engine:
    return engine_for(get_settings().database_url)


def session_factory(engine: Engine | None = None) -> sessionmaker[Session]:
    return sessionmaker(bind=engine or get_engine(), expire_on_commit=False)
