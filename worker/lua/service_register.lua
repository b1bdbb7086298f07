-- Register one service (a worker) under the namespace: a new id and its expiring hash.
-- KEYS[1] :service:id (counter)  KEYS[2] :service:ids
-- ARGV[1] :service: prefix  ARGV[2] expire (ms)  ARGV[3..] field, value pairs of the hash
-- Returns the id; refuses with ORDERLY_KEY_EXISTS when :service:$id already exists (a
-- counter reset under live keys): nothing is kept.
local id = redis.call('INCR', KEYS[1])
local key = ARGV[1] .. id
if redis.call('EXISTS', key) == 1 then
  return redis.error_reply('ORDERLY_KEY_EXISTS ' .. key)
end
local fields = {}
for i = 3, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call('HSET', key, unpack(fields))
redis.call('PEXPIRE', key, tonumber(ARGV[2]))
redis.call('SADD', KEYS[2], id)
return id
