-- The message store's hot path: intake, the claim and the outcome of processing.
-- Prepared statements ($1, $2, ...): see worker/db/queries.py.

-- name: orderly_insert_messages
-- Messages NEW in one statement, in the order given (their msg_ids ascend in it): one message
-- alone, a batch, a handler's children. $1..$19 are arrays, one element per message, in the
-- order of worker.messages.store.NewMessage: its timestamp, service, operation, object,
-- entity type, correlation id, process id, payload, envelope, source system, parent and
-- binding, funnel value and component, guaranteed order, exclude_failed_state, due delay
-- (ms) or time (NULL, 0 or a time passed: due now; a scheduled message is NEW until then,
-- whatever its funnel), and priority. $20: the node; $21: new input needs the node in RUN,
-- checked in the same statement (a node that stops accepting input cannot race an insert; a
-- handler's children do not). $22: hold back at once a funnel message its funnel does not let
-- go yet (POSTPONED; in a plain funnel looked at again after postponedIntervalSec, its release
-- normally comes first): for one message inserted under its funnel's lock
-- (worker.messages.store.insert), so that a release cannot miss it. Otherwise a funnel's
-- messages are stored NEW without a lock: the claim decides under the lock which one goes
-- first and holds the others back (worker.messages.batches). One already stored under its
-- (correlation_id, source_system), or twice in the arrays, is inserted once. The k-th of a
-- funnel in the arrays takes the k-th place after the funnel's last (orderly_fair_at).
-- $23: each one's traceparent, the span that took it in, or NULL (worker.core.tracing).
-- Returns msg_id, correlation_id, source_system and state of each inserted, and whether it
-- waits for its due time.
-- prepare: timestamptz[], text[], text[], text[], text[], text[], text[], text[], text[], text[], bigint[], text[], text[], text[], boolean[], boolean[], bigint[], timestamptz[], integer[], bigint, boolean, boolean, text[]
INSERT INTO message (msg_timestamp, service_name, operation_name, object_id, entity_type,
                     correlation_id, process_id, payload, envelope, source_system,
                     parent_msg_id, parent_binding_type, funnel_value, funnel_component_id,
                     guaranteed_order, exclude_failed_state, node_id,
                     receive_timestamp, last_process_timestamp, state, failed_count,
                     due_at, priority, fair_at, trace_parent)
SELECT f.ts, f.service, f.operation, f.object_id, f.entity_type, f.correlation_id,
       f.process_id, f.payload, f.envelope, f.source_system, f.parent, f.binding, f.funnel,
       f.component, f.guaranteed, f.exclude_failed, $20, now(), now(),
       CASE WHEN f.held THEN 'POSTPONED' ELSE 'NEW' END,
       0,
       CASE WHEN f.held AND NOT f.guaranteed THEN orderly_postponed_due()
            WHEN f.held THEN NULL
            ELSE f.due_at END,
       f.priority,
       CASE WHEN f.funnel IS NULL THEN now()
            ELSE orderly_fair_at(f.funnel, f.component, f.rank) END,
       f.trace
  FROM (SELECT i.*, d.due_at,
               row_number() OVER (PARTITION BY i.funnel, i.component ORDER BY i.n) AS rank,
               $22 AND i.funnel IS NOT NULL AND d.due_at IS NULL
               AND orderly_funnel_blocked(NULL, i.funnel, i.component, i.ts, i.guaranteed,
                                          i.exclude_failed) AS held
          FROM unnest($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,
                      $17, $18, $19, $23)
               WITH ORDINALITY
               AS i(ts, service, operation, object_id, entity_type, correlation_id,
                    process_id, payload, envelope, source_system, parent, binding, funnel,
                    component, guaranteed, exclude_failed, delay_ms, not_before, priority,
                    trace, n),
               LATERAL (SELECT CASE WHEN i.not_before > now() THEN i.not_before
                                    WHEN i.delay_ms > 0
                                    THEN now() + make_interval(secs => i.delay_ms / 1000.0)
                               END AS due_at) d
        OFFSET 0) f  -- evaluated once per message: not pulled up into each use of held
 WHERE NOT $21 OR EXISTS (SELECT 1 FROM node WHERE node_id = $20 AND state = 'RUN')
 ORDER BY f.n
ON CONFLICT (correlation_id, source_system) DO NOTHING
RETURNING msg_id, correlation_id, source_system, state,
          due_at IS NOT NULL AND state = 'NEW' AS scheduled;

-- name: orderly_find_message
-- The message stored under (correlation_id, source_system), with what a submission under the
-- same ids must repeat (worker.messages.intake: the same message again, or a conflict).
-- prepare: text, text
SELECT msg_id, state, service_name, operation_name, payload
  FROM message WHERE correlation_id = $1 AND source_system = $2;

-- name: orderly_parent_owned
-- Whether a message exists and is of one of the source systems $2 (a bound key's): a child
-- may name only such a parent. A message's source system never changes.
-- prepare: bigint, text[]
SELECT 1 AS owned FROM message WHERE msg_id = $1 AND source_system = ANY($2);

-- name: orderly_node_state
-- prepare: bigint
SELECT code, state FROM node WHERE node_id = $1;

-- name: orderly_due_candidates
-- Up to $2 due messages (NEW or IN_QUEUE with no due time left, not conversation rows), higher
-- priority first, then by place in line (fair_at; ix_message_ready), row-locked (rows another
-- worker is claiming are skipped: SKIP LOCKED) for orderly_claim_ids in the same transaction;
-- a funnel message only when its funnel's lock is free now (tried, never waited for: no row
-- lock is held while waiting for a funnel). A STOPPED node finds none. Returns msg_id, the
-- funnel's lock key (NULL without a funnel), msg_timestamp and how many more of its funnel
-- may start now (orderly_funnel_free; 1 for guaranteed order, where the claim decides), and
-- the start rate of its funnel component, if it has one (funnel_limit: per second, burst),
-- and whether it is to be claimed alone (isolate: its worker died in a claim of several).
-- prepare: bigint, integer
SELECT x.msg_id,
       CASE WHEN x.funnel_value IS NOT NULL
            THEN orderly_funnel_key(x.funnel_value, x.funnel_component_id) END AS funnel_key,
       x.msg_timestamp,
       CASE WHEN x.funnel_value IS NULL OR x.guaranteed_order THEN 1
            ELSE orderly_funnel_free(x.funnel_value, x.funnel_component_id) END AS free,
       r.rate_per_s, r.burst, x.isolate
  FROM message x
  LEFT JOIN funnel_limit r
         ON x.funnel_value IS NOT NULL AND r.rate_per_s IS NOT NULL
        AND r.component_id = coalesce(x.funnel_component_id, '')
 WHERE x.state IN ('NEW', 'IN_QUEUE') AND x.due_at IS NULL
   AND x.service_name <> 'conversation'
   AND (x.funnel_value IS NULL
        OR pg_try_advisory_xact_lock(orderly_funnel_key(x.funnel_value, x.funnel_component_id)))
   AND NOT EXISTS (SELECT 1 FROM node n WHERE n.node_id = $1 AND n.state = 'STOPPED')
 ORDER BY x.priority DESC, x.fair_at, x.msg_id
 LIMIT $2
   FOR UPDATE OF x SKIP LOCKED;

-- name: orderly_claim_ids
-- Messages NEW or IN_QUEUE whose due time, if any, has come (due, or released by their funnel;
-- or PROCESSING by a dead worker:
-- its backend pid is gone; that death is counted in lost_count when its claim had taken it
-- alone (lone_claim; a claim of several isolates it instead), and a message whose next
-- death would reach $3 is left to worker.messages.watchdogs.release_orphans, which quarantines it) ->
-- PROCESSING in one statement, or POSTPONED when their funnel holds them back; never on a
-- STOPPED node. One message's claim, or a batch's (worker.messages.batches): at most one message of a
-- funnel among them. Their funnels' locks come first, in key order (whoever takes more than
-- one takes them so: no deadlock), so that the funnel checks see every transition committed
-- before. The claim records the claiming connection's backend pid and time (now(): the same
-- for every row of a batch): only that connection may finish it. Returns each claim
-- (worker.messages.processing.Claimed) and the newer processed message of the same object, if
-- any (the message is then obsolete). A message held back is due again after $4 seconds
-- (postponedIntervalSec: the safety net, its funnel's release normally comes first); a claimed
-- one has no due time. The claim's commit need not wait for the disk: a server crash that
-- loses it leaves the messages where they were.
-- prepare: bigint[], bigint, integer, integer
-- prefix: SET LOCAL synchronous_commit TO OFF; SELECT orderly_lock_funnels_of(CAST(%s AS bigint[]));
UPDATE message m
   SET state = CASE WHEN b.blocked THEN 'POSTPONED' ELSE 'PROCESSING' END,
       lost_count = m.lost_count + CASE WHEN m.state = 'PROCESSING' AND m.lone_claim
                                             AND m.last_process_timestamp
                                                 >= pg_postmaster_start_time()
                                        THEN 1 ELSE 0 END,
       isolate = m.isolate OR (m.state = 'PROCESSING' AND NOT m.lone_claim
                               AND m.last_process_timestamp >= pg_postmaster_start_time()),
       lone_claim = cardinality($1) = 1,
       node_id = $2, last_process_timestamp = now(),
       processing_pid = CASE WHEN b.blocked THEN NULL ELSE pg_backend_pid() END,
       -- held back: looked at again after $4 s in a plain funnel (its block may simply
       -- expire: funnelIdleIntervalSec); in guaranteed order only a transition of the funnel
       -- (the trigger's release) or fail_postponed moves it, so it has no due time
       due_at = CASE WHEN b.blocked AND NOT m.guaranteed_order
                     THEN now() + make_interval(secs => $4) END
  FROM (SELECT x.msg_id,
               x.funnel_value IS NOT NULL
               AND orderly_funnel_blocked(x.msg_id, x.funnel_value, x.funnel_component_id,
                                          x.msg_timestamp, x.guaranteed_order,
                                          x.exclude_failed_state) AS blocked
          FROM message x WHERE x.msg_id = ANY($1)) b
 WHERE m.msg_id = b.msg_id AND m.msg_id = ANY($1)
   AND ((m.state IN ('NEW', 'IN_QUEUE') AND (m.due_at IS NULL OR m.due_at <= now()))
        OR (m.state = 'PROCESSING' AND m.lost_count + 1 < $3
            AND orderly_orphaned(m.processing_pid)))
   AND NOT EXISTS (SELECT 1 FROM node n WHERE n.node_id = $2 AND n.state = 'STOPPED')
RETURNING m.state, m.msg_id, m.service_name, m.operation_name, m.correlation_id,
          m.source_system, m.msg_timestamp, m.payload, m.object_id, m.entity_type,
          m.process_id, m.funnel_value, m.failed_count, m.custom_data, m.wait_res_id,
          m.processing_pid, m.last_process_timestamp, m.trace_parent,
          -- the newest processed (OK) message of the same object, newer than this one; the
          -- object is (object_id, entity_type), or (object_id, operation) without a type
          (SELECT o.msg_id FROM message o
            WHERE m.object_id IS NOT NULL AND o.object_id = m.object_id
              AND o.entity_type IS NOT DISTINCT FROM m.entity_type
              AND (m.entity_type IS NOT NULL OR o.operation_name = m.operation_name)
              AND o.state = 'OK' AND o.msg_timestamp > m.msg_timestamp
            ORDER BY o.msg_timestamp DESC, o.msg_id DESC
            LIMIT 1) AS newer,
          -- its funnel's lock key and start rate, if its component has one
          CASE WHEN m.funnel_value IS NOT NULL
               THEN orderly_funnel_key(m.funnel_value, m.funnel_component_id) END AS funnel_key,
          (SELECT r.rate_per_s FROM funnel_limit r
            WHERE m.funnel_value IS NOT NULL AND r.rate_per_s IS NOT NULL
              AND r.component_id = coalesce(m.funnel_component_id, '')) AS rate_per_s,
          (SELECT r.burst FROM funnel_limit r
            WHERE m.funnel_value IS NOT NULL AND r.rate_per_s IS NOT NULL
              AND r.component_id = coalesce(m.funnel_component_id, '')) AS burst;

-- name: orderly_postpone_ids
-- Due messages a claim passed over because an older one of their funnel goes first: POSTPONED,
-- so that its outcome releases the next of them (a claim holds their funnel locks); in a plain
-- funnel due again after $2 seconds (postponedIntervalSec), should no release come.
-- prepare: bigint[], integer
UPDATE message SET state = 'POSTPONED', last_process_timestamp = now(),
                   due_at = CASE WHEN NOT guaranteed_order
                                 THEN now() + make_interval(secs => $2) END
 WHERE msg_id = ANY($1) AND state IN ('NEW', 'IN_QUEUE') AND funnel_value IS NOT NULL
RETURNING msg_id;

-- name: orderly_defer_ids
-- Due messages a claim passed over because their funnel's start rate is spent (a token bucket
-- in Redis, worker.messages.batches): due again after $2 ms each, as if scheduled.
-- prepare: bigint[], bigint[]
UPDATE message m SET due_at = now() + make_interval(secs => w.wait_ms / 1000.0)
  FROM unnest($1, $2) AS w(msg_id, wait_ms)
 WHERE m.msg_id = w.msg_id AND m.state IN ('NEW', 'IN_QUEUE')
RETURNING m.msg_id;

-- name: orderly_unclaim
-- Claimed messages whose handlers did not start (the batch ran out of time) go back to NEW
-- where they were in line (fair_at, which a claim orders by, is kept), for the next claim.
-- prepare: bigint[]
UPDATE message SET state = 'NEW', processing_pid = NULL, last_process_timestamp = now()
 WHERE msg_id = ANY($1) AND state = 'PROCESSING' AND processing_pid = pg_backend_pid()
RETURNING msg_id;

-- name: orderly_why_not_claimed
-- prepare: bigint, bigint
SELECT (SELECT state FROM message WHERE msg_id = $1) AS msg_state,
       (SELECT state FROM node WHERE node_id = $2) AS node_state;

-- name: orderly_finish
-- Outcomes, each only while this connection holds its claim: one message's, or a batch's OK
-- outcomes held for its round, in one statement (functions.sql: orderly_finish_many; the
-- arrays in worker.messages.store.Ending's order). Returns each one's msg_id, new state
-- (NULL: its claim was lost, taken over while its handler ran) and the funnel messages the
-- outcomes released.
-- prepare: bigint[], text[], integer[], text[], text[], text[], bigint[], bigint[]
SELECT msg_id, new_state, released FROM orderly_finish_many($1, $2, $3, $4, $5, $6, $7, $8);

-- name: orderly_register_wait
-- A running handler parks its message until a response names this correlation id.
-- prepare: bigint, text, integer
UPDATE message m
   SET wait_correlation_id = $2, wait_res_id = NULL,
       response_deadline = now() + make_interval(secs => $3)
 WHERE m.msg_id = $1 AND m.state = 'PROCESSING' AND m.processing_pid = pg_backend_pid()
RETURNING m.msg_id;

-- name: orderly_load_response
-- prepare: bigint
SELECT res_id, res_envelope, failed, failed_reason, res_timestamp FROM response WHERE res_id = $1;

-- name: lock_funnels
-- Funnels' advisory locks (values $1, components $2), in key order, held until the
-- transaction ends (before any row of the funnels): one message's insert takes its funnel's,
-- a batch those of the messages it inserts one by one, first.
-- prepare: text[], text[]
SELECT pg_advisory_xact_lock(k)
  FROM (SELECT DISTINCT orderly_funnel_key(v, c) AS k
          FROM unnest($1, $2) AS u(v, c)
         WHERE v IS NOT NULL
         ORDER BY 1) s;

-- name: hand_over_later
-- NEW or IN_QUEUE messages no worker could be woken for (the broker refused): POSTPONED and
-- due again after $2 seconds, so the due-work ticker wakes one for them instead of repair
-- taking them up as stuck. One a worker took meanwhile has moved on and is left alone.
-- prepare: bigint[], double precision
UPDATE message SET state = 'POSTPONED', last_process_timestamp = now(),
                   due_at = now() + make_interval(secs => $2)
 WHERE msg_id = ANY($1) AND state IN ('NEW', 'IN_QUEUE')
RETURNING msg_id;
