"""The checks make compose-test runs on a stack of envoy/compose.yaml (see
check.py): what `make demo` shows, through the stack's published 127.0.0.1
ports, Redis' (or Valkey's) durability across `restart redis` and a
`kill -s KILL` of its container, and that `down -v` leaves nothing of it.
Each takes the Stack (stack.py) and the Variant it runs."""
import json
import os
import re
import time
import uuid

import yaml

from stack import COMPOSE_FILE, RESULTS, ROOT, check, docker, eq, inspect, step, wait_for

HERE = os.path.join(ROOT, "envoy", "compose")


def standin_header(image):
    """The leading comment of the Dockerfile that builds stand-in `image`
    (redis-guard-standin/<role>:bookworm is built from <role>.Dockerfile)."""
    role = image.split("/", 1)[1].split(":")[0]
    lines = []
    for line in open(os.path.join(HERE, f"{role}.Dockerfile")):
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return " ".join(lines)


def _services(cfg):
    """Each service but its image, as `compose config` prints it, in a form
    that does not depend on whether the file was merged with another: a
    merge lists ports and volumes in another order and gives a network
    without options as {} where the file alone gives null."""
    out = {}
    for name, svc in cfg["services"].items():
        svc = {k: v for k, v in svc.items() if k != "image"}
        for k in ("ports", "volumes"):
            if k in svc:
                svc[k] = sorted(map(str, svc[k]))
        if isinstance(svc.get("networks"), dict):
            svc["networks"] = {n: opts or {} for n, opts in svc["networks"].items()}
        out[name] = svc
    return out


@step("the overrides only swap images, each for a stand-in of the image the file names")
def overrides_only_swap_images(st, v):
    real_raw = yaml.safe_load(open(os.path.join(ROOT, COMPOSE_FILE)))
    for f in st.files[1:]:
        over = yaml.safe_load(open(os.path.join(ROOT, f)))
        eq(list(over), ["services"], f"top-level keys of {f}")
        for name, svc in over["services"].items():
            check(name in real_raw["services"], f"{f} names {name}, not a service of {COMPOSE_FILE}")
            eq(list(svc), ["image"], f"keys of {f}'s {name}")
            check(svc["image"].startswith("redis-guard-standin/"), f"{f}: {name}: {svc['image']}")
    first = yaml.safe_load(open(os.path.join(ROOT, st.files[1])))
    eq(sorted(first["services"]), sorted(real_raw["services"]), f"services {st.files[1]} names")
    # As Compose reads them in this stack's environment: the file alone is
    # what a user runs with the same variables, the merge is what runs here.
    real, merged = st.config([COMPOSE_FILE]), st.config()
    eq(real["services"]["redis"]["image"], v.image, "the store's image, as the variables pick it")
    eq(_services(merged), _services(real), "the services with the overrides, but for their images")
    for name, svc in real["services"].items():
        stand_in = merged["services"][name]["image"]
        header = standin_header(stand_in)
        check(header.startswith("Stand-in for ") and svc["image"] in header,
              f"{name}: {stand_in} does not say it stands in for {svc['image']}: {header[:120]!r}")


def store_identity(st):
    """The store's INFO server fields that name it."""
    info = st.redis_admin("info", "server")
    return {k: v for k, v in (line.strip().split(":", 1) for line in info.splitlines() if ":" in line)
            if k in ("redis_version", "valkey_version", "server_name")}


