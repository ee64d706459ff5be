"""The scenarios the gate measures, one per hot path, and the driver that
plays Envoy and Webdis around the filter for them.

A scenario's filter configuration is make bench's (envoy/bench_scenarios.py,
by id) or, for a path the bench does not isolate, one of its own built the
same way, with fixed Webdis credentials in place of the bench's per-run
ones, so the configuration, and with it every figure, is the same on every
run. Each scenario also says how its requests must be decided (verdict,
local reply, the stats they move): a scenario that drifted onto another
path fails rather than measure it.

A scenario runs in rounds: `round` requests arrive, Webdis answers every
call beyond the `in_flight` the scenario keeps out (oldest first), the
root's tick fires while it is on, and every request whose decision is in
gets its upstream response and ends. Warm-up rounds load the scripts and
fill the worker's tables; the measured rounds that follow must agree call
for call (steady state), and the gate reports one of them.
"""
import copy
import json

from bench_abuse import OVERRIDE, OVERRIDE_KEY
from bench_scenarios import BIG, SCENARIOS as BENCH, SINGLE, filter_config, tb
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
    return with_fixed(copy.deepcopy(sc["filter"]), access_log), sc["request"]


def with_fixed(cfg, access_log=True):
    cfg["redis"]["credentials"]["password"] = PASSWORD
    if not access_log:
        cfg["accessLog"] = {"enabled": False}
    return cfg


def scenario(gid, sid, what, round_=1, in_flight=0, access_log=True, warmup=4, rounds=6,
             **more):
    """Scenario `gid`: bench scenario `sid`'s configuration, or `more`'s
    "filter". `more`: "request" (the request's kind), "headers" (added to
    each request), "idem_key" (one Idempotency-Key for every request),
    "stored" ((key, value) pairs in Redis before the first request),
    "upstream" ((headers, body) the upstream answers), "idle" (what passes
    after each round: "watch" fires the root's slow tick `watch` times,
    "idle_ms" lets that much time pass, ticking as the root asks),
    "expect" (the record's verdict of every request; default admitted or
    leased), "status" (a local reply's status every request gets),
    "response_header" ((name, a part its value holds) in every response)
    and "stats" (stat name: its increase per round, exact). Only the
    measured rounds are checked: a warm-up request may be decided otherwise
    (a bucket's first request admitted, a key's first run)."""
    if sid is None:
        cfg, request = with_fixed(more.pop("filter"), access_log), more.pop("request", "get")
    else:
        cfg, request = bench_filter(sid, access_log)
        request = more.pop("request", request)
    return dict({"id": gid, "bench": sid or "-", "what": what, "filter": cfg,
                 "request": request, "round": round_, "in_flight": in_flight,
                 "warmup": warmup, "rounds": rounds}, **more)


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
# The over-limit cache answers for Redis at most this long (src/overlimit.rs
# HOLD_MAX_MS): a round idle longer meets Redis' own rejection again.
HOLD_MAX_MS = 1000

# A stored plan with the customer's billing day: y's quota moved to the
# 15th (its windows computed for day 1 are sent back once, then the filter
# sends the 15th's). The key is bench_abuse's, for y's quota limit.
ANCHORED_KEY = OVERRIDE_KEY.replace(":bench-ov:", ":bench-quota:")
ANCHORED = "cq 1000000000000 15"
# A plan the request carries (a header a trusted layer sets): twice b's.
CARRIED = b"tb 2000000000 2000000000"
# An LLM's answer with its usage (src/usage.rs reads a JSON body whole):
# 7 + 4 x 5 = 27 tokens against the reserve of 10, 17 charged after it.
USAGE_BODY = b'{"id":"x","usage":{"prompt_tokens":7,"completion_tokens":5}}'
USAGE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/json"),
                 (b"content-length", str(len(USAGE_BODY)).encode())]
# (e.return)'s bucket: the lease's 100 tokens come back whole (a refill of one
# token a second leaves room for them).
SLOW = {"capacity": 1_000_000, "refill": 1, "periodMs": 1000}


