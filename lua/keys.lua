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
