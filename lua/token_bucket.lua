--[[ redis-guard: token bucket, one limit's part of lua/ratelimit.lua.

This file is not a script on its own: src/scripts.rs joins it between the
clock preamble and the driver of ratelimit.lua, which calls it once per
token-bucket limit.

KEYS     one hash per bucket: c = credits left, t = ms of the last update
ARGV     the limit's group in ratelimit.lua: "tb", capacity, refill (tokens per
         period), period (ms), cost, enforce
Returns  tb_check(key, capacity, refill, period, cost) -> verdict table with
         allowed (0/1), remaining, retry (ms), reset (ms: time until full);
         tb_charge(verdict) charges it; tb_flush() writes every charged
         bucket's hash and PEXPIRE, once per key. The driver calls tb_flush()
         before it returns.
Reads    `now` (ms, from Redis TIME) set by the preamble.
]]

-- Token bucket, exact integer arithmetic: one token is `period` credits, and
-- every elapsed millisecond adds `refill` credits. Config validation keeps
-- capacity * period below 2^53 so the doubles stay exact.
-- Buckets this script run has read or charged, by key: a batch decides many
-- requests of one key, and reads and writes that key once instead of once per
-- request. Nothing else runs while a script does, and every charge of one
-- run is stamped with the same `now`, so the last charge's state is exactly
-- what the sequence of writes would have left.
local tb_seen = {}
local tb_charged = {}

local function tb_check(key, capacity, refill, period, cost)
  local full = capacity * period
  local seen = tb_seen[key]
  if seen == nil then
    local state = redis.call('HMGET', key, 'c', 't')
    seen = { c = tonumber(state[1]), t = tonumber(state[2]) }
    tb_seen[key] = seen
  end
  local credits = seen.c
  local last = seen.t
  if credits == nil or last == nil then
    credits = full
  elseif now > last then
    credits = math.min(full, credits + (now - last) * refill)
  else
    -- Same millisecond, or Redis' clock stepped back (failover): no refill.
    credits = math.min(full, credits)
  end
  local need = cost * period
  local r = { key = key, credits = credits, need = need, full = full,
              refill = refill, period = period }
  if credits >= need then
    r.allowed = 1
    r.remaining = math.floor((credits - need) / period)
    r.retry = 0
    r.reset = math.ceil((full - (credits - need)) / refill)
  else
    r.allowed = 0
    -- Credits below zero are a settled usage cost's debt (lua/settle.lua).
    r.remaining = math.max(0, math.floor(credits / period))
    r.retry = math.ceil((need - credits) / refill)
    r.reset = r.retry
  end
  return r
end

local function tb_charge(r)
  local left = r.credits - r.need
  if tb_seen[r.key].charged == nil then
    tb_charged[#tb_charged + 1] = r.key
  end
  -- Once full again the state equals a missing key, so it may vanish then.
  tb_seen[r.key] = { c = left, t = now, charged = true,
                     ttl = math.max(1, math.ceil((r.full - left) / r.refill)) }
end

local function tb_flush()
  for _, key in ipairs(tb_charged) do
    local s = tb_seen[key]
    redis.call('HSET', key, 'c', string.format('%d', s.c), 't', string.format('%d', now))
    redis.call('PEXPIRE', key, s.ttl)
  end
  tb_charged = {}
end

