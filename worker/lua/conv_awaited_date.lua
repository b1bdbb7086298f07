-- updateAwaitedExpires: an operator gives an AWAITED response a new awaitedToDate; the awaited
-- agent takes it up then (its pendingMessages score).
-- KEYS[1] response hash   KEYS[2] pendingMessages
-- ARGV[1] the new date (ms)  ARGV[2] now (ms)
-- Returns {'SET', msgId, date, awaitedRetries}, {'UNKNOWN'}, {'NOT_AWAITED', status} or
-- {'PAST_EXPIRY', expiresAt (ms)} (the response's AWAITED_MESSAGE_TTL ends before the date).
local at, now = tonumber(ARGV[1]), tonumber(ARGV[2])
local f = redis.call('HMGET', KEYS[1], 'status', 'member', 'msgId', 'awaitedRetries')
if not f[1] then return {'UNKNOWN'} end
if f[1] ~= 'AWAITED' then return {'NOT_AWAITED', f[1]} end
local expires = expires_at(KEYS[1])
if at > num(expires, at) then return {'PAST_EXPIRY', tostring(expires)} end
redis.call('HSET', KEYS[1], 'awaitedToDate', at, 'awaitedToDateTS', seconds(at), 'notBefore', at,
  'lastAccess', now)
redis.call('ZADD', KEYS[2], at, f[2])
return {'SET', f[3], at, num(f[4], 0)}
