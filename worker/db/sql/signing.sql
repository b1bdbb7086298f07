-- Signing secrets (worker/signing.py): one per destination, made on first use.

-- name: signing_secret_get
-- A destination's secret and, while a rotation lets it count, the previous one; :secret is
-- stored first when the destination has none yet (two senders racing keep the first).
WITH made AS (
    INSERT INTO signing_secret (kind, name, secret)
    VALUES (:kind, :name, :secret)
    ON CONFLICT (kind, name) DO NOTHING
    RETURNING secret, previous, previous_until, rotated_at)
SELECT secret, previous, previous_until, rotated_at FROM made
UNION ALL
SELECT secret, previous, previous_until, rotated_at FROM signing_secret
 WHERE kind = :kind AND name = :name
 LIMIT 1;

-- name: signing_secret_rotate
-- A new secret (:secret); the one before is still signed with for :keep_s seconds (0: no
-- longer). Creates the destination's row if it had none.
INSERT INTO signing_secret (kind, name, secret, rotated_at)
VALUES (:kind, :name, :secret, now())
ON CONFLICT (kind, name) DO UPDATE
   SET previous = CASE WHEN :keep_s > 0 THEN signing_secret.secret END,
       previous_until = CASE WHEN :keep_s > 0
                             THEN now() + make_interval(secs => :keep_s) END,
       secret = EXCLUDED.secret,
       rotated_at = now()
RETURNING secret, previous, previous_until, rotated_at;

-- name: signing_secret_get_owned
-- signing_secret_get for an API caller: only a destination that exists and is the caller's
-- (:origins, :subscriptions, :source_systems: its key's; NULL: any), checked in this statement.
WITH dest AS (
    SELECT CASE :kind
             WHEN 'channel' THEN EXISTS (
               SELECT 1 FROM channel WHERE origin = :name
                  AND (CAST(:origins AS text[]) IS NULL OR origin = ANY(CAST(:origins AS text[]))))
             WHEN 'subscription' THEN EXISTS (
               SELECT 1 FROM subscription WHERE CAST(subscription_id AS text) = :name
                  AND (CAST(:subscriptions AS bigint[]) IS NULL
                       OR subscription_id = ANY(CAST(:subscriptions AS bigint[]))))
             WHEN 'source_system' THEN EXISTS (
               SELECT 1 FROM source_system WHERE name = :name
                  AND (CAST(:source_systems AS text[]) IS NULL
                       OR name = ANY(CAST(:source_systems AS text[]))))
             ELSE false END AS ok),
made AS (
    INSERT INTO signing_secret (kind, name, secret)
    SELECT :kind, :name, :secret FROM dest WHERE dest.ok
    ON CONFLICT (kind, name) DO NOTHING
    RETURNING secret, previous, previous_until, rotated_at)
SELECT secret, previous, previous_until, rotated_at FROM made
UNION ALL
SELECT s.secret, s.previous, s.previous_until, s.rotated_at
  FROM signing_secret s, dest
 WHERE dest.ok AND s.kind = :kind AND s.name = :name
 LIMIT 1;

-- name: signing_secret_rotate_owned
-- signing_secret_rotate for an API caller: only a destination that exists and is the caller's
-- (as signing_secret_get_owned), checked in this statement.
WITH dest AS (
    SELECT CASE :kind
             WHEN 'channel' THEN EXISTS (
               SELECT 1 FROM channel WHERE origin = :name
                  AND (CAST(:origins AS text[]) IS NULL OR origin = ANY(CAST(:origins AS text[]))))
             WHEN 'subscription' THEN EXISTS (
               SELECT 1 FROM subscription WHERE CAST(subscription_id AS text) = :name
                  AND (CAST(:subscriptions AS bigint[]) IS NULL
                       OR subscription_id = ANY(CAST(:subscriptions AS bigint[]))))
             WHEN 'source_system' THEN EXISTS (
               SELECT 1 FROM source_system WHERE name = :name
                  AND (CAST(:source_systems AS text[]) IS NULL
                       OR name = ANY(CAST(:source_systems AS text[]))))
             ELSE false END AS ok)
INSERT INTO signing_secret (kind, name, secret, rotated_at)
SELECT :kind, :name, :secret, now() FROM dest WHERE dest.ok
ON CONFLICT (kind, name) DO UPDATE
   SET previous = CASE WHEN :keep_s > 0 THEN signing_secret.secret END,
       previous_until = CASE WHEN :keep_s > 0
                             THEN now() + make_interval(secs => :keep_s) END,
       secret = EXCLUDED.secret,
       rotated_at = now()
RETURNING secret, previous, previous_until, rotated_at;
