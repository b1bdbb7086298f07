-- The pub/sub logs (worker.pubsub.logs): the queue message log, the exceptions its Error rows
-- point at and the published_messages rows, filtered by message (delivery, correlation id),
-- queue (subscription, routing key) and state, newest first, a page before an id; only the
-- rows of the caller's subscriptions (:owned, NULL: every one).

-- name: queue_log
SELECT q.id, q.delivery_id, q.attempt, q.state, q.routing_key, q.message,
       q.scheduled_start_time, q.start_time, q.end_time, q.exception_id, q.memory_used,
       e.correlation_id, d.subscription_id
  FROM queue_message q
  JOIN delivery d ON d.delivery_id = q.delivery_id
  JOIN event e ON e.event_id = d.event_id
 WHERE (CAST(:delivery_id AS bigint) IS NULL OR q.delivery_id = :delivery_id)
   AND (CAST(:correlation_id AS text) IS NULL OR e.correlation_id = :correlation_id)
   AND (CAST(:subscription_id AS bigint) IS NULL OR d.subscription_id = :subscription_id)
   AND (CAST(:routing_key AS text) IS NULL OR q.routing_key = :routing_key)
   AND (CAST(:state AS text) IS NULL OR q.state = :state)
   AND (CAST(:before AS bigint) IS NULL OR q.id < :before)
   AND (CAST(:owned AS bigint[]) IS NULL OR d.subscription_id = ANY(CAST(:owned AS bigint[])))
 ORDER BY q.id DESC
 LIMIT :limit;

-- name: exception_list
-- Without their tracebacks (one is read with exception_get).
SELECT x.id, x.time, x.type, x.message, x.delivery_id, x.attempt, e.correlation_id,
       d.subscription_id, e.routing_key, x.traceback IS NOT NULL AS has_traceback
  FROM log_exception x
  JOIN delivery d ON d.delivery_id = x.delivery_id
  JOIN event e ON e.event_id = d.event_id
 WHERE (CAST(:delivery_id AS bigint) IS NULL OR x.delivery_id = :delivery_id)
   AND (CAST(:correlation_id AS text) IS NULL OR e.correlation_id = :correlation_id)
   AND (CAST(:subscription_id AS bigint) IS NULL OR d.subscription_id = :subscription_id)
   AND (CAST(:routing_key AS text) IS NULL OR e.routing_key = :routing_key)
   AND (CAST(:type AS text) IS NULL OR x.type = :type)
   AND (CAST(:before AS bigint) IS NULL OR x.id < :before)
   AND (CAST(:owned AS bigint[]) IS NULL OR d.subscription_id = ANY(CAST(:owned AS bigint[])))
 ORDER BY x.id DESC
 LIMIT :limit;

-- name: exception_get
SELECT x.id, x.time, x.type, x.message, x.traceback, x.delivery_id, x.attempt,
       e.correlation_id, d.subscription_id, e.routing_key
  FROM log_exception x
  JOIN delivery d ON d.delivery_id = x.delivery_id
  JOIN event e ON e.event_id = d.event_id
 WHERE x.id = :id AND (CAST(:owned AS bigint[]) IS NULL OR d.subscription_id = ANY(CAST(:owned AS bigint[])));

-- name: published_log
SELECT p.id, p.delivery_id, p.correlation_id, p.event_id, p.subscription_id, p.attempt,
       p.outcome, p.published_at, p.next_attempt_at, p.delivered_at, p.error, p.next_delay_ms
  FROM published_messages p
  JOIN event e ON e.event_id = p.event_id
 WHERE (CAST(:delivery_id AS bigint) IS NULL OR p.delivery_id = :delivery_id)
   AND (CAST(:correlation_id AS text) IS NULL OR p.correlation_id = :correlation_id)
   AND (CAST(:subscription_id AS bigint) IS NULL OR p.subscription_id = :subscription_id)
   AND (CAST(:routing_key AS text) IS NULL OR e.routing_key = :routing_key)
   AND (CAST(:state AS text) IS NULL OR p.outcome = :state)
   AND (CAST(:before AS bigint) IS NULL OR p.id < :before)
   AND (CAST(:owned AS bigint[]) IS NULL OR p.subscription_id = ANY(CAST(:owned AS bigint[])))
 ORDER BY p.id DESC
 LIMIT :limit;
