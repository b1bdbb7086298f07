-- The store's functions and triggers: the rules that must hold under concurrency, next to the
-- rows they guard. This file is the canonical text: migrations apply it (every definition is
-- CREATE OR REPLACE), and a test checks that what `alembic upgrade head` installs equals it.
-- Change it only together with a new migration that applies it and records its hash
-- (worker.store.schema.apply_functions).
--
-- The funnel predicate, the release of a funnel's next message, the parent's outcome when a
-- HARD child settles, and the confirmation recorded when a message becomes final. A trigger on
-- message.state applies the last three in the transaction that changed the state, whichever
-- path changed it (a worker, beat, an operator). Locks: a funnel's advisory lock is always
-- taken before the row locks of its messages.

-- A PROCESSING message whose claiming backend no longer exists was orphaned by a dead worker
-- (pg_stat_get_activity(pid) plans far cheaper than the pg_stat_activity view).
CREATE OR REPLACE FUNCTION orderly_orphaned(p_pid integer) RETURNS boolean
LANGUAGE sql AS $$
    SELECT p_pid IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_stat_get_activity(p_pid))
$$;

-- The advisory lock key of a funnel: (funnel_value, funnel_component_id).
CREATE OR REPLACE FUNCTION orderly_funnel_key(p_value text, p_component text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended(p_value || chr(31) || coalesce(p_component, ''), 7)
$$;

-- Take the funnel lock of a message (nothing for a message without a funnel). Held until the
-- transaction ends; taken again by the same transaction it is a no-op.
CREATE OR REPLACE FUNCTION orderly_lock_funnel_of(p_msg_id bigint) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(orderly_funnel_key(funnel_value, funnel_component_id))
      FROM message WHERE msg_id = p_msg_id AND funnel_value IS NOT NULL
$$;

-- May this message (p_msg_id NULL: one not yet stored, newer than all) not go on now?
--   funnel: another message of the funnel is active (PROCESSING, WAITING, WAITING_FOR_RES)
--           and was started within asynch.funnelIdleIntervalSec;
--   guaranteed order: another message of the funnel is active, or an older guaranteed-order
--           message of the funnel is not final (FAILED counts unless p_exclude_failed).
CREATE OR REPLACE FUNCTION orderly_funnel_blocked(
    p_msg_id bigint, p_value text, p_component text, p_ts timestamptz,
    p_guaranteed boolean, p_exclude_failed boolean) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM message o
         WHERE o.funnel_value = p_value
           AND o.state NOT IN ('OK', 'CANCEL')
           AND o.funnel_component_id IS NOT DISTINCT FROM p_component
           AND o.msg_id IS DISTINCT FROM p_msg_id
           AND ((o.state IN ('PROCESSING', 'WAITING', 'WAITING_FOR_RES')
                 AND (p_guaranteed OR o.last_process_timestamp >= now() - make_interval(secs =>
                      coalesce((SELECT coalesce(current_value, default_value)::int
                                  FROM configuration
                                 WHERE code = 'asynch.funnelIdleIntervalSec'), 600))))
             OR (p_guaranteed AND o.guaranteed_order
                 AND (o.msg_timestamp < p_ts
                      OR (o.msg_timestamp = p_ts AND p_msg_id IS NOT NULL AND o.msg_id < p_msg_id))
                 AND (o.state <> 'FAILED' OR NOT p_exclude_failed))))
$$;

-- Release the funnel's oldest POSTPONED message if it may go on now: POSTPONED -> IN_QUEUE.
-- Only the oldest is looked at: in guaranteed order every other one waits behind it, and in a
-- plain funnel whatever blocks it blocks them all. The released id is appended to the
-- transaction's 'orderly.released' setting, from which the caller enqueues it after commit.
CREATE OR REPLACE FUNCTION orderly_funnel_release(p_value text, p_component text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
    v_blocked boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(orderly_funnel_key(p_value, p_component));
    SELECT c.msg_id,
           orderly_funnel_blocked(c.msg_id, c.funnel_value, c.funnel_component_id,
                                  c.msg_timestamp, c.guaranteed_order, c.exclude_failed_state)
      INTO v_id, v_blocked
      FROM message c
     WHERE c.funnel_value = p_value
       AND c.state NOT IN ('OK', 'CANCEL')
       AND c.funnel_component_id IS NOT DISTINCT FROM p_component
       AND c.state = 'POSTPONED'
     ORDER BY c.msg_timestamp, c.msg_id
     LIMIT 1
       FOR UPDATE SKIP LOCKED;
    IF v_id IS NULL OR v_blocked THEN
        RETURN NULL;
    END IF;
    UPDATE message
       SET state = 'IN_QUEUE', start_in_queue_timestamp = now(), last_process_timestamp = now()
     WHERE msg_id = v_id;
    PERFORM set_config('orderly.released',
                       concat_ws(',', nullif(current_setting('orderly.released', true), ''),
                                 v_id::text),
                       true);
    RETURN v_id;
END
$$;

-- Settle a WAITING parent from its HARD children: one FAILED (or cancelled) child fails it
-- with the child's error; all OK make it OK; otherwise it keeps waiting. Returns its state.
CREATE OR REPLACE FUNCTION orderly_parent_check(p_parent bigint) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_state text;
    v_child record;
BEGIN
    PERFORM orderly_lock_funnel_of(p_parent);
    SELECT state INTO v_state FROM message WHERE msg_id = p_parent FOR UPDATE;
    IF v_state IS DISTINCT FROM 'WAITING' THEN
        RETURN v_state;
    END IF;
    SELECT msg_id, state, failed_error_code, failed_desc INTO v_child
      FROM message
     WHERE parent_msg_id = p_parent AND parent_binding_type = 'HARD'
       AND state IN ('FAILED', 'CANCEL')
     ORDER BY last_process_timestamp, msg_id
     LIMIT 1;
    IF FOUND THEN
        UPDATE message
           SET state = 'FAILED',
               failed_error_code = CASE WHEN v_child.state = 'CANCEL' THEN 'E_CHILD_CANCELLED'
                                        ELSE coalesce(v_child.failed_error_code, 'E_CHILD_FAILED')
                                   END,
               failed_desc = format('child message %s %s: %s', v_child.msg_id,
                                    CASE WHEN v_child.state = 'CANCEL' THEN 'was cancelled'
                                         ELSE 'failed' END,
                                    coalesce(v_child.failed_desc, '')),
               last_process_timestamp = now()
         WHERE msg_id = p_parent;
        RETURN 'FAILED';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM message
                    WHERE parent_msg_id = p_parent AND parent_binding_type = 'HARD'
                      AND state <> 'OK') THEN
        UPDATE message SET state = 'OK', last_process_timestamp = now() WHERE msg_id = p_parent;
        RETURN 'OK';
    END IF;
    RETURN 'WAITING';
