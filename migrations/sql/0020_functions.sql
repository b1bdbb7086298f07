-- The store's functions and triggers: the rules that must hold under concurrency, next to the
-- rows they guard. This file is the canonical text, as of the newest migration: every definition
-- is CREATE OR REPLACE, and a function taken out is dropped here (DROP ... IF EXISTS). No
-- migration reads it: each applies its own frozen copy, migrations/sql/<revision>_functions.sql,
-- the text of its time (worker.db.schema.apply_frozen). Change it only together with a new
-- migration and a copy frozen from it (python -m tooling.freeze_functions <revision>); tests hold
-- the newest copy and what `alembic upgrade head` installs to this file.
--
-- The funnel predicate, the release of a funnel's next message, the parent's outcome when a
-- HARD child settles, and the confirmation recorded when a message becomes final. A trigger on
-- message.state applies the last three in the transaction that changed the state, whichever
-- path changed it (a worker, beat, an operator). Locks: a funnel's advisory lock is always
-- taken before the row locks of its messages.
--
-- A function whose body queries tables is PL/pgSQL, not SQL: PostgreSQL inlines no SQL function
-- that holds a subquery and plans its body again in every statement that calls it (0.15 ms
-- for orderly_fair_at, 0.47 ms for orderly_funnel_blocked, on each insert), while PL/pgSQL
-- keeps its plans for the session.

-- A PROCESSING message whose claiming backend no longer exists was orphaned by a dead worker
-- (pg_stat_get_activity(pid) plans far cheaper than the pg_stat_activity view).
CREATE OR REPLACE FUNCTION orderly_orphaned(p_pid integer) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    RETURN (
        SELECT p_pid IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_stat_get_activity(p_pid)));
END
$$;

