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
