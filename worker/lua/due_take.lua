-- Take the due members of a due set: each moves to the set's leased set, scored by when its
-- lease ends (that score is the take's fencing token: only this take settles or releases
-- them). A member whose lease ended unsettled (its taker died before the broker had it) is
-- due again first.
-- KEYS[1] due set (members scored by due time, ms)   KEYS[2] leased set (scored by lease end)
-- ARGV[1] now (ms)  ARGV[2] most members to take  ARGV[3] lease end (ms, unique to the take)
-- Returns the taken members, earliest due first.
local now, limit, until_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, limit)) do
  redis.call('ZREM', KEYS[2], m)
  redis.call('ZADD', KEYS[1], 'LT', now, m)
end
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, limit)
for _, m in ipairs(due) do
  redis.call('ZREM', KEYS[1], m)
  redis.call('ZADD', KEYS[2], until_ms, m)
end
return due
