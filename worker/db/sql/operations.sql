-- Operator commands on the message store (worker.messages.operations): list and inspect messages,
-- cancel and re-drive with an audit note, and external responses that resume a waiting one.
-- :owned in these queries: the source systems of the caller's key (NULL: every one); another
-- tenant's message is not found, in the statement that reads or writes it.

-- name: messages_list
-- Messages matching every filter given (NULL: any; :process by ix_message_conversation and
-- ix_message_process, one arm each; :cid_like a correlation id's prefix or
-- part, ix_message_correlation_pattern serving a prefix), oldest msg_timestamp first or, with
-- :newest, newest msg_id first; a page of them. due_at: when a waiting message is due (a
-- scheduled NEW one, a retry), NULL when it waits for no time.
SELECT msg_id, state, service_name, operation_name, correlation_id, source_system,
       msg_timestamp, funnel_value, guaranteed_order, parent_msg_id, failed_count,
       failed_error_code, last_process_timestamp, priority, due_at
  FROM message
 WHERE (CAST(:state AS text) IS NULL OR state = :state)
   AND (CAST(:funnel AS text) IS NULL OR funnel_value = :funnel)
   AND (CAST(:process AS text) IS NULL
        OR (service_name = 'conversation' AND process_id = :process)
        OR (service_name <> 'conversation' AND process_id = :process))
   AND (CAST(:service AS text) IS NULL OR service_name = :service)
   AND (CAST(:operation AS text) IS NULL OR operation_name = :operation)
   AND (CAST(:source AS text) IS NULL OR source_system = :source)
   AND (CAST(:cid AS text) IS NULL OR correlation_id = :cid)
   AND (CAST(:cid_like AS text) IS NULL OR correlation_id LIKE :cid_like)
   AND (CAST(:since AS timestamptz) IS NULL OR msg_timestamp >= :since)
   AND (CAST(:until AS timestamptz) IS NULL OR msg_timestamp < :until)
   AND (CAST(:owned AS text[]) IS NULL OR source_system = ANY(CAST(:owned AS text[])))
 ORDER BY CASE WHEN :newest THEN msg_id END DESC, msg_timestamp, msg_id
 LIMIT :limit OFFSET :offset;

-- name: messages_count_by_state
-- How many messages match the filters of messages_list but the state, per state.
SELECT state, count(*) AS n
  FROM message
 WHERE (CAST(:funnel AS text) IS NULL OR funnel_value = :funnel)
   AND (CAST(:process AS text) IS NULL
        OR (service_name = 'conversation' AND process_id = :process)
        OR (service_name <> 'conversation' AND process_id = :process))
   AND (CAST(:service AS text) IS NULL OR service_name = :service)
   AND (CAST(:operation AS text) IS NULL OR operation_name = :operation)
   AND (CAST(:source AS text) IS NULL OR source_system = :source)
   AND (CAST(:cid AS text) IS NULL OR correlation_id = :cid)
   AND (CAST(:cid_like AS text) IS NULL OR correlation_id LIKE :cid_like)
   AND (CAST(:since AS timestamptz) IS NULL OR msg_timestamp >= :since)
   AND (CAST(:until AS timestamptz) IS NULL OR msg_timestamp < :until)
   AND (CAST(:owned AS text[]) IS NULL OR source_system = ANY(CAST(:owned AS text[])))
 GROUP BY state;

-- name: message_show
SELECT msg_id, state, service_name, operation_name, correlation_id, source_system,
       msg_timestamp, receive_timestamp, last_process_timestamp, start_in_queue_timestamp,
       object_id, entity_type, process_id, funnel_value, funnel_component_id, guaranteed_order,
       exclude_failed_state, parent_msg_id, parent_binding_type, failed_count,
       failed_error_code, failed_desc, custom_data, node_id, obsolete_by, wait_correlation_id,
       response_deadline, wait_res_id, audit, payload, priority, due_at
  FROM message WHERE msg_id = :id AND (CAST(:owned AS text[]) IS NULL OR source_system = ANY(CAST(:owned AS text[])));

-- name: message_children
SELECT msg_id, state, parent_binding_type, service_name, operation_name
  FROM message WHERE parent_msg_id = :id ORDER BY msg_id;

-- name: message_external_calls
SELECT call_id, operation_name, entity_id, state, failed_count, msg_timestamp,
       last_update_timestamp, next_attempt_at
  FROM external_call WHERE msg_id = :id ORDER BY call_id;

-- name: message_exchanges
SELECT q.req_id, q.uri, q.res_join_id, q.req_timestamp, s.res_id, s.res_timestamp, s.failed,
       s.failed_reason
  FROM request q LEFT JOIN response s ON s.req_id = q.req_id
 WHERE q.msg_id = :id ORDER BY q.req_id, s.res_id;

-- name: message_audit
-- An operator's entry in the message's audit trail (a response given by hand).
UPDATE message SET audit = audit || jsonb_build_array(jsonb_build_object(
           'at', now(), 'action', CAST(:action AS text), 'by', CAST(:by AS text),
           'note', CAST(:note AS text), 'from', state, 'error', failed_error_code))
 WHERE msg_id = :id;

