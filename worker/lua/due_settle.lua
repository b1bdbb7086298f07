-- Forget taken members of a due set (the broker has them), only those still leased by the
-- take whose lease end is ARGV[1] (another take's are left alone).
-- KEYS[1] due set (unused)  KEYS[2] leased set
-- ARGV[1] the take's lease end (ms)  ARGV[2..] members
-- Returns how many were settled.
local settled = 0
for i = 2, #ARGV do
  if tonumber(redis.call('ZSCORE', KEYS[2], ARGV[i])) == tonumber(ARGV[1]) then
    settled = settled + redis.call('ZREM', KEYS[2], ARGV[i])
  end
end
return settled
