-- Take a lease if nobody holds it, or renew it for the one holding it.
-- KEYS[1] lease key  ARGV[1] token  ARGV[2] lease (ms)
-- Returns 1 when the token holds it now (taken or renewed), 0 when another holds it.
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
  return 1
end
if held then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
return 1
