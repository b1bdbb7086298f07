-- API keys (worker.keys): created, listed, revoked, and looked up by prefix on every request.

-- name: api_key_insert
-- Nothing when a live key has the name already (the partial unique index: one statement, so
-- two creations of one name cannot both succeed).
INSERT INTO api_key (name, prefix, secret_hash, scopes, created_at, expires_at, owns)
VALUES (:name, :prefix, :secret_hash, CAST(:scopes AS varchar[]), :created_at, :expires_at,
        CAST(:owns AS jsonb))
ON CONFLICT (name) WHERE revoked_at IS NULL DO NOTHING
RETURNING name, prefix, scopes, created_at, expires_at, revoked_at, last_used_at, owns;

-- name: api_key_list
SELECT name, prefix, scopes, created_at, expires_at, revoked_at, last_used_at, owns
  FROM api_key
 WHERE :revoked OR revoked_at IS NULL
 ORDER BY name, created_at;

-- name: api_key_revoke
UPDATE api_key SET revoked_at = :now
 WHERE name = :name AND revoked_at IS NULL
RETURNING name, prefix, scopes, created_at, expires_at, revoked_at, last_used_at, owns;

-- name: api_key_by_prefix
SELECT key_id, name, secret_hash, scopes, expires_at, revoked_at, last_used_at, owns
  FROM api_key WHERE prefix = :prefix;

-- name: api_key_used
-- At most once a minute per key (worker.keys.LAST_USED_EVERY): not a write per request.
UPDATE api_key SET last_used_at = :now
 WHERE key_id = :key_id AND (last_used_at IS NULL OR last_used_at < :now);
