-- Conversation rows in the message store: requests, responses and their outcomes.
-- Redis holds the order (worker/lua); PostgreSQL the durable truth.

-- name: conv_foreign_request
-- Whether the conversation holds a request of an origin not among $2 (a bound key's).
-- prepare: text, text[]
SELECT 1 AS foreign_request FROM message
 WHERE service_name = 'conversation' AND process_id = $1 AND source_system = 'bridge.request'
   AND entity_type <> ALL($2)
 LIMIT 1;

-- name: conv_lock_all
-- Sent before conv_insert_requests in its transaction, the locks of its conversations in key
-- order (two groups never wait for each other's in turn): a request of a bound key and
-- another tenant's, both first in a new conversation, cannot both see it empty.
-- prepare: text[]
SELECT pg_advisory_xact_lock(k)
  FROM (SELECT DISTINCT hashtextextended('conversation:' || c, 0) AS k
          FROM unnest($1) AS u(c) ORDER BY 1) s;

-- name: conv_insert_requests
-- New requests (one, or a group submitted together), sent after conv_lock_all, inserted in
-- the order given: those inserted (ids and conversations). Only through a node in RUN, checked in the same
-- statement (as orderly_insert_messages); nothing is inserted on a duplicate or a node that
-- refuses input. $7: each one's envelope, the request as received (its corr, if any, under
-- "corr": read back by conv_request_rows and the rebuild). $8: each
-- one's caller's origins as a JSON array (NULL: every one): such a caller joins no
-- conversation that holds a request of another origin. Two requests of one new conversation
-- with different callers' origins are never in one statement (it sees the conversation as it
-- was before it). others_open: the conversation had open rows before this statement that
-- may still be in Redis: responses received within the last $9 ms (AWAITED_MESSAGE_TTL),
-- requests within the last $10 ms (MESSAGE_TTL) (register_request.lua: its counter or list
-- gone while they are open was evicted).
-- prepare: text[], text[], text[], timestamptz[], text[], bigint, text[], text[], bigint, bigint
INSERT INTO message (msg_timestamp, receive_timestamp, last_process_timestamp,
                     service_name, operation_name, object_id, entity_type,
                     correlation_id, process_id, payload, source_system, state, node_id,
                     envelope)
SELECT i.ts, now(), now(), 'conversation', 'request', i.request_id, i.origin, i.request_id,
       i.conversation_id, i.payload, 'bridge.request', 'WAITING_FOR_RES', $6, i.envelope
  FROM unnest($1, $2, $3, $4, $5, $7, $8)
       WITH ORDINALITY AS i(request_id, conversation_id, origin, ts, payload, envelope, origins,
                            n)
 WHERE EXISTS (SELECT 1 FROM node WHERE node_id = $6 AND state = 'RUN')
   AND (i.origins IS NULL OR NOT EXISTS (
        SELECT 1 FROM message o
         WHERE o.service_name = 'conversation' AND o.process_id = i.conversation_id
           AND o.source_system = 'bridge.request'
           AND o.entity_type NOT IN (SELECT json_array_elements_text(i.origins::json))))
 ORDER BY i.n
ON CONFLICT (correlation_id, source_system) DO NOTHING
RETURNING msg_id, correlation_id AS request_id, process_id AS conversation_id,
          EXISTS (SELECT 1 FROM message o
                   WHERE o.service_name = 'conversation' AND o.process_id = message.process_id
                     AND o.state IN ('WAITING_FOR_RES', 'IN_QUEUE', 'PARTLY_FAILED')
                     AND o.receive_timestamp > now() - CASE o.operation_name
                           WHEN 'request' THEN $10 ELSE $9 END * interval '1 millisecond')
            AS others_open;

-- name: conv_find
-- prepare: text, text
SELECT msg_id, state, process_id AS conversation_id, entity_type AS origin, msg_timestamp,
       parent_msg_id AS request_msg_id,
       extract(epoch FROM now() - receive_timestamp) * 1000 AS age_ms
  FROM message WHERE correlation_id = $1 AND source_system = $2;

