#!/usr/bin/env python3
"""make bench-tier: the capacity of the shared tier (Webdis and Redis), which
every Envoy of a fleet decides through.

Drives Webdis -> Redis with the exact calls the filter sends, written by the
filter's own encoding code (`redis-guard wire`, the native crate the CLI
uses), for every limit kind at 1 (a worker's lone request, lua/ratelimit.lua)
and 8 and 32 members (a worker's batch, lua/batch.lua), and a request with
two limits and an idempotency key (keyed requests are never batched). Per
case:

* at saturation (wrk -t2 -c32): decisions/s, Redis CPU per decision (INFO
  cpu), Lua per call and per decision (INFO commandstats: the script and the
  commands inside it), Webdis CPU per decision (/proc), bytes of request
  body per decision;
* paced at 50% and 80% of that rate (wrk's delay()): the rate reached,
  Redis' utilisation (its CPU seconds per second), Redis' own latency p50
  and p99 of the calls (INFO latencystats) and wrk's end to end through
  Webdis.

Writes target/bench-tier/results.json and .md, tier.png, and the section of
BENCHMARKS.md between its markers. Not part of `make test`: a measurement.
The decisions all admit (the limits are far larger than the load), so what
is measured is the cost of a charge, the common case.
"""
import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench as B  # noqa: E402  (the stack helpers: spawn, ports, Redis client)
import bench_tier_cluster  # noqa: E402
from bench_tier_files import CLI, OUT, calls_path  # noqa: E402
import bench_tier_profile  # noqa: E402
import bench_tier_valkey  # noqa: E402

MARK_START = "<!-- bench-tier:start -->"
MARK_END = "<!-- bench-tier:end -->"
KEYS = 10_000  # descriptor values the requests spread over
CONNS = 32
# Bytes per decision of the encoding before the packed batch (one string per
# value, percent-encoded; the first bench-tier run, commit f62a8c6): the
# report compares the packed batch's with these.
BYTES_BEFORE = {8: 131, 32: 126}

BIG = 100_000_000
KINDS = {
    # A refill of 10^8 a second fills a bucket 1 ms after its charge: every
    # call meets an absent key (the bucket's first charge).
    "tb": ("token bucket", {"tokenBucket": {"capacity": BIG, "refill": BIG, "periodMs": 1000}}),
    # Steady traffic meets held buckets instead: 1,000 a second never
    # refills 10^8, so after the first pass over the keys every call reads
    # and rewrites a partly spent bucket that exists.
    "tbh": ("token bucket, held (partly spent)",
            {"tokenBucket": {"capacity": BIG, "refill": 1000, "periodMs": 1000}}),
    "gcra": ("GCRA", {"gcra": {"rate": 1_000_000, "periodMs": 1000, "burst": 1_000_000}}),
    "sw": ("sliding-window log", {"slidingWindow": {"limit": 1_000_000, "windowMs": 1000}}),
    "fw": ("fixed window", {"fixedWindow": {"limit": BIG, "windowMs": 1000}}),
    "swc": ("sliding-window counter", {"slidingWindowCounter": {"limit": BIG, "windowMs": 1000}}),
    # A short lease keeps each key's set small: the bench never releases,
    # the filter would at each response's end (another, smaller call).
    "cc": ("concurrency", {"concurrency": {"max": 1000, "leaseMs": 300}}),
}

WRK_LUA = r"""
local reqs, idx, pause = {}, 0, 0
function init(args)
  local f = assert(io.open(args[1], "rb"))
  local data = f:read("*a"); f:close()
  local pos = 1
  while pos <= #data do
    local nl = data:find("\n", pos, true)
    local method, path, len = data:sub(pos, nl - 1):match("^(%S+) (%S+) (%d+)$")
    len = tonumber(len)
    reqs[#reqs + 1] = wrk.format(method, path, {["Authorization"] = args[2]},
                                 data:sub(nl + 1, nl + len))
    pos = nl + 1 + len
  end
  idx = math.random(#reqs)
  pause = tonumber(args[3])
end
function request()
  idx = idx % #reqs + 1
  return reqs[idx]
end
function delay()
  return pause
end
function done(summary, latency, requests)
  io.write(string.format("LAT %d %d %d\n", latency:percentile(50), latency:percentile(99),
                         summary.errors.status))
end
"""


