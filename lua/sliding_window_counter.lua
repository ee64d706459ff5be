--[[ redis-guard: sliding-window counter, one limit's part of
lua/ratelimit.lua and lua/batch.lua.

This file is not a script on its own: src/scripts.rs joins it between the
clock preamble and the driver (lua/decide.lua), which calls it once per
sliding-window-counter limit.

KEYS     one hash per limit: w = index of the current window, c = units
         admitted in it, p = units admitted in the window before it
ARGV     the limit's group in ratelimit.lua: "swc", limit (units per window,
         <= 2^50), window (ms, < 2^53), 0, cost (1 <= cost, <= limit but see
         below), enforce
Returns  swc_check(key, limit, window, _, cost) -> verdict table with allowed
         (0/1), remaining, retry (ms), reset (ms: until the estimate is back
         to 0); swc_charge(verdict) charges it; swc_flush() writes every
         charged key once (HSET and PEXPIRE); swc_restored_in(cur, prev, r)
         is the time until a state's estimate is back to 0. The driver calls
         swc_flush() (through flush_all()) before it returns.
Reads    `now` (ms, from Redis TIME) set by the preamble.

Why this kind: a sliding window in constant memory (three small integers,
where lua/sliding_window.lua keeps a member per admitted unit), at the price
of estimating instead of counting. Windows are aligned to the Unix epoch on
Redis' clock, as in lua/fixed_window.lua; with e = now - start of the current
window, the previous window is taken to have been spread evenly, so the part
of it still inside the sliding span (now - window, now] weighs
    floor(prev * (window - e) / window)
and the estimate is that plus the current window's count. A request is
admitted when estimate + cost <= limit.

Exact arithmetic: prev * (window - e) is exact while it stays below 2^53 (and
a quotient of integers below 2^53 never rounds across an integer). Above
that (a limit and a window both huge), the weight may be off by one unit;
retry_ms is searched on the same computed weight, so it is still the first
ms at which the script admits.

TTL: until the current window's count no longer weighs. In the next window
it weighs floor(c * (window - e) / window), which is 0 from
e = window - floor((window - 1) / c) on (the next window's end at the
latest); from then on the key equals a missing one. reset_ms after a charge
is the same number.

Worst case against the exact sliding-window log (limit L, window W):
  over-admission: any W ms span overlaps at most two aligned windows, each
    holding at most L, so at most 2L are admitted in any span of W ms where
    the log admits L. That bound is reached (for W > 2L) when L units arrive
    in the last ms of window i-1 and then, in window i, the k-th unit
    (k = 1..L) arrives at e = floor((k - 1) * W / L) + 1, the first ms its
    weight allows: 2L in a span of W ms (e.g. W = 60000, L = 10: 10 at the
    last ms of a window, then 10 more at e = 1, 6001, ..., 54001).
  under-admission: after L units in the first ms of window i-1, the log
    admits L again at the start of window i (they left its span), but the
    counter still weighs them fully: it admits 0 at e = 0, the k-th unit from
    e = floor((k - 1) * W / L) + 1, and a request of cost L only from
    e = W - floor((W - 1) / L) (54001 ms for the numbers above). So up to L
    units at one instant, and up to about W ms of waiting, that the log
    would not hold back.
  The floor() in the weight is why the over-admission reaches 2L exactly:
  it rounds the previous window's weight down, in the request's favour, by
  less than one unit.

A cost above the limit can never be admitted: a rejection that writes
nothing, whose retry_ms is the time until the estimate is back to 0 (0 if it
is), since no wait would admit it.

A clock that steps back leaves a state stamped with a window that has not
begun yet by the clock. Time is taken to stand at that window's start until
the clock reaches it: its count and its previous window's (weighing fully)
stay current, what is admitted meanwhile counts against them, and every time
reported includes the wait for the clock. So nothing beyond what the state
allows is admitted on either side of the step; the price is up to the
clock's step of budget held back.
]]

