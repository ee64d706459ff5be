"""The soak's table: faults injected by kind, requests by answer kind, the
longest outage a client saw per fault kind, the invariants' figures and
every violation."""

import os
import platform
import subprocess
import time


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except OSError:
        return "?"


def outages(rec, faults):
    """Each loop's outage (first failed answer to the next good one) put on
    the last fault that began before it, if it began before that fault's
    end + 5 s; 'none' otherwise."""
    longest, count, nones = {}, {}, []
    for loop, since, failed, until in rec.failures:
        kind = "none"
        for f in faults:
            if f["start"] <= failed <= f["end"] + 5:
                kind = f["kind"]
        longest[kind] = max(longest.get(kind, 0), until - since)
        if kind == "none" and until - since > 1:
            at = time.strftime("%H:%M:%S", time.gmtime(since + time.time() - time.monotonic()))
            nones.append(f"{loop} at {at} UTC for {until - since:.2f} s")
        count[kind] = count.get(kind, 0) + 1
    return longest, count, nones


def table(a, elapsed, rec, injector, stats, violations, keys, usage, nkeys, mem, wasm):
    lines = [f"soak: seed {a.seed}, {elapsed / 60:.1f} min, commit {a.commit}, filter {wasm}, "
             f"{os.cpu_count()} CPUs ({cpu_model()})", "", "| fault | injected | failed | "
             "longest outage a client saw (s) | outages |", "|---|---|---|---|---|"]
    longest, count, nones = outages(rec, injector.faults)
    kinds = sorted({f["kind"] for f in injector.faults} | set(longest))
    for k in kinds:
        fs = [f for f in injector.faults if f["kind"] == k]
        failed = sum(1 for f in fs if f["detail"].startswith("FAILED"))
        lines.append(f"| {k} | {len(fs)} | {failed} | {longest.get(k, 0):.2f} | "
                     f"{count.get(k, 0)} |")
    lines += ["", "| answer | requests |", "|---|---|"]
    for k, v in sorted(rec.kinds.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {k} | {v} |")
    lines.append(f"| client hang-ups | {rec.hangups} |")
    lines += ["", "| invariant figures | |", "|---|---|"]
    for k, v in keys.items():
        lines.append(f"| idempotency {k} | {v} |")
    for k, v in usage.items():
        lines.append(f"| usage settlements {k} | {v} |")
    adm = sum(len(v) for v in rec.admitted.values())
    lines.append(f"| limited requests admitted (bounds checked) | {adm} |")
    # What the filter did, from its counters (every Envoy incarnation's
    # last reading): the paths the traffic meant to exercise.
    for name in ("batch.calls", "lease.fetches", "lease.spent", "overlimit_cache.rejected",
                 "idempotency.stored", "idempotency.replayed", "idempotency.offloaded",
                 "idempotency.object_fetched", "idempotency.object_fetch_failed",
                 "idempotency.offload_failed", "idempotency.conflicted",
                 "idempotency.abandoned", "idempotency.store_failed", "usage.charged_units",
                 "concurrency.released", "failure_mode.denied", "redis.retries"):
        lines.append(f"| {name} (Envoy counter) | {stats.total(name)} |")
    lines.append(f"| Redis keys at the end, used_memory | {nkeys}, {mem / 1048576:.1f} MiB |")
    if nones:
        lines += ["", "outages over 1 s with no fault in the 5 s before: " + ", ".join(nones)]
    lines += ["", f"violations: {len(violations)}"]
    lines += [f"  - {v}" for v in violations]
    return "\n".join(lines)
