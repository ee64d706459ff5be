--[[ redis-guard: decide a batch of requests in one call, one after another in
the order given, each exactly as its own call to lua/ratelimit.lua would have
been decided at that point (group commit).

KEYS     one key: the batch's first (its key table's first entry). The
         filter batches only requests of one Redis Cluster hash tag, so every
         key of the batch lives in this key's slot: Redis Cluster checks the
         declared key, Envoy's redis_proxy routes the call by it, and the
         others (carried in ARGV, unencoded and front-coded, where KEYS would
         repeat them whole and Webdis' path percent-encodes them) are in the
         same slot, as the block and override keys lua/keys.lua derives are.
Nonce    a call may put "~" and hex digits before ARGV[1]: it is taken out
         first (the ARGV below are what is left) and given back first in a
         table reply (docs/src/running/failures.md: a reply the filter can tell
         is its own).
ARGV[1]  the whole batch, packed (src/batch.rs writes it; big-endian, every
         figure an 8-byte double, exact below 2^53; u16 counts and indexes,
         1-based; a string is a u16 length then its bytes):
  u8   version, 3 (any other is refused)
  u16  P, then P parameter sets, each a limit's as lua/ratelimit.lua takes
       it: u8 kind (1 tb, 2 sw, 3 gcra, 4 fw, 5 swc, 6 cc, 7 cq; plus 128 for
       a limit that takes overrides, its algorithm suffixed `+o`), figures a,
       b, c (c is 0 for cc and cq: the slot id, the window edges are the
       member's), figure enforce (1,
       0, or a blocking limit's block in ms: lua/ratelimit.lua's value)
  u16  M, then per member, in the order to decide them:
       u16 N limits, each: u16 parameter set, u16 key (into the key table), figure
           cost, and for a cc limit the request's slot id (string), for a cq
           limit its window edges (string, lua/quota.lua)
       u8  1 if the member carries an idempotency key, then: u16 its key,
           owner token (string), request fingerprint (string), figure lock
           TTL (ms); else 0
  u16  the key table's length, then per key: u16 how many leading bytes
       it shares with the key before it, then the rest (string)
  nothing after the last key.
  Each member is unpacked into the values lua/ratelimit.lua's ARGV would
  hold, and decided by the same code (lua/decide.lua), but for the commonest
  member (one enforced token bucket, no override, no block, no idempotency
  key), which read() takes in one unpack into its own tables and
  lone_bucket() decides with the same token-bucket arithmetic and none of
  the steps for what it cannot have (docs/src/notes/2026-12-08.md measures
  what that saves).

Returns a flat array (Webdis' raw output cannot carry nested arrays):
  [1]  M
  then per member, in order: the length L of its reply, then its L values:
       the reply lua/ratelimit.lua documents; or, for a member its lone
       call would have answered with an error reply (malformed(): a quota
       whose edges hold no window of Redis' clock, numbers out of range),
       L = 1 and that error's text, `ERR redis-guard ratelimit: ...`, as a
       string (no reply of lua/ratelimit.lua is one string).

Each member's decision reads what the members before it wrote, and a
rejected member writes nothing, so a batch admits exactly what the same
calls sent one by one in this order would. A member malformed() refuses
writes nothing either and is answered its lone call's error: it fails
alone (an Envoy whose clock is off by more than a window sends such quota
members, and they must not fail the requests batched with them), and the
others are decided as if it was not there. A batch that does not unpack
(the packing above broken) is an error for the whole call: the filter
built it, so it is a bug, not a verdict.

Composition: src/scripts.rs joins lua/nonce.lua, lua/wire.lua, lua/token_bucket.lua, lua/sliding_window.lua,
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

local kinds = { 'tb', 'sw', 'gcra', 'fw', 'swc', 'cc', 'cq' }
local function bad(why)
  return redis.error_reply('ERR redis-guard batch: ' .. why)
end

local packed = ARGV[1]
if #ARGV ~= 1 or type(packed) ~= 'string' or #packed < 5 then
  return bad('ARGV must be one packed batch')
end
if #KEYS ~= 1 then
  return bad('KEYS must be the batch\'s first key alone')
end
local unpack = struct.unpack
local m
local K, A = {}, {}
local ko, nk, ao, na = {}, {}, {}, {}
-- Members whose one limit is an enforced token bucket without overrides or
-- a block, and that carry no idempotency key: the commonest member, decided
-- by lone_bucket() (lua/decide.lua).
local alone = {}
-- Each such member's key (its index, then the key), parameter set and cost:
-- read straight into these, not into K and A, which only the general way
-- (malformed(), decide_checked()) reads.
local alone_key, alone_set, alone_cost = {}, {}, {}
-- Reads the whole batch into K and A; an error string for a batch that does
-- not hold together. Run under pcall: struct raises on a short string.
local function read()
  local version, np, pos = unpack('>BH', packed)
  if version ~= 3 then
    return 'packed batch version ' .. version .. ', this script reads 3'
  end
  local params = {}
  for i = 1, np do
    local kind, a, b, c, enforce
    kind, a, b, c, enforce, pos = unpack('>Bdddd', packed, pos)
    local suffix = ''
    if kind > 128 then
      kind, suffix = kind - 128, '+o'
    end
    if kinds[kind] == nil then
      return 'unknown algorithm'
    end
    params[i] = { kinds[kind] .. suffix, a, b, c, enforce }
  end
  m, pos = unpack('>H', packed, pos)
  if m < 1 then
    return 'no members'
  end
  -- Members unpacked into one KEYS-like and one ARGV-like table, each in
  -- lua/ratelimit.lua's layout at its offsets, then checked and decided as
  -- separate calls would be. Every member is checked before any is decided:
  -- Redis keeps what a script wrote before it returned an error, so a
  -- malformed member found late would leave the members before it charged
  -- (and locked) for a batch the filter sees fail.
  local refs = {}
  for j = 1, m do
    -- The commonest member in one unpack: one limit (parameter set, key,
    -- cost) and no idempotency key, 15 bytes, which a valid batch always
    -- holds after a member's start (the key table follows); a member of
    -- another shape is read again below.
    if #packed - pos >= 14 then
      local n, p, k, cost, keyed, at = unpack('>HHHdB', packed, pos)
      local set = params[p]
      if n == 1 and keyed == 0 and k >= 1 and set and set[1] == 'tb' and set[5] == 1 then
        alone[j], alone_key[j], alone_set[j], alone_cost[j] = true, k, set, cost
        pos = at
      end
    end
    if not alone[j] then
      local n
      n, pos = unpack('>H', packed, pos)
      ko[j], ao[j] = #K, #A
      A[#A + 1] = n
      for _ = 1, n do
        local p, k, cost
        p, k, cost, pos = unpack('>HHd', packed, pos)
        local set = params[p]
        if set == nil or k < 1 then
          return 'member ' .. j .. ' names a parameter set or key it does not carry'
        end
        local c = set[4]
        if set[1] == 'cc' or string.sub(set[1], 1, 2) == 'cq' then
          c, pos = unpack('>Hc0', packed, pos)
        end
        K[#K + 1] = k
        refs[#K] = j
        A[#A + 1] = set[1]
        A[#A + 1] = set[2]
        A[#A + 1] = set[3]
        A[#A + 1] = c
        A[#A + 1] = cost
        A[#A + 1] = set[5]
      end
      local keyed
      keyed, pos = unpack('>B', packed, pos)
      if keyed == 1 then
        local k, owner, fp, ttl
        k, owner, fp, ttl, pos = unpack('>HHc0Hc0d', packed, pos)
        if k < 1 then
          return 'member ' .. j .. ' names a key it does not carry'
        end
        K[#K + 1] = k
        refs[#K] = j
        A[#A + 1] = '1'
        A[#A + 1] = owner
        A[#A + 1] = fp
        A[#A + 1] = ttl
      elseif keyed ~= 0 then
        return 'member ' .. j .. ' has no idempotency flag'
      end
      nk[j], na[j] = #K - ko[j], #A - ao[j]
    end
  end
  local nkeys
  nkeys, pos = unpack('>H', packed, pos)
  local keys, prev = {}, ''
  for i = 1, nkeys do
    local shared, rest
    shared, rest, pos = unpack('>HHc0', packed, pos)
    if shared > #prev then
      return 'key ' .. i .. ' shares more than the key before it holds'
    end
    prev = string.sub(prev, 1, shared) .. rest
    keys[i] = prev
  end
  if pos ~= #packed + 1 then
    return 'bytes after the last key'
  end
  if keys[1] ~= KEYS[1] then
    return 'KEYS[1] is not the key table\'s first key'
  end
  for i = 1, #K do
    local key = keys[K[i]]
    if key == nil then
      return 'member ' .. refs[i] .. ' names a key it does not carry'
    end
    K[i] = key
  end
  for j = 1, m do
    if alone[j] then
      local key = keys[alone_key[j]]
      if key == nil then
        return 'member ' .. j .. ' names a key it does not carry'
      end
      alone_key[j] = key
    end
  end
  return nil
end

local ok, why = pcall(read)
if not ok or why then
  return bad(ok and why or 'unreadable: ' .. tostring(why))
end
-- A member alone[] holds is decided by lone_bucket() (lua/decide.lua): its
-- figures were unpacked from doubles, so malformed() has nothing to find in
-- them. Every member is checked before any is decided (its kinds are
-- defined there); one refused is answered its error in its place.
local refused = {}
for j = 1, m do
  if not alone[j] then
    refused[j] = malformed(K, ko[j], nk[j], A, ao[j], na[j])
  end
end
local out = { m }
for j = 1, m do
  if refused[j] then
    out[#out + 1] = 1
    out[#out + 1] = refused[j]
  elseif alone[j] then
    local set = alone_set[j]
    local allowed, remaining, retry, reset =
      lone_bucket(alone_key[j], set[2], set[3], set[4], alone_cost[j])
    local o = #out
    out[o + 1] = 5
    out[o + 2] = allowed
    out[o + 3] = allowed
    out[o + 4] = remaining
    out[o + 5] = retry
    out[o + 6] = reset
  else
    local reply = decide_checked(K, ko[j], A, ao[j], na[j])
    if reply.err then
      return reply
    end
    out[#out + 1] = #reply
    for i = 1, #reply do out[#out + 1] = reply[i] end
  end
end
flush_all()
return echo(out)
