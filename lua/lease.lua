--[[ redis-guard: a token lease. Admits one request against a token bucket
and, in the same atomic step, hands the calling Envoy up to `lease` more
tokens to spend on its own.

KEYS[1]  the bucket's string (the same key and state as lua/ratelimit.lua's
         token bucket, so leased and strict requests share one budget)
Nonce    a call may put "~" and hex digits before ARGV[1]: it is taken out
         first (the ARGV below are what is left) and given back first in a
         table reply (docs/src/running/failures.md: a reply the filter can tell
         is its own).
ARGV[1]  capacity (tokens)
ARGV[2]  refill (tokens per period)
ARGV[3]  period (ms)
ARGV[4]  cost of this request (0 <= cost <= capacity); 0 is a prefetch: no
         request rides on it, only the grant
ARGV[5]  lease: the most extra tokens to hand out (>= 1)
         Every ARGV is a whole number up to 2^53 (at least 1 but the cost);
         anything else is an error reply and nothing is written.
ARGV[6]  optional, "o": the limit takes stored plans (overrides.redis). A
         key with anything stored at its override key (lua/keys.lua
         override_key) gets no grant: its request is decided as
         lua/decide.lua's token bucket decides it, under the plan's capacity
         and refill when one applies (else the configured ones), and nothing
         more is taken. A give-back's bound (lua/lease_return.lua) holds for
         one capacity and refill only, so leased tokens are for keys the
         configured numbers decide; lease_return.lua takes nothing back
         while a plan is stored, and a plan that charged the bucket restarts
         its give-back record (lua/keys.lua plan_restarts_give_back).

Returns a flat array, the layout of lua/ratelimit.lua's reply for one limit
plus the grant and what the Envoy keeps to give tokens back
(lua/lease_return.lua):
  [admitted, allowed, remaining, retry_ms, reset_ms, granted,
   now_ms, level, returned]
  admitted   1 when the bucket held `cost` tokens (charged), else 0
             (nothing written, granted 0)
  allowed    admitted, plus 2 when a stored plan decided it, 4 when one is
             stored but ignored (lua/decide.lua's verdict); with 2 the reply
             has two more integers after `returned`: the plan's capacity and
             refill (as decide.lua states a plan after its verdicts)
  remaining  tokens left in Redis after the charge and the grant
  retry_ms   0 when admitted; else ms until `cost` tokens are there
  reset_ms   admitted: ms until the bucket is full again (the key's TTL);
             rejected: equal to retry_ms
  granted    tokens taken for the caller beyond `cost`:
             min(lease, floor(whole tokens left after the charge / SHARE))
  now_ms     Redis' clock at the grant (0 when nothing is granted)
  level      the bucket's credits after the grant (credits: one token is
             `period` credits), rounded up (0 when nothing is granted)
  returned   the bucket's give-back count (tokens given back since its
             give-back record started, kept at KEYS[1] .. ':ret' by
             lua/lease_return.lua) at the grant (0 when nothing is granted)

Adaptive sizing. A grant takes at most 1/SHARE of the whole tokens the
charge leaves. Mid-bucket a grant is the full `lease` (one call buys many
requests); as the bucket empties grants shrink, and once fewer than SHARE
tokens are left they are 0: every request is decided here, one token at a
time, exactly as the strict bucket would. SHARE = 4: each grant leaves at
least 3/4 of the remainder in Redis, so however many Envoys fetch in turn,
the tokens they hold together are a bounded share of what they took from
(k grants in a row leave (3/4)^k, and every Envoy gives back what it does
not spend); 8 would halve the grants mid-bucket (twice the calls) for a
shortfall that give-back already bounds.

Why this cannot over-admit: every leased token leaves the bucket here, before
any request spends it; the Envoy only spends what it was granted, and gives
back (lua/lease_return.lua) only what the bucket would still hold had those
tokens never left: see that script's header for the proof. The price is
under-admission bounded by the tokens actually in flight: held by an Envoy
that still spends them, on their way back, or lost with a give-back that
failed.

Composition: src/scripts.rs joins lua/nonce.lua, lua/wire.lua,
lua/token_bucket.lua and lua/keys.lua at the marker below.
Clock: Redis TIME, read once.
]]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- @@ALGORITHMS@@

