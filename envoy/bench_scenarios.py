"""make bench's scenarios: each one filter configuration (or none), the
request wrk sends and what the run expects; envoy/bench.py's docstring lists
them."""

import secrets

import bench_abuse
import bench_quota

# Webdis admits only these (envoy/webdis.json's http_basic_auth), made for
# this run; every filter config sends them.
WEBDIS_USER = "redis-guard"
WEBDIS_PASSWORD = secrets.token_urlsafe(24)  # Webdis caps user:password at 53 bytes


def redis_block():
    # A generous timeout: the bench measures throughput, not the timeout
    # policy; "deny" turns any failed call into a visible 503 (counted as an
    # unexpected response) instead of a silently forwarded request.
    return {"cluster": "webdis", "timeoutMs": 500,
            "credentials": {"username": WEBDIS_USER, "password": WEBDIS_PASSWORD}}


def tb(name, capacity, refill, period_ms, **extra):
    limit = {
        "name": name,
        "descriptor": [{"header": "x-user"}],
        "tokenBucket": {"capacity": capacity, "refill": refill, "periodMs": period_ms},
    }
    limit.update(extra)
    return limit


# Large enough that no run exhausts it: 1e9 tokens, refilled 1e9 per second
# (capacity x periodMs stays below 2^53).
BIG = 1_000_000_000


def kind(name, field, params):
    """One limit per x-user of the given kind (its JSON field and parameters)."""
    return {"name": name, "descriptor": [{"header": "x-user"}], field: params}


def mem_limit(field, params):
    """A slow limit of a kind that only requests carrying x-mem meet (see
    memory_per_key)."""
    limit = kind(f"bench-mem-{field}", field, params)
    limit["match"] = {"headers": [{"name": "x-mem", "present": True}]}
    return limit


# The single-call path: every decision its own call (batching off).
SINGLE = {"enabled": False}


def filter_config(limits, idempotency=None, batch=None):
    cfg = {"redis": redis_block(), "keyPrefix": "rg", "failureMode": "deny", "limits": limits}
    if batch is not None:
        cfg["redis"]["batch"] = batch
    if idempotency:
        cfg["idempotency"] = idempotency
    return cfg


def kind_scenario(sid, name, what, field, params, mem_params=None, goal_vs=None):
    """(b) with one limit of another kind. With `mem_params`, the config also
    holds a slow limit of that kind that only requests carrying x-mem meet:
    memory_per_key() measures its key, which lives long enough to be read
    (the scenario's own key expires within a millisecond)."""
    limits = [kind(f"bench-{field}", field, params)]
    if mem_params:
        limits.append(mem_limit(field, mem_params))
    sc = {"id": sid, "name": f"strict, {name}",
          "what": f"b with {what} instead of the token bucket",
          "filter": filter_config(limits, batch=SINGLE), "request": "get", "expect": "2xx"}
    if goal_vs:
        sc["goal_vs"] = goal_vs
    return sc


