-- Wake a worker for due messages, unless one is looking for them already.
-- KEYS[1] the wake-up mark (models.keys.PROCESS_WAKE_KEY)
-- KEYS[2] its pokes: a list of at most one entry the looking worker waits on (BLPOP)
-- ARGV[1] the mark's life (ms)
-- The mark: absent (nobody looks), 'woken' (a task was sent and has not begun),
-- 'looking:<token>' (the woken worker claims again soon: it is poked, so that it claims now
-- rather than at the end of its wait), 'busy:<token>' (it claims or runs handlers now: what
-- comes meanwhile needs another worker).
-- ARGV[2] (optional) stale: a 'woken' or 'looking' mark set (or last moved) longer than this
-- many ms ago counts as absent: its task never began, or its holder stopped looking (killed);
-- beat's wake-up of messages that waited passes it (a submission's does not)
-- Returns 1 when the caller must send a task (the mark is now 'woken'), 0 when not.
local mark = redis.call('GET', KEYS[1])
local stale = tonumber(ARGV[2] or '0')
if mark and stale > 0 and string.sub(mark, 1, 5) ~= 'busy:'
   and tonumber(ARGV[1]) - redis.call('PTTL', KEYS[1]) > stale then
  mark = false
end
if mark and string.sub(mark, 1, 5) ~= 'busy:' then
  if string.sub(mark, 1, 8) == 'looking:' and redis.call('LLEN', KEYS[2]) == 0 then
    redis.call('RPUSH', KEYS[2], '1')
    redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[1]))
  end
  return 0
end
redis.call('SET', KEYS[1], 'woken', 'PX', tonumber(ARGV[1]))
return 1
