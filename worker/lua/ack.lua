-- The client's ACK of a response it answered with 202: the response is delivered, its
-- references go (deleteConversationMessage) and the next one is released.
-- KEYS[1] asyncRequest key (in the shard the caller found the id in: models/keys.py)
-- KEYS[2] response hash      KEYS[3] response order
-- KEYS[4] pendingMessages    KEYS[5] request list    KEYS[6] request counter
-- KEYS[7] drain lease
-- ARGV[1] member the caller read from KEYS[1]  ARGV[2] request key prefix
-- ARGV[3] asyncRequest key prefix  ARGV[4] drain lease token  ARGV[5] drain lease (ms)
-- ARGV[6] the async response id (named in the refusal)
-- Returns {'ACKED', msgId, completedRequestMsgId or '', leaseTaken}; refuses with
-- ORDERLY_UNKNOWN_ACK when the ACK key no longer holds the member or the response is gone.
if redis.call('GET', KEYS[1]) ~= ARGV[1] or redis.call('EXISTS', KEYS[2]) == 0 then
  return redis.error_reply('ORDERLY_UNKNOWN_ACK ' .. ARGV[6])
end
local done = settle_delivered(KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[1], ARGV[2],
                              ARGV[3])
local taken = redis.call('SET', KEYS[7], ARGV[4], 'NX', 'PX', tonumber(ARGV[5]))
return {'ACKED', done[1], done[2], taken and 1 or 0}
