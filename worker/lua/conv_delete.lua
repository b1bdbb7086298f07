-- deleteConversationRegister: an operator deletes the responses of one request; the rest of
-- the conversation's order stays as it was, so the next request or response goes on.
-- KEYS[1] request hash    KEYS[2] response order    KEYS[3] pendingMessages
-- KEYS[4] request list    KEYS[5] request counter
-- ARGV[1] requestId  ARGV[2] status: only responses in it are deleted ('' any: then the request
--   goes too, leaving a CANCEL tombstone as a cancelled group does, so that a response of it
--   still coming is cancelled by its intake)
-- ARGV[3] allOriginExcept: nothing is deleted when the request's origin is this one ('' none)
-- ARGV[4] the request's origin (PostgreSQL's: the hash may have expired)
-- ARGV[5] response key prefix  ARGV[6] asyncRequest key prefix  ARGV[7] MESSAGE_TTL (ms)
-- ARGV[8] now (ms): a deleted response keeps its hash, status CANCEL, for its lifetime
-- Returns a JSON object: excepted (true: the origin was the excepted one, nothing changed),
-- deleted ([msgId, responseId] of each response deleted), request (true: the request went).
local request_id, status, except = ARGV[1], ARGV[2], ARGV[3]
local origin = redis.call('HGET', KEYS[1], 'origin') or ARGV[4]
if except ~= '' and origin == except then
  return cjson.encode({excepted = true, deleted = {}, request = false})
end
local deleted = {}
for _, m in ipairs(group_members(KEYS[2], request_id)) do
  local rs_id = cjson.decode(m)['rsId']
  local key = ARGV[5] .. rs_id
  local f = redis.call('HMGET', key, 'status', 'msgId')
  if status == '' or f[1] == status then
    deleted[#deleted + 1] = {f[2] or '', rs_id}
    drop_response(key, KEYS[2], KEYS[3], m, ARGV[6], ARGV[8])
  end
end
local whole = status == ''
if whole then
  redis.call('LREM', KEYS[4], 0, KEYS[1])
  redis.call('HSET', KEYS[1], 'status', 'CANCEL')
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[7]))
end
forget_if_empty(KEYS[4], KEYS[2], KEYS[5])
return cjson.encode({excepted = false, deleted = deleted, request = whole})
