-- One token bucket of the API's rate limits: take ARGV[3] tokens if the bucket holds that many
-- (refilled at the rate since it was last written), in one atomic step.
-- KEYS[1] the bucket: a hash {tokens, ms = the time they were counted at}; a missing bucket is
--   a full one (models/keys.py RateKeys)
-- ARGV[1] rate (tokens a second, > 0)  ARGV[2] burst (the most it holds, >= 1)
-- ARGV[3] cost (tokens taken, 1..burst)  ARGV[4] now (ms, the caller's clock)
-- ARGV[5] (optional) most: when the cost is there, as many whole tokens as are there up to
--   this many are taken (a limiter's lease, worker/core/ratelimit.py); absent: the cost.
-- Returns {allowed (1 or 0), retry after (ms: 0 when allowed, else until ARGV[3] tokens are
--   there again), tokens left (rounded down), tokens taken (0 when refused)}.
-- A taken bucket expires when it would be full again, so idle clients leave no key behind.
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local cost, now = tonumber(ARGV[3]), tonumber(ARGV[4])
local held = redis.call('HMGET', KEYS[1], 'tokens', 'ms')
local tokens, at = tonumber(held[1]), tonumber(held[2])
if tokens == nil or at == nil then
  tokens, at = burst, now
elseif now > at then
  tokens = math.min(burst, tokens + (now - at) * rate / 1000)
  at = now
end
-- (A clock behind the one that wrote the bucket refills nothing: its later time is kept.)
-- The refill's float noise (a billionth of a token, a millionth of a millisecond) neither
-- refuses a token that is there nor rounds a wait up into one more millisecond.
local function ms_for(n)
  return math.max(1, math.ceil(n * 1000 / rate - 1e-6))
end
if tokens < cost - 1e-9 then
  return {0, ms_for(cost - tokens), math.floor(tokens + 1e-9), 0}
end
local taken = cost
local most = tonumber(ARGV[5])
if most ~= nil and most > cost then
  taken = math.max(cost, math.min(most, math.floor(tokens + 1e-9)))
end
tokens = math.max(0, tokens - taken)
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ms', at)
redis.call('PEXPIRE', KEYS[1], ms_for(burst - tokens))
return {1, 0, math.floor(tokens + 1e-9), taken}
