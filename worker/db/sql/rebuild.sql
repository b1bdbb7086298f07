-- The rebuild of what Redis held, from the rows (worker/rebuild.py).

-- name: rebuild_lock
-- One rebuilder at a time, across beats and operators: a session-level advisory lock.
SELECT pg_try_advisory_lock(hashtext('orderly.rebuild'));

-- name: rebuild_unlock
SELECT pg_advisory_unlock(hashtext('orderly.rebuild'));

-- name: rebuild_conversation_lock
-- One conversation's lock for the rest of the transaction: conv_lock_all's, for a repair that
-- reads the conversation's rows (worker/conversations/context.py: Context.locked).
SELECT pg_advisory_xact_lock(hashtextextended('conversation:' || :conversation, 0));

-- name: rebuild_conversation_rows
-- What Redis's conversation structures stood for: requests still waiting for responses and
-- responses not yet delivered (queued, AWAITED, or sent and waiting for their ACK), with
-- their ages (ms, by PostgreSQL's clock) so that Redis times can be rebuilt on the caller's.
-- A request comes with the count of its responses and the age of its latest one. A
-- conversation row's envelope is the request or response as received, its corr (if any)
-- under "corr" (conv_insert_requests/_responses); a response's removal an operator
-- scheduled is the latest REMOVE_AT entry of its audit.
-- :after, :conversations: a page of the conversations with such rows, those after :after in
-- id order ('' and NULL: every one; the reconciliation sweep walks them a page at a time).
-- :only: one conversation's (NULL: no such limit). :without: msg_ids left out, as if they
-- were not there yet (a request or response whose own script runs after the rebuild).
-- now_ms: PostgreSQL's clock, which measured the ages (a caller on an injected clock
-- compares).
WITH page AS (
    SELECT DISTINCT process_id FROM message
     WHERE service_name = 'conversation' AND process_id > :after
       AND (CAST(:only AS text) IS NULL OR process_id = :only)
       AND ((operation_name = 'request' AND state = 'WAITING_FOR_RES')
            OR (operation_name = 'response'
                AND state IN ('IN_QUEUE', 'PARTLY_FAILED', 'WAITING_FOR_RES')))
     ORDER BY process_id LIMIT :conversations)
SELECT m.msg_id, m.operation_name, m.process_id, m.correlation_id, m.entity_type, m.state,
       m.failed_count, m.custom_data, m.payload, m.response_last, m.trace_parent,
       CAST(m.envelope AS json) ->> 'corr' AS corr,
       (SELECT CAST(a.e ->> 'remove_at_ms' AS bigint)
          FROM jsonb_array_elements(m.audit) WITH ORDINALITY AS a(e, n)
         WHERE a.e ->> 'action' = 'REMOVE_AT' ORDER BY a.n DESC LIMIT 1) AS remove_at_ms,
       extract(epoch FROM m.msg_timestamp) * 1000 AS timestamp_ms,
       extract(epoch FROM now() - m.receive_timestamp) * 1000 AS age_ms,
       extract(epoch FROM now() - m.last_process_timestamp) * 1000 AS idle_ms,
       p.msg_id AS request_msg_id, p.correlation_id AS request_id, p.state AS request_state,
       extract(epoch FROM p.msg_timestamp) * 1000 AS request_timestamp_ms,
       (SELECT count(*) FROM message c
         WHERE c.parent_msg_id = m.msg_id AND c.msg_id <> ALL(CAST(:without AS bigint[])))
         AS responses,
       (SELECT extract(epoch FROM now() - max(c.receive_timestamp)) * 1000
          FROM message c
         WHERE c.parent_msg_id = m.msg_id AND c.msg_id <> ALL(CAST(:without AS bigint[])))
         AS latest_response_age_ms,
       extract(epoch FROM now()) * 1000 AS now_ms
  FROM message m LEFT JOIN message p ON p.msg_id = m.parent_msg_id
 WHERE m.service_name = 'conversation' AND m.process_id IN (SELECT process_id FROM page)
   AND m.msg_id <> ALL(CAST(:without AS bigint[]))
   AND ((m.operation_name = 'request' AND m.state = 'WAITING_FOR_RES')
        OR (m.operation_name = 'response'
            AND m.state IN ('IN_QUEUE', 'PARTLY_FAILED', 'WAITING_FOR_RES')))
 ORDER BY m.process_id, m.msg_id;

-- name: rebuild_queued_messages
-- How many store messages wait for a worker's claim (NEW, IN_QUEUE without a due time): the
-- rebuild wakes one for them.
SELECT count(*) FROM message
 WHERE state IN ('NEW', 'IN_QUEUE') AND due_at IS NULL AND service_name <> 'conversation';

-- name: rebuild_deliveries_due
-- Push deliveries handed to the broker (due by next_attempt_at, leased by scheduled_at): due
-- again now, so the ticker hands them over at once instead of after the lease.
UPDATE delivery SET scheduled_at = now()
 WHERE state = 'PENDING' AND NOT pull AND next_attempt_at <= now() AND scheduled_at > now()
RETURNING delivery_id;
