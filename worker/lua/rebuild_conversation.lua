-- A conversation's ordering state rebuilt from its PostgreSQL rows after Redis lost it (or
-- part of it: keys evicted or deleted). What is missing is created (a response hash, its
-- entry in pendingMessages, a request hash, the conversation's list or order); what exists
-- (written since the loss) is kept; then the order is renumbered: the rebuilt groups first, in the rows' order, whatever was added
-- since the loss after them, in its own order.
-- KEYS[1] request list  KEYS[2] response order  KEYS[3] pendingMessages  KEYS[4] request counter
-- KEYS[5] scheduled (the shard's: a response's removal an operator scheduled is due there)
-- ARGV[1] JSON: {groups: [{requestId, inList, ttl, request (hash fields, or absent when the
--   request's own life is over), responses: [{responseId, member, fields, ttl, pendingAt,
--   asyncId, asyncTtl, removeAt}]}]}, groups in conversation order, responses in their request's order
-- ARGV[2] request key prefix  ARGV[3] response key prefix  ARGV[4] asyncRequest key prefix
-- ARGV[5] how long the conversation's shared keys live (ms: max of the two TTLs)
-- Returns {created keys, responses in the order now}; nothing is renumbered when nothing
-- was missing.
local data = cjson.decode(ARGV[1])
local req_prefix, res_prefix, async_prefix = ARGV[2], ARGV[3], ARGV[4]
local keep_ms = tonumber(ARGV[5])
local list_key, zset_key, pending_key, seq_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local STEP = 2097152

local function hset_all(key, fields)
  local args = {}
  for k, v in pairs(fields) do
    args[#args + 1] = k
    args[#args + 1] = tostring(v)
  end
  redis.call('HSET', key, unpack(args))
end

local created = 0
local rebuilt_req, rebuilt_res = {}, {}
for _, group in ipairs(data.groups) do
  local req_key = req_prefix .. group.requestId
  rebuilt_req[req_key] = true
  if group.request and redis.call('EXISTS', req_key) == 0 then
    hset_all(req_key, group.request)
    redis.call('PEXPIRE', req_key, group.ttl)
    created = created + 1
  end
  for _, r in ipairs(group.responses) do
    local key = res_prefix .. r.responseId
    rebuilt_res[r.member] = true
    if redis.call('EXISTS', key) == 0 then
      hset_all(key, r.fields)
      redis.call('PEXPIRE', key, r.ttl)
      redis.call('ZADD', pending_key, r.pendingAt, r.member)
      if r.removeAt then
        redis.call('ZADD', KEYS[5], r.removeAt, r.member)
        if redis.call('PTTL', KEYS[5]) < keep_ms then redis.call('PEXPIRE', KEYS[5], keep_ms) end
      end
      if r.asyncId and r.asyncId ~= '' and r.asyncTtl > 0 then
        if redis.call('SET', async_prefix .. r.asyncId, r.member, 'NX', 'PX', r.asyncTtl) then
          redis.call('HSET', key, 'asyncResponseId', r.asyncId)
        end
      end
      created = created + 1
    elseif not redis.call('ZSCORE', pending_key, r.member) then
      -- its hash kept, its wait lost (the shard's set evicted): nothing would wake it
      redis.call('ZADD', pending_key, r.pendingAt, r.member)
      created = created + 1
    end
  end
end
-- A request not in the conversation's list or a response not in its order (the list or
-- order lost, or lost and made anew by a newcomer, while their hashes were kept) count as
-- missing too, and so does the counter (it outlives everything it numbered).
if #data.groups > 0 and redis.call('EXISTS', seq_key) == 0 then created = created + 1 end
for _, group in ipairs(data.groups) do
  if group.request and not redis.call('LPOS', list_key, req_prefix .. group.requestId) then
    created = created + 1
  end
  for _, r in ipairs(group.responses) do
    if not redis.call('ZSCORE', zset_key, r.member) then created = created + 1 end
  end
end
if created == 0 then return {0, redis.call('ZCARD', zset_key)} end

-- Renumber: groups 1..G are the rebuilt ones; what was added since the loss moves behind
-- (a response of a rebuilt request into its group).
local shift = #data.groups
local max_seq = shift
local was_listed, tail_list = {}, {}
for _, key in ipairs(redis.call('LRANGE', list_key, 0, -1)) do
  was_listed[key] = true
  if not rebuilt_req[key] then
    local s = redis.call('HGET', key, 'seq')
    if s then
      local ns = tonumber(s) + shift
      redis.call('HSET', key, 'seq', ns)
      if ns > max_seq then max_seq = ns end
    end
    tail_list[#tail_list + 1] = key
  end
end
-- A response added since whose request is a rebuilt group's joins that group, after its
-- rebuilt responses, in the order it had (a response takes its request's turn).
local group_of, joined = {}, {}
for g, group in ipairs(data.groups) do
  group_of[group.requestId] = g
  joined[g] = #group.responses
end
local tail_members = {}
local existing = redis.call('ZRANGE', zset_key, 0, -1, 'WITHSCORES')
for i = 1, #existing, 2 do
  local m = existing[i]
  if not rebuilt_res[m] then
    local info = cjson.decode(m)
    local key = res_prefix .. info['rsId']
    local g = group_of[info['rqId']]
    if g then
      joined[g] = joined[g] + 1
      redis.call('HSET', key, 'reqSeq', g)
      tail_members[#tail_members + 1] = {g * STEP + joined[g], m}
    else
      local s = redis.call('HGET', key, 'reqSeq')
      if s then redis.call('HSET', key, 'reqSeq', tonumber(s) + shift) end
      tail_members[#tail_members + 1] = {tonumber(existing[i + 1]) + shift * STEP, m}
    end
  end
end
redis.call('DEL', list_key, zset_key)
for g, group in ipairs(data.groups) do
  local req_key = req_prefix .. group.requestId
  if redis.call('EXISTS', req_key) == 1 then
    redis.call('HSET', req_key, 'seq', g)
    local counter = tonumber(redis.call('HGET', req_key, 'responseIdCounter')) or 0
    if counter < joined[g] then redis.call('HSET', req_key, 'responseIdCounter', joined[g]) end
    if group.inList or was_listed[req_key] then redis.call('RPUSH', list_key, req_key) end
  end
  for n, r in ipairs(group.responses) do
    local key = res_prefix .. r.responseId
    if redis.call('EXISTS', key) == 1 then
      redis.call('HSET', key, 'reqSeq', g)
      redis.call('ZADD', zset_key, g * STEP + n, r.member)
    end
  end
end
for _, key in ipairs(tail_list) do redis.call('RPUSH', list_key, key) end
for _, pair in ipairs(tail_members) do redis.call('ZADD', zset_key, pair[1], pair[2]) end
redis.call('SET', seq_key, max_seq, 'PX', keep_ms)
for _, key in ipairs({list_key, zset_key, pending_key}) do
  if redis.call('EXISTS', key) == 1 and redis.call('PTTL', key) < keep_ms then
    redis.call('PEXPIRE', key, keep_ms)
  end
end
return {created, redis.call('ZCARD', zset_key)}
