-- A removal conv_remove_at.lua scheduled, now due: every reference of the response goes (its
-- place in the order, pendingMessages, its ACK key, its hash); if it was its request's final
-- response the request leaves the conversation, as when it is delivered.
-- KEYS[1] response hash  KEYS[2] response order  KEYS[3] pendingMessages
-- KEYS[4] request list   KEYS[5] request counter
-- ARGV[1] member  ARGV[2] request key prefix  ARGV[3] asyncRequest key prefix  ARGV[4] now (ms)
-- Returns {msgId, completedRequestMsgId or '', status}, {'GONE'} (nothing left to remove) or
-- {'NOT_DUE'} (the removal was moved later, or the hash is another response's by now).
if not redis.call('HGET', KEYS[1], 'member') then  -- gone, or cancelled (no member)
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  return {'GONE'}
end
local f = redis.call('HMGET', KEYS[1], 'removeAt', 'status', 'member')
if f[3] ~= ARGV[1] or num(f[1], math.huge) > tonumber(ARGV[4]) then return {'NOT_DUE'} end
local done = settle_delivered(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[2],
                              ARGV[3])
return {done[1], done[2], f[2]}
