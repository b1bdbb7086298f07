-- Publish/subscribe (worker.pubsub): rooms, event types, publishers and subscriptions; the
-- events and one delivery per matching subscription; the due-time index the ticker moves to
-- the broker; the claim, the outcome and its published_messages row; pull subscriptions.
--
-- Every statement that changes a delivery's state writes its logs in the same statement:
-- published_messages (one row per attempt, PENDING from when the attempt is scheduled, then
-- its outcome; at most one PENDING row per delivery, its current attempt), queue_message (a
-- row per state entered: Pending, In process, Completed, Error) and, for an Error, the
-- log_exception row it points at.

-- --- administration --------------------------------------------------------------------------

-- name: room_by_name
SELECT room_id, name, message_expiration_ms, delivery_delay_ms, delivery_delay_multiplier,
       delivery_attempts, status
  FROM room WHERE name = :name;

-- name: room_insert
INSERT INTO room (name, message_expiration_ms, delivery_delay_ms, delivery_delay_multiplier,
                  delivery_attempts, status, created_at)
VALUES (:name, :message_expiration_ms, :delivery_delay_ms, :delivery_delay_multiplier,
        :delivery_attempts, 'ACTIVE', now())
ON CONFLICT (name) DO NOTHING
RETURNING room_id, name, message_expiration_ms, delivery_delay_ms, delivery_delay_multiplier,
          delivery_attempts, status;

-- name: room_update
UPDATE room
   SET message_expiration_ms = :message_expiration_ms, delivery_delay_ms = :delivery_delay_ms,
       delivery_delay_multiplier = :delivery_delay_multiplier,
       delivery_attempts = :delivery_attempts, status = :status
 WHERE room_id = :room_id
RETURNING room_id, name, message_expiration_ms, delivery_delay_ms, delivery_delay_multiplier,
          delivery_attempts, status;

-- name: room_lock
SELECT room_id, name, message_expiration_ms, delivery_delay_ms, delivery_delay_multiplier,
       delivery_attempts, status
  FROM room WHERE name = :name FOR UPDATE;

-- name: room_list
-- Each room with how many of its events matched no subscription (unroutable).
SELECT r.room_id, r.name, r.message_expiration_ms, r.delivery_delay_ms,
       r.delivery_delay_multiplier, r.delivery_attempts, r.status,
       (SELECT count(*) FROM event e WHERE e.room_id = r.room_id AND e.unroutable) AS unroutable
  FROM room r ORDER BY r.name;

-- name: event_type_find
SELECT event_type_id FROM event_type WHERE room_id = :room_id AND name = :name;

-- name: event_type_insert
-- The type is created with its first version (a concurrent creation finds the other one).
INSERT INTO event_type (room_id, name, created_at) VALUES (:room_id, :name, now())
ON CONFLICT (room_id, name) DO UPDATE SET name = EXCLUDED.name
RETURNING event_type_id;

-- name: event_type_version_insert
INSERT INTO event_type_version (event_type_id, version, json_schema, created_at)
VALUES (:event_type_id, :version, CAST(:json_schema AS jsonb), now())
ON CONFLICT (event_type_id, version) DO NOTHING
RETURNING version;

-- name: event_type_list
SELECT t.name, v.version, v.json_schema AS schema
  FROM event_type t JOIN event_type_version v USING (event_type_id)
 WHERE t.room_id = :room_id
 ORDER BY t.name, v.version;

-- name: publisher_insert
INSERT INTO publisher (room_id, name) VALUES (:room_id, :name)
ON CONFLICT (room_id, name) DO NOTHING
RETURNING publisher_id;

-- name: subscription_insert
INSERT INTO subscription (room_id, name, kind, push_url, handler, event_type_id,
                          min_version, max_version, routing_key_pattern, delivery_delay_ms,
                          delivery_delay_multiplier, delivery_attempts, timeout_ms,
                          visibility_timeout_ms, order_key, rate_per_s, burst, max_in_flight,
                          status, created_at)
VALUES (:room_id, :name, :kind, :push_url, :handler, :event_type_id, :min_version,
        :max_version, :routing_key_pattern, :delivery_delay_ms, :delivery_delay_multiplier,
        :delivery_attempts, :timeout_ms, :visibility_timeout_ms, :order_key, :rate_per_s,
        :burst, :max_in_flight, 'ACTIVE', now())
ON CONFLICT (room_id, name) DO NOTHING
RETURNING subscription_id;

-- name: subscription_lock
SELECT subscription_id, name, kind, push_url, handler, routing_key_pattern, delivery_delay_ms,
       delivery_delay_multiplier, delivery_attempts, timeout_ms, visibility_timeout_ms,
       order_key, rate_per_s, burst, max_in_flight, status
  FROM subscription WHERE subscription_id = :id FOR UPDATE;

-- name: subscription_update
UPDATE subscription
   SET push_url = :push_url, routing_key_pattern = :routing_key_pattern,
       delivery_delay_ms = :delivery_delay_ms,
       delivery_delay_multiplier = :delivery_delay_multiplier,
       delivery_attempts = :delivery_attempts, timeout_ms = :timeout_ms,
       visibility_timeout_ms = :visibility_timeout_ms, rate_per_s = :rate_per_s,
       burst = :burst, max_in_flight = :max_in_flight, status = :status
 WHERE subscription_id = :id;

-- name: subscription_set_status
UPDATE subscription SET status = :status WHERE subscription_id = :id RETURNING subscription_id;

-- name: subscription_list
SELECT s.subscription_id, s.name, s.kind, s.push_url, s.handler, t.name AS event_type,
       s.min_version, s.max_version, s.routing_key_pattern, s.delivery_delay_ms,
       s.delivery_delay_multiplier, s.delivery_attempts, s.rate_per_s, s.burst,
       s.max_in_flight, s.status, s.failures, s.failing_since, s.probe_at, s.disabled_at,
       s.disabled_reason
  FROM subscription s LEFT JOIN event_type t USING (event_type_id)
 WHERE s.room_id = :room_id ORDER BY s.subscription_id;

-- name: subscription_deliveries
-- A room's deliveries per subscription and state (a subscription without any: one row with
-- a NULL state); for PULL subscriptions, how many are due now (ix_delivery_subscription_state).
SELECT s.subscription_id, d.state, count(d.delivery_id) AS n,
       count(*) FILTER (WHERE d.pull AND d.state = 'PENDING' AND d.next_attempt_at <= now())
         AS due
  FROM subscription s LEFT JOIN delivery d ON d.subscription_id = s.subscription_id
 WHERE s.room_id = :room_id
 GROUP BY s.subscription_id, d.state;

