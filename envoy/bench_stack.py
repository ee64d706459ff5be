"""make bench's stack: the processes it starts on 127.0.0.1 and stops on exit
(redis-server, Webdis, an upstream Envoy, one Envoy under test per
scenario), the paths they share, a minimal Redis client and the HTTP helpers
that read Envoy's admin interface. bench_tier.py and its helpers use them
too (through bench.py)."""

import glob
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench_scenarios import SCENARIOS, WEBDIS_PASSWORD, WEBDIS_USER

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
