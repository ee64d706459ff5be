"""The soak's clients: bounded loops (a request count and the deadline), each
request to one of the Envoys drawn from the loop's own seeded generator,
each answer classified and recorded for check.py."""

import http.client
import json
import random
import socket
import threading
import time
from urllib.parse import quote

from . import config
from .procs import HOST

TIMEOUT = 15  # above the route's 10 s timeout


def admin_get(port, path):
    c = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def admin_stats(port, regex):
    """Counters of one Envoy whose names match `regex` (Envoy's own filter)."""
    _, body = admin_get(port, "/stats?filter=" + quote(regex, safe=""))
    out = {}
    for line in body.decode().splitlines():
        k, sep, v = line.partition(": ")
        if sep and v.strip().isdigit():
            out[k] = int(v)
    return out


class Answer:
    __slots__ = ("status", "headers", "body", "error", "sent", "done", "wsent", "wdone", "envoy")

    def kind(self):
        """The answer's kind, for the table and the invariants."""
        if self.error:
            return "no answer (connection)"
        h, s = self.headers, self.status
        problem = h.get("content-type") == "application/problem+json"
        if s == 200 and h.get("idempotent-replayed") == "true":
            return "200 replayed"
        if s == 200:
            return "200"
        if s == 429 and problem:
            return "429 rate limited"
        if s == 409 and problem:
            return "409 key in progress"
        if s == 503 and problem:
            doc = self.doc()
            if doc.get("storedResponse") == "unavailable":
                return "503 stored response unavailable"
            return "503 failure mode"
        return f"unexpected {s}"

    def doc(self):
        try:
            return json.loads(self.body)
        except ValueError:
            return {}


def request(envoy, method, path, headers, body=None):
    a = Answer()
    a.envoy, a.status, a.headers, a.body, a.error = envoy["i"], 0, {}, b"", None
    a.sent, a.wsent = time.monotonic(), time.time()
    c = http.client.HTTPConnection(HOST, envoy["port"], timeout=TIMEOUT)
    try:
        c.request(method, path, body=body, headers=headers)
        r = c.getresponse()
        a.body = r.read()
        a.status = r.status
        a.headers = {k.lower(): v for k, v in r.getheaders()}
    except (OSError, http.client.HTTPException) as e:
        a.error = type(e).__name__
    finally:
        c.close()
    a.done, a.wdone = time.monotonic(), time.time()
    return a


