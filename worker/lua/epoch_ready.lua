-- The end of a rebuild: the Redis marker says "ready" again, only if it still holds this
-- rebuild's generation (a loss during the rebuild removed it: the next check rebuilds again).
-- KEYS[1] one shard's marker hash (<prefix>:{bq:<count>:<shard>}:epoch)
-- ARGV[1] the rebuild's generation  ARGV[2] the run_id of the server holding the marker
-- Returns 1 when marked ready, 0 when the marker is gone or another generation's.
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', 'ready', 'run_id', ARGV[2])
return 1