-- name: dead_letters_per_room
SELECT r.name AS room, count(*) AS n
  FROM delivery d JOIN subscription s USING (subscription_id) JOIN room r USING (room_id)
 WHERE d.state = 'DEAD'
   AND (CAST(:owned AS bigint[]) IS NULL OR d.subscription_id = ANY(CAST(:owned AS bigint[])))
 GROUP BY r.name;

-- --- publish -----------------------------------------------------------------------------------

-- name: publish_context
-- Everything a publish needs of its room in one round trip: the room, its publishers and its
-- active subscriptions.
SELECT r.room_id, r.status, r.message_expiration_ms,
       COALESCE((SELECT json_object_agg(p.name, p.publisher_id)
                   FROM publisher p WHERE p.room_id = r.room_id), '{}') AS publishers,
       COALESCE((SELECT json_agg(json_build_object(
                                     'subscription_id', s.subscription_id, 'kind', s.kind,
                                     'event_type_id', s.event_type_id,
                                     'routing_key_pattern', s.routing_key_pattern,
                                     'order_key', s.order_key, 'min_version', s.min_version,
                                     'max_version', s.max_version, 'name', s.name)
                                 ORDER BY s.subscription_id)
                   FROM subscription s
                  WHERE s.room_id = r.room_id AND s.status = 'ACTIVE'), '[]') AS subscriptions
  FROM room r WHERE r.name = :name;

-- name: publish_event_type
-- An event type's version (:version, or its latest when NULL) and its JSON schema.
SELECT t.event_type_id, v.version, v.json_schema
  FROM event_type t JOIN event_type_version v USING (event_type_id)
 WHERE t.room_id = :room_id AND t.name = :name
   AND v.version = COALESCE(CAST(:version AS integer),
                            (SELECT max(version) FROM event_type_version
                              WHERE event_type_id = t.event_type_id));

-- name: event_type_exists
SELECT 1 FROM event_type WHERE room_id = :room_id AND name = :name;

-- name: event_type_versions
-- The versions an event type has, ascending.
SELECT v.version FROM event_type_version v WHERE v.event_type_id = :event_type_id
 ORDER BY v.version;

-- name: events_insert
-- Events from parallel arrays (one row per index: each with the traceparent of the publish
-- that made it), returning their ids by correlation id.
-- With :node_id, only through that node in RUN (checked in the same statement): nothing is
-- inserted while it drains or is stopped.
INSERT INTO event (correlation_id, token, room_id, event_type_id, version, routing_key,
                   payload, publisher_id, user_id, impersonator_id, published_at, deliver_at,
                   expires_at, unroutable, idempotency_key, idempotency_hash, trace_parent)
SELECT c, t, :room_id, CAST(:event_type_id AS bigint), CAST(:version AS integer), k,
       CAST(p AS jsonb), CAST(:publisher_id AS bigint), CAST(:user_id AS text),
       CAST(:impersonator_id AS text), :published_at, d, CAST(:expires_at AS timestamptz), u,
       CAST(:idempotency_key AS text), CAST(:idempotency_hash AS text), tp
  FROM unnest(CAST(:correlation_ids AS text[]), CAST(:tokens AS text[]),
              CAST(:routing_keys AS text[]), CAST(:payloads AS text[]),
              CAST(:deliver_ats AS timestamptz[]), CAST(:unroutables AS boolean[]),
              CAST(:trace_parents AS text[]))
       AS x(c, t, k, p, d, u, tp)
 WHERE CAST(:node_id AS bigint) IS NULL
    OR EXISTS (SELECT 1 FROM node WHERE node_id = CAST(:node_id AS bigint) AND state = 'RUN')
RETURNING event_id, correlation_id;

-- name: idempotency_key_lock
-- Held until the publish commits: a concurrent publish with the same key waits, and its
-- next statement (a new snapshot) sees this one's event.
SELECT pg_advisory_xact_lock(hashtextextended(CAST(:room_id AS text) || chr(31) || :key, 11));

-- name: event_by_idempotency_key
-- The event a publish with this key stored before, and its deliveries.
SELECT e.event_id, e.correlation_id, e.unroutable, e.idempotency_hash,
       COALESCE(array_agg(d.delivery_id ORDER BY d.delivery_id)
                FILTER (WHERE d.delivery_id IS NOT NULL), '{}') AS deliveries
  FROM event e LEFT JOIN delivery d ON d.event_id = e.event_id
 WHERE e.room_id = :room_id AND e.idempotency_key = :key
 GROUP BY e.event_id;

