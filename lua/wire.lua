--[[ redis-guard: numbers on their way out, shared by every script that
returns limit figures (lua/ratelimit.lua, lua/batch.lua, lua/lease.lua).

This file is not a script on its own: src/scripts.rs joins it first after
the clock preamble.

Webdis 0.1.9 cannot carry an integer reply of 2^31 or more: it truncates a
lone one, and one inside an array aborts the whole Webdis process (SIGABRT:
every connection of every Envoy gone; 0.1.23 too). Limits reach
such numbers (a fixed window's reset in a long window, a bucket's remaining
units in a budget of billions), so wire(v) hands them over as a decimal
string, which Webdis passes byte for byte; the filter reads an integer
either way. Smaller numbers stay integers. Lua's %d prints the double's
exact integer value (every figure here is an integer below 2^53).
]]

local function wire(v)
  if v >= 2147483648 or v <= -2147483649 then
    return string.format('%d', v)
  end
  return v
end
