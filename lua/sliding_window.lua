--[[ redis-guard: sliding-window log, one limit's part of lua/ratelimit.lua.

This file is not a script on its own: src/scripts.rs joins it between the
clock preamble and the driver of ratelimit.lua, which calls it once per
sliding-window limit.

KEYS     one sorted set per window: a member per admitted unit, scored by its
         admission time in ms
ARGV     the limit's group in ratelimit.lua: "sw", limit, window (ms), 0, cost,
         enforce
Returns  sw_check(key, limit, window, cost) -> verdict table with allowed (0/1),
         remaining, retry (ms), reset (ms: until the newest member leaves);
         sw_charge(verdict) prunes the members out of the window, adds the
         request's and sets the key's PEXPIRE.
Reads    `now` (ms, from Redis TIME) set by the preamble.

sw_check only reads (ZCOUNT over the window, not ZCARD after a prune): the
operator's read-only inspection (lua/inspect.lua, flagged no-writes) runs it
too. Members older than the window are pruned by the next charge, and the
key's TTL drops the whole set one window after its newest member.
]]

-- Sliding-window log: one member per admitted unit, scored by its admission
-- time in ms. The window is (now - window, now].
local function sw_check(key, limit, window, cost)
  local oldest = '(' .. string.format('%d', now - window)
  local count = redis.call('ZCOUNT', key, oldest, '+inf')
  local r = { key = key, count = count, cost = cost, window = window }
  -- The newest member's stamp: members are numbered after it, and the window
  -- is fully restored once it leaves. A newest member out of the window
  -- (not yet pruned) is older than `now` and changes neither.
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
    local m = redis.call('ZRANGE', key, oldest, '+inf', 'BYSCORE', 'LIMIT', k - 1, 1,
                         'WITHSCORES')
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
  redis.call('ZREMRANGEBYSCORE', r.key, '-inf', string.format('%d', now - r.window))
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
  -- Config caps the cost at 1000 units; ZADD in chunks all the same, since
  -- unpack() has a small stack limit.
  local args = {}
  for i = 0, r.cost - 1 do
    args[#args + 1] = stamp
    args[#args + 1] = string.format('%d:%012d', stamp, seq + i)
    if #args == 200 then
      redis.call('ZADD', r.key, unpack(args))
      args = {}
    end
  end
  if #args > 0 then
    redis.call('ZADD', r.key, unpack(args))
  end
  redis.call('PEXPIRE', r.key, r.window + (stamp - now))
end

