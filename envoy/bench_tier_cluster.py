"""The Redis Cluster case of `make bench-tier`: three masters behind Envoy's
redis_proxy (envoy/redis-cluster.yaml, as deployed), one Webdis in front of
it, tenants spread over the slots by `hashTag`.

Every call is the filter's own (`redis-guard wire`): a token bucket per
(x-tenant, x-user), `hashTag` the tenant, and the members of one batch share
their tenant, as a worker batches only requests of one hash tag. Per batch
size, at saturation (wrk -t2 -c32 at Webdis): decisions/s through the
cluster; each master's share of the calls and its Redis CPU per decision it
decided (INFO cpu and commandstats of that master); Envoy's (the
redis_proxy) and Webdis' CPU per decision.

On this 2-core machine the three masters, Envoy, Webdis and wrk share two
cores, so the cluster's decisions/s says little about a real one: the
per-master CPU per decision and the spread are what carry over.
"""
import json
import re
import secrets
import subprocess
import sys
import time

import bench as B

TENANTS = 48
MEMBERS = (1, 8, 32)
PASSWORD = secrets.token_hex(16)


def case_config():
    return {"redis": {"cluster": "webdis", "timeoutMs": 50},
            "hashTag": [{"header": "x-tenant"}],
            "limits": [{"name": "tb", "descriptor": [{"header": "x-tenant"}, {"header": "x-user"}],
                        "tokenBucket": {"capacity": 100_000_000, "refill": 100_000_000,
                                        "periodMs": 1000}}]}


