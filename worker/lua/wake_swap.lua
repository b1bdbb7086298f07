-- The woken worker moves its mark between 'looking:<token>' and 'busy:<token>', only while
-- the mark is still its own in the state it left it in.
-- KEYS[1] the wake-up mark  ARGV[1] the value expected  ARGV[2] the new value
-- ARGV[3] the mark's life (ms)
-- Returns 1 when moved, 0 when the mark is another's (or gone): the caller no longer holds it.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', tonumber(ARGV[3]))
return 1