-- The advisory lock key of a funnel: (funnel_value, funnel_component_id).
CREATE OR REPLACE FUNCTION orderly_funnel_key(p_value text, p_component text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended(p_value || chr(31) || coalesce(p_component, ''), 7)
$$;

-- Take the funnel lock of a message (nothing for a message without a funnel). Held until the
-- transaction ends; taken again by the same transaction it is a no-op.
CREATE OR REPLACE FUNCTION orderly_lock_funnel_of(p_msg_id bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(orderly_funnel_key(funnel_value, funnel_component_id))
       FROM message WHERE msg_id = p_msg_id AND funnel_value IS NOT NULL;
END
$$;

-- Take the funnel locks of several messages (those without a funnel have none), in key order:
-- whoever takes more than one funnel lock takes them so, and two such transactions cannot
-- deadlock. A batch claim and a batch outcome take them before touching a row.
CREATE OR REPLACE FUNCTION orderly_lock_funnels_of(p_msg_ids bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(s.k)
       FROM (SELECT DISTINCT orderly_funnel_key(funnel_value, funnel_component_id) AS k
               FROM message WHERE msg_id = ANY(p_msg_ids) AND funnel_value IS NOT NULL
              ORDER BY 1) s;
END
$$;

-- The place in line (message.fair_at) of a new message: now, or for the p_rank-th new message
-- of a funnel (1 for one inserted alone), p_rank seconds after the newest message of that
-- funnel still waiting to start (NEW, IN_QUEUE, POSTPONED), when that is later: a virtual clock, so that funnels with many waiting
-- messages take turns with each other and with what comes meanwhile, instead of running one
-- funnel's backlog first.
CREATE OR REPLACE FUNCTION orderly_fair_at(p_value text, p_component text, p_rank bigint)
    RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_value IS NULL THEN
        RETURN now();
    END IF;
    RETURN greatest(now() + make_interval(secs => p_rank - 1),
                    (SELECT o.fair_at FROM message o
                      WHERE o.funnel_value = p_value
                        AND o.state NOT IN ('OK', 'CANCEL')
                        AND o.state IN ('NEW', 'IN_QUEUE', 'POSTPONED')
                        AND o.funnel_component_id IS NOT DISTINCT FROM p_component
                      ORDER BY o.msg_timestamp DESC, o.msg_id DESC
                      LIMIT 1) + make_interval(secs => p_rank));
END
$$;

-- When a message a funnel holds back is looked at again: after postponedIntervalSec (its
-- release normally comes first, when the message ahead of it ends).
CREATE OR REPLACE FUNCTION orderly_postponed_due() RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (
        SELECT now() + make_interval(secs => coalesce(
            (SELECT coalesce(current_value, default_value)::int FROM configuration
              WHERE code = 'asynch.postponedIntervalSec'), 5)));
END
$$;

-- How many messages of one funnel value may run at once: its component's funnel_limit, or one
-- (the seed's funnel). '' stands for funnels without a component.
CREATE OR REPLACE FUNCTION orderly_funnel_limit(p_component text) RETURNS integer
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
BEGIN
    RETURN (
        SELECT coalesce((SELECT max_in_flight FROM funnel_limit
                          WHERE component_id = coalesce(p_component, '')), 1));
END
$$;

-- May this message (p_msg_id NULL: one not yet stored, newer than all) not go on now?
--   funnel: as many other messages of the funnel as its limit (orderly_funnel_limit, one
--           unless its component has a funnel_limit) are active (PROCESSING, WAITING,
--           WAITING_FOR_RES) and were started within asynch.funnelIdleIntervalSec;
--   guaranteed order: another message of the funnel is active, or an older guaranteed-order
--           message of the funnel is not final (FAILED counts unless p_exclude_failed).
CREATE OR REPLACE FUNCTION orderly_funnel_blocked(
    p_msg_id bigint, p_value text, p_component text, p_ts timestamptz,
    p_guaranteed boolean, p_exclude_failed boolean) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
-- One query per kind of funnel, each with no condition on the kind: a plan cached for the
-- session serves every call (a query whose conditions hinge on p_guaranteed would be planned
-- again on each call).
DECLARE
    v_idle integer;
    v_limit integer;
BEGIN
    IF p_guaranteed THEN
        RETURN EXISTS (
            SELECT 1 FROM message o
             WHERE o.funnel_value = p_value
               AND o.state NOT IN ('OK', 'CANCEL')
               AND o.funnel_component_id IS NOT DISTINCT FROM p_component
               AND o.msg_id IS DISTINCT FROM p_msg_id
               AND (o.state IN ('PROCESSING', 'WAITING', 'WAITING_FOR_RES')
                    OR (o.guaranteed_order
                        AND (o.msg_timestamp < p_ts
                             OR (o.msg_timestamp = p_ts AND p_msg_id IS NOT NULL
                                 AND o.msg_id < p_msg_id))
                        AND (o.state <> 'FAILED' OR NOT p_exclude_failed))));
    END IF;
    v_idle := coalesce((SELECT coalesce(current_value, default_value)::int
                          FROM configuration WHERE code = 'asynch.funnelIdleIntervalSec'), 600);
    v_limit := orderly_funnel_limit(p_component);
    -- as many active ones (started within funnelIdleIntervalSec) as the limit: one for the
    -- seed's funnel
    RETURN (SELECT count(*) FROM (
                SELECT 1 FROM message o
                 WHERE o.funnel_value = p_value
                   AND o.state NOT IN ('OK', 'CANCEL')
                   AND o.state IN ('PROCESSING', 'WAITING', 'WAITING_FOR_RES')
                   AND o.funnel_component_id IS NOT DISTINCT FROM p_component
                   AND o.msg_id IS DISTINCT FROM p_msg_id
                   AND o.last_process_timestamp >= now() - make_interval(secs => v_idle)
                 LIMIT v_limit) active) >= v_limit;
END
$$;

-- How many more messages of a funnel may start now (0 or more): its limit less those active.
-- A claim takes that many of a funnel's due messages at most (worker.messages.batches); guaranteed
-- order takes one, the claim's orderly_funnel_blocked deciding.
CREATE OR REPLACE FUNCTION orderly_funnel_free(p_value text, p_component text) RETURNS integer
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (
        SELECT greatest(0, orderly_funnel_limit(p_component) - (
            SELECT count(*) FROM message o
             WHERE o.funnel_value = p_value
               AND o.state NOT IN ('OK', 'CANCEL')
               AND o.state IN ('PROCESSING', 'WAITING', 'WAITING_FOR_RES')
               AND o.funnel_component_id IS NOT DISTINCT FROM p_component
               AND o.last_process_timestamp >= now() - make_interval(secs =>
                   coalesce((SELECT coalesce(current_value, default_value)::int
                               FROM configuration
                              WHERE code = 'asynch.funnelIdleIntervalSec'), 600)))::integer));
END
$$;

-- Release the funnel's oldest POSTPONED message if it may go on now: POSTPONED -> IN_QUEUE;
-- a funnel whose limit allows more than one at a time releases as many as it has free slots.
-- Only the oldest are looked at: in guaranteed order every other one waits behind them, and in
-- a plain funnel whatever blocks them blocks them all. The released ids are appended to the
-- transaction's 'orderly.released' setting, from which the caller enqueues them after commit.
-- Returns the first released id.
CREATE OR REPLACE FUNCTION orderly_funnel_release(p_value text, p_component text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_first bigint;
    v_id bigint;
    v_blocked boolean;
    v_slots integer := 1;
BEGIN
    PERFORM pg_advisory_xact_lock(orderly_funnel_key(p_value, p_component));
    IF orderly_funnel_limit(p_component) > 1 THEN
        v_slots := orderly_funnel_free(p_value, p_component);
    END IF;
    FOR v_id, v_blocked IN
        SELECT c.msg_id,
               orderly_funnel_blocked(c.msg_id, c.funnel_value, c.funnel_component_id,
                                      c.msg_timestamp, c.guaranteed_order,
                                      c.exclude_failed_state)
          FROM message c
         WHERE c.funnel_value = p_value
           AND c.state NOT IN ('OK', 'CANCEL')
           AND c.funnel_component_id IS NOT DISTINCT FROM p_component
           AND c.state = 'POSTPONED'
         ORDER BY c.msg_timestamp, c.msg_id
         LIMIT greatest(v_slots, 1)
           -- waited for, not skipped: beat's due take may hold the row for a moment (it never
           -- waits itself); skipped, the funnel could be left with nothing released. NO KEY:
           -- the release changes no key, so a child's insert (its foreign key's share lock
           -- on this parent row) and the purge's lock of an open member (KEY SHARE) do not
           -- hold it up
           FOR NO KEY UPDATE
    LOOP
        EXIT WHEN v_blocked;
        UPDATE message
           SET state = 'IN_QUEUE', start_in_queue_timestamp = now(),
               last_process_timestamp = now(), due_at = NULL
         WHERE msg_id = v_id;
        PERFORM set_config('orderly.released',
                           concat_ws(',', nullif(current_setting('orderly.released', true), ''),
                                     v_id::text),
                           true);
        v_first := coalesce(v_first, v_id);
    END LOOP;
    RETURN v_first;
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
    SELECT state INTO v_state FROM message WHERE msg_id = p_parent FOR NO KEY UPDATE;
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

-- Workers' outcomes, each only while its connection holds the claim, in one statement: one
-- message's, or a batch's OK outcomes held for its round. Arrays, one element per outcome:
-- msg ids; kinds: OK; FAIL (PARTLY_FAILED, or FAILED once failed_count reached its limit);
-- FAILED (final at once); WAITING (a parent whose children were just stored); WAITING_FOR_RES
-- (IN_QUEUE instead if the response already came); POSTPONED (taken up again when due); the
-- failure limits, error codes, descriptions, custom data, the newer message that made one
-- obsolete, and how long a PARTLY_FAILED or POSTPONED one waits before it is due again (ms:
-- its retry policy's delay, or postponedIntervalSec; the due-work ticker takes it up then,
-- worker.messages.due). Their funnels' locks come first, in key order. Returns, in the order
-- given, each one's new state (NULL: its claim was lost) and, on every row, the funnel
-- messages the outcomes released (comma-separated; a HARD child's OK may settle its parent,
-- and that the parent's funnel).
CREATE OR REPLACE FUNCTION orderly_finish_many(
    p_msg_ids bigint[], p_kinds text[], p_limits integer[], p_codes text[], p_descs text[],
    p_customs text[], p_obsolete_by bigint[], p_due_ms bigint[])
    RETURNS TABLE (msg_id bigint, new_state text, released text)
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    v_states text[];
BEGIN
    PERFORM orderly_lock_funnels_of(p_msg_ids);
    PERFORM set_config('orderly.released', '', true);
    WITH o AS (
        SELECT * FROM unnest(p_msg_ids, p_kinds, p_limits, p_codes, p_descs, p_customs,
                             p_obsolete_by, p_due_ms)
                      AS o(id, kind, fail_limit, code, descr, custom, obsolete_by, due_ms)),
    done AS (
        UPDATE message m
           SET state = CASE o.kind
                           WHEN 'FAIL' THEN CASE WHEN m.failed_count >= o.fail_limit
                                                 THEN 'FAILED' ELSE 'PARTLY_FAILED' END
                           WHEN 'WAITING_FOR_RES' THEN CASE WHEN m.wait_res_id IS NULL
                                                            THEN 'WAITING_FOR_RES'
                                                            ELSE 'IN_QUEUE' END
                           ELSE o.kind END,
               failed_count = m.failed_count
                              + CASE WHEN o.kind IN ('FAIL', 'FAILED') THEN 1 ELSE 0 END,
               failed_error_code = CASE WHEN o.kind IN ('FAIL', 'FAILED') THEN o.code
                                        ELSE m.failed_error_code END,
               failed_desc = CASE WHEN o.kind IN ('FAIL', 'FAILED') THEN o.descr
                                  ELSE m.failed_desc END,
               obsolete_by = coalesce(o.obsolete_by, m.obsolete_by),
               custom_data = o.custom,
               last_process_timestamp = now(),
               start_in_queue_timestamp = CASE WHEN o.kind = 'WAITING_FOR_RES'
                                                AND m.wait_res_id IS NOT NULL
                                               THEN now() ELSE m.start_in_queue_timestamp END,
               due_at = CASE WHEN (o.kind = 'FAIL' AND m.failed_count < o.fail_limit)
                                  OR o.kind = 'POSTPONED'
                             THEN now() + make_interval(secs => coalesce(o.due_ms, 0) / 1000.0)
                        END,
               processing_pid = NULL
          FROM o
         WHERE m.msg_id = o.id AND m.state = 'PROCESSING'
           AND m.processing_pid = pg_backend_pid()
        RETURNING m.msg_id, m.state)
    SELECT array_agg(done.msg_id), array_agg(done.state) INTO v_ids, v_states FROM done;
    -- the transition trigger has run for each row by now (released, parents settled)
    FOR i IN 1 .. coalesce(array_length(v_ids, 1), 0) LOOP
        IF v_states[i] = 'WAITING' THEN
            v_states[i] := orderly_parent_check(v_ids[i]);
        END IF;
    END LOOP;
    RETURN QUERY
        SELECT o.id, s.state, current_setting('orderly.released', true)
          FROM unnest(p_msg_ids) WITH ORDINALITY AS o(id, n)
          LEFT JOIN unnest(v_ids, v_states) AS s(id, state) ON s.id = o.id
         ORDER BY o.n;
END
$$;

-- One outcome, as workers of the previous release record it (orderly_finish_many for one).
CREATE OR REPLACE FUNCTION orderly_finish_v2(
    p_msg_id bigint, p_kind text, p_limit integer, p_code text, p_desc text, p_custom text,
    p_obsolete_by bigint, p_due_ms bigint) RETURNS TABLE (new_state text, released text)
LANGUAGE sql AS $$
    SELECT f.new_state, f.released
      FROM orderly_finish_many(ARRAY[p_msg_id], ARRAY[p_kind], ARRAY[p_limit], ARRAY[p_code],
                               ARRAY[p_desc], ARRAY[p_custom], ARRAY[p_obsolete_by],
                               ARRAY[p_due_ms]) f
$$;

-- The outcome as workers of the previous release record it (seven arguments), kept so that
-- they run beside new ones during a deploy: their retries wait partlyFailedIntervalSec,
-- their postponements postponedIntervalSec. A later migration drops it.
CREATE OR REPLACE FUNCTION orderly_finish(
    p_msg_id bigint, p_kind text, p_limit integer, p_code text, p_desc text, p_custom text,
    p_obsolete_by bigint) RETURNS TABLE (new_state text, released text)
LANGUAGE sql AS $$
    SELECT * FROM orderly_finish_v2(
        p_msg_id, p_kind, p_limit, p_code, p_desc, p_custom, p_obsolete_by,
        1000 * coalesce((SELECT coalesce(current_value, default_value)::bigint
                           FROM configuration
                          WHERE code = CASE WHEN p_kind = 'POSTPONED'
                                            THEN 'asynch.postponedIntervalSec'
                                            ELSE 'asynch.partlyFailedIntervalSec' END),
                        CASE WHEN p_kind = 'POSTPONED' THEN 5 ELSE 60 END))
$$;