@step("up -d: one-shot services done, the store and object store healthy, Envoy ready on its ports")
def up(st, v):
    st.compose("up", "-d", timeout=600)
    wait_for(f"Envoy /ready on 127.0.0.1:{st.admin}", st.envoy_ready, 120)
    real = yaml.safe_load(open(os.path.join(ROOT, COMPOSE_FILE)))
    merged = st.config()
    for name in real["services"]:
        c = st.the_container(name)
        eq(c["Config"]["Image"], merged["services"][name]["image"], f"{name}'s image")
        state = c["State"]
        if name in ("render", "objectstore-init"):
            eq((state["Status"], state["ExitCode"]), ("exited", 0), f"{name} (one-shot)")
        else:
            eq(state["Status"], "running", f"{name}")
        if "healthcheck" in real["services"][name]:
            eq(state["Health"]["Status"], "healthy", f"{name}'s health")
        prefix = re.escape(st.project) + "_"
        nets = sorted(re.sub("^" + prefix, "", n) for n in c["NetworkSettings"]["Networks"])
        if state["Status"] == "running":
            eq(nets, sorted(real["services"][name]["networks"]), f"{name}'s networks")
        ports = {k: val for k, val in (c["NetworkSettings"]["Ports"] or {}).items() if val}
        if name == "envoy":
            got = sorted((k, b["HostIp"], b["HostPort"]) for k, bs in ports.items() for b in bs)
            want = [("10000/tcp", "127.0.0.1", str(st.port)), ("9901/tcp", "127.0.0.1", str(st.admin))]
            eq(got, sorted(want), "envoy's ports")
        else:
            eq(ports, {}, f"{name}'s published ports")
    nets = {}
    for nid in docker("network", "ls", "-q", "--filter", st.label()).stdout.split():
        n = json.loads(docker("network", "inspect", nid).stdout)[0]
        nets[n["Labels"]["com.docker.compose.network"]] = n["Internal"]
    eq(nets, {"backend": True, "edge": False}, "networks (name: internal)")
    # The server the variables picked, and the image's entrypoint put it
    # first and dropped root (the command is flags only).
    ident = store_identity(st)
    check(v.identity(ident), f"the store is not {v.server}: {ident}")
    status = st.compose("exec", "-T", "redis", "cat", "/proc/1/status").stdout
    uid = re.search(r"^Uid:\s+(\d+)", status, re.M)
    check(uid and uid.group(1) != "0", f"the store runs as root: {uid and uid.group(0)}")
    print(f"     store: {ident}, uid {uid.group(1)}")


@step("token bucket per-user-burst: 5 allowed, the 6th is 429 with Retry-After")
def token_bucket(st, v):
    user = "compose-" + uuid.uuid4().hex[:8]
    got = [st.request("GET", "/api/orders", {"x-user": user}) for _ in range(6)]
    eq([s for s, _, _ in got], [200] * 5 + [429], "statuses")
    eq([h.get("x-ratelimit-remaining") for _, h, _ in got[:5]], ["4", "3", "2", "1", "0"], "remaining")
    h = got[5][1]
    check(h.get("retry-after") == "1", f"Retry-After {h.get('retry-after')!r}")
    eq(h.get("content-type"), "application/problem+json", "429 content type")
    eq(st.request("GET", "/api/orders", {"x-user": user + "-other"})[0], 200, "another user's own bucket")


def pay(st, key, body, path="/api/payments", extra=None):
    headers = {"Idempotency-Key": key, "content-type": "application/json"}
    headers.update(extra or {})
    return st.request("POST", path, headers, body)


@step("idempotency: a keyed POST runs once, its retry is replayed byte for byte, other body 422")
def idempotent_replay(st, v):
    key = "compose-" + uuid.uuid4().hex
    before = st.upstream_executions("/api/payments")
    first = pay(st, key, b'{"amount":10}')
    eq(first[0], 200, "first")
    check("idempotent-replayed" not in first[1], "first marked replayed")
    retry = pay(st, key, b'{"amount":10}')
    eq(retry[0], 200, "retry")
    eq(retry[1].get("idempotent-replayed"), "true", "retry's Idempotent-Replayed")
    eq(retry[2], first[2], "replayed body")
    eq(retry[1].get("content-type"), first[1].get("content-type"), "replayed content-type")
    eq(pay(st, key, b'{"amount":99}')[0], 422, "same key, other body")
    eq(st.upstream_executions("/api/payments") - before, 1, "upstream executions")


