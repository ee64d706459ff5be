--[[ redis-guard: a token lease. Admits one request against a token bucket
and, in the same atomic step, hands the calling Envoy up to `lease` more
tokens to spend on its own.

KEYS[1]  the bucket's string (the same key and state as lua/ratelimit.lua's
         token bucket, so leased and strict requests share one budget)
Nonce    a call may put "~" and hex digits before ARGV[1]: it is taken out
         first (the ARGV below are what is left) and given back first in a
         table reply (README, When things fail: a reply the filter can tell
         is its own).
ARGV[1]  capacity (tokens)
ARGV[2]  refill (tokens per period)
ARGV[3]  period (ms)
ARGV[4]  cost of this request (0 <= cost <= capacity); 0 is a prefetch: no
         request rides on it, only the grant
ARGV[5]  lease: the most extra tokens to hand out (>= 1)
         Every ARGV is a whole number up to 2^53 (at least 1 but the cost);
         anything else is an error reply and nothing is written.

Returns a flat array, the layout of lua/ratelimit.lua's reply for one limit
plus the grant:
  [admitted, allowed, remaining, retry_ms, reset_ms, granted]
  admitted = allowed: 1 when the bucket held `cost` tokens (charged), else 0
             (nothing written, granted 0)
  remaining  tokens left in Redis after the charge and the grant
  retry_ms   0 when admitted; else ms until `cost` tokens are there
  reset_ms   admitted: ms until the bucket is full again (the key's TTL);
             rejected: equal to retry_ms
  granted    tokens taken for the caller beyond `cost`:
             min(lease, whole tokens left after the charge)

Why this cannot over-admit: every leased token leaves the bucket here, before
any request spends it; the Envoy only spends what it was granted, and drops
what is left when its lease ends. The price is under-admission: tokens an
Envoy holds but does not spend are lost to the others, at most `lease` per
Envoy and key at a time.

Composition: src/scripts.rs joins lua/nonce.lua, lua/wire.lua and lua/token_bucket.lua at the marker
below.
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
if #KEYS ~= 1 or #ARGV ~= 5 or not (capacity and refill and period and cost and lease)
    or cost > capacity then
  return redis.error_reply('ERR redis-guard lease: one key and five numbers')
end

local r = tb_check(KEYS[1], capacity, refill, period, cost)
if r.allowed == 0 then
  return echo({ 0, 0, wire(r.remaining), wire(r.retry), wire(r.reset), 0 })
end
local spare = math.floor((r.credits - r.need) / period)
local granted = math.min(lease, spare)
r.need = r.need + granted * period
tb_charge(r)
tb_flush()
local left = r.credits - r.need
return echo({ 1, 1, wire(math.floor(left / period)), 0,
              wire(math.ceil((r.full - left) / refill)), wire(granted) })
