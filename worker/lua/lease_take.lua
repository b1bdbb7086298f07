-- Take a lease if nobody holds it.
-- KEYS[1] lease key  ARGV[1] token  ARGV[2] lease (ms)
-- Returns 1 when taken, 0 when another holds it.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', tonumber(ARGV[2])) then return 1 end
return 0
