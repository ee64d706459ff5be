--[[ redis-guard: fixed window, one limit's part of lua/ratelimit.lua and
lua/batch.lua.

This file is not a script on its own: src/scripts.rs joins it between the
clock preamble and the driver (lua/decide.lua), which calls it once per
fixed-window limit.

KEYS     one string per limit: "<window index>:<count>", the units admitted in
         that window
ARGV     the limit's group in ratelimit.lua: "fw", limit (units per window,
         <= 2^50), window (ms, < 2^53), 0, cost (1 <= cost, <= limit but see
         below), enforce
Returns  fw_check(key, limit, window, _, cost) -> verdict table with allowed
         (0/1), remaining, retry (ms), reset (ms: until the window ends);
         fw_charge(verdict) charges it; fw_flush() writes every charged key
         once, with its expiry in the same SET. The driver calls fw_flush()
         (through flush_all()) before it returns.
Reads    `now` (ms, from Redis TIME) set by the preamble.

Windows are aligned to the Unix epoch on Redis' clock: window i is
[i * window, (i + 1) * window), so every Envoy and every key of one limit
turns over at the same instant, whatever the key's first request was.

Why the index is stored beside the count: the key expires at its window's
end, but inside a script Redis decides expiry by the time the script
started, which lags the TIME this script read (by a ms, or more in a long
batch). A key still there at that edge holds the old window's count; with the
index beside it, it is recognised as the old window's and ignored, never read
as the new one's.

TTL: until the window's end, (i + 1) * window - now >= 1 ms, plus 2 ms (see
fw_flush): then the count no longer applies. reset_ms after a charge is the
time to the window's end.

What a fixed window admits: at most `limit` per aligned window, but up to
2 * limit within any span of `window` ms that straddles an edge (a full
window's worth in its last ms, another in the first ms of the next). The
sliding-window kinds exist for limits where that burst matters.

A cost above the limit can never be admitted: a rejection that writes
nothing, whose retry_ms is the time until the window's count is gone (0 if
it is empty), since no wait would admit it.

A clock that steps back leaves a count stamped with a window that has not
begun yet by the clock. That window's count stays the current one until that
window ends: what is admitted meanwhile counts against it, so no window
(on the clock before or after the step) ever admits more than `limit`; the
price is up to the clock's step (plus the rest of that window) of budget held
back.
]]

-- Counts this script run has read or charged, by key: a batch of many
-- requests on one key reads it once and writes it once (see tb_seen in
-- token_bucket.lua).
local fw_seen = {}
local fw_charged = {}

local function fw_check(key, limit, window, _, cost)
  local s = fw_seen[key]
  if s == nil then
    s = {}
    local v = redis.call('GET', key)
    if v then
      local w, c = string.match(v, '^(%d+):(%d+)$')
      s.w, s.c = tonumber(w), tonumber(c)
    end
    fw_seen[key] = s
  end
  local idx = math.floor(now / window)
  local count = 0
  if s.w and s.c and s.w >= idx then
    -- This window's count, or a later window's (the clock stepped back),
    -- which is the current one until its end.
    idx = s.w
    count = s.c
  end
  local ends = (idx + 1) * window - now
  local r = { key = key, idx = idx, count = count, cost = cost, ends = ends }
  if count + cost <= limit then
    r.allowed = 1
    r.remaining = limit - count - cost
    r.retry = 0
    r.reset = ends
  else
    r.allowed = 0
    r.remaining = math.max(0, limit - count)
    if cost > limit and count == 0 then
      r.retry = 0
    else
      -- The next window starts empty (and for a cost above the limit, that
      -- is when the limit is whole again).
      r.retry = ends
    end
    r.reset = r.retry
  end
  return r
end

local function fw_charge(r)
  if fw_seen[r.key].charged == nil then
    fw_charged[#fw_charged + 1] = r.key
  end
  fw_seen[r.key] = { w = r.idx, c = r.count + r.cost, charged = true,
                     ttl = r.ends }
end

-- Redis 7.2 and later count a PX inside a script from the script's start,
-- which can be a ms before the TIME this script read: a key set to expire
-- exactly at its window's end could then vanish in that window's last ms,
-- and a request there would count from zero (up to twice the limit in the
-- window). The index stored beside the count makes a key that outlives its
-- window harmless, so it is kept FW_EDGE_MS longer.
local FW_EDGE_MS = 2

local function fw_flush()
  for _, key in ipairs(fw_charged) do
    local s = fw_seen[key]
    redis.call('SET', key, string.format('%d:%d', s.w, s.c),
               'PX', string.format('%d', s.ttl + FW_EDGE_MS))
  end
  fw_charged = {}
end
