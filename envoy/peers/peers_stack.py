"""make bench-peers: the scenarios, their configs and the processes.

One private stack on 127.0.0.1 (free ports): redis-server, Webdis
(envoy/webdis.json), Limitador on that same Redis, an upstream Envoy that
answers 200 itself (envoy-upstream.yaml), and one Envoy under test per
scenario, each with --concurrency 1 and forwarding to that upstream:

  A   envoy/envoy.yaml without the wasm filter (make bench's (a))
  B   envoy-B-wasm-shim.yaml: Kuadrant's wasm-shim -> Limitador (gRPC) -> Redis
  C   envoy-C-native-ratelimit.yaml: Envoy's ratelimit filter -> Limitador -> Redis
  R1  envoy/envoy.yaml with redis-guard as make bench's (b): strict, batching off
  R3  ... (f): strict, batching on (the default)
  R2  ... (e): a 100-token lease
  X   ... (x): (b)'s filter, requests without x-user (nothing applies)

and, unless --no-diagnostics, three diagnostic Envoys measuring the access
log's own cost in the same alternating run (each right after its base):

  A-noline   A without the access_log
  R3-recoff  R3 with the filter's record off (accessLog.enabled: false):
             the same line, its redis_guard field empty
  R3-noline  R3-recoff without the access_log

Every headline Envoy logs the same JSON line per request: envoy/envoy.yaml's
HCM access_log as rendered, put into B and C through their ACCESS_LOG
placeholder. same_access_log() checks the configs before anything starts, and
Stack.check_log_lines() the lines each Envoy wrote for its probe.

The process helpers (spawn, ports, the Redis client) are envoy/bench.py's,
the ones make bench-tier uses too; the rest is here, so that bench.py's
internals can change without this file.
"""
import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # envoy/: the project's bench helpers
import bench as B  # noqa: E402
from bench_stack import tail  # noqa: E402  (a log's last lines, as make bench shows them)

ROOT = B.ROOT
HOST = B.HOST
PATH = "/api/bench"
WASM = ROOT / "target" / "wasm32-wasip1" / "release" / "redis_guard.wasm"
BUILD = ROOT / "target" / "bench-peers" / "build"
LIMITADOR = BUILD / "target" / "limitador" / "release" / "limitador-server"
WASM_SHIM = BUILD / "target" / "wasm-shim" / "wasm32-wasip1" / "release" / "wasm_shim.wasm"
SOURCES = HERE / "sources.txt"

# Webdis admits only these (webdis.json's http_basic_auth), made for this
# run; every filter config sends them (redis.credentials).
WEBDIS_USER = "redis-guard"
WEBDIS_PASSWORD = secrets.token_urlsafe(24)  # Webdis caps user:password at 53 bytes
BIG = 1_000_000_000  # never exhausted: 1e9 tokens, refilled 1e9 per second


def rg_filter(batch=None, lease=None, record=True):
    """make bench's filter config for (b), (f), (e), (x): one token bucket per
    x-user, always under budget; fail closed after 500 ms, as B and C.
    record=False turns the filter's access-log record off."""
    limit = {"name": "bench-tb", "descriptor": [{"header": "x-user"}],
             "tokenBucket": {"capacity": BIG, "refill": BIG, "periodMs": 1000}}
    if lease:
        limit["lease"] = lease
    cfg = {"redis": {"cluster": "webdis", "timeoutMs": 500,
                     "credentials": {"username": WEBDIS_USER, "password": WEBDIS_PASSWORD}},
           "keyPrefix": "rg", "failureMode": "deny", "limits": [limit]}
    if batch is not None:
        cfg["redis"]["batch"] = batch
    if not record:
        cfg["accessLog"] = {"enabled": False}
    return cfg


SINGLE = {"enabled": False}  # batching off: one EVALSHA per request

