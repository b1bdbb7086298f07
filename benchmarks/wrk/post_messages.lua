-- wrk: POST /messages, each request a new message (its correlation id: the run, the thread,
-- a counter); the Authorization header from the environment (KEY; none for a bare app).
local counter = 0
local threads = {}
function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end
function init(args)
  run = args[1] or "run"
  headers = {["Content-Type"] = "application/json"}
  local key = os.getenv("KEY")
  if key and key ~= "" then headers["Authorization"] = "Bearer " .. key end
end
request = function()
  counter = counter + 1
  local body = string.format(
    '{"service":"bench","operation":"noop","correlation_id":"%s-%d-%d",' ..
    '"source_system":"wrk","msg_timestamp":"2026-12-06T00:00:00Z","payload":"{}"}',
    run, tid, counter)
  return wrk.format("POST", "/messages", headers, body)
end
-- Every answer that is not a 201 (a duplicate's 200 too) is counted, per thread, and the
-- total printed at the end as "not 201: N" (the first three of each thread shown).
not_201 = 0
response = function(status, headers, body)
  if status ~= 201 then
    not_201 = not_201 + 1
    if not_201 <= 3 then io.stderr:write("status " .. status .. " " .. body .. "\n") end
  end
end
function done(summary, latency, requests)
  local total = 0
  for _, thread in ipairs(threads) do total = total + thread:get("not_201") end
  io.write(string.format("not 201: %d\n", total))
end
