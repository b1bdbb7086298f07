-- Retention: final messages finished before a time go, with every row that belongs to them
-- (worker/purge.py). A batch is one short transaction; rows are taken with SKIP LOCKED, so a
-- worker never waits for the purge (the purge passes over what a worker holds).
-- Finished: coalesce(last_process_timestamp, receive_timestamp), the time of the last change
-- of state. Final: OK, FAILED, CANCEL.

-- name: purge_begin
-- First in every batch's transaction: the recursive family query is estimated far above what
-- it reads, and JIT compiling it costs more than running it (0.68 s against 6 ms a batch).
SET LOCAL jit = off;

-- name: purge_roots
-- Up to :limit messages without a parent after :after (msg_id order: one pass over the
-- table, resumed where the previous batch ended), final and finished before :before,
-- row-locked. A child goes only with its family, through its root.
SELECT msg_id FROM message
 WHERE msg_id > :after AND parent_msg_id IS NULL
   AND state IN ('OK', 'FAILED', 'CANCEL')
   AND coalesce(last_process_timestamp, receive_timestamp) < :before
 ORDER BY msg_id
 LIMIT :limit
   FOR UPDATE SKIP LOCKED;

-- name: purge_family
-- The descendants of the roots (children, their children, ...: every message that points at
-- them through parent_msg_id), each with its root and whether this transaction could lock it
-- (false: a worker holds it now, and its family stays this time). A final member is locked
-- to be deleted; an open one (its family stays: purge_held) only against its deletion (KEY
-- SHARE), so that a funnel's release, which waits for its row (orderly_funnel_release), never
-- waits for the purge.
WITH RECURSIVE family(root, msg_id) AS (
    SELECT c.parent_msg_id, c.msg_id FROM message c
     WHERE c.parent_msg_id = ANY(CAST(:roots AS bigint[]))
    UNION ALL
    -- a lookup per member (OFFSET 0 keeps it one): the planner's estimate of the work table
    -- is far too high, and it would rather read the whole parent index in a merge join
    SELECT f.root, c.msg_id
      FROM family f,
           LATERAL (SELECT x.msg_id FROM message x WHERE x.parent_msg_id = f.msg_id OFFSET 0) c
)
SELECT f.root, f.msg_id, coalesce(l.msg_id, o.msg_id) IS NOT NULL AS locked
  FROM family f
  LEFT JOIN LATERAL (SELECT x.msg_id FROM message x
                      WHERE x.msg_id = f.msg_id AND x.state IN ('OK', 'FAILED', 'CANCEL')
                        FOR UPDATE SKIP LOCKED) l ON true
  LEFT JOIN LATERAL (SELECT x.msg_id FROM message x
                      WHERE x.msg_id = f.msg_id AND x.state NOT IN ('OK', 'FAILED', 'CANCEL')
                        FOR KEY SHARE SKIP LOCKED) o ON true;

-- name: purge_held
-- Of the given (locked) messages, those that must stay, and why; a family with one of them
-- stays whole:
--   open     not final (a parent never goes before its children end);
--   recent   finished at or after :before;
--   funnel   FAILED in a guaranteed-order funnel: it holds the funnel's later messages back
--            (orderly_funnel_blocked), and must go on doing so until an operator cancels it;
--   object   OK, and an open message of the same object is older: the claim would mark that
--            one obsolete by this one (orderly_claim_ids);
--   call     an external call of it is in flight, its confirmation is still to be sent, or
--            it keys an entity or custom value and an open message (one whose handler may
--            still run) is not newer than it: that message's call on the key would be judged
--            against it (orderly_call_take: obsolete or duplicate). Calls keyed by their own
--            message (msg:...) and confirmations are nobody else's. :oldest_open is
--            purge_oldest_open's answer (read again every few seconds of a purge).
SELECT m.msg_id,
       CASE
         WHEN m.state NOT IN ('OK', 'FAILED', 'CANCEL') THEN 'open'
         WHEN coalesce(m.last_process_timestamp, m.receive_timestamp) >= :before THEN 'recent'
         WHEN m.state = 'FAILED' AND m.guaranteed_order AND m.funnel_value IS NOT NULL
              THEN 'funnel'
         WHEN m.state = 'OK' AND m.object_id IS NOT NULL AND EXISTS (
              SELECT 1 FROM message b
               WHERE b.object_id = m.object_id
                 AND b.entity_type IS NOT DISTINCT FROM m.entity_type
                 AND b.state NOT IN ('OK', 'FAILED', 'CANCEL')
                 AND b.msg_timestamp < m.msg_timestamp) THEN 'object'
         WHEN EXISTS (
              SELECT 1 FROM external_call e
               WHERE e.msg_id = m.msg_id
                 AND (e.state = 'PROCESSING'
                      OR (e.operation_name = 'orderly.confirmation' AND e.state = 'FAILED')
                      OR (e.operation_name <> 'orderly.confirmation'
                          AND e.entity_id NOT LIKE 'msg:%'
                          AND e.msg_timestamp >= CAST(:oldest_open AS timestamptz)))) THEN 'call'
       END AS held
  FROM message m
 WHERE m.msg_id = ANY(CAST(:ids AS bigint[]));

