--[[ redis-guard: the idempotency record, one request's part of lua/ratelimit.lua.

This file is not a script on its own: src/scripts.rs joins it into
lua/ratelimit.lua, so taking the lock and charging the rate limits happen in
one atomic call. lua/idempotency_complete.lua and lua/idempotency_release.lua
are the other two transitions.

KEYS     one hash per (tenant, key): s = state ("P" in progress, "C" completed),
         o = owner token, f = request fingerprint, and when completed
         st = status, h = stored headers, b = stored body; a body kept in the
         object store instead leaves b empty and sets ok = object key,
         oc = its SHA-256 (hex), ol = its length
ARGV     from ratelimit.lua: owner token, fingerprint, lock TTL (ms)
Returns  idem_check(key, owner, fingerprint, lock_ttl) -> table whose verdict
         is 1 (free: idem_acquire may take it) or 2/3/4 with the reply for
         ratelimit.lua (busy with its PTTL, completed with the stored response
         or, offloaded, its object reference, fingerprint mismatch); idem_acquire(t) writes the IN_PROGRESS record
         with the lock TTL (it expires by itself if its owner vanishes).
]]

local function idem_check(key, owner, fingerprint, lock_ttl)
  local rec = redis.call('HMGET', key, 's', 'f', 'st', 'h', 'b', 'ok', 'oc', 'ol')
  local t = { key = key, owner = owner, fingerprint = fingerprint, ttl = lock_ttl }
  if not rec[1] then
    t.verdict = 1
  elseif rec[2] ~= fingerprint then
    t.verdict = 4
    t.reply = { 4 }
  elseif rec[1] == 'C' then
    t.verdict = 3
    if rec[6] then
      t.reply = { 3, tonumber(rec[3]), rec[4], '', rec[6], rec[7], tonumber(rec[8]) }
    else
      t.reply = { 3, tonumber(rec[3]), rec[4], rec[5] }
    end
  else
    t.verdict = 2
    t.reply = { 2, math.max(1, redis.call('PTTL', key)) }
  end
  return t
end

local function idem_acquire(t)
  redis.call('HSET', t.key, 's', 'P', 'o', t.owner, 'f', t.fingerprint)
  redis.call('PEXPIRE', t.key, t.ttl)
end

