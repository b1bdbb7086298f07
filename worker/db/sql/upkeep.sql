-- The message store's periodic work (worker.messages.watchdogs, worker.messages.timeouts): the re-processing pool,
-- repair, guaranteed order held back by a FAILED message, response deadlines, timeouts.
-- Rows are taken with SKIP LOCKED, so two runners never act on the same row. A batched
-- transition locks rows first and the state trigger then takes funnel locks, while a funnel's
-- lock comes first everywhere else: here a row whose funnel lock is busy is left for the next
-- run (pg_try_advisory_xact_lock).

-- name: messages_due_take
-- Messages whose due time came (worker.messages.due, a due source of beat's ticker): a NEW
-- one scheduled for now, a PARTLY_FAILED one whose retry wait ended, a POSTPONED one whose
-- rest ended and whose funnel lets it go, a timed-out one whose retry is due: claimable now
-- (no due time; PARTLY_FAILED and POSTPONED become IN_QUEUE), returned for a worker's wake-up.
-- A POSTPONED one its funnel still holds back is looked at again after :lease_s in a plain
-- funnel (its block may expire: funnelIdleIntervalSec); in guaranteed order it waits for its
-- funnel's release, with no due time (fail_postponed covers a FAILED head). Oldest due first.
WITH due AS (
    SELECT msg_id,
           state = 'POSTPONED' AND funnel_value IS NOT NULL
           AND orderly_funnel_blocked(msg_id, funnel_value, funnel_component_id,
                                      msg_timestamp, guaranteed_order,
                                      exclude_failed_state) AS blocked
      FROM message
     WHERE due_at <= now() AND state IN ('NEW', 'IN_QUEUE', 'PARTLY_FAILED', 'POSTPONED')
     ORDER BY due_at
     LIMIT :limit
       FOR UPDATE SKIP LOCKED),
moved AS (
    UPDATE message m
       SET state = CASE WHEN d.blocked OR m.state IN ('NEW', 'IN_QUEUE') THEN m.state
                        ELSE 'IN_QUEUE' END,
           start_in_queue_timestamp = CASE WHEN d.blocked OR m.state IN ('NEW', 'IN_QUEUE')
                                           THEN m.start_in_queue_timestamp ELSE now() END,
           due_at = CASE WHEN d.blocked AND NOT m.guaranteed_order
                         THEN now() + make_interval(secs => :lease_s) END,
           -- one still held back keeps its time: fail_postponed counts how long it stood
           last_process_timestamp = CASE WHEN d.blocked THEN m.last_process_timestamp
                                         ELSE now() END
      FROM due d
     WHERE m.msg_id = d.msg_id
    RETURNING m.msg_id, d.blocked)
SELECT msg_id FROM moved WHERE NOT blocked ORDER BY msg_id;

-- name: messages_due_next
-- Milliseconds until the earliest waiting message is due (NULL when none waits): how long an
-- idle beat may wait (ix_message_due).
SELECT extract(epoch FROM min(due_at) - now()) * 1000
  FROM message
 WHERE due_at IS NOT NULL AND state IN ('NEW', 'IN_QUEUE', 'PARTLY_FAILED', 'POSTPONED');

-- name: messages_due_release
-- Made claimable, but no worker could be woken for them (Redis or the broker refused): due
-- again at once, so that the ticker tries the wake-up again (:token unused: the take itself
-- moved them on).
UPDATE message SET due_at = now()
 WHERE msg_id = ANY(CAST(:ids AS bigint[])) AND state IN ('NEW', 'IN_QUEUE') AND due_at IS NULL;

-- name: repair_messages
-- NEW/IN_QUEUE/PROCESSING idle >= :stuck_s become PARTLY_FAILED (FAILED once failed_count
-- reached :limit), due again at once (they waited :stuck_s already). A PROCESSING message
-- whose worker is alive but silent is stuck too; one whose worker died is release_orphans'
-- (released within a second, not after :stuck_s); one waiting for its due time is not stuck.
UPDATE message m
   SET state = CASE WHEN m.failed_count >= :limit THEN 'FAILED' ELSE 'PARTLY_FAILED' END,
       failed_count = m.failed_count + 1,
       failed_error_code = 'E_REPAIR',
       failed_desc = 'stuck in ' || m.state || ' since ' || m.last_process_timestamp::text,
       last_process_timestamp = now(), processing_pid = NULL,
       due_at = CASE WHEN m.failed_count >= :limit THEN NULL ELSE now() END
 WHERE m.msg_id IN (
       SELECT msg_id FROM message m
        WHERE m.service_name <> 'conversation'
          AND m.state IN ('NEW', 'IN_QUEUE', 'PROCESSING') AND m.due_at IS NULL
          AND m.last_process_timestamp <= now() - make_interval(secs => :stuck_s)
          AND NOT (m.state = 'PROCESSING' AND orderly_orphaned(m.processing_pid))
          AND (m.funnel_value IS NULL OR pg_try_advisory_xact_lock(
                   orderly_funnel_key(m.funnel_value, m.funnel_component_id)))
        LIMIT :batch
        FOR UPDATE SKIP LOCKED)
RETURNING m.msg_id, m.state;

-- name: release_orphans
-- PROCESSING messages whose worker died (the claiming backend is gone, for :grace_s) go back
-- to IN_QUEUE at once, their death counted in lost_count; one whose deaths reach :limit is
-- quarantined instead: FAILED with E_WORKER_LOST (its funnel and parent move on, as for any
-- failure), so one poison message cannot keep a worker pool crashing. A claim older than the
-- server's start lost its backend to a PostgreSQL restart, not to its worker: released, not
-- counted (its worker cannot record the outcome on a new connection anyway). Nor is a death
-- counted against the messages of a claim of several (not lone_claim): which of them its
-- worker was running is not known; they are isolated instead, claimed alone from then on,
-- where a death counts.
UPDATE message m
   SET state = CASE WHEN m.lost_count + d.died >= :limit THEN 'FAILED' ELSE 'IN_QUEUE' END,
       lost_count = m.lost_count + d.died,
       failed_count = m.failed_count + CASE WHEN m.lost_count + d.died >= :limit THEN 1 ELSE 0 END,
       failed_error_code = CASE WHEN m.lost_count + d.died >= :limit THEN 'E_WORKER_LOST'
                                ELSE m.failed_error_code END,
       failed_desc = CASE WHEN m.lost_count + d.died >= :limit
                          THEN format('quarantined: its worker died %s times while processing it',
                                      m.lost_count + d.died)
                          ELSE m.failed_desc END,
       start_in_queue_timestamp = now(), last_process_timestamp = now(), processing_pid = NULL,
       isolate = m.isolate OR d.batched
  FROM (SELECT o.msg_id,
               CASE WHEN o.last_process_timestamp < pg_postmaster_start_time() THEN 0
                    WHEN NOT o.lone_claim THEN 0
                    ELSE 1 END AS died,
               o.last_process_timestamp >= pg_postmaster_start_time()
               AND NOT o.lone_claim AS batched
          FROM message o
         WHERE o.state = 'PROCESSING' AND o.service_name <> 'conversation'
           AND o.last_process_timestamp <= now() - make_interval(secs => :grace_s)
           AND orderly_orphaned(o.processing_pid)
           AND (o.funnel_value IS NULL OR pg_try_advisory_xact_lock(
                    orderly_funnel_key(o.funnel_value, o.funnel_component_id)))
         LIMIT :batch
         FOR UPDATE SKIP LOCKED) d
 WHERE m.msg_id = d.msg_id
RETURNING m.msg_id, m.state;

-- name: repair_calls
-- External calls stuck in PROCESSING become FAILED (confirmations have their own lease).
UPDATE external_call
   SET state = 'FAILED', failed_count = failed_count + 1, last_update_timestamp = now()
 WHERE call_id IN (
       SELECT call_id FROM external_call
        WHERE state = 'PROCESSING'
          AND operation_name <> 'orderly.confirmation'
          AND last_update_timestamp <= now() - make_interval(secs => :stuck_s)
        LIMIT :batch
        FOR UPDATE SKIP LOCKED)
RETURNING call_id;

-- name: fail_postponed
-- Guaranteed order halts behind a FAILED message (unless exclude_failed_state): the messages
-- it holds back fail once both have stood still for :failed_s.
UPDATE message m
   SET state = 'FAILED', failed_count = m.failed_count + 1, due_at = NULL,
       failed_error_code = 'E_POSTPONED_TOO_LONG',
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
           AND (c.funnel_value IS NULL OR pg_try_advisory_xact_lock(
                    orderly_funnel_key(c.funnel_value, c.funnel_component_id)))
         ORDER BY c.msg_timestamp
         LIMIT :batch
         FOR UPDATE OF c SKIP LOCKED) b
 WHERE m.msg_id = b.msg_id AND b.blocker IS NOT NULL
