--[[ redis-guard: an operator forgets one idempotency record
(`redis-guard idempotency forget`), so the key runs again.

KEYS[1]  the record (see lua/idempotency.lua)
ARGV[1]  "1" to forget a record IN_PROGRESS as well, else "0"
Returns  1 forgotten, 0 no such record, -1 refused: IN_PROGRESS, not forced

One script, so the state read and the DEL are one step: a request that
completes the record in between cannot be deleted unseen, and a forced
forget of a lock makes its owner's completion a no-op
(lua/idempotency_complete.lua checks the owner) instead of a record
written under a key the operator just freed. A body in the object store is
left to the bucket's lifecycle rule, as for a record that expires.
]]

local s = redis.call('HGET', KEYS[1], 's')
if not s then
  return 0
end
if s == 'P' and ARGV[1] ~= '1' then
  return -1
end
redis.call('DEL', KEYS[1])
return 1
