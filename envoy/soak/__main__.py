"""make soak's entry point: the stack up, the client loops and the fault
injector for --minutes, the invariants checked as it runs and at the end,
the table printed; exit 1 on any violation, 2 if the stack itself failed."""

import argparse
import os
import random
import signal
import sys
import threading
import time

from . import check, config, selftest
from .faults import KINDS, Injector, Stats
from .procs import SoakError, log, stop_all
from .stack import ROOT, Stack
from .traffic import Record, grpc_loop, hangup_loop, limited_loop, pay_loop, usage_loop
from .report import commit, table

MEM_LIMIT = 256 << 20
LOOPS = {"limits": (limited_loop, 4), "usage": (usage_loop, 2), "pay": (pay_loop, 3),
         "hangup": (hangup_loop, 1), "grpc": (grpc_loop, 1)}


def on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def monitor(stack, stats, rec, stop, violations):
    """Counters read every 2 s; processes that died unasked and Redis' keys
    and memory every 30 s; the limits' bounds as they stand. Anything it
    cannot do ends the run as a violation, never silently."""
    try:
        watch(stack, stats, rec, stop, violations)
    except Exception as e:  # noqa: BLE001 — reported, and the run stops
        violations.append(f"the monitor failed: {type(e).__name__}: {e}")
        log(f"VIOLATION the monitor failed: {e!r}")


def watch(stack, stats, rec, stop, violations):
    next_redis = time.monotonic() + 10
    while not stop.wait(2.0):
        for e in stack.envoys:
            if e["proc"].alive():
                stats.scrape(e)
        out = []
        # Under the injector's lock: nothing it killed on purpose is read
        # as dead, and Redis is not read while it is being killed.
        with stack.fault_lock:
            for p in [*stack.redis.values(), *stack.webdis, stack.fwd, stack.upstream,
                      stack.s3, stack.grpc, *(e["proc"] for e in stack.envoys)]:
                if not p.alive():
                    out.append(f"{p.name} exited unasked (code {p.p.poll()}), see {p.logfile}")
            due = time.monotonic() > next_redis
            if due:
                next_redis = time.monotonic() + 30
                admin = stack.admin()
                try:
                    check.check_redis(admin, out, MEM_LIMIT)
                finally:
                    admin.close()
        if due:
            check.check_limits(rec, check.upstream_stats(stack), out)
        for v in out:
            if v not in violations:
                log(f"VIOLATION {v}")
                violations.append(v)
        if any("exited unasked" in v for v in out):
            return


def main():
    ap = argparse.ArgumentParser(prog="soak")
    ap.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", 10)))
    ap.add_argument("--seed", type=int, default=int(os.environ.get("SOAK_SEED") or
                                                     int(time.time())))
    ap.add_argument("--faults", default=",".join(KINDS))
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, on_signal)
    # The commit the run started from: HEAD may move while it runs.
    a.commit = commit()
    log(f"seed {a.seed}, {a.minutes} minutes, commit {a.commit}")
    broken = selftest.run()
    if broken:
        log("the checkers' self-test failed: " + "; ".join(broken))
        return 2
    stack = Stack(ROOT / "target" / "soak" / "run", envoys=config.ENVOYS)
    rec = Record()
    violations = []
    try:
        stack.start()
        log("stack up: " + ", ".join(f"envoy{e['i']} :{e['port']}" for e in stack.envoys))
        stats = Stats(stack)
        stop = threading.Event()
        start = time.monotonic()
        deadline = start + a.minutes * 60
        injector = Injector(stack, stats, a.seed, a.faults.split(","))
        threads = [threading.Thread(target=injector.run, args=(deadline, stop), daemon=True)]
        for name, (fn, n) in LOOPS.items():
            for i in range(n):
                rng = random.Random(f"{name}-{i}-{a.seed}")
                threads.append(threading.Thread(target=fn, args=(stack, rec, rng, deadline,
                                                                 stop, i), daemon=True))
        for t in threads:
            t.start()
        try:
            mon = threading.Thread(target=monitor, args=(stack, stats, rec, stop, violations),
                                   daemon=True)
            mon.start()
            while time.monotonic() < deadline and mon.is_alive():
                time.sleep(1)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
            mon.join(timeout=30)
        if any(t.is_alive() for t in threads):
            violations.append("a client loop did not end within 120 s of the deadline")
        for e in stack.envoys:
            stats.scrape(e)
        final(stack, rec, stats, injector, violations, a, time.monotonic() - start)
    except SoakError as e:
        log(f"the stack failed: {e}")
        return 2
    finally:
        stop_all()
    return 1 if violations else 0


def final(stack, rec, stats, injector, violations, a, elapsed):
    out = []
    # Settlements leave on the workers' next tick: wait until each usage
    # bucket reads the same twice.
    admin = stack.admin()
    try:
        last = None
        for _ in range(50):
            now = [check.usage_spent(admin, u) for u in sorted(rec.usage)]
            if now == last:
                break
            last = now
            time.sleep(0.2)
        for e in stack.envoys:
            stats.scrape(e)
        up = check.upstream_stats(stack)
        check.check_limits(rec, up, out)
        keys = check.check_keys(rec, up, stats.total("idempotency.store_failed")
                                + stats.total("idempotency.offload_failed"), out)
        usage = check.check_usage(rec, admin, stats, injector.kills, out)
        nkeys, mem = check.check_redis(admin, out, MEM_LIMIT)
    finally:
        admin.close()
    check.check_logs(stack, out)
    if rec.unexpected:
        out.append(f"{len(rec.unexpected)} answers no fault explains: "
                   f"{sorted(set(rec.unexpected))}")
    incomplete = [k for k, v in rec.keys.items() if not v["completed"] or not v["replayed"]]
    if incomplete:
        out.append(f"{len(incomplete)} keys not completed and replayed within 90 s, "
                   f"e.g. {incomplete[:3]}")
    for f in injector.faults:
        if f["detail"].startswith("FAILED"):
            out.append(f"fault {f['kind']} could not be made or undone: {f['detail']}")
    for e in stack.envoys:
        kills = sum(1 for i, _ in injector.kills if i == e["i"])
        if e["proc"].starts != kills + 1:
            out.append(f"envoy{e['i']}: started {e['proc'].starts} times, killed {kills}")
    for v in out:
        if v not in violations:
            violations.append(v)
    print(table(a, elapsed, rec, injector, stats, violations, keys, usage, nkeys, mem,
                stack.wasm_sha))


if __name__ == "__main__":
    sys.exit(main())
