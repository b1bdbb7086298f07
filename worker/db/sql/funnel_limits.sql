-- Funnel limits (worker.messages.limits): how many messages of one funnel value of a component
-- may run at once, and start a second (rate_per_s, burst; NULL: no rate). The claim reads the table itself (orderly_funnel_limit in functions.sql), so
-- what these write holds from the next claim on. component_id '' stands for funnels without a
-- component. :now is the caller's clock (worker.core.clock), never the server's.

-- name: funnel_limit_list
-- Every limit, by component.
SELECT component_id, max_in_flight, rate_per_s, burst, updated_at
  FROM funnel_limit
 ORDER BY component_id;

-- name: funnel_limit_show
SELECT component_id, max_in_flight, rate_per_s, burst, updated_at
  FROM funnel_limit
 WHERE component_id = :component_id;

-- name: funnel_limit_set
-- A component's limit, made or replaced in one statement (two operators setting the same
-- component at once: the last one wins, neither fails). created is true for a new row: a row
-- inserted in this transaction has no xmax, one updated by the ON CONFLICT branch has this
-- transaction's.
INSERT INTO funnel_limit AS f (component_id, max_in_flight, rate_per_s, burst, updated_at)
VALUES (:component_id, :max_in_flight, :rate_per_s, :burst, :now)
    ON CONFLICT (component_id)
    DO UPDATE SET max_in_flight = EXCLUDED.max_in_flight, rate_per_s = EXCLUDED.rate_per_s,
                  burst = EXCLUDED.burst, updated_at = EXCLUDED.updated_at
RETURNING f.component_id, f.max_in_flight, f.rate_per_s, f.burst, f.updated_at,
          (f.xmax = 0) AS created;

-- name: funnel_limit_delete
-- A component's limit removed: its funnels run one message at a time again.
DELETE FROM funnel_limit
 WHERE component_id = :component_id
RETURNING component_id;
