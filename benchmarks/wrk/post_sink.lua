-- wrk: POST a conversation response to the client sink, as a delivery does (the body's
-- fields, an Idempotency-Key), each one another response of a conversation per thread.
local counter = 0
local threads = {}
function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end
function init(args)
  run = args[1] or "run"
end
request = function()
  counter = counter + 1
  local id = string.format("%s-%d-%d", run, tid, counter)
  local body = string.format(
    '{"conversation_id":"wrk-%s-%d","request_id":"q-%s","response_id":"%s",' ..
    '"payload":{"text":"hello"}}', run, tid, id, id)
  return wrk.format("POST", nil,
    {["Content-Type"] = "application/json", ["Idempotency-Key"] = id}, body)
end
-- Every answer that is not a 200 is counted, per thread, and the total printed at the end
-- as "not 200: N" (the first three of each thread shown).
not_200 = 0
response = function(status, headers, body)
  if status ~= 200 then
    not_200 = not_200 + 1
    if not_200 <= 3 then io.stderr:write("status " .. status .. " " .. body .. "\n") end
  end
end
function done(summary, latency, requests)
  local total = 0
  for _, thread in ipairs(threads) do total = total + thread:get("not_200") end
  io.write(string.format("not 200: %d\n", total))
end
