"""One Compose project of envoy/compose.yaml, for make compose-test
(envoy/compose/check.py): its project name, the files and environment every
`compose` call of it gets, the host ports its Envoy is published on, and the
ways the checks reach it: HTTP to those ports on 127.0.0.1, `docker` on the
containers that carry its project label, `compose exec` and `run` inside it.

Every call names the project: nothing here reaches another project's
containers, networks or volumes, a user's `make compose-up` stack included.
"""
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PY = os.path.join(ROOT, ".venv", "bin", "python")
COMPOSE_FILE = "envoy/compose.yaml"
# What compose.yaml reads from the environment (its header): a stack's own
# values replace whatever the shell running make had.
VARIABLES = ("REDIS_IMAGE", "REDIS_GUARD_PORT", "REDIS_GUARD_ADMIN_PORT")
DEFAULT_PORT, DEFAULT_ADMIN = 10000, 9901
RESULTS = {"passed": 0, "failed": 0}


class Fail(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Fail(what)


def eq(got, want, what):
    if got != want:
        raise Fail(f"{what}: got {got!r}, want {want!r}")


def step(name):
    """A check: prints ok or FAIL with its time, counts it, never raises."""

    def wrap(fn):
        def go(*a):
            t = time.time()
            try:
                fn(*a)
            except Exception as e:  # any error fails the check, never skips it
                RESULTS["failed"] += 1
                print(f"FAIL {name}: {e}", flush=True)
                return False
            RESULTS["passed"] += 1
            print(f"ok   {name} ({time.time() - t:.1f} s)", flush=True)
            return True

        return go

    return wrap


def compose_base():
    """`docker compose` (v2) where the plugin is installed, else
    `docker-compose` (v1, the only one Debian bookworm packages)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    sys.exit("compose-test: neither `docker compose` nor `docker-compose` is installed")


BASE = compose_base()


def run(cmd, check_rc=True, timeout=300, env=None):
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check_rc and p.returncode != 0:
        raise Fail(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    return p


def docker(*args, **kw):
    return run(["docker"] + list(args), **kw)


def free_loopback_ports(n):
    """n distinct ports nothing listens on at 127.0.0.1 now (the kernel's
    choice, from its ephemeral range: never 10000 or 9901)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_free(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def wait_for(what, probe, seconds):
    end = time.time() + seconds
    while time.time() < end:
        try:
            if probe():
                return
        except (OSError, Fail, http.client.HTTPException):
            pass
        time.sleep(0.5)
    raise Fail(f"{what} not within {seconds} s")


def projects():
    """Compose projects with a container on this daemon, running or not."""
    out = docker("ps", "-a", "--format", '{{.Label "com.docker.compose.project"}}').stdout
    return sorted({p for p in out.split() if p})


class Stack:
    def __init__(self, project, files, env, port=DEFAULT_PORT, admin=DEFAULT_ADMIN):
        self.project, self.files, self.port, self.admin = project, list(files), port, admin
        self.env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
        self.env.update(env)
        self.cmd = BASE + ["-p", project] + [a for f in files for a in ("-f", f)]

    def describe(self):
        own = " ".join(f"{k}={self.env[k]}" for k in VARIABLES if k in self.env)
        return f"{own} {' '.join(self.cmd)}".strip()

    def compose(self, *args, **kw):
        return run(self.cmd + list(args), env=self.env, **kw)

    def config(self, files=None):
        """The file(s) as Compose reads them in this stack's environment."""
        import yaml

        cmd = BASE + ["-p", self.project] + [a for f in (files or self.files) for a in ("-f", f)]
        return yaml.safe_load(run(cmd + ["config"], env=self.env).stdout)

    # --- HTTP to the published ports only --------------------------------

    def request(self, method, path, headers=None, body=None, admin=False):
        c = http.client.HTTPConnection("127.0.0.1", self.admin if admin else self.port, timeout=30)
        try:
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            c.close()

    def envoy_ready(self):
        return self.request("GET", "/ready", admin=True)[0] == 200

    def prometheus(self):
        status, _, body = self.request("GET", "/stats/prometheus", admin=True)
        eq(status, 200, "/stats/prometheus")
        series = {}
        for line in body.decode().splitlines():
            if line.startswith("redis_guard_") and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                name = name[:-2] if name.endswith("{}") else name
                series[name] = float(value)
        return series

    def grpc_calls(self, specs):
        out = run([PY, "envoy/grpc_peer.py", "call", "--target", f"127.0.0.1:{self.port}", json.dumps(specs)])
        return json.loads(out.stdout)

    # --- its containers, networks and volumes ----------------------------

    def label(self):
        return f"label=com.docker.compose.project={self.project}"

    def containers(self, service=None):
        """The project's containers, running or not."""
        args = ["ps", "-a", "-q", "--filter", self.label()]
        if service:
            args += ["--filter", f"label=com.docker.compose.service={service}"]
        return docker(*args).stdout.split()

    def the_container(self, service):
        ids = self.containers(service)
        eq(len(ids), 1, f"containers of {service}")
        return inspect(ids[0])

    def leftovers(self):
        left = {
            "containers": self.containers(),
            "networks": docker("network", "ls", "-q", "--filter", self.label()).stdout.split(),
            "volumes": docker("volume", "ls", "-q", "--filter", self.label()).stdout.split(),
        }
        # By name too, in case a resource lost its labels: Compose (v1 and
        # v2) names networks and volumes <project>_<name>, and another
        # project's name may begin with this one's followed by "-".
        for kind in ("network", "volume"):
            names = docker(kind, "ls", "--format", "{{.Name}}").stdout.split()
            left[kind + "s"] += [n for n in names if n.startswith(self.project + "_")]
        return {k: sorted(set(v)) for k, v in left.items() if v}

    def redis_admin(self, *args):
        """The store's CLI as its admin user (the password is in the rendered
        volume): valkey-cli where the image has it, else redis-cli."""
        script = (
            '. /rendered/redis.env && exec "$(command -v valkey-cli || command -v redis-cli)" '
            '--user admin --pass "$REDIS_ADMIN_PASSWORD" --no-auth-warning "$@"'
        )
        return self.compose("exec", "-T", "redis", "sh", "-c", script, "sh", *args).stdout

    def redis_healthy(self):
        return self.the_container("redis")["State"].get("Health", {}).get("Status") == "healthy"

    def upstream_executions(self, path):
        """The demo upstream's count for `path`, read inside its container."""
        code = (
            "import json, urllib.request; "
            "print(json.load(urllib.request.urlopen('http://127.0.0.1:18080/__stats'))['byPath'].get(%r, 0))"
            % path
        )
        return int(self.compose("exec", "-T", "upstream", "python3", "-c", code).stdout.strip())

    def webdis_probe(self, mode):
        return self.compose(
            "run", "--rm", "--no-deps", "--entrypoint", "sh", "objectstore-init", "-c",
            'set -a && . /rendered/webdis.env && set +a && exec python3 -c "$0" "$1"', WEBDIS_PROBE, mode,
        ).stdout.split()

    def save_logs(self, name):
        logs = self.compose("logs", "--no-color", "--tail", "40", check_rc=False)
        path = os.path.join(ROOT, "target", "compose", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(logs.stdout + logs.stderr)
        return path


def inspect(cid):
    return json.loads(docker("inspect", cid).stdout)[0]


def state_of(ids):
    """Each container's (status, start time): a container stopped, removed,
    or stopped and started again does not keep both."""
    out = {}
    for cid in ids:
        st = inspect(cid)["State"]
        out[cid] = (st["Status"], st["StartedAt"])
    return out


# Run inside the stack (a one-off objectstore-init container: python3, the
# rendered volume, the backend network): Webdis' answer to an EVAL without and
# with the credentials render.py made. With "wait", polls (up to 30 s) until
# Redis answers through Webdis, as the tests do after restarting Redis.
WEBDIS_PROBE = """
import http.client, os, socket, sys, time
def post(auth, host="webdis"):
    c = http.client.HTTPConnection(host, 7379, timeout=10)
    h = {"Authorization": os.environ["REDIS_GUARD_WEBDIS_AUTHORIZATION"]} if auth else {}
    c.request("POST", "/", body=b"EVAL/return%207/0.raw", headers=h)
    r = c.getresponse()
    return r.status, r.read()
def every_webdis():
    return sorted({a[4][0] for a in socket.getaddrinfo("webdis", 7379, type=socket.SOCK_STREAM)})
if sys.argv[1] == "wait":
    # Every Webdis behind the name (Envoy's cluster resolves them all), not
    # the first that answers, and each on several new connections (its
    # threads keep their own Redis connections): each reconnects on its own
    # time, and a call Envoy sends to one still reconnecting times out.
    t = time.time()
    while time.time() - t < 30:
        try:
            if all(post(True, a) == (200, b":7\\r\\n") for a in every_webdis() for _ in range(8)):
                print("%.1f" % (time.time() - t)); sys.exit(0)
        except OSError:
            pass
        time.sleep(0.1)
    sys.exit("Redis did not answer through every Webdis in 30 s")
print(post(False)[0], *post(True))
"""
