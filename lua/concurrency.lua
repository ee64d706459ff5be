--[[ redis-guard: concurrency limit, one limit's part of lua/ratelimit.lua and
lua/batch.lua: at most `max` requests of one descriptor in flight at once,
across every Envoy.

This file is not a script on its own: src/scripts.rs joins it, after
lua/concurrency_slots.lua, between the clock preamble and the driver
(lua/decide.lua), which calls it once per concurrency limit.

KEYS     one sorted set per limit: a member per slot held, scored by the end
         of its lease (ms on Redis' clock). A request of cost 1 holds the
         member "<slot>", one of cost k > 1 the members "<slot>:1" ..
         "<slot>:k".
ARGV     the limit's group in ratelimit.lua: "cc", max (slots, <= 2^20),
         lease (ms, <= 2^32), slot (the request's slot id: 1 to 32 of
         [0-9a-f], unique per request among every Envoy), cost (1 <= cost
         <= 1000), enforce
Returns  cc_check(key, max, lease, slot, cost) -> verdict table with allowed
         (0/1), remaining (slots free after this request), retry (ms),
         reset (0: see below); cc_charge(verdict) takes the slots.
Reads    `now` (ms, from Redis TIME) set by the preamble.

A slot is taken here, in the request's decision (all or nothing with its
other limits), and given back by lua/concurrency_release.lua when the
request's stream ends in any way. An Envoy renews the lease of a request
still running (lua/concurrency_renew.lua) well before it ends, so a slot
outlives its lease only while its Envoy is alive: a slot whose Envoy died
is free again when its lease ends. A member whose score is at or before
`now` is such a dead slot: it is not counted, and the next charge prunes it.

Capacity comes back when a request finishes, not with time, so there is no
time at which the limit is known to be whole again: reset is 0, and a
rejection's retry is CC_RETRY_MS, the shortest Retry-After HTTP can say
(1 s). The filter never caches a concurrency rejection for the same reason.

A clock that steps back makes every lease look longer by the step: slots are
held back (never over-admitted) until the clock catches up, or the holders
release them. The key's expiry is only ever pushed later (see cc_charge),
so it never ends before the last lease in it.

TTL: the lease plus CC_EDGE_MS, extended by every charge and renewal: the
set is empty of live slots once its last lease ends.
]]

local CC_RETRY_MS = 1000

local function cc_check(key, max, lease, slot, cost)
  local live = redis.call('ZCOUNT', key, '(' .. string.format('%d', now), '+inf')
  local r = { key = key, slot = slot, cost = cost, lease = lease, reset = 0 }
  if live + cost <= max then
    r.allowed = 1
    r.remaining = max - live - cost
    r.retry = 0
  else
    r.allowed = 0
    r.remaining = math.max(0, max - live)
    r.retry = CC_RETRY_MS
  end
  return r
end

local function cc_charge(r)
  local ends = string.format('%d', now + r.lease)
  redis.call('ZREMRANGEBYSCORE', r.key, '-inf', string.format('%d', now))
  -- Config caps the cost at 1000; ZADD in chunks, since unpack() has a
  -- small stack limit.
  local args = {}
  for _, member in ipairs(cc_members(r.slot, r.cost)) do
    args[#args + 1] = ends
    args[#args + 1] = member
    if #args == 200 then
      redis.call('ZADD', r.key, unpack(args))
      args = {}
    end
  end
  if #args > 0 then
    redis.call('ZADD', r.key, unpack(args))
  end
  cc_expire_at_least(r.key, r.lease + CC_EDGE_MS)
end
