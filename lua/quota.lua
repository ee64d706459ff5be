--[[ redis-guard: calendar quota, one limit's part of lua/ratelimit.lua and
lua/batch.lua ("cq").

This file is not a script on its own: src/scripts.rs joins it between the
clock preamble and the driver (lua/decide.lua), which calls it once per
quota limit.

KEYS     the limit's state key; the count of a window lives at that key
         followed by `:<window start, ms>` (same hash tag, so the same
         Redis Cluster slot): a new window is a new key, its count a decimal
         string, the units admitted in it
ARGV     the limit's group in ratelimit.lua: "cq", amount (units per
         window, <= 2^50), 0, edges, cost, enforce. `edges` is four
         decimal ms, comma-separated and non-decreasing: the window around
         the filter's clock and one on each side, which the filter computed
         from the quota's time zone (src/quota.rs); for a limit that takes
         stored overrides (a month or a week), followed by
         `@<sent>,<default>,<max>`: the anchor day the edges were computed
         for, the one that applies without a stored anchor, and the largest
         the unit takes (src/quota.rs Anchoring)
Returns  cq_check(key, amount, _, edges, cost) -> verdict table with allowed
         (0/1), remaining, retry (ms), reset (ms: until the window ends, its
         renewal); cq_charge(verdict) charges it; cq_flush() writes every
         charged key once, with its expiry in the same SET.
Reads    `now` (ms, from Redis TIME) set by the preamble.

Why edges and not rules: Lua has no time-zone rules, and the filter's clock
is not the one decisions read. The window is the one of `edges` that holds
Redis' TIME, so a quota renews when Redis' clock crosses its edge, the same
instant for every Envoy. A call whose edges do not hold Redis' TIME (the
filter's clock off by more than a window) is malformed: an error reply,
decided by the failure mode, never a count in a window it cannot place (in
lua/batch.lua, that member alone; in lua/settle.lua, that settlement alone).
The filter's edges are increasing: a neighbour is never an empty window
(src/quota.rs Calendar::edges); the script takes non-decreasing ones.

TTL: until the window's end plus CQ_MARGIN_MS. The key carries its window,
so a key that outlives its window is never read as the next one's; the
margin keeps the count a while for a clock that steps back over the edge and
for an operator's inspection just after the renewal.

Why the anchor is refereed here: a stored override may move a customer's
windows to its billing day (`cq <amount> <anchorDay>`), but the filter
computes the windows before this call reads it. cq_anchor_wanted() says
which anchor the stored override (else the default) puts the windows on
when it is not the one sent: lua/decide.lua then decides nothing for the
request and names it, and the filter sends the request again with edges
for it (and remembers it for the customer's next requests).

What the quota admits: at most `amount` units per window. A cost above the
amount can never be admitted: a rejection that writes nothing, retry_ms 0
when the window is empty, else the renewal.
]]

local cq_seen = {}
local cq_charged = {}
local CQ_MARGIN_MS = 60000

-- The anchoring after the edges: sent, default, max, or nil when there is
-- none; false when it does not parse.
local function cq_anchoring(edges)
  local at = string.find(edges, '@', 1, true)
  if at == nil then
    return nil
  end
  local s, d, m = string.match(string.sub(edges, at + 1), '^(%d%d?),(%d%d?),(%d%d?)$')
  s, d, m = tonumber(s), tonumber(d), tonumber(m)
  if s == nil or m > 31 or s < 1 or s > m or d < 1 or d > m then
    return false
  end
  return s, d, m
end

-- The start and end of the window of `edges` that holds `now`, or nil
-- when the edges do not parse or none holds it.
local function cq_window(edges)
  if type(edges) ~= 'string' or #edges > 96 or cq_anchoring(edges) == false then
    return nil
  end
  local at = string.find(edges, '@', 1, true)
  if at then
    edges = string.sub(edges, 1, at - 1)
  end
  local e = {}
  for v in string.gmatch(edges, '[^,]+') do
    local x = tonumber(v)
    if x == nil or x ~= math.floor(x) or x < 0 or x >= 2^47 or #e == 4 then
      return nil
    end
    e[#e + 1] = x
  end
  if #e ~= 4 then
    return nil
  end
  for j = 1, 3 do
    if e[j] > e[j + 1] then
      return nil
    end
  end
  for j = 1, 3 do
    if e[j] <= now and now < e[j + 1] then
      return e[j], e[j + 1]
    end
  end
  return nil
end

-- Why a call's edges cannot be decided on, for malformed().
local function cq_edges_bad(edges)
  return cq_window(edges) == nil
end

-- The anchor the request's quota must be decided on when it is not the one
-- its edges were computed for, else nil. `text` is the stored override (a
-- string, or nil/false/a table for none or an unreadable one), read as
-- lua/decide.lua reads it: an override that does not parse within the
-- bounds sets no anchor either. One whose amount is below this request's
-- cost still does: the billing day is the customer's whatever a request
-- costs (decide() then ignores the amount alone, as for every kind), so the
-- request is counted in the customer's window and the Envoy's remembered
-- day is not sent back to the default by one large request.
local function cq_anchor_wanted(text, edges)
  local sent, default, max = cq_anchoring(edges)
  if not sent then
    return nil
  end
  local want = default
  if type(text) == 'string' then
    local amount, anchor = string.match(text, '^cq (%d+) (%d+)$')
    amount, anchor = tonumber(amount), tonumber(anchor)
    if amount and amount == math.floor(amount) and amount >= 1 and amount <= 2^50
        and anchor >= 1 and anchor <= max then
      want = anchor
    end
  end
  if want ~= sent then
    return want
  end
  return nil
end

local function cq_check(key, amount, _, edges, cost)
  local start, stop = cq_window(edges)
  local wkey = key .. ':' .. string.format('%d', start)
  local s = cq_seen[wkey]
  if s == nil then
    local v = redis.call('GET', wkey)
    s = { c = v and tonumber(v) or 0 }
    cq_seen[wkey] = s
  end
  local count = s.c
  local ends = stop - now
  local r = { key = wkey, count = count, cost = cost, ends = ends }
  if count + cost <= amount then
    r.allowed = 1
    r.remaining = amount - count - cost
    r.retry = 0
    r.reset = ends
  else
    r.allowed = 0
    r.remaining = math.max(0, amount - count)
    if cost > amount and count == 0 then
      r.retry = 0
    else
      r.retry = ends
    end
    r.reset = r.retry
  end
  return r
end

local function cq_charge(r)
  local s = cq_seen[r.key]
  if not s.charged then
    cq_charged[#cq_charged + 1] = r.key
  end
  cq_seen[r.key] = { c = r.count + r.cost, charged = true, ttl = r.ends }
end

local function cq_flush()
  for _, key in ipairs(cq_charged) do
    local s = cq_seen[key]
    redis.call('SET', key, string.format('%d', s.c),
               'PX', string.format('%d', s.ttl + CQ_MARGIN_MS))
  end
  cq_charged = {}
end
