"""Where a batched decision's Redis microseconds go (part of `make bench-tier`).

Runs lua/batch.lua, as the filter composes it, and variants of it cut short
at successive points, on the token-bucket batches `redis-guard wire` wrote
for the tier's runs (the filter's own packed calls), pipelined straight into
Redis (no Webdis: what is measured is the script, from INFO commandstats'
usec per call). The differences between the variants are the cost of each
step, per decision:

* the script's setup per call: its clock, and every kind's functions defined
  (a script cannot keep state between calls);
* unpacking each member from the packed argument into the values
  lua/ratelimit.lua's ARGV would hold, and checking them (`malformed()`);
* the member's decision (`lone_bucket()` for these members, a lone token
  bucket: the check with its GET, the verdict table, the reply values;
  the token bucket's functions are defined here, at the first member that
  needs them);
* writing what was charged (`flush_all()`: one SET with PX per key).

A raw variant runs only the two commands a token bucket needs (GET, and SET
with PX) per member: the floor of the state layout. A hash variant runs the
three the layout before it needed (HMGET, HSET, PEXPIRE), which says what the
one-string state saves.

The same for a lone request's lua/ratelimit.lua on the lone calls: its clock,
its definitions (a kind's functions only once a call needs the kind), the
one decision, and its writes.
"""
import re
import statistics
import time
from urllib.parse import unquote_to_bytes

import bench as B

CALLS = 3000
# Each variant runs this many times, the variants taking turns, and the
# median is reported: on this shared machine one run of a variant can be
# 40% off the next.
ROUNDS = 5


def read_calls(path):
    """The Webdis requests of a `redis-guard wire` file, as EVALSHA argument
    lists (a PUT's path segments, percent-decoded, then its body)."""
    data = path.read_bytes()
    calls, pos = [], 0
    while pos < len(data) and len(calls) < CALLS:
        nl = data.index(b"\n", pos)
        method, target, n = data[pos:nl].decode().split()
        body = data[nl + 1:nl + 1 + int(n)]
        pos = nl + 1 + int(n)
        if method == "PUT":
            parts = target.lstrip("/").removesuffix(".raw").split("/")
            calls.append([unquote_to_bytes(p) for p in parts] + [body])
        else:
            # A lone request: POST / with the whole command as the body.
            parts = body.decode().removesuffix(".raw").split("/")
            calls.append([unquote_to_bytes(p) for p in parts])
    return calls


