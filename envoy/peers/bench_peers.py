#!/usr/bin/env python3
"""make bench-peers: redis-guard side by side with Kuadrant's Limitador.

Seven Envoys under test (envoy/peers/peers_stack.py), each --concurrency 1,
in front of the same upstream, measured in ONE alternating run
(A B C R1 R3 R2 X, A B C R1 R3 R2 X, ...) by wrk on 127.0.0.1:

  A   no filter                B   wasm-shim -> Limitador -> Redis
  C   Envoy's ratelimit filter -> Limitador -> Redis
  R1  redis-guard strict, batching off     R3  strict, batching on (default)
  R2  redis-guard lease of 100 tokens      X   redis-guard, nothing applies

Limitador holds one limit per x-user of 1e9 per 60 s (limits.yaml) and
redis-guard one token bucket per x-user of 1e9 (never exhausted): every
request is one check. All fail closed after 500 ms. Every Envoy under test
logs the same JSON access line per request (envoy/envoy.yaml's).

Two passes: throughput (wrk -t1 -c32, --rounds x --duration s after a
--warmup s warm-up per scenario) and latency (wrk -t1 -c1, --lat-rounds x
--lat-duration s). Per scenario: median 2xx req/s, the median of the
per-round ratios to A, p50/p99, non-2xx responses, gRPC/Webdis/Redis calls
per request and CPU us per request of each process (/proc; Redis from INFO
cpu; wrk from its rusage); per pair (R3/C, R2/C, X/A, ...) the median of the
per-round ratios, and where the CPU per request goes between R3 and C, R2
and C, X and A. The report states measured comparisons only: the project's
own targets are not graded in it.

Diagnostics (default on, --no-diagnostics leaves them out): three more Envoys
in every -c32 round, each right after its base, for the access log's own
cost (envoy/peers/peers_diag.py): A-noline (A without the access_log),
R3-recoff (R3 with accessLog.enabled: false, the same line) and R3-noline
(R3-recoff without the access_log). Never in the head-to-head ratios; the
report gives the record's Envoy CPU per request (R3 - R3-recoff) and the
line's (R3-recoff - R3-noline, A - A-noline).

--perf S (envoy/peers/peers_perf.py): one extra -c32 round on R3 after the
measured ones, with perf record -g on R3's Envoy and on Redis for S seconds;
the top symbols by self % go to target/bench-peers/perf/ and the report.

Writes target/bench-peers/results.json, results.md and the region of
BENCHMARKS.md between <!-- bench-peers:start --> and <!-- bench-peers:end -->
(appended at the end when the markers are missing).

--check-configs renders every config, checks that they log the same line and
has Envoy validate each (--mode validate): no process is started.
--deny-check starts the stack with limits-deny.yaml (2 per hour) and checks
that B and C enforce it: 200 200 429 429 for one x-user. No load.
"""
import argparse
import atexit
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import peers_diag
import peers_perf
import peers_stack as S
from peers_stack import B

OUT = S.ROOT / "target" / "bench-peers"
MARK_START = "<!-- bench-peers:start -->"
MARK_END = "<!-- bench-peers:end -->"

