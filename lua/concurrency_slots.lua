--[[ redis-guard: concurrency slots, the part the decision
(lua/concurrency.lua), the renewal (lua/concurrency_renew.lua) and the
release (lua/concurrency_release.lua) share: how a slot is named in its
sorted set, and how long the set lives.

This file is not a script on its own: src/scripts.rs joins it into each of
those scripts. A slot id is 1 to 32 of [0-9a-f], unique per request among
every Envoy; a request of cost 1 holds the member "<slot>", one of cost k > 1
the members "<slot>:1" .. "<slot>:k".
]]

-- Redis 7.2 and later count a PX inside a script from the script's start, up
-- to a ms before the TIME this script read: without a margin the key could
-- vanish (freeing every slot) a ms before its newest lease ends.
local CC_EDGE_MS = 2

-- The members a slot of `cost` units holds.
local function cc_members(slot, cost)
  if cost == 1 then
    return { slot }
  end
  local m = {}
  for j = 1, cost do
    m[j] = slot .. ':' .. j
  end
  return m
end

-- Pushes the key's expiry out to `ms` from now, never earlier than it was:
-- a lease written before a clock stepped back may end later than this one.
local function cc_expire_at_least(key, ms)
  local ttl = redis.call('PTTL', key)
  if ttl < ms then
    redis.call('PEXPIRE', key, ms)
  end
end

-- The driver's check of the slot argument: the member names must stay short
-- and must not carry the ':' that separates a slot from its unit number.
local function cc_slot_bad(slot)
  return type(slot) ~= 'string' or not string.match(slot, '^[0-9a-f]+$')
      or #slot > 32
end
