--[[ redis-guard: leased tokens given back. An Envoy whose lease of a bucket
ends, or whose traffic on it stopped, hands its unspent tokens back here,
every bucket it gives back to in one call per tick (and per hash tag).

KEYS[i]  a bucket's string (lua/token_bucket.lua's layout), once per give-back
ARGV     seven whole numbers per key, in KEYS' order:
         capacity, refill, period (the bucket's, as lua/lease.lua took them),
         tokens (unspent, >= 1), and the tuple lease.lua's grant replied:
         now_ms, level (credits), returned
         Anything else is an error reply and nothing is written.
Returns  one integer per key: the tokens given back (0 to `tokens`); the
         rest are dropped (under-admission, never over-admission).

Composition: src/scripts.rs joins lua/wire.lua and lua/token_bucket.lua at
the marker below. Clock: Redis TIME, read once.

Why giving back can never over-admit. Naively adding the unspent g tokens
back (capped at the capacity C) can: the bucket refills to C while they are
out (refill a never-leased bucket would have wasted at the cap), a strict
request then takes y, and g more would leave min(C, C - y + g) where a
bucket that never leased holds C - y. So take L1 = the bucket's real level,
L2 = the level it would have had the g tokens never left. From the grant
(t0) on, both see the same charges and the same refill; L2 - L1 starts at g
and shrinks only while L2 is held at C, where it is C - L1. So at the
give-back (t1), L2 - L1 = min(g, C - M), M the highest level L1 reached in
[t0, t1], and giving back max(0, min(g, C - M')) for any M' >= M keeps the
bucket at or below L2. Between t0 and t1, L1 rises only by refill and by
give-backs (every charge lowers it), so
  M <= M' = min(C, level(t0) + refill x (t1 - t0) + (returned(t1) - returned(t0)))
with level(t0) the level lease.lua left and replied, returned(t) the
bucket's give-back counter in tokens (KEYS[i] .. ':ret', counted here) and
refill in credits per ms. Nothing on the strict path is touched: the strict
token bucket reads and writes what it always did. When an Envoy's slot
received a second grant while it still held tokens, it keeps the first
tuple: [t0, t1] then covers both grants, and the gap starts at the first
grant's part and only grows with the second's, so the bound holds for all
it holds.
Several Envoys: each give-back is judged against the real trajectory,
earlier give-backs included (they are in the counter), so by induction the
bucket never holds more than it would had every given-back token never been
taken. Spent tokens are requests a never-leasing bucket would have charged.
The counter must never restart at 0 while a tuple is out (that would hide
give-backs from M'): lease.lua sets its TTL to 660 s at every grant, and a
tuple older than 600 s (the longest lease) gives nothing back here, nor one
whose counter is missing or went backwards. As every key of the limiter, it
assumes Redis does not evict keys. A Redis clock stepped back (failover)
before t0 gives nothing back.
]]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- @@ALGORITHMS@@

-- The oldest tuple that may come back (ms): the longest lease. The counter
-- outlives every tuple that young (lua/lease.lua: 660 s after each grant).
local OLDEST = 600000
local PER_KEY = 7

local function whole(v, least)
  local x = tonumber(v)
  if x and x == math.floor(x) and x >= least and x <= 9007199254740992 then
    return x
  end
  return nil
end

local function bad()
  return redis.error_reply('ERR redis-guard lease return: seven numbers per key')
end

if #KEYS == 0 or #ARGV ~= PER_KEY * #KEYS then
  return bad()
end
local back = {}
for i = 1, #KEYS do
  local a = (i - 1) * PER_KEY
  local g = {
    capacity = whole(ARGV[a + 1], 1), refill = whole(ARGV[a + 2], 1),
    period = whole(ARGV[a + 3], 1), tokens = whole(ARGV[a + 4], 1),
    t0 = whole(ARGV[a + 5], 0), level = whole(ARGV[a + 6], 0),
    returned = whole(ARGV[a + 7], 0),
  }
  if not (g.capacity and g.refill and g.period and g.tokens and g.t0 and g.level
      and g.returned) or g.tokens > g.capacity then
    return bad()
  end
  back[i] = g
end

local out = {}
for i, g in ipairs(back) do
  local key = KEYS[i]
  local ck = key .. ':ret'
  local given = 0
  local counted = tonumber(redis.call('GET', ck))
  if counted and counted >= g.returned and now >= g.t0 and now - g.t0 < OLDEST then
    local full = g.capacity * g.period
    local m = math.min(full, g.level + g.refill * (now - g.t0)
                             + (counted - g.returned) * g.period)
    given = math.min(g.tokens, math.floor((full - m) / g.period))
    if given > 0 then
      local r = tb_check(key, g.capacity, g.refill, g.period, 0)
      -- r.credits <= M' by the bound, so this never cuts; kept so a bucket
      -- is never written above full whatever a caller sends.
      given = math.min(given, math.floor((r.full - r.credits) / g.period))
      if given > 0 then
        r.need = -given * g.period
        tb_charge(r)
        redis.call('INCRBY', ck, given)
      end
    end
    given = math.max(0, given)
  end
  out[i] = wire(given)
end
tb_flush()
return out
