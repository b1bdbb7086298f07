-- A worker finished a tracked message: note when, then push its id to :message:done.
-- KEYS[1] :message:$id  KEYS[2] :message:done
-- ARGV[1] id  ARGV[2] now (ms)
-- Returns 1; 0 when the hash is gone (expired: the monitor delists the id) or the id was
-- already reported done (a second report changes nothing).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
if redis.call('HSETNX', KEYS[1], 'done', ARGV[2]) == 0 then
  return 0
end
redis.call('LPUSH', KEYS[2], ARGV[1])
return 1
