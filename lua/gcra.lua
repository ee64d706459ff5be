--[[ redis-guard: GCRA (generic cell rate algorithm), one limit's part of
lua/ratelimit.lua and lua/batch.lua.

This file is not a script on its own: src/scripts.rs joins it between the
clock preamble and the driver (lua/decide.lua), which calls it once per GCRA
limit.

KEYS     one string per limit: the theoretical arrival time (TAT) on Redis'
         clock, "<ms>" or "<ms>:<rem>", meaning ms + rem/rate ms (0 <= rem <
         rate; ":0" is left out, so a TAT on a whole ms is stored as an
         integer, which Redis keeps in less memory)
ARGV     the limit's group in ratelimit.lua: "gcra", burst (units), rate
         (units per period), period (ms), cost, enforce.
         Config keeps 1 <= burst, rate, period; burst * period < 2^52;
         rate * period < 2^53; 1 <= cost (<= burst, but see below)
Returns  gcra_check(key, burst, rate, period, cost) -> verdict table with
         allowed (0/1), remaining, retry (ms), reset (ms: until the TAT, when
         the whole burst is back); gcra_charge(verdict) charges it;
         gcra_flush() writes every charged key once, with its expiry in the
         same SET. The driver calls gcra_flush() (through flush_all()) before
         it returns.
Reads    `now` (ms, from Redis TIME) set by the preamble.

Why GCRA: the same admissions as a token bucket of capacity = burst that
refills `rate` units every `period` ms, from one number instead of two (the
TAT: the instant the limit would be whole again), so one GET and one SET.

Exact arithmetic. The emission interval period/rate is a fraction of a ms in
general, so nothing is computed in ms: d = (TAT - now) * rate is the backlog
in the token bucket's credits (one unit is `period` credits, and every ms
takes `rate` of them off). A request is admitted when
    max(d, 0) + cost * period <= burst * period,
and then TAT' = now + (max(d, 0) + cost * period) / rate. Every value here is
at most burst * period < 2^52, and a quotient of integers below 2^53 never
rounds across an integer, so floor() and ceil() of it are exact. The TAT
itself is never multiplied by the rate (ms * rate would pass 2^53): d is
built from the distance TAT - now in whole ms plus rem.

TTL: until the TAT, rounded up to a whole ms. From then on the key equals a
missing one (max(d, 0) = 0), so it may vanish; reset_ms after a charge is the
same number.

A cost above the burst can never be admitted: a rejection that writes
nothing, whose retry_ms is the time until the limit is whole again (0 if it
already is), since no wait would admit it.

A clock that steps back (a failover to a replica whose clock is behind)
leaves a TAT that may lie further ahead than burst * period / rate. That
state is taken as it is: nothing is admitted until the clock has caught up
to TAT - (burst - cost) * period / rate, and retry_ms says exactly when.
Holding the budget back for up to the clock's step is the price; admitting
more than the burst in total is never possible, since the backlog is never
forgotten.
]]

-- TATs this script run has read or charged, by key, for the same reason as
-- token_bucket.lua's tb_seen: a batch of many requests on one key reads it
-- once and writes it once; every charge of one run has the same `now`, so
-- the last TAT is what the sequence of writes would have left.
local gcra_seen = {}
local gcra_charged = {}

local function gcra_check(key, burst, rate, period, cost)
  local s = gcra_seen[key]
  if s == nil then
    s = {}
    local v = redis.call('GET', key)
    if v then
      local ms, rem = string.match(v, '^(%d+):?(%d*)$')
      s.ms, s.rem = tonumber(ms), tonumber(rem) or 0
    end
    gcra_seen[key] = s
  end
  local full = burst * period
  local need = cost * period
  local ms, rem = s.ms, s.rem
  if ms and rem >= rate then
    -- Written under a higher rate: carry the whole ms out of rem (the TAT
    -- moves by less than a ms, once).
    ms = ms + math.floor(rem / rate)
    rem = rem % rate
  end

  -- lag = whole ms from now to the TAT; d as above. A TAT before now leaves
  -- no backlog (rem < rate, so d < 0).
  local lag, d = 0, 0
  if ms and ms >= now then
    lag = ms - now
    if lag <= math.floor((full - rem) / rate) then
      d = lag * rate + rem
    else
      -- More backlog than the burst holds: a clock that stepped back. d is
      -- not needed (nor, this far out, exact): such a state only rejects.
      d = nil
    end
  end

  local r = { key = key, d = d, need = need, full = full, rate = rate,
              period = period }
  if d and need <= full and d + need <= full then
    r.allowed = 1
    r.remaining = math.floor((full - d - need) / period)
    r.retry = 0
    r.reset = math.ceil((d + need) / rate)
  else
    r.allowed = 0
    r.remaining = d and math.floor((full - d) / period) or 0
    if need > full then
      -- Never admissible: the time until the backlog is gone.
      r.retry = ms and ms >= now and lag + math.ceil(rem / rate) or 0
    else
      -- Until max(d, 0) + need <= full, i.e. (d + need - full) / rate ms,
      -- split as lag + (rem + need - full) / rate so it stays exact for a
      -- TAT however far ahead.
      r.retry = lag + math.ceil((rem + need - full) / rate)
    end
    r.reset = r.retry
  end
  return r
end

local function gcra_charge(r)
  local ahead = r.d + r.need
  local whole = math.floor(ahead / r.rate)
  if gcra_seen[r.key].charged == nil then
    gcra_charged[#gcra_charged + 1] = r.key
  end
  gcra_seen[r.key] = { ms = now + whole, rem = ahead - whole * r.rate,
                       charged = true, ttl = r.reset }
end

local function gcra_flush()
  for _, key in ipairs(gcra_charged) do
    local s = gcra_seen[key]
    local v = string.format('%d', s.ms)
    if s.rem > 0 then
      v = v .. string.format(':%d', s.rem)
    end
    redis.call('SET', key, v, 'PX', string.format('%d', s.ttl))
  end
  gcra_charged = {}
end
