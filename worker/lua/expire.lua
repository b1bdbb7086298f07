-- A response whose AWAITED_MESSAGE_TTL ran out before it could be delivered: its references
-- go; if it was its request's final response the request leaves the conversation.
-- KEYS[1] response hash  KEYS[2] response order  KEYS[3] pendingMessages
-- KEYS[4] request list   KEYS[5] request counter
-- ARGV[1] member  ARGV[2] request key prefix  ARGV[3] asyncRequest key prefix
-- Returns {msgId, completedRequestMsgId or ''}, or {} when the response is already gone.
if not redis.call('HGET', KEYS[1], 'member') then  -- gone, or cancelled (no member)
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  return {}
end
return settle_delivered(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[2], ARGV[3])
