-- One turn of the timeout monitor (message-tracking-timeouts.txt). One atomic step.
-- KEYS[1] :message:done  KEYS[2] :message:ids  KEYS[3] :metrics:done
-- KEYS[4] :metrics:timeout  KEYS[5] :metrics:expired
-- ARGV[1] :message: prefix  ARGV[2] now (ms)
-- ARGV[3] batch: most done ids, and most listed ids, looked at in this turn
-- ARGV[4..] histogram bucket bounds (ms, ascending); larger values go to 'le:+Inf'
-- 1. Done ids, oldest first: done metrics get done - timestamp (count, sum, max, bucket, and
--    a count per kind in 'count:$kind'); the id is delisted. A done id whose hash has expired
--    is counted in :metrics:expired instead; one already counted as a timeout is not counted
--    again.
-- 2. Listed ids, oldest first: a missing hash is expired (counted, delisted); a passed
--    deadline is a timeout: timeout metrics get now - timestamp, the hash is marked, and the
--    id is delisted.
-- Returns {done, expired, timed_out} where timed_out lists {id, xid, kind, claim, elapsed}.
local prefix, now, batch = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local bounds = {}
for i = 4, #ARGV do
  bounds[#bounds + 1] = tonumber(ARGV[i])
end

local function observe(key, value, kind)
  redis.call('HINCRBY', key, 'count', 1)
  redis.call('HINCRBY', key, 'count:' .. kind, 1)
  redis.call('HINCRBY', key, 'sum', value)
  local max = tonumber(redis.call('HGET', key, 'max') or '-1')
  if value > max then
    redis.call('HSET', key, 'max', value)
  end
  local field = 'le:+Inf'
  for _, bound in ipairs(bounds) do
    if value <= bound then
      field = 'le:' .. bound
      break
    end
  end
  redis.call('HINCRBY', key, field, 1)
end

local done, expired, timed_out = 0, 0, {}

for _ = 1, batch do
  local id = redis.call('RPOP', KEYS[1])
  if not id then break end
  local key = prefix .. id
  local f = redis.call('HMGET', key, 'timestamp', 'done', 'kind', 'state')
  if not f[1] then
    expired = expired + 1
    redis.call('HINCRBY', KEYS[5], 'count', 1)
  elseif not f[4] then
    observe(KEYS[3], math.max(0, tonumber(f[2] or now) - tonumber(f[1])), f[3] or '')
    done = done + 1
    redis.call('HSET', key, 'state', 'done')
  end
  redis.call('LREM', KEYS[2], -1, id)
end

local oldest = redis.call('LRANGE', KEYS[2], -batch, -1)
for i = #oldest, 1, -1 do
  local id = oldest[i]
  local key = prefix .. id
  local f = redis.call('HMGET', key, 'timestamp', 'deadline', 'xid', 'kind', 'done', 'claim')
  if not f[1] then
    expired = expired + 1
    redis.call('HINCRBY', KEYS[5], 'count', 1)
    redis.call('LREM', KEYS[2], -1, id)
  elseif not f[5] and now > tonumber(f[2]) then
    local elapsed = now - tonumber(f[1])
    observe(KEYS[4], elapsed, f[4] or '')
    redis.call('HSET', key, 'state', 'timeout')
    redis.call('LREM', KEYS[2], -1, id)
    timed_out[#timed_out + 1] = {id, f[3], f[4] or '', f[6] or '', elapsed}
  end
end

return {done, expired, timed_out}
