-- A subscriber reports tracked work done by its xid, the seed's way: the :message:xid:$xid
-- cross-reference names the id, which is then reported as track_done does.
-- KEYS[1] :message:xid:$xid  KEYS[2] :message:done
-- ARGV[1] the :message: prefix  ARGV[2] now (ms)
-- Returns {id, outcome}: DONE (pushed to :message:done), ALREADY (reported done before), GONE
-- (its hash expired: the monitor delists it), or {0, UNKNOWN} (no such xid, or expired).
local id = redis.call('HGET', KEYS[1], 'id')
if not id then return {0, 'UNKNOWN'} end
return {tonumber(id), track_mark_done(ARGV[1] .. id, KEYS[2], id, ARGV[2])}
