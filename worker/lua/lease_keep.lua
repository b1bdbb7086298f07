-- Extend a lease, only for its holder.
-- KEYS[1] lease key  ARGV[1] token  ARGV[2] lease (ms)
-- Returns 1 when extended, 0 when the token no longer holds it.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
