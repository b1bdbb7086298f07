"""The timeout monitor's turn: tracking figures in Redis, then the retry or the failure of each
timed-out message in the message store.

A message is tracked from its claim (PROCESSING) to its outcome. One that is not done within
its deadline (messageTimeout, or longer: its handler's time limit, the kill grace and a margin,
so that a handler still within its limit is never taken back; see worker.messages.processing)
is taken back from its worker (``processing_pid`` cleared, so a late outcome is
dropped as LOST_CLAIM) and retried after ``delay * multiplier^n`` (the retry policy), up to
the retry attempts; after the last it becomes FAILED with ``E_TIMEOUT``. The count of
timeouts lives on the row (``timeout_count``) and the retry-or-fail decision is part of the
take-back statement. A batch of due messages is tracked as one claim (worker.messages.batches); when
it times out, each message that claim still holds is taken back.
The store is the authority: only the claim that timed out is taken back, so a message that
reached its outcome meanwhile, or was claimed again since, is left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sqlalchemy import Engine

from orderly.worker.core.clock import now_ms
from orderly.worker.db.queries import sql
from orderly.worker.messages.batches import BATCH_KIND
from orderly.worker.messages.watchdogs import released_in
from orderly.worker.tracking import TimedOut, Tracker

log = logging.getLogger(__name__)

TIMEOUT_CODE = "E_TIMEOUT"

# Only tracked message processing is retried here, one message or a batch claim of them;
# conversation drains and event deliveries are counted, and their own leases give them back
# (worker.conversations, worker.pubsub).
RETRIED_KIND = "message"


@dataclass
class TimeoutReport:
    done: int = 0
    expired: int = 0
    timeouts: int = 0
    retried: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    # Timed out, but the store shows that claim already settled (or the message is in a plain
    # funnel): nothing to take back.
    settled: list[int] = field(default_factory=list)
    errors: int = 0


def _take_back(
    engine: Engine, tracker: Tracker, t: TimedOut, now: int
) -> tuple[str | None, int, list[int]]:
    """Take a timed-out claim back: (new state or None, timeout number, released ids). The
    retry waits on the row (its due time, set in the same statement): nothing to lose
    between the take-back and the retry."""
    msg_id = int(t.xid)
    pid, _, claimed_at = t.claim.partition(" ")
    policy = tracker.policy
    with engine.begin() as conn:
        # The funnel lock before the row lock, as everywhere (a no-op without a funnel).
        conn.execute(sql("lock_funnel_of"), {"id": msg_id})
        row = conn.execute(
            sql("timeout_take_back"),
            {
                "msg_id": msg_id,
                "pid": int(pid),
                "claimed_at": claimed_at,
                "attempts": policy.retry_attempts,
                "delays": [policy.retry.delay(n) for n in range(1, policy.retry_attempts + 1)],
                # the message's own deadline may be longer than messageTimeout (its
                # handler's time limit): say how long it really ran
                "timeout_ms": t.elapsed_ms,
            },
        ).first()
        if row is None:
            return None, 0, []
        # A retry waits on the row (its due time), taken up by the messages' due source.
        return str(row.state), int(row.timeout_count), released_in(conn)


def _claim_members(engine: Engine, claim: str) -> list[int]:
    pid, _, claimed_at = claim.partition(" ")
    with engine.connect() as conn:
        rows = conn.execute(sql("claim_members"), {"pid": int(pid), "claimed_at": claimed_at})
        return [int(row.msg_id) for row in rows]


def _retry_or_fail(
    engine: Engine,
    tracker: Tracker,
    t: TimedOut,
    now: int,
    enqueue: Callable[[int], None],
    report: TimeoutReport,
) -> None:
    msg_id = int(t.xid)
    try:
        state, _, released = _take_back(engine, tracker, t, now)
    except Exception:
        # One message's trouble must not cost the others their turn.
        log.exception("taking back timed-out message %s failed", msg_id)
        report.errors += 1
        return
    if state == "IN_QUEUE":
        report.retried.append(msg_id)
    elif state == "FAILED":
        report.failed.append(msg_id)
        for next_id in released:
            enqueue(next_id)
    else:
        report.settled.append(msg_id)


def monitor(
    engine: Engine,
    tracker: Tracker,
    enqueue: Callable[[int], None],
    now: int | None = None,
) -> TimeoutReport:
    """One turn: count done and expired ids, retry or fail timeouts. The retries themselves
    are due work (``Tracker.retries``): the ticker hands them to the broker when due."""
    now = now_ms(tracker.clock) if now is None else now
    turn = tracker.monitor_turn(now)
    report = TimeoutReport(done=turn.done, expired=turn.expired, timeouts=len(turn.timed_out))
    for t in turn.timed_out:
        if " " not in t.claim:
            continue
        if t.kind == BATCH_KIND:
            # A batch's claim: every message it still holds timed out with it.
            try:
                members = _claim_members(engine, t.claim)
            except Exception:
                log.exception("finding the messages of timed-out claim %s failed", t.xid)
                report.errors += 1
                continue
            for msg_id in members:
                _retry_or_fail(engine, tracker, replace(t, xid=str(msg_id)), now, enqueue, report)
        elif t.kind == RETRIED_KIND and t.xid.isdigit():
            _retry_or_fail(engine, tracker, t, now, enqueue, report)
    tracker.count("retry", len(report.retried))
    tracker.count("gaveup", len(report.failed))
    return report
