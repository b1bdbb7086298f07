-- Nodes, the configuration table, delivery channels: the store's own settings.

-- name: node_register
-- The node in RUN if it is new; an existing node keeps the state an operator gave it. Nothing
-- on a conflict with any unique index: when the processes of a new node register at once,
-- the later insert may meet the first's row on uq_node_name (name = code), which an arbiter
-- of (code) alone would leave to raise. node_registered then reads the id.
INSERT INTO node (code, name, description, state, last_heartbeat)
VALUES (:code, :code, :description, 'RUN', now())
ON CONFLICT DO NOTHING;

-- name: node_registered
-- A statement of its own, after node_register: its snapshot holds a row another process
-- committed meanwhile.
UPDATE node SET last_heartbeat = now() WHERE code = :code RETURNING node_id;

-- name: node_heartbeat
UPDATE node SET last_heartbeat = now() WHERE node_id = :id RETURNING state;

-- name: node_set_state
-- An operator's change of state, with who made it and the note given (NULL: none).
UPDATE node SET state = :state, state_changed_at = now(), state_changed_by = :by,
       state_note = :note
 WHERE code = :code RETURNING node_id;

-- name: node_state
SELECT state FROM node WHERE node_id = :id;

-- name: node_code_state
SELECT code, state FROM node WHERE node_id = :id;

-- name: node_list
SELECT node_id, code, state, last_heartbeat,
       last_heartbeat IS NOT NULL
       AND now() - last_heartbeat <= make_interval(secs => :timeout_s) AS alive,
       state_changed_at, state_changed_by, state_note
  FROM node ORDER BY code;

-- name: config_ensure_defaults
-- A known item missing from the table, with its default; existing rows stay as they are.
INSERT INTO configuration (code, category_code, current_value, default_value, data_type,
                           mandatory, validation, description)
VALUES (:code, :category, NULL, :default, :data_type, :mandatory, :validation, :description)
ON CONFLICT (code) DO NOTHING;

-- name: config_list
SELECT code, category_code, current_value, default_value, data_type, mandatory, validation,
       description
  FROM configuration ORDER BY code;

-- name: config_get
SELECT code, category_code, current_value, default_value, data_type, mandatory, validation,
       description
  FROM configuration WHERE code = :code;

-- name: config_lock
SELECT code, category_code, current_value, default_value, data_type, mandatory, validation,
       description
  FROM configuration WHERE code = :code FOR UPDATE;

-- name: config_set
UPDATE configuration SET current_value = :value WHERE code = :code;

-- name: config_values
SELECT code, COALESCE(current_value, default_value) FROM configuration;

-- name: channel_put
INSERT INTO channel (origin, url, delivery_delay_ms, multiplier, attempts, timeout_ms,
                     updated_at)
VALUES (:origin, :url, :delivery_delay_ms, :multiplier, :attempts, :timeout_ms, now())
ON CONFLICT (origin) DO UPDATE
   SET url = EXCLUDED.url, delivery_delay_ms = EXCLUDED.delivery_delay_ms,
       multiplier = EXCLUDED.multiplier, attempts = EXCLUDED.attempts,
       timeout_ms = EXCLUDED.timeout_ms, updated_at = now();

-- name: channel_list
SELECT origin, url, delivery_delay_ms, multiplier, attempts, timeout_ms FROM channel;

-- name: ack_secrets
SELECT origin, secret FROM channel_ack_secret;

-- name: ack_secrets_make
-- The secret itself comes from the column's default (two random UUIDs: 244 random bits).
INSERT INTO channel_ack_secret (origin)
SELECT unnest(CAST(:origins AS varchar[]))
ON CONFLICT (origin) DO NOTHING;

-- name: ready_ping
-- GET /ready: the server answers a query.
SELECT 1;

-- name: backend_pid
-- Start-up: the pid of the backend that runs this connection's queries (a pooler between
-- client and server gives the client a key of its own at connect).
SELECT pg_backend_pid();
