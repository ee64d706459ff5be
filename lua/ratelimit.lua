--[[ redis-guard: decide every rate limit that matches one request, all or nothing.

KEYS[i]  state key of limit i. The filter gives every key of one call the same
         Redis Cluster hash tag, so the whole call runs on one slot.
ARGV[1]  N, the number of limits (must equal #KEYS)
ARGV per limit i, six values starting at 2 + (i-1)*6:
  algorithm  "tb" (token bucket, one hash) or "sw" (sliding-window log, one sorted set)
  a          tb: capacity (tokens)          sw: limit (requests per window)
  b          tb: refill (tokens per period) sw: window (ms)
  c          tb: period (ms)                sw: ignored (0)
  cost       units this request spends (1 <= cost <= capacity or limit)
  enforce    "1": a rejection rejects the request; "0": shadow, reported only

Returns a flat array (Webdis' raw output cannot carry nested arrays):
  [1]          1 if the request is admitted, 0 if any enforced limit rejects it
  then 4 integers per limit, in KEYS order:
    allowed    1 if this limit alone would admit the request
    remaining  units left after this request (after the charge, if charged)
    retry_ms   0 when allowed; otherwise ms until this limit could admit it
    reset_ms   allowed: ms until the limit is fully restored (for the token
               bucket: full again; for the window: its newest member gone),
               which is also the key's TTL after a charge;
               rejected: equal to retry_ms, so Retry-After and the reset agree

All-or-nothing: nothing is written unless every enforced limit admits the
request, so a rejected request costs nothing. Then every limit that admits it
is charged (a shadow limit that would reject is reported, not charged).

Clock: Redis TIME, read once; the proxies' clocks are never used, so every
Envoy instance sees one time line. Every key written gets a PEXPIRE equal to
the time after which its state is indistinguishable from a fresh key.
]]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local n = tonumber(ARGV[1])
if n == nil or n ~= #KEYS then
  return redis.error_reply('ERR redis-guard ratelimit: ARGV[1] must equal #KEYS')
end

-- Token bucket, exact integer arithmetic: one token is `period` credits, and
-- every elapsed millisecond adds `refill` credits. Config validation keeps
-- capacity * period below 2^53 so the doubles stay exact.
local function tb_check(key, capacity, refill, period, cost)
  local full = capacity * period
  local state = redis.call('HMGET', key, 'c', 't')
  local credits = tonumber(state[1])
  local last = tonumber(state[2])
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
    r.remaining = math.floor(credits / period)
    r.retry = math.ceil((need - credits) / refill)
    r.reset = r.retry
  end
  return r
end

local function tb_charge(r)
  local left = r.credits - r.need
  redis.call('HSET', r.key, 'c', string.format('%d', left), 't', string.format('%d', now))
  -- Once full again the state equals a missing key, so it may vanish then.
  redis.call('PEXPIRE', r.key, math.max(1, math.ceil((r.full - left) / r.refill)))
end

-- Sliding-window log: one member per admitted unit, scored by its admission
-- time in ms. The window is (now - window, now]; older members are pruned.
local function sw_check(key, limit, window, cost)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  local count = redis.call('ZCARD', key)
  local r = { key = key, count = count, cost = cost, window = window }
  -- The newest member's stamp: members are numbered after it, and the window
  -- is fully restored once it leaves.
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  r.newest_member = newest[1]
  r.newest = tonumber(newest[2])
  if count + cost <= limit then
    r.allowed = 1
    r.remaining = limit - count - cost
    r.retry = 0
    -- After the charge the newest member is this request's.
    r.reset = window + math.max(0, (r.newest or now) - now)
  else
    r.allowed = 0
    r.remaining = math.max(0, limit - count)
    -- The (count + cost - limit)-th oldest member must leave the window first.
    local k = count + cost - limit
    local m = redis.call('ZRANGE', key, k - 1, k - 1, 'WITHSCORES')
    if m[2] then
      r.retry = math.max(1, tonumber(m[2]) + window - now)
    else
      r.retry = window
    end
    r.reset = r.retry
  end
  return r
end

local function sw_charge(r)
  -- Members must be unique or same-millisecond requests would collapse into
  -- one. Number them after the newest member; a clock that stepped back keeps
  -- the newest stamp so the log stays ordered.
  -- The sequence is zero-padded: members of one score sort as strings, so
  -- the newest member must also be the highest-numbered one.
  local stamp = now
  local seq = 0
  if r.newest and r.newest >= stamp then
    stamp = r.newest
    seq = (tonumber(string.match(r.newest_member, ':(%d+)$')) or 0) + 1
  end
  local args = {}
  for i = 0, r.cost - 1 do
    args[#args + 1] = stamp
    args[#args + 1] = string.format('%d:%012d', stamp, seq + i)
  end
  redis.call('ZADD', r.key, unpack(args))
  redis.call('PEXPIRE', r.key, r.window + (stamp - now))
end

local results = {}
local admit = 1
for i = 1, n do
  local base = 2 + (i - 1) * 6
  local alg = ARGV[base]
  local a = tonumber(ARGV[base + 1])
  local b = tonumber(ARGV[base + 2])
  local c = tonumber(ARGV[base + 3])
  local cost = tonumber(ARGV[base + 4])
  local enforce = ARGV[base + 5] == '1'
  local r
  if alg == 'tb' then
    r = tb_check(KEYS[i], a, b, c, cost)
  elseif alg == 'sw' then
    r = sw_check(KEYS[i], a, b, cost)
  else
    return redis.error_reply('ERR redis-guard ratelimit: unknown algorithm')
  end
  r.alg = alg
  if enforce and r.allowed == 0 then
    admit = 0
  end
  results[i] = r
end

local out = { admit }
for i = 1, n do
  local r = results[i]
  if admit == 1 and r.allowed == 1 then
    if r.alg == 'tb' then tb_charge(r) else sw_charge(r) end
  elseif r.allowed == 1 then
    -- Not charged: report the budget as it stands.
    if r.alg == 'tb' then
      r.remaining = math.floor(r.credits / r.period)
      r.reset = math.ceil((r.full - r.credits) / r.refill)
    else
      r.remaining = r.remaining + r.cost
      if r.newest then
        r.reset = math.max(0, r.newest + r.window - now)
      else
        r.reset = 0
      end
    end
  end
  out[#out + 1] = r.allowed
  out[#out + 1] = r.remaining
  out[#out + 1] = r.retry
  out[#out + 1] = r.reset
end
return out
