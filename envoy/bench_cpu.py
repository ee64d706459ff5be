"""make bench's accounting: the CPU every process of the stack spends during
one measured run (/proc ticks, Redis' INFO cpu), the machine's own busy and
stolen time, Redis' command counts and the filter's counters, and the
memory each kind of key takes in Redis."""

import http.client
import os
import re
import socket
import time

from bench_stack import (
    ADMIN_COMMANDS, BenchError, CLK_TCK, HOST, PATH, batch_histogram, envoy_stats, hreq, log,
    tail,
)
from bench_wrk import run_wrk


def machine_ticks():
    """(busy, steal, total) clock ticks of the whole machine, all CPUs."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq
    return busy, steal, busy + idle + iowait + steal


def busy_cores(seconds):
    a = machine_ticks()
    time.sleep(seconds)
    b = machine_ticks()
    wall = (b[2] - a[2]) / (os.cpu_count() or 1)
    return (b[0] - a[0]) / wall if wall else 0.0


def wait_quiet(limit_s):
    """Waits (bounded) until the machine is nearly idle before measuring."""
    end = time.monotonic() + limit_s
    while True:
        busy = busy_cores(2)
        if busy < 0.25:
            return busy
        if time.monotonic() >= end:
            log(f"warning: the machine stays busy ({busy:.2f} cores without the bench): "
                "measuring anyway; see the 'other work' column")
            return busy
        log(f"machine busy ({busy:.2f} cores of other work): waiting for it to calm down")
        time.sleep(3)


def cpu_ticks(pid):
    """utime + stime of a process (all its threads), in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


# ---------------------------------------------------------------------------
# One measured run


