--[[ redis-guard: a call's nonce, the first part joined into the scripts whose
replies decide requests (lua/ratelimit.lua, lua/batch.lua, lua/lease.lua).

This file is not a script on its own: src/scripts.rs joins it right after
the clock preamble, before anything reads ARGV.

A call may carry "~" and hex digits first in ARGV (no other first ARGV of
those scripts starts with "~"): it is taken out here, so the script reads
its ARGV as documented, and echo() puts it back first in the script's table
reply. The filter takes a reply as its call's own only if it starts with its
nonce: Webdis 0.1.9 may write another connection's late reply to this one's
socket (docs/src/running/failures.md). An error reply carries none.
]]

local nonce = ARGV[1]
if type(nonce) == 'string' and string.byte(nonce, 1) == 126 then
  table.remove(ARGV, 1)
else
  nonce = nil
end

local function echo(reply)
  if nonce and type(reply) == 'table' and reply.err == nil then
    table.insert(reply, 1, nonce)
  end
  return reply
end