def filter_config(limits, idempotency=None):
    cfg = {"redis": {"cluster": "webdis", "timeoutMs": 50}, "limits": limits}
    if idempotency:
        cfg["idempotency"] = idempotency
    return cfg


def limit(name, params):
    return {"name": name, "descriptor": [{"header": "x-user"}], **params}


def cases(members):
    out = []
    for kid, (what, params) in KINDS.items():
        for m in members:
            out.append({"id": f"{kid}-{m}", "what": what, "members": m,
                        "config": filter_config([limit(kid, params)])})
    keyed = filter_config(
        [limit("tb", KINDS["tb"][1]), limit("fw", KINDS["fw"][1])],
        [{"name": "pay", "match": {"pathPrefix": "/"}, "tenant": [{"header": "x-user"}],
          "lockTtlMs": 1000}])
    out.append({"id": "tb+fw+idem-1", "what": "token bucket + fixed window + idempotency acquire",
                "members": 1, "config": keyed, "rule": "pay"})
    return out


def write_calls(case, calls):
    cfg = OUT / f"{case['id']}.json"
    cfg.write_text(json.dumps(case["config"]))
    out = calls_path(case["id"])
    args = [str(CLI), "--json", "wire", "--config", str(cfg), "--value", "x-user=u{i}",
            "--value", "path=/", "--value", "method=POST", "--distinct", str(KEYS),
            "--members", str(case["members"]), "--calls", str(calls), "--out", str(out),
            "--scripts", str(OUT)]
    if case.get("rule"):
        args += ["--rule", case["rule"]]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise B.BenchError(f"redis-guard wire: {r.stdout}{r.stderr}")
    info = json.loads(r.stdout)
    case["bytes_per_decision"] = info["wireBytes"] / info["requests"]
    return out


