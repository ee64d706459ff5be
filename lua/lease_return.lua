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
give-backs (every charge lowers it): after each such peak (t0's level, or
the level a give-back left) it climbs by refill alone until the next, so
  M <= M' = min(C, max(level(t0), P) + refill x (t1 - t0))
with level(t0) the level lease.lua left and replied, P the highest level a
give-back after t0 left, and refill in credits per ms. Adding up the
give-backs instead (level(t0) + all given back since) is also a bound, but
with two Envoys taking turns it counts every give-back of the other as a
rise, though charges took the bucket down in between, and strands tokens.
To know P, the record at KEYS[i] .. ':ret' holds the count of tokens given
back (the grant's tuple carries it: every give-back after t0 has a higher
count) and the peaks: (count, level, time) of give-backs, counts rising
and levels falling, for a peak below a later one's level never decides P
for any tuple. P is the level of the first peak whose count exceeds the
tuple's. The record stays small: peaks older than the oldest tuple that
may come back are dropped (a give-back before t0 has a count <= the
tuple's), and beyond MAX_PEAKS the oldest two become one with the later
count and the higher level (never lower than the truth for any tuple).
Nothing on the strict path is touched: the strict token bucket reads and
writes what it always did. When an Envoy's slot
received a second grant while it still held tokens, it keeps the first
tuple: [t0, t1] then covers both grants, and the gap starts at the first
grant's part and only grows with the second's, so the bound holds for all
it holds.
Several Envoys: each give-back is judged against the real trajectory,
earlier give-backs included (they are in the counter), so by induction the
bucket never holds more than it would had every given-back token never been
taken. Spent tokens are requests a never-leasing bucket would have charged.
The record must never start again while a tuple is out (that would hide
peaks from M'): lease.lua creates it and sets its TTL to 660 s at every
grant, this script keeps that TTL, and a tuple older than 600 s (the
longest lease) gives nothing back here, nor one whose record is missing or
whose count went backwards. As every key of the limiter, it
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
-- Peaks a record keeps at most (24 bytes each).
local MAX_PEAKS = 32

-- The record: count, then peaks {count, level, time}, counts rising.
local function read_record(s)
  local count = struct.unpack('<d', s)
  local peaks = {}
  for at = 9, #s - 23, 24 do
    local c, l, t = struct.unpack('<ddd', s, at)
    peaks[#peaks + 1] = { c, l, t }
  end
  return count, peaks
end

local function write_record(key, count, peaks)
  local parts = { struct.pack('<d', count) }
  for _, p in ipairs(peaks) do
    parts[#parts + 1] = struct.pack('<ddd', p[1], p[2], p[3])
  end
  redis.call('SET', key, table.concat(parts), 'KEEPTTL')
end

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
  local rec = redis.call('GET', ck)
  if rec and #rec >= 8 and now >= g.t0 and now - g.t0 < OLDEST then
    local counted, peaks = read_record(rec)
    if counted >= g.returned then
      local peak = g.level
      for _, p in ipairs(peaks) do
        if p[1] > g.returned then
          peak = math.max(peak, p[2])
          break
        end
      end
      local full = g.capacity * g.period
      local m = math.min(full, peak + g.refill * (now - g.t0))
      given = math.min(g.tokens, math.floor((full - m) / g.period))
      if given > 0 then
        local r = tb_check(key, g.capacity, g.refill, g.period, 0)
        -- r.credits <= M' by the bound, so this never cuts; kept so a
        -- bucket is never written above full whatever a caller sends.
        given = math.min(given, math.floor((r.full - r.credits) / g.period))
        if given > 0 then
          r.need = -given * g.period
          tb_charge(r)
          local left = r.credits + given * g.period
          counted = counted + given
          -- A new peak: earlier ones at or below it never decide again.
          while #peaks > 0 and peaks[#peaks][2] <= left do
            peaks[#peaks] = nil
          end
          peaks[#peaks + 1] = { counted, left, now }
          -- Peaks before the oldest tuple that may come back: never read.
          while #peaks > 0 and now - peaks[1][3] >= OLDEST do
            table.remove(peaks, 1)
          end
          if #peaks > MAX_PEAKS then
            peaks[2] = { peaks[2][1], peaks[1][2], peaks[2][3] }
            table.remove(peaks, 1)
          end
          write_record(ck, counted, peaks)
        end
      end
      given = math.max(0, given)
    end
  end
  out[i] = wire(given)
end
tb_flush()
return out
