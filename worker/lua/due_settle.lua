-- Forget taken members of a due set: the broker has them.
-- KEYS[1] due set (unused)  KEYS[2] leased set
-- ARGV[1..] members
-- Returns how many were settled.
return redis.call('ZREM', KEYS[2], unpack(ARGV))
