--[[ redis-guard: decide one request in one call: its idempotency key (if any)
and every rate limit that matches it, all or nothing.

KEYS[i]    state key of limit i, for i = 1..N
KEYS[N+1]  the idempotency record, when ARGV[2+6N] is "1"
           The filter gives every key of one call the same Redis Cluster hash
           tag, so the whole call runs on one slot.
Nonce    a call may put "~" and hex digits before ARGV[1]: it is taken out
         first (the ARGV below are what is left) and given back first in a
         table reply (docs/src/running/failures.md: a reply the filter can tell
         is its own).
ARGV[1]  N, the number of limits
ARGV per limit i, six values starting at 2 + (i-1)*6:
  algorithm  "tb"   token bucket (one string)
             "sw"   sliding-window log (one sorted set)
             "gcra" GCRA (one string: the theoretical arrival time)
             "fw"   fixed window aligned to the epoch (one string)
             "swc"  sliding-window counter (one hash)
             "cc"   concurrency: requests in flight (one sorted set)
             "cq"   calendar quota (one string per window: lua/quota.lua)
  a          tb: capacity (tokens)           sw, fw, swc: limit (units per window)
             gcra: burst (units)             cc: max (slots)
             cq: amount (units per window)
  b          tb: refill (tokens per period)  sw, fw, swc: window (ms)
             gcra: rate (units per period)   cc: lease (ms); cq: 0
  c          tb, gcra: period (ms)           sw, fw, swc: ignored (0)
             cc: the request's slot id (hex; see lua/concurrency.lua)
             cq: the window edges (four ms, comma-separated), then, for a
             cq+o limit of a month or a week, `@<sent>,<default>,<max>`:
             the anchor day they were computed for (lua/quota.lua)
  cost       units this request spends (1 <= cost <= capacity, burst or
             limit; a larger cost is a rejection that writes nothing, see
             each kind's file)
  enforce    "1": a rejection rejects the request; "0": shadow, reported only;
             a whole number of ms from 1000 to 2^42 (not for cc): as "1",
             and a rejection by this limit blocks its key for that long: a
             key `:bl:` in place of the state key's `:rl:` (same hash tag,
             lua/keys.lua), SET with that PX; while it lives the limit
             rejects the key with retry_ms = reset_ms = its PTTL, without
             reading its state. Its negative (a usage-based limit): the
             block is honoured the same way, but only lua/settle.lua starts
             it (a rejection may be due to reserves of running requests)
  algorithm  may carry `+o` (tb, sw, fw, swc, cq, cc): the limit takes overrides;
             the script reads the key's override (lua/keys.lua
             override_key) and, when it parses within the kind's bounds and
             leaves room for the cost, decides with its figures: the
             verdict's `allowed` then adds 2 (4 when one is stored but
             ignored)
  gcra, fw, swc and cc take whole numbers within the bounds their files' headers
  give (the filter's config validation keeps them there); numbers that
  would corrupt a key are an error reply, and nothing is written.
ARGV[2+6N]  "1" if the request carries an idempotency key, else "0" or absent;
            then owner token, request fingerprint, lock TTL (ms): see
            lua/idempotency.lua

Returns a flat array (Webdis' raw output cannot carry nested arrays):
  [1]  the verdict:
       1  admitted: every limit charged; the idempotency lock (if any) is ours
       0  rejected by a rate limit: nothing written, no lock taken
       2  another request holds the key's lock: [2, lock PTTL ms]
       3  the key completed before: [3, status, stored headers, stored body],
          or, for a body in the object store, [3, status, stored headers, "",
          object key, SHA-256 hex, length]
       4  the key was used with another request fingerprint: [4]
       5  a stored override puts a quota's windows on another anchor day
          than its edges': [5, limit index (1-based), anchor day, ...] for
          each such limit; nothing read or written for the idempotency key,
          nothing charged: the filter sends the request again with edges
          for that day (answered before 2, 3 and 4)
       (2, 3 and 4 are answered before any limit is looked at: a replay or a
       conflict spends no quota)
  for 0 and 1, then 4 integers per limit, in KEYS order:
    allowed    1 if this limit alone would admit the request
    remaining  units left after this request (after the charge, if charged)
    retry_ms   0 when allowed; otherwise ms until this limit could admit it
    reset_ms   allowed: ms until the limit is fully restored (for the token
               bucket: full again; for the window: its newest member gone;
               gcra: the theoretical arrival time reached; fw: the window's
               end; swc: the estimate back to 0; cc: always 0, capacity
               comes back when requests end), which is also the key's
               TTL after a charge (cc: its lease); not charged (another limit rejected): the
               same for the state as it stands, 0 if already restored;
               rejected: equal to retry_ms, so Retry-After and the reset agree
               (cc: reset 0, retry_ms 1000)

  then, for 0 and 1, after every limit's four: two integers per limit a
  stored plan decided (its `allowed` holds the +2), in KEYS order: the
  plan's a and b as it applied them (tb: capacity, refill; fw, swc, sw:
  limit, 0; cq: amount, 0; cc: max, 0), so the filter states the
  customer's own quota in its headers without another call

All-or-nothing: nothing is written unless every enforced limit admits the
request, so a rejected request costs nothing. Then every limit that admits it
is charged (a shadow limit that would reject is reported, not charged).

Composition: src/scripts.rs sends this preamble, lua/nonce.lua, lua/wire.lua,
then (each defined only when a call meets its kind) lua/token_bucket.lua,
lua/sliding_window.lua, lua/gcra.lua, lua/fixed_window.lua,
lua/sliding_window_counter.lua, lua/concurrency.lua, lua/idempotency.lua and the driver in
lua/decide.lua as one script (one SHA-1), so one EVALSHA decides every limit
atomically. Charges of the kinds that keep a per-run cache are written by
flush_all() just before the reply.

Clock: Redis TIME, read once; the proxies' clocks are never used, so every
Envoy instance sees one time line. Every key written gets a PEXPIRE equal to
the time after which its state is indistinguishable from a fresh key.
]]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- @@ALGORITHMS@@

local reply = decide(KEYS, ARGV)
flush_all()
return echo(reply)