END
$$;

-- What follows a change of message.state, in the same transaction:
--   a funnel message that ends or fails lets the funnel's next one go (release);
--   a HARD child that becomes final settles its WAITING parent (and so on up the chain);
--   a message that becomes final is confirmed to its source system, if that has a URL.
CREATE OR REPLACE FUNCTION orderly_message_transition() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.funnel_value IS NOT NULL
       AND NEW.state IN ('OK', 'FAILED', 'CANCEL', 'PARTLY_FAILED') THEN
        PERFORM orderly_funnel_release(NEW.funnel_value, NEW.funnel_component_id);
    END IF;
    IF NEW.state IN ('OK', 'FAILED', 'CANCEL') THEN
        IF NEW.parent_msg_id IS NOT NULL AND NEW.parent_binding_type = 'HARD'
           AND OLD.state NOT IN ('OK', 'FAILED', 'CANCEL')
           -- conversation rows are settled by the ordering gate, not by their children
           AND NEW.service_name <> 'conversation' THEN
            PERFORM orderly_parent_check(NEW.parent_msg_id);
        END IF;
        INSERT INTO external_call (msg_id, operation_name, entity_id, state, msg_timestamp,
                                   creation_timestamp, last_update_timestamp, failed_count,
                                   next_attempt_at)
        SELECT NEW.msg_id, 'orderly.confirmation', NEW.msg_id::text, 'PROCESSING',
               NEW.msg_timestamp, now(), now(), 0, now()
          FROM source_system s
         WHERE s.name = NEW.source_system AND s.confirmation_url IS NOT NULL
        ON CONFLICT (operation_name, entity_id) DO UPDATE
           SET state = 'PROCESSING', failed_count = 0, next_attempt_at = now(),
               last_update_timestamp = now(), claim = NULL;
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER orderly_message_transition
    AFTER UPDATE OF state ON message
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          AND (NEW.funnel_value IS NOT NULL OR NEW.state IN ('OK', 'FAILED', 'CANCEL')))
    EXECUTE FUNCTION orderly_message_transition();

-- A worker's outcome, only while its connection holds the claim. p_kind: OK; FAIL (PARTLY_FAILED,
-- or FAILED once failed_count reached p_limit); FAILED (final at once); WAITING (a parent whose
-- children were just stored); WAITING_FOR_RES (IN_QUEUE instead if the response already came);
-- POSTPONED (to be taken up again by the pool). Returns the new state (NULL: the claim was lost)
-- and the ids the funnel released, comma-separated.
CREATE OR REPLACE FUNCTION orderly_finish(
    p_msg_id bigint, p_kind text, p_limit integer, p_code text, p_desc text, p_custom text,
    p_obsolete_by bigint) RETURNS TABLE (new_state text, released text)
LANGUAGE plpgsql AS $$
DECLARE
    v_state text;
    v_fail boolean := p_kind IN ('FAIL', 'FAILED');
BEGIN
    PERFORM orderly_lock_funnel_of(p_msg_id);
    PERFORM set_config('orderly.released', '', true);
    UPDATE message m
       SET state = CASE p_kind
                       WHEN 'FAIL' THEN CASE WHEN m.failed_count >= p_limit THEN 'FAILED'
                                             ELSE 'PARTLY_FAILED' END
                       WHEN 'WAITING_FOR_RES' THEN CASE WHEN m.wait_res_id IS NULL
                                                        THEN 'WAITING_FOR_RES'
                                                        ELSE 'IN_QUEUE' END
                       ELSE p_kind END,
           failed_count = m.failed_count + CASE WHEN v_fail THEN 1 ELSE 0 END,
           failed_error_code = CASE WHEN v_fail THEN p_code ELSE m.failed_error_code END,
           failed_desc = CASE WHEN v_fail THEN p_desc ELSE m.failed_desc END,
           obsolete_by = coalesce(p_obsolete_by, m.obsolete_by),
           custom_data = p_custom,
           last_process_timestamp = now(),
           start_in_queue_timestamp = CASE WHEN p_kind = 'WAITING_FOR_RES'
                                            AND m.wait_res_id IS NOT NULL
                                           THEN now() ELSE m.start_in_queue_timestamp END,
           processing_pid = NULL
     WHERE m.msg_id = p_msg_id AND m.state = 'PROCESSING'
       AND m.processing_pid = pg_backend_pid()
    RETURNING m.state INTO v_state;
    IF v_state = 'WAITING' THEN
        v_state := orderly_parent_check(p_msg_id);
    END IF;
    RETURN QUERY SELECT v_state, current_setting('orderly.released', true);
END
$$;
