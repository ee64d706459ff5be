"""The invariants, read from what the clients saw (traffic.Record), from
Redis, from the upstream's counts and from the Envoys' counters and logs.
Each violation is a line; the run fails on any."""

import json
import re
import struct
import time

from . import config
from .procs import SoakError, log
from .traffic import admin_get

# How far an admission's window reaches in the interval check: past it the
# whole run's total (checked apart) bounds them.
HORIZON_S = 10.0


def rate_bound(kind):
    spec = config.LIMITS[kind]
    if "gcra" in spec:
        g = spec["gcra"]
        return g["burst"], g["rate"] / g["periodMs"]
    t = spec["tokenBucket"]
    return t["capacity"], t["refill"] / t["periodMs"]


def check_bucket(kind, user, adm, out):
    """Token bucket, GCRA and the leased bucket: at most capacity + rate x
    elapsed over any interval, and over the whole run from the bucket's
    start. Admission k was decided in [sent_k, done_k], so admissions i..j
    (sorted by sent) fall in [sent_i, max done]. A leased bucket's burst may
    reach the capacity plus the lease's tokens per Envoy (tokens leased
    before the interval, spent in it: docs/src/using/leases.md)."""
    cap, per_ms = rate_bound(kind)
    lease = config.LIMITS[kind].get("lease")
    slack = lease["tokens"] * config.ENVOYS if lease else 0
    n = len(adm)
    for i in range(n):
        far = adm[i][0]
        for j in range(i, n):
            if adm[j][0] - adm[i][0] > HORIZON_S:
                break
            far = max(far, adm[j][1])
            allowed = cap + slack + per_ms * (far - adm[i][0]) * 1000
            if j - i + 1 > allowed + 1e-9:
                out.append(f"{kind} {user}: {j - i + 1} admitted within "
                           f"{(far - adm[i][0]) * 1000:.0f} ms, bound {allowed:.2f}")
                return
    if n:
        span = max(a[1] for a in adm) - adm[0][0]
        if n > cap + per_ms * span * 1000 + 1e-9:
            out.append(f"{kind} {user}: {n} admitted in the run, bound "
                       f"{cap + per_ms * span * 1000:.1f}")


def check_window(kind, user, adm, limit, window_ms, out):
    """At most `limit` decided in any interval shorter than the window."""
    n = len(adm)
    for i in range(n):
        far = adm[i][0]
        for j in range(i, n):
            far = max(far, adm[j][1])
            if (far - adm[i][0]) * 1000 >= window_ms:
                break
            if j - i + 1 > limit:
                out.append(f"{kind} {user}: {j - i + 1} admitted within "
                           f"{(far - adm[i][0]) * 1000:.0f} ms, limit {limit} per {window_ms} ms")
                return


def check_aligned(kind, user, adm, limit, window_ms, out):
    """At most `limit` in each aligned window (Redis' clock is the wall
    clock of this machine): counted where sent and answered fall in one."""
    per = {}
    for _, _, ws, wd in adm:
        a, b = int(ws * 1000) // window_ms, int(wd * 1000) // window_ms
        if a == b:
            per[a] = per.get(a, 0) + 1
    for w, c in per.items():
        if c > limit:
            out.append(f"{kind} {user}: {c} admitted in the aligned window {w}, limit {limit}")


def check_limits(rec, upstream_stats, out):
    with rec.lock:
        items = {k: sorted(v) for k, v in rec.admitted.items()}
    for (kind, user), adm in items.items():
        spec = config.LIMITS[kind]
        if "tokenBucket" in spec or "gcra" in spec:
            check_bucket(kind, user, adm, out)
        elif "slidingWindow" in spec:
            s = spec["slidingWindow"]
            check_window(kind, user, adm, s["limit"], s["windowMs"], out)
        elif "fixedWindow" in spec:
            s = spec["fixedWindow"]
            check_aligned(kind, user, adm, s["limit"], s["windowMs"], out)
            check_window(kind, user, adm, 2 * s["limit"], s["windowMs"], out)
        elif "slidingWindowCounter" in spec:
            s = spec["slidingWindowCounter"]
            check_window(kind, user, adm, 2 * s["limit"], s["windowMs"], out)
        elif "quota" in spec:
            check_aligned(kind, user, adm, spec["quota"]["amount"], 3_600_000, out)
    peak = upstream_stats.get("peakInFlight", {})
    cmax = config.LIMITS["conc"]["concurrency"]["max"]
    for path, p in peak.items():
        if path.startswith("/rl/conc/") and p > cmax:
            out.append(f"concurrency {path}: {p} in flight at the upstream, max {cmax}")


