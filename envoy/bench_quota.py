"""make bench's calendar-quota scenario (envoy/bench.py joins it in): the
book's recipe "monthly plan + per-second burst limit"
(docs/src/using/recipes.md#monthly-plan-and-a-per-second-burst-limit)
(envoy/recipes/quota.json), batched as the default is, so its ratio to (f)
is what the plan's quota adds to a batched request.

  y  quota + burst   f's token bucket (the burst limit, never exhausted) and a
                     monthly quota per x-user in Europe/Berlin renewing on the
                     1st, with overrides from Redis (none stored: the script's
                     GET of the override finds nothing, as for most
                     customers); the amount is never reached in a run. Each
                     request's quota carries its window edges, computed in
                     the filter from the zone's rules
"""

# Never reached: a run's requests are far fewer (every run starts from an
# empty Redis), and it stays below the script's 2^50.
AMOUNT = 1_000_000_000_000


def quota(name, amount):
    return {
        "name": name,
        "descriptor": [{"header": "x-user"}],
        "quota": {"amount": amount, "per": "month", "timeZone": "Europe/Berlin",
                  "anchorDay": 1},
        "overrides": {"redis": True},
    }


def scenarios(filter_config, tb, big):
    return [{
        "id": "y",
        "name": "batched, quota + burst",
        "what": "f's token bucket as a per-second burst limit plus a monthly quota per x-user "
        "(Europe/Berlin, renewing on the 1st, overrides from Redis, none stored): the book's "
        "recipe's shape, batched (the default); one window key per month, its edges "
        "computed by the filter",
        "filter": filter_config([tb("bench-burst", big, big, 1000),
                                 quota("bench-quota", AMOUNT)]),
        "request": "get",
        "expect": "2xx",
        # The run is void unless the quota decided wrk's requests.
        "expect_stat": "wasmcustom.redis_guard.ratelimit.bench-quota.allowed",
    }]
