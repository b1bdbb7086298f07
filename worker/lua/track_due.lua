-- Take the timed-out messages whose retry is due. One atomic step, so two monitors never
-- retry the same message twice.
-- KEYS[1] :message:retry (members scored by due time, ms)
-- ARGV[1] now (ms)  ARGV[2] most members taken
-- Returns the members taken (removed from the set).
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #due > 0 then
  redis.call('ZREM', KEYS[1], unpack(due))
end
return due
