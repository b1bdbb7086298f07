-- The ordering gate of one conversation: settle the previous send, then validate the head
-- (canSendConversationMessage) and, in claim mode, take it for sending. One atomic step.
-- KEYS[1] request list   KEYS[2] response order   KEYS[3] pendingMessages (the shard's)
-- KEYS[4] drain lease    KEYS[5] scheduled (the shard's)   KEYS[6] request counter
-- KEYS[7] running drains (conversation id -> 'pid|token|ms': the drain's liveness)
-- KEYS[8] the shard's Redis marker (<shard>:epoch): while it says 'rebuilding', nothing is
--   claimed
-- ARGV[1] mode: 'claim' (a drain holding the lease), 'yield' (settle only, keep the lease:
--   the drain goes on in a new task) or 'check' (validate ARGV[10] only, no lease)
-- ARGV[2] lease token  ARGV[3] now (ms)  ARGV[4] drain lease (ms)
-- ARGV[5] in-flight limit (ms: MAX_PENDING_TTL + margin)  ARGV[6] SENT_MESSAGE_TTL (ms)
-- ARGV[7] request key prefix  ARGV[8] response key prefix  ARGV[9] asyncRequest key prefix
-- ARGV[10] response id to validate (check mode)
-- ARGV[11] previous outcome: '' | 'delivered' | 'sent' | 'retry' | 'awaited' | 'cancel'
-- ARGV[12] previous response id  ARGV[13] async response id ('sent') or delay ms ('retry')
-- ARGV[14] MESSAGE_TTL (ms)  ARGV[15] AWAITED_TIME_WHEN_RETRIES_END (ms)
-- ARGV[16] MAX_PENDING_TTL * AWAITED_RETRIES_FACTOR (ms)  ARGV[17] conversationId
-- ARGV[18] the backend pid of the PostgreSQL connection the drain holds ('' in check mode)
-- ARGV[19] JSON array of keys to take as run out when missing ('' none): those a MISSING
--   answer named and PostgreSQL then found over (worker/conversations/reconcile.py: repair)
-- The responses it settles an outcome of, claims or validates get lastAccess = now.
-- Returns a JSON object: code, head (the response's fields when code is SEND; its lateMs is
-- '' or the lateness add_response.lua decided; its lost counts the claims of it that died
-- with their worker: a head claimed again before its outcome was settled), first (the first response id), due (ms, for
-- waits), settled (responses delivered by an ACK timeout: [msgId, completedRequestMsgId]),
-- prev (what settling the previous outcome produced).
-- Codes: SEND, CAN_SEND, EMPTY, WAIT_REQUEST, WAIT_RESPONSE, WAIT_ACK, WAIT_RETRY,
-- WAIT_AWAITED, UNKNOWN (check: no such response), LOST (the lease is another's), YIELD,
-- REBUILDING (Redis is being rebuilt from PostgreSQL: the rebuild wakes the conversation
-- once it is whole; a response sent now could overtake older ones not rebuilt yet),
-- MISSING (missing: the head request's or first response's key, or the request list while a
-- response would go, gone but not in ARGV[19]:
-- its life ran out, or Redis evicted it; PostgreSQL tells which before the conversation goes
-- on, so an evicted head is never skipped. The lease stays held.)
local mode, token, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local lease_ms, inflight_ms, sent_ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local req_prefix, res_prefix, async_prefix = ARGV[7], ARGV[8], ARGV[9]
local list_key, zset_key, pending_key = KEYS[1], KEYS[2], KEYS[3]
local lease_key, sched_key, seq_key, drains_key = KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local result = {settled = {}}
local gone = {}
if ARGV[19] and ARGV[19] ~= '' then
  for _, key in ipairs(cjson.decode(ARGV[19])) do gone[key] = true end
end

if mode ~= 'check' then
  local holder = redis.call('GET', lease_key)
  if holder and holder ~= token then
    result.code = 'LOST'
    return cjson.encode(result)
  end
  redis.call('SET', lease_key, token, 'PX', lease_ms)
elseif redis.call('EXISTS', res_prefix .. ARGV[10]) == 1 then
  redis.call('HSET', res_prefix .. ARGV[10], 'lastAccess', now)
end

-- 1. The outcome of the previous send.
local outcome, prev_id = ARGV[11], ARGV[12]
if outcome ~= '' then
  local res_key = res_prefix .. prev_id
  local member = redis.call('HGET', res_key, 'member')
  if member then
    if outcome == 'delivered' then
      result.prev = settle_delivered(res_key, zset_key, pending_key, list_key, seq_key, member,
                                     req_prefix, async_prefix)
    elseif outcome == 'sent' then
      -- markSentConversationRegister: delivered, its ACK to follow under asyncResponseId.
      local async_id = ARGV[13]
      redis.call('HSET', res_key, 'status', 'SENT', 'sentAt', now, 'lastAccess', now)
      redis.call('HDEL', res_key, 'claimedAt')
      -- An id another response is still waiting under is not taken over: this one then
      -- simply waits out SENT_MESSAGE_TTL.
      if redis.call('SET', async_prefix .. async_id, member, 'NX', 'PX', sent_ttl) then
        redis.call('HSET', res_key, 'asyncResponseId', async_id)
      else
        result.ack_clash = async_id
      end
      local expires = num(expires_at(res_key), now)
      redis.call('ZADD', pending_key, math.min(now + sent_ttl + inflight_ms, expires), member)
    elseif outcome == 'retry' then
      -- A recoverable failure with attempts left: the head waits, its successors behind it.
      local at = now + tonumber(ARGV[13])
      redis.call('HINCRBY', res_key, 'attempt', 1)
      redis.call('HSET', res_key, 'status', 'PENDING', 'notBefore', at, 'lastAccess', now)
      redis.call('HDEL', res_key, 'claimedAt')
      local expires = num(expires_at(res_key), at)
      redis.call('ZADD', pending_key, math.min(at + inflight_ms, expires), member)
    elseif outcome == 'awaited' then
      -- Attempts spent: the response and the rest of its group become AWAITED; the awaited
      -- agent takes them up again at awaitedToDate. The conversation stays held meanwhile.
      local request_id = redis.call('HGET', res_key, 'requestId')
      local ids = {}
      for _, m in ipairs(group_members(zset_key, request_id)) do
        local key = res_prefix .. cjson.decode(m)['rsId']
        local done = make_awaited(key, pending_key, m, now, tonumber(ARGV[15]),
                                  tonumber(ARGV[16]))
        if done then ids[#ids + 1] = done[1] end
      end
      result.prev = ids
    elseif outcome == 'cancel' then
      -- A non-recoverable failure: the whole group is cancelled, the conversation moves on.
      local request_id = redis.call('HGET', res_key, 'requestId')
      local ids = {}
      for _, m in ipairs(group_members(zset_key, request_id)) do
        local key = res_prefix .. cjson.decode(m)['rsId']
        ids[#ids + 1] = redis.call('HGET', key, 'msgId') or ''
        drop_response(key, zset_key, pending_key, m, async_prefix, now)
      end
      local req_key = req_prefix .. request_id
      redis.call('LREM', list_key, 0, req_key)
      -- A tombstone, even when the request had expired: a response of the group that is
      -- being accepted right now must not bring the request back as a callback.
      redis.call('HSET', req_key, 'status', 'CANCEL')
      redis.call('PEXPIRE', req_key, tonumber(ARGV[14]))
      forget_if_empty(list_key, zset_key, seq_key)
      result.prev = ids
    end
  end
end

if mode == 'yield' then
  result.code = 'YIELD'
  return cjson.encode(result)
end

-- 2. Validate the head (the seed's request-list check and its three response cases).
local function finish(code, due)
  result.code = code
  result.due = due
  if mode == 'claim' and code ~= 'SEND' then
    redis.call('DEL', lease_key)
    redis.call('HDEL', drains_key, ARGV[17])
    if due then
      -- Wake the conversation when due; LT keeps the earliest wake-up already there.
      redis.call('ZADD', sched_key, 'LT', due, ARGV[17])
      -- The key is shared: its life is only ever extended.
      local ttl = tonumber(ARGV[14]) + due - now
      if redis.call('PTTL', sched_key) < ttl then redis.call('PEXPIRE', sched_key, ttl) end
    end
  end
  return cjson.encode(result)
end

-- A key met gone that PostgreSQL must judge first (MISSING: the lease stays held).
local function missing(key)
  result.code = 'MISSING'
  result.missing = key
  return cjson.encode(result)
end

if mode == 'claim' and redis.call('HGET', KEYS[8], 'state') == 'rebuilding' then
  return finish('REBUILDING')
end

while true do
  local head_req = redis.call('LINDEX', list_key, 0)
  if head_req and redis.call('EXISTS', head_req) == 0 then
    -- The head request vanished: once PostgreSQL says its MESSAGE_TTL ran out (ARGV[19]),
    -- remove it and check again.
    if not gone[head_req] then return missing(head_req) end
    redis.call('LPOP', list_key)
  else
    local first = redis.call('ZRANGE', zset_key, 0, 0)[1]
    if not first then
      if mode == 'check' then return finish('UNKNOWN') end
      if head_req then
        -- The oldest request still waits for its answer: wake up when it would expire.
        local ttl = redis.call('PTTL', head_req)
        return finish('WAIT_REQUEST', ttl > 0 and now + ttl or nil)
      end
      forget_if_empty(list_key, zset_key, seq_key)
      return finish('EMPTY')
    end
    local info = cjson.decode(first)
    local res_key = res_prefix .. info['rsId']
    result.first = info['rsId']
    if redis.call('EXISTS', res_key) == 0 then
      -- Case 3: the first response no longer exists: remove it and check again.
      if not gone[res_key] then return missing(res_key) end
      redis.call('ZREM', zset_key, first)
      redis.call('ZREM', pending_key, first)
    else
      local f = redis.call('HMGET', res_key, 'reqSeq', 'status', 'sentAt', 'notBefore')
      -- The request list check: an earlier request still waiting for its first response
      -- holds everything after it. (A request that already left the list is done waiting.)
      if head_req and head_req ~= req_prefix .. info['rqId']
          and num(redis.call('HGET', head_req, 'seq'), 0) < num(f[1], 0) then
        local ttl = redis.call('PTTL', head_req)
        return finish('WAIT_REQUEST', ttl > 0 and now + ttl or nil)
      end
      -- No request list while the response's request is there (a live request is listed):
      -- the list was evicted, and an earlier request still waiting for its first response
      -- would hold this one. PostgreSQL is asked before anything goes.
      local unlisted = not head_req and not gone[list_key]
        and redis.call('EXISTS', req_prefix .. info['rqId']) == 1
      if mode == 'check' then
        -- Cases 1 and 2: the validated response is first, or another one is.
        if info['rsId'] == ARGV[10] and unlisted then return missing(list_key) end
        if info['rsId'] == ARGV[10] then return finish('CAN_SEND') end
        -- (a cancelled response's hash has no member: unknown, as one that is gone)
        if not redis.call('HGET', res_prefix .. ARGV[10], 'member') then
          return finish('UNKNOWN')
        end
        return finish('WAIT_RESPONSE')
      end
      local status = f[2]
      if status == 'SENT' then
        local due = num(f[3], now) + sent_ttl
        if due > now then return finish('WAIT_ACK', due) end
        -- No ACK within SENT_MESSAGE_TTL: taken as delivered, the next one is released.
        local done = settle_delivered(res_key, zset_key, pending_key, list_key, seq_key, first,
                                      req_prefix, async_prefix)
        result.settled[#result.settled + 1] = done
      else
        local not_before = num(f[4], 0)
        if not_before > now then
          if status == 'AWAITED' then return finish('WAIT_AWAITED', not_before) end
          return finish('WAIT_RETRY', not_before)
        end
        if unlisted then return missing(list_key) end
        -- Claimed: in flight until the outcome; the awaited agent looks again if the
        -- sender dies (MAX_PENDING_TTL + margin), and beat as soon as the drain's connection
        -- is gone (drain_release.lua). A claim still there when the head is claimed again
        -- died with its worker: counted.
        local lost = 0
        if redis.call('HEXISTS', res_key, 'claimedAt') == 1 then
          -- Another drain claimed it and is alive (its running-drains entry is fresh): this
          -- one took a lease evicted from under it. The lease goes back; nothing is sent.
          local other = redis.call('HGET', drains_key, ARGV[17])
          local _, _, other_token, since = string.find(other or '', '^[^|]*|([^|]*)|(%d+)$')
          if other_token and other_token ~= token and now - tonumber(since) < lease_ms then
            redis.call('SET', lease_key, other_token, 'PX', lease_ms)
            result.code = 'LOST'
            return cjson.encode(result)
          end
          lost = redis.call('HINCRBY', res_key, 'lost', 1)
        else
          lost = num(redis.call('HGET', res_key, 'lost'), 0)
        end
        redis.call('HSET', res_key, 'status', 'PENDING', 'claimedAt', now, 'lastAccess', now)
        redis.call('HSET', drains_key, ARGV[17], ARGV[18] .. '|' .. token .. '|' .. now)
        local h = redis.call('HMGET', res_key, 'expiresAt', 'conversationId', 'origin',
          'requestId', 'responseId', 'taskItem', 'msgId', 'requestMsgId', 'last', 'attempt',
          'awaitedRetries', 'lateMs', 'receivedAt', 'tp', 'expiresAtTS')
        local expires = num(h[1], num(h[15], now))
        redis.call('ZADD', pending_key, math.min(now + inflight_ms, expires), first)
        result.head = {
          conversationId = h[2], origin = h[3], requestId = h[4], responseId = h[5],
          taskItem = h[6], msgId = h[7], requestMsgId = h[8], last = h[9],
          attempt = num(h[10], 0), awaitedRetries = num(h[11], 0), lateMs = h[12] or '',
          receivedAt = h[13] or '', tp = h[14] or '', lost = lost}
        return finish('SEND')
      end
    end
  end
end
