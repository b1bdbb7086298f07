-- Register one tracked message (message-tracking-timeouts.txt), or only count it when the
-- tracked ids are at capacity. One atomic step.
-- KEYS[1] :message:id (counter)  KEYS[2] :message:ids  KEYS[3] :metrics:overflow
-- ARGV[1] :message: prefix  ARGV[2] :message:xid: prefix  ARGV[3] capacity (ids listed)
-- ARGV[4] now (ms)  ARGV[5] messageTimeout (ms)  ARGV[6] messageExpire (ms)
-- ARGV[7] xid  ARGV[8] xid type ('number' | 'meta' | 'sha1')  ARGV[9] service id
-- ARGV[10] kind (what was tracked: 'message', 'drain', 'events', 'confirmation')
-- ARGV[11] claim: which claim of the message this is ('' when not a message)
-- Returns the new id; 0 when at capacity (only the overflow is counted). Refuses with
-- ORDERLY_KEY_EXISTS when the :message:$id hash already exists (a counter reset under live
-- keys): nothing is kept.
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[3]) then
  redis.call('HINCRBY', KEYS[3], 'count', 1)
  return 0
end
local id = redis.call('INCR', KEYS[1])
local key = ARGV[1] .. id
if redis.call('EXISTS', key) == 1 then
  return redis.error_reply('ORDERLY_KEY_EXISTS ' .. key)
end
local now, timeout, expire = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
redis.call('HSET', key, 'timestamp', ARGV[4], 'xid', ARGV[7], 'deadline', now + timeout,
  'service', ARGV[9], 'kind', ARGV[10], 'claim', ARGV[11])
redis.call('PEXPIRE', key, expire)
redis.call('LPUSH', KEYS[2], id)
local xid_key = ARGV[2] .. ARGV[7]
redis.call('HSET', xid_key, 'id', id, 'type', ARGV[8])
redis.call('PEXPIRE', xid_key, expire)
return id
