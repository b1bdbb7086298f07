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
errors = 0
response = function(status, headers, body)
  if status ~= 201 then
    errors = errors + 1
    if errors <= 3 then io.stderr:write("status " .. status .. " " .. body .. "\n") end
  end
end
