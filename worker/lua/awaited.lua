-- The awaited agent's turn (getAwaitedMessages): take the due members of pendingMessages
-- and claim them by moving their score forward, so another agent does not take them too.
-- KEYS[1] pendingMessages of one shard (beat's turn walks every shard, models/keys.py)
-- ARGV[1] now (ms)  ARGV[2] AWAITED_MESSAGES_BY_TURN  ARGV[3] response key prefix
-- ARGV[4] MAX_PENDING_TTL * AWAITED_RETRIES_FACTOR (ms)
-- A member still PENDING becomes AWAITED with awaitedRetries + 1; each taken member's next
-- look is at now + awaitedRetries * MAX_PENDING_TTL * factor (never past its expiry).
-- Returns a JSON object: wake (conversation ids to re-queue), expired ([member, cnId,
-- status] whose AWAITED_MESSAGE_TTL ran out), vanished ([response id, cnId] whose hash is
-- gone: its life over, or evicted; the caller asks PostgreSQL which),
-- taken (how many members this turn claimed).
local now, pending_key, res_prefix = tonumber(ARGV[1]), KEYS[1], ARGV[3]
local step = tonumber(ARGV[4])
local out = {wake = {}, expired = {}, vanished = {}, taken = 0}
local seen = {}
local due = redis.call('ZRANGEBYSCORE', pending_key, '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
for _, m in ipairs(due) do
  local info = cjson.decode(m)
  local key = res_prefix .. info['rsId']
  local f = redis.call('HMGET', key, 'status', 'expiresAt', 'awaitedRetries', 'expiresAtTS')
  if not f[1] then
    redis.call('ZREM', pending_key, m)
    out.vanished[#out.vanished + 1] = {info['rsId'], info['cnId']}
  else
    local expires = num(f[2], num(f[4], now))
    out.taken = out.taken + 1
    if expires <= now then
      -- Claimed for the caller, who removes it for good (a SENT one counts as delivered).
      redis.call('ZADD', pending_key, now + step, m)
      out.expired[#out.expired + 1] = {m, info['cnId'], f[1]}
    else
      local retries = tonumber(f[3]) or 0
      if f[1] == 'PENDING' then
        -- Blocked too long, or its sender died: AWAITED, one more awaited retry. (An
        -- AWAITED one was counted when its attempts ran out.)
        retries = retries + 1
        redis.call('HSET', key, 'status', 'AWAITED', 'awaitedRetries', retries,
          'awaitedToDate', now, 'awaitedToDateTS', seconds(now))
      end
      redis.call('ZADD', pending_key, math.min(now + math.max(retries, 1) * step, expires), m)
    end
    if not seen[info['cnId']] then
      seen[info['cnId']] = true
      out.wake[#out.wake + 1] = info['cnId']
    end
  end
end
return cjson.encode(out)
