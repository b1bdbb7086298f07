-- Put a live service's key back under its own id, after it expired while the service could
-- not renew it (Redis unreachable, or restarted without its data).
-- KEYS[1] :service:$id  KEYS[2] :service:ids  KEYS[3] :service:id (counter)
-- ARGV[1] id  ARGV[2] expire (ms)  ARGV[3..] field, value pairs of the hash
-- Returns 1 when restored, 0 when the key exists (nothing changed).
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local fields = {}
for i = 3, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
redis.call('SADD', KEYS[2], ARGV[1])
-- After a restart the counter may be behind: never hand this id out again.
if tonumber(redis.call('GET', KEYS[3]) or '0') < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[3], ARGV[1])
end
return 1
