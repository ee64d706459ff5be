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
         rest are dropped (under-admission, never over-admission). The
         same give-back sent again answers the same and writes nothing (or
         0 while a plan is stored; see Plans).

Composition: src/scripts.rs joins lua/wire.lua, lua/token_bucket.lua and
lua/keys.lua at the marker below. Clock: Redis TIME, read once.

Plans. The proof below is for one capacity and refill. A key with anything
stored at its override key (a plan, lua/keys.lua override_key) takes
nothing back: the tokens are dropped (under-admission only), whether or not
the limit takes plans. And a plan that charged the bucket restarted its
record (lua/keys.lua plan_restarts_give_back, marked -3, which read_record
refuses), so a tuple handed out before the plan's charge never comes back
once the plan is gone: from that tuple's instant the bucket may have risen
by the plan's refill, which the bound below does not see. lua/lease.lua
grants nothing while a plan is stored, so every tuple that may come back
after a plan's charge was handed out under the configured numbers. A
give-back answered 0 while a plan was stored, sent again once the plan is
gone without having charged the bucket, is judged as a first one, by the
bound below.

Why giving back can never over-admit. Naively adding the unspent g tokens
back (capped at the capacity C) can: the bucket refills to C while they are
out (refill a never-leased bucket would have wasted at the cap), a strict
request then takes y, and g more would leave min(C, C - y + g) where a
bucket that never leased holds C - y.

The promise is about CF, the bucket in which every token a give-back was
ever accepted for was never taken: each charged back at its grant's instant
instead of returned later. Invariant: the real bucket holds at most CF.
Accepting a tokens under the tuple (t0, L0, n) of a grant (t0 its instant,
L0 the level it left, n the give-back count then) makes CF' = CF with those
a never taken either: from t0 on they sit on top of CF, and only the cap
can cut them. So if a <= C - max of CF over [t0, now], CF'(now) = CF(now) +
a >= real + a, and from now on both buckets see the same charges and the
same refill, so the invariant holds ever after. Redis only has to bound CF
over [t0, now], from what it knows:
- At t0. CF is the real bucket with each accepted give-back moved from its
  instant back to its grant's. Moving tokens earlier raises the level in
  between by at most them, and never raises it after the give-back (the cap
  only cuts what came earlier). So right after the grant, CF exceeds L0 by
  at most S: the tokens accepted by give-backs made after it whose grants
  were not after it. Give-backs made before are in L0 already; later grants
  are not yet in CF. Within one ms, grants are ordered by their tuples:
  between two, only a give-back raises the count, and without one the later
  grant left a lower level.
- After t0, CF rises by refill alone: every charge lowers it, and a grant
  after t0 takes from CF at least what its own give-backs will return.
So max CF over [t0, now] <= M' = min(C, L0 + S + refill x (now - t0)) (in
credits: refill per ms, S in tokens x period), and giving back min(tokens,
floor((C - M') / token)) keeps the invariant; the whole-token floor, and
the cap at what the bucket can still hold, only give back less. By
induction over give-backs the real bucket never holds more than one that
never took any given-back token; spent tokens are requests a bucket that
never leased would have charged. A tuple may also cover tokens of later
grants of the same Envoy (an older filter kept its first grant's tuple for
all it held): the interval from the earlier t0 is longer and its S counts
more, so the bound is only tighter, and the entry recorded under the
earlier instant is counted by every tuple that should count it, and more.
Why not the highest level since t0 (the rule before issue 51): each grant's
cap was sound against the real levels on its own, but the real levels
already held the other give-backs, so grants judged against one peak each
took the slack the others needed (capacity 100: three grants of 10 at one
instant, 9 back at 1 s, a strict 80 at 15 s, then 5 and 5 back: 24 left
where a bucket that never leased holds 20). Why not every give-back since
t0 (the rule before that, also sound): a grant made after t0 lends CF
nothing at t0, so its give-back is no rise; with two Envoys taking turns,
counting the other's give-backs stranded tokens.

The record at KEYS[i] .. ':ret' (lua/lease.lua creates it, with the same
hash tag): the count of tokens given back, the instant it started, then one
entry per accepted give-back, oldest first: the grant's tuple (t0, level,
count then), the tokens accepted, the instant, and how many give-backs it
holds. Every give-back after a grant leaves a count above the grant's, and
the count after an entry is the record's count less the entries after it,
so S is the sum over the entries whose count after exceeds the tuple's and
whose grant was not after the tuple's. The record stays small: an entry
made OLDEST ago or more was made before every tuple that may still come
back (none is older), so none counts it and it is dropped; beyond
MAX_ENTRIES the oldest two become one (tokens summed, the earlier grant's
tuple, the later instant; its count after is the later one's), counted
whenever either part would be, so S never shrinks.
A give-back is idempotent: sent again after it ran (a late reply Webdis
0.1.9 handed to another request, a 503 after the command ran), it answers
the same figure and writes nothing. A grant's tuple is unique per bucket
(in one ms, the order above tells any two apart), so the entry holding it
is that give-back's; one a merged entry may hold (counted in S) may have
come back already, so it gives nothing back. A give-back answered 0 keeps
no entry: its bound only tightens with time (elapsed and S only grow), so
sent again it is 0 again.
The record must never start again while a tuple it does not know of may
come back: a tuple older than its start (a record lost, expired, or an
older filter's layout lease.lua replaced) gives nothing back, as does one
older than 600 s (the longest lease; the record lives 660 s after the last
grant), one whose count went backwards, and one from Redis' future (a
clock stepped back). A tuple of the very ms a record started in cannot be
told from one of the record before, were that one deleted in that ms: so
a reset must not delete the record but start it after the reset's ms (count
0, the mark, start = that ms + 1), which refuses every tuple up to then. As every key of the limiter, it assumes Redis does not
evict keys. Nothing on the strict path is touched.
]]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- @@ALGORITHMS@@