@step("large response: 1 MiB offloaded to moto's S3 (SigV4), replayed from it byte for byte")
def offload(st, v):
    key = "compose-big-" + uuid.uuid4().hex[:8]
    path = "/api/payments/statement"
    before = st.upstream_executions(path)
    big = {"x-upstream-binary-bytes": "1048576"}
    first = pay(st, key, b'{"month":"2026-11"}', path, big)
    eq((first[0], len(first[2])), (200, 1 << 20), "first (status, bytes)")
    retry = pay(st, key, b'{"month":"2026-11"}', path, big)
    eq(retry[1].get("idempotent-replayed"), "true", "retry's Idempotent-Replayed")
    eq(retry[2], first[2], "replayed 1 MiB body")
    eq(st.upstream_executions(path) - before, 1, "upstream executions")
    # The command docs/src/running/compose.md gives for listing the bucket,
    # from inside the stack.
    listing = st.compose(
        "run", "--rm", "--entrypoint", "sh", "objectstore-init", "-c",
        '. /rendered/objectstore.env && python3 /src/s3ctl.py --host objectstore list 5000 redis-guard '
        '"$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY"',
    ).stdout
    objects = json.loads(listing[listing.index("["):])
    eq([o["size"] for o in objects], [1 << 20], "objects in the bucket")
    check(objects[0]["key"].startswith("redis-guard/"), f"object key {objects[0]['key']}")


def grpc_spec(prefix):
    return {"method": "Create", "data": "pen",
            "metadata": {"x-plan": "free", "x-tenant": prefix + uuid.uuid4().hex[:8]}}


@step("gRPC: the free plan's 3rd call is RESOURCE_EXHAUSTED with RetryInfo")
def grpc_limited(st, v):
    spec = grpc_spec("c-")
    got = st.grpc_calls([spec, spec, spec])
    # The stack has no gRPC service (compose.yaml: point GRPC_UPSTREAM_PORT at
    # yours): admitted calls end UNAVAILABLE at Envoy, the limited one at the filter.
    eq([r["code"] for r in got], [14, 14, 8], "grpc-status of the three calls")
    check(got[2].get("retry") and 0 < got[2]["retry"]["ms"] <= 30000, f"RetryInfo {got[2].get('retry')}")


@step("Webdis, from inside the backend network: 403 without the credentials, EVAL runs with them")
def webdis_credentials(st, v):
    eq(st.webdis_probe("once"), ["403", "200", "b':7\\r\\n'"], "without, with (status, raw reply)")


@step("Prometheus stats on the admin port: the verdicts and replays so far, exactly")
def stats(st, v):
    s = st.prometheus()
    # What the checks before this one decided: token_bucket, idempotent_replay
    # and grpc_limited, and offload's keyed pair when it ran.
    offloaded = 1 if offload in v.plan else 0
    want = {
        'redis_guard_ratelimit_rejected{limit="per-user-burst"}': 1,
        'redis_guard_ratelimit_allowed{limit="per-user-burst"}': 6,
        'redis_guard_ratelimit_rejected{limit="orders-create"}': 1,
        'redis_guard_ratelimit_allowed{limit="orders-create"}': 2,
        "redis_guard_idempotency_acquired": 1 + offloaded,
        "redis_guard_idempotency_replayed": 1 + offloaded,
        "redis_guard_idempotency_mismatched": 1,
        "redis_guard_idempotency_offloaded": offloaded,
        "redis_guard_idempotency_object_fetched": offloaded,
        "redis_guard_redis_errors": 0,
    }
    eq({k: s.get(k) for k in want}, want, "series")


def webdis_hosts(st):
    """The webdis cluster's hosts in Envoy's /clusters (ip:port)."""
    status, _, body = st.request("GET", "/clusters", admin=True)
    eq(status, 200, "/clusters")
    return sorted({line.split("::")[1] for line in body.decode().splitlines()
                   if line.startswith("webdis::") and "::health_flags::" in line})


def decided_by_redis(st, n=4):
    """n requests of fresh users, each decided by Redis: 200 with the
    per-user bucket's remaining count, not the failure mode's (allow)
    answer. PUT, so that only per-user-burst applies (per-client-minute
    counts GET and POST, and later steps need its budget)."""
    users = ["replica-" + uuid.uuid4().hex[:8] for _ in range(n)]
    got = [st.request("PUT", "/api/orders", {"x-user": u}) for u in users]
    return all(s == 200 and h.get("x-ratelimit-remaining") == "4" for s, h, _ in got)


