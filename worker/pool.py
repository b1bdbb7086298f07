"""The re-processing pool and repair: the periodic work beat triggers.

Pool: PARTLY_FAILED messages idle for partlyFailedIntervalSec and POSTPONED ones idle for
postponedIntervalSec go back to IN_QUEUE (oldest msg_timestamp first) and are enqueued; a
POSTPONED message only once its funnel lets it go (its release normally comes at once, when
the message ahead of it ends: the pool is the safety net). A guaranteed-order message held
back by a FAILED one longer than postponedIntervalWhenFailedSec becomes FAILED; a message
whose wait for an external response ran out becomes FAILED.
Repair: NEW/IN_QUEUE/PROCESSING messages idle longer than repairRepeatTimeSec, and PROCESSING
messages whose worker connection is gone, become PARTLY_FAILED (FAILED at the limit);
external calls stuck in PROCESSING become FAILED; WAITING parents whose children all ended
are settled. Rows are taken with SKIP LOCKED, so two beat agents (or an agent and a worker)
never act on the same row. What a transition releases in a funnel is enqueued after commit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, text

from worker.configuration import ConfigReader
from worker.processing import ORPHANED, parse_ids

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
                   AND last_process_timestamp <= now() - make_interval(secs => :postponed_s)
                   AND NOT (funnel_value IS NOT NULL
                            AND orderly_funnel_blocked(msg_id, funnel_value,
                                                       funnel_component_id, msg_timestamp,
                                                       guaranteed_order, exclude_failed_state))))
            ORDER BY msg_timestamp
            LIMIT :batch
            FOR UPDATE SKIP LOCKED)
    RETURNING m.msg_id, m.msg_timestamp
    """
)

REPAIR_CODE = "E_REPAIR"