-- name: deliveries_insert
-- Deliveries from parallel arrays; scheduled_at is the due-time index: a PULL delivery's due
-- time, a push delivery's lease (due now: handed to the broker after the commit) or due time.
-- Each is accepted PENDING: its first attempt's published_messages row and its Pending row
-- in the queue log (scheduled for a $delay's due time). One an event already has for its
-- subscription (a backfill racing another) is not made again.
WITH made AS (
    INSERT INTO delivery (event_id, subscription_id, state, pull, order_value, attempt,
                          next_attempt_at, scheduled_at)
    SELECT e, s, 'PENDING', pl, ov, 0, n, sc
      FROM unnest(CAST(:event_ids AS bigint[]), CAST(:subscription_ids AS bigint[]),
                  CAST(:pulls AS boolean[]), CAST(:order_values AS text[]),
                  CAST(:next_attempt_ats AS timestamptz[]), CAST(:scheduled_ats AS timestamptz[]))
           AS x(e, s, pl, ov, n, sc)
    ON CONFLICT (event_id, subscription_id) DO NOTHING
    RETURNING delivery_id, event_id, subscription_id, next_attempt_at),
published AS (
    INSERT INTO published_messages (correlation_id, delivery_id, event_id, subscription_id,
                                    attempt, published_at, next_attempt_at, outcome)
    SELECT e.correlation_id, m.delivery_id, m.event_id, m.subscription_id, 0, e.published_at,
           m.next_attempt_at, 'PENDING'
      FROM made m JOIN event e USING (event_id)),
queued AS (
    INSERT INTO queue_message (delivery_id, attempt, message, routing_key,
                               scheduled_start_time, state)
    SELECT m.delivery_id, 0, CAST(e.payload AS text), e.routing_key,
           CASE WHEN e.deliver_at > e.published_at THEN e.deliver_at END, 'Pending'
      FROM made m JOIN event e USING (event_id))
SELECT delivery_id, event_id, subscription_id FROM made;

-- --- due work and upkeep -----------------------------------------------------------------------

-- name: deliveries_take_due
-- Due push deliveries (a $delay, a retry wait, or a lease that ran out), leased for :lease_s
-- (worker.core.due): a task lost with its worker brings them back after it. With each, whether
-- it goes in a batch of its own: a worker died holding it (alone, counted in lost_count; or in
-- a batch of several, which isolated it).
UPDATE delivery d SET scheduled_at = now() + make_interval(secs => :lease_s)
 WHERE d.delivery_id IN (
       SELECT delivery_id FROM delivery
        WHERE state = 'PENDING' AND NOT pull AND scheduled_at <= now()
        ORDER BY scheduled_at, delivery_id
        LIMIT :limit
        FOR UPDATE SKIP LOCKED)
RETURNING d.delivery_id, d.lost_count > 0 OR d.isolate AS alone;

-- name: deliveries_next_due
-- Milliseconds until the earliest push delivery is due (deliveries_take_due's rows; NULL when
-- none waits): how long an idle beat may wait (worker.core.due).
SELECT extract(epoch FROM min(scheduled_at) - now()) * 1000
  FROM delivery WHERE state = 'PENDING' AND NOT pull;

-- name: deliveries_release
UPDATE delivery SET scheduled_at = now()
 WHERE delivery_id = ANY(:ids) AND state = 'PENDING';

-- name: deliveries_release_stuck
-- A claim whose worker died (the connection it holds is gone, for :grace_s; or, whatever its
-- worker, a claim older than its subscription's timeout per delivery of a batch plus
-- :stale_s): back to PENDING, due at once (delivered at least once). The lost try counts as
-- an attempt, and its death in lost_count when its batch took it alone (lone_claim): a
-- delivery that keeps killing its worker ends DEAD with E_WORKER_LOST at :limit deaths or
-- when its attempts are spent. The deliveries of a batch of several are not counted (which
-- one its worker was sending is not known): they are isolated instead, claimed alone from
-- then on, where a death counts. A claim older than the server's start lost its connection
-- to a PostgreSQL restart, not to its worker: not counted.
-- The lost attempt is logged FAILED (or DEAD) with a WorkerLost exception.
WITH back AS (
    UPDATE delivery d
       SET state = CASE WHEN d.attempt + 1 >= x.attempts OR d.lost_count + x.died >= :limit
                        THEN 'DEAD' ELSE 'PENDING' END,
           attempt = d.attempt + 1, lost_count = d.lost_count + x.died,
           scheduled_at = now(), next_attempt_at = now(),
           claimed_at = NULL, claim = NULL, claim_pid = NULL, isolate = d.isolate OR x.batched,
           last_error = CASE WHEN d.lost_count + x.died >= :limit
                             THEN format('E_WORKER_LOST: quarantined: its worker died %s times '
                                         'while delivering it', d.lost_count + x.died)
                             WHEN x.batched AND d.attempt + 1 < x.attempts
                             THEN 'E_WORKER_LOST: the worker holding this delivery in a batch '
                                  'of several died (not counted; it is sent alone from now on)'
                             ELSE 'E_WORKER_LOST: the worker holding this delivery died' END
      FROM (SELECT o.delivery_id, COALESCE(s.delivery_attempts, r.delivery_attempts) AS attempts,
                   CASE WHEN o.claimed_at < pg_postmaster_start_time() THEN 0
                        WHEN NOT o.lone_claim THEN 0
                        ELSE 1 END AS died,
                   o.claimed_at >= pg_postmaster_start_time() AND NOT o.lone_claim AS batched,
                   o.claimed_at AS started
              FROM delivery o
              JOIN subscription s ON s.subscription_id = o.subscription_id
              JOIN room r ON r.room_id = s.room_id
             WHERE o.state = 'IN_PROCESS' AND NOT o.pull
               AND ((o.claimed_at <= now() - make_interval(secs => :grace_s)
                     AND orderly_orphaned(o.claim_pid))
                 OR o.claimed_at < now() - make_interval(secs => s.timeout_ms * :per_batch / 1000.0
                                                                 + :stale_s))
             LIMIT :batch
             FOR UPDATE OF o SKIP LOCKED) x
     WHERE d.delivery_id = x.delivery_id
    RETURNING d.delivery_id, d.event_id, d.subscription_id, d.state, d.attempt, d.last_error,
              d.next_attempt_at, x.started),
logged AS (
    UPDATE published_messages p
       SET outcome = CASE WHEN back.state = 'DEAD' THEN 'DEAD' ELSE 'FAILED' END,
           error = back.last_error
      FROM back
     WHERE p.delivery_id = back.delivery_id AND p.outcome = 'PENDING'),
republished AS (
    INSERT INTO published_messages (correlation_id, delivery_id, event_id, subscription_id,
                                    attempt, published_at, next_attempt_at, outcome)
    SELECT e.correlation_id, back.delivery_id, back.event_id, back.subscription_id,
           back.attempt, now(), back.next_attempt_at, 'PENDING'
      FROM back JOIN event e USING (event_id)
     WHERE back.state = 'PENDING'),
failure AS (
    INSERT INTO log_exception (time, type, message, delivery_id, attempt)
    SELECT now(), 'WorkerLost', back.last_error, back.delivery_id, back.attempt - 1 FROM back
    RETURNING id, delivery_id),
queued AS (
    INSERT INTO queue_message (delivery_id, attempt, message, routing_key,
                               scheduled_start_time, start_time, end_time, state, exception_id)
    SELECT back.delivery_id, back.attempt - 1, CAST(e.payload AS text), e.routing_key,
           CAST(NULL AS timestamptz), back.started, now(), 'Error', failure.id
      FROM back JOIN event e USING (event_id) JOIN failure USING (delivery_id)
    UNION ALL
    SELECT back.delivery_id, back.attempt, CAST(e.payload AS text), e.routing_key,
           back.next_attempt_at, NULL, NULL, 'Pending', NULL
      FROM back JOIN event e USING (event_id)
     WHERE back.state = 'PENDING')
SELECT delivery_id, state FROM back;

-- name: pulled_return_unacked
-- A pulled delivery not ACKed within its visibility (the subscription's visibility timeout
-- from its pull, or what its receipt's holder set since: pull_extend) comes back (or,
-- its attempts spent, is dead-lettered): its pull's attempt is logged FAILED (or DEAD) with a
-- NotAcknowledged exception, and the next one PENDING.
WITH back AS (
    UPDATE delivery d
       SET state = CASE WHEN d.attempt + 1 >= COALESCE(s.delivery_attempts, r.delivery_attempts)
                        THEN 'DEAD' ELSE 'PENDING' END,
           attempt = d.attempt + 1, next_attempt_at = now(), claimed_at = NULL,
           receipt = NULL, last_error = 'not ACKed within the visibility timeout'
      FROM subscription s, room r
     WHERE d.subscription_id = s.subscription_id AND r.room_id = s.room_id
       AND d.pull AND d.state = 'IN_PROCESS' AND d.scheduled_at <= now()
    RETURNING d.delivery_id, d.event_id, d.subscription_id, d.state, d.attempt,
              d.next_attempt_at, s.visibility_timeout_ms),
logged AS (
    UPDATE published_messages p
       SET outcome = CASE WHEN back.state = 'DEAD' THEN 'DEAD' ELSE 'FAILED' END,
           error = 'not ACKed in time'
      FROM back
     WHERE p.delivery_id = back.delivery_id AND p.outcome = 'PENDING'),
republished AS (
    INSERT INTO published_messages (correlation_id, delivery_id, event_id, subscription_id,
                                    attempt, published_at, next_attempt_at, outcome)
    SELECT e.correlation_id, back.delivery_id, back.event_id, back.subscription_id,
           back.attempt, now(), back.next_attempt_at, 'PENDING'
      FROM back JOIN event e USING (event_id)
     WHERE back.state = 'PENDING'),
failure AS (
    INSERT INTO log_exception (time, type, message, delivery_id, attempt)
    SELECT now(), 'NotAcknowledged',
           format('not ACKed within the visibility timeout (%s ms)', back.visibility_timeout_ms),
           back.delivery_id, back.attempt - 1
      FROM back
    RETURNING id, delivery_id),
queued AS (
    INSERT INTO queue_message (delivery_id, attempt, message, routing_key,
                               scheduled_start_time, start_time, end_time, state, exception_id)
    SELECT back.delivery_id, back.attempt - 1, CAST(e.payload AS text), e.routing_key,
           CAST(NULL AS timestamptz), CAST(NULL AS timestamptz), now(), 'Error', failure.id
      FROM back JOIN event e USING (event_id) JOIN failure USING (delivery_id)
    UNION ALL
    SELECT back.delivery_id, back.attempt, CAST(e.payload AS text), e.routing_key, NULL, NULL,
           NULL, 'Pending', NULL
      FROM back JOIN event e USING (event_id)
     WHERE back.state = 'PENDING')
SELECT count(*) FROM back;

-- name: pulled_expire
-- Pull deliveries nobody took before their room's expiration: EXPIRED, their attempt logged
-- EXPIRED, and an Error in the queue log with a MessageExpired exception.
WITH gone AS (
    UPDATE delivery d SET state = 'EXPIRED', last_error = 'past the room''s message expiration'
      FROM event e
     WHERE e.event_id = d.event_id AND d.pull AND d.state = 'PENDING'
       AND e.expires_at IS NOT NULL AND e.expires_at <= now()
    RETURNING d.delivery_id, d.event_id, d.attempt, e.expires_at),
logged AS (
    UPDATE published_messages p SET outcome = 'EXPIRED', error = 'expired untaken'
      FROM gone
     WHERE p.delivery_id = gone.delivery_id AND p.outcome = 'PENDING'),
failure AS (
    INSERT INTO log_exception (time, type, message, delivery_id, attempt)
    SELECT now(), 'MessageExpired',
           format('not pulled before the room''s message expiration (%s)', gone.expires_at),
           gone.delivery_id, gone.attempt
      FROM gone
    RETURNING id, delivery_id)
INSERT INTO queue_message (delivery_id, attempt, message, routing_key, end_time, state,
                           exception_id)
SELECT gone.delivery_id, gone.attempt, CAST(e.payload AS text), e.routing_key, now(), 'Error',
       failure.id
  FROM gone JOIN event e USING (event_id) JOIN failure USING (delivery_id);

-- --- delivery ------------------------------------------------------------------------------------

-- name: endpoints_lock
-- The PUSH endpoints (subscriptions) of a batch's deliveries, locked in key order until the
-- claim commits: the claim that follows counts their sends in flight and takes their one
-- probe with nothing racing it, whatever they looked like before the lock (and whatever
-- state their deliveries were in: one may turn PENDING before the claim reads it).
SELECT s.subscription_id
  FROM subscription s
 WHERE s.subscription_id IN (SELECT d.subscription_id FROM delivery d
                              WHERE d.delivery_id = ANY(:ids) AND NOT d.pull)
 ORDER BY s.subscription_id
   FOR NO KEY UPDATE;

-- name: deliveries_claim
-- Claim due push deliveries for one batch under the claim token :claim; an ordered
-- subscription's delivery only when no earlier one of its key is still open. An endpoint
-- (subscription) that is disabled takes none; one whose circuit is open (probe_at) takes one,
-- its probe, when the probe is due (and holds its next probe back until the probe's outcome
-- sets it); one that failed its last send takes one at a time until a send succeeds; one with
-- max_in_flight only as many as it has room for. What an endpoint does not take waits: until
-- its probe, or until a send of it ends (endpoint_release, at the latest after its timeout);
-- a disabled endpoint's for a day, or until it is enabled (endpoint_enable). A claimed one
-- refused a rate token is given back in the same transaction (deliveries_hold_back). The
-- claim records the backend pid of the connection the worker holds until the batch is
-- settled (its liveness), whether it took the delivery alone (lone_claim: only then does its
-- worker's death count against it), and each claimed delivery's In process row in the queue
-- log. A delivery whose worker died in a batch of several (isolate) is claimed alone: the
-- first one of them is, and the rest of the batch stays due at once for other batches. It
-- commits without waiting for the disk: a crash can only make a delivery come again.
SET LOCAL synchronous_commit TO OFF;
WITH cand AS (
    SELECT d.delivery_id, d.subscription_id, s.max_in_flight, s.probe_at, s.timeout_ms,
           s.failures, d.isolate,
           row_number() OVER (PARTITION BY d.subscription_id ORDER BY d.delivery_id) AS rn,
           CASE WHEN s.max_in_flight IS NOT NULL OR s.failures > 0 OR s.probe_at IS NOT NULL
                THEN (SELECT count(*) FROM delivery o
                       WHERE o.subscription_id = d.subscription_id AND o.state = 'IN_PROCESS'
                         AND NOT o.pull)
                ELSE 0 END AS in_flight
      FROM delivery d JOIN subscription s USING (subscription_id)
     WHERE d.delivery_id = ANY(:ids) AND d.state = 'PENDING' AND NOT d.pull
       AND d.next_attempt_at <= now() AND s.status = 'ACTIVE' AND s.disabled_at IS NULL
       AND (d.order_value IS NULL OR NOT EXISTS (
             SELECT 1 FROM delivery o
              WHERE o.subscription_id = d.subscription_id AND o.order_value = d.order_value
                AND o.event_id < d.event_id AND o.state IN ('PENDING', 'IN_PROCESS')))),
ready AS (
    SELECT c.delivery_id, c.subscription_id, c.probe_at IS NOT NULL AS probe, c.isolate
      FROM cand c
     WHERE CASE WHEN c.probe_at IS NOT NULL
                THEN c.probe_at <= now() AND c.rn = 1 AND c.in_flight = 0
                WHEN c.failures > 0 THEN c.rn = 1 AND c.in_flight = 0
                ELSE TRUE END
       AND (c.max_in_flight IS NULL OR c.rn <= c.max_in_flight - c.in_flight)),
chosen AS (
    SELECT r.delivery_id, r.subscription_id, r.probe
      FROM ready r
     WHERE NOT EXISTS (SELECT 1 FROM ready i WHERE i.isolate)
        OR r.delivery_id = (SELECT min(i.delivery_id) FROM ready i WHERE i.isolate)),
deferred AS (
    UPDATE delivery d SET scheduled_at = now()
      FROM ready r
     WHERE d.delivery_id = r.delivery_id AND d.state = 'PENDING'
       AND r.delivery_id NOT IN (SELECT delivery_id FROM chosen)),
probing AS (
    UPDATE subscription s
       SET probe_at = now() + make_interval(secs => 2 * s.timeout_ms / 1000.0 + 60)
      FROM chosen
     WHERE chosen.probe AND s.subscription_id = chosen.subscription_id),
waiting AS (
    UPDATE delivery d
       SET scheduled_at = CASE WHEN c.probe_at > now() THEN c.probe_at
                               WHEN c.probe_at IS NOT NULL
                               THEN now() + make_interval(secs => 2 * c.timeout_ms / 1000.0 + 60)
                               ELSE now() + make_interval(secs => c.timeout_ms / 1000.0) END
      FROM cand c
     WHERE d.delivery_id = c.delivery_id AND d.state = 'PENDING'
       AND c.delivery_id NOT IN (SELECT delivery_id FROM ready)),
disabled AS (
    UPDATE delivery d SET scheduled_at = now() + interval '1 day'
      FROM subscription s
     WHERE d.delivery_id = ANY(:ids) AND d.state = 'PENDING' AND NOT d.pull
       AND s.subscription_id = d.subscription_id AND s.disabled_at IS NOT NULL),
claimed AS (
    UPDATE delivery d SET state = 'IN_PROCESS', claimed_at = now(), claim = :claim,
                          claim_pid = pg_backend_pid(),
                          lone_claim = (SELECT count(*) FROM chosen) = 1
      FROM event e, subscription s, room r
     WHERE d.delivery_id IN (SELECT delivery_id FROM chosen)
       AND d.state = 'PENDING' AND NOT d.pull
       AND e.event_id = d.event_id AND s.subscription_id = d.subscription_id
       AND r.room_id = e.room_id
    RETURNING d.delivery_id, d.attempt, e.event_id, e.correlation_id, e.routing_key, e.payload,
              e.user_id AS "user", e.impersonator_id AS impersonator, e.deliver_at, e.expires_at,
              e.version, s.subscription_id, s.kind, s.push_url, s.handler, s.timeout_ms,
              COALESCE(s.delivery_delay_ms, r.delivery_delay_ms) AS delay_ms,
              COALESCE(s.delivery_delay_multiplier, r.delivery_delay_multiplier) AS multiplier,
              COALESCE(s.delivery_attempts, r.delivery_attempts) AS attempts, r.name AS room,
              e.token, d.order_value, e.deliver_at > e.published_at AS delayed,
              s.max_in_flight, s.failures > 0 OR s.probe_at IS NOT NULL AS unhealthy,
              s.rate_per_s, s.burst, s.probe_at IS NOT NULL AS probe, e.trace_parent,
              d.claimed_at),
queued AS (
    INSERT INTO queue_message (delivery_id, attempt, message, routing_key, start_time, state)
    SELECT delivery_id, attempt, CAST(payload AS text), routing_key, claimed_at, 'In process'
      FROM claimed)
SELECT delivery_id, attempt, event_id, correlation_id, routing_key, payload, "user",
       impersonator, deliver_at, expires_at, version, subscription_id, kind, push_url,
       handler, timeout_ms, delay_ms, multiplier, attempts, room, token, order_value, delayed,
       max_in_flight, unhealthy, rate_per_s, burst, probe, trace_parent
  FROM claimed;

-- name: deliveries_hold_back
-- Claimed deliveries not sent after all (their endpoint failed too often in this batch, or had
-- no rate token for them): back to PENDING under no claim, their attempt not counted, due
-- after their wait (:waits_ms; or when their endpoint heals), their In process rows in the
-- queue log gone (they never started).
WITH back AS (
    UPDATE delivery d
       SET state = 'PENDING', claimed_at = NULL, claim = NULL, claim_pid = NULL,
           scheduled_at = now() + make_interval(secs => w.ms / 1000.0)
      FROM unnest(CAST(:ids AS bigint[]), CAST(:waits_ms AS bigint[])) AS w(id, ms)
     WHERE d.delivery_id = w.id AND d.state = 'IN_PROCESS' AND d.claim = :claim
    RETURNING d.delivery_id, d.attempt)
DELETE FROM queue_message q
 USING back
 WHERE q.delivery_id = back.delivery_id AND q.attempt = back.attempt
   AND q.state = 'In process' AND q.end_time IS NULL;

-- name: endpoints_lock_settle
-- The endpoints a batch's outcomes will write (failures, heals, releases), locked in key order
-- before anything else of the settling transaction, as the claim locks them.
SELECT subscription_id FROM subscription
 WHERE subscription_id = ANY(:subs)
 ORDER BY subscription_id
   FOR NO KEY UPDATE;

-- name: endpoint_release
-- Sends of an endpoint with max_in_flight ended: as many of its waiting deliveries (due, held
-- back for room) are due again at once.
UPDATE delivery SET scheduled_at = now()
 WHERE delivery_id IN (
       SELECT delivery_id FROM delivery
        WHERE subscription_id = :s AND state = 'PENDING' AND NOT pull
          AND next_attempt_at <= now() AND scheduled_at > now()
        ORDER BY delivery_id
        LIMIT :n);

-- name: endpoint_healed
-- Endpoints that answered: their failures forgotten, their circuit closed, and what waited for
-- them (due, held back for their probe or their one send at a time) due at once, in order
-- (the due index takes the earliest id first). A retry wait of its own still waits.
WITH healed AS (
    UPDATE subscription SET failures = 0, failing_since = NULL, probe_at = NULL
     WHERE subscription_id = ANY(:subs) AND (failures > 0 OR probe_at IS NOT NULL)
    RETURNING subscription_id)
UPDATE delivery d SET scheduled_at = now()
  FROM healed
 WHERE d.subscription_id = healed.subscription_id AND d.state = 'PENDING' AND NOT d.pull
   AND d.next_attempt_at <= now() AND d.scheduled_at > now();

-- name: endpoint_failed
-- A send to an endpoint failed: one more failure in a row (since failing_since), and whether
-- it has been failing for :disable_after_s.
UPDATE subscription
   SET failures = failures + 1, failing_since = COALESCE(failing_since, now())
 WHERE subscription_id = :s AND disabled_at IS NULL
RETURNING failures, failing_since,
          failing_since <= now() - make_interval(secs => :disable_after_s) AS too_long;

-- name: endpoint_open
-- The endpoint's circuit is open: its next probe in :wait_ms, and its earliest delivery that
-- can go then due then (the probe has a candidate on time, whatever the others wait for).
WITH opened AS (
    UPDATE subscription SET probe_at = now() + make_interval(secs => :wait_ms / 1000.0)
     WHERE subscription_id = :s AND disabled_at IS NULL
    RETURNING subscription_id, probe_at)
UPDATE delivery d SET scheduled_at = opened.probe_at
  FROM opened
 WHERE d.delivery_id = (SELECT min(o.delivery_id) FROM delivery o
                         WHERE o.subscription_id = opened.subscription_id
                           AND o.state = 'PENDING' AND NOT o.pull
                           AND o.next_attempt_at <= opened.probe_at
                           AND o.scheduled_at > opened.probe_at);

-- name: endpoint_enable
-- An operator enables an endpoint (one of :owned, when given): failures forgotten, circuit
-- closed, its waiting deliveries due at once.
WITH enabled AS (
    UPDATE subscription
       SET disabled_at = NULL, disabled_reason = NULL, failures = 0, failing_since = NULL,
           probe_at = NULL
     WHERE subscription_id = :s
       AND (CAST(:owned AS bigint[]) IS NULL OR subscription_id = ANY(CAST(:owned AS bigint[])))
    RETURNING subscription_id),
released AS (
    UPDATE delivery d SET scheduled_at = GREATEST(d.next_attempt_at, now())
      FROM enabled
     WHERE d.subscription_id = enabled.subscription_id AND d.state = 'PENDING' AND NOT d.pull
       AND d.scheduled_at > GREATEST(d.next_attempt_at, now()))
SELECT subscription_id FROM enabled;

-- name: endpoint_disable
-- The endpoint has failed too long: disabled (no sends) until an operator enables it.
UPDATE subscription s SET disabled_at = now(), disabled_reason = :why, probe_at = NULL
  FROM room r
 WHERE s.subscription_id = :s AND s.disabled_at IS NULL AND r.room_id = s.room_id
RETURNING s.subscription_id, s.name, r.name AS room, s.push_url, s.failures, s.failing_since,
          s.disabled_at;

-- name: deliveries_delivered
-- Plain push deliveries delivered, their attempts' published_messages rows and their
-- Completed rows in the queue log (each try's start and memory), in one statement, only
-- while this claim holds them (committed without waiting for the disk, like the claim).
SET LOCAL synchronous_commit TO OFF;
WITH held AS (
    UPDATE delivery SET state = 'DELIVERED', delivered_at = now(), claimed_at = NULL,
           claim = NULL, claim_pid = NULL, last_error = NULL
     WHERE delivery_id = ANY(:ids) AND state = 'IN_PROCESS' AND claim = :claim
    RETURNING delivery_id, event_id, attempt, delivered_at),
tried AS (
    SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:starts AS timestamptz[]),
                         CAST(:memory AS bigint[])) AS t(id, at, mem)),
logged AS (
    UPDATE published_messages p SET outcome = 'DELIVERED', delivered_at = held.delivered_at
      FROM held
     WHERE p.delivery_id = held.delivery_id AND p.outcome = 'PENDING'),
queued AS (
    INSERT INTO queue_message (delivery_id, attempt, message, routing_key, start_time,
                               end_time, state, memory_used)
    SELECT held.delivery_id, held.attempt, CAST(e.payload AS text), e.routing_key, tried.at,
           held.delivered_at, 'Completed', tried.mem
      FROM held JOIN event e USING (event_id) JOIN tried ON tried.id = held.delivery_id)
SELECT delivery_id FROM held;

-- name: delivery_settle
-- One delivery's outcome, only while this claim holds it: its attempt's published_messages
-- row (and, for a retry, the next attempt's, PENDING), its queue log rows (Completed, or
-- Error pointing at its log_exception row; and Pending for a retry).
WITH held AS (
    UPDATE delivery SET state = :state, attempt = :next_attempt,
           next_attempt_at = COALESCE(:at, next_attempt_at),
           scheduled_at = COALESCE(:at, scheduled_at),
           claimed_at = NULL, claim = NULL, claim_pid = NULL,
           delivered_at = CASE WHEN :state = 'DELIVERED' THEN now() END, last_error = :why
     WHERE delivery_id = :id AND state = 'IN_PROCESS' AND claim = :claim
    RETURNING delivery_id, event_id, subscription_id, next_attempt_at, delivered_at),
logged AS (
    UPDATE published_messages p
       SET outcome = :o, delivered_at = held.delivered_at, error = :why,
           next_delay_ms = :next_delay_ms
      FROM held
     WHERE p.delivery_id = held.delivery_id AND p.outcome = 'PENDING'),
republished AS (
    INSERT INTO published_messages (correlation_id, delivery_id, event_id, subscription_id,
                                    attempt, published_at, next_attempt_at, outcome)
    SELECT :c, held.delivery_id, held.event_id, held.subscription_id, :next_attempt, now(),
           held.next_attempt_at, 'PENDING'
      FROM held
     WHERE :state = 'PENDING'),
failure AS (
    INSERT INTO log_exception (time, type, message, traceback, delivery_id, attempt)
    SELECT now(), :exc_type, :exc_message, :exc_traceback, held.delivery_id, :a
      FROM held
     WHERE CAST(:exc_type AS text) IS NOT NULL
    RETURNING id),
queued AS (
    INSERT INTO queue_message (delivery_id, attempt, message, routing_key,
                               scheduled_start_time, start_time, end_time, state,
                               exception_id, memory_used)
    SELECT held.delivery_id, :a, CAST(e.payload AS text), e.routing_key,
           CAST(NULL AS timestamptz), CAST(:started AS timestamptz), now(),
           CASE WHEN :state = 'DELIVERED' THEN 'Completed' ELSE 'Error' END,
           (SELECT id FROM failure), CAST(:memory AS bigint)
      FROM held JOIN event e USING (event_id)
    UNION ALL
    SELECT held.delivery_id, :next_attempt, CAST(e.payload AS text), e.routing_key,
           held.next_attempt_at, NULL, NULL, 'Pending', NULL, NULL
      FROM held JOIN event e USING (event_id)
     WHERE :state = 'PENDING')
SELECT delivery_id FROM held;

-- name: async_commit
-- This transaction commits without waiting for the disk: a database crash in that instant can
-- only make a delivery come again (at least once, same Idempotency-Key), never lose it.
SET LOCAL synchronous_commit TO OFF;

-- name: delivery_dead_letter
-- A delivery whose outcome cannot be recorded: DEAD, its attempt logged DEAD, an Error in the
-- queue log with the recording's exception.
WITH held AS (
    UPDATE delivery
       SET state = 'DEAD', claimed_at = NULL, claim = NULL, claim_pid = NULL, last_error = :why
     WHERE delivery_id = :id AND claim = :claim
    RETURNING delivery_id, event_id, attempt),
logged AS (
    UPDATE published_messages p SET outcome = 'DEAD', error = :why
      FROM held
     WHERE p.delivery_id = held.delivery_id AND p.outcome = 'PENDING'),
failure AS (
    INSERT INTO log_exception (time, type, message, traceback, delivery_id, attempt)
    SELECT now(), :exc_type, :why, :exc_traceback, held.delivery_id, held.attempt FROM held
    RETURNING id)
INSERT INTO queue_message (delivery_id, attempt, message, routing_key, start_time, end_time,
                           state, exception_id)
SELECT held.delivery_id, held.attempt, CAST(e.payload AS text), e.routing_key, :started, now(),
       'Error', (SELECT id FROM failure)
  FROM held JOIN event e USING (event_id);

-- name: delivery_release_next
-- An ordered key's head reached a final state: its successor (the next event of the key, by
-- publish order: a backfilled delivery of an older event comes before) is due at once.
UPDATE delivery SET next_attempt_at = now(), scheduled_at = now()
 WHERE delivery_id = (
       SELECT n.delivery_id FROM delivery n
        WHERE n.subscription_id = :s AND n.order_value = :v AND n.state = 'PENDING'
          AND n.event_id > (SELECT event_id FROM delivery WHERE delivery_id = :d)
        ORDER BY n.event_id
        LIMIT 1);

