#!lua flags=no-writes
--[[ redis-guard: one limit's state as an operator's inspection sees it
(`redis-guard inspect`), spending nothing.

KEYS[1]  the limit's state key, as the filter builds it
ARGV     the limit's group as in lua/ratelimit.lua, without the enforce flag:
         algorithm, a, b, c, cost (the cost of the request asked about; a
         concurrency limit's c, the slot id, is any valid one: no slot is taken)
Returns  [allowed, remaining, retry_ms, reset_ms, now_ms]
  allowed    1 if a request of that cost would be admitted now
  remaining  units left as the state stands (nothing charged)
  retry_ms   0 when allowed; otherwise ms until such a request could be
  reset_ms   allowed: ms until the limit is whole again (0 if it is);
             rejected: retry_ms, as the filter's 429 reports it
  now_ms     Redis' clock, which every decision reads

Read-only by construction and by Redis: the first line flags the script
`no-writes`, so Redis refuses any write it would make (and runs it on a
replica, or with EVAL_RO). Each kind's check only reads; the same code the
filter decides with computes the figures (lua/decide.lua's
report_uncharged), so an inspection agrees with the headers a request
would have got.

Composition: src/scripts.rs joins the decision parts (lua/wire.lua, the
kinds, lua/idempotency.lua, lua/decide.lua) at the marker below, as for
lua/ratelimit.lua.
]]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- @@ALGORITHMS@@

local function inspect(key, alg, a, b, c, cost)
  need(alg)
  local r
  if alg == 'tb' then
    r = tb_check(key, a, b, tonumber(c), cost)
  elseif alg == 'sw' then
    r = sw_check(key, a, b, cost)
  elseif alg == 'gcra' then
    r = gcra_check(key, a, b, tonumber(c), cost)
  elseif alg == 'fw' then
    r = fw_check(key, a, b, 0, cost)
  elseif alg == 'swc' then
    r = swc_check(key, a, b, 0, cost)
  elseif alg == 'cc' then
    r = cc_check(key, a, b, c, cost)
  elseif alg == 'cq' then
    if cq_edges_bad(c) then
      return redis.error_reply('ERR redis-guard inspect: no window of the edges holds Redis\' clock')
    end
    r = cq_check(key, a, b, c, cost)
  else
    return redis.error_reply('ERR redis-guard inspect: unknown algorithm')
  end
  r.alg = alg
  if r.allowed == 1 then
    report_uncharged(r)
  end
  return { r.allowed, wire(r.remaining), wire(r.retry), wire(r.reset), wire(now) }
end

local a, b, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
if #KEYS ~= 1 or a == nil or b == nil or cost == nil then
  return redis.error_reply('ERR redis-guard inspect: one key, then algorithm, a, b, c, cost')
end
return inspect(KEYS[1], ARGV[1], a, b, ARGV[4], cost)
