--[[ redis-guard: one request's decision, the driver of lua/ratelimit.lua and
of each member of lua/batch.lua.

This file is not a script on its own: src/scripts.rs joins it after the
algorithm and idempotency files. decide(keys, argv) takes one request's KEYS
and ARGV in the layout lua/ratelimit.lua documents and returns its reply (the
flat array documented there), or an error reply; decide_checked(keys, ko,
argv, ao, na) the same for a request malformed() has already passed, read from
KEYS and ARGV at offsets (its `na` ARGV values follow argv[ao]). It writes only what that
reply says was charged or locked, so requests decided one after another in
one script see each other exactly as separate calls in the same order would.
Reads    `now` (ms, from Redis TIME) set by the preamble.
Kinds    "tb" token_bucket.lua, "sw" sliding_window.lua, "gcra" gcra.lua,
         "fw" fixed_window.lua, "swc" sliding_window_counter.lua, "cc"
         concurrency.lua, "cq" quota.lua, each defined by need(kind) when malformed() first
         meets it (a script's functions are made anew on every call: a call
         makes only its kinds', see src/scripts.rs on_demand); each
         kind's check reads its key, its charge records the new state, and
         the kinds that cache state per run write it in flush_all(), which
         the script calls once before it returns.
]]


-- The kinds malformed() lets through.
local known_kinds = { tb = true, sw = true, gcra = true, fw = true, swc = true,
                      cc = true, cq = true }
-- The kinds that take overrides: their state means the same under another
-- capacity, limit or maximum (GCRA's is in units of its rate).
local overridable = { tb = true, sw = true, fw = true, swc = true, cq = true,
                      cc = true }

-- A limit's kind, and whether it takes overrides (its algorithm suffixed
-- `+o`), or nil for an algorithm that is neither.
local function kind_of(alg)
  if known_kinds[alg] then
    return alg, false
  end
  if type(alg) == 'string' and string.sub(alg, -2) == '+o' then
    local kind = string.sub(alg, 1, -3)
    if overridable[kind] then
      return kind, true
    end
  end
  return nil, false
end


-- A whole number lo <= x <= hi (tonumber() also takes fractions, "nan" and
-- "inf").
local function whole(x, lo, hi)
  return x == math.floor(x) and x >= lo and x <= hi
end

-- Why a GCRA, fixed-window or sliding-window-counter limit's numbers would
-- corrupt its state or its exactness, or nil. The filter validates the
-- config; this only keeps a contract bug from writing fractions, NaN or
-- zero divisors into a key (the bounds are the ones each file's header
-- relies on).
local function kind_params_bad(alg, a, b, c, cost)
  if not whole(cost, 1, 2^52) then
    return true
  end
  if alg == 'gcra' then
    return not (whole(a, 1, 2^52) and whole(b, 1, 2^53) and whole(c, 1, 2^53)
                and a * c < 2^52 and b * c < 2^53)
  end
  if alg == 'cq' then
    -- c is the edges (a string), checked by the caller; b is unused.
    return not whole(a, 1, 2^50)
  end
  if alg == 'cc' then
    -- c is the slot id (a string), checked by the caller.
    return not (whole(a, 1, 2^20) and whole(b, 1, 2^32) and cost <= 1000)
  end
  return not (whole(a, 1, 2^50) and whole(b, 1, 2^53 - 1))
end

-- Why one request's KEYS and ARGV cannot be decided, or nil: checked before
-- anything is written, so a malformed request (or batch member) changes
-- nothing.
local function malformed(keys, ko, nk, argv, ao, na)
  local n = tonumber(argv[ao + 1])
  local keyed = n ~= nil and 2 + 6 * n <= na and argv[ao + 2 + 6 * n] == '1'
  if n == nil or n < 0 or n + (keyed and 1 or 0) ~= nk then
    return 'ERR redis-guard ratelimit: ARGV[1] must match #KEYS'
  end
  -- Every limit's six values, enforce flag included, must be the request's
  -- own: in a batch, past them lies the next member's.
  if 1 + 6 * n > na then
    return 'ERR redis-guard ratelimit: limit ' .. n .. ' needs numbers'
  end
  for i = 1, n do
    local base = ao + 2 + (i - 1) * 6
    local alg = kind_of(base - ao <= na and argv[base] or nil)
    if alg == nil then
      return 'ERR redis-guard ratelimit: unknown algorithm'
    end
    -- Every request is checked before it is decided: its kinds are
    -- defined here (src/scripts.rs on_demand).
    need(alg)
    for j = 1, 4 do
      -- A concurrency limit's third value is its slot id, a quota's its
      -- window edges: not numbers.
      if base - ao + j > na
          or (tonumber(argv[base + j]) == nil
              and not ((alg == 'cc' or alg == 'cq') and j == 3)) then
        return 'ERR redis-guard ratelimit: limit ' .. i .. ' needs numbers'
      end
    end
    local e = tonumber(argv[base + 5])
    if e == nil or not (e == 0 or e == 1
        or (alg ~= 'cc' and (whole(e, 1000, 2^42) or whole(-e, 1000, 2^42)))) then
      return 'ERR redis-guard ratelimit: limit ' .. i .. ' has a bad enforce value'
    end
    if alg == 'cc' and cc_slot_bad(argv[base + 3]) then
      return 'ERR redis-guard ratelimit: limit ' .. i .. ' needs a slot id'
    end
    if alg == 'cq' and cq_edges_bad(argv[base + 3]) then
      return 'ERR redis-guard ratelimit: limit ' .. i
          .. ': no window of its edges holds Redis\' clock (the proxy\'s clock is off by more than a window)'
    end
    if alg ~= 'tb' and alg ~= 'sw' and kind_params_bad(alg,
        tonumber(argv[base + 1]), tonumber(argv[base + 2]),
        tonumber(argv[base + 3]) or 0, tonumber(argv[base + 4])) then
      return 'ERR redis-guard ratelimit: limit ' .. i .. ' has numbers out of range'
    end
  end
  if keyed and 5 + 6 * n > na then
    return 'ERR redis-guard ratelimit: an idempotency key needs owner, fingerprint and lock TTL'
  end
  return nil
end

-- A verdict that admits but is not charged (another limit rejected, or an
-- inspection): the budget as it stands, remaining without this request's
-- cost, reset until whole again (0 if it already is). lua/inspect.lua
-- reports every admitting verdict this way.
local function report_uncharged(r)
  local alg = r.alg
  if alg == 'tb' then
    r.remaining = math.floor(r.credits / r.period)
    r.reset = math.ceil((r.full - r.credits) / r.refill)
  elseif alg == 'sw' then
    r.remaining = r.remaining + r.cost
    if r.newest then
      r.reset = math.max(0, r.newest + r.window - now)
    else
      r.reset = 0
    end
  elseif alg == 'gcra' then
    -- An admitting verdict always has its backlog d (0 <= d <= full).
    r.remaining = math.floor((r.full - r.d) / r.period)
    r.reset = math.ceil(r.d / r.rate)
  elseif alg == 'fw' or alg == 'cq' then
    r.remaining = r.remaining + r.cost
    r.reset = r.count > 0 and r.ends or 0
  elseif alg == 'swc' then
    r.remaining = r.remaining + r.cost
    r.reset = swc_restored_in(r.cur, r.prev, r)
  else
    -- No slot taken: the free slots as they stand.
    r.remaining = r.remaining + r.cost
  end
end

-- decide() for a request malformed() has passed, whose KEYS start after
-- keys[ko] and ARGV after argv[ao]: lua/batch.lua checks every member before
-- deciding any, and reads each member where it lies in KEYS and ARGV (checking
-- twice, or copying each member's values out, costs a member about as much
-- as its token bucket does).
local function decide_checked(keys, ko, argv, ao, na)
  local n = tonumber(argv[ao + 1])
  -- The flag is optional (the filter leaves it out for a request without a
  -- key): past the request's own values lies the next batch member's.
  local keyed = 2 + 6 * n <= na and argv[ao + 2 + 6 * n] == '1'

  -- A quota whose stored override puts its windows on another anchor day
  -- than its edges': nothing is decided (nothing read for the idempotency
  -- key, nothing written), the reply names each such limit and its anchor
  -- (verdict 5), and the filter sends the request again. The overrides
  -- read here are kept for the decision below.
  local texts
  for i = 1, n do
    local base = ao + 2 + (i - 1) * 6
    if argv[base] == 'cq+o' then
      local okey = override_key(keys[ko + i])
      local text = okey and redis.pcall('GET', okey)
      texts = texts or {}
      texts[i] = text or false
      local want = cq_anchor_wanted(text, argv[base + 3])
      if want then
        texts.moved = texts.moved or { 5 }
        texts.moved[#texts.moved + 1] = i
        texts.moved[#texts.moved + 1] = want
      end
    end
  end
  if texts and texts.moved then
    return texts.moved
  end

  local idem
  if keyed then
    need('idem')
    local ib = ao + 3 + 6 * n
    idem = idem_check(keys[ko + n + 1], argv[ib], argv[ib + 1], tonumber(argv[ib + 2]))
    if idem.verdict ~= 1 then
      return idem.reply
    end
  end

  local results = {}
  local admit = 1
  for i = 1, n do
    local base = ao + 2 + (i - 1) * 6
    local alg, ov = kind_of(argv[base])
    local a = tonumber(argv[base + 1])
    local b = tonumber(argv[base + 2])
    local c = argv[base + 3]
    local cost = tonumber(argv[base + 4])
    local e = tonumber(argv[base + 5])
    local enforce = e ~= 0
    local r
    -- An override for this key, read in the same call: its figures replace
    -- the configured capacity (and refill) or limit; one that does not
    -- parse within the kind's bounds, or leaves no room for this request's
    -- cost, is ignored and reported (4). Read before the block, so a
    -- blocked key's verdict says whether an override decides the key.
    local used = 0
    local plan_b
    if ov then
      -- pcall: a key of another type written by hand is an ignored
      -- override, never an error that fails the request.
      local text = texts and texts[i]
      if text == nil then
        local okey = override_key(keys[ko + i])
        text = okey and redis.pcall('GET', okey)
      end
      if type(text) == 'table' then
        used = 4
      elseif text then
        local x, y = override_figures(text, alg, c)
        if x and x >= cost then
          a, b, used = x, y or b, 2
          plan_b = y or 0
        else
          used = 4
        end
      end
    end
    -- A blocking limit's key stays refused while its block key lives, whatever
    -- its state would say. e > 1: a rejection by this limit starts the
    -- block; e < 0 (a usage-based limit, whose state holds the reserves of
    -- requests still running): only its settlement does, once the counted
    -- usage leaves it exhausted (lua/settle.lua).
    local block, bkey = nil, nil
    if e > 1 or e < 0 then
      block = math.abs(e)
      bkey = block_key(keys[ko + i])
      local left = redis.call('PTTL', bkey)
      if left > 0 then
        r = { allowed = 0, remaining = 0, retry = left, reset = left, blocked = true }
      end
    end
    if r then
      -- blocked: no state read
    elseif alg == 'tb' then
      r = tb_check(keys[ko + i], a, b, tonumber(c), cost)
    elseif alg == 'sw' then
      r = sw_check(keys[ko + i], a, b, cost)
    elseif alg == 'gcra' then
      r = gcra_check(keys[ko + i], a, b, tonumber(c), cost)
    elseif alg == 'fw' then
      r = fw_check(keys[ko + i], a, b, 0, cost)
    elseif alg == 'swc' then
      r = swc_check(keys[ko + i], a, b, 0, cost)
    elseif alg == 'cq' then
      r = cq_check(keys[ko + i], a, b, c, cost)
    else
      r = cc_check(keys[ko + i], a, b, c, cost)
    end
    r.alg = alg
    r.used = used
    if used == 2 then
      r.plan_a, r.plan_b = a, plan_b
    end
    r.block, r.bkey, r.starts = block, bkey, e > 1
    if enforce and r.allowed == 0 then
      admit = 0
    end
    results[i] = r
  end

  -- A blocking limit that rejected starts its block now: the key is refused
  -- for the whole block, so Retry-After says when the block ends.
  if admit == 0 then
    for i = 1, n do
      local r = results[i]
      if r.starts and r.allowed == 0 and not r.blocked then
        redis.call('SET', r.bkey, '1', 'PX', r.block)
        r.retry, r.reset = r.block, r.block
      end
    end
  end

  if admit == 1 and idem then
    idem_acquire(idem)
  end

  local out = { admit }
  for i = 1, n do
    local r = results[i]
    local alg = r.alg
    if admit == 1 and r.allowed == 1 then
      if alg == 'tb' then
        tb_charge(r)
        -- A leased bucket's give-backs assume its configured numbers.
        if r.used == 2 then plan_restarts_give_back(r.key) end
      elseif alg == 'sw' then sw_charge(r)
      elseif alg == 'gcra' then gcra_charge(r)
      elseif alg == 'fw' then fw_charge(r)
      elseif alg == 'swc' then swc_charge(r)
      elseif alg == 'cq' then cq_charge(r)
      else cc_charge(r) end
    elseif r.allowed == 1 then
      report_uncharged(r)
    end
    out[#out + 1] = r.allowed + r.used
    out[#out + 1] = wire(r.remaining)
    out[#out + 1] = wire(r.retry)
    out[#out + 1] = wire(r.reset)
  end
  -- The plan that decided each overridden limit, after every verdict: its
  -- figures a and b (a token bucket's capacity and refill; another kind's
  -- limit, amount or maximum, and 0), so the filter states the customer's
  -- own quota in its headers without another call.
  for i = 1, n do
    local r = results[i]
    if r.used == 2 then
      out[#out + 1] = wire(r.plan_a)
      out[#out + 1] = wire(r.plan_b)
    end
  end
  return out
end

-- Writes what the kinds with a per-run cache charged, each key once. Called
-- once by the script before it returns, after every request is decided.
local function flush_all()
  -- Only the kinds this call met are defined (src/scripts.rs on_demand).
  if tb_flush then tb_flush() end
  if gcra_flush then gcra_flush() end
  if fw_flush then fw_flush() end
  if swc_flush then swc_flush() end
  if cq_flush then cq_flush() end
end

-- decide_checked()'s answer for the commonest request: one enforced token
-- bucket without overrides or a block, no idempotency key. It skips the
-- steps for what such a request cannot have (other kinds, overrides,
-- blocks, shadow limits, a record, the verdict tables they need), which cost
-- a lone decision more than its bucket does. Returns allowed, remaining,
-- retry, reset; the request's reply is { allowed, allowed, remaining,
-- retry, reset }.
local function lone_bucket(key, a, b, c, cost)
  need('tb')
  local allowed, remaining, retry, reset = tb_take(key, a, b, c, cost)
  return allowed, wire(remaining), wire(retry), wire(reset)
end

-- A lone call in lone_bucket()'s shape: one key, ARGV exactly "1", "tb",
-- four numbers and "1" (the filter sends no key flag for a request without
-- an idempotency key). Anything else, nil: decide() takes the general way,
-- which decides such a call the same.
local function decide_lone(keys, argv)
  if #keys ~= 1 or #argv ~= 7 or argv[1] ~= '1' or argv[2] ~= 'tb' or argv[7] ~= '1' then
    return nil
  end
  local a, b = tonumber(argv[3]), tonumber(argv[4])
  local c, cost = tonumber(argv[5]), tonumber(argv[6])
  if a == nil or b == nil or c == nil or cost == nil then
    return nil
  end
  local allowed, remaining, retry, reset = lone_bucket(keys[1], a, b, c, cost)
  return { allowed, allowed, remaining, retry, reset }
end

local function decide(keys, argv)
  local lone = decide_lone(keys, argv)
  if lone then
    return lone
  end
  local bad = malformed(keys, 0, #keys, argv, 0, #argv)
  if bad then
    return redis.error_reply(bad)
  end
  return decide_checked(keys, 0, argv, 0, #argv)
end
