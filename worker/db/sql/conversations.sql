-- Conversation rows in the message store: requests, responses and their outcomes.
-- Redis holds the order (worker/lua); PostgreSQL the durable truth.

-- name: conv_lock
-- Sent before conv_insert_request in its transaction: a request of a bound key and another
-- tenant's, both first in a new conversation, cannot both see it empty.
-- prepare: text
SELECT pg_advisory_xact_lock(hashtextextended('conversation:' || $1, 0));

-- name: conv_foreign_request
-- Whether the conversation holds a request of an origin not among $2 (a bound key's).
-- prepare: text, text[]
SELECT 1 AS foreign_request FROM message
 WHERE service_name = 'conversation' AND process_id = $1 AND source_system = 'bridge.request'
   AND entity_type <> ALL($2)
 LIMIT 1;

-- name: conv_insert_request
-- New input: only through a node in RUN, checked in the same statement (as
-- orderly_insert_messages); nothing is inserted on a duplicate or a node that refuses input.
-- $8: the origins of the caller's key (NULL: every one): such a key joins no conversation
-- that holds a request of another origin (conv_lock, sent first, holds out a concurrent one).
-- $7: the request's corr (NULL: none), kept as {"corr": ...} in envelope.
-- prepare: text, text, text, timestamptz, text, bigint, text, text[]
INSERT INTO message (msg_timestamp, receive_timestamp, last_process_timestamp,
                     service_name, operation_name, object_id, entity_type,
                     correlation_id, process_id, payload, source_system, state, node_id,
                     envelope)
SELECT $4, now(), now(), 'conversation', 'request', $1, $3, $1, $2, $5,
       'bridge.request', 'WAITING_FOR_RES', $6,
       CASE WHEN $7 IS NOT NULL THEN json_build_object('corr', $7)::text END
 WHERE EXISTS (SELECT 1 FROM node WHERE node_id = $6 AND state = 'RUN')
   AND ($8 IS NULL OR NOT EXISTS (
        SELECT 1 FROM message o
         WHERE o.service_name = 'conversation' AND o.process_id = $2
           AND o.source_system = 'bridge.request' AND o.entity_type <> ALL($8)))
ON CONFLICT (correlation_id, source_system) DO NOTHING
RETURNING msg_id;

-- name: conv_find
-- prepare: text, text
SELECT msg_id, state, process_id AS conversation_id, entity_type AS origin, msg_timestamp,
       parent_msg_id AS request_msg_id,
       extract(epoch FROM now() - receive_timestamp) * 1000 AS age_ms
  FROM message WHERE correlation_id = $1 AND source_system = $2;

-- name: conv_insert_response
-- The response (nothing on a duplicate or through a node not in RUN, checked in the same
-- statement), and its request; no row when the request is unknown in this conversation.
-- prepare: text, text, text, timestamptz, text, bigint, boolean, text, text[], text
-- $7: the response is its request's last. $8: its corr (NULL: none), kept as envelope.
-- $10: the traceparent of the span taking it in (its send continues that trace).
-- $9: the origins of the caller's key (NULL: every one): a request of another origin is
-- unknown, as one that does not exist. The last column returned: the request was
-- completed (its final response settled, delivered or not), as opposed to open or closed
-- without a final response. A response whose request is gone from Redis is late unless the
-- request completed (add_response.lua).
WITH r AS (
    SELECT msg_id, state, process_id, entity_type, msg_timestamp, custom_data FROM message
     WHERE correlation_id = $2 AND source_system = 'bridge.request'
       AND process_id = $3 AND ($9 IS NULL OR entity_type = ANY($9))),
ins AS (
    INSERT INTO message (msg_timestamp, receive_timestamp, last_process_timestamp,
                         service_name, operation_name, object_id, entity_type,
                         correlation_id, process_id, payload, source_system, state,
                         failed_error_code, failed_desc, node_id,
                         parent_msg_id, parent_binding_type, response_last, envelope,
                         trace_parent)
    SELECT $4, now(), now(), 'conversation', 'response', $2, r.entity_type, $1, $3, $5,
           'bridge.response',
           CASE WHEN r.state = 'CANCEL' THEN 'CANCEL' ELSE 'IN_QUEUE' END,
           CASE WHEN r.state = 'CANCEL' THEN 'E_CANCELLED' END,
           CASE WHEN r.state = 'CANCEL' THEN 'its request was cancelled' END,
           $6, r.msg_id, 'HARD', $7,
           CASE WHEN $8 IS NOT NULL THEN json_build_object('corr', $8)::text END, $10
      FROM r
     WHERE EXISTS (SELECT 1 FROM node WHERE node_id = $6 AND state = 'RUN')
    ON CONFLICT (correlation_id, source_system) DO NOTHING
    RETURNING msg_id, state)
SELECT ins.msg_id, ins.state, r.msg_id AS request_msg_id, r.state AS request_state,
       r.entity_type AS origin, r.msg_timestamp AS request_ts,
       r.state IN ('OK', 'FAILED')
         AND r.custom_data IS DISTINCT FROM 'closed without a final response' AS request_done
  FROM r LEFT JOIN ins ON true;

-- name: conv_ok
-- prepare: bigint[], text
-- prefix: SET LOCAL synchronous_commit TO OFF;
UPDATE message SET state = 'OK', last_process_timestamp = now(),
                   custom_data = COALESCE($2, custom_data)
 WHERE msg_id = ANY($1) AND state NOT IN ('OK', 'FAILED', 'CANCEL');

-- name: conv_mark_late
-- prepare: bigint, bigint
-- A response handed to its client after its request had expired (sent before the outcome
-- it goes with, in the same transaction).
UPDATE message SET late_ms = $2 WHERE msg_id = $1 AND late_ms IS NULL;

-- name: conv_sent
-- prepare: bigint, text
UPDATE message SET state = 'WAITING_FOR_RES', last_process_timestamp = now(),
                   custom_data = 'asyncResponseId=' || $2
 WHERE msg_id = $1 AND state = 'IN_QUEUE';

-- name: conv_retry
-- A recoverable failure with attempts left: the attempt, when the retry is due (ms, the
-- clock's) and the awaited round it belongs to, for the rebuild from the rows (worker.rebuild).
-- prepare: bigint, integer, bigint
UPDATE message SET custom_data = format('retry=%s;at=%s;round=%s', $2, $3, failed_count)
 WHERE msg_id = $1 AND state = 'IN_QUEUE';

-- name: conv_group_awaited
-- prepare: bigint, text, text
UPDATE message SET state = 'PARTLY_FAILED', failed_count = failed_count + 1,
                   failed_error_code = $2, failed_desc = $3,
                   last_process_timestamp = now()
 WHERE parent_msg_id = $1 AND state IN ('IN_QUEUE', 'PARTLY_FAILED');

-- name: conv_back_in_queue
-- prepare: bigint
UPDATE message SET state = 'IN_QUEUE', last_process_timestamp = now()
 WHERE msg_id = $1 AND state = 'PARTLY_FAILED';

-- name: conv_group_cancel
-- prepare: bigint, text, text
UPDATE message SET state = 'CANCEL', failed_error_code = $2, failed_desc = $3,
                   last_process_timestamp = now()
 WHERE (parent_msg_id = $1 OR msg_id = $1) AND state NOT IN ('OK', 'FAILED', 'CANCEL');

-- name: conv_failed
-- prepare: bigint[], text, text
UPDATE message SET state = 'FAILED', failed_error_code = $2, failed_desc = $3,
                   last_process_timestamp = now()
 WHERE msg_id = ANY($1) AND state NOT IN ('OK', 'FAILED', 'CANCEL');

-- name: conv_failed_by_response
-- prepare: text[], text, text
UPDATE message SET state = 'FAILED', failed_error_code = $2, failed_desc = $3,
                   last_process_timestamp = now()
 WHERE correlation_id = ANY($1) AND source_system = 'bridge.response' AND state NOT IN ('OK', 'FAILED', 'CANCEL');

-- name: conv_expire_responses
-- prepare: double precision
UPDATE message
   SET state = CASE WHEN state = 'WAITING_FOR_RES' THEN 'OK' ELSE 'FAILED' END,
       failed_error_code = CASE WHEN state = 'WAITING_FOR_RES' THEN failed_error_code
                                ELSE 'E_AWAITED_TTL' END,
       failed_desc = CASE WHEN state = 'WAITING_FOR_RES' THEN failed_desc
                          ELSE 'AWAITED_MESSAGE_TTL spent before delivery' END,
       last_process_timestamp = now()
 WHERE state IN ('IN_QUEUE', 'PARTLY_FAILED', 'WAITING_FOR_RES')
   AND last_process_timestamp < now() - make_interval(secs => $1)
   AND service_name = 'conversation' AND operation_name = 'response';

-- name: conv_close_requests
-- prepare: double precision
UPDATE message SET state = 'OK', last_process_timestamp = now(),
                   custom_data = 'closed without a final response'
 WHERE service_name = 'conversation' AND operation_name = 'request'
   AND state = 'WAITING_FOR_RES'
   AND last_process_timestamp < now() - make_interval(secs => $1)
   AND NOT EXISTS (SELECT 1 FROM message c
                    WHERE c.parent_msg_id = message.msg_id AND c.state NOT IN ('OK', 'FAILED', 'CANCEL'));

-- name: drain_holders_gone
-- Of the backend pids running drains hold, those whose backend is gone (the drain's worker
-- died, or PostgreSQL restarted), with the server's start (ms since the epoch).
SELECT p AS pid,
       (extract(epoch FROM pg_postmaster_start_time()) * 1000)::bigint AS server_started_ms
  FROM unnest(CAST(:pids AS integer[])) AS p
 WHERE orderly_orphaned(p);

-- name: conv_op_find
-- A conversation row by its id and source (bridge.request / bridge.response), for the
-- operators' operations (worker/conversations/operations.py); its corr from the envelope.
-- $3: the origins of the caller's key (NULL: every one); a row of another origin is not
-- found. A row's conversation and origin never change: what is done with it after is done
-- to the caller's own.
-- prepare: text, text, text[]
SELECT msg_id, state, process_id AS conversation_id, entity_type AS origin,
       object_id AS request_id, parent_msg_id AS request_msg_id,
       CAST(envelope AS json) ->> 'corr' AS corr
  FROM message WHERE correlation_id = $1 AND source_system = $2
   AND ($3 IS NULL OR entity_type = ANY($3));

-- name: conv_op_cancel
-- Responses an operator deleted or removed: CANCEL, with the audit entry ($5: its action);
-- with $2 (a request's msg_id) the request and every response of it not final too.
-- prepare: bigint[], bigint, text, text, text
UPDATE message SET state = 'CANCEL', failed_error_code = 'E_CANCELLED', failed_desc = $4,
       last_process_timestamp = now(),
       audit = audit || jsonb_build_array(jsonb_build_object(
           'at', now(), 'action', $5, 'by', $3, 'note', $4, 'from', state,
           'error', failed_error_code))
 WHERE (msg_id = ANY($1) OR msg_id = $2 OR parent_msg_id = $2)
   AND service_name = 'conversation' AND state NOT IN ('OK', 'FAILED', 'CANCEL')
RETURNING msg_id;

-- name: conv_op_awaited
-- Responses an operator set AWAITED ($7: the error code) or gave a new awaited date ($7
-- NULL: code and description kept): PARTLY_FAILED for the round Redis counts, the date
-- (ms, the clock's) kept in custom_data for a rebuild (worker/conversations/rebuild.py).
-- prepare: bigint[], bigint[], integer[], text, text, text, text
UPDATE message m SET state = 'PARTLY_FAILED', failed_count = u.round,
       failed_error_code = COALESCE($7, m.failed_error_code),
       failed_desc = CASE WHEN $7 IS NULL THEN m.failed_desc ELSE $6 END,
       custom_data = format('awaited=%s;round=%s', u.at, u.round),
       last_process_timestamp = now(),
       audit = m.audit || jsonb_build_array(jsonb_build_object(
           'at', now(), 'action', $4, 'by', $5, 'note', $6, 'from', m.state,
           'error', m.failed_error_code, 'awaited_to_date_ms', u.at))
  FROM unnest($1, $2, $3) AS u(id, at, round)
 WHERE m.msg_id = u.id AND m.state IN ('IN_QUEUE', 'PARTLY_FAILED');

-- name: conv_op_audit_removal
-- A removal of a response's references an operator scheduled (removeAllReferencesAtTime):
-- its audit entry holds the time (ms, the clock's), which a rebuild of Redis schedules again.
-- prepare: bigint, text, text, text, bigint
UPDATE message SET audit = audit || jsonb_build_array(jsonb_build_object(
           'at', now(), 'action', $2, 'by', $3, 'note', $4, 'from', state,
           'remove_at_ms', $5))
 WHERE msg_id = $1;
