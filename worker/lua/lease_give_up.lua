-- Give a lease up, only by its holder.
-- KEYS[1] lease key  ARGV[1] token
-- Returns 1 when released, 0 when the token did not hold it.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
