-- A drain whose worker died (the PostgreSQL connection it held is gone): its lease is freed
-- and its conversation woken at once, instead of after MAX_PENDING_TTL. Only the very drain
-- that was found dead is released: the entry and the lease must still be its.
-- KEYS[1] running drains (the shard's)  KEYS[2] the conversation's drain lease
-- KEYS[3] scheduled (the shard's)
-- KEYS[4] the conversation's response order
-- ARGV[1] conversationId  ARGV[2] the entry found dead ('pid|token|ms')  ARGV[3] now (ms)
-- ARGV[4] '1' the worker died; '0' PostgreSQL restarted under a live drain (the head it had
--   in flight is not counted as lost); 'forget' the worker lives but the entry is old: it
--   goes only if its lease has ended (a drain that raised leaves its entry behind)
-- ARGV[5] response key prefix  ARGV[6] MESSAGE_TTL (ms)
-- Returns 1 when released, 0 when that drain had already ended or been replaced.
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
local token = string.match(ARGV[2], '^[^|]*|([^|]*)|')
local held = redis.call('GET', KEYS[2]) == token
if ARGV[4] == 'forget' then
  if not held then redis.call('HDEL', KEYS[1], ARGV[1]) end
  return 0
end
redis.call('HDEL', KEYS[1], ARGV[1])
if not held then return 0 end
redis.call('DEL', KEYS[2])
if ARGV[4] == '0' then
  local first = redis.call('ZRANGE', KEYS[4], 0, 0)[1]
  if first then redis.call('HDEL', ARGV[5] .. cjson.decode(first)['rsId'], 'claimedAt') end
end
local now = tonumber(ARGV[3])
redis.call('ZADD', KEYS[3], 'LT', now, ARGV[1])
local ttl = tonumber(ARGV[6])
if redis.call('PTTL', KEYS[3]) < ttl then redis.call('PEXPIRE', KEYS[3], ttl) end
return 1
