-- B9's requests for wrk (benchmarks/b9_load.py), every one with an API key:
--   wrk ... -s b9_wrk.lua URL -- post KEY TOTAL BODY_FILE IDEMPOTENCY_PREFIX
--     POST /jobs with BODY_FILE's JSON and a new Idempotency-Key each, stopping after TOTAL answers;
--   wrk ... -s b9_wrk.lua URL -- get KEY IDS_FILE
--     GET /jobs/{id}, the ids of IDS_FILE (one a line) in turn, until wrk's -d ends.
-- done() prints one line, "B9 " and a JSON object: requests, seconds, latency percentiles in
-- microseconds (wrk's own histogram), wrk's error counts and the answers of an unexpected status.

local ffi = require("ffi")
ffi.cdef([[
int getpid(void);
int kill(int pid, int sig);
]])
local SIGINT = 2

local mode
local requests = {}
local index = 0
local total = 0
local answers = 0
local unexpected = 0
local body, prefix, auth

local function read_file(path)
  local file = assert(io.open(path, "rb"))
  local text = file:read("*a")
  file:close()
  return text
end

function init(args)
  mode = args[1]
  auth = "Bearer " .. args[2]
  if mode == "post" then
    total = tonumber(args[3])
    body = read_file(args[4])
    prefix = args[5]
  elseif mode == "get" then
    for id in read_file(args[3]):gmatch("[^\n]+") do
      requests[#requests + 1] = wrk.format("GET", "/jobs/" .. id, { Authorization = auth })
    end
    -- No per-answer callback: wrk then leaves the answers unparsed by Lua (cheaper), and counts
    -- every status over 399 as an error itself.
    response = nil
  else
    error("mode must be post or get, not " .. tostring(mode))
  end
end

function request()
  index = index + 1
  if mode == "get" then
    return requests[(index - 1) % #requests + 1]
  end
  return wrk.format("POST", "/jobs", {
    Authorization = auth,
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = prefix .. index,
  }, body)
end

function response(status, headers, answer)
  answers = answers + 1
  if status ~= 201 then
    unexpected = unexpected + 1
    if unexpected == 1 then
      io.stderr:write("B9 unexpected answer " .. status .. ": " .. answer:sub(1, 500) .. "\n")
    end
  end
  if answers == total then
    -- wrk's main thread sleeps for --duration whatever its threads do; a SIGINT (wrk's own
    -- Ctrl-C) ends that sleep, and wrk reports what it timed.
    wrk.thread:stop()
    ffi.C.kill(ffi.C.getpid(), SIGINT)
  end
end

local threads = {}

function setup(thread)
  threads[#threads + 1] = thread
end

function done(summary, latency, _)
  local odd = 0
  for _, thread in ipairs(threads) do
    odd = odd + (thread:get("unexpected") or 0)
  end
  local e = summary.errors
  io.write(string.format(
    'B9 {"requests":%d,"seconds":%.6f,"p50_us":%d,"p90_us":%d,"p95_us":%d,"p99_us":%d,"max_us":%d,' ..
    '"mean_us":%.1f,"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},"unexpected":%d}\n',
    summary.requests, summary.duration / 1e6, latency:percentile(50), latency:percentile(90),
    latency:percentile(95), latency:percentile(99), latency.max, latency.mean,
    e.connect, e.read, e.write, e.status, e.timeout, odd))
end