-- name: conv_insert_responses
-- New responses (one, or a group submitted together), inserted in the order given, each
-- IN_QUEUE under its request (CANCEL with it), only through a node in RUN (checked in the same
-- statement): one row each, in that order, with the response inserted (msg_id NULL: not
-- inserted: a repeat, its request unknown, or the node not in RUN) and its request (NULL:
-- unknown in that conversation, or of an origin the caller does not hold). Two with one
-- response id both name the inserted row: the first is it. request_done: the request was
-- completed (its final response settled, delivered or not), as opposed to open or closed
-- without a final response; a response whose request is gone from Redis is late unless the
-- request completed (add_response.lua). others_open: the conversation had open responses
-- received within the last $11 ms (AWAITED_MESSAGE_TTL) before this statement (so its order
-- must be in Redis).
-- prepare: text[], text[], text[], timestamptz[], text[], bigint, boolean[], text[], text[], text[], bigint
-- $8: each one's envelope, the response as received (its corr under "corr"); $9: each one's
-- caller's origins as a JSON array (NULL: every one); $10: each one's traceparent.
WITH i AS (
    SELECT * FROM unnest($1, $2, $3, $4, $5, $7, $8, $9, $10)
      WITH ORDINALITY AS i(response_id, request_id, conversation_id, ts, payload, last,
                           envelope, origins, trace, n)),
r AS (
    SELECT i.n, m.msg_id, m.state, m.entity_type, m.msg_timestamp, m.custom_data
      FROM i JOIN message m
        ON m.correlation_id = i.request_id AND m.source_system = 'bridge.request'
       AND m.process_id = i.conversation_id
       AND (i.origins IS NULL
            OR m.entity_type IN (SELECT json_array_elements_text(i.origins::json)))),
ins AS (
    INSERT INTO message (msg_timestamp, receive_timestamp, last_process_timestamp,
                         service_name, operation_name, object_id, entity_type,
                         correlation_id, process_id, payload, source_system, state,
                         failed_error_code, failed_desc, node_id,
                         parent_msg_id, parent_binding_type, response_last, envelope,
                         trace_parent)
    SELECT i.ts, now(), now(), 'conversation', 'response', i.request_id, r.entity_type,
           i.response_id, i.conversation_id, i.payload, 'bridge.response',
           CASE WHEN r.state = 'CANCEL' THEN 'CANCEL' ELSE 'IN_QUEUE' END,
           CASE WHEN r.state = 'CANCEL' THEN 'E_CANCELLED' END,
           CASE WHEN r.state = 'CANCEL' THEN 'its request was cancelled' END,
           $6, r.msg_id, 'HARD', i.last, i.envelope, i.trace
      FROM i JOIN r USING (n)
     WHERE EXISTS (SELECT 1 FROM node WHERE node_id = $6 AND state = 'RUN')
     ORDER BY i.n
    ON CONFLICT (correlation_id, source_system) DO NOTHING
    RETURNING msg_id, state, correlation_id)
SELECT ins.msg_id, ins.state, r.msg_id AS request_msg_id, r.state AS request_state,
       r.entity_type AS origin, r.msg_timestamp AS request_ts,
       r.state IN ('OK', 'FAILED')
         AND r.custom_data IS DISTINCT FROM 'closed without a final response' AS request_done,
       EXISTS (SELECT 1 FROM message o
                WHERE o.service_name = 'conversation' AND o.process_id = i.conversation_id
                  AND o.state IN ('WAITING_FOR_RES', 'IN_QUEUE', 'PARTLY_FAILED')
                  AND o.operation_name = 'response'
                  AND o.receive_timestamp > now() - $11 * interval '1 millisecond')
         AS others_open
  FROM i LEFT JOIN r USING (n) LEFT JOIN ins ON ins.correlation_id = i.response_id
 ORDER BY i.n;

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
