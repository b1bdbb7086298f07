-- Make taken members due again at once: the broker did not take them.
-- KEYS[1] due set  KEYS[2] leased set
-- ARGV[1] now (ms)  ARGV[2..] members
-- Returns how many were released.
local released = 0
for i = 2, #ARGV do
  if redis.call('ZREM', KEYS[2], ARGV[i]) == 1 then
    redis.call('ZADD', KEYS[1], 'LT', tonumber(ARGV[1]), ARGV[i])
    released = released + 1
  end
end
return released