def measure(args, stack, sc, seconds, run_id):
    e = stack.envoys[sc["id"]]
    r = stack.r
    r.cmd("FLUSHALL", "SYNC")
    time.sleep(0.3)  # let the previous run's stragglers settle
    for key, value in sc.get("redis_setup", []):
        r.cmd("SET", key, value, "PX", 3_600_000)
    r.cmd("CONFIG", "RESETSTAT")
    pids = {"envoy": e["proc"].pid, "upstream": stack.upstream.pid, "webdis": stack.webdis.pid,
            "redis": stack.redis.pid}
    stats0 = envoy_stats(e["admin"])
    cpu0 = {k: cpu_ticks(v) for k, v in pids.items()}
    rcpu0 = r.cpu_us()
    m0 = machine_ticks()
    w = run_wrk(args, e["port"], sc["request"], seconds, run_id, sc.get("connections"))
    m1 = machine_ticks()
    rcpu1 = r.cpu_us()
    cpu1 = {k: cpu_ticks(v) for k, v in pids.items()}
    stats1 = envoy_stats(e["admin"])
    calls = {k: v for k, v in r.commandstats().items() if k not in ADMIN_COMMANDS}
    for k, p in [("envoy", e["proc"]), ("upstream", stack.upstream), ("webdis", stack.webdis),
                 ("redis", stack.redis)]:
        if p.poll() is not None:
            raise BenchError(f"{p.bench_name} died during the run:\n{tail(p.bench_log)}")

    delta = {k: stats1.get(k, 0) - stats0.get(k, 0) for k in stats1
             if stats1.get(k, 0) != stats0.get(k, 0)}
    if sc.get("expect_stat") and delta.get(sc["expect_stat"], 0) <= 0:
        raise BenchError(f"({sc['id']}): {sc['expect_stat']} did not move: the run does not "
                         "measure what it says")
    n = max(w["requests"], 1)
    secs = w["duration_us"] / 1e6
    expected = delta.get(f"http.ingress.downstream_rq_{sc['expect']}", 0)
    completed = sum(v for k, v in delta.items()
                    if re.fullmatch(r"http\.ingress\.downstream_rq_[0-9]xx", k))
    script_calls = sum(v for k, v in calls.items()
                       if k in ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"))
    cpu = {k: (cpu1[k] - cpu0[k]) * 1e6 / CLK_TCK for k in pids}
    cpu["redis"] = rcpu1 - rcpu0  # INFO cpu: microsecond resolution
    cpu["wrk"] = w["cpu_us"]
    # The whole machine over the run: how busy both cores were, and how much
    # of that was not the stack's (other work skews the numbers).
    wall_ticks = (m1[2] - m0[2]) / (os.cpu_count() or 1)
    busy_cores = (m1[0] - m0[0]) / wall_ticks if wall_ticks else 0.0
    ours_cores = sum(cpu.values()) / 1e6 / secs if secs else 0.0
    machine = {"busy_cores": busy_cores, "steal_cores": (m1[1] - m0[1]) / wall_ticks
               if wall_ticks else 0.0, "other_cores": max(busy_cores - ours_cores, 0.0)}
    return {
        "round": run_id,
        "requests": w["requests"],
        "seconds": secs,
        "rps": expected / secs,
        "rps_all": w["requests"] / secs,
        "expected_responses": expected,
        "unexpected_responses": completed - expected,
        "wrk_errors": w["errors"],
        "latency_ms": {k: v / 1000 for k, v in w["latency_us"].items()},
        "redis_calls_per_req": script_calls / n,
        "redis_cmds_per_req": sum(calls.values()) / n,
        "redis_commandstats": calls,
        "cpu_us_per_req": {k: v / n for k, v in cpu.items()},
        "cpu_s": {k: v / 1e6 for k, v in cpu.items()},
        "envoy_stats_delta": delta,
        "machine_cpu": machine,
        "batch_histogram": batch_histogram(e["admin"]) if sc["filter"] else None,
    }


# ---------------------------------------------------------------------------
# Memory per key, through the real filter


def memory_per_key(stack):
    r = stack.r
    out = []
    r.cmd("FLUSHALL", "SYNC")

    def usage(pattern, what):
        parts = pattern if isinstance(pattern, tuple) else (pattern,)
        keys = [k for k in scan(r, "*") if all(p in k for p in parts)]
        if not keys:
            out.append({"key": what, "bytes": None, "note": f"no key matching {parts!r}"})
            return
        k = keys[0]
        row = {"key": what, "bytes": r.cmd("MEMORY", "USAGE", k, "SAMPLES", "0"),
               "type": r.cmd("TYPE", k), "example": k}
        if row["type"] == "zset":
            row["members"] = r.cmd("ZCARD", k)
        out.append(row)

    # (d)'s bucket (1 per hour) keeps its key for an hour; (b)'s huge bucket is
    # full again within a millisecond, so its key expires almost at once.
    if "d" in stack.envoys and "d" not in stack.unavailable:
        hreq(stack.envoys["d"]["port"], "GET", PATH, {"x-user": "mem-tb"})
        usage(":bench-over:", "token bucket (string)")
    for sid, field, what in (("k", "gcra", "GCRA (string)"),
                             ("l", "fixedWindow", "fixed window"),
                             ("m", "slidingWindowCounter", "sliding-window counter")):
        if sid in stack.envoys and sid not in stack.unavailable:
            hreq(stack.envoys[sid]["port"], "GET", PATH, {"x-user": f"mem-{sid}", "x-mem": "1"})
            usage(f":bench-mem-{field}:", what)
    if "o" in stack.envoys and "o" not in stack.unavailable:
        # A slot lives as long as its request: POSTs whose body never comes
        # stay open (the upstream reads the body before it answers) while
        # their slots are measured.
        port = stack.envoys["o"]["port"]
        for slots in (1, 10, 100):
            user = f"mem-cc{slots}"
            held = []
            for _ in range(slots):
                s = socket.create_connection((HOST, port), timeout=5)
                s.sendall(f"POST {PATH} HTTP/1.1\r\nhost: bench\r\nx-user: {user}\r\n"
                          "content-length: 10\r\n\r\n".encode())
                held.append(s)
            deadline = time.time() + 5
            pattern = (":bench-concurrency:", f":{len(user)}:{user}")
            while time.time() < deadline:
                keys = [k for k in scan(r, "*") if all(p in k for p in pattern)]
                if keys and r.cmd("ZCARD", keys[0]) == slots:
                    break
                time.sleep(0.02)
            usage(pattern, f"concurrency, {slots} slot(s) (sorted set)")
            for s in held:
                s.close()
    if "c" in stack.envoys and "c" not in stack.unavailable:
        port = stack.envoys["c"]["port"]
        for members in (1, 100, 1000):
            user = f"mem-sw{members}"
            c = http.client.HTTPConnection(HOST, port, timeout=5)
            for i in range(members):
                c.request("POST", PATH, body=b'{"amount":1}', headers={
                    "x-user": user, "idempotency-key": f"mem-{user}-{i}",
                    "content-type": "application/json"})
                c.getresponse().read()
            c.close()
            usage((":bench-sw:", f":{len(user)}:{user}"), f"sliding window, {members} member(s) (sorted set)")
        usage(":idem:", "idempotency record, COMPLETED (3-byte body, content-type)")
    r.cmd("FLUSHALL", "SYNC")
    return out


def scan(r, pattern):
    cursor, keys = "0", []
    while True:
        cursor, batch = r.cmd("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
        keys += batch
        if cursor == "0":
            return keys
