--[[ redis-guard: token bucket, one limit's part of lua/ratelimit.lua.

This file is not a script on its own: src/scripts.rs joins it between the
clock preamble and the driver of ratelimit.lua, which calls it once per
token-bucket limit.

KEYS     one string per bucket: credits left and the ms of the last update,
         two little-endian doubles (struct '<dd', 16 bytes). One GET reads
         it and one SET ... PX writes it with its TTL: a hash took HMGET,
         HSET and PEXPIRE, and two number formats, about 1 us more per
         decision on Redis' one thread (BENCHMARKS.md). The limit's key
         signature is `tb2.` (src/config/limit.rs), so this layout never
         meets a hash an older filter wrote under `tb.`.
ARGV     the limit's group in ratelimit.lua: "tb", capacity, refill (tokens per
         period), period (ms), cost, enforce
Returns  tb_check(key, capacity, refill, period, cost) -> verdict table with
         allowed (0/1), remaining, retry (ms), reset (ms: time until full);
         tb_charge(verdict) charges it; tb_flush() writes every charged
         bucket's string with its PX, once per key. The driver calls tb_flush()
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

-- The key a filter before the one-string layout kept this bucket under, as
-- a hash: its signature `tb.` where this one has `tb2.`; nil for a key not in
-- the filter's layout (`<prefix>:rl:{<tag>}:<name>:<signature>:...`, names
-- hold no `:`, lua/keys.lua). During a rolling upgrade a missing string is
-- read from that hash, so a bucket an older Envoy spent is not full again
-- for the new ones (a day's quota would start over at the upgrade). Only
-- read, never written: each side then charges its own key until the older
-- Envoys are gone, and the hash expires when it would be full.
local function tb_hash_key(key)
  local s = string.find(key, '}:', 1, true)
  if s == nil then return nil end
  local n = string.find(key, ':', s + 2, true)
  if n == nil or string.sub(key, n + 1, n + 4) ~= 'tb2.' then return nil end
  return string.sub(key, 1, n) .. 'tb.' .. string.sub(key, n + 5)
end

-- A bucket's state as this run knows it: read (and remembered) at its
-- first use.
local function tb_read(key)
  local seen = tb_seen[key]
  if seen == nil then
    local state = redis.call('GET', key)
    if state and #state == 16 then
      local c, t = struct.unpack('<dd', state)
      seen = { c = c, t = t }
    elseif state then
      -- Not a string this layout writes: as a missing bucket (full), as a
      -- hash with unreadable fields was before it.
      seen = {}
    else
      -- PTTL first: on a missing key it answers without the table HMGET
      -- builds, at half the cost, and a missing hash is the common case
      -- (a bucket's key vanishes once it is full).
      local old = tb_hash_key(key)
      if old and redis.call('PTTL', old) ~= -2 then
        local h = redis.call('HMGET', old, 'c', 't')
        seen = { c = tonumber(h[1]), t = tonumber(h[2]) }
      else
        seen = {}
      end
    end
    tb_seen[key] = seen
  end
  return seen
end

local function tb_check(key, capacity, refill, period, cost)
  local full = capacity * period
  local seen = tb_read(key)
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

-- tb_check() and, when it admits, tb_charge() in one, without the verdict
-- table (lua/decide.lua lone_bucket()): the same arithmetic and state.
-- Returns allowed, remaining, retry, reset.
local function tb_take(key, capacity, refill, period, cost)
  local full = capacity * period
  local seen = tb_read(key)
  local credits = seen.c
  local last = seen.t
  if credits == nil or last == nil then
    credits = full
  elseif now > last then
    credits = math.min(full, credits + (now - last) * refill)
  else
    credits = math.min(full, credits)
  end
  local need = cost * period
  if credits >= need then
    local left = credits - need
    if seen.charged == nil then
      tb_charged[#tb_charged + 1] = key
    end
    local reset = math.ceil((full - left) / refill)
    tb_seen[key] = { c = left, t = now, charged = true, ttl = math.max(1, reset) }
    return 1, math.floor(left / period), 0, reset
  end
  local retry = math.ceil((need - credits) / refill)
  return 0, math.max(0, math.floor(credits / period)), retry, retry
end

local function tb_flush()
  for _, key in ipairs(tb_charged) do
    local s = tb_seen[key]
    redis.call('SET', key, struct.pack('<dd', s.c, now), 'PX', s.ttl)
  end
  tb_charged = {}
end

