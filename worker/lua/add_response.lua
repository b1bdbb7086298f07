-- markPendingConversationRegister: a response to deliver joins its conversation's order.
-- KEYS[1] request hash     KEYS[2] response hash      KEYS[3] response order (sorted set)
-- KEYS[4] pendingMessages  KEYS[5] request list       KEYS[6] request counter
-- KEYS[7] drain lease
-- ARGV[1] conversationId  ARGV[2] origin  ARGV[3] requestId  ARGV[4] responseId
-- ARGV[5] member (MinMessageInfo)  ARGV[6] responseTimestamp (ms)  ARGV[7] taskItem (payload)
-- ARGV[8] msgId  ARGV[9] requestMsgId  ARGV[10] last (1/0)  ARGV[11] now (ms)
-- ARGV[12] MESSAGE_TTL  ARGV[13] AWAITED_MESSAGE_TTL  ARGV[14] blocked-limit (ms: after this
-- a response still waiting becomes AWAITED, MAX_RETRIES * INTERVAL)
-- ARGV[15] requestTimestamp (ms, used when the request must be registered again)
-- ARGV[16] drain lease token  ARGV[17] drain lease (ms)
-- ARGV[18] 1 when PostgreSQL has the request completed (its final response settled)
-- ARGV[19] corr: the response's correlator ('' when none was given)
-- ARGV[20] tp: the traceparent its send continues ('' when none)
-- ARGV[21] 1: a callback checks that the conversation's counter is there
-- ARGV[22] 1: PostgreSQL has the request open (waiting for responses): its key must be there
-- ARGV[23] 1: PostgreSQL has other responses of the conversation open: its order must be there
-- Both hashes' lastAccess becomes now.
-- Returns {code, leaseTaken, lateMs}: code 'ADDED', 'DUPLICATE', 'CANCELLED' (the request's
-- group was cancelled) or, when checked, 'MISSING' (nothing written; the missing key in
-- lateMs's place): the request's key is gone while PostgreSQL has the request open, a
-- callback finds the conversation's counter gone, or the conversation's order is gone while
-- PostgreSQL has other responses open. Evicted or deleted, the request would take a new
-- turn, or a number before those given, or the response go before those it follows; the
-- caller has PostgreSQL decide (the conversation rebuilt from its rows, or found over) and
-- calls again. leaseTaken 1 when the caller must start a drain with ARGV[16];
-- lateMs '' or, for a late response, how long after requestTimestamp + MESSAGE_TTL it came.
-- Late: the request had expired (MESSAGE_TTL) before this response, which therefore takes
-- the request's turn again at the end of the conversation; decided here, with that order.
if redis.call('EXISTS', KEYS[2]) == 1 then return {'DUPLICATE', 0, ''} end
local now = tonumber(ARGV[11])
local msg_ttl = tonumber(ARGV[12])
local awaited_ttl = tonumber(ARGV[13])
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'CANCEL' then return {'CANCELLED', 0, ''} end
if not status and ARGV[22] == '1' then return {'MISSING', 0, KEYS[1]} end
if not status and ARGV[21] == '1' and redis.call('EXISTS', KEYS[6]) == 0 then
  return {'MISSING', 0, KEYS[6]}
end
if ARGV[23] == '1' and redis.call('EXISTS', KEYS[3]) == 0 then return {'MISSING', 0, KEYS[3]} end
if not status then
  -- An asynchronous callback for a request that completed or expired: the request takes
  -- its turn again, at the end of the conversation. One that expired is late, and so are
  -- the responses that join it in this new turn.
  redis.call('LREM', KEYS[5], 0, KEYS[1])
  local seq = redis.call('INCR', KEYS[6])
  redis.call('HSET', KEYS[1],
    'conversationId', ARGV[1], 'origin', ARGV[2], 'requestId', ARGV[3],
    'requestTimestamp', ARGV[15], 'status', 'PENDING', 'responseIdCounter', 0,
    'expiresAt', now + msg_ttl, 'expiresAtTS', seconds(now + msg_ttl), 'msgId', ARGV[9],
    'seq', seq, 'callback', 1,
    'late', ARGV[18] == '1' and 0 or 1)
  redis.call('RPUSH', KEYS[5], KEYS[1])
end
local late_ms = ''
if redis.call('HGET', KEYS[1], 'late') == '1' then
  late_ms = math.max(0, now - tonumber(ARGV[15]) - msg_ttl)
end
local n = redis.call('HINCRBY', KEYS[1], 'responseIdCounter', 1)
local req_seq = tonumber(redis.call('HGET', KEYS[1], 'seq'))
redis.call('HSET', KEYS[1], 'status', 'PENDING', 'expiresAt', now + msg_ttl,
  'expiresAtTS', seconds(now + msg_ttl), 'lastAccess', now)
-- A request with activity lives MESSAGE_TTL past its latest response.
redis.call('PEXPIRE', KEYS[1], msg_ttl)
redis.call('PEXPIRE', KEYS[5], awaited_ttl)
redis.call('PEXPIRE', KEYS[6], awaited_ttl)
local expires = now + awaited_ttl
redis.call('HSET', KEYS[2],
  'conversationId', ARGV[1], 'origin', ARGV[2], 'requestId', ARGV[3], 'responseId', ARGV[4],
  'requestTimestamp', ARGV[15], 'responseTimestamp', ARGV[6], 'status', 'PENDING',
  'expiresAt', expires, 'expiresAtTS', seconds(expires), 'awaitedToDate', 0,
  'awaitedToDateTS', 0, 'awaitedRetries', 0, 'taskItem', ARGV[7],
  'msgId', ARGV[8], 'requestMsgId', ARGV[9], 'last', ARGV[10], 'reqSeq', req_seq,
  'attempt', 0, 'notBefore', 0, 'member', ARGV[5], 'lateMs', late_ms, 'lastAccess', now,
  'receivedAt', now)
if ARGV[19] ~= '' then redis.call('HSET', KEYS[2], 'corr', ARGV[19]) end
if ARGV[20] and ARGV[20] ~= '' then redis.call('HSET', KEYS[2], 'tp', ARGV[20]) end
redis.call('PEXPIRE', KEYS[2], awaited_ttl)
-- Total order: the request's position in the conversation, then the response's arrival
-- within its request. Both are integers; seq * 2^21 + n is exact in a double below 2^53.
redis.call('ZADD', KEYS[3], req_seq * 2097152 + n, ARGV[5])
redis.call('PEXPIRE', KEYS[3], awaited_ttl)
redis.call('ZADD', KEYS[4], math.min(now + tonumber(ARGV[14]), expires), ARGV[5])
redis.call('PEXPIRE', KEYS[4], awaited_ttl)
local taken = redis.call('SET', KEYS[7], ARGV[16], 'NX', 'PX', tonumber(ARGV[17]))
if taken then return {'ADDED', 1, late_ms} end
return {'ADDED', 0, late_ms}