SCENARIOS = [
    {
        "id": "a",
        "name": "no filter",
        "what": "Envoy without the wasm filter (the baseline)",
        "filter": None,
        "request": "get",
        "expect": "2xx",
    },
    {
        "id": "b",
        "name": "strict, 1 limit",
        "what": "one token bucket per x-user, always under budget, batching off: one EVALSHA "
        "per request",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)], batch=SINGLE),
        "request": "get",
        "expect": "2xx",
        "goal": 0.35,
    },
    {
        "id": "c",
        "name": "strict, 2 limits + idempotency",
        "what": "token bucket + sliding window (1e6 per 10 s) per x-user and an idempotency "
        "rule; every request is a POST with a fresh Idempotency-Key: acquire (joined with "
        "the limits) + complete, two EVALSHA per request",
        "filter": filter_config(
            [
                tb("bench-tb", BIG, BIG, 1000),
                {
                    "name": "bench-sw",
                    "descriptor": [{"header": "x-user"}],
                    "slidingWindow": {"limit": 1_000_000, "windowMs": 10_000},
                },
            ],
            [{"name": "bench-idem", "lockTtlMs": 30_000, "recordTtlMs": 60_000}],
        ),
        "request": "post-idem",
        "expect": "2xx",
    },
    {
        "id": "d",
        "name": "key under attack",
        "what": "one token bucket of capacity 1, refilled 1 per hour, one x-user: every "
        "request after the first gets 429 (the over-limit cache answers without Redis)",
        "filter": filter_config([tb("bench-over", 1, 1, 3_600_000)]),
        "request": "get",
        "expect": "4xx",
        "goal": 0.9,
    },
    {
        "id": "e",
        "name": "lease",
        "what": "b with \"lease\": {\"tokens\": 100, \"ttlMs\": 1000}: the Envoy takes 100 "
        "tokens per Redis call and spends them locally",
        "filter": filter_config(
            [tb("bench-tb", BIG, BIG, 1000, lease={"tokens": 100, "ttlMs": 1000})]
        ),
        "request": "get",
        "expect": "2xx",
        "goal": 0.8,
    },
    {
        # A diagnostic (in the default --scenarios abcdex): what the filter
        # costs before any Redis call.
        "id": "x",
        "name": "filter, nothing applies",
        "what": "b's filter, but the requests carry no x-user: the limit does not apply, no "
        "Redis call (the filter's fixed cost per request)",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)], batch=SINGLE),
        "request": "get-anon",
        "expect": "2xx",
        "optional": True,
    },
    {
        "id": "f",
        "name": "strict, batched",
        "what": "b with batching on (the default: maxRequests 32, maxInFlight 2): requests "
        "that arrive while the worker's calls are out go to Redis together, one EVALSHA of "
        "lua/batch.lua, each decided exactly",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)]),
        "request": "get",
        "expect": "2xx",
        "goal": 0.65,
    },
    {
        # Diagnostics for the batching defaults (not in the default run).
        "id": "i",
        "name": "batched, 1 call in flight",
        "what": "f with maxInFlight 1: bigger batches, a reply waited for before the next call",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)],
                                batch={"maxRequests": 32, "maxInFlight": 1}),
        "request": "get",
        "expect": "2xx",
        "optional": True,
    },
    {
        "id": "j",
        "name": "batched, 4 calls in flight",
        "what": "f with maxInFlight 4: smaller batches, more calls out at once",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)],
                                batch={"maxRequests": 32, "maxInFlight": 4}),
        "request": "get",
        "expect": "2xx",
        "optional": True,
    },
    # One scenario per limit kind, as (b): always under budget, batching off
    # (one EVALSHA per request), so the kinds compare call for call.
    kind_scenario("k", "GCRA", "one GCRA limit (rate 1e9 per second, burst 1e9)", "gcra",
                  {"rate": BIG, "periodMs": 1000, "burst": BIG},
                  {"rate": 1, "periodMs": 3_600_000, "burst": 10}, goal_vs="b"),
    kind_scenario("l", "fixed window", "one fixed window (1e9 per second)", "fixedWindow",
                  {"limit": BIG, "windowMs": 1000}, {"limit": 10, "windowMs": 3_600_000},
                  goal_vs="b"),
    kind_scenario("m", "sliding-window counter", "one sliding-window counter (1e9 per second)",
                  "slidingWindowCounter", {"limit": BIG, "windowMs": 1000},
                  {"limit": 10, "windowMs": 3_600_000}),
    kind_scenario("n", "sliding-window log", "one sliding-window log (1e6 per 10 s)",
                  "slidingWindow", {"limit": 1_000_000, "windowMs": 10_000}),
    {
        "id": "q",
        "name": "no filter, LLM answers",
        "what": "(a) answering (p)'s streamed completion: (p)'s baseline for the same bytes",
        "filter": None,
        "request": "get-llm",
        "expect": "2xx",
    },
    {
        "id": "p",
        "name": "strict, usage (LLM tokens)",
        "what": "b's token bucket charged by the response's usage: a reserve of 10 taken in the "
        "decision, each answer an OpenAI-style stream of about 4 KiB scanned event by event, its "
        "final usage settled by the worker (batched per tick): two calls per request at most",
        "filter": filter_config([dict(tb("bench-usage", BIG, BIG, 1000), usage={
            "reserve": 10,
            "json": [{"pointer": "/usage/prompt_tokens"},
                     {"pointer": "/usage/completion_tokens", "weight": 4}]})], batch=SINGLE),
        "request": "get-llm",
        "expect": "2xx",
    },
    {
        "id": "s",
        "name": "no filter, JWT verified",
        "what": "(a) with a bearer token that Envoy's jwt_authn verifies on every request: "
        "(r)'s baseline, the verification without the filter",
        "filter": None,
        "request": "get-jwt",
        "expect": "2xx",
    },
    {
        "id": "r",
        "name": "strict, per JWT subject",
        "what": "b keyed on the verified token's `sub` claim (dynamic metadata jwt_authn "
        "writes) instead of x-user: jwt_authn, then one EVALSHA per request",
        "filter": filter_config([{
            "name": "bench-jwt",
            "descriptor": [{"metadata": {"namespace": "envoy.filters.http.jwt_authn",
                                         "path": ["payload", "sub"]}}],
            "tokenBucket": {"capacity": BIG, "refill": BIG, "periodMs": 1000}}], batch=SINGLE),
        "request": "get-jwt",
        "expect": "2xx",
    },
    kind_scenario("o", "concurrency", "one concurrency limit (1e6 in flight; its slot given "
                  "back by a second call as the stream ends)", "concurrency",
                  {"max": 1_000_000, "leaseMs": 30_000}),
    {
        "id": "g",
        "name": "strict, 1 connection",
        "what": "b at `-c1` (one request at a time): what a quiet Envoy pays per call",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)], batch=SINGLE),
        "request": "get",
        "expect": "2xx",
        "connections": 1,
    },
    {
        "id": "h",
        "name": "batched, 1 connection",
        "what": "f at `-c1`: each request finds its worker quiet and sends its own call at once "
        "(batch.alone): compare its latency with (g)'s",
        "filter": filter_config([tb("bench-tb", BIG, BIG, 1000)]),
        "request": "get",
        "expect": "2xx",
        "connections": 1,
    },
]

# Abuse protection and per-customer quotas (envoy/bench_abuse.py).
SCENARIOS += bench_abuse.scenarios(filter_config, tb, BIG, SINGLE)

# A calendar quota with a per-second burst limit (envoy/bench_quota.py).
SCENARIOS += bench_quota.scenarios(filter_config, tb, BIG)
