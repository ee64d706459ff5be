//! Per-customer quotas without a config per customer, through two real
//! Envoys: a limit that takes overrides reads the one `redis-guard override
//! set` stored for the request's key in the same call that decides it, so
//! the next request on every Envoy is decided under it, exactly; `unset`
//! restores the configured limit; garbage written by hand is ignored with a
//! stat. Built with the `cli` feature (its binary is driven here).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use support::probe::poll;
use support::*;

/// Free tier: 5 per hour per API key (the period far above the test's run,
/// so nothing refills while it runs).
fn config() -> String {
    filter_config(1000)
        .limits(
            r#"[{"name": "per-key", "match": {"pathPrefix": "/api/"},
                 "descriptor": [{"header": "x-api-key"}],
                 "tokenBucket": {"capacity": 5, "refill": 5, "periodMs": 3600000},
                 "overrides": {"redis": true, "request": {"header": "x-quota"}}}]"#,
        )
        .build()
}

/// `redis-guard override ...` for acme's key against the stack's Redis.
fn cli(stack: &Stack, config: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let which = ["--limit", "per-key", "--value", "x-api-key=acme"];
    let args = [&["override"], args, &which[..]].concat();
    cli_json(env!("CARGO_BIN_EXE_redis-guard"), stack, config, &args)
}

/// Requests for `key`, alternating Envoys, until the first 429 (bounded):
/// how many were admitted.
fn admitted_until_limited(stack: &Stack, key: &str, most: usize) -> usize {
    admitted_carrying(stack, key, None, most)
}

/// The same, each request carrying `quota` in x-quota (as a trusted filter
/// in front would set it from a claim).
fn admitted_carrying(stack: &Stack, key: &str, quota: Option<&str>, most: usize) -> usize {
    let mut headers = vec![("x-api-key", key)];
    if let Some(q) = quota {
        headers.push(("x-quota", q));
    }
    admitted_until_429(&stack.envoys, "/api/x", &headers, most)
}

#[test]
fn an_override_set_with_the_cli_decides_the_next_request_on_every_envoy() {
    let stack = Stack::start(&config(), 2);
    let dir = Scratch::new("overrides");
    let config_path = dir.0.join("filter.json");
    std::fs::write(&config_path, config()).unwrap();
    let agent = agent();
    let get = |i: usize, key: &str| {
        let e = &stack.envoys[i % 2];
        http_with(&agent, "GET", &e.url("/api/x"), &[("x-api-key", key)], None).status
    };

    // acme spends 3 of the free 5; then its tier: 20 an hour.
    for i in 0..3 {
        assert_eq!(get(i, "acme"), 200);
    }
    let set = cli(
        &stack,
        &config_path,
        &["set", "--capacity", "20", "--refill", "20"],
    );
    assert_eq!(set["override"]["capacity"], 20);
    let shown = cli(&stack, &config_path, &["show"]);
    assert_eq!(shown["valid"], true);
    // The bucket keeps its level (2 tokens) and now holds up to 20: only
    // what was left is there at once, exactly, on both Envoys.
    assert_eq!(admitted_until_limited(&stack, "acme", 30), 2);
    assert_eq!(
        stack.counter("redis_guard.ratelimit.per-key.override_applied"),
        3
    );
    // Another key is not affected: its configured 5.
    assert_eq!(admitted_until_limited(&stack, "globex", 30), 5);

    // acme's status from Envoy `i` as Redis decides it, not the over-limit
    // cache an earlier 429 filled (it holds one up to a second and reads
    // no override).
    let decided_by_redis = |i: usize| {
        poll("a request decided by Redis", Duration::from_secs(5), || {
            let cached = stack.counter("redis_guard.overlimit_cache.rejected");
            let status = get(i, "acme");
            (stack.counter("redis_guard.overlimit_cache.rejected") == cached).then_some(status)
        })
    };

    // Unset: the configured numbers decide again.
    cli(&stack, &config_path, &["unset"]);
    assert_eq!(
        cli(&stack, &config_path, &["show"])["override"],
        serde_json::Value::Null
    );
    let applied = stack.counter("redis_guard.ratelimit.per-key.override_applied");
    assert_eq!(decided_by_redis(0), 429);
    assert_eq!(
        stack.counter("redis_guard.ratelimit.per-key.override_applied"),
        applied
    );

    // A fresh key with an override gets its whole quota: set before any
    // request, 20 admitted, exactly, over both Envoys.
    let set_initech = [
        "override",
        "set",
        "--limit",
        "per-key",
        "--value",
        "x-api-key=initech",
        "--capacity",
        "20",
        "--refill",
        "20",
    ];
    cli_json(
        env!("CARGO_BIN_EXE_redis-guard"),
        &stack,
        &config_path,
        &set_initech,
    );
    assert_eq!(admitted_until_limited(&stack, "initech", 40), 20);

    // Garbage written by hand at acme's override key: ignored, counted, the
    // configured limit applies (acme's bucket is empty: 429, never a 5xx).
    let key: String = {
        let shown = cli(&stack, &config_path, &["show"]);
        shown["key"].as_str().unwrap().to_string()
    };
    set_key(&mut stack.redis.conn(), &key, "tb lots");
    let shown = cli(&stack, &config_path, &["show"]);
    assert_eq!(shown["valid"], false);
    assert_eq!(decided_by_redis(1), 429);
    assert_eq!(
        stack.counter("redis_guard.ratelimit.per-key.override_invalid"),
        1
    );
}

#[test]
fn an_override_the_request_carries_applies_and_one_in_redis_wins_over_it() {
    let stack = Stack::start(&config(), 2);
    let dir = Scratch::new("overrides");
    let config_path = dir.0.join("filter.json");
    std::fs::write(&config_path, config()).unwrap();
    // hooli's token says 8: eight at once, exactly, on both Envoys; the
    // limit headers state the carried quota.
    let agent = agent();
    let r = http_with(
        &agent,
        "GET",
        &stack.envoy().url("/api/x"),
        &[("x-api-key", "hooli"), ("x-quota", "8")],
        None,
    );
    assert_eq!(r.header("x-ratelimit-limit"), Some("8"));
    assert_eq!(admitted_carrying(&stack, "hooli", Some("8"), 20), 7);
    // acme carries 8 too, but its operator set 12 in Redis: Redis wins (an
    // operator's change applies at once; a token's claim lives until it
    // expires).
    cli(
        &stack,
        &config_path,
        &["set", "--capacity", "12", "--refill", "12"],
    );
    assert_eq!(admitted_carrying(&stack, "acme", Some("8"), 30), 12);
    // A carried value that is no quota: ignored, counted, the configured 5.
    let invalid = stack.counter("redis_guard.ratelimit.per-key.override_invalid");
    assert_eq!(admitted_carrying(&stack, "umbrella", Some("-3"), 20), 5);
    assert_eq!(
        stack.counter("redis_guard.ratelimit.per-key.override_invalid"),
        invalid + 6
    );
}
