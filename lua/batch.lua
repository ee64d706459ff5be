--[[ redis-guard: decide a batch of requests in one call, one after another in
the order given, each exactly as its own call to lua/ratelimit.lua would have
been decided at that point (group commit).

ARGV[1]  M, the number of members
ARGV per member j, two values starting at 2 + (j-1)*2:
  nkeys    how many of KEYS are this member's (in order after the previous
           members')
  nargs    how many of ARGV after the header are this member's
ARGV[2 + 2M ...]  the members' ARGV, one after another, each in the layout of
                  lua/ratelimit.lua
KEYS     the members' KEYS, one after another. The filter batches only
         requests of one Redis Cluster hash tag, so the call runs on one slot.

Returns a flat array (Webdis' raw output cannot carry nested arrays):
  [1]  M
  then per member, in order: the length L of its reply, then its L values:
       the reply lua/ratelimit.lua documents.

Each member's decision reads what the members before it wrote, and a
rejected member writes nothing, so a batch admits exactly what the same
calls sent one by one in this order would. A malformed member makes the
whole batch an error: the filter built it, so it is a bug, not a verdict.

Composition: src/scripts.rs joins lua/wire.lua, lua/token_bucket.lua, lua/sliding_window.lua,
lua/gcra.lua, lua/fixed_window.lua, lua/sliding_window_counter.lua,
lua/concurrency.lua, lua/idempotency.lua and lua/decide.lua (the one-request driver) at the
marker. The kinds that keep a per-run cache write each charged key once, in
flush_all() after the last member: however many members charge a key, it is
read once and written once.

Clock: Redis TIME, read once for the whole batch: its members are decided at
one instant, as calls arriving together would be.
]]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- @@ALGORITHMS@@

local m = tonumber(ARGV[1])
if m == nil or m < 1 then
  return redis.error_reply('ERR redis-guard batch: ARGV[1] must be the member count')
end
-- Every member is checked before any is decided: Redis keeps what a script
-- wrote before it returned an error, so a malformed member found late would
-- leave the members before it charged (and locked) for a batch the filter
-- sees fail.
-- Members are read where they lie in KEYS and ARGV (offsets), not copied.
local ko, ao, na = {}, {}, {}
local k, a = 1, 2 + 2 * m
for j = 1, m do
  local nkeys = tonumber(ARGV[2 * j])
  local nargs = tonumber(ARGV[2 * j + 1])
  if nkeys == nil or nargs == nil or nkeys < 0 or nargs < 1
      or k + nkeys - 1 > #KEYS or a + nargs - 1 > #ARGV then
    return redis.error_reply('ERR redis-guard batch: member sizes do not match KEYS and ARGV')
  end
  local bad = malformed(KEYS, k - 1, nkeys, ARGV, a - 1, nargs)
  if bad then
    return redis.error_reply(bad)
  end
  ko[j], ao[j], na[j] = k - 1, a - 1, nargs
  k, a = k + nkeys, a + nargs
end
if k - 1 ~= #KEYS or a - 1 ~= #ARGV then
  return redis.error_reply('ERR redis-guard batch: member sizes do not match KEYS and ARGV')
end

local out = { m }
for j = 1, m do
  local reply = decide_checked(KEYS, ko[j], ARGV, ao[j], na[j])
  if reply.err then
    return reply
  end
  out[#out + 1] = #reply
  for i = 1, #reply do out[#out + 1] = reply[i] end
end
flush_all()
return out
