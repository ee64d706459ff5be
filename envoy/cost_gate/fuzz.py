#!/usr/bin/env python3
"""make fuzz (and tests/fuzz_wasm.rs, in make test): the release filter under
the cost gate's wasmtime host, driven by seeded random cases, each a fresh
VM: a configuration drawn from the schema (fuzz_config.py), client streams
with arbitrary headers, bodies and trailers, upstream responses, Webdis and
object-store replies (valid, failed or mutated: fuzz_inputs.py), in any
order Envoy could deliver them (fuzz_case.py): a hang-up at any point, a
reply after the stream ended, a tick or a queue wake-up between any two
callbacks, a new configuration beside the old one mid-flight.

Properties, checked at every callback (fuzz_host.py, fuzz_case.py):
  no trap, no panic (the filter's hook logs at critical), no import the
  filter has no business calling (host.py traps on those); no ABI call as
  a context that is gone (after proxy_on_delete), no change to a stream
  after it ended (resume, local reply, headers, body after proxy_on_log), no
  local reply once the response's headers went to the client; fuel per
  callback within FUEL_BASE + FUEL_PER_BYTE x the bytes handed in;
  decisions a reference would make: no 429 but after a reply that said
  over limit (or, cached, after one did), no request admitted in the
  callback of a reply that rejected it, nor on a failure where every limit
  and rule says deny; no failure-mode 503 where none says deny, nor with
  no call failed; no request left paused once nothing is out, queued or
  ticking; no end to the calls once the case stops drawing.

  fuzz.py --cases 2000 --seed 1        cases 1..2000 of run seed 1
  fuzz.py --minutes 10 --jobs 2        as many as fit, two processes
  fuzz.py --replay 1:733               one case again (run seed:case)
  fuzz.py --corpus                     every trace in fuzz_corpus/
  fuzz.py --minimize FILE              a finding's trace, shrunk
A finding prints its case id and writes its trace to target/fuzz/; a trace
replays with --trace FILE, and goes into fuzz_corpus/ as a regression case.
"""
import argparse
import json
import os
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))

from cost_gate import fuzz_config, fuzz_host, fuzz_inputs as fi  # noqa: E402
from cost_gate.fuzz_case import Case  # noqa: E402
from cost_gate.fuzz_host import Finding  # noqa: E402
from cost_gate.host import REQUEST_HEADERS, compile_module  # noqa: E402

WASM = ROOT / "target" / "wasm32-wasip1" / "release" / "redis_guard.wasm"
CORPUS = HERE / "fuzz_corpus"
OUT = ROOT / "target" / "fuzz"
# The drain after a case's random steps: at most this many more steps, and
# ticks (a lease's slow tick runs as long as a lease is held).
DRAIN_STEPS = 600
DEFAULT_FUEL_BASE = fuzz_host.FUEL_BASE
# Where a case's clock may start (ns since the epoch, UTC): 2026-01-31
# 23:59:59.9, 2028-02-29 12:00, 2026-03-29 00:59:59 (Europe's spring
# change), 2026-11-01 05:59:59 (New York's fall change), 2026-06-15 09:59:59.
T0 = [1_769_903_999_900_000_000, 1_835_438_400_000_000_000, 1_774_745_999_000_000_000,
      1_793_512_799_000_000_000, 1_781_517_599_000_000_000]
DRAIN_TICKS = 100


# ---- drawing cases ------------------------------------------------------------