-- name: conversation_messages
-- A conversation's requests and responses in PostgreSQL, in the order they were sent
-- (ix_message_conversation).
SELECT msg_id, operation_name, correlation_id, object_id, state, msg_timestamp,
       receive_timestamp, last_process_timestamp, late_ms, response_last, failed_error_code,
       failed_desc, parent_msg_id
  FROM message
 WHERE service_name = 'conversation' AND process_id = :cid
   AND (CAST(:owned AS text[]) IS NULL OR entity_type = ANY(CAST(:owned AS text[])))
 ORDER BY msg_timestamp, msg_id
 LIMIT :limit;

-- name: late_responses_recent
-- The newest conversation responses delivered after their request expired (ix_message_late).
SELECT msg_id, process_id AS conversation_id, correlation_id AS response_id,
       object_id AS request_id, late_ms, last_process_timestamp
  FROM message WHERE late_ms IS NOT NULL AND (CAST(:owned AS text[]) IS NULL OR entity_type = ANY(CAST(:owned AS text[])))
 ORDER BY msg_id DESC LIMIT :limit;

-- name: message_wait_of
SELECT state, wait_correlation_id FROM message WHERE msg_id = :id AND (CAST(:owned AS text[]) IS NULL OR source_system = ANY(CAST(:owned AS text[])));

-- name: message_state_of
SELECT state, service_name FROM message WHERE msg_id = :id AND (CAST(:owned AS text[]) IS NULL OR source_system = ANY(CAST(:owned AS text[])));

-- name: message_cancel
-- CANCEL a message not final yet, with the operator's audit entry. Conversation rows are
-- settled by their ordering gate, never by an operator.
UPDATE message SET state = 'CANCEL', processing_pid = NULL, last_process_timestamp = now(),
                   due_at = NULL,
       audit = audit || jsonb_build_array(jsonb_build_object(
           'at', now(), 'action', 'CANCEL', 'by', CAST(:by AS text),
           'note', CAST(:note AS text), 'from', state, 'error', failed_error_code))
 WHERE msg_id = :id AND state NOT IN ('OK', 'FAILED', 'CANCEL')
   AND service_name <> 'conversation' AND (CAST(:owned AS text[]) IS NULL OR source_system = ANY(CAST(:owned AS text[])))
RETURNING msg_id;

