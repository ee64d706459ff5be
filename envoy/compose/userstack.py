"""The proof that make compose-test leaves a user's stack alone (issue 42):
a stack of project redis-guard, the one `make compose-up` starts, is there
while every test stack runs, and is as it was afterwards.

- A user's stack is there (any container of project redis-guard): nothing
  is written into it or started in it; afterwards every one of its
  containers must be in the state it was in, not restarted (same start
  time), and its volumes still there.
- None is there and 127.0.0.1:10000 and :9901 are free: the test starts one
  as `make compose-up` does (project redis-guard, the default ports and
  image: none of compose.yaml's variables set; the stand-in images, as every
  stack here), writes a key into its Redis, and afterwards checks that key
  (value and TTL), each container's state and start time, and that its
  Envoy still answers on 10000 and 9901; then takes down that stack, which
  it started, and only it.
- Neither (something else holds those ports): the proof cannot run, and
  says so (NOT RUN), failing nothing.
"""
import time
import uuid

from stack import (
    COMPOSE_FILE, DEFAULT_ADMIN, DEFAULT_PORT, Fail, Stack, check, docker, eq, port_free, state_of, step, wait_for,
)

PROJECT = "redis-guard"  # the Makefile's COMPOSE: docker compose -p redis-guard


class UserStack:
    def __init__(self, standins):
        self.stack = Stack(PROJECT, [COMPOSE_FILE, standins], {})
        self.started = False
        self.before = {}
        self.volumes = []
        self.key = self.value = None

    def volume_names(self):
        return sorted(docker("volume", "ls", "-q", "--filter", self.stack.label()).stdout.split())

    def prepare(self):
        """True when the proof runs: a user's stack recorded, or one started."""
        ids = self.stack.containers()
        if ids:
            self.before, self.volumes = state_of(ids), self.volume_names()
            print(f"compose-test: a stack of project {PROJECT} is here ({len(ids)} containers): "
                  "not touched, and checked to be as it was after the test's own stacks", flush=True)
            return True
        busy = [p for p in (DEFAULT_PORT, DEFAULT_ADMIN) if not port_free(p)]
        if busy:
            print(f"compose-test: NOT RUN: the proof that a user's stack survives: 127.0.0.1:{busy} in use "
                  f"by something other than a stack of project {PROJECT}", flush=True)
            return False
        print(f"compose-test: starting a user's stack as make compose-up does: {self.stack.describe()} up -d",
              flush=True)
        t = time.time()
        self.started = True
        self.stack.compose("up", "-d", timeout=600)
        wait_for(f"its Envoy /ready on 127.0.0.1:{DEFAULT_ADMIN}", self.stack.envoy_ready, 120)
        self.key = "rg:compose-test-survivor:" + uuid.uuid4().hex
        self.value = uuid.uuid4().hex
        eq(self.stack.redis_admin("set", self.key, self.value, "EX", "3600").strip(), "OK", "SET in its Redis")
        self.before, self.volumes = state_of(self.stack.containers()), self.volume_names()
        check(any(v.endswith("_redis-data") for v in self.volumes), f"its redis-data volume: {self.volumes}")
        print(f"compose-test: the user's stack is up, {self.key} in its Redis ({time.time() - t:.0f} s)", flush=True)
        return True

    def survived(self):
        try:
            after = state_of(self.before)
        except Fail as e:
            raise Fail(f"a container of the stack is gone: {e}")
        eq(after, self.before, "each container's (status, start time)")
        eq(sorted(self.stack.containers()), sorted(self.before), "the project's containers")
        eq(self.volume_names(), self.volumes, "the project's volumes")
        if self.started:
            check(self.stack.envoy_ready(), f"its Envoy is not ready on 127.0.0.1:{DEFAULT_ADMIN}")
            status, headers, _ = self.stack.request("GET", "/api/orders", {"x-user": "survivor-" + uuid.uuid4().hex})
            eq((status, headers.get("x-ratelimit-remaining")), (200, "4"),
               f"a request through its Envoy on 127.0.0.1:{DEFAULT_PORT}")
            eq(self.stack.redis_admin("get", self.key).strip(), self.value, f"{self.key} in its Redis")
            ttl = int(self.stack.redis_admin("ttl", self.key))
            check(0 < ttl <= 3600, f"{self.key}'s TTL {ttl}")

    def teardown(self):
        """Only a stack this run started, and only its own project."""
        if self.started:
            self.started = False
            took_down(self)


@step(f"the stack of project {PROJECT} is as it was: its containers, their start times, its volumes "
      "(and, when the test started it, its key and ports)")
def survived(user):
    user.survived()


@step(f"the stack of project {PROJECT} this run started is taken down, and nothing of it is left")
def took_down(user):
    user.stack.compose("down", "-v", "--timeout", "3", timeout=300)
    eq(user.stack.leftovers(), {}, "left after down -v")