# Batched transitions lock rows, and the state trigger then takes funnel locks: a funnel's
# lock comes first everywhere else, so here a row whose funnel is busy is left for next time.
_FUNNEL_FIRST = (
    "({m}.funnel_value IS NULL OR pg_try_advisory_xact_lock("
    "orderly_funnel_key({m}.funnel_value, {m}.funnel_component_id)))"
)

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
              AND {_FUNNEL_FIRST.format(m="m")}
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
              -- confirmations have their own lease (worker.confirmations)
              AND operation_name <> 'orderly.confirmation'
              AND last_update_timestamp <= now() - make_interval(secs => :stuck_s)
            LIMIT :batch
            FOR UPDATE SKIP LOCKED)
    RETURNING call_id
    """
)

POSTPONED_CODE = "E_POSTPONED_TOO_LONG"

# Guaranteed order halts behind a FAILED message (unless exclude_failed_state): the messages
# it holds back fail once both have stood still for postponedIntervalWhenFailedSec.
_FAIL_POSTPONED = text(
    f"""
    UPDATE message m
       SET state = 'FAILED', failed_count = m.failed_count + 1,
           failed_error_code = '{POSTPONED_CODE}',
           failed_desc = format('postponed for over %s s behind FAILED message %s of funnel %s',
                                :failed_s, b.blocker, m.funnel_value),
           last_process_timestamp = now()
      FROM (SELECT c.msg_id,
                   (SELECT o.msg_id FROM message o
                     WHERE o.funnel_value = c.funnel_value
                       AND o.state NOT IN ('OK', 'CANCEL')
                       AND o.funnel_component_id IS NOT DISTINCT FROM c.funnel_component_id
                       AND o.state = 'FAILED' AND o.guaranteed_order
                       AND (o.msg_timestamp, o.msg_id) < (c.msg_timestamp, c.msg_id)
                       AND o.last_process_timestamp <= now() - make_interval(secs => :failed_s)
                     ORDER BY o.msg_timestamp, o.msg_id LIMIT 1) AS blocker
              FROM message c
             WHERE c.state = 'POSTPONED' AND c.guaranteed_order AND NOT c.exclude_failed_state
               AND c.last_process_timestamp <= now() - make_interval(secs => :failed_s)
               AND {_FUNNEL_FIRST.format(m="c")}
             ORDER BY c.msg_timestamp
             LIMIT :batch
             FOR UPDATE OF c SKIP LOCKED) b
     WHERE m.msg_id = b.msg_id AND b.blocker IS NOT NULL
    RETURNING m.msg_id
    """
)

TIMEOUT_CODE = "E_RESPONSE_TIMEOUT"

_RESPONSE_TIMEOUTS = text(
    f"""
    UPDATE message m
       SET state = 'FAILED', failed_count = m.failed_count + 1,
           failed_error_code = '{TIMEOUT_CODE}',
           failed_desc = format('no response for correlation id %s by %s',
                                m.wait_correlation_id, m.response_deadline),
           last_process_timestamp = now()
     WHERE m.msg_id IN (
           SELECT msg_id FROM message
            WHERE state = 'WAITING_FOR_RES' AND response_deadline <= now()
              AND service_name <> 'conversation'
              AND {_FUNNEL_FIRST.format(m="message")}
            ORDER BY response_deadline
            LIMIT :batch
            FOR UPDATE SKIP LOCKED)
    RETURNING m.msg_id
    """
)

# A parent is settled when its last child ends; this catches one whose settling was lost.
_SETTLE_PARENTS = text(
    """
    SELECT p.msg_id, orderly_parent_check(p.msg_id) AS state
      FROM message p
     WHERE p.state = 'WAITING' AND p.service_name <> 'conversation'
       AND p.last_process_timestamp <= now() - make_interval(secs => :stuck_s)
       AND NOT EXISTS (SELECT 1 FROM message c
                        WHERE c.parent_msg_id = p.msg_id AND c.parent_binding_type = 'HARD'
                          AND c.state NOT IN ('OK', 'FAILED', 'CANCEL'))
     LIMIT :batch
    """
)


def released_in(conn: Connection) -> list[int]:
    """The funnel messages the current transaction released (enqueue them after commit)."""
    value = conn.execute(text("SELECT current_setting('orderly.released', true)")).scalar()
    return parse_ids(value)


# A claim commits its backend pid atomically, so an orphan is certain once pg_stat_activity
# no longer shows the pid; the grace only covers a backend that connected in the same instant.
ORPHAN_GRACE_S = 1.0
MAX_BATCHES = 100


@dataclass(frozen=True)
class RepairReport:
    messages: int
    failed: int
    external_calls: int
    parents: int = 0


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


def _batches(
    engine: Engine, stmt: Any, params: dict[str, Any], enqueue: Callable[[int], None]
) -> int:
    """Run a batched transition until it changes fewer rows than a batch; enqueue releases."""
    done = 0
    for _ in range(MAX_BATCHES):
        with engine.begin() as conn:
            changed = len(conn.execute(stmt, params).all())
            released = released_in(conn)
        for msg_id in released:
            enqueue(msg_id)
        done += changed
        if changed < params["batch"]:
            break
    return done


def fail_postponed(engine: Engine, config: ConfigReader, enqueue: Callable[[int], None]) -> int:
    """Guaranteed-order messages held back by a FAILED one too long become FAILED."""
    params = {
        "failed_s": config.get_int("asynch.postponedIntervalWhenFailedSec"),
        "batch": config.get_int("asynch.pool.batchSize"),
    }
    return _batches(engine, _FAIL_POSTPONED, params, enqueue)


def expire_waits(engine: Engine, config: ConfigReader, enqueue: Callable[[int], None]) -> int:
    """Messages whose wait for an external response ran out become FAILED."""
    return _batches(
        engine, _RESPONSE_TIMEOUTS, {"batch": config.get_int("asynch.pool.batchSize")}, enqueue
    )


def repair(
    engine: Engine, config: ConfigReader, enqueue: Callable[[int], None] | None = None
) -> RepairReport:
    stuck_s = config.get_int("asynch.repairRepeatTimeSec")
    batch = config.get_int("asynch.pool.batchSize")
    limit = config.get_int("asynch.countPartlyFailsBeforeFailed")
    messages = failed = calls = parents = 0
    released: list[int] = []
    for _ in range(MAX_BATCHES):
        with engine.begin() as conn:
            rows = conn.execute(
                _REPAIR_MESSAGES,
                {"stuck_s": stuck_s, "grace_s": ORPHAN_GRACE_S, "batch": batch, "limit": limit},
            ).all()
            released += released_in(conn)
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
    with engine.begin() as conn:
        rows = conn.execute(_SETTLE_PARENTS, {"stuck_s": stuck_s, "batch": batch}).all()
        parents = sum(1 for r in rows if r.state != "WAITING")
        released += released_in(conn)
    for msg_id in released:
        if enqueue is not None:
            enqueue(msg_id)
    return RepairReport(messages=messages, failed=failed, external_calls=calls, parents=parents)
