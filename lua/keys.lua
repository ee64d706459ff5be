--[[ redis-guard: the keys a script derives from a limit's state key, joined
into lua/ratelimit.lua, lua/batch.lua and lua/settle.lua (src/keys.rs builds
the same ones for the CLI and the tests). A state key is
`<prefix>:rl:{<tag>}:<name>:<signature>:<descriptor>`; the prefix holds no
brace, names and signatures no `:`. A derived key keeps the hash tag, so it
lives in the state's slot.

Derived keys the scripts below do not build here: a quota's window
`<state key>:<window start, ms>` (lua/quota.lua) and a leased token
bucket's give-back record `<state key>:ret` (lua/lease.lua,
lua/lease_return.lua, which are not joined with this file; src/keys.rs
give_back_key() names it for the CLI, whose reset deletes it, and checks
that both scripts spell that suffix).

It also reads what is stored at an override key (override_figures), for the
decision (lua/decide.lua), the settlement (lua/settle.lua) and a leased
bucket's grant (lua/lease.lua) alike, so all judge a customer by one plan;
and restarts a leased bucket's give-back record once a plan charged the
bucket (plan_restarts_give_back).
]]

-- The key of a blocking limit's block: its state key with `:bl:` for `:rl:`
-- (src/keys.rs block_key(); the prefix holds no brace, so the first `:rl:{`
-- is the one after it).
local function block_key(key)
  local s, e = string.find(key, ':rl:{', 1, true)
  if s == nil then
    return key .. ':bl'
  end
  return string.sub(key, 1, s - 1) .. ':bl:{' .. string.sub(key, e + 1)
end

-- The override key of a state key `<prefix>:rl:{<tag>}:<name>:<signature>:
-- <descriptor>`: `<prefix>:ov:{<tag>}:<name>:<descriptor>` (src/keys.rs
-- override_key()). Without the signature, so an override outlives a change
-- of the limit's configured numbers; the same hash tag, so the same slot.
-- Names and signatures hold no `:`.
local function override_key(key)
  local s, e = string.find(key, ':rl:{', 1, true)
  if s == nil then return nil end
  local t = string.find(key, '}:', e + 1, true)
  if t == nil then return nil end
  local n = string.find(key, ':', t + 2, true)
  if n == nil then return nil end
  local g = string.find(key, ':', n + 1, true)
  if g == nil then return nil end
  return string.sub(key, 1, s - 1) .. ':ov:{' .. string.sub(key, e + 1, n)
      .. string.sub(key, g + 1)
end

-- A whole number lo <= x <= hi (tonumber() also takes fractions, "nan" and
-- "inf").
local function ov_whole(x, lo, hi)
  return x == math.floor(x) and x >= lo and x <= hi
end

-- An override's figures for a limit of kind `kind` (a token bucket's period
-- `c`, a quota's edges), or nil when `text` is not one within the kind's
-- bounds: "tb <capacity> <refill>", "fw <limit>", "swc <limit>", "sw
-- <limit>", "cc <max>", "cq <amount>", "cq <amount> <anchorDay>" (decimal,
-- as `redis-guard override set` writes them). A quota's anchor day counts
-- only for edges sent for that day (cq_anchor_wanted() sent the others
-- back); `any_day`: the amount counts whatever the day (a settlement lands
-- in the window its decision was made in, whichever day that was on).
local function override_figures(text, kind, c, any_day)
  if kind == 'cq' then
    local x, d = string.match(text, '^cq (%d+) (%d+)$')
    if x then
      if not any_day and cq_anchoring(c) ~= tonumber(d) then
        return nil
      end
      text = 'cq ' .. x
    end
  end
  if kind == 'tb' then
    local x, y = string.match(text, '^tb (%d+) (%d+)$')
    x, y = tonumber(x), tonumber(y)
    local p = tonumber(c)
    if x and y and ov_whole(x, 1, 2^50) and ov_whole(y, 1, 2^50)
        and x * p < 2^53 and y * p < 2^53 then
      return x, y
    end
    return nil
  end
  local k, x = string.match(text, '^(%l+) (%d+)$')
  x = tonumber(x)
  local top = 2^50
  if kind == 'sw' then top = 1000000 elseif kind == 'cc' then top = 2^20 end
  if k == kind and x and ov_whole(x, 1, top) then
    return x
  end
  return nil
end

-- A stored plan charged the bucket at `key`: its give-back record (lua/
-- lease.lua, lua/lease_return.lua) starts again after this ms, marked -3, so
-- no tuple handed out before comes back. lease_return.lua's bound assumes
-- the bucket rose by the configured refill alone since the grant; under a
-- plan it may have risen faster, and once the plan is gone nothing would
-- say so. A -3 record refuses every give-back until lease.lua's next grant
-- (never while a plan is stored: it grants nothing then) turns it back into
-- a record starting at the same instant. A -2 record only (a record of
-- another layout refuses every tuple already): a planned key pays one GET.
local function plan_restarts_give_back(key)
  local ck = key .. ':ret'
  local rec = redis.call('GET', ck)
  if rec and #rec >= 24 and (#rec - 24) % 48 == 0 then
    local _, mark = struct.unpack('<dd', rec)
    if mark == -2 then
      redis.call('SET', ck, struct.pack('<ddd', 0, -3, now + 1), 'KEEPTTL')
    end
  end
end