def custom(limits, idempotency=None, batch=SINGLE):
    return filter_config(limits, idempotency, batch)


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
    scenario("y", "y", f"calendar quota with a stored plan and billing day (15th) + burst "
             f"bucket, batched: {BATCH} requests a call", round_=BATCH, in_flight=2, warmup=8,
             rounds=8, stored=[(ANCHORED_KEY, ANCHORED)],
             stats={"ratelimit.bench-quota.override_applied": BATCH}),
    scenario("t", "t", "stored override: the customer's plan read from Redis in the "
             "decision's call", stored=[(OVERRIDE_KEY, OVERRIDE)],
             stats={"ratelimit.bench-ov.override_applied": 1}),
    scenario("t.carried", None, "carried override: the plan from a request header",
             filter=custom([tb("bench-carried", BIG, BIG, 1000,
                               overrides={"request": {"header": "x-plan"}})]),
             headers=[(b"x-plan", CARRIED)],
             response_header=(b"ratelimit-policy", b"2000000000"),
             stats={"ratelimit.bench-carried.override_applied": 1}),
    scenario("p", "p", "usage: a reserve of 10 in the decision, the JSON answer's 27 "
             "tokens settled after it (17 charged, batched per tick)",
             upstream=(USAGE_HEADERS, USAGE_BODY), stats={"usage.charged_units": 17}),
    scenario("d", "d", "rejected by Redis (429): the bucket is spent, the over-limit "
             f"cache's hold ({HOLD_MAX_MS} ms) is over", idle_ms=HOLD_MAX_MS + 1,
             expect="rejected", status=429, stats={"ratelimit.bench-over.rejected": 1}),
    scenario("d.cached", "d", "over-limit cache: 429 without a call to Redis",
             expect="cached_rejection", status=429, stats={"overlimit_cache.rejected": 1}),
    scenario("e.watch", "e", f"(e) and the root's watch tick ({LEASE_TICK_MS} ms) over the "
             "worker's lease slot once a cycle, nothing yet due back", round_=LEASE_CYCLE,
             warmup=2, rounds=3, watch=1),
    scenario("e.return", None, "give-back: a lease's 100 tokens, unspent, return to Redis "
             f"(watch ticks every {LEASE_TICK_MS} ms until the lease ends)",
             filter=custom([tb("bench-slow", SLOW["capacity"], SLOW["refill"],
                               SLOW["periodMs"], lease={"tokens": 100, "ttlMs": 1000})],
                           batch=None),
             watch=200, stats={"lease.returned": 100}),
    scenario("c.replay", "c", "a keyed retry answered from its completed record (replay)",
             idem_key=b"run-1-replay", expect="replayed", status=200,
             stats={"idempotency.replayed": 1}),
]