class Record:
    """Everything the clients saw; one lock, as the loops share it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.kinds = {}  # answer kind -> count
        self.admitted = {}  # (limit kind, user) -> [(sent, done)]
        self.keys = {}  # idempotency key -> dict
        self.usage = {}  # user -> dict(admitted, answers: [(envoy, done)], errors)
        self.hangups = 0
        self.unexpected = []
        self.failures = []  # (loop, first failure, next success)

    def count(self, kind):
        with self.lock:
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            if kind.startswith("unexpected"):
                self.unexpected.append(kind)


class Outage:
    """A loop's view of availability: from its first failed answer to its
    next good one."""

    def __init__(self, rec, loop):
        self.rec, self.loop, self.since = rec, loop, None

    def saw(self, a, good):
        """`a` answered, good or not. The outage is put on the fault during
        which its first failed answer came (it may have been sent before)."""
        if good:
            if self.since is not None:
                with self.rec.lock:
                    self.rec.failures.append((self.loop, *self.since, a.done))
                self.since = None
        elif self.since is None:
            self.since = (a.sent, a.done)


FAILED = {"503 failure mode", "no answer (connection)", "503 stored response unavailable"}


def limited_loop(stack, rec, rng, deadline, stop, n):
    """GETs on every limit kind, a few users per kind shared by all loops."""
    out = Outage(rec, f"limits-{n}")
    kinds = [k for k in config.LIMITS if k not in config.PATHS]
    for _ in range(1_000_000):
        if stop.is_set() or time.monotonic() > deadline:
            return
        kind = rng.choice(kinds)
        user = f"{kind}-u{rng.randrange(2)}"
        headers = {"x-user": user}
        if kind == "conc":
            headers["x-upstream-delay-ms"] = str(config.CONC_HOLD_MS)
        e = rng.choice(stack.envoys)
        a = request(e, "GET", f"/rl/{kind}/{user}", headers)
        k = a.kind()
        rec.count(k)
        if k == "200":
            with rec.lock:
                rec.admitted.setdefault((kind, user), []).append(
                    (a.sent, a.done, a.wsent, a.wdone))
        out.saw(a, k not in FAILED)
        time.sleep(rng.uniform(0.005, 0.03))


def usage_loop(stack, rec, rng, deadline, stop, n):
    """Streamed completions whose usage the filter settles after the stream.
    A request without a whole answer may or may not have been settled: the
    loop then goes on as a new user, so each user's bucket holds at most one
    request whose cost is unknown (its last)."""
    out = Outage(rec, f"usage-{n}")
    gen = 0
    body = json.dumps({"stream": True}).encode()
    for _ in range(1_000_000):
        if stop.is_set() or time.monotonic() > deadline:
            return
        user = f"llm-{n}-{gen}"
        with rec.lock:
            u = rec.usage.setdefault(user, {"admitted": 0, "answers": [], "unknown": 0})
        e = rng.choice(stack.envoys)
        a = request(e, "POST", "/v1/chat/completions", {
            "x-user": user, "x-upstream-llm": "openai-sse", "content-type": "application/json",
            "x-upstream-tokens": f"{config.USAGE_PROMPT},{config.USAGE_COMPLETION}"}, body)
        k = a.kind()
        rec.count(k)
        with rec.lock:
            if k == "200" and b"[DONE]" in a.body:
                u["admitted"] += 1
                u["answers"].append((e["i"], a.done))
            elif k in ("no answer (connection)", "200"):
                u["unknown"] = 1
                gen += 1
        out.saw(a, k not in FAILED)
        time.sleep(rng.uniform(0.01, 0.05))


def pay_loop(stack, rec, rng, deadline, stop, n):
    """Keyed POSTs: each key retried on 409, 503 and no answer until it
    completes, then sent once more, which must be its replay."""
    out = Outage(rec, f"pay-{n}")
    for i in range(1_000_000):
        if stop.is_set() or time.monotonic() > deadline:
            return
        key = f"p{n}-{i}"
        path = f"/pay/{key}"
        k = {"path": path, "answers": [], "no_answer": 0, "completed": False,
             "replayed": False, "big": rng.random() < 0.2, "attempts": []}
        with rec.lock:
            rec.keys[key] = k
        headers = {"idempotency-key": key, "x-tenant": f"t{n % 3}",
                   "content-type": "application/json"}
        if k["big"]:
            # Above offloadAboveBytes: the body goes to the object store.
            headers["x-upstream-pad-bytes"] = str(config.OFFLOAD_ABOVE + 4096)
        body = json.dumps({"amount": i, "loop": n}).encode()
        # A key keeps retrying past the deadline (bounded): a key left
        # half done would say nothing.
        key_deadline = time.monotonic() + 90
        phase = 0
        for _ in range(2000):
            if time.monotonic() > key_deadline:
                break
            a = request(rng.choice(stack.envoys), "POST", path, headers, body)
            kind = a.kind()
            rec.count(kind)
            out.saw(a, kind not in FAILED)
            # For a violation's message: what each attempt met, where, when.
            k["attempts"].append(f"{time.strftime('%H:%M:%S', time.gmtime(a.wsent))}"
                                 f".{int(a.wsent * 1000) % 1000:03d}/envoy{a.envoy}/"
                                 f"{kind.split(' ')[0]}{'r' if 'replayed' in kind else ''}"
                                 f"{'#' + str(a.doc().get('execution')) if kind == '200' else ''}")
            if kind == "no answer (connection)":
                k["no_answer"] += 1
            if kind in ("200", "200 replayed"):
                k["answers"].append((kind, a.body))
                if phase == 0:
                    k["completed"] = True
                    phase = 1
                    continue
                k["replayed"] = True
                break
            time.sleep(0.3 if kind.startswith("409") else 0.1)
        time.sleep(rng.uniform(0.01, 0.05))


def hangup_loop(stack, rec, rng, deadline, stop, n):
    """Clients that leave: the request sent, the socket closed at once or
    a few ms later, on limited paths and streamed completions."""
    for _ in range(1_000_000):
        if stop.is_set() or time.monotonic() > deadline:
            return
        e = rng.choice(stack.envoys)
        if rng.random() < 0.5:
            req = (f"GET /rl/tb/h{n} HTTP/1.1\r\nhost: x\r\nx-user: hang-{n}\r\n"
                   "x-upstream-delay-ms: 50\r\n\r\n")
        else:
            req = ("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-user: hang-llm\r\n"
                   "x-upstream-llm: openai-sse\r\nx-upstream-body-pause-ms: 100\r\n"
                   "content-length: 2\r\n\r\n{}")
        try:
            with socket.create_connection((HOST, e["port"]), timeout=2) as s:
                s.sendall(req.encode())
                time.sleep(rng.uniform(0, 0.12))
        except OSError:
            pass
        with rec.lock:
            rec.hangups += 1
        time.sleep(rng.uniform(0.05, 0.2))


def grpc_loop(stack, rec, rng, deadline, stop, n):
    """Unary gRPC calls on a limited method, each on a new channel (a
    channel to a killed Envoy would wait out gRPC's reconnect backoff)."""
    import grpc
    out = Outage(rec, f"grpc-{n}")
    user = f"grpc-u{n}"
    # DEADLINE_EXCEEDED is the client's own deadline (TIMEOUT, above the
    # route's): no answer in time, as an HTTP client's timeout is, never a
    # timed assertion.
    names = {grpc.StatusCode.OK: "gRPC OK", grpc.StatusCode.RESOURCE_EXHAUSTED:
             "gRPC RESOURCE_EXHAUSTED", grpc.StatusCode.UNAVAILABLE: "gRPC UNAVAILABLE",
             grpc.StatusCode.DEADLINE_EXCEEDED: "gRPC no answer (client deadline)"}
    failed = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    for _ in range(1_000_000):
        if stop.is_set() or time.monotonic() > deadline:
            return
        e = rng.choice(stack.envoys)
        sent, wsent = time.monotonic(), time.time()
        with grpc.insecure_channel(f"{HOST}:{e['port']}") as ch:
            try:
                ch.unary_unary("/demo.Orders/Create").with_call(
                    b"soak", metadata=[("x-user", user)], timeout=TIMEOUT)
                code = grpc.StatusCode.OK
            except grpc.RpcError as err:
                code = err.code()
        done, wdone = time.monotonic(), time.time()
        k = names.get(code, f"unexpected gRPC {code.name}")
        rec.count(k)
        if code == grpc.StatusCode.OK:
            with rec.lock:
                rec.admitted.setdefault(("grpc", user), []).append((sent, done, wsent, wdone))

        class A:
            pass
        a = A()
        a.sent, a.done = sent, done
        out.saw(a, code not in failed)
        time.sleep(rng.uniform(0.02, 0.1))
