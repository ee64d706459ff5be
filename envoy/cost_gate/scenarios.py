"""The bench scenarios the gate measures, and the driver that plays Envoy and
Webdis around the filter for them.

Each scenario's filter configuration is make bench's (envoy/bench_scenarios.py,
by id), with fixed Webdis credentials in place of the bench's per-run ones, so
the configuration, and with it every figure, is the same on every run.

A scenario runs in rounds: `round` requests arrive, Webdis answers every
call beyond the `in_flight` the scenario keeps out (oldest first), the
root's tick fires while it is on, and every request whose decision is in
gets its upstream response and ends. Warm-up rounds load the scripts and
fill the worker's tables; the measured rounds that follow must agree call
for call (steady state), and the gate reports one of them.
"""
import copy
import json

from bench_scenarios import SCENARIOS as BENCH
from bench_stack import PATH
from cost_gate.host import RESPONSE_BODY, RESPONSE_HEADERS, GateError, Host
from cost_gate.webdis import Redis, response_headers

# Fixed credentials of the bench's form (secrets.token_urlsafe(24): 32 bytes).
PASSWORD = "cost-gate-fixed-password-0000000"

# Envoy between two callbacks of a worker: requests at about 10 000 a second.
GAP_NS = 100_000

# What the bench's upstream (a direct_response "ok\n") answers, as Envoy
# hands it to the filter.
UPSTREAM_HEADERS = [(b":status", b"200"), (b"content-length", b"3"),
                    (b"content-type", b"text/plain"),
                    (b"date", b"Thu, 01 Jan 2026 00:00:00 GMT"), (b"server", b"envoy"),
                    (b"x-envoy-upstream-service-time", b"0")]
UPSTREAM_BODY = b"ok\n"
POST_BODY = b'{"amount":1}'


def bench_filter(sid, access_log=True):
    """make bench's filter configuration of scenario `sid`."""
    sc = next(s for s in BENCH if s["id"] == sid)
    cfg = copy.deepcopy(sc["filter"])
    cfg["redis"]["credentials"]["password"] = PASSWORD
    if not access_log:
        cfg["accessLog"] = {"enabled": False}
    return cfg, sc["request"]


def scenario(gid, sid, what, round_=1, in_flight=0, access_log=True, warmup=4, rounds=6):
    cfg, request = bench_filter(sid, access_log)
    return {"id": gid, "bench": sid, "what": what, "filter": cfg, "request": request,
            "round": round_, "in_flight": in_flight, "warmup": warmup, "rounds": rounds}


# (f) keeps the default batch's two calls out, and each reply sends the 8
# requests that queued meanwhile (make bench's (f) averaged 6.8 a call).
# The queue the first rounds leave (a lone call, NOSCRIPTs) is gone by the
# sixth.
BATCH = 8
# (e): a lease of 100 tokens is topped up when fewer than half are left
# (src/lease.rs low_water): one background fetch of 51 every 51 requests.
LEASE_CYCLE = 51
# The root's tick while only watched lease slots wait (src/filter/stage/
# lease.rs CHECK_MS); the millisecond tick is the one calls wait on.
LEASE_TICK_MS = 20

SCENARIOS = [
    scenario("x", "x", "no limit applies (no x-user): the filter's fixed cost"),
    scenario("b", "b", "strict, one call of its own per request"),
    scenario("b.nolog", "b", "(b) without the access-log record", access_log=False),
    scenario("f", "f", f"strict, batched: {BATCH} requests a call, two calls out",
             round_=BATCH, in_flight=2, warmup=8, rounds=8),
    scenario("f.nolog", "f", "(f) without the access-log record", round_=BATCH, in_flight=2,
             access_log=False, warmup=8, rounds=8),
    scenario("e", "e", f"lease: {LEASE_CYCLE} requests spend leased tokens, one of them "
             "starts the background fetch of the next", round_=LEASE_CYCLE, warmup=2, rounds=3),
    scenario("e.nolog", "e", "(e) without the access-log record", round_=LEASE_CYCLE,
             access_log=False, warmup=2, rounds=3),
    scenario("c", "c", "two limits and an idempotency key: acquire with the decision, "
             "complete after the response"),
]