class Tier:
    def __init__(self, server="redis-server"):
        self.redis_port, self.webdis_port = B.free_ports(2)
        self.redis = B.spawn(Path(server).name, [
            server, "--port", str(self.redis_port), "--bind", B.HOST, "--save", "",
            "--appendonly", "no", "--dir", str(B.RUN), "--logfile", str(B.RUN / "tier-redis.log"),
            "--daemonize", "no"], B.RUN / "tier-redis.out")
        if not B.wait_port(self.redis, self.redis_port):
            raise B.BenchError("redis-server did not start")
        self.r = B.Redis(self.redis_port)
        creds = B.RUN / "tier-webdis.env"
        sets = {"REDIS_HOST": B.HOST, "REDIS_PORT": self.redis_port, "REDIS_AUTH": "null",
                "BIND_ADDRESS": B.HOST, "WEBDIS_PORT": self.webdis_port,
                "WEBDIS_LOG": B.RUN / "tier-webdis.log"}
        out_dir = B.RUN / "tier"
        out_dir.mkdir(exist_ok=True)
        args = [sys.executable, str(B.ROOT / "envoy/render.py"), "--out", str(out_dir),
                "--webdis-credentials", str(creds)]
        for k, v in sets.items():
            args += ["--set", f"{k}={v}"]
        args.append(str(B.ROOT / "envoy/webdis.json"))
        r = subprocess.run(args, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise B.BenchError(f"render.py: {r.stderr}")
        auth = re.search(r"REDIS_GUARD_WEBDIS_AUTHORIZATION=['\"]?([^'\"\n]+)", creds.read_text())
        self.authorization = auth.group(1)
        self.webdis = B.spawn("webdis", ["webdis", str(out_dir / "webdis.json")],
                              B.RUN / "tier-webdis.out")
        if not B.wait_port(self.webdis, self.webdis_port):
            raise B.BenchError("webdis did not start")

    def close(self):
        self.r.close()
        B.stop(self.webdis)
        B.stop(self.redis)

    def load_scripts(self):
        for name in ("ratelimit", "batch"):
            self.r.cmd("SCRIPT", "LOAD", (OUT / f"{name}.lua").read_text())

    def snapshot(self):
        stats = self.r.info("commandstats")
        lat = self.r.info("latencystats")
        calls = usec = 0
        for cmd in ("evalsha", "eval"):
            v = stats.get(f"cmdstat_{cmd}", "")
            m = re.search(r"calls=(\d+),usec=(\d+)", v)
            if m:
                calls += int(m.group(1))
                usec += int(m.group(2))
        return {"t": time.monotonic(), "cpu_us": self.r.cpu_us(), "calls": calls, "usec": usec,
                "webdis_ticks": B.cpu_ticks(self.webdis.pid),
                "latency": lat.get("latency_percentiles_usec_evalsha", ""),
                "errors": int(re.search(r"failed_calls=(\d+)", stats.get("cmdstat_evalsha", "")
                                        ).group(1)) if "cmdstat_evalsha" in stats else 0}

    def run(self, case, calls_file, seconds, pause_ms=0, conns=CONNS):
        self.r.cmd("CONFIG", "RESETSTAT")
        a = self.snapshot()
        wrk = subprocess.run(
            ["wrk", "-t2", f"-c{conns}", f"-d{seconds}s", "-s", str(OUT / "wrk.lua"),
             f"http://{B.HOST}:{self.webdis_port}/", "--", str(calls_file), self.authorization,
             str(pause_ms)], capture_output=True, text=True, timeout=seconds + 60)
        b = self.snapshot()
        lat = re.search(r"LAT (\d+) (\d+) (\d+)", wrk.stdout)
        if not lat:
            raise B.BenchError(f"wrk: {wrk.stdout}{wrk.stderr}")
        calls = b["calls"] - a["calls"]
        if calls == 0 or int(lat.group(3)) or b["errors"]:
            raise B.BenchError(f"{case['id']}: {calls} calls, {lat.group(3)} non-2xx, "
                               f"{b['errors']} failed scripts")
        decisions = calls * case["members"]
        wall = b["t"] - a["t"]
        p = dict(re.findall(r"(p[\d.]+)=([\d.]+)", b["latency"]))
        return {
            "decisions_per_s": decisions / wall,
            "calls_per_s": calls / wall,
            "redis_cpu_us_per_decision": (b["cpu_us"] - a["cpu_us"]) / decisions,
            "redis_utilisation": (b["cpu_us"] - a["cpu_us"]) / 1e6 / wall,
            "lua_us_per_call": (b["usec"] - a["usec"]) / calls,
            "lua_us_per_decision": (b["usec"] - a["usec"]) / decisions,
            "webdis_cpu_us_per_decision":
                (b["webdis_ticks"] - a["webdis_ticks"]) * 1e6 / B.CLK_TCK / decisions,
            "redis_p50_us": float(p.get("p50", 0)), "redis_p99_us": float(p.get("p99", 0)),
            "e2e_p50_us": int(lat.group(1)), "e2e_p99_us": int(lat.group(2)),
        }

    def quiet(self, limit_s=10.0):
        """Waits (bounded) until Redis has run no command and Webdis used no
        CPU for 100 ms: every call wrk left in flight has been answered and
        its reply written. Webdis 0.1.9 writes the reply of a call whose HTTP
        client hung up to that client's file descriptor, which a connection
        opened since may have been given (the book, Running it: When things fail), so the
        probe below must not overlap them."""
        deadline = time.monotonic() + limit_s
        last = None
        while time.monotonic() < deadline:
            n = (int(self.r.info("stats").get("total_commands_processed", 0)),
                 B.cpu_ticks(self.webdis.pid))
            # The INFO itself is one command.
            if last is not None and n == (last[0] + 1, last[1]):
                return
            last = n
            time.sleep(0.1)
        raise B.BenchError("Redis and Webdis never went quiet after the load")

    def verify(self, case, calls_file):
        """One call by hand: its reply is a verdict that admits every member.
        The call carries a nonce, as the filter's do (lua/nonce.lua): Webdis
        0.1.9 can answer a new connection with a reply meant for a client that
        hung up (the book, Running it: When things fail), even once Redis is quiet, so a
        reply without it is not this call's and the call is sent again, on
        an empty Redis (the lost call ran: a keyed one took its lock)."""
        data = calls_file.read_bytes()
        nl = data.index(b"\n")
        method, path, n = data[:nl].decode().split()
        body = data[nl + 1:nl + 1 + int(n)]
        for attempt in range(5):
            self.quiet()
            if attempt:
                self.r.cmd("FLUSHALL")
            nonce = "~" + secrets.token_hex(8)
            if method == "PUT":
                call_path, call_body = with_nonce(path, nonce), body
            else:
                call_path, call_body = path, with_nonce(body.decode(), nonce).encode()
            status, _, reply = B.hreq(self.webdis_port, method, call_path,
                                      {"Authorization": self.authorization}, call_body)
            text = reply.decode(errors="replace")
            values = [v.lstrip(":") for v in text.split("\r\n") if v and v[0] not in "*$"]
            # An error reply carries no nonce: it may be another call's as
            # well, so it is sent again too, and raised if it stays.
            mine = text.startswith("*") and values and values[0] == nonce
            if status == 200 and not mine and attempt < 4:
                B.log(f"  {case['id']}: Webdis answered the probe with another call's reply: "
                      f"{text[:80]!r}; sending it again")
                continue
            if status != 200 or not mine:
                raise B.BenchError(f"{case['id']}: HTTP {status}: {text[:200]}")
            # lua/ratelimit.lua: [1, ...]; lua/batch.lua: [M, len, 1, ...].
            values = values[1:]
            first = values[2] if case["members"] > 1 else values[0]
            if first != "1":
                raise B.BenchError(f"{case['id']}: not admitted: {text[:120]!r}")
            return


def with_nonce(command, nonce):
    """A Webdis command (`EVALSHA/<sha>/<n>/<n keys>/...`, a POST body or a
    PUT path, ending `.raw`) with `nonce` first in its ARGV."""
    stem = command.removesuffix(".raw")
    parts = stem.split("/")
    lead = 1 if parts[0] == "" else 0
    at = lead + 3 + int(parts[lead + 2])
    return "/".join(parts[:at] + [nonce] + parts[at:]) + ".raw"


def measure(tier, case, seconds):
    calls = calls_path(case["id"])
    tier.r.cmd("FLUSHALL")
    tier.load_scripts()
    tier.verify(case, calls)
    tier.run(case, calls, 1)  # warm-up: keys created, Webdis' connections open
    sat = tier.run(case, calls, seconds)
    paced = []
    for share in (0.5, 0.8):
        # Each of 8 connections sends, waits its pause, sends again: the
        # pause that makes `share` of the saturated call rate.
        conns = 8
        target = sat["calls_per_s"] * share
        pause = max(0, int(conns * 1000 / target - sat["e2e_p50_us"] / 1000))
        r = tier.run(case, calls, seconds, pause_ms=pause, conns=conns)
        r["share"] = share
        paced.append(r)
    return {"saturated": sat, "paced": paced}


def fleet_rows(res):
    """Envoys served at 70% of one Redis core, by per-Envoy rate."""
    rows = []
    for cid, label in (("tb-1", "lone requests (1 per call)"), ("tb-8", "batches of 8"),
                       ("tb-32", "batches of 32")):
        c = next((x for x in res["cases"] if x["id"] == cid), None)
        if not c:
            continue
        us = c["saturated"]["redis_cpu_us_per_decision"]
        cap = 0.7 * 1e6 / us
        rows.append((label, us, cap, [cap / rate for rate in (1000, 5000, 20000)]))
    return rows


def markdown(res):
    lines = [MARK_START, "## The shared tier (`make bench-tier`)", "",
             f"Measured {res['date']} on this machine ({res['cores']} cores, shared by wrk, Webdis "
             f"and Redis; load average at start {res['loadavg']}), commit {res['commit']}, Redis "
             f"{res['redis']}, Webdis with {res['webdis_threads']} threads, persistence off. "
             f"Calls written by `redis-guard wire` (the filter's own encoding), {KEYS} keys, "
             f"{res['seconds']} s per run. Saturation: `wrk -t2 -c{CONNS}` straight at Webdis.",
             "",
             "| case | members | decisions/s | Redis CPU µs/decision | Lua µs/call | Lua µs/decision "
             "| Webdis CPU µs/decision | bytes/decision | paced at ~50%: decisions/s, Redis util, "
             "p50/p99 µs (Redis; end to end) | paced at ~80%: the same |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["cases"]:
        s = c["saturated"]
        pc = []
        for p in c["paced"]:
            pc.append(f"{p['decisions_per_s']:,.0f}, {p['redis_utilisation']:.0%}, "
                      f"{p['redis_p50_us']:.0f}/"
                      f"{p['redis_p99_us']:.0f}; {p['e2e_p50_us']}/{p['e2e_p99_us']}")
        lines.append(f"| {c['what']} | {c['members']} | {s['decisions_per_s']:,.0f} | "
                     f"{s['redis_cpu_us_per_decision']:.1f} | {s['lua_us_per_call']:.1f} | "
                     f"{s['lua_us_per_decision']:.1f} | {s['webdis_cpu_us_per_decision']:.1f} | "
                     f"{c['bytes_per_decision']:.0f} | {pc[0]} | {pc[1]} |")
    lines += ["", "### Fleet table: Envoys one Redis core serves at 70% utilisation", "",
              "Capacity = 0.7 × 10^6 / (Redis CPU µs per decision, token bucket, above). A worker "
              "batches only while a call of its hash tag is out, so a quiet Envoy sends lone "
              "requests and a busy one batches (`make bench` (f)/(h)).", "",
              "| the Envoys send | Redis µs/decision | decisions/s at 70% | Envoys at 1k req/s "
              "| at 5k | at 20k |", "|---|---|---|---|---|---|"]
    for label, us, cap, envoys in fleet_rows(res):
        lines.append(f"| {label} | {us:.1f} | {cap:,.0f} | {envoys[0]:.0f} | {envoys[1]:.0f} | "
                     f"{envoys[2]:.1f} |")
    for r in res.get("cluster", []):
        # The cluster is full when its busiest master (share × cost) is at 70%.
        busiest = max(x["share"] * x["cpu_us_per_decision"] for x in r["masters"])
        mean = sum(x["cpu_us_per_decision"] for x in r["masters"]) / len(r["masters"])
        cap = 0.7 * 1e6 / busiest
        lines.append(f"| 3-master cluster, {r['members']} per call | {mean:.1f} per master | "
                     f"{cap:,.0f} | {cap / 1000:.0f} | {cap / 5000:.0f} | {cap / 20000:.1f} |")
    lines += ["", *packing(res), ""]
    lines += bench_tier_valkey.markdown(res)
    if res.get("cluster"):
        lines += bench_tier_cluster.markdown(res["cluster"]) + [""]
    if res.get("profile"):
        lines += bench_tier_profile.markdown({int(k): v for k, v in res["profile"].items()})
    if res.get("single_profile"):
        lines += [""] + bench_tier_profile.single_markdown(res["single_profile"])
    lines += ["", "Reading it: *saturation* is 32 connections with no pause; the paced runs (8 "
              "connections, each pausing between calls) aim at a share of its call rate but land "
              "where the pause allows, sometimes above it (fewer connections contend less for "
              "the 2 cores), so each cell gives the rate reached. Lone requests saturate Webdis "
              "and the machine before Redis (Redis near 50%): their Redis figures are its CPU "
              "per decision, not its ceiling. p50/p99 *Redis* is INFO latencystats of the "
              "script calls, *end to end* wrk's through Webdis.", "",
              "A cluster row of the fleet table is full when its busiest master is at 70% "
              "(its share of the calls × its µs per decision), so an uneven spread of tenants "
              "over the masters costs capacity.", "",
              "`target/bench-tier/tier.png` plots decisions/s against Redis utilisation and p99 "
              "(not committed). Reproduce: `make bench-tier` (about "
              f"{res['wall_s'] / 60:.0f} min).", MARK_END]
    return "\n".join(lines)


def packing(res):
    """The packed batch's bytes per decision against the encoding before it
    (BYTES_BEFORE), token bucket: a measured comparison."""
    parts = []
    for cid in ("tb-8", "tb-32"):
        c = next((c for c in res["cases"] if c["id"] == cid), None)
        if not c:
            continue
        before = BYTES_BEFORE[c["members"]]
        got = c["bytes_per_decision"]
        parts.append(f"{got:.0f} at {c['members']} members, {got / before:.2f}× the {before} "
                     "of the encoding before packing")
    if not parts:
        return []
    return ["Packed batches (token bucket), bytes per decision: " + "; ".join(parts)
            + " (one string per value, percent-encoded; measured at commit f62a8c6)."]


def write_benchmarks(text):
    path = B.ROOT / "BENCHMARKS.md"
    doc = path.read_text()
    if MARK_START in doc and MARK_END in doc:
        head, rest = doc.split(MARK_START, 1)
        doc = head + text + rest.split(MARK_END, 1)[1]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(doc)


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for c in res["cases"]:
        if not c["id"].startswith("tb-"):
            continue
        pts = sorted(c["paced"] + [dict(c["saturated"], share=1.0)],
                     key=lambda p: p["decisions_per_s"])
        xs = [p["decisions_per_s"] for p in pts]
        a1.plot(xs, [p["redis_utilisation"] * 100 for p in pts], "o-", label=c["id"])
        a2.plot(xs, [p["redis_p99_us"] for p in pts], "o-", label=c["id"])
    a1.set_xlabel("decisions/s"), a1.set_ylabel("Redis CPU, % of a core"), a1.legend()
    a2.set_xlabel("decisions/s"), a2.set_ylabel("Redis p99 per call, µs"), a2.legend()
    fig.tight_layout()
    fig.savefig(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--members", default="1,8,32")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kind ids")
    ap.add_argument("--no-benchmarks-md", action="store_true")
    ap.add_argument("--no-cluster", action="store_true",
                    help="skip the 3-master Redis Cluster case")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the breakdown of lua/batch.lua's time by step")
    ap.add_argument("--no-valkey", action="store_true",
                    help="skip the same kinds on Valkey (1 and 8 per call)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    B.RUN.mkdir(parents=True, exist_ok=True)
    (OUT / "wrk.lua").write_text(WRK_LUA)
    members = [int(m) for m in args.members.split(",")]
    todo = [c for c in cases(members)
            if c["id"].split("-")[0] in args.kinds.split(",") or "+" in c["id"]]
    started = time.monotonic()
    for c in todo:
        write_calls(c, max(200, 40_000 // c["members"]))
    B.wait_quiet(30)
    tier = Tier()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(),
           "loadavg": " ".join(open("/proc/loadavg").read().split()[:3]),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=B.ROOT,
                                    capture_output=True, text=True).stdout.strip(),
           "redis": tier.r.info("server").get("redis_version"), "webdis_threads": 2,
           "seconds": args.seconds, "cases": []}
    for c in todo:
        B.log(f"{c['id']}: {c['what']}, {c['members']} per call")
        c.update(measure(tier, c, args.seconds))
        s = c["saturated"]
        B.log(f"  {s['decisions_per_s']:,.0f} decisions/s, Redis {s['redis_cpu_us_per_decision']:.1f}"
              f" µs/decision, Lua {s['lua_us_per_decision']:.1f}, Webdis "
              f"{s['webdis_cpu_us_per_decision']:.1f}")
        res["cases"].append({k: v for k, v in c.items() if k != "config"})
    tier.close()
    if not args.no_valkey:
        B.log("valkey: every kind at 1 and 8 per call on valkey-server")
        res["valkey"] = bench_tier_valkey.measure(Tier, todo, args.seconds)
    if not args.no_cluster:
        B.log("cluster: three masters behind Envoy's redis_proxy")
        res["cluster"] = bench_tier_cluster.measure(OUT, CLI, args.seconds, KEYS)
    if not args.no_profile:
        B.log("profile: lua/batch.lua cut short at each step")
        files = {c["members"]: calls_path(c["id"]) for c in todo
                 if c["id"].startswith("tb-") and c["members"] > 1}
        res["profile"] = bench_tier_profile.profile((OUT / "batch.lua").read_text(), files)
        if any(c["id"] == "tb-1" for c in todo):
            res["single_profile"] = bench_tier_profile.single_profile(
                (OUT / "ratelimit.lua").read_text(), calls_path("tb-1"))
    res["wall_s"] = time.monotonic() - started
    (OUT / "results.json").write_text(json.dumps(res, indent=2))
    text = markdown(res)
    (OUT / "results.md").write_text(text + "\n")
    plot(res, OUT / "tier.png")
    if not args.no_benchmarks_md:
        write_benchmarks(text)
    print(text)


if __name__ == "__main__":
    try:
        main()
    except B.BenchError as e:
        print(f"bench-tier: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        B.stop_all()