-- name: purge_oldest_open
-- The msg_timestamp of the oldest message whose handler may still run (not final, not a
-- WAITING parent): external calls from then on may be judged against (purge_held).
SELECT min(msg_timestamp) FROM message WHERE state NOT IN ('OK', 'FAILED', 'CANCEL', 'WAITING');

-- name: purge_count
-- What purge_delete_* would delete for these messages (a dry run).
SELECT (SELECT count(*) FROM response s
         WHERE s.msg_id = ANY(CAST(:ids AS bigint[]))
            OR (s.msg_id IS NULL AND s.req_id IN (
                SELECT q.req_id FROM request q WHERE q.msg_id = ANY(CAST(:ids AS bigint[]))))
       ) AS response,
       (SELECT count(*) FROM request q
         WHERE q.msg_id = ANY(CAST(:ids AS bigint[]))
           AND NOT EXISTS (SELECT 1 FROM response s
                            WHERE s.req_id = q.req_id
                              AND s.msg_id IS NOT NULL
                              AND s.msg_id <> ALL(CAST(:ids AS bigint[])))
       ) AS request,
       (SELECT count(*) FROM external_call e WHERE e.msg_id = ANY(CAST(:ids AS bigint[])))
       AS external_call;

-- name: purge_delete_responses
-- The responses of these messages, and those without a message to requests of theirs. Each
-- delete returns the rows as JSON when :archive (written before the commit).
DELETE FROM response t
 WHERE t.msg_id = ANY(CAST(:ids AS bigint[]))
    OR (t.msg_id IS NULL AND t.req_id IN (
        SELECT q.req_id FROM request q WHERE q.msg_id = ANY(CAST(:ids AS bigint[]))))
RETURNING CASE WHEN :archive THEN row_to_json(t)::text END AS row;

-- name: purge_delete_requests
-- Their requests, but one that another message's response still points at (the (uri,
-- res_join_id) key was taken over): that one loses its msg_id (purge_detach_requests).
DELETE FROM request t
 WHERE t.msg_id = ANY(CAST(:ids AS bigint[]))
   AND NOT EXISTS (SELECT 1 FROM response s WHERE s.req_id = t.req_id)
RETURNING CASE WHEN :archive THEN row_to_json(t)::text END AS row;

-- name: purge_detach_requests
UPDATE request SET msg_id = NULL
 WHERE msg_id = ANY(CAST(:ids AS bigint[]))
RETURNING req_id;

-- name: purge_delete_calls
DELETE FROM external_call t
 WHERE t.msg_id = ANY(CAST(:ids AS bigint[]))
RETURNING CASE WHEN :archive THEN row_to_json(t)::text END AS row;

-- name: purge_delete_messages
-- The messages themselves, their audit trail (message.audit) with them; children and
-- parents in one statement.
DELETE FROM message t
 WHERE t.msg_id = ANY(CAST(:ids AS bigint[]))
   AND t.state IN ('OK', 'FAILED', 'CANCEL')
RETURNING CASE WHEN :archive THEN row_to_json(t)::text END AS row;