-- The oldest tuple that may come back (ms): the longest lease. The record
-- outlives every tuple that young (lua/lease.lua: 660 s after each grant).
local OLDEST = 600000
local PER_KEY = 7
-- Entries a record keeps at most (48 bytes each): a few per Envoy that
-- leases the bucket within the 600 s an entry may count.
local MAX_ENTRIES = 32
-- The record's layout mark, its second double (lua/lease.lua writes it):
-- an older filter's record held a give-back's count (>= 1) there, or
-- nothing.
local LAYOUT = -2
local HEAD = 24
local ENTRY = 48

-- The record: count, start, entries {t0, level, returned, tokens, at,
-- parts}; nil when it is not this layout.
local function read_record(s)
  if #s < HEAD or (#s - HEAD) % ENTRY ~= 0 then
    return nil
  end
  local count, mark, since = struct.unpack('<ddd', s)
  if mark ~= LAYOUT then
    return nil
  end
  local entries = {}
  for at = HEAD + 1, #s - ENTRY + 1, ENTRY do
    local e = { struct.unpack('<dddddd', s, at) }
    e[7] = nil
    entries[#entries + 1] = e
  end
  return count, since, entries
end

local function write_record(key, count, since, entries)
  local parts = { struct.pack('<ddd', count, LAYOUT, since) }
  for _, e in ipairs(entries) do
    parts[#parts + 1] = struct.pack('<dddddd', e[1], e[2], e[3], e[4], e[5], e[6])
  end
  redis.call('SET', key, table.concat(parts), 'KEEPTTL')
end

-- Whether grant a (an entry, or a tuple's t0, level, returned) was not
-- after grant b: the earlier ms, or in one ms the lower count, or the same
-- count and the higher level (see the header).
local function not_after(a0, al, an, b0, bl, bn)
  if a0 ~= b0 then
    return a0 < b0
  end
  if an ~= bn then
    return an < bn
  end
  return al >= bl
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
  local count, since, entries
  -- GET, not EXISTS: the filter's Redis user may run only the commands
  -- envoy/redis.acl grants. pcall: a key of another type is stored too.
  local okey = override_key(key)
  if rec and not (okey and redis.pcall('GET', okey)) then
    count, since, entries = read_record(rec)
  end
  if count and g.t0 >= since and now >= g.t0 and now - g.t0 < OLDEST
      and count >= g.returned then
    -- S: the entries after the grant (newest first, until the count after
    -- one is the tuple's) whose grant was not after the tuple's. Among
    -- them, this very grant's, when the call comes again: `seen`, its
    -- tokens; or 0 when a merged entry may hold it.
    local s, after, seen = 0, count, nil
    for k = #entries, 1, -1 do
      if after <= g.returned then
        break
      end
      local e = entries[k]
      if not_after(e[1], e[2], e[3], g.t0, g.level, g.returned) then
        s = s + e[4]
        if e[6] > 1 then
          seen = seen or 0
        elseif e[1] == g.t0 and e[2] == g.level and e[3] == g.returned then
          seen = e[4]
          break
        end
      end
      after = after - e[4]
    end
    local full = g.capacity * g.period
    local m = math.min(full, g.level + g.refill * (now - g.t0) + s * g.period)
    given = math.min(g.tokens, math.floor((full - m) / g.period))
    if seen then
      given = seen
    elseif given > 0 then
      local r = tb_check(key, g.capacity, g.refill, g.period, 0)
      -- r.credits <= M' by the bound, so this never cuts; kept so a
      -- bucket is never written above full whatever a caller sends.
      given = math.min(given, math.floor((r.full - r.credits) / g.period))
      if given > 0 then
        r.need = -given * g.period
        tb_charge(r)
        entries[#entries + 1] = { g.t0, g.level, g.returned, given, now, 1 }
        -- Entries made before every tuple that may still come back.
        while #entries > 0 and now - entries[1][5] >= OLDEST do
          table.remove(entries, 1)
        end
        if #entries > MAX_ENTRIES then
          local a, b = entries[1], entries[2]
          local first = not_after(a[1], a[2], a[3], b[1], b[2], b[3]) and a or b
          entries[2] = { first[1], first[2], first[3], a[4] + b[4],
                         math.max(a[5], b[5]), a[6] + b[6] }
          table.remove(entries, 1)
        end
        write_record(ck, count + given, since, entries)
      end
    end
    given = math.max(0, given)
  end
  out[i] = wire(given)
end
tb_flush()
return out