-- Whole numbers up to 2^53 only: Redis' tonumber() also takes "nan", "inf",
-- fractions and negatives, any of which would corrupt the bucket.
local function whole(v, least)
  local x = tonumber(v)
  if x and x == math.floor(x) and x >= least and x <= 9007199254740992 then
    return x
  end
  return nil
end

local capacity = whole(ARGV[1], 1)
local refill = whole(ARGV[2], 1)
local period = whole(ARGV[3], 1)
local cost = whole(ARGV[4], 0)
local lease = whole(ARGV[5], 1)
local plans = ARGV[6] == 'o'
if #KEYS ~= 1 or not (#ARGV == 5 or (#ARGV == 6 and plans))
    or not (capacity and refill and period and cost and lease)
    or cost > capacity then
  return redis.error_reply('ERR redis-guard lease: one key and five numbers')
end

-- A stored plan, read as lua/decide.lua reads it: applied when it parses and
-- leaves room for the cost (used 2), else ignored (4). Either way no grant.
-- pcall: a key of another type written by hand is an ignored plan.
local used = 0
if plans then
  local okey = override_key(KEYS[1])
  local text = okey and redis.pcall('GET', okey)
  if type(text) == 'table' then
    used = 4
  elseif text then
    local x, y = override_figures(text, 'tb', period)
    if x and x >= cost then
      capacity, refill, used = x, y, 2
    else
      used = 4
    end
  end
  if used ~= 0 then
    lease = 0
  end
end
-- The plan's figures after the verdict, as decide.lua states them.
local function planned(out)
  if used == 2 then
    out[#out + 1] = wire(capacity)
    out[#out + 1] = wire(refill)
  end
  return echo(out)
end

-- See the header: each grant at most 1/SHARE of what the charge leaves.
local SHARE = 4
-- The give-back counter lives this long after the last grant (ms): longer
-- than the longest lease (600 s, src/config/limit.rs) by a minute, so it
-- never expires, nor starts again at 0, while a tuple handed out here may
-- still come back (lua/lease_return.lua takes none older than 600 s).
local RETURNED_TTL = 660000
-- The give-back record's layout mark (lua/lease_return.lua).
local LAYOUT = -2

local r = tb_check(KEYS[1], capacity, refill, period, cost)
if r.allowed == 0 then
  return planned({ 0, used, wire(r.remaining), wire(r.retry), wire(r.reset), 0, 0, 0, 0 })
end
local spare = math.floor((r.credits - r.need) / period)
local granted = math.min(lease, math.floor(spare / SHARE))
r.need = r.need + granted * period
tb_charge(r)
tb_flush()
if used == 2 then
  plan_restarts_give_back(KEYS[1])
end
local left = r.credits - r.need
local at, level, returned = 0, 0, 0
if granted > 0 then
  -- The give-back record (lua/lease_return.lua's layout): the count first,
  -- a little-endian double, then its layout mark and the instant it
  -- started. Created here, so it exists from the first grant on, and its
  -- TTL renewed by every grant. A record of another layout (an older
  -- filter's) starts again at 0: the give-backs it held are not in this
  -- layout, and its start refuses every tuple handed out before.
  local ck = KEYS[1] .. ':ret'
  local rec = redis.call('GET', ck)
  local mark = nil
  if rec and #rec >= 24 and (#rec - 24) % 48 == 0 then
    returned, mark = struct.unpack('<dd', rec)
  end
  if mark == LAYOUT then
    redis.call('PEXPIRE', ck, RETURNED_TTL)
  elseif mark == -3 then
    -- Restarted by a plan (lua/keys.lua): a record again, from the instant
    -- after the plan's charge, so every tuple before it stays refused.
    local _, _, since = struct.unpack('<ddd', rec)
    returned = 0
    redis.call('SET', ck, struct.pack('<ddd', 0, LAYOUT, since), 'PX', RETURNED_TTL)
  else
    returned = 0
    redis.call('SET', ck, struct.pack('<ddd', 0, LAYOUT, now), 'PX', RETURNED_TTL)
  end
  at, level = now, math.ceil(left)
end
return planned({ 1, 1 + used, wire(math.floor(left / period)), 0,
                 wire(math.ceil((r.full - left) / refill)), wire(granted),
                 wire(at), wire(level), wire(returned) })
