-- wrk: POSTs that each carry something new, as the benchmark names it after "--":
--   "messages" (front_door): POST /messages, a new message each (its correlation id: the run,
--     the thread, a counter), the Authorization header from the environment (KEY; none for a
--     bare app), each answer expected to be a 201;
--   "requests" (front_door): a conversation request each, ten to a conversation, of the origin
--     "bench"; "responses": a response each to one of the requests q-0 .. q-999 waiting in
--     conversations bench-0 .. bench-999 (registered by the benchmark), in turn; "events": an
--     event each published to the room "bench" (routing key bench.noop): all with KEY, each
--     answer expected to be a 201;
--   "sink" (ordered_delivery): a conversation response to the URL's path, as a delivery POSTs
--     it (its fields, an Idempotency-Key), another response of a conversation per thread,
--     each answer expected to be a 200.
-- Every other answer is counted, per thread, and the total printed at the end as
-- "not <status>: N" (the first three of each thread shown).
local counter = 0
local threads = {}
function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end
function init(args)
  run = args[1] or "run"
  kind = args[2] or "messages"
  headers = {["Content-Type"] = "application/json"}
  if kind ~= "sink" then
    expected = 201
    local key = os.getenv("KEY")
    if key and key ~= "" then headers["Authorization"] = "Bearer " .. key end
  else
    expected = 200
  end
end
request = function()
  counter = counter + 1
  if kind == "messages" then
    local body = string.format(
      '{"service":"bench","operation":"noop","correlation_id":"%s-%d-%d",' ..
      '"source_system":"wrk","msg_timestamp":"2026-12-06T00:00:00Z","payload":"{}"}',
      run, tid, counter)
    return wrk.format("POST", "/messages", headers, body)
  elseif kind == "requests" then
    local body = string.format('{"request_id":"%s-%d-%d","origin":"bench"}', run, tid, counter)
    local path = string.format("/conversations/c-%s-%d-%d/requests", run, tid, math.floor(counter / 10))
    return wrk.format("POST", path, headers, body)
  elseif kind == "responses" then
    local n = counter % 1000
    local body = string.format(
      '{"request_id":"q-%d","response_id":"%s-%d-%d","payload":{"text":"hello"}}',
      n, run, tid, counter)
    return wrk.format("POST", string.format("/conversations/bench-%d/responses", n), headers, body)
  elseif kind == "events" then
    local body = string.format('{"routing_key":"bench.noop","payload":{"n":%d}}', counter)
    return wrk.format("POST", "/rooms/bench/events", headers, body)
  end
  local id = string.format("%s-%d-%d", run, tid, counter)
  headers["Idempotency-Key"] = id
  local body = string.format(
    '{"conversation_id":"wrk-%s-%d","request_id":"q-%s","response_id":"%s",' ..
    '"payload":{"text":"hello"}}', run, tid, id, id)
  return wrk.format("POST", nil, headers, body)
end
wrong = 0
response = function(status, headers, body)
  if status ~= expected then
    wrong = wrong + 1
    if wrong <= 3 then io.stderr:write("status " .. status .. " " .. body .. "\n") end
  end
end
function done(summary, latency, requests)
  local total = 0
  for _, thread in ipairs(threads) do total = total + thread:get("wrong") end
  -- (init ran in the threads, not here: the expected status is theirs)
  io.write(string.format("not %d: %d\n", threads[1]:get("expected"), total))
end