class Live:
    """Draws a case's steps as it runs."""

    def __init__(self, rng, seeds):
        self.rng = rng
        self.seeds = seeds
        self.budget = rng.choice([20, 60, 120, 250, 400])
        self.streams = rng.choice([1, 2, 4, 8, 16])

    def first(self):
        origin, raw = fuzz_config.draw(self.rng, self.seeds)
        step = {"op": "config", "raw": fi.enc(raw), "origin": origin}
        if self.rng.random() < 0.3:
            # The clock starts elsewhere than 2026-01-01: a month's last
            # day, a leap day, a daylight-saving change, the top of an hour.
            step["t0"] = self.rng.choice(T0)
        return step

    def candidates(self, case, drain):
        """(weight, make step, op) of every step that applies now."""
        rng, h = self.rng, case.host
        out = []

        def add(weight, op, make):
            out.append((weight, make, op))
        if not drain and not case.failed_plugin and len(case.streams) < self.streams:
            add(3, "open", lambda: {"op": "open", "req": fi.request(rng, case.cfg)})
        for s in case.streams:
            if s.ended:
                if not s.deleted:
                    add(1, "delete", lambda s=s: {"op": "delete", "s": s.idx})
                continue
            if s.local is None and not s.req_done and s.sent < len(s.body):
                add(2, "body", lambda s=s: {"op": "body", "s": s.idx, "to": s.sent + max(
                    1, fi.chunks(rng, len(s.body) - s.sent)[0])})
            elif s.local is None and not s.req_done and s.trailers:
                add(2, "trailers", lambda s=s: {"op": "trailers", "s": s.idx})
            if (s.passed and (s.req_done or rng.random() < 0.1) or s.local) and not s.resp_done:
                add(3, "response", lambda s=s: {
                    "op": "response", "s": s.idx, "to": s.resp_sent + rng.randrange(1, 1 << 20),
                    "resp": self.response(case, s)})
            done = s.resp_done and not s.resp_held
            add(6 if done else (0 if drain else 0.4), "end", lambda s=s: {"op": "end", "s": s.idx})
        for token in sorted(h.calls_out):
            call = h.calls_out[token]
            add(4, "reply", lambda t=token, c=call: {"op": "reply", "token": t, "spec": (
                fi.reply_spec(rng, case.webdis, c) if not drain or rng.random() < 0.3
                else {"v": case.webdis.choices(c)[0]})})
        if h.queue_ready:
            add(4, "queue", lambda: {"op": "queue"})
        for root, period in sorted(h.ticks.items()):
            if period:
                add(1 if not drain else 0.5, "tick", lambda r=root: {"op": "tick", "root": r})
        for root in sorted(h.roots - {case.root}):
            if not any(s.root == root and not s.deleted for s in case.streams):
                add(0.5 if not drain else 0.1, "retire", lambda r=root: {"op": "retire",
                                                                          "root": r})
        if not drain:
            add(0.5, "advance", lambda: {"op": "advance", "ns": rng.choice(
                [1, 10**6, 10**9, 30 * 10**9, 3600 * 10**9])})
            add(0.1, "refuse", lambda: {"op": "refuse", "on": not h.refuse})
            if case.configured and rng.random() < 0.02:
                add(1, "config", lambda: {"op": "config", "raw": fi.enc(
                    fuzz_config.draw(rng, self.seeds)[1])})
        return out

    def response(self, case, s):
        """The upstream's answer, or (mostly) the replay route's where the
        filter sent the request there (envoy/envoy.yaml: a one-byte body
        and x-redis-guard-replay: 1)."""
        st = case.host.streams.get(s.ctx)
        path = dict(st.maps[REQUEST_HEADERS]).get(b":path") if st else None
        if path == b"/redis-guard/replay" and self.rng.random() < 0.8:
            return {"headers": [[":status", "200"], ["x-redis-guard-replay", "1"],
                                ["content-length", "1"]], "body": ["x"], "trailers": None}
        return fi.response(self.rng, case.cfg, "grpc" in str(s.req["headers"]))

    def next(self, case):
        drain = case.steps >= self.budget
        if not drain and case.streams and all(s.deleted for s in case.streams) \
                and len(case.streams) >= self.streams:
            # Every stream came and went: what is left to draw is idle.
            self.budget = case.steps
            drain = True
        if drain and case.host.refuse:
            return {"op": "refuse", "on": False}
        cands = self.candidates(case, drain)
        if drain:
            self.ticks = getattr(self, "ticks", 0)
            if self.ticks >= DRAIN_TICKS or case.steps > self.budget + DRAIN_STEPS:
                cands = [c for c in cands if c[2] != "tick"]
            if case.steps > self.budget + 2 * DRAIN_STEPS:
                raise Finding(f"no quiet after {2 * DRAIN_STEPS} steps of draining: calls "
                              f"{sorted(case.host.calls_out)[:5]} still out")
            if not any(w > 0 for w, _, _ in cands):
                # Nothing left that could move a stream on: each still
                # paused is stuck; then every stream ends.
                stuck = case.stuck()
                if stuck:
                    raise Finding(f"stream {stuck[0].idx} left paused with nothing out, "
                                  "queued or ticking")
                cands = [(1, make, op) for _, make, op in cands if op in ("end", "delete")]
                if not cands:
                    return None
        total = sum(w for w, _, _ in cands)
        x = self.rng.random() * total
        for w, make, op in cands:
            x -= w
            if x <= 0 and w > 0:
                break
        if op == "tick" and drain:
            self.ticks += 1
        return make()


