-- An ACK whose id no ACK key held a moment ago, looked at again in one shard: the ACK key now,
-- and else the responses being sent, whose 202 (and so their ACK id) a drain has not yet
-- recorded. Read only; one atomic step, so a 202 recorded meanwhile is seen in one or the
-- other (advance.lua records the ACK id and ends the claim in the same step).
-- KEYS[1] the id's asyncRequest key in this shard   KEYS[2] the shard's running drains
-- ARGV[1] the shard's conversation key prefix (a conversation's response order is ARGV[1]
--   followed by its id: models/keys.py)   ARGV[2] the shard's response key prefix
-- Returns {member}: the MinMessageInfo the ACK key holds now; or {'', conversationId,
-- responseId, origin, ...}: each running drain's head that is claimed (sent or being sent,
-- its outcome not settled), for the caller to check the ACK's token against.
local member = redis.call('GET', KEYS[1])
if member then return {member} end
local found = {''}
for _, cid in ipairs(redis.call('HKEYS', KEYS[2])) do
  -- The head a drain claims is the first of its conversation's order (drain_release.lua).
  local first = redis.call('ZRANGE', ARGV[1] .. cid, 0, 0)[1]
  if first then
    local rs_id = cjson.decode(first)['rsId']
    local head = redis.call('HMGET', ARGV[2] .. rs_id, 'claimedAt', 'origin')
    if head[1] and head[2] then
      found[#found + 1] = cid
      found[#found + 1] = rs_id
      found[#found + 1] = head[2]
    end
  end
end
return found
