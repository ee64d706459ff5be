#!/usr/bin/env python3
"""The batch script's Lua against the same state commands sent bare (one of
`make bench-tier`'s modules, run on its own: `python3 envoy/bench_tier_lua.py`
after `make cli`, about a minute; issue 56 goal 2). docs/src/notes/2026-12-08.md
holds its first runs.

On a private redis-server (no Webdis: what is compared is Redis' own work,
and Webdis would only add its CPU and its connections to the noise), for the
token-bucket batches `redis-guard wire` writes (the filter's own packed
calls), pipelined straight in:

* the script: lua/batch.lua as the filter composes it (and, with --also,
  other composed versions of it, e.g. the one before a change), each call
  as the filter sent it;
* bare: the state commands a bucket needs, as plain commands pipelined
  (MULTI-less): the one TIME per call, and per member the GET of its bucket
  and the SET ... PX of its new state.

Per variant, per decision: Redis' CPU (INFO cpu, the process' user + system
time, which the machine's other load inflates far less than wall-clock
times), and INFO commandstats' usec of the script and of the commands it ran
inside (wall clock: on a loaded machine they include the time Redis was not
on a core). The Lua's cost is the script's Redis CPU minus the bare
commands'. Every variant runs ROUNDS times, taking turns, on an empty Redis;
the median is reported.

The goal (issue 56): the Lua's cost per decision at 8 per call at most the
Redis CPU per decision of the bare commands.
"""
import argparse
import json
import re
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench as B  # noqa: E402
import bench_tier  # noqa: E402
from bench_tier_files import OUT, calls_path  # noqa: E402
from bench_tier_profile import private_redis, read_calls, resp  # noqa: E402

ROUNDS = 7
# The script's own entry points and this module's housekeeping, left out of
# the commands a script ran inside.
OUTER = {"evalsha", "eval", "info", "config|resetstat", "config", "flushall", "script",
         "script|load", "ping"}


def held_case(members):
    """Buckets that stay partly spent: a token an hour, so every member but a
    key's first reads and rewrites a bucket that exists (bench_tier's `tb`
    and `tbh` both refill a token within 1 ms: their keys are gone again by
    the next call)."""
    params = {"tokenBucket": {"capacity": 100_000_000, "refill": 1, "periodMs": 3_600_000}}
    return [{"id": f"held-{members}", "what": "token bucket, held", "members": members,
             "config": bench_tier.filter_config([bench_tier.limit("held", params)])}]


def member_keys(packed):
    """The key of each member's first limit in a packed batch (lua/batch.lua's
    layout, version 3), in member order."""
    version, np = struct.unpack_from(">BH", packed, 0)
    if version != 3:
        raise B.BenchError(f"packed batch version {version}")
    pos = 3
    kinds = []
    for _ in range(np):
        kinds.append(packed[pos] & 127)
        pos += 1 + 32
    (m,) = struct.unpack_from(">H", packed, pos)
    pos += 2
    firsts = []
    for _ in range(m):
        (n,) = struct.unpack_from(">H", packed, pos)
        pos += 2
        first = None
        for _ in range(n):
            p, k = struct.unpack_from(">HH", packed, pos)
            pos += 12
            if kinds[p - 1] in (6, 7):
                (ln,) = struct.unpack_from(">H", packed, pos)
                pos += 2 + ln
            first = first or k
        keyed = packed[pos]
        pos += 1
        if keyed:
            pos += 2
            for _ in range(2):
                (ln,) = struct.unpack_from(">H", packed, pos)
                pos += 2 + ln
            pos += 8
        firsts.append(first)
    (nk,) = struct.unpack_from(">H", packed, pos)
    pos += 2
    keys, prev = [], b""
    for _ in range(nk):
        shared, ln = struct.unpack_from(">HH", packed, pos)
        pos += 4
        prev = prev[:shared] + packed[pos:pos + ln]
        pos += ln
        keys.append(prev)
    return [keys[k - 1] for k in firsts]


def bare_pipeline(calls, ttl_ms):
    """The state commands of `calls` (EVALSHA argument lists of packed
    batches), bare: TIME per call, GET and SET ... PX per member."""
    state = struct.pack("<dd", 100.0, 200.0)
    out = []
    for c in calls:
        out.append(resp([b"TIME"]))
        for k in member_keys(c[-1]):
            out.append(resp([b"GET", k]))
            out.append(resp([b"SET", k, state, b"PX", str(ttl_ms).encode()]))
    return b"".join(out), len(out)


def stats(r):
    """{command: (calls, usec)} from INFO commandstats."""
    out = {}
    for k, v in r.info("commandstats").items():
        m = re.search(r"calls=(\d+),usec=(\d+)", v)
        if k.startswith("cmdstat_") and m:
            out[k[len("cmdstat_"):]] = (int(m.group(1)), int(m.group(2)))
    return out


def run_once(r, payload, replies, decisions):
    """Redis' figures per decision for one pipelined run of `payload`."""
    r.cmd("FLUSHALL")
    r.cmd("CONFIG", "RESETSTAT")
    cpu0 = r.cpu_us()
    r.sock.sendall(payload)
    for _ in range(replies):
        r._reply()
    cpu1 = r.cpu_us()
    s = stats(r)
    script = sum(u for c, (_, u) in s.items() if c in ("evalsha", "eval"))
    inner = sum(u for c, (_, u) in s.items() if c not in OUTER)
    counts = {c: n / decisions for c, (n, _) in s.items() if c not in OUTER}
    return {"cpu_us": (cpu1 - cpu0) / decisions, "script_us": script / decisions,
            "commands_us": inner / decisions,
            "lua_us": (script - inner) / decisions if script else 0.0, "per_decision": counts}