-- name: dead_letters_redrive
-- An operator sends dead-lettered deliveries again: attempts start over, due now (published
-- again: a PENDING attempt 0, and Pending in the queue log).
WITH moved AS (
    UPDATE delivery SET state = 'PENDING', attempt = 0, next_attempt_at = now(),
           scheduled_at = now(), last_error = 'redriven: ' || COALESCE(last_error, '')
     WHERE state = 'DEAD'
       AND (CAST(:ids AS bigint[]) IS NULL OR delivery_id = ANY(:ids))
       AND (CAST(:sub AS bigint) IS NULL OR subscription_id = :sub)
       AND (CAST(:owned AS bigint[]) IS NULL OR subscription_id = ANY(CAST(:owned AS bigint[])))
       AND (CAST(:room AS text) IS NULL OR subscription_id IN (
            SELECT s.subscription_id FROM subscription s JOIN room r USING (room_id)
             WHERE r.name = :room))
    RETURNING delivery_id, event_id, subscription_id, next_attempt_at),
republished AS (
    INSERT INTO published_messages (correlation_id, delivery_id, event_id, subscription_id,
                                    attempt, published_at, next_attempt_at, outcome)
    SELECT e.correlation_id, m.delivery_id, m.event_id, m.subscription_id, 0, now(),
           m.next_attempt_at, 'PENDING'
      FROM moved m JOIN event e USING (event_id)),