-- name: cancel_hard_descendants
-- The messages a cancel of :id cascades to: its HARD children not final yet, and theirs, down
-- through messages not final (a final child's children belong to its outcome). Read before
-- any lock, so that the funnel locks of the whole tree are taken at once, in key order.
WITH RECURSIVE tree AS (
    SELECT msg_id FROM message
     WHERE parent_msg_id = :id AND parent_binding_type = 'HARD'
       AND state NOT IN ('OK', 'FAILED', 'CANCEL') AND service_name <> 'conversation'
    UNION
    SELECT c.msg_id FROM message c JOIN tree t ON c.parent_msg_id = t.msg_id
     WHERE c.parent_binding_type = 'HARD'
       AND c.state NOT IN ('OK', 'FAILED', 'CANCEL') AND c.service_name <> 'conversation'
)
SELECT msg_id FROM tree ORDER BY msg_id;

-- name: lock_funnels_of_ids
-- The funnel locks of these messages, in key order (orderly_lock_funnels_of).
SELECT orderly_lock_funnels_of(CAST(:ids AS bigint[]));

-- name: lock_funnels_of_hard_children
-- The funnel locks of the HARD children not final of :ids (those a cancel reaches next), in
-- key order; a lock this transaction holds already is taken again at no cost.
SELECT orderly_lock_funnels_of(ARRAY(
    SELECT msg_id FROM message
     WHERE parent_msg_id = ANY(CAST(:ids AS bigint[])) AND parent_binding_type = 'HARD'
       AND state NOT IN ('OK', 'FAILED', 'CANCEL') AND service_name <> 'conversation'));

-- name: message_cancel_hard_children
-- CANCEL the HARD children not final yet of messages just cancelled (:ids), each with an
-- audit entry naming its parent and the operator's note; SOFT children go on.
UPDATE message SET state = 'CANCEL', processing_pid = NULL, last_process_timestamp = now(),
                   due_at = NULL,
       audit = audit || jsonb_build_array(jsonb_build_object(
           'at', now(), 'action', 'CANCEL', 'by', CAST(:by AS text),
           'note', format('parent message %s cancelled: %s', parent_msg_id, CAST(:note AS text)),
           'from', state, 'error', failed_error_code))
 WHERE parent_msg_id = ANY(CAST(:ids AS bigint[])) AND parent_binding_type = 'HARD'
   AND state NOT IN ('OK', 'FAILED', 'CANCEL') AND service_name <> 'conversation'
RETURNING msg_id;

-- name: message_redrive
-- A FAILED or CANCEL message IN_QUEUE again: failures counted anew, an earlier wait for a
-- response forgotten, the operator's audit entry.
UPDATE message SET state = 'IN_QUEUE', failed_count = 0, start_in_queue_timestamp = now(),
       due_at = NULL, fair_at = coalesce(fair_at, now()),
       last_process_timestamp = now(), wait_correlation_id = NULL, wait_res_id = NULL,
       response_deadline = NULL,
       audit = audit || jsonb_build_array(jsonb_build_object(
           'at', now(), 'action', 'REDRIVE', 'by', CAST(:by AS text),
           'note', CAST(:note AS text), 'from', state, 'error', failed_error_code))
 WHERE msg_id = :id AND state IN ('FAILED', 'CANCEL')
   AND service_name <> 'conversation' AND (CAST(:owned AS text[]) IS NULL OR source_system = ANY(CAST(:owned AS text[])))
RETURNING parent_msg_id;

-- name: message_reopen_parent
-- A HARD parent its re-driven child had failed waits for it again.
UPDATE message SET state = 'WAITING', last_process_timestamp = now(),
       audit = audit || jsonb_build_array(jsonb_build_object(
           'at', now(), 'action', 'REOPEN', 'by', CAST(:by AS text),
           'note', CAST(:note AS text), 'from', state, 'error', failed_error_code))
 WHERE msg_id = :id AND state = 'FAILED' AND failed_desc LIKE :because
RETURNING parent_msg_id;

-- name: response_waiting_message
-- The message waiting for a response under this correlation id, locked.
SELECT msg_id, state, wait_res_id FROM message
 WHERE wait_correlation_id = :cid AND state NOT IN ('OK', 'FAILED', 'CANCEL')
   AND (CAST(:owned AS text[]) IS NULL OR source_system = ANY(CAST(:owned AS text[])))
   FOR UPDATE;

-- name: response_insert
INSERT INTO response (req_id, msg_id, res_envelope, failed, failed_reason, res_timestamp)
VALUES ((SELECT req_id FROM request
          WHERE msg_id = :msg AND res_join_id = :cid
          ORDER BY req_timestamp DESC LIMIT 1),
        :msg, :envelope, :failed, :reason, now())
RETURNING res_id;

-- name: response_resume
-- The wait ends: the message goes on (IN_QUEUE), or keeps the response until its handler
-- returns (it registered the wait while running).
UPDATE message
   SET wait_res_id = :res,
       state = CASE WHEN state = 'WAITING_FOR_RES' THEN 'IN_QUEUE' ELSE state END,
       start_in_queue_timestamp = CASE WHEN state = 'WAITING_FOR_RES' THEN now()
                                       ELSE start_in_queue_timestamp END,
       last_process_timestamp = now()
 WHERE msg_id = :msg
RETURNING state;

-- name: store_figures
-- The figures behind GET /metrics, in one round trip: states of messages and deliveries, the
-- delayed deliveries, the late conversation responses, the age of the given messages'
-- oldest receive_timestamp, and the messages waiting for their due time (the messages' due
-- source, worker.messages.due: ix_message_due) by state, with how far the earliest due time
-- is past (seconds; 0 when none is: beat's ticker keeps up); and the PUSH endpoints that are
-- not well: failing (closed circuit), OPEN, DISABLED.
SELECT 'message' AS part, state AS key, count(*)::float8 AS value
  FROM message GROUP BY state
UNION ALL
SELECT 'delivery', state, count(*)::float8 FROM delivery GROUP BY state
UNION ALL
SELECT 'delayed', '', count(*)::float8
  FROM delivery WHERE state = 'PENDING' AND next_attempt_at > now()
UNION ALL
SELECT 'late', '', count(*)::float8 FROM message WHERE late_ms IS NOT NULL
UNION ALL
SELECT 'head_age', '', COALESCE(extract(epoch FROM now() - min(receive_timestamp)), 0)::float8
  FROM message WHERE msg_id = ANY(CAST(:ids AS bigint[]))
UNION ALL
SELECT 'due', state, count(*)::float8
  FROM message
 WHERE due_at IS NOT NULL AND state IN ('NEW', 'IN_QUEUE', 'PARTLY_FAILED', 'POSTPONED')
 GROUP BY state
UNION ALL
SELECT 'due_lag', '', GREATEST(COALESCE(extract(epoch FROM now() - min(due_at)), 0), 0)::float8
  FROM message
 WHERE due_at IS NOT NULL AND state IN ('NEW', 'IN_QUEUE', 'PARTLY_FAILED', 'POSTPONED')
UNION ALL
SELECT 'endpoint', CASE WHEN disabled_at IS NOT NULL THEN 'DISABLED'
                        WHEN probe_at IS NOT NULL THEN 'OPEN' ELSE 'FAILING' END, count(*)::float8
  FROM subscription
 WHERE disabled_at IS NOT NULL OR probe_at IS NOT NULL OR failures > 0
 GROUP BY 2;

-- name: message_outcome
-- What processing left on a message (worker.testing.run_handler reports it).
SELECT state, failed_count, failed_error_code, failed_desc, custom_data
  FROM message WHERE msg_id = :id;