def run_case(compiled, seeds, case_id, trace=None):
    """(None or the finding, case) of one case: drawn from `case_id` (a run
    seed and an index), or the steps of `trace`."""
    rng = random.Random(case_id)
    case = Case(compiled, rng.randrange(1 << 30))
    try:
        if trace is not None:
            for step in trace["steps"]:
                case.play(step)
            return None, case
        live = Live(rng, seeds)
        case.play(live.first())
        if not case.configured:
            return None, case
        while True:
            step = live.next(case)
            if step is None:
                return None, case
            case.play(step)
    except Finding as e:
        return str(e), case
    except Exception as e:  # noqa: BLE001 (a fuzzer's own error: reported, the run goes on)
        where = traceback.extract_tb(e.__traceback__)[-1]
        return (f"harness error (a defect of the fuzzer, not necessarily of the filter): "
                f"{type(e).__name__}: {e} at {Path(where.filename).name}:{where.lineno}"), case
    finally:
        case.host.close()


def kind(finding):
    """A finding without its numbers: what the minimizer keeps."""
    return "".join(c for c in finding if not c.isdigit())


def minimize(compiled, seeds, trace):
    """The trace with every step dropped that the finding does not need
    (greedy, last step first, until nothing more can go)."""
    finding, _ = run_case(compiled, seeds, trace["case"], trace)
    if not finding:
        return trace
    steps = list(trace["steps"])
    shrunk = True
    while shrunk:
        shrunk = False
        for i in range(len(steps) - 1, 0, -1):
            fewer = steps[:i] + steps[i + 1:]
            again, _ = run_case(compiled, seeds, trace["case"], dict(trace, steps=fewer))
            if again and kind(again) == kind(finding):
                steps, shrunk = fewer, True
    again, _ = run_case(compiled, seeds, trace["case"], dict(trace, steps=steps))
    return dict(trace, finding=again, steps=steps)


def save(case_id, finding, case):
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"finding-{case_id.replace(':', '-')}.json"
    path.write_text(json.dumps({"case": case_id, "finding": finding, "steps": case.trace}) + "\n")
    return path