# The alternation's order. kind: "rg" renders envoy/envoy.yaml (A without
# its wasm filter), "peer" one of this folder's templates.
SCENARIOS = [
    {"id": "A", "kind": "rg", "filter": None, "request": "get",
     "what": "no filter (make bench's (a))"},
    {"id": "B", "kind": "peer", "template": "envoy-B-wasm-shim.yaml", "request": "get",
     "what": "wasm-shim → Limitador (gRPC) → Redis"},
    {"id": "C", "kind": "peer", "template": "envoy-C-native-ratelimit.yaml", "request": "get",
     "what": "Envoy's ratelimit filter → Limitador (gRPC) → Redis"},
    {"id": "R1", "kind": "rg", "filter": rg_filter(batch=SINGLE), "request": "get",
     "what": "redis-guard strict, batching off (make bench's (b))"},
    {"id": "R3", "kind": "rg", "filter": rg_filter(), "request": "get",
     "what": "redis-guard strict, batching on: the default (make bench's (f))"},
    {"id": "R2", "kind": "rg", "filter": rg_filter(lease={"tokens": 100, "ttlMs": 1000}),
     "request": "get", "what": "redis-guard lease 100 tokens / 1 s (make bench's (e))"},
    {"id": "X", "kind": "rg", "filter": rg_filter(batch=SINGLE), "request": "get-anon",
     "what": "redis-guard loaded, nothing applies (make bench's (x))"},
]
HEADLINE = SCENARIOS

# Diagnostics (issue 43: "the access-log record adds <= 2 us of Envoy CPU per
# request, same-minute on/off"): each runs right after its base ("after") in
# every -c32 round, never in the head-to-head ratios. line=False: no access_log.
DIAGNOSTICS = [
    {"id": "A-noline", "kind": "rg", "filter": None, "request": "get", "after": "A",
     "line": False, "what": "A without the access_log"},
    {"id": "R3-recoff", "kind": "rg", "filter": rg_filter(record=False), "request": "get",
     "after": "R3", "what": "R3, the filter's record off (accessLog.enabled: false), "
     "the same line"},
    {"id": "R3-noline", "kind": "rg", "filter": rg_filter(record=False), "request": "get",
     "after": "R3", "line": False, "what": "R3, the record off and no access_log"},
    # X's Envoy with noop.wat in place of redis_guard.wasm: the floor any
    # proxy-wasm filter pays in V8 per request (a context, the callbacks'
    # crossings), so that X - A splits into V8's part and the filter's own.
    {"id": "X-noop", "kind": "rg", "filter": rg_filter(batch=SINGLE), "request": "get-anon",
     "after": "X", "wasm": "noop", "what": "X's Envoy with a no-op wasm module (noop.wat)"},
]

NOOP_WAT = HERE / "noop.wat"


def noop_wasm(run):
    """noop.wat compiled for this run (wasmtime's wat2wasm, in the venv)."""
    import wasmtime

    out = run / "noop.wasm"
    out.write_bytes(wasmtime.wat2wasm(NOOP_WAT.read_text()))
    return out


def scenarios(diagnostics=True):
    """The alternation's order: the headline scenarios, each diagnostic
    right after its base (so that a pair is measured seconds apart)."""
    out = []
    for sc in HEADLINE:
        out.append(sc)
        out += [d for d in DIAGNOSTICS if diagnostics and d["after"] == sc["id"]]
    return out


def set_run_dir(run):
    """Where spawn() starts processes (its module's RUN)."""
    setattr(sys.modules[B.spawn.__module__], "RUN", run)


# ---------------------------------------------------------------------------
# Configs


