-- Takes the conversations whose wake-up time has come (a retry wait, an ACK deadline, an
-- expiring head request). Taking removes them, so two schedulers never take the same one.
-- KEYS[1] scheduled
-- ARGV[1] now (ms)  ARGV[2] how many at most
-- Returns the conversation ids.
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #due > 0 then redis.call('ZREM', KEYS[1], unpack(due)) end
return due
