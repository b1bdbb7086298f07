-- Renew a service's key, only if it is still there: a deleted (or expired) key means the
-- service must stop, and renewing must not bring it back. Its mark is renewed with it.
-- KEYS[1] :service:$id  KEYS[2] :service:$id:mark
-- ARGV[1] expire (ms)  ARGV[2] now (ms)  ARGV[3] the mark's life (ms)
-- Returns 1 when renewed; 0 when the key is gone but its mark is there (removed: stop);
-- -1 when both are gone (Redis lost its data, or the key and mark both expired).
if redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1])) == 0 then
  if redis.call('EXISTS', KEYS[2]) == 1 then
    return 0
  end
  return -1
end
redis.call('HSET', KEYS[1], 'renewed', ARGV[2])
redis.call('SET', KEYS[2], '1', 'PX', tonumber(ARGV[3]))
return 1
