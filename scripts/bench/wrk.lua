-- wrk harness for scripts/bench.sh: the same closed-loop load on leasecore and on etcd.
--
--   SYSTEM=leasecore|etcd OP=put|get|get-local|lease-grant|lease-refresh \
--     wrk -t1 -c64 -d10s --timeout 5s -s scripts/bench/wrk.lua http://127.0.0.1:PORT
--
-- Each (SYSTEM, OP) has a request template (below) and a success rule: the exact HTTP status
-- and a substring the body must contain (and one it must not). Every response is checked;
-- only checked successes count in "ok" and "ok_rps". At the end one line is printed:
--   RESULT_JSON {"system":..,"op":..,"ok":..,"failed":..,"ok_rps":..,"p50_ms":..,"p99_ms":..}
-- (latency percentiles are wrk's, over every response of the run).
--
-- Env:
--   KEY_PREFIX   prefix of the keys written (put) or read (get); lease names for lease-grant
--   KEYSPACE     gets read a random key KEY_PREFIX%08d, 0 <= i < KEYSPACE (preloaded)
--   VALUE_SIZE   bytes per value (default 256)
--   TTL_S        lease TTL in seconds for lease-grant (default 60)
--   LEASES       comma-separated lease names (leasecore) or ids (etcd) for lease-refresh
--   LABEL        free text copied into the result
-- Keys written by put are KEY_PREFIX .. %02d(thread) .. %09d(n): digits only after the prefix,
-- so that a store without a count call can be counted by splitting the prefix digit by digit.

local function env(name, default)
  local v = os.getenv(name)
  if v == nil or v == '' then return default end
  return v
end

local SYSTEM = env('SYSTEM', 'leasecore')
local OP = env('OP', 'put')
local PREFIX = env('KEY_PREFIX', 'bench/')
local KEYSPACE = tonumber(env('KEYSPACE', '1000'))
local VALUE_SIZE = tonumber(env('VALUE_SIZE', '256'))
local TTL_S = tonumber(env('TTL_S', '60'))
local LABEL = env('LABEL', '')

-- base64 (etcd's JSON gateway carries keys and values as base64 bytes)
local B64 = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/'
local function b64(s)
  local out = {}
  for i = 1, #s, 3 do
    local a, b, c = s:byte(i, i + 2)
    local v = a * 65536 + (b or 0) * 256 + (c or 0)
    local n = (b == nil) and 2 or ((c == nil) and 3 or 4)
    for j = 1, 4 do
      if j <= n then
        local idx = math.floor(v / 2 ^ (6 * (4 - j))) % 64
        out[#out + 1] = B64:sub(idx + 1, idx + 1)
      else
        out[#out + 1] = '='
      end
    end
  end
  return table.concat(out)
end

-- The templates. path/body are functions of (key, n); status/match/reject check the answer.
local T = {
  leasecore = {
    put = { method = 'PUT', path = function(k) return '/v1/kv/' .. k end,
            body = function(_, _, v) return '{"value":"' .. v .. '"}' end,
            status = 200, match = '"revision"' },
    get = { method = 'GET', path = function(k) return '/v1/kv/' .. k end,
            status = 200, match = '"mod_revision"' },
    ['get-local'] = { method = 'GET', path = function(k) return '/v1/kv/' .. k .. '?consistency=local' end,
            status = 200, match = '"mod_revision"' },
    ['lease-grant'] = { method = 'POST', path = function() return '/v1/leases' end,
            body = function(k) return '{"name":"' .. k .. '","ttl_ms":' .. (TTL_S * 1000) .. '}' end,
            status = 201, match = '"revision"' },
    ['lease-refresh'] = { method = 'POST', path = function(_, l) return '/v1/leases/' .. l .. '/refresh' end,
            status = 200, match = '"remaining_ms"' },
  },
  etcd = {
    put = { method = 'POST', path = function() return '/v3/kv/put' end,
            body = function(k, _, _, vb) return '{"key":"' .. b64(k) .. '","value":"' .. vb .. '"}' end,
            status = 200, match = '"header"' },
    get = { method = 'POST', path = function() return '/v3/kv/range' end,
            body = function(k) return '{"key":"' .. b64(k) .. '"}' end,
            status = 200, match = '"kvs"' },
    ['get-local'] = { method = 'POST', path = function() return '/v3/kv/range' end,
            body = function(k) return '{"key":"' .. b64(k) .. '","serializable":true}' end,
            status = 200, match = '"kvs"' },
    ['lease-grant'] = { method = 'POST', path = function() return '/v3/lease/grant' end,
            body = function() return '{"TTL":' .. TTL_S .. '}' end,
            status = 200, match = '"ID"' },
    -- etcd answers 200 to a keepalive of an unknown lease, with TTL -1 or no TTL at all
    ['lease-refresh'] = { method = 'POST', path = function() return '/v3/lease/keepalive' end,
            body = function(_, l) return '{"ID":"' .. l .. '"}' end,
            status = 200, match = '"TTL"', reject = '"TTL":"-' },
  },
}
local tpl = assert(T[SYSTEM] and T[SYSTEM][OP], 'unknown SYSTEM/OP ' .. SYSTEM .. '/' .. OP)
local REJECT = tpl.reject or '"error"'

local threads = {}
function setup(thread)
  threads[#threads + 1] = thread
  thread:set('tid', #threads)
end

local n, leases, value, value_b64, headers = 0, {}, nil, nil, nil
ok, bad_status, bad_body = 0, 0, 0
local first_failure = nil

function init(args)
  math.randomseed(os.time() * 1000 + (tid or 1))
  for l in env('LEASES', ''):gmatch('[^,%s]+') do leases[#leases + 1] = l end
  if OP == 'lease-refresh' then assert(#leases > 0, 'lease-refresh needs LEASES') end
  local t = {}
  for i = 1, VALUE_SIZE do t[i] = string.char(97 + (i * 7) % 26) end
  value = table.concat(t)
  value_b64 = b64(value)
  headers = { ['Content-Type'] = 'application/json' }
end

function request()
  n = n + 1
  local key
  if OP == 'get' or OP == 'get-local' then
    key = PREFIX .. string.format('%08d', math.random(0, KEYSPACE - 1))
  else
    key = PREFIX .. string.format('%02d%09d', tid or 1, n)
  end
  local lease = (#leases > 0) and leases[(n - 1) % #leases + 1] or nil
  local body = tpl.body and tpl.body(key, lease, value, value_b64) or nil
  return wrk.format(tpl.method, tpl.path(key, lease), headers, body)
end

function response(status, hdrs, body)
  if status ~= tpl.status then
    bad_status = bad_status + 1
  elseif not (body and body:find(tpl.match, 1, true)) or body:find(REJECT, 1, true) then
    bad_body = bad_body + 1
  else
    ok = ok + 1
    return
  end
  if first_failure == nil then
    first_failure = status .. ' ' .. string.sub(body or '', 1, 160)
    io.stderr:write('wrk.lua: first failed response: ' .. first_failure .. '\n')
  end
end

local function jstr(s)
  return '"' .. tostring(s):gsub('[%c"\\]', function(c) return string.format('\\u%04x', c:byte()) end) .. '"'
end

function done(summary, latency, requests)
  local okc, bs, bb = 0, 0, 0
  for _, t in ipairs(threads) do
    okc = okc + (t:get('ok') or 0)
    bs = bs + (t:get('bad_status') or 0)
    bb = bb + (t:get('bad_body') or 0)
  end
  local e = summary.errors
  local socket_errors = e.connect + e.read + e.write + e.timeout
  local secs = summary.duration / 1e6
  local function ms(us) return string.format('%.3f', us / 1000) end
  io.write('RESULT_JSON {' ..
    '"system":' .. jstr(SYSTEM) .. ',"op":' .. jstr(OP) .. ',"label":' .. jstr(LABEL) ..
    ',"threads":' .. #threads .. ',"seconds":' .. string.format('%.3f', secs) ..
    ',"requests":' .. summary.requests .. ',"ok":' .. okc ..
    ',"failed":' .. (bs + bb + socket_errors) ..
    ',"bad_status":' .. bs .. ',"bad_body":' .. bb ..
    ',"socket_errors":' .. socket_errors .. ',"timeouts":' .. e.timeout ..
    ',"ok_rps":' .. string.format('%.1f', okc / secs) ..
    ',"p50_ms":' .. ms(latency:percentile(50)) .. ',"p90_ms":' .. ms(latency:percentile(90)) ..
    ',"p99_ms":' .. ms(latency:percentile(99)) .. ',"max_ms":' .. ms(latency.max) .. '}\n')
end
