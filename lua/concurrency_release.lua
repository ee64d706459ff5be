--[[ redis-guard: give back concurrency slots of requests whose streams ended
in any way (response complete, client reset, upstream failure, local
reply). An Envoy worker's root context gathers the releases of its streams
and sends them together, one call per hash tag at most every millisecond, so
the release outlives the stream and costs a fraction of a call per request.

KEYS[i]    the sorted set of a concurrency limit (see lua/concurrency.lua);
           one hash tag for all, as the filter groups them
ARGV[2i-1], ARGV[2i]  the slot id of the request that may hold a slot in
           KEYS[i], and its cost in that limit (a key may appear once per
           request)
Returns  how many of the (key, slot) pairs held their slot. Releasing a slot
         that is not there (never taken: the decision failed before the
         script ran; already gone: its lease ended) removes nothing: a slot id
         is its request's own, so no other request's slot is ever touched.

Composition: src/scripts.rs joins lua/concurrency_slots.lua (member names)
at the marker.
]]

-- @@ALGORITHMS@@

-- Every pair is checked before anything is removed: Redis keeps what a
-- script wrote before an error.
if #ARGV ~= 2 * #KEYS then
  return redis.error_reply('ERR redis-guard concurrency release: a slot and a cost per key')
end
for i = 1, #KEYS do
  local cost = tonumber(ARGV[2 * i])
  if cc_slot_bad(ARGV[2 * i - 1]) then
    return redis.error_reply('ERR redis-guard concurrency release: bad slot id')
  end
  if cost == nil or cost < 1 or cost > 1000 or cost ~= math.floor(cost) then
    return redis.error_reply('ERR redis-guard concurrency release: cost must be a whole number from 1 to 1000')
  end
end
local released = 0
for i, key in ipairs(KEYS) do
  local members = cc_members(ARGV[2 * i - 1], tonumber(ARGV[2 * i]))
  if redis.call('ZREM', key, unpack(members)) > 0 then
    released = released + 1
  end
end
return released
