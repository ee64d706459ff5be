#!/usr/bin/env python3
"""The compose stack, run for real (make compose-test; envoy/compose/run.sh
builds the stand-in images and starts Docker first).

Brings up envoy/compose.yaml, unchanged, with envoy/compose/standins.yaml
(which only swaps images), then checks through the published 127.0.0.1 ports
what `make demo` shows, Redis' durability across `restart redis` and a
`kill -s KILL` of its container, and that `down -v` leaves nothing. Traffic
goes only to 127.0.0.1:10000/9901 from here and between the stack's own
containers (`exec`, and `run` on its backend network). Each check prints ok or
FAIL; the last line is "compose-test: N passed, N failed"; exit 1 on a failure.
"""
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROJECT = "redis-guard"
FILES = ["envoy/compose.yaml", "envoy/compose/standins.yaml"]
PORT, ADMIN = 10000, 9901
PY = os.path.join(ROOT, ".venv", "bin", "python")
RESULTS = {"passed": 0, "failed": 0}


class Fail(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Fail(what)


def eq(got, want, what):
    if got != want:
        raise Fail(f"{what}: got {got!r}, want {want!r}")


def compose_cmd():
    """`docker compose` (v2) where the plugin is installed, else
    `docker-compose` (v1, the only one Debian bookworm packages)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        base = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        base = ["docker-compose"]
    else:
        sys.exit("compose-test: neither `docker compose` nor `docker-compose` is installed")
    args = ["-p", PROJECT]
    for f in FILES:
        args += ["-f", f]
    return base + args


COMPOSE = compose_cmd()


def run(cmd, check_rc=True, timeout=300):
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check_rc and p.returncode != 0:
        raise Fail(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    return p


def compose(*args, **kw):
    return run(COMPOSE + list(args), **kw)


def docker(*args, **kw):
    return run(["docker"] + list(args), **kw)


def step(name):
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


# --- HTTP to the published ports only ----------------------------------------


def request(method, path, headers=None, body=None, port=PORT):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def prometheus():
    status, _, body = request("GET", "/stats/prometheus", port=ADMIN)
    eq(status, 200, "/stats/prometheus")
    series = {}
    for line in body.decode().splitlines():
        if line.startswith("redis_guard_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name[:-2] if name.endswith("{}") else name
            series[name] = float(value)
    return series


def grpc_calls(specs):
    out = run([PY, "envoy/grpc_peer.py", "call", "--target", f"127.0.0.1:{PORT}", json.dumps(specs)])
    return json.loads(out.stdout)


# --- inside the stack ----------------------------------------------------------


def containers(service=None):
    """The project's containers, running or not."""
    args = ["ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"]
    if service:
        args += ["--filter", f"label=com.docker.compose.service={service}"]
    return docker(*args).stdout.split()


def inspect(cid):
    return json.loads(docker("inspect", cid).stdout)[0]


def the_container(service):
    ids = containers(service)
    eq(len(ids), 1, f"containers of {service}")
    return inspect(ids[0])


def upstream_executions(path):
    """The demo upstream's count for `path`, read inside its container."""
    code = (
        "import json, urllib.request; "
        "print(json.load(urllib.request.urlopen('http://127.0.0.1:18080/__stats'))['byPath'].get(%r, 0))"
        % path
    )
    return int(compose("exec", "-T", "upstream", "python3", "-c", code).stdout.strip())


def redis_admin(*args):
    """redis-cli as the admin user (its password is in the rendered volume)."""
    script = '. /rendered/redis.env && exec redis-cli --user admin --pass "$REDIS_ADMIN_PASSWORD" --no-auth-warning "$@"'
    return compose("exec", "-T", "redis", "sh", "-c", script, "sh", *args).stdout


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


def envoy_ready():
    return request("GET", "/ready", port=ADMIN)[0] == 200


def redis_healthy():
    return the_container("redis")["State"].get("Health", {}).get("Status") == "healthy"


def leftovers():
    label = f"label=com.docker.compose.project={PROJECT}"
    left = {
        "containers": containers(),
        "networks": docker("network", "ls", "-q", "--filter", label).stdout.split(),
        "volumes": docker("volume", "ls", "-q", "--filter", label).stdout.split(),
    }
    # By name too, in case a resource lost its labels.
    for kind in ("network", "volume"):
        names = docker(kind, "ls", "--format", "{{.Name}}").stdout.split()
        left[kind + "s"] += [n for n in names if re.match(rf"{PROJECT}[_-]", n)]
    return {k: v for k, v in left.items() if v}


# --- the checks ------------------------------------------------------------------


@step("the override only swaps images, for every service of envoy/compose.yaml")
def override_only_swaps_images():
    real = yaml.safe_load(open(os.path.join(ROOT, FILES[0])))
    over = yaml.safe_load(open(os.path.join(ROOT, FILES[1])))
    eq(list(over), ["services"], "top-level keys of the override")
    eq(sorted(over["services"]), sorted(real["services"]), "services the override names")
    for name, svc in over["services"].items():
        eq(list(svc), ["image"], f"keys of the override's {name}")
        check(svc["image"].startswith("redis-guard-standin/"), f"{name}: {svc['image']}")
    compose("config", "-q")


@step("up -d: one-shot services done, Redis and the store healthy, Envoy ready on 127.0.0.1")
def up():
    compose("up", "-d", timeout=600)
    wait_for("Envoy /ready on 127.0.0.1:9901", envoy_ready, 120)
    real = yaml.safe_load(open(os.path.join(ROOT, FILES[0])))
    over = yaml.safe_load(open(os.path.join(ROOT, FILES[1])))
    for name in real["services"]:
        c = the_container(name)
        eq(c["Config"]["Image"], over["services"][name]["image"], f"{name}'s image")
        state = c["State"]
        if name in ("render", "objectstore-init"):
            eq((state["Status"], state["ExitCode"]), ("exited", 0), f"{name} (one-shot)")
        else:
            eq(state["Status"], "running", f"{name}")
        if "healthcheck" in real["services"][name]:
            eq(state["Health"]["Status"], "healthy", f"{name}'s health")
        nets = sorted(re.sub(rf"^{PROJECT}[_-]", "", n) for n in c["NetworkSettings"]["Networks"])
        if state["Status"] == "running":
            eq(nets, sorted(real["services"][name]["networks"]), f"{name}'s networks")
        ports = {k: v for k, v in (c["NetworkSettings"]["Ports"] or {}).items() if v}
        if name == "envoy":
            got = sorted((k, b["HostIp"], b["HostPort"]) for k, bs in ports.items() for b in bs)
            eq(got, [("10000/tcp", "127.0.0.1", "10000"), ("9901/tcp", "127.0.0.1", "9901")], "envoy's ports")
        else:
            eq(ports, {}, f"{name}'s published ports")
    nets = {}
    for nid in docker("network", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}").stdout.split():
        n = json.loads(docker("network", "inspect", nid).stdout)[0]
        nets[n["Labels"]["com.docker.compose.network"]] = n["Internal"]
    eq(nets, {"backend": True, "edge": False}, "networks (name: internal)")


@step("token bucket per-user-burst: 5 allowed, the 6th is 429 with Retry-After")
def token_bucket():
    user = "compose-" + uuid.uuid4().hex[:8]
    got = [request("GET", "/api/orders", {"x-user": user}) for _ in range(6)]
    eq([s for s, _, _ in got], [200] * 5 + [429], "statuses")
    eq([h.get("x-ratelimit-remaining") for _, h, _ in got[:5]], ["4", "3", "2", "1", "0"], "remaining")
    h = got[5][1]
    check(h.get("retry-after") == "1", f"Retry-After {h.get('retry-after')!r}")
    eq(h.get("content-type"), "application/problem+json", "429 content type")
    eq(request("GET", "/api/orders", {"x-user": user + "-other"})[0], 200, "another user's own bucket")


def pay(key, body, path="/api/payments", extra=None):
    headers = {"Idempotency-Key": key, "content-type": "application/json"}
    headers.update(extra or {})
    return request("POST", path, headers, body)


@step("idempotency: a keyed POST runs once, its retry is replayed byte for byte, other body 422")
def idempotent_replay():
    key = "compose-" + uuid.uuid4().hex
    before = upstream_executions("/api/payments")
    first = pay(key, b'{"amount":10}')
    eq(first[0], 200, "first")
    check("idempotent-replayed" not in first[1], "first marked replayed")
    retry = pay(key, b'{"amount":10}')
    eq(retry[0], 200, "retry")
    eq(retry[1].get("idempotent-replayed"), "true", "retry's Idempotent-Replayed")
    eq(retry[2], first[2], "replayed body")
    eq(retry[1].get("content-type"), first[1].get("content-type"), "replayed content-type")
    eq(pay(key, b'{"amount":99}')[0], 422, "same key, other body")
    eq(upstream_executions("/api/payments") - before, 1, "upstream executions")


@step("large response: 1 MiB offloaded to moto's S3 (SigV4), replayed from it byte for byte")
def offload():
    key = "compose-big-" + uuid.uuid4().hex[:8]
    path = "/api/payments/statement"
    before = upstream_executions(path)
    big = {"x-upstream-binary-bytes": "1048576"}
    first = pay(key, b'{"month":"2026-11"}', path, big)
    eq((first[0], len(first[2])), (200, 1 << 20), "first (status, bytes)")
    retry = pay(key, b'{"month":"2026-11"}', path, big)
    eq(retry[1].get("idempotent-replayed"), "true", "retry's Idempotent-Replayed")
    eq(retry[2], first[2], "replayed 1 MiB body")
    eq(upstream_executions(path) - before, 1, "upstream executions")
    # The README's command for listing the bucket, from inside the stack.
    listing = compose(
        "run", "--rm", "--entrypoint", "sh", "objectstore-init", "-c",
        '. /rendered/objectstore.env && python3 /src/s3ctl.py --host objectstore list 5000 redis-guard '
        '"$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY"',
    ).stdout
    objects = json.loads(listing[listing.index("["):])
    eq([o["size"] for o in objects], [1 << 20], "objects in the bucket")
    check(objects[0]["key"].startswith("redis-guard/"), f"object key {objects[0]['key']}")


@step("gRPC: the free plan's 3rd call is RESOURCE_EXHAUSTED with RetryInfo")
def grpc_limited():
    spec = {"method": "Create", "data": "pen", "metadata": {"x-plan": "free", "x-tenant": "c-" + uuid.uuid4().hex[:8]}}
    got = grpc_calls([spec, spec, spec])
    # The stack has no gRPC service (compose.yaml: point GRPC_UPSTREAM_PORT at
    # yours): admitted calls end UNAVAILABLE at Envoy, the limited one at the filter.
    eq([r["code"] for r in got], [14, 14, 8], "grpc-status of the three calls")
    check(got[2].get("retry") and 0 < got[2]["retry"]["ms"] <= 30000, f"RetryInfo {got[2].get('retry')}")


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


def webdis_probe(mode):
    return compose(
        "run", "--rm", "--no-deps", "--entrypoint", "sh", "objectstore-init", "-c",
        'set -a && . /rendered/webdis.env && set +a && exec python3 -c "$0" "$1"', WEBDIS_PROBE, mode,
    ).stdout.split()


@step("Webdis, from inside the backend network: 403 without the credentials, EVAL runs with them")
def webdis_credentials():
    eq(webdis_probe("once"), ["403", "200", "b':7\\r\\n'"], "without, with (status, raw reply)")


@step("Prometheus stats at 127.0.0.1:9901: the verdicts and replays so far, exactly")
def stats():
    s = prometheus()
    want = {
        'redis_guard_ratelimit_rejected{limit="per-user-burst"}': 1,
        'redis_guard_ratelimit_allowed{limit="per-user-burst"}': 6,
        'redis_guard_ratelimit_rejected{limit="orders-create"}': 1,
        'redis_guard_ratelimit_allowed{limit="orders-create"}': 2,
        "redis_guard_idempotency_acquired": 2,
        "redis_guard_idempotency_replayed": 2,
        "redis_guard_idempotency_mismatched": 1,
        "redis_guard_idempotency_offloaded": 1,
        "redis_guard_idempotency_object_fetched": 1,
        "redis_guard_redis_errors": 0,
    }
    eq({k: s.get(k) for k in want}, want, "series")


def webdis_hosts():
    """The webdis cluster's hosts in Envoy's /clusters (ip:port)."""
    status, _, body = request("GET", "/clusters", port=ADMIN)
    eq(status, 200, "/clusters")
    return sorted({line.split("::")[1] for line in body.decode().splitlines()
                   if line.startswith("webdis::") and "::health_flags::" in line})


def decided_by_redis(n=4):
    """n requests of fresh users, each decided by Redis: 200 with the
    per-user bucket's remaining count, not the failure mode's (allow)
    answer. PUT, so that only per-user-burst applies (per-client-minute
    counts GET and POST, and later steps need its budget)."""
    users = ["replica-" + uuid.uuid4().hex[:8] for _ in range(n)]
    got = [request("PUT", "/api/orders", {"x-user": u}) for u in users]
    return all(s == 200 and h.get("x-ratelimit-remaining") == "4" for s, h, _ in got)


@step("two Webdis behind the webdis cluster: with one killed, the other decides every request")
def webdis_replicas():
    wait_for("two webdis hosts in Envoy's /clusters", lambda: len(webdis_hosts()) == 2, 30)
    check(decided_by_redis(), "requests decided with both Webdis up")
    cid = the_container("webdis-b")["Id"]
    docker("kill", "-s", "KILL", cid)
    # Envoy ejects the dead host after 3 failed connects, and drops it from
    # DNS within its refresh; until then a call meeting it is sent again.
    wait_for("every request decided with webdis-b dead", decided_by_redis, 30)
    compose("start", "webdis-b")
    wait_for("both webdis hosts again", lambda: len(webdis_hosts()) == 2, 30)
    check(decided_by_redis(), "requests decided with both Webdis up again")


def durability(name, interrupt):
    """A keyed request, Redis interrupted, then its retry; a spent gRPC bucket."""
    key = "compose-" + name + "-" + uuid.uuid4().hex[:8]
    spec = {"method": "Create", "data": "pen", "metadata": {"x-plan": "free", "x-tenant": "d-" + uuid.uuid4().hex[:8]}}
    before = upstream_executions("/api/payments")
    first = pay(key, b'{"amount":7}')
    eq(first[0], 200, "first")
    eq([r["code"] for r in grpc_calls([spec, spec])], [14, 14], "the bucket's two calls")
    record = [k for k in redis_admin("--scan", "--pattern", f"*{key}*").split() if k]
    eq(len(record), 1, f"records of {key}")
    ttl_before = int(redis_admin("pttl", record[0]))
    check(ttl_before > 0, f"record's TTL {ttl_before}")
    t = time.time()
    interrupt()
    wait_for("redis healthy again", redis_healthy, 60)
    waited = float(webdis_probe("wait")[-1])
    down_for = time.time() - t
    print(f"     Redis back, answering through every Webdis {waited:.1f} s after healthy; {down_for:.1f} s in all")
    retry = pay(key, b'{"amount":7}')
    eq((retry[0], retry[1].get("idempotent-replayed")), (200, "true"), "retry after " + name)
    eq(retry[2], first[2], "replayed body")
    eq(upstream_executions("/api/payments") - before, 1, "upstream executions")
    ttl_after = int(redis_admin("pttl", record[0]))
    check(0 < ttl_after <= ttl_before, f"record's TTL {ttl_before} -> {ttl_after}")
    # 2 calls a minute: no token came back in the seconds Redis was away.
    check(down_for < 25, f"Redis was away {down_for:.0f} s")
    eq([r["code"] for r in grpc_calls([spec])], [8], "the spent bucket after " + name)


@step("durability: `restart redis` between a keyed request and its retry (AOF on the volume)")
def restart_redis():
    start = the_container("redis")["State"]["StartedAt"]
    durability("restart", lambda: compose("restart", "redis"))
    check(the_container("redis")["State"]["StartedAt"] != start, "redis was not restarted")


@step("durability: `kill -s KILL` of the Redis container, then `start redis`")
def kill_redis():
    def interrupt():
        cid = the_container("redis")["Id"]
        docker("kill", "-s", "KILL", cid)
        st = inspect(cid)["State"]
        eq((st["Status"], st["ExitCode"]), ("exited", 137), "killed redis")
        compose("start", "redis")

    durability("kill", interrupt)


@step("down -v leaves no container, network or volume of the project")
def down():
    compose("down", "-v", timeout=300)
    eq(leftovers(), {}, "left after down -v")


def port_free(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def main():
    t0 = time.time()
    print("compose-test: " + " ".join(COMPOSE), flush=True)
    if leftovers():
        print("compose-test: removing an earlier run's stack", flush=True)
        compose("down", "-v", "--remove-orphans", timeout=300)
    for p in (PORT, ADMIN):
        if not port_free(p):
            sys.exit(f"compose-test: 127.0.0.1:{p} is in use (make demo-down?); compose publishes it")
    override_only_swaps_images()
    try:
        if up():
            for fn in (token_bucket, idempotent_replay, offload, grpc_limited, webdis_credentials, stats,
                       webdis_replicas, restart_redis, kill_redis):
                fn()
        else:
            print(compose("ps", check_rc=False).stdout)
            print(compose("logs", "--no-color", "--tail", "30", check_rc=False).stdout[-8000:])
    finally:
        if RESULTS["failed"]:
            logs = compose("logs", "--no-color", "--tail", "40", check_rc=False)
            os.makedirs(os.path.join(ROOT, "target", "compose"), exist_ok=True)
            with open(os.path.join(ROOT, "target", "compose", "stack.log"), "w") as f:
                f.write(logs.stdout + logs.stderr)
            print("compose-test: the stack's last logs are in target/compose/stack.log")
        down()
    print(f"compose-test: stack checks took {time.time() - t0:.0f} s")
    print(f"compose-test: {RESULTS['passed']} passed, {RESULTS['failed']} failed")
    sys.exit(1 if RESULTS["failed"] else 0)


if __name__ == "__main__":
    main()