def render(out_dir, templates, sets, filter_cfg=None, jwks=None):
    """envoy/render.py: every placeholder filled, none left, none unused."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, str(ROOT / "envoy" / "render.py"), "--out", str(out_dir)]
    if filter_cfg is not None:
        (out_dir / "filter.json").write_text(json.dumps(filter_cfg, indent=2))
        args += ["--filter-config", str(out_dir / "filter.json")]
    if jwks:
        args += ["--jwks", str(jwks)]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    args += [str(t) for t in templates]
    r = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise B.BenchError(f"envoy/render.py failed: {r.stderr.strip()}")


def ingress_hcm(doc):
    """The HTTP connection manager of the `ingress` listener."""
    for listener in doc["static_resources"]["listeners"]:
        for chain in listener.get("filter_chains", []):
            for f in chain.get("filters", []):
                tc = f.get("typed_config", {})
                if tc.get("stat_prefix") == "ingress":
                    return tc
    raise B.BenchError("no HTTP connection manager with stat_prefix ingress")


def drop_wasm(doc):
    hcm = ingress_hcm(doc)
    kept = [h for h in hcm["http_filters"] if h.get("name") != "envoy.filters.http.wasm"]
    if len(kept) == len(hcm["http_filters"]):
        raise B.BenchError("envoy/envoy.yaml: no envoy.filters.http.wasm filter to remove for A")
    hcm["http_filters"] = kept
    return doc


def write_configs(run, ports, limitador_port, wasm_shim, scs=HEADLINE):
    """Renders the Envoy configs of every scenario of scs, the upstream's
    and Webdis'; returns {scenario id: {"config", "port", "admin"}}."""
    import yaml

    sys.path.insert(0, str(ROOT / "envoy"))
    import demo_jwt

    # envoy.yaml's jwt_authn needs a JWKS (it verifies tokens on /v1/me
    # only; no scenario sends one): the demo's issuer, a key for this run.
    jwks = run / "jwks.json"
    demo_jwt.keys(str(jwks), str(run / "jwt.secret"))
    render(run, [ROOT / "envoy" / "webdis.json"], {
        "REDIS_HOST": HOST, "REDIS_PORT": ports["redis"], "REDIS_AUTH": "null",
        "BIND_ADDRESS": HOST, "WEBDIS_PORT": ports["webdis"], "WEBDIS_LOG": run / "webdis.log",
        "WEBDIS_USERNAME": WEBDIS_USER, "WEBDIS_PASSWORD": WEBDIS_PASSWORD})
    render(run / "upstream", [HERE / "envoy-upstream.yaml"],
           {"LISTEN_PORT": ports["upstream"], "ADMIN_PORT": ports["upstream_admin"]})
    (run / "upstream" / "envoy-upstream.yaml").rename(run / "upstream" / "envoy.yaml")
    out = {}
    for sc in scs:
        if sc["kind"] != "rg":
            continue
        d = run / sc["id"]
        port, admin = ports["envoys"][sc["id"]]
        render(d, [ROOT / "envoy" / "envoy.yaml"], {
            "BIND_ADDRESS": HOST, "ADMIN_PORT": admin, "LISTEN_PORT": port,
            "UPSTREAM_HOST": HOST, "UPSTREAM_PORT": ports["upstream"],
            # No gRPC upstream nor object store in the bench: a port nobody
            # listens on (no config here sends anything there).
            "GRPC_UPSTREAM_PORT": ports["unused"], "OBJECT_STORE_HOST": HOST,
            "OBJECT_STORE_PORT": ports["unused"], "WEBDIS_HOST": HOST,
            "WEBDIS_PORT": ports["webdis"],
            "WASM_PATH": noop_wasm(run) if sc.get("wasm") == "noop" else WASM,
            "WASM_RUNTIME": "v8",
        }, sc["filter"] or rg_filter(batch=SINGLE), jwks)
        if sc["filter"] is None or not sc.get("line", True):
            doc = yaml.safe_load((d / "envoy.yaml").read_text())
            if sc["filter"] is None:
                drop_wasm(doc)
            if not sc.get("line", True) and not ingress_hcm(doc).pop("access_log", None):
                raise B.BenchError("envoy/envoy.yaml has no access_log to remove")
            (d / "envoy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        out[sc["id"]] = {"config": d / "envoy.yaml", "port": port, "admin": admin}
    a_doc = yaml.safe_load(out["A"]["config"].read_text())
    access_log = ingress_hcm(a_doc).get("access_log")
    if not access_log:
        raise B.BenchError("envoy/envoy.yaml has no access_log: nothing to give B and C")
    for sc in scs:
        if sc["kind"] != "peer":
            continue
        d = run / sc["id"]
        port, admin = ports["envoys"][sc["id"]]
        sets = {"LISTEN_PORT": port, "ADMIN_PORT": admin, "UPSTREAM_PORT": ports["upstream"],
                "LIMITADOR_GRPC_PORT": limitador_port,
                # JSON is YAML: the list goes in as one flow sequence.
                "ACCESS_LOG": json.dumps(access_log)}
        if sc["id"] == "B":
            sets["WASM_SHIM_PATH"] = wasm_shim
        render(d, [HERE / sc["template"]], sets)
        (d / sc["template"]).rename(d / "envoy.yaml")
        out[sc["id"]] = {"config": d / "envoy.yaml", "port": port, "admin": admin}
    same_access_log({sid: e["config"] for sid, e in out.items()}, scs)
    return out


def same_access_log(configs, scs=HEADLINE):
    """Raises unless every config's ingress access_log is A's, and non-empty
    (none at all in the diagnostics without a line)."""
    import yaml

    logs = {sid: ingress_hcm(yaml.safe_load(Path(p).read_text())).get("access_log")
            for sid, p in configs.items()}
    noline = {sc["id"] for sc in scs if not sc.get("line", True)}
    differ = [sid for sid, al in logs.items()
              if (al is not None if sid in noline else al != logs["A"])]
    if not logs["A"] or differ:
        raise B.BenchError(f"access_log differs from A's in {differ or 'A (none)'}")
    return logs["A"]


def validate(envoy, config):
    """Envoy's own check of a config (--mode validate): None if it passes."""
    r = subprocess.run([envoy, "--mode", "validate", "-c", str(config), "--log-level", "warn"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        return None
    return (r.stdout + r.stderr).strip()[-1500:]


def source_revs():
    """{repository: (pinned, built)} from sources.txt and build.sh's copies."""
    revs = {}
    for line in SOURCES.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        d, repo, rev = line.split()[:3]
        stamp = BUILD / "src" / d / ".peers-source-rev"
        built = stamp.read_text().split()[0] if stamp.exists() else "unknown"
        revs[repo] = {"pinned": rev, "built": built}
    return revs


# ---------------------------------------------------------------------------
# The processes


class Stack:
    def __init__(self, run, args, scs=HEADLINE):
        self.run, self.args, self.scenarios = run, args, scs
        self.envoy = B.envoy_binary()
        self.envoys = {}  # scenario id -> {"proc", "port", "admin", "config", "log"}

    def ports(self):
        names = ["redis", "webdis", "upstream", "upstream_admin", "unused", "grpc", "http"]
        scs = self.scenarios
        got = B.free_ports(len(names) + 2 * len(scs))  # all at once: none the same
        ports = dict(zip(names, got))
        rest = got[len(names):]
        ports["envoys"] = {sc["id"]: (rest[2 * i], rest[2 * i + 1])
                           for i, sc in enumerate(scs)}
        return ports

    def start(self):
        run, a = self.run, self.args
        p = self.ports()
        self.redis_port = p["redis"]
        configs = write_configs(run, p, p["grpc"], a.wasm_shim, self.scenarios)
        self.redis = B.spawn("redis-server", [
            "redis-server", "--port", str(p["redis"]), "--bind", HOST, "--save", "",
            "--appendonly", "no", "--dir", str(run), "--logfile", str(run / "redis.log"),
            "--daemonize", "no"], run / "redis.out")
        if not B.wait_port(self.redis, p["redis"]):
            raise B.BenchError(f"redis-server did not start:\n{tail(run / 'redis.log')}")
        self.r = B.Redis(p["redis"])
        self.webdis = B.spawn("webdis", ["webdis", str(run / "webdis.json")], run / "webdis.out")
        if not B.wait_port(self.webdis, p["webdis"]):
            raise B.BenchError(f"webdis did not start:\n{tail(run / 'webdis.log')}")
        self.upstream = self.start_envoy("upstream", run / "upstream" / "envoy.yaml",
                                         p["upstream"], run / "upstream" / "envoy.log")
        limits = run / "limits.yaml"
        limits.write_text(Path(a.limits).read_text())
        self.limitador = B.spawn("limitador", [
            str(a.limitador), "--rls-ip", HOST, "--rls-port", str(p["grpc"]),
            "--http-ip", HOST, "--http-port", str(p["http"]), *a.limitador_args.split(),
            str(limits), "redis", f"redis://{HOST}:{p['redis']}"], run / "limitador.log")
        if not B.wait_port(self.limitador, p["grpc"], 30):
            raise B.BenchError(f"limitador did not start:\n{tail(run / 'limitador.log')}")
        B.log(f"limitador up: gRPC :{p['grpc']}")
        for sc in self.scenarios:
            e = configs[sc["id"]]
            e["log"] = run / sc["id"] / "envoy.log"
            e["proc"] = self.start_envoy(f"envoy ({sc['id']})", e["config"], e["port"], e["log"])
            self.envoys[sc["id"]] = e
            why = self.probe(sc)
            if why:
                raise B.BenchError(f"scenario {sc['id']}: {why}\n{tail(e['log'])}\n"
                                   f"limitador:\n{tail(run / 'limitador.log')}")
            B.log(f"scenario {sc['id']}: Envoy up on :{e['port']} (admin :{e['admin']})")
        self.check_log_lines()

    def start_envoy(self, name, config, port, logfile):
        proc = B.spawn(name, [self.envoy, "-c", str(config), "--concurrency", "1",
                              "--disable-hot-restart", "--log-level", self.args.envoy_log_level],
                       logfile)
        if not B.wait_port(proc, port, 30):
            raise B.BenchError(f"{name} did not start:\n{tail(logfile)}")
        return proc

    def probe(self, sc):
        """None once the scenario's Envoy answers as it should: 200, and the
        request reached what the scenario measures (Limitador and Redis for
        B and C; Webdis for R1, R3, R2; neither for A and X)."""
        e = self.envoys[sc["id"]]
        anon = sc["request"] == "get-anon"
        last = None
        for _ in range(40):  # Webdis and Limitador may still be connecting to Redis
            try:
                self.r.cmd("FLUSHALL", "SYNC")
                s0 = envoy_stats(e["admin"])
                status, headers, _ = B.hreq(e["port"], "GET", PATH,
                                            {} if anon else {"x-user": "probe"})
                s1 = envoy_stats(e["admin"])
                grpc = moved(s0, s1, "cluster.limitador.upstream_rq_total")
                webdis = moved(s0, s1, "cluster.webdis.upstream_rq_total")
                keys = self.r.cmd("DBSIZE")
                if sc["kind"] == "peer":
                    ok = grpc > 0 and keys > 0
                elif sc["filter"] is None or anon:
                    ok = webdis == 0
                else:
                    # A strict decision says its policy; a lease's may not.
                    ok = webdis > 0 and ("ratelimit-policy" in headers
                                         or "lease" in sc["filter"]["limits"][0])
                if status == 200 and ok:
                    return None
                last = (f"GET {status}, Limitador calls {grpc}, Webdis calls {webdis}, "
                        f"Redis keys {keys}, headers {sorted(headers)}")
            except OSError as ex:
                last = f"{type(ex).__name__}: {ex}"
            time.sleep(0.25)
        return f"probe failed ({last})"

    def check_log_lines(self, wait_s=15.0):
        """Each Envoy under test wrote its probe's access line, with A's
        fields, the filter's record where it decided and has it on; the
        diagnostics without a line wrote none."""
        want = {sc["id"] for sc in self.scenarios if sc.get("line", True)}
        lines = {}
        end = time.monotonic() + wait_s
        while time.monotonic() < end and len(lines) < len(want):
            for sid in want - set(lines):
                line = last_json_line(self.envoys[sid]["log"])
                if line is not None:
                    lines[sid] = line
            time.sleep(0.2)
        missing = sorted(want - set(lines))
        if missing:
            raise B.BenchError(f"no JSON access-log line in the log of {missing}")
        # Probed before the last of those lines was written: a line would be there.
        extra = sorted(sid for sid in set(self.envoys) - want
                       if last_json_line(self.envoys[sid]["log"]) is not None)
        if extra:
            raise B.BenchError(f"an access-log line in the log of {extra}, which has none")
        fields = sorted(lines["A"])
        differ = {sid: sorted(v) for sid, v in lines.items() if sorted(v) != fields}
        if differ:
            raise B.BenchError(f"access-log fields differ from A's {fields}: {differ}")
        for sc in self.scenarios:
            if sc["id"] not in lines or not sc.get("filter") or sc["request"] != "get":
                continue
            record = lines[sc["id"]].get("redis_guard") not in (None, "", "-")
            on = sc["filter"].get("accessLog", {}).get("enabled", True)
            if record != on:
                raise B.BenchError(f"scenario {sc['id']}: the filter's record is "
                                   f"{'there' if record else 'missing'} in its line, but "
                                   f"accessLog.enabled is {on}: {lines[sc['id']]}")
        B.log(f"every Envoy under test logs the same line: {', '.join(fields)}"
              + (f" (none in {', '.join(sorted(set(self.envoys) - want))})"
                 if set(self.envoys) - want else ""))
        return lines


def moved(s0, s1, key):
    return s1.get(key, 0) - s0.get(key, 0)


def last_json_line(path):
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


STATS_RE = (r"^(http\.ingress\.downstream_rq_[0-9]xx|http\.ingress\.downstream_rq_total|"
            r"cluster\.(upstream|webdis|limitador)\.upstream_(cx_total|rq_total|rq_timeout)|"
            r"cluster\.limitador\.grpc\..*|cluster\.upstream\.ratelimit\..*|"
            r"cluster\.webdis\.upstream_rq_[0-9]xx|wasmcustom\..*)$")


def envoy_stats(admin_port):
    from urllib.parse import quote

    _, _, body = B.hreq(admin_port, "GET", "/stats?filter=" + quote(STATS_RE, safe=""))
    stats = {}
    for line in body.decode().splitlines():
        k, sep, v = line.partition(": ")
        if sep and v.strip().isdigit():
            stats[k] = int(v)
    return stats


# ---------------------------------------------------------------------------
# wrk

WRK_DONE = r"""
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%.0f,"duration_us":%.0f,' ..
    '"errors":{"connect":%.0f,"read":%.0f,"write":%.0f,"status":%.0f,"timeout":%.0f},' ..
    '"latency_us":{"p50":%.0f,"p90":%.0f,"p99":%.0f,"p999":%.0f,"max":%.0f}}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max))
  io.flush()
end
"""
WRK_REQUEST = {"get": 'wrk.method = "GET"\nwrk.headers["x-user"] = "bench-user"\n',
               "get-anon": 'wrk.method = "GET"\n'}


def run_wrk(run, port, kind, connections, seconds, threads=1):
    """One wrk run: its summary, and its own CPU (rusage) as cpu_us."""
    script = run / f"wrk-{kind}.lua"
    script.write_text(WRK_REQUEST[kind] + WRK_DONE)
    out_path = run / "wrk.out"
    out_path.write_bytes(b"")
    p = B.spawn("wrk", ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s",
                        "--timeout", "5s", "-s", str(script), f"http://{HOST}:{port}{PATH}"],
                out_path)
    deadline = time.monotonic() + seconds + 30
    while True:
        pid, status, rusage = os.wait4(p.pid, os.WNOHANG)
        if pid == p.pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            B.stop(p)
            raise B.BenchError("wrk did not finish in time")
        time.sleep(0.05)
    B.stop(p)  # reaped: only leaves the list of processes to stop
    text = out_path.read_text(errors="replace")
    m = re.search(r"^BENCH_JSON (.*)$", text, re.M)
    if p.returncode != 0 or not m:
        raise B.BenchError(f"wrk failed (exit {p.returncode}):\n{text[-2000:]}")
    res = json.loads(m.group(1))
    res["cpu_us"] = (rusage.ru_utime + rusage.ru_stime) * 1e6
    return res
