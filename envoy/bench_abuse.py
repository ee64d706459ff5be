"""make bench's scenarios for abuse protection and per-customer quotas
(envoy/bench.py joins them in): each is (b) or (f) with one option added, so
its ratio to that scenario is what the option costs a request.

  t  override        b's bucket with "overrides": {"redis": true} and an
                     override stored for wrk's user: the script reads it (one
                     GET) in the decision's call and decides under it
  u  counted         b's bucket counting only 401 responses
                     (usage.countStatuses): the upstream answers 200, so every
                     request's reserve is given back by a settlement the
                     worker sends after the stream (batched per tick)
  v, w               t and u with batching on, against (f)
"""

# The static hash tag of a config without hashTag (the first 16 hex digits of
# SHA-256 of nothing) and wrk's user, as src/keys.rs lays out the key.
OVERRIDE_KEY = "rg:ov:{e3b0c44298fc1c14}:bench-ov:10:bench-user"
# Twice b's bucket: never exhausted either, capacity x period below 2^53.
OVERRIDE = "tb 2000000000 2000000000"


def scenarios(filter_config, tb, big, single):
    over = dict(tb("bench-ov", big, big, 1000), overrides={"redis": True})
    counted = dict(tb("bench-cs", big, big, 1000), usage={"countStatuses": ["401"]})
    common_over = {
        "request": "get",
        "expect": "2xx",
        "redis_setup": [(OVERRIDE_KEY, OVERRIDE)],
        # The run is void unless the override decided wrk's requests.
        "expect_stat": "wasmcustom.redis_guard.ratelimit.bench-ov.override_applied",
    }
    common_counted = {
        "request": "get",
        "expect": "2xx",
        "expect_stat": "wasmcustom.redis_guard.usage.refunded_units",
    }
    return [
        dict(common_over, id="t", name="strict, override",
             what="b's bucket with overrides from Redis and one stored for wrk's user: "
             "the decision's call reads it (one GET more) and decides under it",
             filter=filter_config([over], batch=single), goal_vs="b"),
        dict(common_counted, id="u", name="strict, response-counted",
             what="b's bucket counting only 401s: every request's reserve comes back by "
             "a settlement after its 200 (a second call, per worker tick)",
             filter=filter_config([counted], batch=single), goal_vs="b"),
        dict(common_over, id="v", name="batched, override",
             what="t with batching on", filter=filter_config([over]), goal_vs="f"),
        dict(common_counted, id="w", name="batched, response-counted",
             what="u with batching on", filter=filter_config([counted]), goal_vs="f"),
    ]