def measure(r, scripts, calls, members, ttl):
    """{variant: median figures} for each (name, composed source) in
    `scripts` and the bare commands, taking turns for ROUNDS rounds."""
    decisions = len(calls) * members
    runs = []
    for name, src in scripts:
        sha = r.cmd("SCRIPT", "LOAD", src).encode()
        payload = b"".join(resp([c[0], sha] + c[2:]) for c in calls)
        runs.append((name, payload, len(calls)))
    samples = {name: [] for name, _, _ in runs}
    # Bare: one read and one write per member, what a bucket's state needs
    # (the script's PTTL of a missing bucket's older hash is left out: the
    # floor is what is compared). TTL: 1 ms where the case's buckets are
    # full again by the next call, an hour where they are held.
    payload, n = bare_pipeline(calls, ttl)
    bare = "bare: TIME per call; GET, SET PX per member"
    runs.append((bare, payload, n))
    samples[bare] = []
    for _ in range(ROUNDS):
        for name, payload, n in runs:
            samples[name].append(run_once(r, payload, n, decisions))
    out = {}
    for name, got in samples.items():
        med = {k: statistics.median(g[k] for g in got)
               for k in ("cpu_us", "script_us", "commands_us", "lua_us")}
        med["per_decision"] = got[-1]["per_decision"]
        med["bare"] = name == bare
        out[name] = med
    return out


def markdown(results, meta):
    lines = ["### The batch script's Lua against the same commands sent bare", "",
             f"Measured {meta['date']}, commit {meta['commit']}, Redis {meta['redis']}, on a "
             f"private redis-server (no Webdis), `python3 envoy/bench_tier_lua.py "
             f"{meta['args']}` (load average {meta['loadavg']} at the start): the filter's "
             f"packed token-bucket calls (`redis-guard wire`, {meta['calls']} calls of "
             f"{meta['members']} per case) pipelined straight in, each variant {ROUNDS} times "
             "taking turns on an empty Redis, medians. µs per decision. *Redis CPU* is INFO "
             "cpu (the process' own user + system time); *Lua's cost* is the script's Redis CPU "
             "minus the bare commands' (what running the state commands through the script "
             "adds). *script usec* and *its commands' usec* are INFO commandstats, wall-clock "
             "time inside each command, which the machine's other load inflates.", "",
             "| case | variant | Redis CPU | Lua's cost | Lua's cost / bare | script usec "
             "| its commands' usec | commands per decision |",
             "|---|---|---|---|---|---|---|---|"]
    for case, res in results.items():
        bare = next(v for v in res.values() if v["bare"])
        for name, v in res.items():
            cmds = ", ".join(f"{c} {n:.2f}" for c, n in sorted(v["per_decision"].items()))
            if v["bare"]:
                cost = ratio = script = ""
            else:
                extra = v["cpu_us"] - bare["cpu_us"]
                cost, ratio = f"{extra:.2f}", f"{extra / bare['cpu_us']:.2f}"
                script = f"{v['script_us']:.2f}"
            lines.append(f"| {case} | {name} | {v['cpu_us']:.2f} | {cost} | {ratio} | {script} | "
                         f"{v['commands_us']:.2f} | {cmds} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default="tb,held", help="token-bucket case ids of bench_tier")
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--also", action="append", default=[], metavar="NAME=PATH",
                    help="another composed batch script to measure alongside")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--load-json", metavar="PATH",
                    help="print the table of an earlier --json file, measuring nothing")
    args = ap.parse_args()
    if args.load_json:
        saved = json.loads(Path(args.load_json).read_text())
        print("\n".join(markdown(saved["results"], saved["meta"])))
        return
    OUT.mkdir(parents=True, exist_ok=True)
    B.RUN.mkdir(parents=True, exist_ok=True)
    todo = [c for c in bench_tier.cases([args.members]) + held_case(args.members)
            if c["id"].split("-")[0] in args.kinds.split(",") and "+" not in c["id"]]
    for c in todo:
        bench_tier.write_calls(c, max(args.calls, 200))
    scripts = [("lua/batch.lua", (OUT / "batch.lua").read_text())]
    for spec in args.also:
        name, path = spec.split("=", 1)
        scripts.append((name, Path(path).read_text()))
    p, r = private_redis("lua")
    results = {}
    try:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=B.ROOT,
                                         capture_output=True, text=True).stdout.strip(),
                "redis": r.info("server").get("redis_version"), "calls": args.calls,
                "members": args.members,
                "loadavg": " ".join(open("/proc/loadavg").read().split()[:3]),
                "args": " ".join(sys.argv[1:])}
        for c in todo:
            calls = read_calls(calls_path(c["id"]))[:args.calls]
            B.log(f"{c['id']}: {len(calls)} calls of {args.members}")
            ttl = 3_600_000 if c["id"].startswith("held") else 1
            results[c["id"]] = measure(r, scripts, calls, args.members, ttl)
    finally:
        r.close()
        B.stop(p)
    text = "\n".join(markdown(results, meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(text)


if __name__ == "__main__":
    try:
        main()
    except B.BenchError as e:
        print(f"bench-tier lua: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        B.stop_all()