RETURNING m.msg_id;

-- name: expire_waits
-- Messages whose wait for an external response ran out become FAILED.
UPDATE message m
   SET state = 'FAILED', failed_count = m.failed_count + 1,
       failed_error_code = 'E_RESPONSE_TIMEOUT',
       failed_desc = format('no response for correlation id %s by %s',
                            m.wait_correlation_id, m.response_deadline),
       last_process_timestamp = now()
 WHERE m.msg_id IN (
       SELECT msg_id FROM message
        WHERE state = 'WAITING_FOR_RES' AND response_deadline <= now()
          AND service_name <> 'conversation'
          AND (message.funnel_value IS NULL OR pg_try_advisory_xact_lock(
                   orderly_funnel_key(message.funnel_value, message.funnel_component_id)))
        ORDER BY response_deadline
        LIMIT :batch
        FOR UPDATE SKIP LOCKED)
RETURNING m.msg_id;

-- name: settle_parents
-- A parent is settled when its last child ends; this catches one whose settling was lost.
SELECT p.msg_id, orderly_parent_check(p.msg_id) AS state
  FROM message p
 WHERE p.state = 'WAITING' AND p.service_name <> 'conversation'
   AND p.last_process_timestamp <= now() - make_interval(secs => :stuck_s)
   AND NOT EXISTS (SELECT 1 FROM message c
                    WHERE c.parent_msg_id = p.msg_id AND c.parent_binding_type = 'HARD'
                      AND c.state NOT IN ('OK', 'FAILED', 'CANCEL'))
 LIMIT :batch;

