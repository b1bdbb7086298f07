"""The re-processing pool and repair: the periodic work beat triggers.

Pool: PARTLY_FAILED messages idle for partlyFailedIntervalSec and POSTPONED ones idle for
postponedIntervalSec go back to IN_QUEUE (oldest msg_timestamp first) and are enqueued.
Repair: NEW/IN_QUEUE/PROCESSING messages idle longer than repairRepeatTimeSec, and PROCESSING
messages whose worker connection is gone, become PARTLY_FAILED (FAILED at the limit);
external calls stuck in PROCESSING become FAILED. Rows are taken with SKIP LOCKED, so two
beat agents (or an agent and a worker) never act on the same row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine, text

from worker.configuration import ConfigReader
from worker.processing import ORPHANED

_REQUEUE = text(
    """
    UPDATE message m
       SET state = 'IN_QUEUE', start_in_queue_timestamp = now(), last_process_timestamp = now()
     WHERE m.msg_id IN (
           SELECT msg_id FROM message
            -- conversation messages are delivered by the ordering gate, not by handlers
            WHERE service_name <> 'conversation'
              AND ((state = 'PARTLY_FAILED'
                   AND last_process_timestamp <= now() - make_interval(secs => :partly_s))
               OR (state = 'POSTPONED'
                   AND last_process_timestamp <= now() - make_interval(secs => :postponed_s)))
            ORDER BY msg_timestamp
            LIMIT :batch
            FOR UPDATE SKIP LOCKED)
    RETURNING m.msg_id, m.msg_timestamp
    """
)

REPAIR_CODE = "E_REPAIR"

_REPAIR_MESSAGES = text(
    f"""
    UPDATE message m
       SET state = CASE WHEN m.failed_count >= :limit THEN 'FAILED' ELSE 'PARTLY_FAILED' END,
           failed_count = m.failed_count + 1,
           failed_error_code = '{REPAIR_CODE}',
           failed_desc = CASE
               WHEN m.state = 'PROCESSING' AND {ORPHANED}
                 THEN 'worker connection lost while PROCESSING'
               ELSE 'stuck in ' || m.state || ' since ' || m.last_process_timestamp::text END,
           last_process_timestamp = now(), processing_pid = NULL
     WHERE m.msg_id IN (
           SELECT msg_id FROM message m
            WHERE m.service_name <> 'conversation'
              AND ((m.state IN ('NEW', 'IN_QUEUE', 'PROCESSING')
                   AND m.last_process_timestamp <= now() - make_interval(secs => :stuck_s))
               OR (m.state = 'PROCESSING'
                   AND m.last_process_timestamp <= now() - make_interval(secs => :grace_s)
                   AND {ORPHANED}))
            LIMIT :batch
            FOR UPDATE SKIP LOCKED)
    RETURNING m.msg_id, m.state
    """
)

_REPAIR_CALLS = text(
    """
    UPDATE external_call
       SET state = 'FAILED', failed_count = failed_count + 1, last_update_timestamp = now()
     WHERE call_id IN (
           SELECT call_id FROM external_call
            WHERE state = 'PROCESSING'
              AND last_update_timestamp <= now() - make_interval(secs => :stuck_s)
            LIMIT :batch
            FOR UPDATE SKIP LOCKED)
    RETURNING call_id
    """
)

# A claim commits its backend pid atomically, so an orphan is certain once pg_stat_activity
# no longer shows the pid; the grace only covers a backend that connected in the same instant.
ORPHAN_GRACE_S = 1.0
MAX_BATCHES = 100


@dataclass(frozen=True)
class RepairReport:
    messages: int
    failed: int
    external_calls: int


def requeue_due(engine: Engine, config: ConfigReader, enqueue: Callable[[int], None]) -> list[int]:
    """Move due PARTLY_FAILED/POSTPONED messages to IN_QUEUE and enqueue them, oldest first."""
    params = {
        "partly_s": config.get_int("asynch.partlyFailedIntervalSec"),
        "postponed_s": config.get_int("asynch.postponedIntervalSec"),
        "batch": config.get_int("asynch.pool.batchSize"),
    }
    moved: list[int] = []
    for _ in range(MAX_BATCHES):
        with engine.begin() as conn:
            rows = conn.execute(_REQUEUE, params).all()
        # Enqueue after commit; a message whose enqueue fails stays IN_QUEUE for repair.
        for row in sorted(rows, key=lambda r: r.msg_timestamp):
            enqueue(row.msg_id)
            moved.append(row.msg_id)
        if len(rows) < params["batch"]:
            break
    return moved


def repair(engine: Engine, config: ConfigReader) -> RepairReport:
    stuck_s = config.get_int("asynch.repairRepeatTimeSec")
    batch = config.get_int("asynch.pool.batchSize")
    limit = config.get_int("asynch.countPartlyFailsBeforeFailed")
    messages = failed = calls = 0
    for _ in range(MAX_BATCHES):
        with engine.begin() as conn:
            rows = conn.execute(
                _REPAIR_MESSAGES,
                {"stuck_s": stuck_s, "grace_s": ORPHAN_GRACE_S, "batch": batch, "limit": limit},
            ).all()
        messages += len(rows)
        failed += sum(1 for r in rows if r.state == "FAILED")
        if len(rows) < batch:
            break
    for _ in range(MAX_BATCHES):
        with engine.begin() as conn:
            n = len(conn.execute(_REPAIR_CALLS, {"stuck_s": stuck_s, "batch": batch}).all())
        calls += n
        if n < batch:
            break
    return RepairReport(messages=messages, failed=failed, external_calls=calls)
