"""The soak's stack on 127.0.0.1, every process on a free port and stopped on
exit: Redis a (primary) and b (its replica), both with the append-only file
fsynced at every write, reached through a forwarder (fwd.py) that a failover
moves; two Webdis behind it, each Envoy's webdis cluster holding both; three
Envoys with the filter delivered by ECDS (a file per Envoy, so a reload is
one rename); moto's S3 server as the object store; envoy/upstream.py as the
upstream. The wiring is the tests' (tests/support/): envoy.yaml, webdis.json
and redis.acl rendered by envoy/render.py, Webdis behind HTTP Basic
credentials, Redis with its ACL users."""

import base64
import glob
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from . import config
from .procs import HOST, Proc, Redis, SoakError, free_ports, log, wait_for

ROOT = Path(__file__).resolve().parents[2]
ENVOY_DIR = ROOT / "envoy"
WASM = ROOT / "target" / "wasm32-wasip1" / "release" / "redis_guard.wasm"
PY = sys.executable
ECDS_NAME = "redis_guard_ecds"
WEBDIS_USER = "redis-guard"


def envoy_binary():
    if os.environ.get("REDIS_GUARD_ENVOY"):
        return os.environ["REDIS_GUARD_ENVOY"]
    found = sorted(glob.glob(str(ROOT / ".venv/lib/python3*/site-packages/envoy/_bin/envoy")))
    if not found:
        raise SoakError("Envoy not found in .venv: run 'make envoy-dep'")
    return found[0]


def render(out, sets, templates, filter_cfg=None):
    args = [PY, str(ENVOY_DIR / "render.py"), "--out", str(out)]
    if filter_cfg is not None:
        path = Path(out) / "filter.json"
        path.write_text(filter_cfg)
        args += ["--filter-config", str(path), "--jwks", str(ENVOY_DIR / "jwks.json")]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    args += [str(ENVOY_DIR / t) for t in templates]
    r = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise SoakError(f"envoy/render.py failed: {r.stderr.strip()}")