def request_headers(kind, n, idem_key=None):
    """What Envoy hands the filter for request `n` of wrk's script `kind`
    (envoy/bench_wrk.py's WRK_*; "get-llm" as "get")."""
    kind = "get" if kind == "get-llm" else kind
    method = b"POST" if kind == "post-idem" else b"GET"
    headers = [(b":authority", b"127.0.0.1:10000"), (b":path", PATH.encode()),
               (b":method", method), (b":scheme", b"http")]
    if kind != "get-anon":
        headers.append((b"x-user", b"bench-user"))
    if kind == "post-idem":
        headers += [(b"content-length", str(len(POST_BODY)).encode()),
                    (b"content-type", b"application/json"),
                    (b"idempotency-key", idem_key or b"run-1-%08d" % n)]
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
        self.redis = Redis(clock_ms=lambda: self.host.now_ns // 1_000_000)
        for key, value in sc.get("stored", ()):
            self.redis.set(key.encode(), value.encode())
        self.open = []  # streams whose decision is not in yet
        self.sent = 0
        self.finished = 0
        self.scripts = []  # the scripts the calls ran, in order
        self.measuring = False  # warm-up rounds are not checked
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

    def idle(self):
        """What passes after a round: `watch` of the root's slow ticks (the
        watch over lease slots; fewer when it stops), or `idle_ms` of time
        with the root's ticks as it asks for them."""
        h = self.host
        for _ in range(self.sc.get("watch", 0)):
            if h.tick_ms < LEASE_TICK_MS:
                break
            mark = h.next_token
            h.tick()
            h.drain_queues()
            self.settle(0, mark)
        until = h.now_ns + self.sc.get("idle_ms", 0) * 1_000_000
        for _ in range(10_000):
            if h.now_ns >= until:
                return
            if not h.tick_ms or h.now_ns + h.tick_ms * 1_000_000 > until:
                h.advance(until - h.now_ns)
                return
            mark = h.next_token
            h.tick()
            h.drain_queues()
            self.settle(0, mark)
        raise GateError("10,000 ticks in one idle time")

    def arrive(self):
        n = self.sent
        self.sent += 1
        post = self.sc["request"] == "post-idem"
        headers = request_headers(self.sc["request"], n, self.sc.get("idem_key"))
        headers += self.sc.get("headers", [])
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
        """The response goes through the filter, the upstream's for a
        request the filter let through, its own local reply for one it
        answered (as Envoy encodes a local reply), and the stream ends."""
        # Warm-up requests may be decided otherwise (a bucket's first
        # request admitted, a key's first run): measured ones are checked.
        sc = self.sc if self.measuring else {"id": self.sc["id"], "filter": {}}
        if stream.local_reply is not None:
            status, _details, body, headers, _grpc = stream.local_reply
            if status != sc.get("status", status if not self.measuring else None):
                raise GateError(f"({sc['id']}) request {stream.ctx} answered locally: "
                                f"{stream.local_reply}")
            headers = [(b":status", b"%d" % status)] + list(headers)
        elif "status" in sc:
            raise GateError(f"({sc['id']}) request {stream.ctx} went upstream, expected a "
                            f"local {sc['status']}")
        else:
            headers, body = self.sc.get("upstream", (UPSTREAM_HEADERS, UPSTREAM_BODY))
        stream.maps[RESPONSE_HEADERS] = list(headers)
        stream.buffers[RESPONSE_BODY] = body
        self.host.advance(GAP_NS)
        mark = self.host.next_token
        held = self.host.callback("proxy_on_response_headers", stream.ctx, len(headers),
                                  0 if body else 1)
        if body:
            held = self.host.callback("proxy_on_response_body", stream.ctx, len(body),
                                      1) or held
        self.settle(0, mark)
        if held and not stream.response_resumed:
            raise GateError(f"request {stream.ctx}: its response was held and never resumed")
        want = sc.get("response_header")
        if want:
            value = dict(stream.maps[RESPONSE_HEADERS]).get(want[0], b"")
            if want[1] not in value:
                raise GateError(f"({sc['id']}) response header {want[0]!r}: {value!r}, "
                                f"not naming {want[1]!r}")
        mark = self.host.next_token
        self.host.close_stream(stream)
        self.host.drain_queues()
        self.settle(0, mark)
        # The record says how the request was decided: the scenario's
        # verdict, every request.
        record = stream.filter_state.get(("redis_guard",))
        if record is not None and self.measuring:
            verdict = json.loads(record).get("verdict")
            if verdict not in ((sc["expect"],) if "expect" in sc else ("admitted", "leased")):
                raise GateError(f"({sc['id']}) request {stream.ctx}: {record!r}, expected "
                                f"verdict {sc.get('expect', 'admitted')!r}")
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
        self.idle()

    def stats(self):
        return {m[1]: m[2] for m in self.host.metrics.values()}

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
        self.measuring = True
        for _ in range(sc["rounds"]):
            h.reset_counts()
            self.scripts, self.finished = [], 0
            before = self.stats()
            self.round()
            after = self.stats()
            for name, want in sc.get("stats", {}).items():
                full = next((k for k in after if k.endswith("redis_guard." + name)), None)
                got = None if full is None else after[full] - before.get(full, 0)
                if got != want:
                    raise GateError(f"({sc['id']}) stat {name} rose by {got} in a round, "
                                    f"expected {want}: not the scenario's decision")
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
                           "fuel": dict(h.fuel),
                           "segments": dict(h.segments or {})})
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
                "fuel_max": max(totals), "fuel_by_callback": by_callback,
                "segments": rounds[-1]["segments"]}
