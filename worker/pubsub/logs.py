"""The pub/sub logs as operators read them: the queue message log (a row per state a delivery
entered), the exceptions its Error rows point at (with their tracebacks) and the
published_messages rows (one per attempt), filtered by message and queue, newest first."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints
from sqlalchemy import Engine

from orderly.models import Outcome, QueueState
from orderly.worker.core import owners
from orderly.worker.core.errors import NotFound
from orderly.worker.core.inputs import parse_input
from orderly.worker.core.owners import Owns
from orderly.worker.db.queries import sql

# At most this many rows per page.
MAX_LOG_ROWS = 1000
RowId = Annotated[StrictInt, Field(ge=1, le=9_223_372_036_854_775_807)]
Text = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=255)]


class LogFilter(BaseModel):
    """Which rows: of one message (a delivery, or every delivery of an event by its
    correlation id), of one queue (a subscription, a routing key); a page of ``limit`` rows
    before the id ``before``."""

    model_config = ConfigDict(extra="forbid")

    delivery_id: RowId | None = None
    correlation_id: Text | None = None
    subscription_id: RowId | None = None
    routing_key: Text | None = None
    limit: Annotated[StrictInt, Field(ge=1, le=MAX_LOG_ROWS)] = 100
    before: RowId | None = None


class QueueLogFilter(LogFilter):
    state: Literal["Pending", "In process", "Completed", "Error"] | None = None


class ExceptionFilter(LogFilter):
    type: Text | None = None


class PublishedFilter(LogFilter):
    state: Literal["PENDING", "DELIVERED", "FAILED", "DEAD", "EXPIRED"] | None = None


def _rows(
    engine: Engine, name: str, values: dict[str, Any], owns: Owns | None
) -> list[dict[str, Any]]:
    """The rows of one log query: only those of the caller's subscriptions (``owns``:
    worker.core.owners; None: every one)."""
    params = {**values, "owned": owners.subscriptions(owns)}
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sql(name), params)]


def queue_log(engine: Engine, owns: Owns | None = None, **filters: Any) -> list[dict[str, Any]]:
    """Queue message log rows (``QueueLogFilter``'s fields), newest first."""
    asked = parse_input(QueueLogFilter, filters)
    rows = _rows(engine, "queue_log", asked.model_dump(), owns)
    return [{**r, "state": QueueState(r["state"]).value} for r in rows]


def exception_list(
    engine: Engine, owns: Owns | None = None, **filters: Any
) -> list[dict[str, Any]]:
    """Exceptions (``ExceptionFilter``'s fields) without their tracebacks, newest first."""
    asked = parse_input(ExceptionFilter, filters).model_dump()
    return _rows(engine, "exception_list", asked, owns)


def exception_get(engine: Engine, exception_id: int, owns: Owns | None = None) -> dict[str, Any]:
    """One exception with its traceback."""
    found = _rows(engine, "exception_get", {"id": exception_id}, owns)
    if not found:
        raise NotFound("exception", exception_id)
    return found[0]


def published_log(engine: Engine, owns: Owns | None = None, **filters: Any) -> list[dict[str, Any]]:
    """published_messages rows (``PublishedFilter``'s fields; ``state`` is the outcome),
    newest first."""
    asked = parse_input(PublishedFilter, filters).model_dump()
    rows = _rows(engine, "published_log", asked, owns)
    return [{**r, "outcome": Outcome(r["outcome"]).value} for r in rows]
