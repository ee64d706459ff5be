--[[ redis-guard: IN_PROGRESS -> COMPLETED, only for the lock's owner.

KEYS[1]  the idempotency record (see lua/idempotency.lua)
ARGV[1]  owner token of the request that took the lock
ARGV[2]  response status
ARGV[3]  stored response headers (the filter's encoding)
ARGV[4]  stored response body
ARGV[5]  record TTL (ms): how long retries are answered from the record
ARGV[6]  optional: the object key, when the body went to the object store
         (ARGV[4] is then empty), with ARGV[7] its SHA-256 (hex) and ARGV[8]
         its length; the object is uploaded before this runs, so a COMPLETED
         record never points at an object that was not stored
Returns  1 if the record was written; 0 if the lock is gone or another
         request's (it expired and was taken again): the response is then not
         stored, and that other request's outcome stands.
]]

if redis.call('HGET', KEYS[1], 'o') ~= ARGV[1]
    or redis.call('HGET', KEYS[1], 's') ~= 'P' then
  return 0
end
redis.call('HSET', KEYS[1], 's', 'C', 'st', ARGV[2], 'h', ARGV[3], 'b', ARGV[4])
if ARGV[6] then
  redis.call('HSET', KEYS[1], 'ok', ARGV[6], 'oc', ARGV[7], 'ol', ARGV[8])
end
redis.call('HDEL', KEYS[1], 'o')
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
