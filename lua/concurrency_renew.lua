--[[ redis-guard: renew the leases of one request's concurrency slots, sent
by the Envoy that holds them while the request still runs (long downloads,
server-sent events, WebSockets), well before the leases end.

KEYS[i]  the sorted set of concurrency limit i the request holds a slot in
         (see lua/concurrency.lua); one hash tag for all, as in the decision
ARGV[1]  the request's slot id
ARGV[2i], ARGV[2i+1]  limit i's lease (ms) and the request's cost in it
Returns  one integer per key, in KEYS order: 1 if the slot was still held
         and its lease now ends `lease` ms from now; 0 if it was gone (its
         lease ran out first: the Envoy was cut off from Redis for longer
         than the lease), in which case nothing is written: re-adding it
         could exceed the limit, since others may hold the freed slot now.

Composition: src/scripts.rs joins lua/concurrency_slots.lua (member names,
expiry rule) at the marker. Clock: Redis TIME, as in the decision.
]]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- @@ALGORITHMS@@

local slot = ARGV[1]
if cc_slot_bad(slot) or #ARGV ~= 1 + 2 * #KEYS then
  return redis.error_reply('ERR redis-guard concurrency renew: slot, then lease and cost per key')
end
-- Every number is checked before anything is written: Redis keeps what a
-- script wrote before an error.
for i = 1, #KEYS do
  local lease = tonumber(ARGV[2 * i])
  local cost = tonumber(ARGV[2 * i + 1])
  if lease == nil or cost == nil or lease < 1 or lease > 2^32 or lease ~= math.floor(lease)
      or cost < 1 or cost > 1000 or cost ~= math.floor(cost) then
    return redis.error_reply('ERR redis-guard concurrency renew: lease and cost must be whole numbers in range')
  end
end
local out = {}
for i, key in ipairs(KEYS) do
  local lease = tonumber(ARGV[2 * i])
  local cost = tonumber(ARGV[2 * i + 1])
  local members = cc_members(slot, cost)
  local held = redis.call('ZMSCORE', key, unpack(members))
  local live = false
  for _, score in ipairs(held) do
    if score and tonumber(score) > now then
      live = true
    end
  end
  if live then
    local ends = string.format('%d', now + lease)
    for _, member in ipairs(members) do
      redis.call('ZADD', key, 'XX', ends, member)
    end
    cc_expire_at_least(key, lease + CC_EDGE_MS)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
