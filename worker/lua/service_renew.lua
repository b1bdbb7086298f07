-- Renew a service's key, only if it is still there: a deleted (or expired) key means the
-- service must stop, and renewing must not bring it back.
-- KEYS[1] :service:$id  ARGV[1] expire (ms)  ARGV[2] now (ms)
-- Returns 1 when renewed, 0 when the key is gone.
if redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1])) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'renewed', ARGV[2])
return 1
