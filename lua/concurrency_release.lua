--[[ redis-guard: give back one request's concurrency slots when its stream
ends in any way (response complete, client reset, upstream failure, local
reply). Sent from the Envoy's root context, so it outlives the stream, and
nobody reads its reply.

KEYS[i]  the sorted set of concurrency limit i the request may hold a slot in
         (see lua/concurrency.lua)
ARGV[1]  the request's slot id
ARGV[1+i]  the request's cost in limit i
Returns  how many of the keys held the slot. Releasing a slot that is not
         there (never taken: the decision failed before the script ran;
         already gone: its lease ended) removes nothing: the slot id is the
         request's own, so no other request's slot is ever touched.

Composition: src/scripts.rs joins lua/concurrency_slots.lua (member names)
at the marker. Small on purpose: it is sent whole (EVAL), since nobody reads
its reply to fall back on after a NOSCRIPT.
]]

-- @@ALGORITHMS@@

local slot = ARGV[1]
if cc_slot_bad(slot) or #ARGV ~= 1 + #KEYS then
  return redis.error_reply('ERR redis-guard concurrency release: slot, then cost per key')
end
-- Every cost is checked before anything is removed: Redis keeps what a
-- script wrote before an error.
for i = 1, #KEYS do
  local cost = tonumber(ARGV[1 + i])
  if cost == nil or cost < 1 or cost > 1000 or cost ~= math.floor(cost) then
    return redis.error_reply('ERR redis-guard concurrency release: cost must be a whole number from 1 to 1000')
  end
end
local released = 0
for i, key in ipairs(KEYS) do
  local members = cc_members(slot, tonumber(ARGV[1 + i]))
  if redis.call('ZREM', key, unpack(members)) > 0 then
    released = released + 1
  end
end
return released
