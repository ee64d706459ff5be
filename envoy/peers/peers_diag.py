"""make bench-peers' diagnostics: what the access log costs, same minute.

What the access-log record adds to Envoy's CPU per request (same-minute on
and off) cannot be read from the headline rows: every one of them logs the
line, and R3 writes the record. Three diagnostic Envoys
(peers_stack.DIAGNOSTICS) run in every -c32 round right after their base, so
that each pair below is measured seconds apart on the same machine state:

  record        R3 - R3-recoff        the filter building its record, its
                                      host call, and Envoy printing it
  line, R3      R3-recoff - R3-noline  Envoy formatting and writing the JSON
                                      line (its redis_guard field empty)
  line, A       A - A-noline           the same line without any filter

Each figure is the median of the per-round differences of CPU us per request
(/proc, as the headline rows), with their min-max over rounds.
"""
import os
import statistics

CLK_TCK = os.sysconf("SC_CLK_TCK")

PROCS = ["envoy", "upstream", "limitador", "webdis", "redis", "wrk"]

# (key, numerator, denominator, what the difference is)
DELTAS = [
    ("record", "R3", "R3-recoff", "the filter's record (R3 − R3-recoff)"),
    ("line_r3", "R3-recoff", "R3-noline", "the line, record off (R3-recoff − R3-noline)"),
    ("line_a", "A", "A-noline", "the line in A (A − A-noline)"),
    ("wasm_floor", "X-noop", "A", "a no-op wasm filter in V8 (X-noop − A)"),
    ("filter_idle", "X", "X-noop", "redis-guard when nothing applies, beyond V8's floor "
     "(X − X-noop)"),
]


def spread(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "rounds": xs}


def total(x):
    return sum(v for k, v in x["cpu_us_per_req"].items() if k in PROCS and v is not None)


def costs(runs):
    """{key: {what, num, den, envoy, all, rps_ratio}} from one pass's rounds,
    or None when the run left the diagnostics out."""
    if not all(num in runs and den in runs for _, num, den, _ in DELTAS):
        return None
    out = {}
    for key, num, den, what in DELTAS:
        pairs = list(zip(runs[num], runs[den]))
        out[key] = {
            "what": what, "num": num, "den": den,
            "envoy": spread([x["cpu_us_per_req"]["envoy"] - y["cpu_us_per_req"]["envoy"]
                             for x, y in pairs]),
            "all": spread([total(x) - total(y) for x, y in pairs]),
            "rps_ratio": spread([x["rps"] / y["rps"] for x, y in pairs if y["rps"]]),
        }
    return out


def fmt(v, spec=".1f"):
    return "—" if v is None else format(v, spec)


def rng(s, spec=".1f"):
    return "—" if not s else f"**{fmt(s['median'], spec)}** ({fmt(s['min'], spec)}–" \
        f"{fmt(s['max'], spec)})"


def report_lines(res):
    c = res.get("access_log_cost")
    if not c:
        return []
    thr = res["throughput"]
    lines = ["", "Diagnostics, not in the head-to-head ratios: the access log's own cost, "
             "measured in the "
             "same alternating run at -c32, each diagnostic Envoy right after its base in "
             "every round (R3-recoff: `accessLog.enabled: false`, the same line with its "
             "`redis_guard` field empty; the -noline Envoys have no `access_log`):", "",
             "| | setup | req/s (-c32) | ratio to A | envoy µs/req | redis | webdis | "
             "total µs/req |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for sid in ("A", "A-noline", "R3", "R3-recoff", "R3-noline", "X", "X-noop"):
        t = thr.get(sid)
        if not t:
            continue
        cpu = t["cpu_us_per_req"]
        lines.append(f"| {sid} | {t['what']} | {fmt(t['rps'], '.0f')} | {fmt(t['ratio'], '.2f')} "
                     f"| {fmt(cpu.get('envoy'))} | {fmt(cpu.get('redis'))} | "
                     f"{fmt(cpu.get('webdis'))} | {fmt(cpu.get('total'))} |")
    lines += ["", "| cost per request (median of the per-round differences, min–max) | "
              "Envoy CPU µs | all processes µs | req/s ratio |", "|---|---:|---:|---:|"]
    for key, *_ in DELTAS:
        d = c[key]
        lines.append(f"| {d['what']} | {rng(d['envoy'])} | {rng(d['all'])} | "
                     f"{rng(d['rps_ratio'], '.3f')} |")
    e = c["record"]["envoy"]
    tick_us = 1e6 / CLK_TCK
    per_run = max(thr["R3"]["rps"] * res["settings"]["duration_s"], 1)
    lines += ["", f"The record costs {e['median']:.1f} µs of Envoy CPU per request "
              f"({e['min']:.1f}–{e['max']:.1f} over {len(e['rounds'])} rounds). The line costs "
              f"{c['line_r3']['envoy']['median']:.1f} µs in R3 (record off) and "
              f"{c['line_a']['envoy']['median']:.1f} µs in A. /proc counts CPU in ticks of "
              f"{tick_us / 1000:.0f} ms: {tick_us / per_run:.2f} µs per request in one of R3's "
              "runs, the resolution of each round's figure."]
    return lines
