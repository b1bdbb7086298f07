-- createConversationRegister: a user's request enters its conversation (status WAITING).
-- KEYS[1] request hash            <prefix>:{bq:<count>:<shard>}:req:<requestId>
-- KEYS[2] request list            <prefix>:{bq:<count>:<shard>}:<conversationId>:req
-- KEYS[3] request counter         <prefix>:{bq:<count>:<shard>}:<conversationId>:seq
-- ARGV[1] conversationId  ARGV[2] origin  ARGV[3] requestId  ARGV[4] requestTimestamp (ms)
-- ARGV[5] msgId (PostgreSQL)  ARGV[6] now (ms)  ARGV[7] MESSAGE_TTL (ms)
-- ARGV[8] AWAITED_MESSAGE_TTL (ms): the counter lives as long as anything it ordered
-- KEYS[4] response order        <prefix>:{bq:<count>:<shard>}:<conversationId>
-- ARGV[9] corr: the request's correlator ('' when none was given)
-- ARGV[10] 1: check that the counter is not numbering anew a conversation it numbered before
-- ARGV[11] 1: PostgreSQL has other open rows in the conversation
-- Returns 1 when registered, 0 when the request was already registered (nothing changed), -1
-- (nothing written) when checked and the counter is gone while the conversation's list or
-- order is there (the counter outlives both), or the counter or the list is gone while
-- PostgreSQL has other open rows: evicted or deleted, the request would be numbered before
-- those it follows, or head a list without the requests still waiting before it. The caller
-- has PostgreSQL decide (the conversation rebuilt from its rows, or found over) and calls
-- again unchecked.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if ARGV[10] == '1' then
  local counted = redis.call('EXISTS', KEYS[3]) == 1
  if (not counted and redis.call('EXISTS', KEYS[2], KEYS[4]) > 0)
      or (ARGV[11] == '1' and (not counted or redis.call('EXISTS', KEYS[2]) == 0)) then
    return -1
  end
end
local ttl = tonumber(ARGV[7])
local seq = redis.call('INCR', KEYS[3])
redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[8]))
redis.call('HSET', KEYS[1],
  'conversationId', ARGV[1], 'origin', ARGV[2], 'requestId', ARGV[3],
  'requestTimestamp', ARGV[4], 'status', 'WAITING', 'responseIdCounter', 0,
  'expiresAt', tonumber(ARGV[6]) + ttl, 'expiresAtTS', seconds(tonumber(ARGV[6]) + ttl),
  'msgId', ARGV[5], 'seq', seq,
  'lastAccess', ARGV[6])
if ARGV[9] ~= '' then redis.call('HSET', KEYS[1], 'corr', ARGV[9]) end
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('RPUSH', KEYS[2], KEYS[1])
-- Never shorten the list's life: earlier requests of it may have responses in flight.
if redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
return 1
