--[[ redis-guard: IN_PROGRESS -> gone (FAILED), only for the lock's owner, so a
retry of the same key runs again.

KEYS[1]  the idempotency record (see lua/idempotency.lua)
ARGV[1]  owner token of the request that took the lock
Returns  1 if the lock was released; 0 if it was not ours (expired, taken
         again, or already completed).
]]

if redis.call('HGET', KEYS[1], 'o') == ARGV[1]
    and redis.call('HGET', KEYS[1], 's') == 'P' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
