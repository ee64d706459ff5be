"""The soak's filter configuration and, for each limit, the bound the book
states for it (docs/src/using/limits.md; the simulation's references in
tests/sim/kinds.rs), which check.py holds every client's admissions to."""

import json

ENVOYS = 3

# Every limit counts per x-user on its own path; failureMode deny, so every
# 200 on a limited path was admitted by Redis (or by a lease Redis granted),
# and an outage answers 503 (counted apart).
LIMITS = {
    "tb": {"tokenBucket": {"capacity": 5, "refill": 1, "periodMs": 1000}},
    "gcra": {"gcra": {"rate": 1, "periodMs": 1000, "burst": 3}},
    "sw": {"slidingWindow": {"limit": 6, "windowMs": 3000}},
    "fw": {"fixedWindow": {"limit": 6, "windowMs": 3000}},
    "swc": {"slidingWindowCounter": {"limit": 6, "windowMs": 3000}},
    "conc": {"concurrency": {"max": 2, "leaseMs": 60000}},
    # Big enough that grants are not 0 (under 4 tokens left they are), so
    # requests spend leased tokens, and drained by the traffic (about 3 a
    # second per user), so the strict path decides too.
    "lease": {"tokenBucket": {"capacity": 30, "refill": 2, "periodMs": 1000},
              "lease": {"tokens": 5, "ttlMs": 2000}},
    "quota": {"quota": {"amount": 60, "per": "hour", "timeZone": "UTC"}},
    # gRPC calls (demo.Orders/Create, envoy/grpc_peer.py), x-user metadata.
    "grpc": {"tokenBucket": {"capacity": 4, "refill": 1, "periodMs": 1000}},
}
PATHS = {"grpc": "/demo.Orders/"}
# A request on /rl/conc is held this long by the upstream.
CONC_HOLD_MS = 400

# The usage limit: a bucket that no run of the soak can empty and that
# refills less than one token a day, so what Redis spent on it is the sum of
# what each request cost: its reserve if its settlement was lost, its usage
# if settled. Each completion reports USAGE tokens against a reserve of
# RESERVE, so every lost settlement shows as USAGE - RESERVE missing.
USAGE_CAPACITY = 50_000_000
USAGE_PERIOD_MS = 86_400_000
USAGE_RESERVE = 1
USAGE_PROMPT, USAGE_COMPLETION = 1, 100
USAGE = USAGE_PROMPT + USAGE_COMPLETION

# Keyed POSTs: the lock outlives the route's 10 s timeout, as the book asks.
LOCK_TTL_MS = 12000
RECORD_TTL_MS = 300_000
OFFLOAD_ABOVE = 16384
BUCKET = "redis-guard"


def limits():
    out = []
    for kind, spec in LIMITS.items():
        out.append({"name": f"soak-{kind}", "match": {"pathPrefix": PATHS.get(kind, f"/rl/{kind}")},
                    "descriptor": [{"header": "x-user"}], "failureMode": "deny", **spec})
    out.append({
        "name": "soak-usage", "match": {"pathPrefix": "/v1/"},
        "descriptor": [{"header": "x-user"}], "failureMode": "deny",
        "tokenBucket": {"capacity": USAGE_CAPACITY, "refill": 1, "periodMs": USAGE_PERIOD_MS},
        "usage": {"reserve": USAGE_RESERVE,
                  "json": [{"pointer": "/usage/prompt_tokens"},
                           {"pointer": "/usage/completion_tokens"}]},
    })
    # The limit an idempotency rule needs beside it (its records' bound).
    out.append({"name": "soak-pay", "match": {"pathPrefix": "/pay"},
                "descriptor": [{"header": "x-tenant"}], "failureMode": "deny",
                "slidingWindow": {"limit": 100000, "windowMs": 60000}})
    return out


def filter_config(timeout_ms=1000):
    return {
        "redis": {"cluster": "webdis", "timeoutMs": timeout_ms},
        "objectStore": {"cluster": "objectstore", "bucket": BUCKET, "region": "us-east-1",
                        "keyPrefix": "redis-guard/", "timeoutMs": 5000,
                        "credentials": {"fromEnvironment": True}},
        "keyPrefix": "rg",
        "failureMode": "deny",
        "limits": limits(),
        "idempotency": [{
            "name": "pay", "match": {"pathPrefix": "/pay", "methods": ["POST"]},
            "tenant": [{"header": "x-tenant"}], "lockTtlMs": LOCK_TTL_MS,
            "maxStoredBodyBytes": 65536, "offloadAboveBytes": OFFLOAD_ABOVE,
            # Five minutes, not a day: Redis' memory then levels off within
            # a run, which the memory bound is checked against.
            "recordTtlMs": RECORD_TTL_MS,
            "failureMode": "deny",
        }],
    }


def filter_json(timeout_ms=1000):
    return json.dumps(filter_config(timeout_ms))
