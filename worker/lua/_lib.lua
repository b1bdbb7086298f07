-- Shared functions, prepended to every script by worker/core/scripts.py.
-- Times are milliseconds since the epoch, given by the caller (ARGV), never read here.
-- Keys: every key a script touches, given in KEYS or derived from a prefix in ARGV and a value
-- it read, is of one conversation shard (models/keys.py): one hash tag, so one slot of a Redis
-- Cluster. pendingMessages, scheduled, the running drains and the marker are the shard's; the
-- prefixes are the shard's too.

local function num(v, default)
  if v == false or v == nil or v == '' then return default end
  return tonumber(v)
end

-- The seed's ...TS fields (expiresAtTS, awaitedToDateTS) are Unix seconds; the gate keeps its
-- times in milliseconds in the seed's expiresAt and awaitedToDate. A hash written before
-- those fields holds milliseconds in its TS field: read as such while expiresAt is missing.
local function seconds(ms)
  return math.floor(tonumber(ms) / 1000)
end

local function expires_at(key)
  local f = redis.call('HMGET', key, 'expiresAt', 'expiresAtTS')
  return num(f[1], num(f[2], nil))
end

-- A tracked message reported done at ``now``: its id pushed to :message:done once. Returns
-- 'DONE', 'ALREADY' (reported before) or 'GONE' (its hash expired: the monitor delists it).
local function track_mark_done(key, done_list, id, now)
  if redis.call('EXISTS', key) == 0 then return 'GONE' end
  if redis.call('HSETNX', key, 'done', now) == 0 then return 'ALREADY' end
  redis.call('LPUSH', done_list, id)
  return 'DONE'
end

-- Remove every reference of a response: its place in the conversation's order, in
-- pendingMessages, its ACK key and its hash; a cancelled one (``cancel_at``, now) keeps its
-- hash for its lifetime with status CANCEL, as the seed's model has it.
local function drop_response(res_key, zset_key, pending_key, member, async_prefix, cancel_at)
  local async_id = redis.call('HGET', res_key, 'asyncResponseId')
  if async_id and async_id ~= '' then
    redis.call('DEL', async_prefix .. async_id)
  end
  redis.call('ZREM', zset_key, member)
  redis.call('ZREM', pending_key, member)
  if cancel_at and redis.call('EXISTS', res_key) == 1 then
    -- without its member it is no live response to any script (they key on it)
    redis.call('HSET', res_key, 'status', 'CANCEL', 'lastAccess', cancel_at)
    redis.call('HDEL', res_key, 'member', 'removeAt', 'claimedAt', 'asyncResponseId')
  else
    redis.call('DEL', res_key)
  end
end

-- A conversation with nothing left forgets its request counter too.
local function forget_if_empty(list_key, zset_key, seq_key)
  if redis.call('LLEN', list_key) == 0 and redis.call('ZCARD', zset_key) == 0 then
    redis.call('DEL', seq_key)
  end
end

-- A response is settled (delivered, ACKed, or its ACK wait ran out). If it was its request's
-- final response, the request is complete: it leaves the conversation's request list.
-- Returns {msgId, requestMsgId or '' when the request did not complete}.
local function settle_delivered(res_key, zset_key, pending_key, list_key, seq_key, member,
                                req_prefix, async_prefix)
  local f = redis.call('HMGET', res_key, 'msgId', 'requestMsgId', 'last', 'requestId')
  local completed = ''
  if f[3] == '1' then
    local req_key = req_prefix .. f[4]
    redis.call('LREM', list_key, 0, req_key)
    redis.call('DEL', req_key)
    completed = f[2] or ''
  end
  drop_response(res_key, zset_key, pending_key, member, async_prefix)
  forget_if_empty(list_key, zset_key, seq_key)
  return {f[1] or '', completed}
end

-- The members of the conversation's order that belong to one request (its group).
local function group_members(zset_key, request_id)
  local out = {}
  for _, m in ipairs(redis.call('ZRANGE', zset_key, 0, -1)) do
    if cjson.decode(m)['rqId'] == request_id then out[#out + 1] = m end
  end
  return out
end

-- A response becomes AWAITED (its attempts ran out, or an operator said so): one more
-- awaited retry, taken up again by the awaited agent at awaitedToDate (the first wait
-- AWAITED_TIME_WHEN_RETRIES_END, then awaitedRetries * step; never past its expiry).
-- Returns {msgId, awaitedToDate, awaitedRetries}, or nil when the hash is gone.
local function make_awaited(key, pending_key, member, now, first_wait, step)
  local f = redis.call('HMGET', key, 'awaitedRetries', 'msgId')
  if not f[2] then return nil end
  local retries = num(f[1], 0)
  local wait = first_wait
  if retries > 0 then wait = retries * step end
  local at = math.min(now + wait, num(expires_at(key), now + wait))
  redis.call('HSET', key, 'status', 'AWAITED', 'awaitedRetries', retries + 1,
    'awaitedToDate', at, 'awaitedToDateTS', seconds(at), 'notBefore', at, 'attempt', 0,
    'lastAccess', now)
  redis.call('HDEL', key, 'claimedAt')
  redis.call('ZADD', pending_key, at, member)
  return {f[2], at, retries + 1}
end
