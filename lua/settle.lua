--[[ redis-guard: settle usage-based costs: once a response says what its
request really cost, charge the difference from what the decision reserved,
or refund it.

KEYS[i]  the state key of limit i (as in lua/ratelimit.lua); a key may come
         more than once (the settlements of several requests in one call, as
         an Envoy worker sends them): they apply in order
ARGV per limit i, seven values starting at 1 + (i-1)*7:
  algorithm  "tb", "gcra", "fw", "swc" or "cq" (the sliding-window log keeps a
             member per unit, and a concurrency limit counts requests, not
             units: neither settles); "tb", "fw", "swc" and "cq" may carry
             `+o` as in lua/ratelimit.lua: the key's stored override (the
             customer's plan, lua/keys.lua override_figures) replaces a, b
             as it did in the decision, read in this same call. A quota's
             plan counts whatever its anchor day: the edges are the
             decision's, and it was judged on the plan's day
  a, b, c    as in lua/ratelimit.lua (tb: capacity, refill, period; gcra:
             burst, rate, period; fw, swc: limit, window, 0; cq: amount,
             0, the window edges of the decision, lua/quota.lua)
  delta      units to charge now: the actual cost minus what was reserved,
             negative for a refund (a whole number, |delta| < 2^50)
  age        ms since the decision's call left (the proxy's clock): the
             decision ran at most that long ago. A window kind refunds only
             when the reserve was surely taken in the window current now
  block      0, or a blocking limit's block (ms, 1000 to 2^42): when the
             usage counted (delta >= 0) and leaves less than one unit, the
             key's block starts (lua/keys.lua block_key, SET PX), as a
             rejection starts it for other limits (lua/ratelimit.lua)
Returns  one entry per limit: the units left after settling (wire()d),
         negative is debt; or, for a limit that cannot be settled, the
         string `ERR redis-guard settle: limit <i> ...` saying why, in its
         place (never a number: a wire()d figure is digits).

One member, one outcome. The filter joins the settlements of every request
of a hash tag that ended in one tick into one call (src/filter/deferred.rs):
they are different requests, often different customers, so one that cannot
be settled (a quota's edges that no longer hold Redis' clock: its response
ended more than a window after the decision, or the Envoy's clock is off by
more than a window; a kind or numbers out of range) is marked in its place
and the others are applied, as separate calls would be. Each member is
checked before anything is written, so a marked one writes nothing; only a
call that does not parse (not seven values per key) is an error for the
whole call, and then nothing is written.

Debt. The cost comes after the work, so the balance may go below zero: a
token bucket's credits, a GCRA's theoretical arrival time past the burst, a
window's count past its limit. Nothing is admitted until the debt has
refilled (tb, gcra) or its window has passed (fw; swc: the window and, by
its weight, part of the next). That is the only exact answer when the cost
is known late. No cap: a cost is bounded by what the upstream reports.

Refunds never make a limit more than whole: a token bucket stops at full, a
GCRA's arrival time at now, a window's count at 0. A fixed window or counter
settles into the window current now: a charge lands in it; a refund only if
the reserve was surely taken in it (now - age is in the same window), and is
dropped otherwise (the reserve went with its window, or into a window whose
count a refund here would wrongly lower: never over-admit).

Large costs: a token bucket's or GCRA's debt is kept exact (its credits
below 2^53): a charge beyond that is clamped, so at most 2^52 credits of
debt (2^52 / period units) are held.

Composition: src/scripts.rs joins lua/wire.lua, lua/token_bucket.lua,
lua/fixed_window.lua, lua/sliding_window_counter.lua and lua/quota.lua at
the marker: each
kind's own check reads and rolls its state forward (cost 0), its own charge
and flush write it, so a settlement stores exactly what a decision would.
Clock: Redis TIME, as in the decision. Every key written keeps a TTL: the
time until it equals a missing key.
]]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- @@ALGORITHMS@@

local n = #KEYS
if #ARGV ~= 7 * n then
  return redis.error_reply('ERR redis-guard settle: seven values per key')
end

local function whole(x, lo, hi)
  return x ~= nil and x == math.floor(x) and x >= lo and x <= hi
end

-- Every limit is checked before any is written: a member that fails is
-- marked in `failed` (its reply entry) and skipped below, having written
-- nothing.
-- A limit's kind, and whether it reads its key's override (`+o`).
local function settle_kind(alg)
  if type(alg) == 'string' and string.sub(alg, -2) == '+o' then
    local kind = string.sub(alg, 1, -3)
    if kind == 'tb' or kind == 'fw' or kind == 'swc' or kind == 'cq' then
      return kind, true
    end
    return nil, false
  end
  return alg, false
end

