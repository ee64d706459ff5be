"""The fault injector: at moments drawn from the run's seed, one fault at a
time, each recorded with when it began and ended (check.py attributes the
clients' outages to them)."""

import random
import signal
import threading
import time

from .procs import SoakError, log, wait_for

KINDS = ["redis-kill", "redis-stop", "failover", "webdis-kill", "envoy-kill", "ecds-reload",
         "store-stop"]


class Injector:
    def __init__(self, stack, stats, seed, kinds=None):
        self.stack, self.stats = stack, stats
        self.rng = random.Random(f"faults-{seed}")
        self.kinds = kinds or KINDS
        self.faults = []  # dicts: kind, start, end, detail
        self.kills = []  # (envoy index, monotonic time of its SIGKILL)
        self.errors = []

    def run(self, deadline, stop):
        # Traffic first runs a while without faults.
        if stop.wait(self.rng.uniform(3, 6)):
            return
        order = []
        while time.monotonic() < deadline - 5 and not stop.is_set():
            # Every kind once per round, in a drawn order: a short run
            # still meets each.
            if not order:
                order = list(self.kinds)
                self.rng.shuffle(order)
            kind = order.pop()
            f = {"kind": kind, "start": time.monotonic(), "detail": ""}
            try:
                with self.stack.fault_lock:
                    f["detail"] = getattr(self, kind.replace("-", "_"))() or ""
            except (SoakError, OSError) as e:
                # A fault that could not be made (or undone) is a finding
                # about the stack, reported; the run goes on.
                f["detail"] = f"FAILED: {e}"
                self.errors.append(f"{kind}: {e}")
                log(f"fault {kind} failed: {e}")
            f["end"] = time.monotonic()
            self.faults.append(f)
            log(f"fault {kind} {f['detail']} ({f['end'] - f['start']:.1f} s)")
            if stop.wait(self.rng.uniform(4, 12)):
                return

    def redis_kill(self):
        s = self.stack
        name = s.primary
        s.redis[name].kill()
        time.sleep(self.rng.uniform(0, 1))
        s.start_redis(name)
        wait_for("the replica back in sync", s.in_sync, 60, 0.1)
        return f"primary {name} SIGKILLed, restarted from its append-only file"

    def redis_stop(self):
        s = self.stack
        ms = self.rng.randint(200, 2000)
        p = s.redis[s.primary]
        p.signal(signal.SIGSTOP)
        try:
            time.sleep(ms / 1000)
        finally:
            p.signal(signal.SIGCONT)
        return f"primary {s.primary} SIGSTOPped {ms} ms"

    def failover(self):
        """Redis' own coordinated failover (FAILOVER: writes paused until the
        replica has them all, then the roles swap), then the forwarder moved
        to the new primary: no acknowledged write is lost."""
        s = self.stack
        wait_for("the replica in sync before a failover", s.in_sync, 30, 0.1)
        old, new = s.primary, s.replica()
        r = s.admin(old)
        try:
            r.cmd("FAILOVER", "TIMEOUT", 5000)
        finally:
            r.close()

        def role(name):
            c = s.admin(name)
            try:
                return c.cmd("ROLE")[0]
            finally:
                c.close()

        wait_for("the replica promoted", lambda: role(new) == "master", 20, 0.02)
        s.point_forwarder(s.ports[new])
        s.primary = new
        wait_for("the old primary replicating", s.in_sync, 30, 0.1)
        return f"{old} -> {new}"

    def store_stop(self):
        """The object store SIGSTOPped 0.5 to 7 s: slower than the filter's
        5 s timeout at times (moto keeps its objects in memory, so it is
        stopped, not killed)."""
        ms = self.rng.randint(500, 7000)
        p = self.stack.s3
        p.signal(signal.SIGSTOP)
        try:
            time.sleep(ms / 1000)
        finally:
            p.signal(signal.SIGCONT)
        return f"object store SIGSTOPped {ms} ms"

    def webdis_kill(self):
        s = self.stack
        w = self.rng.randrange(len(s.webdis))
        s.webdis[w].kill()
        time.sleep(self.rng.uniform(0.5, 3))
        s.webdis[w].start()
        return f"webdis{w} SIGKILLed, restarted"

    def envoy_kill(self):
        s = self.stack
        e = self.rng.choice(s.envoys)
        # Its counters die with it: read them last thing before.
        self.stats.scrape(e)
        e["proc"].kill()
        self.kills.append((e["i"], time.monotonic()))
        self.stats.new_incarnation(e)
        time.sleep(self.rng.uniform(0, 1))
        s.start_envoy(e)
        return f"envoy{e['i']} SIGKILLed, restarted"

    def ecds_reload(self):
        s = self.stack
        e = self.rng.choice(s.envoys)
        s.reload(e)
        return f"envoy{e['i']} took a new filter configuration"


class Stats:
    """The filter's counters of every Envoy incarnation: each Envoy's last
    reading kept per start, summed at the end."""

    def __init__(self, stack):
        self.stack = stack
        self.lock = threading.Lock()
        self.readings = {}  # (envoy, incarnation) -> counters

    def scrape(self, e):
        from .traffic import admin_stats
        try:
            got = admin_stats(e["admin"], r"^wasmcustom\.redis_guard\.")
        except OSError:
            return
        with self.lock:
            self.readings[(e["i"], e["proc"].starts)] = got

    def new_incarnation(self, e):
        pass

    def total(self, name):
        with self.lock:
            return sum(r.get(f"wasmcustom.redis_guard.{name}", 0)
                       for r in self.readings.values())