queued AS (
    INSERT INTO queue_message (delivery_id, attempt, message, routing_key, state)
    SELECT m.delivery_id, 0, CAST(e.payload AS text), e.routing_key, 'Pending'
      FROM moved m JOIN event e USING (event_id))
SELECT delivery_id FROM moved ORDER BY delivery_id;

-- name: deliveries_replay
-- A subscription's deliveries of the events published in [:since, :until) sent again, whatever
-- became of them (DELIVERED, DEAD, EXPIRED; one still PENDING or IN_PROCESS is in flight and
-- left as it is): attempts start over, due now, in their order (an ordered key's first still
-- goes first). An event past its room's expiration is not replayed. Published again (a
-- PENDING attempt 0) and Pending in the queue log; how many.
WITH moved AS (
    UPDATE delivery d
       SET state = 'PENDING', attempt = 0, next_attempt_at = now(), scheduled_at = now(),
           delivered_at = NULL, receipt = NULL,
           last_error = 'replayed: ' || COALESCE(d.last_error, d.state::text)
      FROM event e
     WHERE d.subscription_id = :s AND e.event_id = d.event_id
       AND d.state IN ('DELIVERED', 'DEAD', 'EXPIRED')
       AND e.published_at >= :since
       AND (CAST(:until AS timestamptz) IS NULL OR e.published_at < :until)
       AND (e.expires_at IS NULL OR e.expires_at > now())
    RETURNING d.delivery_id, d.event_id, d.subscription_id, d.next_attempt_at),
