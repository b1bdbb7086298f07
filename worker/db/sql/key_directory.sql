-- The API's directory of keys (worker.key_directory): what every key's token hashes to.

-- name: api_key_digests
-- Revoked and expired keys too: their tokens are refused by worker.keys.authenticate, which
-- says why; a token none of these is refused without a lookup of its own.
SELECT secret_hash FROM api_key;
