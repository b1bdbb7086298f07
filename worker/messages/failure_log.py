"""The log line of a handler's failed try (worker.messages.processing): WARNING while it is
tried again, ERROR with the traceback when it failed for good; the message's ids are bound to
it by the caller (worker.core.logs)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from orderly.worker.core import logs
from orderly.worker.messages.handlers import MessageContext

log = logging.getLogger("orderly.worker.messages.processing")


def log_failure(
    ctx: MessageContext,
    outcome: str,
    code: str,
    desc: str,
    attempt: int,
    due_ms: int,
    error: BaseException | None,
) -> None:
    """One line per failed try, with the message's ids as fields: WARNING while it will be
    tried again (with the next due time), ERROR with the traceback when it failed for good."""
    first = desc.splitlines()[0] if desc else ""
    if outcome == "PARTLY_FAILED":
        due = datetime.now(UTC) + timedelta(milliseconds=due_ms)
        with logs.bound(error_code=code, attempt=attempt, next_due_at=due.isoformat()):
            log.warning(
                "message %s (%s.%s) failed, try %d: %s: %s; tried again at %s",
                ctx.msg_id,
                ctx.service,
                ctx.operation,
                attempt,
                code,
                first,
                due.isoformat(timespec="seconds"),
            )
    elif outcome == "FAILED":
        with logs.bound(error_code=code, attempt=attempt):
            log.error(
                "message %s (%s.%s) FAILED after try %d: %s: %s",
                ctx.msg_id,
                ctx.service,
                ctx.operation,
                attempt,
                code,
                first,
                exc_info=(type(error), error, error.__traceback__) if error is not None else None,
            )