def worker(args):
    """Runs cases `first`, `first + stride`, ... of run `seed` until `count`
    or `deadline`; (cases run, findings, steps, max fuel)."""
    seed, first, stride, count, deadline, wasm, fuel_base = args
    fuzz_host.FUEL_BASE = fuel_base
    compiled = compile_module(wasm)
    seeds = fuzz_config.seed_configs()
    n, findings, steps, fuel, stats = 0, [], 0, (0, "", 0), Counter()
    i = first
    while (count is None or i <= count) and (deadline is None or time.time() < deadline):
        case_id = f"{seed}:{i}"
        finding, case = run_case(compiled, seeds, case_id)
        n += 1
        steps += case.steps
        stats.update(case.stats)
        fuel = max(fuel, getattr(case.host, "max_fuel", (0, "", 0)))
        if finding:
            path = save(case_id, finding, case)
            flag = "" if fuel_base == DEFAULT_FUEL_BASE else f" --fuel-base {fuel_base}"
            print(f"FINDING case {case_id}: {finding}\n  replay: .venv/bin/python "
                  f"envoy/cost_gate/fuzz.py --replay {case_id}{flag}  (trace: {path})",
                  flush=True)
            findings.append(case_id)
        i += stride
    return n, findings, steps, fuel, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wasm", type=Path, default=WASM)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", type=int)
    ap.add_argument("--minutes", type=float)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--replay", help="a case id, seed:index")
    ap.add_argument("--trace", type=Path, help="a trace file to replay")
    ap.add_argument("--corpus", action="store_true", help="replay every trace in fuzz_corpus/")
    ap.add_argument("--stats", action="store_true", help="print what the cases exercised")
    ap.add_argument("--minimize", type=Path, help="shrink a finding's trace (to FILE.min.json)")
    ap.add_argument("--fuel-base", type=int, default=DEFAULT_FUEL_BASE,
                    help="the fuel bound's fixed part (lowered, the bound itself is tested)")
    args = ap.parse_args()
    if not args.wasm.is_file():
        sys.exit(f"fuzz: {args.wasm} not found: run `make build`")
    fuzz_host.FUEL_BASE = args.fuel_base
    if args.minimize:
        trace = json.loads(args.minimize.read_text())
        small = minimize(compile_module(args.wasm), fuzz_config.seed_configs(), trace)
        out = args.minimize.with_suffix(".min.json")
        out.write_text(json.dumps(small) + "\n")
        print(f"{len(trace['steps'])} -> {len(small['steps'])} steps: {out}: "
              f"{small.get('finding')}")
        return
    if args.replay or args.trace or args.corpus:
        compiled = compile_module(args.wasm)
        seeds = fuzz_config.seed_configs()
        traces = []
        if args.replay:
            traces.append((args.replay, None))
        if args.trace:
            traces.append((str(args.trace), json.loads(args.trace.read_text())))
        if args.corpus:
            for path in sorted(CORPUS.glob("*.json")):
                traces.append((path.name, json.loads(path.read_text())))
        bad = 0
        for name, trace in traces:
            case_id = trace["case"] if trace else name
            finding, case = run_case(compiled, seeds, case_id, trace)
            # A trace whose steps no longer all apply proves less than it did.
            whole = f" of {len(trace['steps'])}" if trace else ""
            print(f"{name}: {case.steps}{whole} steps, "
                  f"{'FINDING: ' + finding if finding else 'clean'}")
            if finding and trace is None:
                print(f"  trace: {save(case_id, finding, case)}")
            bad += bool(finding)
        print(f"fuzz: {len(traces)} replayed, {bad} with findings")
        sys.exit(1 if bad else 0)
    deadline = time.time() + args.minutes * 60 if args.minutes else None
    count = args.cases if args.cases or deadline else 1000
    start = time.time()
    jobs = [(args.seed, 1 + j, args.jobs, count, deadline, args.wasm, args.fuel_base)
            for j in range(args.jobs)]
    if args.jobs == 1:
        results = [worker(jobs[0])]
    else:
        from multiprocessing import Pool
        with Pool(args.jobs) as pool:
            results = pool.map(worker, jobs)
    took = time.time() - start
    n = sum(r[0] for r in results)
    findings = [f for r in results for f in r[1]]
    steps = sum(r[2] for r in results)
    print(f"fuzz: seed {args.seed}: {n} cases ({steps} steps) in {took:.1f} s, "
          f"{n / took:.1f} cases/s, {args.jobs} job(s); max fuel in one callback "
          f"{max(r[3] for r in results)}; {len(findings)} finding(s)"
          + (f": {' '.join(findings)}" if findings else ""))
    if args.stats:
        total = sum((r[4] for r in results), Counter())
        for what, count in sorted(total.items()):
            print(f"  {count:>9,} {what}")
    sys.exit(1 if findings else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
