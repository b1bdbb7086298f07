-- Make taken members due again at once (the broker did not take them), only those still
-- leased by the take whose lease end is ARGV[2].
-- KEYS[1] due set  KEYS[2] leased set
-- ARGV[1] now (ms)  ARGV[2] the take's lease end (ms)  ARGV[3..] members
-- Returns how many were released.
local released = 0
for i = 3, #ARGV do
  if tonumber(redis.call('ZSCORE', KEYS[2], ARGV[i])) == tonumber(ARGV[2]) then
    redis.call('ZREM', KEYS[2], ARGV[i])
    redis.call('ZADD', KEYS[1], 'LT', tonumber(ARGV[1]), ARGV[i])
    released = released + 1
  end
end
return released