-- name: released_in_transaction
-- The funnel messages the current transaction released (enqueued after its commit).
SELECT current_setting('orderly.released', true);

-- name: lock_funnel_of
-- A message's funnel lock (a no-op without a funnel), before any row lock of the funnel.
SELECT orderly_lock_funnel_of(:id);

-- name: due_waiting
-- Whether a message has waited due (NEW or IN_QUEUE: what workers claim in batches) longer
-- than :after_s.
SELECT EXISTS (SELECT 1 FROM message
                WHERE state IN ('NEW', 'IN_QUEUE') AND due_at IS NULL
                  AND service_name <> 'conversation'
                  AND last_process_timestamp <= now() - make_interval(secs => :after_s));

-- name: claim_members
-- The messages one claim (its backend pid and claim time) still holds: a batch's, when the
-- timeout monitor takes it back.
SELECT msg_id FROM message
 WHERE state = 'PROCESSING' AND processing_pid = :pid
   AND last_process_timestamp = CAST(:claimed_at AS timestamptz)
 ORDER BY msg_id;

-- name: timeout_take_back
-- A timed-out claim taken back: IN_QUEUE with timeout_count + 1, due after :delays[n] ms
-- (the retry policy's wait before retry n, worker.core.retry; the due-work ticker takes it
-- up then), FAILED at the last attempt; only the very claim that timed out (pid and claim
-- time), never a message of a plain funnel (that counts only started messages: taking one back would let its successor
-- run beside the hung handler; funnelIdleIntervalSec and repair apply).
UPDATE message m
   SET state = CASE WHEN m.timeout_count >= :attempts THEN 'FAILED' ELSE 'IN_QUEUE' END,
       timeout_count = m.timeout_count + 1,
       failed_count = m.failed_count + 1,
       failed_error_code = 'E_TIMEOUT',
       failed_desc = format('no worker finished it within %s ms (timeout %s of %s); %s',
                            :timeout_ms, m.timeout_count + 1, :attempts + 1,
                            CASE WHEN m.timeout_count >= :attempts THEN 'no retries left'
                                 ELSE 'retried' END),
       processing_pid = NULL, last_process_timestamp = now(),
       due_at = CASE WHEN m.timeout_count >= :attempts THEN NULL
                     ELSE now() + make_interval(
                              secs => (CAST(:delays AS bigint[]))[m.timeout_count + 1] / 1000.0)
                END
 WHERE m.msg_id = :msg_id AND m.state = 'PROCESSING'
   AND m.processing_pid = :pid AND m.last_process_timestamp = CAST(:claimed_at AS timestamptz)
   AND (m.funnel_value IS NULL OR m.guaranteed_order)
RETURNING m.state, m.timeout_count;
