-- removeAllReferencesAtTime: the response's references go at a time. The removal is due work
-- in the shard's scheduled set (the conversations' wake-ups, walked by the ticker): its member
-- is the response's MinMessageInfo (a JSON object; a conversation id is never one), handed to
-- conv_remove_due.lua when due. A later call moves the time.
-- KEYS[1] response hash   KEYS[2] scheduled (the shard's)
-- ARGV[1] when (ms)  ARGV[2] now (ms)  ARGV[3] MESSAGE_TTL (ms: the set outlives its members)
-- Returns {'SCHEDULED', msgId, when} or {'UNKNOWN'}.
local at, now = tonumber(ARGV[1]), tonumber(ARGV[2])
local f = redis.call('HMGET', KEYS[1], 'member', 'msgId')
if not f[1] then return {'UNKNOWN'} end
redis.call('HSET', KEYS[1], 'removeAt', at)
redis.call('ZADD', KEYS[2], at, f[1])
local ttl = tonumber(ARGV[3]) + at - now
if redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
return {'SCHEDULED', f[2], at}