-- States this script run has read or charged, by key: a batch of many
-- requests on one key reads it once and writes it once (see tb_seen in
-- token_bucket.lua).
local swc_seen = {}
local swc_charged = {}

local function swc_weight(p, window, e)
  return math.floor(p * (window - e) / window)
end

-- The first e >= from (from <= window) at which the weight of p is at most
-- `most` (>= 0); at e = window it is 0, so the answer is at most window.
local function swc_first(p, window, most, from)
  if p <= most then
    return from
  end
  local e
  if p * window < 9007199254740992 then
    -- floor(p (W - e) / W) <= most  <=>  p (W - e) <= (most + 1) W - 1, all
    -- below p * W < 2^53 since most < p.
    e = window - math.floor(((most + 1) * window - 1) / p)
  else
    -- Past exact products: search the weight as computed (it never rises
    -- with e), so this is the ms at which the check admits. At most 53
    -- halvings of [from, window].
    local lo, hi = from, window
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      if swc_weight(p, window, mid) <= most then
        hi = mid
      else
        lo = mid + 1
      end
    end
    e = lo
  end
  return math.max(from, e)
end

-- ms until the estimate of a state (cur and prev in the window starting at
-- r.start, now at r.e into it) is 0, with no further arrivals.
local function swc_restored_in(cur, prev, r)
  if cur > 0 then
    return r.start + r.window + swc_first(cur, r.window, 0, 0) - now
  elseif prev > 0 then
    return r.start + swc_first(prev, r.window, 0, r.e) - now
  end
  return 0
end

local function swc_check(key, limit, window, _, cost)
  local s = swc_seen[key]
  if s == nil then
    local state = redis.call('HMGET', key, 'w', 'c', 'p')
    s = { w = tonumber(state[1]), c = tonumber(state[2]) or 0,
          p = tonumber(state[3]) or 0 }
    swc_seen[key] = s
  end
  local idx = math.floor(now / window)
  local cur, prev = 0, 0
  if s.w and s.w >= idx then
    -- This window, or a later one (the clock stepped back), which stays
    -- current until the clock reaches it.
    idx = s.w
    cur, prev = s.c, s.p
  elseif s.w and s.w == idx - 1 then
    prev = s.c
  end
  local start = idx * window
  local r = { key = key, idx = idx, cur = cur, prev = prev, cost = cost,
              window = window, start = start, e = math.max(0, now - start) }
  local est = swc_weight(prev, window, r.e) + cur
  if est + cost <= limit then
    r.allowed = 1
    r.remaining = limit - est - cost
    r.retry = 0
    r.reset = swc_restored_in(cur + cost, prev, r)
  else
    r.allowed = 0
    r.remaining = math.max(0, limit - est)
    if cost > limit then
      r.retry = swc_restored_in(cur, prev, r)
    elseif cur + cost <= limit then
      -- Within this window, once prev's weight has fallen far enough.
      r.retry = start + swc_first(prev, window, limit - cur - cost, r.e) - now
    else
      -- Only in the next window, where cur becomes the previous count.
      r.retry = start + window + swc_first(cur, window, limit - cost, 0) - now
    end
    r.reset = r.retry
  end
  return r
end

local function swc_charge(r)
  if swc_seen[r.key].charged == nil then
    swc_charged[#swc_charged + 1] = r.key
  end
  swc_seen[r.key] = { w = r.idx, c = r.cur + r.cost, p = r.prev,
                      charged = true, ttl = r.reset }
end

local function swc_flush()
  for _, key in ipairs(swc_charged) do
    local s = swc_seen[key]
    redis.call('HSET', key, 'w', string.format('%d', s.w),
               'c', string.format('%d', s.c), 'p', string.format('%d', s.p))
    redis.call('PEXPIRE', key, string.format('%d', s.ttl))
  end
  swc_charged = {}
end
