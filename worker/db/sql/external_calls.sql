-- External calls (obsolete/duplicate rules) and the request/response log of HTTP exchanges.

-- name: orderly_call_take
-- prepare: bigint, timestamptz, text, text
INSERT INTO external_call AS e (msg_id, operation_name, entity_id, state, msg_timestamp,
                                creation_timestamp, last_update_timestamp, failed_count)
VALUES ($1, $3, $4, 'PROCESSING', $2, now(), now(), 0)
ON CONFLICT (operation_name, entity_id) DO UPDATE
   SET state = 'PROCESSING', msg_id = EXCLUDED.msg_id,
       msg_timestamp = EXCLUDED.msg_timestamp, last_update_timestamp = now(),
       failed_count = CASE WHEN e.msg_id = EXCLUDED.msg_id THEN e.failed_count ELSE 0 END
 WHERE (e.state <> 'PROCESSING' OR e.msg_id = EXCLUDED.msg_id)
   AND (EXCLUDED.msg_timestamp > e.msg_timestamp
        OR (EXCLUDED.msg_timestamp = e.msg_timestamp AND e.state <> 'OK'))
RETURNING call_id;

-- name: orderly_call_row
-- prepare: text, text
SELECT msg_id, state, msg_timestamp FROM external_call
 WHERE operation_name = $1 AND entity_id = $2;

-- name: orderly_call_done
-- prepare: bigint, bigint, boolean
UPDATE external_call
   SET state = CASE WHEN $3 THEN 'OK' ELSE 'FAILED' END,
       failed_count = failed_count + CASE WHEN $3 THEN 0 ELSE 1 END,
       last_update_timestamp = now()
 WHERE call_id = $1 AND msg_id = $2 AND state = 'PROCESSING'
RETURNING state;

-- name: orderly_log_request
-- prepare: bigint, text, text, text
INSERT INTO request (msg_id, res_join_id, uri, req_envelope, req_timestamp)
VALUES ($1, $2, $3, $4, now())
ON CONFLICT (uri, res_join_id) DO UPDATE
   SET msg_id = EXCLUDED.msg_id, req_envelope = EXCLUDED.req_envelope,
       req_timestamp = now()
RETURNING req_id;

-- name: orderly_log_response
-- prepare: bigint, bigint, text, boolean, text
INSERT INTO response (req_id, msg_id, res_envelope, failed, failed_reason, res_timestamp)
VALUES ($1, $2, $3, $4, $5, now())
RETURNING res_id;
-- name: source_system_put
INSERT INTO source_system (name, confirmation_url, timeout_ms, updated_at)
VALUES (:name, :url, :timeout, now())
ON CONFLICT (name) DO UPDATE
   SET confirmation_url = EXCLUDED.confirmation_url,
       timeout_ms = EXCLUDED.timeout_ms, updated_at = now();

-- name: source_system_list
SELECT name, confirmation_url, timeout_ms FROM source_system ORDER BY name;

-- name: confirmation_take
-- Due confirmations, leased (worker.core.due): due again after :lease_s should their task be
-- lost; each try is fenced by the claim token it was taken with.
UPDATE external_call
   SET state = 'PROCESSING', last_update_timestamp = now(), claim = :token, claim_pid = NULL,
       next_attempt_at = now() + make_interval(secs => :lease_s)
 WHERE call_id IN (
       SELECT call_id FROM external_call
        WHERE next_attempt_at <= now() AND operation_name = 'orderly.confirmation'
          AND state IN ('PROCESSING', 'FAILED')
        ORDER BY next_attempt_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED)
RETURNING call_id, claim;

-- name: confirmation_next_due
-- Milliseconds until the earliest confirmation try is due (confirmation_take's rows; NULL
-- when none waits): how long an idle beat may wait (worker.core.due).
SELECT extract(epoch FROM min(next_attempt_at) - now()) * 1000
  FROM external_call
 WHERE operation_name = 'orderly.confirmation' AND state IN ('PROCESSING', 'FAILED');

-- name: confirmation_release
-- Taken under :token but not handed to the broker: due again at once.
UPDATE external_call SET next_attempt_at = now()
 WHERE call_id = ANY(:ids) AND state = 'PROCESSING' AND claim = :token;

-- name: confirmation_start
-- The try a task was handed, only while its claim still holds it and no live worker is on it
-- (a task the broker gave out twice): the claim records the backend pid of the connection the
-- worker holds until it settles the try (its liveness; confirmations_release_orphans).
WITH started AS (
    UPDATE external_call
       SET claim_pid = pg_backend_pid(), last_update_timestamp = now()
     WHERE call_id = :id AND state = 'PROCESSING' AND claim = :claim
       AND (claim_pid IS NULL OR orderly_orphaned(claim_pid))
    RETURNING msg_id, failed_count)
SELECT started.msg_id, started.failed_count, m.correlation_id,
       m.source_system, m.state, m.failed_error_code, m.failed_desc,
       s.confirmation_url, s.timeout_ms
  FROM started
  JOIN message m ON m.msg_id = started.msg_id
  LEFT JOIN source_system s ON s.name = m.source_system;

-- name: confirmations_release_orphans
-- Tries whose worker died (its connection gone, for :grace_s) are due again at once, the
-- death counted in lost_count; at :limit deaths the confirmation is FAILED_END (quarantined:
-- no further tries). A try older than the server's start lost its connection to a PostgreSQL
-- restart, not to its worker: not counted.
UPDATE external_call c
   SET state = CASE WHEN c.lost_count + x.died >= :limit THEN 'FAILED_END' ELSE c.state END,
       lost_count = c.lost_count + x.died,
       next_attempt_at = CASE WHEN c.lost_count + x.died >= :limit THEN NULL ELSE now() END,
       last_update_timestamp = now(), claim = NULL, claim_pid = NULL
  FROM (SELECT call_id,
               CASE WHEN last_update_timestamp < pg_postmaster_start_time() THEN 0
                    ELSE 1 END AS died
          FROM external_call
         WHERE operation_name = 'orderly.confirmation' AND state = 'PROCESSING'
           AND claim IS NOT NULL AND claim_pid IS NOT NULL
           AND last_update_timestamp <= now() - make_interval(secs => :grace_s)
           AND orderly_orphaned(claim_pid)
         LIMIT :batch
         FOR UPDATE SKIP LOCKED) x
 WHERE c.call_id = x.call_id
RETURNING c.call_id, c.state;

-- name: confirmation_settle
-- The try this claim made: OK, FAILED (tried again after :wait_ms) or FAILED_END. A final
-- state recorded anew meanwhile (the trigger clears the claim) or a try taken again (a new
-- claim) is not settled by it.
UPDATE external_call
   SET state = :state,
       failed_count = failed_count + CASE WHEN :state = 'OK' THEN 0 ELSE 1 END,
       next_attempt_at = CASE WHEN :state = 'FAILED'
                              THEN now() + make_interval(secs => :wait_ms / 1000.0) END,
       last_update_timestamp = now(), claim = NULL, claim_pid = NULL
 WHERE call_id = :id AND state = 'PROCESSING' AND claim = :claim
RETURNING state;
