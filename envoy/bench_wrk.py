"""make bench's load: the wrk scripts of each kind of request and one wrk
run, with its own summary (counts, latency percentiles, wrk's CPU)."""

import json
import os
import re
import subprocess
import time

import bench_stack as S
from bench_stack import BenchError, HOST, JWT, JWT_PATH, PATH, PROCS, stop

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
    path = S.RUN / f"wrk-{kind}.lua"
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
    out_path = S.RUN / "wrk.out"
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
