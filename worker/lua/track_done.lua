-- A worker finished a tracked message: note when, then push its id to :message:done.
-- KEYS[1] :message:$id  KEYS[2] :message:done
-- ARGV[1] id  ARGV[2] now (ms)
-- Returns 1; 0 when the hash is gone (expired: the monitor delists the id) or the id was
-- already reported done (a second report changes nothing).
if track_mark_done(KEYS[1], KEYS[2], ARGV[1], ARGV[2]) == 'DONE' then return 1 end
return 0