# The pairs whose CPU per request the report breaks down by process.
CPU_PAIRS = [("R3", "C"), ("R2", "C"), ("X", "A")]
PAIRS = [("R3", "C"), ("R1", "C"), ("R2", "C"), ("R3", "R1"), ("C", "B"), ("X", "A")]
PROCS = ["envoy", "upstream", "limitador", "webdis", "redis", "wrk"]


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def machine_ticks():
    """(busy, total) clock ticks of the whole machine, all CPUs."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq
    return busy, busy + idle + iowait + steal


# ---------------------------------------------------------------------------
# One measured run


def measure(stack, sc, conns, seconds, run_dir):
    e = stack.envoys[sc["id"]]
    r = stack.r
    r.cmd("FLUSHALL", "SYNC")
    time.sleep(0.3)  # the previous run's stragglers
    r.cmd("CONFIG", "RESETSTAT")
    procs = {"envoy": e["proc"], "upstream": stack.upstream, "webdis": stack.webdis,
             "limitador": stack.limitador}
    s0 = S.envoy_stats(e["admin"])
    c0 = {k: B.cpu_ticks(p.pid) for k, p in procs.items()}
    rc0 = r.cpu_us()
    m0 = machine_ticks()
    w = S.run_wrk(run_dir, e["port"], sc["request"], conns, seconds)
    m1 = machine_ticks()
    rc1 = r.cpu_us()
    c1 = {k: B.cpu_ticks(p.pid) for k, p in procs.items()}
    s1 = S.envoy_stats(e["admin"])
    calls = {k: v for k, v in r.commandstats().items()
             if k.split("|")[0] not in ("info", "config", "flushall", "dbsize", "ping")}
    for name, p in [*procs.items(), ("redis", stack.redis)]:
        if p.poll() is not None:
            raise B.BenchError(f"{name} died during the run:\n{S.tail(p.bench_log)}")
    delta = {k: s1.get(k, 0) - s0.get(k, 0) for k in s1 if s1.get(k, 0) != s0.get(k, 0)}
    n = max(w["requests"], 1)
    secs = w["duration_us"] / 1e6
    by_class = {k.rsplit("_", 1)[1]: v for k, v in delta.items()
                if re.fullmatch(r"http\.ingress\.downstream_rq_[0-9]xx", k)}
    ok = by_class.get("2xx", 0)
    cpu = {k: (c1[k] - c0[k]) * 1e6 / B.CLK_TCK for k in procs}
    cpu["redis"] = rc1 - rc0
    cpu["wrk"] = w["cpu_us"]
    wall = (m1[1] - m0[1]) / (os.cpu_count() or 1)
    busy = (m1[0] - m0[0]) / wall if wall else 0.0
    ours = sum(cpu.values()) / 1e6 / secs if secs else 0.0
    # Round trips: the clients' own commands (Limitador: MGET + EVALSHA;
    # redis-guard: EVALSHA), not those the scripts run.
    trips = sum(v for k, v in calls.items() if k in (
        "eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro", "mget"))
    return {
        "requests": w["requests"], "seconds": secs, "rps": ok / secs if secs else 0.0,
        "ok_2xx": ok, "non_2xx": sum(by_class.values()) - ok, "by_class": by_class,
        "wrk_errors": w["errors"],
        "latency_ms": {k: v / 1000 for k, v in w["latency_us"].items()},
        "limitador_rq_per_req": delta.get("cluster.limitador.upstream_rq_total", 0) / n,
        "webdis_rq_per_req": delta.get("cluster.webdis.upstream_rq_total", 0) / n,
        # redis-guard's batching: calls that carried a batch, and those that
        # left at once because the worker had no call out.
        "batch_calls_per_req": delta.get("wasmcustom.redis_guard.batch.calls", 0) / n,
        "batch_alone_per_req": delta.get("wasmcustom.redis_guard.batch.alone", 0) / n,
        "redis_calls_per_req": trips / n,
        "redis_cmds_per_req": sum(calls.values()) / n,
        "redis_commandstats": calls,
        "cpu_us_per_req": {k: v / n for k, v in cpu.items()},
        "busy_cores": busy, "other_cores": max(busy - ours, 0.0),
        "stats_delta": delta,
    }


def one_pass(stack, args, label, conns, rounds, seconds, warmup, scs):
    runs = {sc["id"]: [] for sc in scs}
    if warmup:
        B.log(f"[{label}] warm-up {warmup} s per scenario (wrk -t1 -c{conns})")
        for sc in scs:
            measure(stack, sc, conns, warmup, stack.run)
    for rnd in range(1, rounds + 1):
        for sc in scs:
            x = measure(stack, sc, conns, seconds, stack.run)
            runs[sc["id"]].append(x)
            B.log(f"[{label}] round {rnd} {sc['id']:>2}: {x['rps']:8.0f} req/s 2xx, p50 "
                  f"{x['latency_ms']['p50']:.3f} ms, non-2xx {x['non_2xx']}, busy "
                  f"{x['busy_cores']:.2f} cores" + (f", {x['other_cores']:.2f} of other work"
                                                    if x["other_cores"] > 0.1 else ""))
    return runs


def summarize(runs):
    out = {}
    for sc in S.scenarios(True):
        if sc["id"] not in runs:
            continue
        rs = runs[sc["id"]]
        ratios = [x["rps"] / a["rps"] for x, a in zip(rs, runs["A"]) if a["rps"]]
        cpu = {k: median([x["cpu_us_per_req"][k] for x in rs]) for k in PROCS}
        cpu["total"] = sum(v for v in cpu.values() if v is not None)
        out[sc["id"]] = {
            "what": sc["what"], "rounds": len(rs),
            "rps": median([x["rps"] for x in rs]),
            "rps_min": min(x["rps"] for x in rs), "rps_max": max(x["rps"] for x in rs),
            "ratio": median(ratios), "ratios": ratios,
            "latency_ms": {p: median([x["latency_ms"][p] for x in rs])
                           for p in ("p50", "p90", "p99", "p999", "max")},
            "non_2xx": sum(x["non_2xx"] for x in rs),
            "wrk_errors": {k: sum(x["wrk_errors"][k] for x in rs) for k in rs[0]["wrk_errors"]},
            "requests": sum(x["requests"] for x in rs),
            **{k: median([x[k] for x in rs]) for k in (
                "limitador_rq_per_req", "webdis_rq_per_req", "batch_calls_per_req",
                "batch_alone_per_req", "redis_calls_per_req", "redis_cmds_per_req",
                "busy_cores")},
            "cpu_us_per_req": cpu,
            "other_cores_max": max(x["other_cores"] for x in rs),
        }
    return out


def pair_ratios(runs, num, den, metric="rps"):
    """Per-round ratios num/den (throughput), or den/num of p50 (latency:
    above 1 when num answers faster): (median, min, max, list)."""
    if not runs:
        return None
    if metric == "rps":
        rs = [x["rps"] / y["rps"] for x, y in zip(runs[num], runs[den]) if y["rps"]]
    else:
        rs = [y["latency_ms"]["p50"] / x["latency_ms"]["p50"]
              for x, y in zip(runs[num], runs[den]) if x["latency_ms"]["p50"]]
    return {"median": median(rs), "min": min(rs), "max": max(rs), "ratios": rs} if rs else None


def head_to_head(res_runs):
    out = {}
    for num, den in PAIRS:
        out[f"{num}/{den}"] = {
            "c32": pair_ratios(res_runs["c32"], num, den),
            "c1": pair_ratios(res_runs.get("c1"), num, den),
            "c1_p50": pair_ratios(res_runs.get("c1"), num, den, "p50"),
        }
    return out


# ---------------------------------------------------------------------------
# Report


def f(v, spec=".2f"):
    return "—" if v is None else format(v, spec)


def rng(p):
    return "—" if not p else f"**{f(p['median'])}** ({f(p['min'])}–{f(p['max'])})"


def cpu_delta(thr, num, den):
    a, b = thr[num]["cpu_us_per_req"], thr[den]["cpu_us_per_req"]
    parts = ", ".join(f"{p} {a[p] - b[p]:+.1f}" for p in PROCS
                      if a.get(p) is not None and b.get(p) is not None)
    return f"{num} − {den}: total {a['total'] - b['total']:+.1f} ({parts})"


def disturbed(runs):
    """A line naming the measured runs that met other work (> 0.1 cores)."""
    hit = [f"{sid} {lane} round {i + 1} ({x['other_cores']:.2f} cores)"
           for lane, by in runs.items() for sid, xs in by.items()
           for i, x in enumerate(xs) if x["other_cores"] > 0.1]
    return [f"Runs that met other work on the machine (> 0.1 cores): {'; '.join(hit)}.", ""] \
        if hit else []


def report(res):
    m, st = res["machine"], res["settings"]
    thr, lat = res["throughput"], res["latency"]
    peers = m["peers"]
    lines = [
        # The form of make bench-tier's line ("Measured <date> on …, commit <c>,"),
        # which tests/docs_check.rs reads to tie quotes to their run.
        f"Measured {res['date']} on {m['cpu']}, {m['cores']} cores ({m['os']}), commit "
        f"{m['commit']}, in {res['wall_s'] / 60:.0f} min: redis_guard.wasm sha256 "
        f"{m['wasm_sha256']}…, Limitador "
        f"{peers['Kuadrant/limitador']['built'][:12]} ({m['limitador_version']}), wasm-shim "
        f"{peers['Kuadrant/wasm-shim']['built'][:12]} (wasm_shim.wasm sha256 "
        f"{m['wasm_shim_sha256']}…), built from source by `envoy/peers/build.sh`"
        + ("" if m["peers_pinned"] else " (**not the revisions envoy/peers/sources.txt pins**)")
        + f". Envoy {m['envoy']} for every Envoy, "
        f"Redis {m['redis']}, Webdis {m['webdis']}, wrk {m['wrk']}. Load average at the start "
        f"{' '.join(m['loadavg_at_start'])}; other work at most {f(m['other_cores_max'])} cores "
        "in a measured run.", "",
        "Every Envoy under test runs `--concurrency 1` in front of the same upstream (an Envoy "
        "answering `200` itself) and, the diagnostics below excepted, logs the same JSON "
        "access line per request "
        "(envoy/envoy.yaml's `access_log`, with the filter's record "
        "`%FILTER_STATE(wasm.redis_guard:PLAIN)%`, empty in A, B and C). B and C send one "
        "descriptor `{user: x-user}` per request; Limitador's limit (1e9 per 60 s) and "
        "redis-guard's token bucket (1e9) are never exhausted. Everything fails closed after "
        f"500 ms. Throughput: `wrk -t1 -c{st['connections']}`, {st['rounds']} alternating rounds "
        f"× {st['duration_s']} s after {st['warmup_s']} s each; latency: `wrk -t1 -c1`, "
        f"{st['lat_rounds']} rounds × {st['lat_duration_s']} s. Ratios: the median of the "
        "per-round ratios (min–max).", "",
        "Where the CPU per request goes between the setups compared below, at -c32 (µs, by "
        "process, the first setup's minus the second's): "
        + "; ".join(cpu_delta(thr, num, den) for num, den in CPU_PAIRS) + "."
        + ("" if "R3-recoff" in thr else " Not measured in this run: the access-log record's "
           "own cost (same-minute on and off: the diagnostics were left out)."), "",
        *disturbed(res.get("runs", {})),
        "Head to head (req/s ratio; at -c1 also C's p50 over ours: above 1 is faster):", "",
        "| | -c32 | -c1 | -c1 p50 |", "|---|---:|---:|---:|",
    ]
    for pair, v in res["head_to_head"].items():
        lines.append(f"| {pair} | {rng(v['c32'])} | {rng(v['c1'])} | {rng(v['c1_p50'])} |")
    lines += ["", "| | setup | req/s (-c32) | min–max | ratio to A | p50 / p99 ms (-c32) | "
              "p50 / p99 ms (-c1) | req/s (-c1) | non-2xx (-c32 / -c1) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for sc in S.SCENARIOS:
        t, ll = thr[sc["id"]], lat.get(sc["id"])
        lines.append(
            f"| {sc['id']} | {sc['what']} | {f(t['rps'], '.0f')} | {f(t['rps_min'], '.0f')}–"
            f"{f(t['rps_max'], '.0f')} | {f(t['ratio'])} | {f(t['latency_ms']['p50'])} / "
            f"{f(t['latency_ms']['p99'])} | "
            + (f"{f(ll['latency_ms']['p50'], '.3f')} / {f(ll['latency_ms']['p99'], '.3f')} | "
               f"{f(ll['rps'], '.0f')} | " if ll else "— | — | ")
            + f"{t['non_2xx']} / {ll['non_2xx'] if ll else '—'} |")
    lines += ["", "Per request at -c32 (medians): calls, and CPU µs by process (envoy = the "
              "Envoy under test; an idle process still counts):", "",
              "| | gRPC to Limitador | Webdis calls | Redis round trips (commands) | "
              "batch.calls / alone | " + " | ".join(PROCS) + " | total | busy cores |",
              "|---|---:|---:|---:|---:|" + "---:|" * (len(PROCS) + 2)]
    for sc in S.SCENARIOS:
        t = thr[sc["id"]]
        c = t["cpu_us_per_req"]
        lines.append(
            f"| {sc['id']} | {f(t['limitador_rq_per_req'], '.3f')} | "
            f"{f(t['webdis_rq_per_req'], '.3f')} | {f(t['redis_calls_per_req'], '.3f')} "
            f"({f(t['redis_cmds_per_req'])}) | {f(t['batch_calls_per_req'], '.3f')} / "
            f"{f(t['batch_alone_per_req'], '.3f')} | "
            + " | ".join(f(c.get(p), ".1f") for p in PROCS)
            + f" | {f(c['total'], '.1f')} | {f(t['busy_cores'])} |")
    lines += peers_diag.report_lines(res) + peers_perf.report_lines(res)
    lines += ["", "Reproduce: `make bench-peers PEERS_SRC=<the five sources, "
              "envoy/peers/extract.sh>` (envoy/peers/README.md); every round and counter in "
              "`target/bench-peers/results.json`."]
    return "\n".join(lines) + "\n"


def write_benchmarks(text, path):
    region = (f"{MARK_START}\n## Side by side with Limitador (`make bench-peers`)\n\n"
              f"{text}{MARK_END}")
    doc = path.read_text() if path.exists() else ""
    if MARK_START in doc and MARK_END in doc:
        head, rest = doc.split(MARK_START, 1)
        doc = head + region + rest.split(MARK_END, 1)[1]
    else:
        B.log(f"{path.name} has no {MARK_START} region: appended at the end")
        doc = doc.rstrip("\n") + "\n\n" + region + "\n"
    path.write_text(doc)


def machine_info(stack, args):
    def out(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "unknown")
    os_name = re.search(r'PRETTY_NAME="([^"]*)"', Path("/etc/os-release").read_text())
    envoy = re.search(r"version: \S+/(\d+\.\d+\.\d+)", out([stack.envoy, "--version"]))
    commit = out(["git", "-C", str(S.ROOT), "rev-parse", "--short", "HEAD"]) or "unknown"
    if out(["git", "-C", str(S.ROOT), "status", "--porcelain", "--", "src", "lua", "Cargo.toml",
            "Cargo.lock", "envoy"]):
        commit += " + uncommitted changes"
    peers = S.source_revs()
    sha = lambda p: hashlib.sha256(Path(p).read_bytes()).hexdigest()[:16]  # noqa: E731
    return {
        "commit": commit, "wasm_sha256": sha(S.WASM), "cpu": cpu, "cores": os.cpu_count(),
        "kernel": platform.release(), "os": os_name.group(1) if os_name else "",
        "envoy": envoy.group(1) if envoy else "unknown",
        "redis": stack.r.info("server").get("redis_version", "unknown"),
        "webdis": out(["dpkg-query", "-W", "-f", "${Version}", "webdis"]) or "unknown",
        "wrk": out(["dpkg-query", "-W", "-f", "${Version}", "wrk"]) or "unknown",
        "limitador_version": (out([str(args.limitador), "--version"]).splitlines() or ["?"])[0],
        "limitador_sha256": sha(args.limitador), "wasm_shim_sha256": sha(args.wasm_shim),
        "peers": peers, "peers_pinned": all(p["pinned"] == p["built"] for p in peers.values()),
        "loadavg_at_start": open("/proc/loadavg").read().split()[:3],
    }


# ---------------------------------------------------------------------------


def check_configs(args, out):
    """Renders every config (no process), checks the access logs, validates."""
    run = out / "check"
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    scs = S.scenarios(True)
    stack = S.Stack(run, args, scs)
    ports = stack.ports()
    configs = S.write_configs(run, ports, ports["grpc"], args.wasm_shim, scs)
    access_log = S.same_access_log({sid: e["config"] for sid, e in configs.items()}, scs)
    B.log(f"every config has envoy/envoy.yaml's access_log ({len(access_log)} logger): "
          + ", ".join(sc["id"] for sc in scs if sc.get("line", True))
          + "; none: " + ", ".join(sc["id"] for sc in scs if not sc.get("line", True)))
    failed = {}
    for sid, e in [*configs.items(), ("upstream", {"config": run / "upstream" / "envoy.yaml"})]:
        why = S.validate(stack.envoy, e["config"])
        B.log(f"envoy --mode validate {e['config'].relative_to(S.ROOT)}: "
              + ("OK" if why is None else "FAILED"))
        if why:
            failed[sid] = why
    if failed:
        raise B.BenchError(f"invalid configs: {json.dumps(failed, indent=1)}")


def deny_check(stack):
    for sid in ("B", "C"):
        port = stack.envoys[sid]["port"]
        user = f"deny-{time.time_ns()}"
        got = [B.hreq(port, "GET", S.PATH, {"x-user": user})[0] for _ in range(4)]
        B.log(f"deny check ({sid}), x-user {user}: {got}")
        if got != [200, 200, 429, 429]:
            raise B.BenchError(f"({sid}) does not enforce limits-deny.yaml: {got}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limitador", type=Path, default=S.LIMITADOR)
    ap.add_argument("--limitador-args", default="",
                    help="extra limitador-server options, before LIMITS_FILE")
    ap.add_argument("--wasm-shim", type=Path, default=S.WASM_SHIM)
    ap.add_argument("--limits", type=Path, default=S.HERE / "limits.yaml")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--lat-rounds", type=int, default=3)
    ap.add_argument("--lat-duration", type=int, default=5)
    ap.add_argument("--lat-warmup", type=int, default=1)
    ap.add_argument("--envoy-log-level", default="warn")
    ap.add_argument("--quiet-wait", type=int, default=60,
                    help="seconds to wait at most for other work on the machine to stop")
    ap.add_argument("--no-diagnostics", action="store_true",
                    help="leave out the diagnostic rows (A-noline, R3-recoff, "
                    "R3-noline, X-noop): about 4 min less")
    ap.add_argument("--perf", type=int, default=0, metavar="S",
                    help="one extra -c32 round on R3 with perf record -g on its Envoy and "
                    "Redis for S seconds (0: none)")
    ap.add_argument("--perf-bin", default="/usr/bin/perf")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-benchmarks-md", action="store_true",
                    help="do not write BENCHMARKS.md's region (trial runs)")
    ap.add_argument("--check-configs", action="store_true",
                    help="render and validate every config, start nothing")
    ap.add_argument("--deny-check", action="store_true",
                    help="no load: B and C must answer 200 200 429 429 under limits-deny.yaml")
    args = ap.parse_args()
    out = args.out.resolve()
    if args.deny_check and args.limits == S.HERE / "limits.yaml":
        args.limits = S.HERE / "limits-deny.yaml"
    try:
        import yaml  # noqa: F401
    except ImportError:
        raise B.BenchError("PyYAML missing: make bench-deps installs it into .venv")
    need = [S.WASM, args.wasm_shim] + ([] if args.check_configs else [args.limitador])
    for p in need:
        if not Path(p).exists():
            raise B.BenchError(f"missing {p}: make build (redis_guard.wasm) and "
                               "envoy/peers/build.sh (the peers) make them")
    tools = [] if args.check_configs else ["wrk", "redis-server", "webdis"]
    for tool in tools + ([args.perf_bin] if args.perf and not args.check_configs else []):
        if not shutil.which(tool):
            raise B.BenchError(f"{tool} not found (make bench-deps installs wrk, make deps "
                               "the rest)")
    S.set_run_dir(out)
    if args.check_configs:
        return check_configs(args, out)

    t0 = time.monotonic()
    run = out / "run"
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    S.set_run_dir(run)
    scs = S.scenarios(not args.no_diagnostics and not args.deny_check)
    if args.perf and not args.deny_check:
        peers_perf.can_record(args.perf_bin, run)  # before the measured rounds, not after
    stack = S.Stack(run, args, scs)
    B.log("starting redis-server, webdis, limitador, the upstream Envoy and "
          f"{len(scs)} Envoys under test")
    stack.start()
    if args.deny_check:
        return deny_check(stack)
    machine = machine_info(stack, args)
    machine["busy_cores_before"] = B.wait_quiet(args.quiet_wait)
    runs = {"c32": one_pass(stack, args, "c32", args.connections, args.rounds, args.duration,
                            args.warmup, scs)}
    if args.lat_rounds:
        # The diagnostics are about CPU per request: -c32 only.
        runs["c1"] = one_pass(stack, args, "c1", 1, args.lat_rounds, args.lat_duration,
                              args.lat_warmup, S.HEADLINE)
    perf = peers_perf.try_perf_round(stack, args, out, runs["c32"]) if args.perf else None
    B.stop_all()
    thr = summarize(runs["c32"])
    machine["other_cores_max"] = max(s["other_cores_max"] for s in thr.values())
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "settings": {"rounds": args.rounds, "duration_s": args.duration, "warmup_s": args.warmup,
                     "connections": args.connections, "lat_rounds": args.lat_rounds,
                     "lat_duration_s": args.lat_duration, "lat_warmup_s": args.lat_warmup,
                     "envoy_concurrency": 1, "limitador_args": args.limitador_args,
                     "path": S.PATH, "diagnostics": not args.no_diagnostics,
                     "perf_s": args.perf},
        "filter_configs": {sc["id"]: redact(sc["filter"]) for sc in scs if sc.get("filter")},
        "throughput": thr,
        "latency": summarize(runs["c1"]) if "c1" in runs else {},
        "head_to_head": head_to_head(runs),
        "access_log_cost": peers_diag.costs(runs["c32"]),
        "perf": perf,
        "runs": runs,
        "wall_s": time.monotonic() - t0,
    }
    text = report(res)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "results.md").write_text("# Side by side with Limitador (`make bench-peers`)\n\n" + text)
    if not args.no_benchmarks_md:
        write_benchmarks(text, S.ROOT / "BENCHMARKS.md")
    print(text)
    B.log(f"done in {res['wall_s']:.0f} s: {out}/results.json, results.md"
          + ("" if args.no_benchmarks_md else ", BENCHMARKS.md"))


def redact(cfg):
    """A filter config without Webdis' password of the run."""
    cfg = json.loads(json.dumps(cfg))
    cfg["redis"]["credentials"]["password"] = "<made for the run>"
    return cfg


if __name__ == "__main__":
    atexit.register(B.stop_all)
    signal.signal(signal.SIGTERM, lambda signum, _f: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, lambda signum, _f: sys.exit(128 + signum))
    try:
        main()
    except B.BenchError as e:
        print(f"bench-peers: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        B.stop_all()