republished AS (
    INSERT INTO published_messages (correlation_id, delivery_id, event_id, subscription_id,
                                    attempt, published_at, next_attempt_at, outcome)
    SELECT e.correlation_id, m.delivery_id, m.event_id, m.subscription_id, 0, now(),
           m.next_attempt_at, 'PENDING'
      FROM moved m JOIN event e USING (event_id)),
queued AS (
    INSERT INTO queue_message (delivery_id, attempt, message, routing_key, state)
    SELECT m.delivery_id, 0, CAST(e.payload AS text), e.routing_key, 'Pending'
      FROM moved m JOIN event e USING (event_id))
SELECT count(*) FROM moved;

-- name: replay_subscription
-- The subscription a replay or backfill is for (one of :owned, when given), its room and how
-- it selects events, locked against a concurrent change of it.
SELECT s.subscription_id, s.room_id, s.kind, s.status, s.event_type_id,
       s.routing_key_pattern, s.order_key, s.min_version, s.max_version, s.name
  FROM subscription s
 WHERE s.subscription_id = :s
   AND (CAST(:owned AS bigint[]) IS NULL OR s.subscription_id = ANY(CAST(:owned AS bigint[])))
   FOR NO KEY UPDATE;

-- name: backfill_candidates
-- A room's events published in [:since, :until) after (:after_at, :after_id), in publish
-- order (ix_event_room_published), that the subscription :s has no delivery of and that have
-- not expired (:limit at most).
SELECT e.event_id, e.event_type_id, e.version, e.routing_key, e.payload, e.deliver_at,
       e.published_at
  FROM event e
 WHERE e.room_id = :room_id AND e.published_at >= :since
   AND (CAST(:until AS timestamptz) IS NULL OR e.published_at < :until)
   AND (CAST(:after_at AS timestamptz) IS NULL
        OR (e.published_at, e.event_id) > (CAST(:after_at AS timestamptz), :after_id))
   AND (e.expires_at IS NULL OR e.expires_at > now())
   AND NOT EXISTS (SELECT 1 FROM delivery d
                    WHERE d.event_id = e.event_id AND d.subscription_id = :s)
 ORDER BY e.published_at, e.event_id
 LIMIT :limit;

