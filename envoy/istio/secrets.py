#!/usr/bin/env python3
"""The Secrets of envoy/istio/redis-webdis.yaml, with new random credentials.

  python3 envoy/istio/secrets.py OUT
  kubectl apply -f envoy/istio/redis-webdis.yaml -f OUT/secrets.yaml

Renders envoy/webdis.json and envoy/redis.acl with envoy/render.py, the
renderer the demo and the compose stack use (the same templates, the same
random passwords: Webdis' HTTP Basic user `redis-guard`, Redis' `default`
user that Webdis connects as, Redis' `admin` for operators), then writes
OUT/secrets.yaml (mode 0600) holding four Secrets:

  redis/redis-acl           redis.acl: the two Redis users (SHA-256s of
                            their passwords), mounted by the redis Deployment
  redis/webdis-config       webdis.json: Webdis' configuration, with its
                            Basic credentials and Redis' password
  redis/redis-admin         password: the admin user's, for operators
                            (redis-guard's CLI, redis-cli)
  shop/webdis-credentials   username, password: what the filter sends Webdis,
                            read by the filter's workload's istio-proxy
                            (wasmplugin.yaml's vmConfig.env, valueFrom HOST)

OUT/rendered keeps the rendered files (the secret ones mode 0600): delete OUT
once the Secrets are applied. Standard library only. The namespaces are the
manifests' (redis, shop);
change them with --redis-namespace and --filter-namespace. Run again, it makes
new passwords: apply all four Secrets together and restart Webdis, Redis and
the filter's pods. tests/deploy_istio.rs runs this script and checks the
Secrets against the Deployments that mount them and the WasmPlugin that
reads them.
"""
import argparse
import base64
import os
import subprocess
import sys
from pathlib import Path

ENVOY = Path(__file__).resolve().parent.parent
KEY_PREFIX = "rg"  # the filter's keyPrefix: the default user's keys are ~rg:*
REDIS_PORT = 6379
WEBDIS_PORT = 7379


def env_file(path):
    """NAME=VALUE lines, values unquoted."""
    out = {}
    for line in Path(path).read_text().splitlines():
        name, _, value = line.partition("=")
        out[name] = value.strip("'")
    return out


def secret(name, namespace, data):
    lines = ["apiVersion: v1", "kind: Secret", "metadata:", f"  name: {name}",
             f"  namespace: {namespace}", "type: Opaque", "data:"]
    for key, value in data.items():
        lines.append(f"  {key}: {base64.b64encode(value.encode()).decode()}")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory for the rendered files and secrets.yaml")
    ap.add_argument("--redis-namespace", default="redis")
    ap.add_argument("--filter-namespace", default="shop")
    args = ap.parse_args()
    rendered = args.out / "rendered"
    rendered.mkdir(parents=True, exist_ok=True)
    webdis_env, redis_env = rendered / "webdis.env", rendered / "redis.env"
    subprocess.run(
        [sys.executable, str(ENVOY / "render.py"), "--out", str(rendered),
         "--webdis-credentials", str(webdis_env), "--redis-users", str(redis_env),
         "--set", f"KEY_PREFIX={KEY_PREFIX}",
         "--set", f"REDIS_HOST=redis.{args.redis_namespace}.svc.cluster.local",
         "--set", f"REDIS_PORT={REDIS_PORT}",
         "--set", "BIND_ADDRESS=0.0.0.0",
         "--set", f"WEBDIS_PORT={WEBDIS_PORT}",
         "--set", "WEBDIS_LOG=/dev/stderr",
         str(ENVOY / "webdis.json"), str(ENVOY / "redis.acl")],
        check=True)
    webdis = env_file(webdis_env)
    admin = env_file(redis_env)["REDIS_ADMIN_PASSWORD"]
    ns = args.redis_namespace
    text = "---\n".join([
        secret("redis-acl", ns, {"redis.acl": (rendered / "redis.acl").read_text()}),
        secret("webdis-config", ns, {"webdis.json": (rendered / "webdis.json").read_text()}),
        secret("redis-admin", ns, {"password": admin}),
        secret("webdis-credentials", args.filter_namespace,
               {"username": webdis["REDIS_GUARD_WEBDIS_USERNAME"],
                "password": webdis["REDIS_GUARD_WEBDIS_PASSWORD"]}),
    ])
    out = args.out / "secrets.yaml"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    print(f"wrote {out}: kubectl apply -f {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