def write_calls(out, cli, members, calls, keys):
    cfg = out / "cluster.json"
    cfg.write_text(json.dumps(case_config()))
    path = out / f"cluster-{members}.calls"
    r = subprocess.run([
        str(cli), "--json", "wire", "--config", str(cfg), "--value", "x-tenant=t{c}",
        "--value", "x-user=u{i}", "--value", "path=/", "--value", "method=POST",
        "--distinct", str(keys), "--tenants", str(TENANTS), "--members", str(members),
        "--calls", str(calls), "--out", str(path)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise B.BenchError(f"redis-guard wire: {r.stdout}{r.stderr}")
    return path, json.loads(r.stdout)["wireBytes"] / (calls * members)


def render(out, template, sets, extra=()):
    args = [sys.executable, str(B.ROOT / "envoy/render.py"), "--out", str(out), *extra]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    args.append(str(B.ROOT / template))
    r = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise B.BenchError(f"render.py {template}: {r.stderr}")


def poll(what, check, seconds=30.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if check():
                return
        except (OSError, B.BenchError):
            pass
        time.sleep(0.2)
    raise B.BenchError(f"{what}: not ready within {seconds:.0f} s")


class Cluster:
    """Three masters, Envoy's redis_proxy before them, Webdis before it."""

    def __init__(self):
        ports = B.free_ports(9)
        self.nodes, buses = ports[0:3], ports[3:6]
        self.proxy_port, self.admin_port, self.webdis_port = ports[6:9]
        self.procs = []
        for port, bus in zip(self.nodes, buses):
            d = B.RUN / f"cluster-{port}"
            d.mkdir(parents=True, exist_ok=True)
            p = B.spawn(f"redis-server (cluster :{port})", [
                "redis-server", "--port", str(port), "--bind", B.HOST, "--save", "",
                "--appendonly", "no", "--dir", str(d), "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus),
                "--user", "redis-proxy", "on", f">{PASSWORD}", "~*", "&*", "+@all",
                "--daemonize", "no"], d / "out.log")
            if not B.wait_port(p, port):
                raise B.BenchError(f"redis-server :{port} did not start")
            self.procs.append(p)
        r = subprocess.run(["redis-cli", "--cluster", "create",
                            *[f"{B.HOST}:{p}" for p in self.nodes], "--cluster-yes"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise B.BenchError(f"redis-cli --cluster create: {r.stdout}{r.stderr}")
        self.masters = [B.Redis(p) for p in self.nodes]
        for m in self.masters:
            poll("cluster state", lambda m=m: "cluster_state:ok" in m.cmd("CLUSTER", "INFO"))
        out = B.RUN / "cluster-envoy"
        out.mkdir(parents=True, exist_ok=True)
        render(out, "envoy/redis-cluster.yaml", {
            "ADMIN_PORT": self.admin_port, "REDIS_PROXY_PORT": self.proxy_port,
            "REDIS_NODE_A": self.nodes[0], "REDIS_NODE_B": self.nodes[1],
            "REDIS_NODE_C": self.nodes[2], "REDIS_AUTH": json.dumps(PASSWORD),
            "REDIS_PROXY_PASSWORD": PASSWORD})
        self.envoy = B.spawn("envoy (redis_proxy)", [
            B.envoy_binary(), "-c", str(out / "redis-cluster.yaml"), "--concurrency", "1",
            "--disable-hot-restart", "--log-level", "warning"], B.RUN / "cluster-envoy.log")
        if not B.wait_port(self.envoy, self.proxy_port, 30):
            raise B.BenchError("Envoy's redis_proxy did not start")

        def proxied():
            c = B.Redis(self.proxy_port)
            try:
                c.cmd("AUTH", PASSWORD)
                return c.cmd("SET", "rg:{probe}:x", "1", "PX", "1000") == "OK"
            finally:
                c.close()
        poll("Envoy's view of the cluster", proxied)
        wd = B.RUN / "cluster-webdis"
        wd.mkdir(parents=True, exist_ok=True)
        creds = wd / "webdis.env"
        render(wd, "envoy/webdis.json", {
            "REDIS_HOST": B.HOST, "REDIS_PORT": self.proxy_port,
            "REDIS_AUTH": json.dumps(PASSWORD), "BIND_ADDRESS": B.HOST,
            "WEBDIS_PORT": self.webdis_port, "WEBDIS_LOG": wd / "webdis.log"},
            ["--webdis-credentials", str(creds)])
        auth = re.search(r"REDIS_GUARD_WEBDIS_AUTHORIZATION=['\"]?([^'\"\n]+)", creds.read_text())
        self.authorization = auth.group(1)
        self.webdis = B.spawn("webdis (cluster)", ["webdis", str(wd / "webdis.json")],
                              B.RUN / "cluster-webdis.out")
        if not B.wait_port(self.webdis, self.webdis_port):
            raise B.BenchError("webdis (cluster) did not start")

    def prepare(self, tier_out):
        for m in self.masters:
            m.cmd("FLUSHALL")
            for name in ("ratelimit", "batch"):
                m.cmd("SCRIPT", "LOAD", (tier_out / f"{name}.lua").read_text())

    def snapshot(self):
        per = []
        for m in self.masters:
            stat = m.info("commandstats").get("cmdstat_evalsha", "")
            calls = re.search(r"calls=(\d+)", stat)
            failed = re.search(r"failed_calls=(\d+)", stat)
            per.append({"cpu_us": m.cpu_us(), "calls": int(calls.group(1)) if calls else 0,
                        "failed": int(failed.group(1)) if failed else 0})
        return {"t": time.monotonic(), "masters": per,
                "envoy_ticks": B.cpu_ticks(self.envoy.pid),
                "webdis_ticks": B.cpu_ticks(self.webdis.pid)}

    def run(self, tier_out, calls_file, members, seconds):
        for m in self.masters:
            m.cmd("CONFIG", "RESETSTAT")
        a = self.snapshot()
        wrk = subprocess.run(
            ["wrk", "-t2", "-c32", f"-d{seconds}s", "-s", str(tier_out / "wrk.lua"),
             f"http://{B.HOST}:{self.webdis_port}/", "--", str(calls_file), self.authorization,
             "0"], capture_output=True, text=True, timeout=seconds + 60)
        b = self.snapshot()
        lat = re.search(r"LAT (\d+) (\d+) (\d+)", wrk.stdout)
        if not lat:
            raise B.BenchError(f"wrk: {wrk.stdout}{wrk.stderr}")
        calls = [y["calls"] - x["calls"] for x, y in zip(a["masters"], b["masters"])]
        failed = sum(y["failed"] - x["failed"] for x, y in zip(a["masters"], b["masters"]))
        if sum(calls) == 0 or int(lat.group(3)) or failed:
            raise B.BenchError(f"cluster-{members}: {sum(calls)} calls, {lat.group(3)} non-2xx, "
                               f"{failed} failed scripts")
        wall = b["t"] - a["t"]
        decisions = sum(calls) * members
        masters = []
        for c, x, y in zip(calls, a["masters"], b["masters"]):
            cpu = y["cpu_us"] - x["cpu_us"]
            masters.append({"share": c / sum(calls), "decisions_per_s": c * members / wall,
                            "cpu_us_per_decision": cpu / max(1, c * members),
                            "utilisation": cpu / 1e6 / wall})
        tick_us = 1e6 / B.CLK_TCK
        return {"members": members, "decisions_per_s": decisions / wall, "masters": masters,
                "envoy_cpu_us_per_decision":
                    (b["envoy_ticks"] - a["envoy_ticks"]) * tick_us / decisions,
                "webdis_cpu_us_per_decision":
                    (b["webdis_ticks"] - a["webdis_ticks"]) * tick_us / decisions,
                "e2e_p50_us": int(lat.group(1)), "e2e_p99_us": int(lat.group(2))}

    def close(self):
        for m in self.masters:
            m.close()
        for p in [self.webdis, self.envoy, *self.procs]:
            B.stop(p)


def measure(tier_out, cli, seconds, keys):
    """The cluster's rows, one per batch size."""
    files = {}
    for m in MEMBERS:
        files[m] = write_calls(tier_out, cli, m, max(200, 40_000 // m), keys)
    cluster = Cluster()
    rows = []
    try:
        for m in MEMBERS:
            path, bytes_per = files[m]
            cluster.prepare(tier_out)
            cluster.run(tier_out, path, m, 1)  # warm-up: keys, connections
            row = cluster.run(tier_out, path, m, seconds)
            row["bytes_per_decision"] = bytes_per
            B.log(f"  cluster, {m} per call: {row['decisions_per_s']:,.0f} decisions/s, masters "
                  + ", ".join(f"{x['share']:.0%} at {x['cpu_us_per_decision']:.1f} µs"
                              for x in row["masters"]))
            rows.append(row)
    finally:
        cluster.close()
    return rows


def markdown(rows):
    lines = ["### Redis Cluster: three masters behind Envoy's redis_proxy", "",
             f"Token bucket per (tenant, user), `hashTag` the tenant, {TENANTS} tenants; a batch's "
             "members share their tenant (as a worker batches one hash tag). One Webdis (2 "
             "threads) → Envoy redis_proxy (1 worker) → 3 masters, all on this machine's 2 cores "
             "with wrk: the rate is the machine's, the per-master cost and the spread carry over.",
             "", "| members | decisions/s | masters: share of calls, Redis CPU µs/decision | "
             "Envoy redis_proxy CPU µs/decision | Webdis CPU µs/decision | bytes/decision | "
             "p50/p99 µs end to end |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        masters = "; ".join(f"{x['share']:.0%}, {x['cpu_us_per_decision']:.1f}"
                            for x in r["masters"])
        lines.append(f"| {r['members']} | {r['decisions_per_s']:,.0f} | {masters} | "
                     f"{r['envoy_cpu_us_per_decision']:.1f} | "
                     f"{r['webdis_cpu_us_per_decision']:.1f} | {r['bytes_per_decision']:.0f} | "
                     f"{r['e2e_p50_us']}/{r['e2e_p99_us']} |")
    return lines
