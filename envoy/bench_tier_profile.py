"""Where a batched decision's Redis microseconds go (part of `make bench-tier`).

Runs lua/batch.lua, as the filter composes it, and variants of it cut short
at successive points, on the same token-bucket batches, pipelined straight
into Redis (no Webdis: what is measured is the script, from INFO
commandstats' usec per call). The differences between the variants are the
cost of each step, per decision:

* the script's setup per call: its clock, and every kind's functions defined
  (a script cannot keep state between calls);
* reading and checking each member's ARGV strings (`malformed()`);
* the member's decision (`decide_checked()`: the kind's check with its
  HMGET, the verdict tables, the reply values);
* writing what was charged (`flush_all()`: HSET and PEXPIRE per key).

A raw variant runs only the three commands a token bucket needs (HMGET,
HSET, PEXPIRE) per member: the floor of the current state layout.
"""
import re
import time

import bench as B

MEMBERS = (1, 8, 32)
CALLS = 3000


def tb_member(i):
    key = f"rg:rl:{{e3b0c44298fc1c14}}:tb:tb.100000000.100000000.1000:4:u{i}"
    return [key], ["1", "tb", "100000000", "100000000", "1000", "1", "1"]


def batch_args(m, start):
    keys, argv = [], [str(m)]
    members = [tb_member((start + j) % 10_000) for j in range(m)]
    for k, a in members:
        argv += [str(len(k)), str(len(a))]
    for k, a in members:
        keys += k
        argv += a
    return keys, argv


def resp(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def per_call_us(r, script, m):
    sha = r.cmd("SCRIPT", "LOAD", script)
    r.cmd("FLUSHALL")
    r.cmd("CONFIG", "RESETSTAT")
    data = []
    for c in range(CALLS):
        keys, argv = batch_args(m, c * m)
        data.append(resp(["EVALSHA", sha, str(len(keys)), *keys, *argv]))
    r.sock.sendall(b"".join(data))
    for _ in range(CALLS):
        r._reply()
    stat = r.info("commandstats")["cmdstat_evalsha"]
    calls, usec = map(int, re.search(r"calls=(\d+),usec=(\d+)", stat).groups())
    return usec / calls


def variants(batch_src):
    pre, _ = batch_src.split("local out = { m }")
    head = batch_src.split("local m = tonumber(ARGV[1])")[0]
    raw = ("for j = 1, m do local k = KEYS[ko[j] + 1]; redis.call('HMGET', k, 'c', 't'); "
           "redis.call('HSET', k, 'c', '100', 't', '200'); redis.call('PEXPIRE', k, 1000) end\n")
    return [
        ("empty script", "return 1\n"),
        ("setup: clock and definitions", head + "\nreturn 1\n"),
        ("+ members' ARGV read and checked", pre + "return 1\n"),
        ("+ decisions, no writes", pre + "for j = 1, m do decide_checked(KEYS, ko[j], ARGV, "
                                         "ao[j], na[j]) end\nreturn 1\n"),
        ("+ writes: the whole script", batch_src),
        ("raw: checked ARGV + HMGET, HSET, PEXPIRE per member", pre + raw + "return 1\n"),
    ]


def profile(batch_src):
    """{members: [(step, µs per call, µs per decision)]} on a private Redis."""
    port = B.free_ports(1)[0]
    p = B.spawn("redis-server (profile)", [
        "redis-server", "--port", str(port), "--bind", B.HOST, "--save", "", "--appendonly",
        "no", "--daemonize", "no"], B.RUN / "tier-profile-redis.out")
    if not B.wait_port(p, port):
        raise B.BenchError("redis-server (profile) did not start")
    r = B.Redis(port)
    out = {}
    try:
        for m in MEMBERS:
            rows = []
            for name, src in variants(batch_src):
                us = per_call_us(r, src, m)
                rows.append((name, us, us / m))
            out[m] = rows
    finally:
        r.close()
        B.stop(p)
    return out


def markdown(prof):
    lines = ["### Where a batched decision's Lua time goes", "",
             "`lua/batch.lua` and variants of it cut short at each step, on token-bucket batches "
             f"pipelined straight into Redis ({CALLS} calls each, INFO commandstats µs per call; "
             "no Webdis). Each row adds one step; per decision = per call / members.", "",
             "| step | " + " | ".join(f"{m} per call: µs/call, µs/decision" for m in prof) + " |",
             "|---|" + "---|" * len(prof)]
    names = [n for n, _, _ in next(iter(prof.values()))]
    for i, name in enumerate(names):
        cells = [f"{prof[m][i][1]:.1f}, {prof[m][i][2]:.2f}" for m in prof]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    src = (B.ROOT / "target" / "bench-tier" / "batch.lua").read_text()
    B.RUN.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        print("\n".join(markdown(profile(src))))
    finally:
        B.stop_all()
    print(f"({time.monotonic() - started:.0f} s)")
