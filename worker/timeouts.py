"""The timeout monitor's turn: tracking figures in Redis, then the retry or the failure of each
timed-out message in the message store, then the retries that are due.

A message is tracked from its claim (PROCESSING) to its outcome. One that is not done within
messageTimeout is taken back from its worker (``processing_pid`` cleared, so a late outcome is
dropped as LOST_CLAIM) and retried after ``delay * multiplier^(attempt-1)``, up to the retry
attempts; after the last it becomes FAILED with ``E_TIMEOUT``. The store's transition is the
authority: a message that reached its outcome meanwhile is left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Engine, text

from worker.pool import released_in
from worker.tracking import Tracker, now_ms

log = logging.getLogger(__name__)

TIMEOUT_CODE = "E_TIMEOUT"

# Only tracked message processing is retried here; conversation drains and event deliveries
# are counted, and their own leases give them back (worker.conversations, worker.pubsub).
RETRIED_KIND = "message"

_TAKE_BACK = text(
    f"""
    UPDATE message m
       SET state = :state, failed_count = m.failed_count + 1,
           failed_error_code = '{TIMEOUT_CODE}', failed_desc = :desc,
           processing_pid = NULL, last_process_timestamp = now()
     WHERE m.msg_id = :msg_id AND m.state = 'PROCESSING'
    RETURNING m.msg_id
    """
)


@dataclass
class TimeoutReport:
    done: int = 0
    expired: int = 0
    timeouts: int = 0
    retried: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    # Timed out, but the store shows the message already past PROCESSING: nothing to do.
    settled: list[int] = field(default_factory=list)
    requeued: list[int] = field(default_factory=list)

    @property
    def busy(self) -> bool:
        return bool(self.timeouts or self.expired or self.requeued)


def _take_back(engine: Engine, msg_id: int, state: str, desc: str) -> tuple[bool, list[int]]:
    """Move a PROCESSING message to ``state``; what its funnel released (for FAILED)."""
    with engine.begin() as conn:
        # The funnel lock before the row lock, as everywhere (a no-op without a funnel).
        conn.execute(text("SELECT orderly_lock_funnel_of(:id)"), {"id": msg_id})
        row = conn.execute(_TAKE_BACK, {"msg_id": msg_id, "state": state, "desc": desc}).first()
        released = released_in(conn) if row is not None else []
    return row is not None, released


def monitor(
    engine: Engine,
    tracker: Tracker,
    enqueue: Callable[[int], None],
    now: int | None = None,
) -> TimeoutReport:
    """One turn: count done and expired ids, retry or fail timeouts, enqueue due retries."""
    policy = tracker.policy
    now = now_ms() if now is None else now
    turn = tracker.monitor_turn(now)
    report = TimeoutReport(done=turn.done, expired=turn.expired, timeouts=len(turn.timed_out))
    for t in turn.timed_out:
        if t.kind != RETRIED_KIND or not t.xid.isdigit():
            continue
        msg_id = int(t.xid)
        what = f"no worker finished it within {policy.timeout_ms} ms (timeout {t.attempt}"
        if t.attempt <= policy.retry_attempts:
            desc = f"{what} of {policy.retry_attempts + 1}); retried"
            taken, _ = _take_back(engine, msg_id, "IN_QUEUE", desc)
            if taken:
                tracker.schedule_retry(t.xid, t.attempt, now)
                report.retried.append(msg_id)
            else:
                report.settled.append(msg_id)
            continue
        desc = f"{what} of {policy.retry_attempts + 1}); no retries left"
        taken, released = _take_back(engine, msg_id, "FAILED", desc)
        tracker.gave_up(t.xid)
        if taken:
            report.failed.append(msg_id)
            for next_id in released:
                enqueue(next_id)
        else:
            report.settled.append(msg_id)
    for xid in tracker.due_retries(now):
        if xid.isdigit():
            enqueue(int(xid))
            report.requeued.append(int(xid))
    return report