class Stack:
    def __init__(self, run_dir, envoys=3, webdis=2):
        self.run = Path(run_dir)
        if self.run.exists():
            shutil.rmtree(self.run)
        self.run.mkdir(parents=True)
        self.n_envoys, self.n_webdis = envoys, webdis
        self.envoy_bin = envoy_binary()
        self.redis_pw = secrets.token_hex(16)
        self.admin_pw = secrets.token_hex(16)
        self.webdis_pw = secrets.token_hex(16)
        self.redis = {}  # "a"/"b" -> Proc
        self.primary = "a"
        self.webdis = []
        self.envoys = []  # dicts: proc, port, admin, dir
        self.timeout_ms = 1000
        # Held by the injector while a fault is made and undone, so the
        # monitor never reads a process it killed as one that died.
        self.fault_lock = threading.Lock()

    # -- Redis ---------------------------------------------------------------

    def redis_args(self, name):
        d = self.run / f"redis-{name}"
        d.mkdir(exist_ok=True)
        args = ["redis-server", "--port", self.ports[name], "--bind", HOST, "--save", "",
                "--appendonly", "yes", "--appendfsync", "always",
                "--aclfile", self.run / "redis.acl", "--dir", d,
                "--logfile", d / "redis.log", "--daemonize", "no",
                "--masteruser", "admin", "--masterauth", self.admin_pw]
        if name != self.primary:
            args += ["--replicaof", HOST, self.ports[self.primary]]
        return args

    def start_redis(self, name):
        p = self.redis.get(name)
        if p is None:
            p = Proc(f"redis-{name}", [], self.run / f"redis-{name}.out", port=self.ports[name])
            self.redis[name] = p
        p.args = [str(a) for a in self.redis_args(name)]
        p.start()
        # Loading the append-only file: until then Redis answers LOADING.
        wait_for(f"redis-{name} loaded", lambda: self.admin(name).info("persistence")
                 .get("loading") == "0", 60)

    def admin(self, name=None):
        return Redis(self.ports[name or self.primary], "admin", self.admin_pw)

    def replica(self):
        return "b" if self.primary == "a" else "a"

    def in_sync(self):
        """The replica is connected and has every byte the primary wrote."""
        p, r = self.admin(), self.admin(self.replica())
        try:
            pi, ri = p.info("replication"), r.info("replication")
            return (ri.get("master_link_status") == "up"
                    and pi.get("master_repl_offset") == ri.get("slave_repl_offset")
                    and pi.get("connected_slaves") == "1")
        finally:
            p.close()
            r.close()

    def point_forwarder(self, port):
        import socket
        with socket.create_connection((HOST, self.ports["fwd_ctl"]), timeout=5) as s:
            s.sendall(b"%d\n" % port)
            if not s.makefile().readline().startswith("ok"):
                raise SoakError("the forwarder refused the new target")

    # -- start ----------------------------------------------------------------

    def start(self):
        names = ["a", "b", "fwd", "fwd_ctl", "up", "grpc", "s3"]
        names += [f"webdis{i}" for i in range(self.n_webdis)]
        for i in range(self.n_envoys):
            names += [f"envoy{i}", f"admin{i}"]
        self.ports = dict(zip(names, free_ports(len(names))))
        # The Envoys load a copy: a build during the run (the checkout is
        # shared) must not change the filter an Envoy restarted into.
        self.wasm = self.run / "redis_guard.wasm"
        if not WASM.exists():
            raise SoakError(f"{WASM} missing: run 'make build'")
        shutil.copyfile(WASM, self.wasm)
        self.wasm_sha = hashlib.sha256(self.wasm.read_bytes()).hexdigest()[:12]
        render(self.run, {
            "REDIS_PASSWORD_HASH": hashlib.sha256(self.redis_pw.encode()).hexdigest(),
            "REDIS_ADMIN_PASSWORD_HASH": hashlib.sha256(self.admin_pw.encode()).hexdigest(),
            "KEY_PREFIX": "rg"}, ["redis.acl"])
        self.start_redis("a")
        self.start_redis("b")
        wait_for("the replica in sync", self.in_sync, 30)
        self.fwd = Proc("forwarder", [PY, "-m", "soak.fwd", "--listen", self.ports["fwd"],
                                      "--control", self.ports["fwd_ctl"],
                                      "--target", self.ports["a"]],
                        self.run / "fwd.log", cwd=str(ENVOY_DIR), port=self.ports["fwd"]).start()
        for i in range(self.n_webdis):
            d = self.run / f"webdis{i}"
            d.mkdir()
            render(d, {"REDIS_HOST": HOST, "REDIS_PORT": self.ports["fwd"],
                       "REDIS_AUTH": json.dumps(self.redis_pw), "BIND_ADDRESS": HOST,
                       "WEBDIS_PORT": self.ports[f"webdis{i}"], "WEBDIS_LOG": d / "webdis.log",
                       "WEBDIS_USERNAME": WEBDIS_USER, "WEBDIS_PASSWORD": self.webdis_pw},
                   ["webdis.json"])
            self.webdis.append(Proc(f"webdis{i}", ["webdis", d / "webdis.json"],
                                    d / "webdis.out", port=self.ports[f"webdis{i}"]).start())
        self.upstream = Proc("upstream", [PY, ENVOY_DIR / "upstream.py", "--port",
                                          self.ports["up"]], self.run / "upstream.log",
                             port=self.ports["up"]).start()
        self.grpc = Proc("grpc service", [PY, ENVOY_DIR / "grpc_peer.py", "serve", "--port",
                                          self.ports["grpc"]], self.run / "grpc.log",
                         port=self.ports["grpc"]).start()
        self.s3 = Proc("moto_server", [Path(PY).parent / "moto_server", "-H", HOST, "-p",
                                       self.ports["s3"]], self.run / "moto.log",
                       env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}, port=self.ports["s3"]).start()
        env_file = self.run / "objectstore.env"
        r = subprocess.run([PY, ENVOY_DIR / "s3ctl.py", "bootstrap", str(self.ports["s3"]),
                            config.BUCKET, "--env-file", env_file, "--lifecycle-days", "2",
                            "--lifecycle-prefix", "redis-guard/"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise SoakError(f"s3ctl bootstrap failed: {r.stderr.strip()}")
        self.s3_env = dict(line.split("=", 1) for line in env_file.read_text().split()
                           if "=" in line)
        for i in range(self.n_envoys):
            self.envoys.append(self.envoy_config(i))
        for e in self.envoys:
            self.start_envoy(e)

    # -- Envoys ----------------------------------------------------------------

    def envoy_config(self, i):
        d = self.run / f"envoy{i}"
        (d / "ecds").mkdir(parents=True)
        render(d, {"BIND_ADDRESS": HOST, "ADMIN_PORT": self.ports[f"admin{i}"],
                   "LISTEN_PORT": self.ports[f"envoy{i}"], "UPSTREAM_HOST": HOST,
                   "UPSTREAM_PORT": self.ports["up"], "GRPC_UPSTREAM_PORT": self.ports["grpc"],
                   "WEBDIS_HOST": HOST, "WEBDIS_PORT": self.ports["webdis0"], "WASM_PATH": self.wasm,
                   "WASM_RUNTIME": "v8", "OBJECT_STORE_HOST": HOST,
                   "OBJECT_STORE_PORT": self.ports["s3"]},
               ["envoy.yaml"], config.filter_json(self.timeout_ms))
        doc = yaml.safe_load((d / "envoy.yaml").read_text())
        doc["node"] = {"id": f"soak-{i}", "cluster": "soak"}
        hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        hcm = hcm["typed_config"]
        # One access line per request would cost more CPU than the filter.
        hcm.pop("access_log", None)
        filters = hcm["http_filters"]
        at = next(k for k, f in enumerate(filters) if f["name"] == "envoy.filters.http.wasm")
        self.ecds_template = filters[at]["typed_config"]
        filters[at] = {"name": ECDS_NAME, "config_discovery": {
            "config_source": {"path_config_source": {
                "path": str(d / "ecds" / "ecds.yaml"),
                "watched_directory": {"path": str(d / "ecds")}}},
            "type_urls": ["type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"]}}
        for c in doc["static_resources"]["clusters"]:
            if c["name"] == "webdis":
                c["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
                    {"endpoint": {"address": {"socket_address": {
                        "address": HOST, "port_value": self.ports[f"webdis{w}"]}}}}
                    for w in range(self.n_webdis)]
        (d / "envoy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        e = {"i": i, "dir": d, "port": self.ports[f"envoy{i}"],
             "admin": self.ports[f"admin{i}"], "reloads": 0, "timeout_ms": self.timeout_ms}
        self.write_ecds(e)
        auth = base64.b64encode(f"{WEBDIS_USER}:{self.webdis_pw}".encode()).decode()
        env = {"REDIS_GUARD_WEBDIS_AUTHORIZATION": f"Basic {auth}", **self.s3_env}
        e["proc"] = Proc(f"envoy{i}", [self.envoy_bin, "-c", d / "envoy.yaml", "--concurrency",
                                       "1", "--disable-hot-restart", "--log-level", "warn",
                                       "--file-flush-interval-msec", "200"],
                         d / "envoy.log", env=env, port=e["port"])
        return e

    def write_ecds(self, e):
        """The filter's configuration as the ECDS resource, replaced by a
        rename (Envoy watches the directory for the move)."""
        typed = json.loads(json.dumps(self.ecds_template))
        typed["config"]["configuration"]["value"] = config.filter_json(e["timeout_ms"])
        doc = {"resources": [{
            "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
            "name": ECDS_NAME, "typed_config": typed}]}
        tmp = e["dir"] / "ecds.tmp"
        tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
        os.replace(tmp, e["dir"] / "ecds" / "ecds.yaml")

    def start_envoy(self, e):
        e["proc"].start(60)
        from .traffic import admin_get
        wait_for(f"envoy{e['i']} ready", lambda: admin_get(e["admin"], "/ready")[0] == 200, 60)
        wait_for(f"envoy{e['i']} took its filter",
                 lambda: self.reload_count(e) >= 1, 60)

    def reload_count(self, e):
        from .traffic import admin_stats
        s = admin_stats(e["admin"], f"extension_config_discovery.http_filter.{ECDS_NAME}"
                        ".config_reload")
        return sum(s.values())

    def reload(self, e):
        """A new configuration by ECDS (its timeout moved by 1 ms, so it is
        a new one); returns once this Envoy took it."""
        before = self.reload_count(e)
        # Per Envoy: a file that says what it said before is no new one.
        e["timeout_ms"] = 1001 if e["timeout_ms"] == 1000 else 1000
        self.write_ecds(e)
        wait_for(f"envoy{e['i']} reloaded", lambda: self.reload_count(e) > before, 20)
        e["reloads"] += 1
