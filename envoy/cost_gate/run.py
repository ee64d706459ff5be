#!/usr/bin/env python3
"""make cost-gate (and tests/cost_gate.rs, in make test): the release filter's
host calls and wasm fuel per request of each bench scenario, against the
budgets in envoy/cost_gate/budgets.json. Exits 1 when a scenario exceeds its
budget, saying which calls grew and by how much; 2 when it cannot run.

  run.py                     gate every scenario, print the figures
  run.py --report            also where each scenario's calls and fuel go
  run.py --write             write the current figures as the budgets
                             (or REDIS_GUARD_WRITE_BUDGETS=1)
  run.py --scenarios b,f     only these
  run.py --drop-stored       the scenarios without what they store in Redis
                             first (a plan): their decision checks must fail
  run.py --segments f        also the fuel between consecutive host calls
                             within each callback (one measured round), per
                             request: where in a callback the fuel goes

A budget holds each scenario's ABI calls by name per round (exact: one more
call fails) and its fuel, with a ceiling `headroom` above it: fuel is
deterministic for one build, so the headroom only lets a change elsewhere in
the filter (a table's hashing, code layout) move it a little without a
rewrite. No clock is read: the same build gives the same figures on every
machine.
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))

WASM = ROOT / "target" / "wasm32-wasip1" / "release" / "redis_guard.wasm"
BUDGETS = HERE / "budgets.json"
HEADROOM = 0.03


def fail_to_run(why):
    print(f"cost gate: cannot run: {why}", file=sys.stderr)
    sys.exit(2)


def run(wasm, only, drop_stored=False, segments=False):
    try:
        import wasmtime  # noqa: F401 (its version names the budgets' fuel)
        from importlib.metadata import version
    except ImportError:
        fail_to_run("the wasmtime package is not in this Python: run `make wasi-dep` (it "
                    "installs the pinned wasmtime into .venv) and use .venv/bin/python")
    from cost_gate.host import compile_module
    from cost_gate.host import GateError
    from cost_gate.scenarios import SCENARIOS, Driver
    compiled = compile_module(wasm)
    results = {}
    for sc in SCENARIOS:
        if only and sc["id"] not in only:
            continue
        if drop_stored:
            sc = dict(sc, stored=[])
        try:
            driver = Driver(compiled, sc)
            if segments:
                driver.host.segments = {}
            results[sc["id"]] = driver.measure()
        except GateError as e:
            # A scenario that no longer decides as it should measures
            # another path: its figures would gate nothing.
            print(f"COST GATE FAILED: {e}", file=sys.stderr)
            sys.exit(1)
    unknown = set(only or ()) - set(results)
    if unknown:
        fail_to_run(f"no scenario {sorted(unknown)}; there are "
                    f"{[sc['id'] for sc in SCENARIOS]}")
    return results, version("wasmtime")


def per_request(n, requests):
    v = n / requests
    return f"{v:g}" if v == int(v) else f"{v:.2f}"


def compare(sid, cur, budget):
    """(failures, notes) of one scenario against its budget. Counts are
    compared per request, so a round of another size still compares."""
    fails, notes = [], []
    if budget is None:
        return [f"({sid}) has no budget: write one with REDIS_GUARD_WRITE_BUDGETS=1"], notes
    rq, brq = cur["requests"], budget["requests"]
    if rq != brq:
        notes.append(f"({sid}) rounds of {rq} requests, budgeted as {brq}: compared per request")
    for name in sorted(set(cur["calls"]) | set(budget["calls"])):
        now, was = cur["calls"].get(name, 0), budget["calls"].get(name, 0)
        # now/rq against was/brq, in integers.
        if now * brq > was * rq:
            fails.append(f"({sid}) {name}: {per_request(was, brq)} -> {per_request(now, rq)} "
                         f"per request (+{per_request(now * brq - was * rq, rq * brq)}; "
                         f"{was} -> {now} per round of {rq})")
        elif now * brq < was * rq:
            notes.append(f"({sid}) {name}: {per_request(was, brq)} -> {per_request(now, rq)} "
                         "per request, below budget")
    fuel, ceiling = cur["fuel"] / rq, budget["fuel_ceiling"] / brq
    was = budget["fuel"] / brq
    if fuel > ceiling:
        fails.append(f"({sid}) fuel: {was:,.0f} -> {fuel:,.0f} per request "
                     f"(+{(fuel / was - 1) * 100:.1f}%; ceiling {ceiling:,.0f})")
    elif fuel < was * (1 - HEADROOM):
        notes.append(f"({sid}) fuel: {was:,.0f} -> {fuel:,.0f} per request "
                     f"({(fuel / was - 1) * 100:.1f}%), below budget")
    return fails, notes


def budgets_of(results, wasmtime_version):
    return {
        "_about": "Per scenario, per round of `requests` requests in steady state: the ABI "
                  "imports the release filter calls, by name, and the wasm fuel it burns "
                  "(wasmtime's count, mean of the measured rounds), with fuel_ceiling = "
                  f"fuel x {1 + HEADROOM}. Written by REDIS_GUARD_WRITE_BUDGETS=1 "
                  ".venv/bin/python envoy/cost_gate/run.py; checked by tests/cost_gate.rs.",
        "wasmtime": wasmtime_version,
        "scenarios": {
            sid: {"what": r["what"], "bench": r["bench"], "requests": r["requests"],
                  "calls": r["calls"], "fuel": r["fuel"],
                  "fuel_ceiling": math.ceil(r["fuel"] * (1 + HEADROOM))}
            for sid, r in results.items()
        },
    }


def show(sid, r, budget, full):
    rq = r["requests"]
    head = f"({sid}) {r['what']}"
    if rq > 1:
        head += f" [per request, of a round of {rq}]"
    print(head)
    calls = sum(r["calls"].values())
    line = f"    {per_request(calls, rq)} ABI calls, fuel {r['fuel'] / rq:,.0f}"
    if budget:
        line += (f" (budget {per_request(sum(budget['calls'].values()), budget['requests'])}"
                 f" calls, fuel {budget['fuel'] / budget['requests']:,.0f}, ceiling "
                 f"{budget['fuel_ceiling'] / budget['requests']:,.0f})")
    print(line)
    for name, n in r["calls"].items():
        print(f"    {per_request(n, rq):>6} {name}")
    if not full:
        return
    print(f"    per round of {rq}: fuel {r['fuel']:,} (rounds {r['fuel_min']:,} to "
          f"{r['fuel_max']:,}); scripts run: {', '.join(r['scripts']) or 'none'}")
    print("    by the context that made them:")
    for what, n in r["by_role"].items():
        print(f"      {n:>4} {what}")
    print("    fuel by callback (callbacks per round):")
    for name, fuel in sorted(r["fuel_by_callback"].items(), key=lambda kv: -kv[1]):
        print(f"      {fuel:>10,} {name} ({r['callbacks'].get(name, 0)})")


def show_segments(sid, r):
    rq = r["requests"]
    print(f"({sid}) fuel per request between host calls, by callback (one round):")
    for (callback, before, after), fuel in sorted(r["segments"].items(), key=lambda kv: -kv[1]):
        print(f"    {fuel / rq:>9,.0f}  {callback}: {before} -> {after}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wasm", type=Path, default=WASM)
    ap.add_argument("--budgets", type=Path, default=BUDGETS)
    ap.add_argument("--scenarios", default="", help="comma-separated ids (default: all)")
    ap.add_argument("--report", action="store_true", help="where the calls and fuel go")
    ap.add_argument("--write", action="store_true", help="write the figures as the budgets")
    ap.add_argument("--drop-stored", action="store_true",
                    help="run the scenarios without what they store in Redis first")
    ap.add_argument("--segments", action="store_true",
                    help="the fuel between consecutive host calls in each callback")
    args = ap.parse_args()
    if not args.wasm.is_file():
        fail_to_run(f"{args.wasm} not found: run `make build`")
    only = [s for s in args.scenarios.split(",") if s]
    results, version = run(args.wasm, only, args.drop_stored, args.segments)
    if args.write or os.environ.get("REDIS_GUARD_WRITE_BUDGETS") == "1":
        if only or args.drop_stored:
            fail_to_run("--write writes every scenario's budget: run it without --scenarios "
                        "or --drop-stored")
        args.budgets.write_text(json.dumps(budgets_of(results, version), indent=2) + "\n")
        print(f"cost gate: wrote {args.budgets.relative_to(ROOT)}")
    try:
        budgets = json.loads(args.budgets.read_text())
    except (OSError, ValueError) as e:
        fail_to_run(f"{args.budgets}: {e}")
    fails, notes = [], []
    for sid, r in results.items():
        budget = budgets["scenarios"].get(sid)
        show(sid, r, budget, args.report)
        if args.segments:
            show_segments(sid, r)
        f, n = compare(sid, r, budget)
        fails += f
        notes += n
    if budgets.get("wasmtime") != version:
        notes.append(f"budgets measured with wasmtime {budgets.get('wasmtime')}, this is "
                     f"{version}: fuel may differ by version")
    for n in notes:
        print(f"note: {n}")
    if fails:
        print("\nCOST GATE FAILED: over budget", file=sys.stderr)
        for f in fails:
            print(f"  {f}", file=sys.stderr)
        print("A host call or instructions more per request is a cost every request pays: "
              "take it out, or if it is worth it, rewrite the budgets with "
              "REDIS_GUARD_WRITE_BUDGETS=1 .venv/bin/python envoy/cost_gate/run.py and say "
              "why in the commit.", file=sys.stderr)
        sys.exit(1)
    print(f"cost gate: {len(results)} scenarios within budget")


if __name__ == "__main__":
    main()
