-- Periodic schedules that produce messages (worker.schedules).
-- :owned in these queries: the source systems of the caller's key (NULL: every one); another
-- tenant's schedule is not found, in the statement that reads or writes it.
-- :now is the caller's clock (worker.core.clock), never the server's: a test steps it.

-- name: schedule_insert
-- A new schedule; nothing when the name is taken (the caller says so).
INSERT INTO schedule (name, cron, time_zone, service, operation, source_system, payload,
                      object_id, entity_type, process_id, funnel_value, funnel_component_id,
                      guaranteed_order, exclude_failed_state, priority, enabled, next_at,
                      created_at, updated_at)
VALUES (:name, :cron, :time_zone, :service, :operation, :source_system, CAST(:payload AS json),
        :object_id, :entity_type, :process_id, :funnel_value, :funnel_component_id,
        :guaranteed_order, :exclude_failed_state, :priority, :enabled, :next_at, :now, :now)
ON CONFLICT (name) DO NOTHING
RETURNING *;

-- name: schedule_list
-- The caller's schedules by name.
SELECT * FROM schedule
 WHERE (CAST(:owned AS text[]) IS NULL OR source_system = ANY(CAST(:owned AS text[])))
 ORDER BY name
 LIMIT :limit OFFSET :offset;

-- name: schedule_show
SELECT * FROM schedule
 WHERE name = :name
   AND (CAST(:owned AS text[]) IS NULL OR source_system = ANY(CAST(:owned AS text[])));

-- name: schedule_lock
-- One of the caller's schedules, locked for a change: a producer holding it (its messages
-- being submitted) finishes first, so the change never races a production.
SELECT * FROM schedule
 WHERE name = :name
   AND (CAST(:owned AS text[]) IS NULL OR source_system = ANY(CAST(:owned AS text[])))
   FOR UPDATE;

-- name: schedule_update
-- Every field of a schedule locked by schedule_lock (in the same transaction).
UPDATE schedule
   SET cron = :cron, time_zone = :time_zone, service = :service, operation = :operation,
       source_system = :source_system, payload = CAST(:payload AS json), object_id = :object_id,
       entity_type = :entity_type, process_id = :process_id, funnel_value = :funnel_value,
       funnel_component_id = :funnel_component_id, guaranteed_order = :guaranteed_order,
       exclude_failed_state = :exclude_failed_state, priority = :priority, enabled = :enabled,
       next_at = :next_at, updated_at = :now
 WHERE name = :name
RETURNING *;

-- name: schedule_delete
DELETE FROM schedule
 WHERE name = :name
   AND (CAST(:owned AS text[]) IS NULL OR source_system = ANY(CAST(:owned AS text[])))
RETURNING name;

-- name: schedules_take_due
-- The due schedules (ix_schedule_next_at), locked until the producer's transaction ends; those
-- another producer holds are passed over, so two beats never produce for one schedule at once.
-- A row another producer advanced meanwhile is checked again against next_at <= :now.
SELECT * FROM schedule
 WHERE next_at <= :now
 ORDER BY next_at, name
 LIMIT :limit
   FOR UPDATE SKIP LOCKED;

-- name: schedule_advance
-- The instant :last_at taken up: its message :last_msg_id (NULL: refused, :last_error says
-- why), and the schedule due next at :next_at. Same transaction as schedules_take_due.
UPDATE schedule
   SET next_at = :next_at, last_at = :last_at, last_msg_id = :last_msg_id,
       last_error = :last_error
 WHERE name = :name;

-- name: schedule_stop
-- A schedule that cannot be due again as it stands (its time zone is no longer known):
-- disabled, :error saying why, until a change makes it valid again.
UPDATE schedule
   SET enabled = false, next_at = NULL, last_error = :error
 WHERE name = :name;