-- name: events_routed
-- Events a backfill gave a delivery: no longer unroutable.
UPDATE event SET unroutable = false WHERE event_id = ANY(:ids) AND unroutable;

-- name: dead_letters_list
SELECT d.delivery_id, d.subscription_id, d.attempt, d.last_error,
       e.correlation_id, e.routing_key, r.name AS room
  FROM delivery d JOIN event e USING (event_id) JOIN room r USING (room_id)
 WHERE d.state = 'DEAD' AND (CAST(:room AS text) IS NULL OR r.name = :room)
   AND (CAST(:owned AS bigint[]) IS NULL OR d.subscription_id = ANY(CAST(:owned AS bigint[])))
 ORDER BY d.delivery_id;

-- --- pull ----------------------------------------------------------------------------------------

-- name: pull_subscription
-- :owned here and below: the subscriptions of the caller's key (NULL: every one); another
-- tenant's is not found, in the statement that reads or writes it.
SELECT kind, status, visibility_timeout_ms
  FROM subscription
 WHERE subscription_id = :s
   AND (CAST(:owned AS bigint[]) IS NULL OR subscription_id = ANY(CAST(:owned AS bigint[])));

-- name: pull_take
-- A PULL subscriber takes up to :max due messages under the receipt :receipt (its fencing
-- token), invisible to other pulls until scheduled_at (:visibility_s from now; a receipt's
-- holder may move it: pull_extend), each In process in the queue log (its attempt's published_messages row has been
-- PENDING since it was scheduled); an ordered key's next only when none is open.
WITH taken AS (
    UPDATE delivery d SET state = 'IN_PROCESS', claimed_at = now(), receipt = :receipt,
                          scheduled_at = now() + make_interval(secs => :visibility_s)
     WHERE d.delivery_id IN (
           SELECT o.delivery_id FROM delivery o JOIN event e USING (event_id)
            WHERE o.subscription_id = :sub AND o.pull AND o.state = 'PENDING'
              AND o.next_attempt_at <= now()
              AND (e.expires_at IS NULL OR e.expires_at > now())
              AND (o.order_value IS NULL OR NOT EXISTS (
                    SELECT 1 FROM delivery p
                     WHERE p.subscription_id = o.subscription_id
                       AND p.order_value = o.order_value
                       AND p.event_id < o.event_id
                       AND p.state IN ('PENDING', 'IN_PROCESS')))
            ORDER BY o.delivery_id
            LIMIT :max
            FOR UPDATE OF o SKIP LOCKED)
    RETURNING d.delivery_id, d.attempt, d.event_id, d.claimed_at),