local failed = {}
for i = 1, n do
  local base = 1 + (i - 1) * 7
  local alg = settle_kind(ARGV[base])
  local a, b, c = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local block = tonumber(ARGV[base + 6])
  -- The bounds config validation keeps each kind within (src/config/limit.rs).
  local ok = whole(tonumber(ARGV[base + 4]), -(2^50 - 1), 2^50 - 1)
      and (block == 0 or whole(block, 1000, 2^42))
      and whole(tonumber(ARGV[base + 5]), 0, 2^53 - 1)
      and whole(a, 1, 2^53 - 1) and whole(b, 1, 2^53 - 1) and whole(c, 0, 2^53 - 1)
  if alg == 'tb' then
    ok = ok and c >= 1 and a * c < 2^53 and b * c < 2^53
  elseif alg == 'gcra' then
    ok = ok and c >= 1 and a * c < 2^52 and b * c < 2^53
  elseif alg == 'fw' or alg == 'swc' then
    ok = ok and a <= 2^50
  elseif alg == 'cq' then
    -- b is unused (0) and c the edges: a window of them holds now.
    ok = whole(tonumber(ARGV[base + 4]), -(2^50 - 1), 2^50 - 1)
      and (block == 0 or whole(block, 1000, 2^42))
      and whole(tonumber(ARGV[base + 5]), 0, 2^53 - 1)
      and whole(a, 1, 2^50)
    if ok and cq_edges_bad(ARGV[base + 3]) then
      failed[i] = 'ERR redis-guard settle: limit ' .. i
          .. ': no window of its edges holds Redis\' clock'
    end
  else
    ok = false
  end
  if not ok then
    failed[i] = 'ERR redis-guard settle: limit ' .. i
        .. ' has an unknown kind or numbers out of range'
  end
end

-- GCRA, settled on its own terms: the backlog d = (TAT - now) * rate in
-- credits (lua/gcra.lua), here allowed past the burst (debt), moved by
-- delta * period, never below 0 (now).
local function gcra_settle(key, burst, rate, period, delta)
  local v = redis.call('GET', key)
  local d = 0
  if v then
    local ms, rem = string.match(v, '^(%d+):?(%d*)$')
    ms, rem = tonumber(ms), tonumber(rem) or 0
    if ms and ms >= now then
      d = (ms - now) * rate + rem
    end
  end
  d = math.max(0, math.min(d + delta * period, 2^52))
  if d == 0 then
    redis.call('DEL', key)
  else
    local whole_ms = math.floor(d / rate)
    local value = string.format('%d', now + whole_ms)
    if d - whole_ms * rate > 0 then
      value = value .. string.format(':%d', d - whole_ms * rate)
    end
    redis.call('SET', key, value, 'PX', string.format('%d', math.ceil(d / rate)))
  end
  return math.floor((burst * period - d) / period)
end

local out = {}
local function settle(i)
  local base = 1 + (i - 1) * 7
  local key = KEYS[i]
  local alg, ov = settle_kind(ARGV[base])
  local a, b, c = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  if ov then
    -- pcall: a key of another type written by hand is no plan, as in the
    -- decision.
    local okey = override_key(key)
    local text = okey and redis.pcall('GET', okey)
    if type(text) == 'string' then
      local x, y = override_figures(text, alg, ARGV[base + 3], true)
      if x then
        a, b = x, y or b
      end
    end
  end
  local delta = tonumber(ARGV[base + 4])
  local age = tonumber(ARGV[base + 5])
  if (alg == 'fw' or alg == 'swc') and delta < 0
      and math.floor((now - age) / b) ~= math.floor(now / b) then
    delta = 0
  end
  if alg == 'cq' and delta < 0 then
    -- A refund only into the window the reserve was surely taken in.
    local start = cq_window(ARGV[base + 3])
    if now - age < start then
      delta = 0
    end
  end
  local left
  if alg == 'tb' then
    local r = tb_check(key, a, b, c, 0)
    -- A refund stops at full; a debt at 2^52 credits (exact doubles).
    r.need = math.min(math.max(delta * c, r.credits - r.full), r.credits + 2^52)
    tb_charge(r)
    left = math.floor((r.credits - r.need) / c)
  elseif alg == 'gcra' then
    left = gcra_settle(key, a, b, c, delta)
  elseif alg == 'cq' then
    local r = cq_check(key, a, 0, ARGV[base + 3], 0)
    r.cost = math.max(delta, -r.count)
    if r.count + r.cost > 0 or r.count > 0 then
      cq_charge(r)
    end
    left = a - r.count - r.cost
  elseif alg == 'fw' then
    local r = fw_check(key, a, b, 0, 0)
    r.cost = math.max(delta, -r.count)
    if r.count + r.cost > 0 or r.count > 0 then
      fw_charge(r)
    end
    left = a - r.count - r.cost
  else
    local r = swc_check(key, a, b, 0, 0)
    r.cost = math.max(delta, -r.cur)
    -- Written through the kind's per-run cache even when the state is back
    -- to nothing (a key that expires at once): the same key may come again
    -- in this call.
    r.reset = math.max(1, swc_restored_in(r.cur + r.cost, r.prev, r))
    swc_charge(r)
    left = a - swc_weight(r.prev, b, r.e) - r.cur - r.cost
  end
  local block = tonumber(ARGV[base + 6])
  if block > 0 and delta >= 0 and left < 1 then
    redis.call('SET', block_key(key), '1', 'PX', block)
  end
  return wire(left)
end
for i = 1, n do
  out[i] = failed[i] or settle(i)
end
tb_flush()
fw_flush()
swc_flush()
cq_flush()
return out