def request_headers(kind, n):
    """What Envoy hands the filter for request `n` of wrk's script `kind`
    (envoy/bench_wrk.py's WRK_*)."""
    method = b"POST" if kind == "post-idem" else b"GET"
    headers = [(b":authority", b"127.0.0.1:10000"), (b":path", PATH.encode()),
               (b":method", method), (b":scheme", b"http")]
    if kind != "get-anon":
        headers.append((b"x-user", b"bench-user"))
    if kind == "post-idem":
        headers += [(b"content-length", str(len(POST_BODY)).encode()),
                    (b"content-type", b"application/json"),
                    (b"idempotency-key", b"run-1-%08d" % n)]
    elif kind not in ("get", "get-anon"):
        raise GateError(f"no request of kind {kind!r} in the gate")
    headers += [(b"x-forwarded-proto", b"http"),
                (b"x-request-id", b"00000000-0000-4000-8000-%012d" % n)]
    return headers


class Driver:
    """Envoy and Webdis around one filter VM, for one scenario."""

    def __init__(self, compiled, sc):
        self.sc = sc
        self.host = Host(compiled, properties={
            ("source", "address"): b"127.0.0.1:40000",
            ("plugin_root_id",): b"redis-guard",
        })
        self.redis = Redis()
        self.open = []  # streams whose decision is not in yet
        self.sent = 0
        self.finished = 0
        self.scripts = []  # the scripts the calls ran, in order
        self.host.start(json.dumps(sc["filter"]).encode())

    def answer_calls(self, keep=0, since=0):
        """Webdis answers the calls sent from token `since` on, oldest
        first, but the newest `keep`. With `keep`, one pass: what the
        answers send stays out for the next round (a pipeline); without,
        until none is out (a NOSCRIPT's EVAL too)."""
        while True:
            out = sorted(t for t in self.host.calls_out if t >= since)
            due = out[:len(out) - keep] if keep else out
            for token in due:
                name, body = self.redis.answer(self.host.calls_out[token])
                self.scripts.append(name or "NOSCRIPT")
                self.host.advance(GAP_NS)
                self.host.respond(token, response_headers(body), body)
                self.host.drain_queues()
            if keep or not due:
                return

    def settle(self, keep=0, since=0):
        """Answers calls, then fires the root's tick while it is on,
        answering what each tick sends. Bounded: what waits for a tick goes
        in a few."""
        self.answer_calls(keep, since)
        for _ in range(20):
            # Off, or the slow tick of watched lease slots only
            # (src/filter/proxy/mod.rs LEASE_TICK): nothing waits on it.
            if not self.host.tick_ms or self.host.tick_ms >= LEASE_TICK_MS:
                return
            mark = self.host.next_token
            self.host.tick()
            self.host.drain_queues()
            self.answer_calls(0, mark)
        raise GateError("the root's tick stayed on for 20 ticks")

    def arrive(self):
        n = self.sent
        self.sent += 1
        post = self.sc["request"] == "post-idem"
        headers = request_headers(self.sc["request"], n)
        stream = self.host.open_stream(headers, POST_BODY if post else b"")
        self.host.advance(GAP_NS)
        paused = self.host.callback("proxy_on_request_headers", stream.ctx, len(headers),
                                    0 if post else 1)
        if post:
            paused = self.host.callback("proxy_on_request_body", stream.ctx, len(POST_BODY),
                                        1) or paused
        stream.paused = bool(paused)
        self.host.drain_queues()
        self.open.append(stream)

    def finish(self, stream):
        """The upstream answers a request the filter let through, and the
        stream ends."""
        if stream.local_reply is not None:
            raise GateError(f"request {stream.ctx} answered locally: {stream.local_reply}")
        stream.maps[RESPONSE_HEADERS] = list(UPSTREAM_HEADERS)
        stream.buffers[RESPONSE_BODY] = UPSTREAM_BODY
        self.host.advance(GAP_NS)
        mark = self.host.next_token
        held = self.host.callback("proxy_on_response_headers", stream.ctx,
                                  len(UPSTREAM_HEADERS), 0)
        held = self.host.callback("proxy_on_response_body", stream.ctx, len(UPSTREAM_BODY),
                                  1) or held
        self.settle(0, mark)
        if held and not stream.response_resumed:
            raise GateError(f"request {stream.ctx}: its response was held and never resumed")
        mark = self.host.next_token
        self.host.close_stream(stream)
        self.host.drain_queues()
        self.settle(0, mark)
        # The record, when on, says how the request went: every reply the
        # gate gives must read as an admission.
        record = stream.filter_state.get(("redis_guard",))
        if record is not None:
            verdict = json.loads(record).get("verdict")
            if verdict not in ("admitted", "leased"):
                raise GateError(f"request {stream.ctx} was not admitted: {record!r}")
        self.finished += 1

    def round(self):
        # A pipeline of `in_flight` calls: each round, Webdis answers the
        # oldest, and its answer sends what queued meanwhile.
        keep = max(0, self.sc["in_flight"] - 1)
        for _ in range(self.sc["round"]):
            self.arrive()
        self.settle(keep)
        still = []
        for stream in self.open:
            if stream.paused and not stream.request_resumed and stream.local_reply is None:
                still.append(stream)
            else:
                self.finish(stream)
        self.open = still

    def measure(self):
        """The scenario's figures per round in steady state: import calls
        by name (and by the kind of context that made them), the scripts
        the calls ran, and fuel, whose mean over the measured rounds is the
        figure (a hash table's growth or sweep moves a round's by a fraction
        of a percent, the same rounds on every run)."""
        sc, h = self.sc, self.host
        for _ in range(sc["warmup"]):
            self.round()
        rounds = []
        for _ in range(sc["rounds"]):
            h.reset_counts()
            self.scripts, self.finished = [], 0
            self.round()
            warnings = [m for level, m in h.logs if level not in ("trace", "debug", "info")]
            if warnings:
                raise GateError(f"({sc['id']}) the filter warned in steady state: {warnings}")
            if self.finished != sc["round"]:
                raise GateError(f"({sc['id']}) {self.finished} requests ended in a round of "
                                f"{sc['round']}: not a steady state")
            rounds.append({"calls": dict(sorted(h.calls.items())),
                           "by_role": {f"{n} ({r})": c for (n, r), c in
                                       sorted(h.calls_by_role.items())},
                           "callbacks": dict(sorted(h.callbacks.items())),
                           "scripts": list(self.scripts),
                           "fuel": dict(h.fuel)})
        first = rounds[0]
        for other in rounds[1:]:
            for what in ("calls", "by_role", "callbacks", "scripts"):
                if other[what] != first[what]:
                    raise GateError(f"({sc['id']}) measured rounds differ in {what}: "
                                    f"{first[what]} then {other[what]}: not a steady state "
                                    "(more warm-up rounds, or another round size)")
        totals = [sum(r["fuel"].values()) for r in rounds]
        by_callback = {name: round(sum(r["fuel"].get(name, 0) for r in rounds) / len(rounds))
                       for name in sorted(first["fuel"])}
        return {"what": sc["what"], "bench": sc["bench"], "requests": sc["round"],
                "calls": first["calls"], "by_role": first["by_role"],
                "callbacks": first["callbacks"], "scripts": first["scripts"],
                "fuel": round(sum(totals) / len(totals)), "fuel_min": min(totals),
                "fuel_max": max(totals), "fuel_by_callback": by_callback}