def check_keys(rec, upstream_stats, store_failed, out):
    """Every key ran upstream at most once, every answer of a key the same
    bytes, each its own. The book's exceptions are allowed and shown
    apart: an attempt that met an Envoy dying under it (its lock expires
    unstored, then a retry runs), and a store that failed
    (`idempotency.store_failed`, or `idempotency.offload_failed` for a body
    the object store did not take: the key is freed, a retry runs again);
    the runs past the SIGKILLs' must number at most what those count."""
    by_path = upstream_stats.get("byPath", {})
    summary = {"keys": 0, "completed and replayed": 0, "ran again after an Envoy's SIGKILL": 0,
               "ran again after a failed store": 0}
    with rec.lock:
        keys = dict(rec.keys)
    again = []
    for key, k in keys.items():
        summary["keys"] += 1
        runs = by_path.get(k["path"], 0)
        bodies = {b for _, b in k["answers"]}
        if k["completed"] and k["replayed"]:
            summary["completed and replayed"] += 1
        # A run after the client had a whole answer: only a failed store
        # explains it. A run whose answer never came: an Envoy killed
        # under an attempt (as many as the attempts without an answer).
        after_whole = max(0, len(bodies) - 1)
        hidden = max(0, runs - 1 - after_whole)
        killed = min(hidden, k["no_answer"])
        summary["ran again after an Envoy's SIGKILL"] += killed
        if after_whole + hidden - killed:
            again.append((key, after_whole + hidden - killed, k.get("attempts", [])))
        for b in bodies:
            try:
                doc = json.loads(b)
            except ValueError:
                out.append(f"key {key}: an answer that is not the upstream's JSON")
                continue
            if doc.get("path") != k["path"]:
                out.append(f"key {key}: answered with {doc.get('path')}'s response "
                           f"(attempts: {' '.join(k.get('attempts', []))})")
        if k["answers"] and runs == 0:
            out.append(f"key {key}: answered 200 but never ran upstream")
    n_again = sum(n for _, n, _ in again)
    summary["ran again after a failed store"] = n_again
    if n_again > store_failed:
        shown = "; ".join(f"{key} (attempts: {' '.join(a)})" for key, _, a in again[:3])
        out.append(f"{n_again} runs again past the SIGKILLs' but idempotency.store_failed "
                   f"and offload_failed count {store_failed}: {shown}")
    return summary


def usage_spent(admin, user):
    keys = scan(admin, f"rg:rl:*:soak-usage:*:{len(user)}:{user}")
    if len(keys) != 1:
        return None
    raw = admin.cmd("GET", keys[0], raw=True)
    credits, _ = struct.unpack("<dd", raw[:16])
    return config.USAGE_CAPACITY - credits / config.USAGE_PERIOD_MS


def check_usage(rec, admin, stats, kills, out):
    """No settlement lost silently, none applied twice. Redis spent on each
    user what its settled requests used plus the reserves of the others, so
    the settlements missing there are read from its bucket; each must be
    counted by `usage.lost`, or have met an Envoy's SIGKILL (answered by it
    within 2 s before: its settlement may not have left). A user's last
    request may have no known cost (its answer was cut): 0, the reserve or
    the usage, so its count is a range. `usage.lost` may count more than
    Redis misses: a settlement whose call failed after Redis ran it is
    counted lost (the filter cannot know), shown apart."""
    per = config.USAGE - config.USAGE_RESERVE
    lo = hi = near_kill = 0
    with rec.lock:
        users = {u: dict(v) for u, v in rec.usage.items()}
    for user, u in users.items():
        spent = usage_spent(admin, user)
        if spent is None:
            if u["admitted"]:
                out.append(f"usage {user}: no bucket in Redis after {u['admitted']} admitted")
            continue
        missing = u["admitted"] * config.USAGE - spent
        xs = (0, config.USAGE_RESERVE, config.USAGE) if u["unknown"] else (0,)
        lost = [int((missing + x + per / 2) // per) for x in xs]
        lo += min(lost)
        hi += max(lost)
        if max(lost) < 0:
            out.append(f"usage {user}: Redis spent {-missing:.0f} more than every admitted "
                       "request used: a settlement applied twice")
        for ei, t in u["answers"]:
            if any(ki == ei and 0 <= kt - t <= 2.0 for ki, kt in kills):
                near_kill += 1
    counted = stats.total("usage.lost")
    if lo > counted + near_kill:
        out.append(f"usage: at least {lo} settlements missing in Redis, usage.lost counts "
                   f"{counted}, {near_kill} answered just before their Envoy's SIGKILL")
    return {"missing in Redis": f"{lo}" if lo == hi else f"{lo} to {hi}",
            "counted by usage.lost": counted,
            "answered just before a SIGKILL": near_kill}


def scan(admin, pattern="*"):
    keys, cursor = [], "0"
    for _ in range(100_000):
        cursor, batch = admin.cmd("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
        keys += batch
        if cursor == "0":
            return keys
    raise SoakError("SCAN did not finish")


def check_redis(admin, out, mem_limit):
    """No key without a TTL; memory within its bound."""
    keys = scan(admin)
    no_ttl = []
    for i in range(0, len(keys), 1000):
        part = keys[i:i + 1000]
        ttls = admin.pipeline([("PTTL", k) for k in part])
        no_ttl += [k for k, t in zip(part, ttls) if t == -1]
    if no_ttl:
        out.append(f"redis: {len(no_ttl)} keys without a TTL, e.g. {no_ttl[:3]}")
    used = int(admin.info("memory")["used_memory"])
    if used > mem_limit:
        out.append(f"redis: used_memory {used} above {mem_limit}")
    return len(keys), used


# The filter's panic hook logs at critical level; a trap is a RuntimeError
# in V8's words; Envoy's own crash prints its signal and a backtrace.
PANIC = re.compile(r"panicked|\]\[critical\]|RuntimeError|Caught (Segmentation|Abort)|"
                   r"backtrace|VM (has )?(failed|crashed)")


def check_logs(stack, out):
    for e in stack.envoys:
        text = (e["dir"] / "envoy.log").read_text(errors="replace")
        bad = [ln for ln in text.splitlines() if PANIC.search(ln)]
        if bad:
            out.append(f"envoy{e['i']}: {len(bad)} log lines of a panic or crash, e.g. "
                       f"{bad[0][:300]}")


def upstream_stats(stack):
    _, body = admin_get(stack.ports["up"], "/__stats")
    return json.loads(body)
