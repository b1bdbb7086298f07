-- setAwaitedByRequestId / setAwaitedByResponseId: an operator sets responses AWAITED, as the
-- gate does when a response's attempts run out (make_awaited, _lib.lua): the awaited agent
-- takes each up again at its awaitedToDate.
-- KEYS[1] response order   KEYS[2] pendingMessages
-- ARGV[1] response key prefix  ARGV[2] now (ms)  ARGV[3] AWAITED_TIME_WHEN_RETRIES_END (ms)
-- ARGV[4] MAX_PENDING_TTL * AWAITED_RETRIES_FACTOR (ms)
-- ARGV[5] requestId (every response of it) or ''  ARGV[6] responseId (when ARGV[5] is '')
-- A response SENT (waiting for its ACK), in flight (claimed by a drain) or AWAITED already is
-- left as it is, and named with why.
-- Returns a JSON object: set ([msgId, responseId, awaitedToDate, awaitedRetries]), skipped
-- ([responseId, status]).
local res_prefix, now = ARGV[1], tonumber(ARGV[2])
local out = {set = {}, skipped = {}}
local members = {}
if ARGV[5] ~= '' then
  members = group_members(KEYS[1], ARGV[5])
else
  local m = redis.call('HGET', res_prefix .. ARGV[6], 'member')
  if m and redis.call('ZSCORE', KEYS[1], m) then members = {m} end
end
for _, m in ipairs(members) do
  local rs_id = cjson.decode(m)['rsId']
  local key = res_prefix .. rs_id
  local f = redis.call('HMGET', key, 'status', 'claimedAt')
  if f[1] and f[1] ~= 'PENDING' then
    out.skipped[#out.skipped + 1] = {rs_id, f[1]}
  elseif f[2] then
    out.skipped[#out.skipped + 1] = {rs_id, 'IN_FLIGHT'}
  elseif f[1] then
    local done = make_awaited(key, KEYS[2], m, now, tonumber(ARGV[3]), tonumber(ARGV[4]))
    out.set[#out.set + 1] = {done[1], rs_id, done[2], done[3]}
  end
end
return cjson.encode(out)