def resp(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def per_call_us(r, script, calls):
    sha = r.cmd("SCRIPT", "LOAD", script)
    r.cmd("FLUSHALL")
    r.cmd("CONFIG", "RESETSTAT")
    # Each call as the filter sent it, naming this variant instead.
    r.sock.sendall(b"".join(resp([c[0], sha.encode()] + c[2:]) for c in calls))
    for _ in calls:
        r._reply()
    stat = r.info("commandstats")["cmdstat_evalsha"]
    n, usec = map(int, re.search(r"calls=(\d+),usec=(\d+)", stat).groups())
    return usec / n


def medians(r, named, calls):
    """[(name, median µs per call)] of each (name, script) in `named`, the
    variants taking turns for ROUNDS rounds."""
    samples = {name: [] for name, _ in named}
    for _ in range(ROUNDS):
        for name, src in named:
            samples[name].append(per_call_us(r, src, calls))
    return [(name, statistics.median(samples[name])) for name, _ in named]


def without_writes(src):
    """`src` without its call of flush_all() (which writes what was charged)."""
    cut = src.replace("\nflush_all()\n", "\n")
    if cut == src:
        raise B.BenchError("the script has no flush_all() to leave out")
    return cut


def variants(batch_src):
    pre, _ = batch_src.split("local out = { m }")
    head = batch_src.split("local kinds = {")[0]
    raw = ("for j = 1, m do local k = alone_key[j]; local v = redis.call('GET', k); "
           "if v then struct.unpack('<dd', v) end; "
           "redis.call('SET', k, struct.pack('<dd', 100, 200), 'PX', 1000) end\n")
    # Each variant runs on an empty Redis (per_call_us), so the hashes meet
    # no string the other variants wrote.
    hashed = ("for j = 1, m do local k = alone_key[j]; redis.call('HMGET', k, 'c', 't'); "
              "redis.call('HSET', k, 'c', '100', 't', '200'); redis.call('PEXPIRE', k, 1000) end\n")
    return [
        ("empty script", "return 1\n"),
        ("setup: clock and definitions", head + "\nreturn 1\n"),
        ("+ members unpacked and checked", pre + "return 1\n"),
        ("+ decisions, no writes", without_writes(batch_src)),
        ("+ writes: the whole script", batch_src),
        ("raw: unpacked and checked + GET, SET PX per member", pre + raw + "return 1\n"),
        ("raw, the hash layout: + HMGET, HSET, PEXPIRE", pre + hashed + "return 1\n"),
    ]


def private_redis(name):
    """A Redis of the profile's own, persistence off: (process, client)."""
    port = B.free_ports(1)[0]
    p = B.spawn(f"redis-server ({name})", [
        "redis-server", "--port", str(port), "--bind", B.HOST, "--save", "", "--appendonly",
        "no", "--daemonize", "no"], B.RUN / f"tier-{name}-redis.out")
    if not B.wait_port(p, port):
        raise B.BenchError(f"redis-server ({name}) did not start")
    return p, B.Redis(port)


def single_variants(src):
    """lua/ratelimit.lua (a lone request's script) cut short: what its
    clock, its definitions and its one decision each cost."""
    head = src.split("local reply = decide(KEYS, ARGV)")[0]
    clock = head[:head.index("local function")]
    return [
        ("empty script", "return 1\n"),
        ("+ the clock (TIME)", clock + "\nreturn 1\n"),
        ("+ the definitions (a kind's when the decision needs it: the bucket's in the next row)",
         head + "\nreturn 1\n"),
        ("+ the decision, no writes", without_writes(src)),
        ("+ its writes: the whole script", src),
    ]


def single_profile(src, calls_file):
    """[(step, µs per call)] for lone token-bucket requests, on a private
    Redis, replaying the `redis-guard wire` file of lone calls."""
    p, r = private_redis("single-profile")
    try:
        calls = read_calls(calls_file)
        return medians(r, single_variants(src), calls)
    finally:
        r.close()
        B.stop(p)


def single_markdown(rows):
    lines = ["### Where a lone request's Lua time goes", "",
             "`lua/ratelimit.lua` cut short at each step, on the lone token-bucket calls "
             f"`redis-guard wire` wrote, pipelined straight into Redis ({CALLS} calls, INFO "
             f"commandstats µs per call, the median of {ROUNDS} runs taking turns; no Webdis). "
             "Each row adds one step.", "",
             "| step | µs per call |", "|---|---|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in rows]
    return lines


def profile(batch_src, calls_files):
    """{members: [(step, µs per call, µs per decision)]} on a private Redis,
    for each {members: path of a token-bucket `wire` file}."""
    p, r = private_redis("profile")
    out = {}
    try:
        for m, path in sorted(calls_files.items()):
            calls = read_calls(path)
            out[m] = [(name, us, us / m) for name, us in medians(r, variants(batch_src), calls)]
    finally:
        r.close()
        B.stop(p)
    return out


def markdown(prof):
    lines = ["### Where a batched decision's Lua time goes", "",
             "`lua/batch.lua` and variants of it cut short at each step, on the token-bucket "
             f"batches `redis-guard wire` wrote, pipelined straight into Redis ({CALLS} calls "
             f"each, INFO commandstats µs per call, the median of {ROUNDS} runs taking turns; no "
             "Webdis). Each row adds one step; per decision = per call / members.", "",
             "| step | " + " | ".join(f"{m} per call: µs/call, µs/decision" for m in prof) + " |",
             "|---|" + "---|" * len(prof)]
    names = [n for n, _, _ in next(iter(prof.values()))]
    for i, name in enumerate(names):
        cells = [f"{prof[m][i][1]:.1f}, {prof[m][i][2]:.2f}" for m in prof]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    out = B.ROOT / "target" / "bench-tier"
    files = {m: out / f"tb-{m}.calls" for m in (8, 32) if (out / f"tb-{m}.calls").exists()}
    B.RUN.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        print("\n".join(markdown(profile((out / "batch.lua").read_text(), files))))
        if (out / "tb-1.calls").exists():
            rows = single_profile((out / "ratelimit.lua").read_text(), out / "tb-1.calls")
            print("\n".join(single_markdown(rows)))
    finally:
        B.stop_all()
    print(f"({time.monotonic() - started:.0f} s)")