queued AS (
    INSERT INTO queue_message (delivery_id, attempt, message, routing_key, start_time, state)
    SELECT t.delivery_id, t.attempt, CAST(e.payload AS text), e.routing_key, t.claimed_at,
           'In process'
      FROM taken t JOIN event e USING (event_id))
SELECT t.delivery_id, t.attempt, e.correlation_id, e.routing_key, e.payload,
       e.user_id AS "user", e.impersonator_id AS impersonator
  FROM taken t JOIN event e USING (event_id)
 ORDER BY t.delivery_id;

-- name: pull_extend
-- A pulled message's visibility moved (SQS ChangeMessageVisibility): it comes back :visibility_s
-- from now unless ACKed, only with its current receipt. Returns how many it moved (0 or 1).
WITH moved AS (
    UPDATE delivery SET scheduled_at = now() + make_interval(secs => :visibility_s)
     WHERE delivery_id = :d AND subscription_id = :s AND pull AND state = 'IN_PROCESS'
       AND receipt = :r
       AND (CAST(:owned AS bigint[]) IS NULL OR subscription_id = ANY(CAST(:owned AS bigint[])))
    RETURNING delivery_id)
SELECT count(*) FROM moved;

-- name: pull_ack
-- The subscriber processed a pulled message: delivered, only with its current receipt; its
-- attempt's published_messages row and a Completed row in the queue log (from the pull to
-- the ACK) with it. Returns how many deliveries it settled (0 or 1).
WITH done AS (
    UPDATE delivery SET state = 'DELIVERED', delivered_at = now(), receipt = NULL
     WHERE delivery_id = :d AND subscription_id = :s AND pull
       AND state = 'IN_PROCESS' AND receipt = :r AND (CAST(:owned AS bigint[]) IS NULL OR subscription_id = ANY(CAST(:owned AS bigint[])))
    RETURNING delivery_id, event_id, attempt, claimed_at, delivered_at),
logged AS (
    UPDATE published_messages p SET outcome = 'DELIVERED', delivered_at = done.delivered_at
      FROM done
     WHERE p.delivery_id = done.delivery_id AND p.outcome = 'PENDING'),
queued AS (
    INSERT INTO queue_message (delivery_id, attempt, message, routing_key, start_time,
                               end_time, state)
    SELECT done.delivery_id, done.attempt, CAST(e.payload AS text), e.routing_key,
           done.claimed_at, done.delivered_at, 'Completed'
      FROM done JOIN event e USING (event_id))
SELECT count(*) FROM done;
