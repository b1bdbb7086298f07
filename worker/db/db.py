"""Engine and session factory for the PostgreSQL store (one engine per process and URL)."""

from __future__ import annotations

import select
from functools import lru_cache
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

from orderly.worker.settings import get_settings

# SQLSTATEs of a lost server: connection exceptions (class 08) and the server shutting down,
# crashed or starting (57P01-57P03). A connection-level failure has no SQLSTATE at all.
_PG_GONE = ("08", "57P01", "57P02", "57P03")


def connection_lost(exc: BaseException) -> bool:
    """Does this driver error mean PostgreSQL cannot be reached (not a deadlock, a timeout or a
    constraint: those are errors of the statement)?"""
    import psycopg2  # type: ignore[import-untyped]
    import sqlalchemy.exc

    orig = getattr(exc, "orig", None) or exc
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(orig, psycopg2.InterfaceError):
        return True
    code = getattr(orig, "pgcode", None)
    return isinstance(orig, psycopg2.OperationalError) and (
        code is None or str(code).startswith(_PG_GONE)
    )


def server_left(dbapi_connection: Any) -> bool:
    """Whether the server closed this idle connection (a restart, a crash, a terminated
    backend), seen without a round trip: an idle connection has nothing to read, while one the
    server left reads its goodbye or end of file."""
    if dbapi_connection.closed:
        return True
    poller = select.poll()
    poller.register(dbapi_connection.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


def _check_out(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    # The pool replaces a connection that raises DisconnectionError here, so the first query
    # after a PostgreSQL restart runs on a fresh connection.
    if server_left(dbapi_connection):
        raise DisconnectionError("the server closed this pooled connection")


@lru_cache(maxsize=8)
def engine_for(
    url: str, connect_timeout_s: int | None = None, pool_size: int = 10, max_overflow: int = 20
) -> Engine:
    # Instead of pre-ping (a round trip per checkout on the hot path), every checkout looks at
    # the socket (_check_out). A connection that dies while checked out raises once and is
    # dropped (worker.db.prepared; SQLAlchemy for its own statements). A server that does
    # not answer makes a new connection fail after connect_timeout_s (libpq: at least 2 s).
    args = {} if connect_timeout_s is None else {"connect_timeout": connect_timeout_s}
    engine = create_engine(
        url,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_recycle=3600,
        connect_args=args,
    )
    event.listen(engine, "checkout", _check_out)
    return engine


def get_engine() -> Engine:
    settings = get_settings()
    return engine_for(
        settings.database_url,
        settings.connect_timeout_s,
        settings.database_pool_size,
        settings.database_max_overflow,
    )


def session_factory(engine: Engine | None = None) -> sessionmaker[Session]:
    return sessionmaker(bind=engine or get_engine(), expire_on_commit=False)