@step("two Webdis behind the webdis cluster: with one killed, the other decides every request")
def webdis_replicas(st, v):
    wait_for("two webdis hosts in Envoy's /clusters", lambda: len(webdis_hosts(st)) == 2, 30)
    check(decided_by_redis(st), "requests decided with both Webdis up")
    cid = st.the_container("webdis-b")["Id"]
    docker("kill", "-s", "KILL", cid)
    # Envoy ejects the dead host after 3 failed connects, and drops it from
    # DNS within its refresh; until then a call meeting it is sent again.
    wait_for("every request decided with webdis-b dead", lambda: decided_by_redis(st), 30)
    st.compose("start", "webdis-b")
    wait_for("both webdis hosts again", lambda: len(webdis_hosts(st)) == 2, 30)
    check(decided_by_redis(st), "requests decided with both Webdis up again")


def durability(st, name, interrupt):
    """A keyed request, the store interrupted, then its retry; a spent gRPC bucket."""
    key = "compose-" + name + "-" + uuid.uuid4().hex[:8]
    spec = grpc_spec("d-")
    before = st.upstream_executions("/api/payments")
    first = pay(st, key, b'{"amount":7}')
    eq(first[0], 200, "first")
    eq([r["code"] for r in st.grpc_calls([spec, spec])], [14, 14], "the bucket's two calls")
    record = [k for k in st.redis_admin("--scan", "--pattern", f"*{key}*").split() if k]
    eq(len(record), 1, f"records of {key}")
    ttl_before = int(st.redis_admin("pttl", record[0]))
    check(ttl_before > 0, f"record's TTL {ttl_before}")
    t = time.time()
    interrupt()
    wait_for("the store healthy again", st.redis_healthy, 60)
    waited = float(st.webdis_probe("wait")[-1])
    down_for = time.time() - t
    print(f"     store back, answering through every Webdis {waited:.1f} s after healthy; {down_for:.1f} s in all")
    retry = pay(st, key, b'{"amount":7}')
    eq((retry[0], retry[1].get("idempotent-replayed")), (200, "true"), "retry after " + name)
    eq(retry[2], first[2], "replayed body")
    eq(st.upstream_executions("/api/payments") - before, 1, "upstream executions")
    ttl_after = int(st.redis_admin("pttl", record[0]))
    check(0 < ttl_after <= ttl_before, f"record's TTL {ttl_before} -> {ttl_after}")
    # 2 calls a minute: no token came back in the seconds the store was away.
    check(down_for < 25, f"the store was away {down_for:.0f} s")
    eq([r["code"] for r in st.grpc_calls([spec])], [8], "the spent bucket after " + name)


@step("durability: `restart redis` between a keyed request and its retry (AOF on the volume)")
def restart_redis(st, v):
    start = st.the_container("redis")["State"]["StartedAt"]
    durability(st, "restart", lambda: st.compose("restart", "redis"))
    check(st.the_container("redis")["State"]["StartedAt"] != start, "redis was not restarted")


@step("durability: `kill -s KILL` of the store's container, then `start redis`")
def kill_redis(st, v):
    def interrupt():
        cid = st.the_container("redis")["Id"]
        docker("kill", "-s", "KILL", cid)
        state = inspect(cid)["State"]
        eq((state["Status"], state["ExitCode"]), ("exited", 137), "killed redis")
        st.compose("start", "redis")

    durability(st, "kill", interrupt)


@step("down -v leaves no container, network or volume of the project")
def down(st, v):
    # Three seconds to stop, not ten: the stack's data goes with it.
    st.compose("down", "-v", "--timeout", "3", timeout=300)
    eq(st.leftovers(), {}, "left after down -v")


def run_stack(st, v):
    """The variant's checks on its own stack, always taken down after."""
    t0, failed = time.time(), RESULTS["failed"]
    print(f"compose-test: {v.name}: {st.describe()}", flush=True)
    overrides_only_swap_images(st, v)
    try:
        if up(st, v):
            for fn in v.plan:
                fn(st, v)
        else:
            print(st.compose("ps", check_rc=False).stdout)
            print(st.compose("logs", "--no-color", "--tail", "30", check_rc=False).stdout[-8000:])
    finally:
        if RESULTS["failed"] > failed:
            path = st.save_logs(f"stack-{v.name}.log")
            print(f"compose-test: the {v.name} stack's last logs are in {os.path.relpath(path, ROOT)}")
        down(st, v)
    print(f"compose-test: {v.name}: stack checks took {time.time() - t0:.0f} s", flush=True)
