//! Per-customer quotas without a config per customer, through two real
//! Envoys: a limit that takes overrides reads the one `redis-guard override
//! set` stored for the request's key in the same call that decides it, so
//! the next request on every Envoy is decided under it, exactly; `unset`
//! restores the configured limit; garbage written by hand is ignored with a
//! stat. Built with the `cli` feature (its binary is driven here).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use support::probe::{poll, poll_eq};
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
    // The headers state the plan that decided: Redis' 12, not the carried 8.
    let r = http_with(
        &agent,
        "GET",
        &stack.envoy().url("/api/x"),
        &[("x-api-key", "acme"), ("x-quota", "8")],
        None,
    );
    assert_eq!(r.header("x-ratelimit-limit"), Some("12"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("11"));
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"per-key\";q=12;w=3600")
    );
    assert_eq!(admitted_carrying(&stack, "acme", Some("8"), 30), 11);
    // A carried value that is no quota: ignored, counted, the configured 5.
    let invalid = stack.counter("redis_guard.ratelimit.per-key.override_invalid");
    assert_eq!(admitted_carrying(&stack, "umbrella", Some("-3"), 20), 5);
    assert_eq!(
        stack.counter("redis_guard.ratelimit.per-key.override_invalid"),
        invalid + 6
    );
}

/// A day's zone far from its midnight now (a test that crosses a day's
/// edge would see its quota renew): UTC, or Tokyo near UTC's midnight.
fn zone_far_from_midnight() -> &'static str {
    let hour = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        / 3600
        % 24;
    if (2..22).contains(&hour) {
        "UTC"
    } else {
        "Asia/Tokyo"
    }
}

/// An LLM gateway's plans: 100 tokens a day per API key configured (the
/// free tier), each request reserving 1 and settled from its OpenAI or
/// Anthropic usage after the response; one request in flight per user
/// configured. Both take stored plans.
fn plans_config() -> String {
    filter_config(1000)
        .limits(&format!(
            r#"[{{"name": "tokens", "match": {{"pathPrefix": "/v1/"}},
                 "descriptor": [{{"header": "x-api-key"}}],
                 "quota": {{"amount": 100, "per": "day", "timeZone": "{}"}},
                 "usage": {{"json": [{{"pointer": "/usage/prompt_tokens"}},
                                     {{"pointer": "/usage/completion_tokens"}},
                                     {{"pointer": "/message/usage/input_tokens"}},
                                     {{"pointer": "/usage/output_tokens"}}]}},
                 "overrides": {{"redis": true}}}},
                {{"name": "inflight", "match": {{"pathPrefix": "/slow"}},
                 "descriptor": [{{"header": "x-user"}}],
                 "concurrency": {{"max": 1, "leaseMs": 30000}},
                 "overrides": {{"redis": true}}}}]"#,
            zone_far_from_midnight()
        ))
        .build()
}

/// The tokens counted in `key`'s daily windows.
fn tokens_spent(con: &mut redis::Connection, key: &str) -> i64 {
    llm::tokens_in_windows(con, "tokens", key)
}

#[test]
fn a_stored_daily_token_plan_is_spent_exactly_from_streamed_usage_and_its_headers_state_it() {
    let stack = Stack::start(&plans_config(), 2);
    let dir = Scratch::new("plans");
    let config_path = dir.0.join("filter.json");
    std::fs::write(&config_path, plans_config()).unwrap();
    let mut con = stack.redis.conn();
    // acme's plan: 1,000 tokens a day; initech has none (the configured 100).
    let set = cli_json(
        env!("CARGO_BIN_EXE_redis-guard"),
        &stack,
        &config_path,
        &[
            "override",
            "set",
            "--limit",
            "tokens",
            "--value",
            "x-api-key=acme",
            "--quota",
            "1000",
        ],
    );
    assert_eq!(set["override"]["quota"], 1000);
    let day = |q: u64| format!("\"tokens\";q={q};w=86400");
    // Ten streamed completions of 100 tokens each, alternating Envoys and
    // APIs: each reserves 1 at admission and settles its 99 more as its
    // stream ends, under acme's plan.
    for n in 1..=10 {
        let r = llm::streamed(&stack, n, "acme", 30, 70);
        assert_eq!(r.status, 200, "request {n}");
        // The headers state acme's own plan and what is left of it after
        // the reserve.
        let left = 1000 - 100 * (n as u64 - 1) - 1;
        assert_eq!(r.header("ratelimit-policy"), Some(day(1000).as_str()));
        assert_eq!(r.header("x-ratelimit-limit"), Some("1000"));
        assert_eq!(
            r.header("x-ratelimit-remaining"),
            Some(left.to_string().as_str())
        );
        let state = r.header("ratelimit").unwrap();
        assert!(
            state.starts_with(&format!("\"tokens\";r={left};t=")),
            "{state}"
        );
        poll_eq(
            "acme's settlement",
            100 * n as i64,
            Duration::from_secs(5),
            || tokens_spent(&mut con, "acme"),
        );
    }
    // Exactly 1,000 tokens, to the token: the plan is spent.
    let r = llm::streamed(&stack, 0, "acme", 1, 1);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ratelimit-limit"), Some("1000"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(tokens_spent(&mut con, "acme"), 1000);

    // initech: the configured 100, settled the same way.
    let r = llm::streamed(&stack, 1, "initech", 40, 60);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("ratelimit-policy"), Some(day(100).as_str()));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("99"));
    poll_eq("initech's settlement", 100, Duration::from_secs(5), || {
        tokens_spent(&mut con, "initech")
    });
    let r = llm::streamed(&stack, 0, "initech", 1, 1);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ratelimit-limit"), Some("100"));
    assert_eq!(tokens_spent(&mut con, "initech"), 100);
    assert_eq!(tokens_spent(&mut con, "acme"), 1000);
    assert_eq!(stack.counter("redis_guard.usage.fallback"), 0);
    assert_eq!(
        stack.counter("redis_guard.ratelimit.tokens.override_applied"),
        11
    );
}

/// A request to `path` as `user` that its client holds in flight.
fn held(stack: &Stack, n: usize, path: &str, user: &str) -> std::net::TcpStream {
    let admitted = "redis_guard.ratelimit.inflight.allowed";
    llm::held_by_client(stack, n, path, &[("x-user", user.as_bytes())], admitted)
}

#[test]
fn a_customer_with_a_concurrency_plan_of_3_holds_exactly_3_in_flight_and_others_1() {
    let stack = Stack::start(&plans_config(), 2);
    let dir = Scratch::new("plans");
    let config_path = dir.0.join("filter.json");
    std::fs::write(&config_path, plans_config()).unwrap();
    let set = cli_json(
        env!("CARGO_BIN_EXE_redis-guard"),
        &stack,
        &config_path,
        &[
            "override",
            "set",
            "--limit",
            "inflight",
            "--value",
            "x-user=acme",
            "--max",
            "3",
        ],
    );
    assert_eq!(set["override"]["quota"], 3);
    // Three held in flight by their clients, over both Envoys.
    let held_acme: Vec<_> = (0..3)
        .map(|i| held(&stack, i, &format!("/slow?acme={i}"), "acme"))
        .collect();
    // The 4th is refused, on either Envoy, and says acme's own maximum.
    for e in &stack.envoys {
        let r = http("GET", &e.url("/slow"), &[("x-user", "acme")], None);
        assert_eq!(r.status, 429);
        assert_eq!(r.header("x-ratelimit-limit"), Some("3"));
        assert_eq!(r.header("ratelimit-policy"), Some("\"inflight\";q=3"));
    }
    // bob has no plan: the configured 1.
    let bob = held(&stack, 0, "/slow?bob", "bob");
    let r = http(
        "GET",
        &stack.envoys[1].url("/slow"),
        &[("x-user", "bob")],
        None,
    );
    assert_eq!(r.status, 429);
    assert_eq!(r.header("ratelimit-policy"), Some("\"inflight\";q=1"));
    // Exactly three of acme's and one of bob's ever reached the upstream,
    // once each was let go.
    for s in held_acme.into_iter().chain([bob]) {
        llm::finish(s);
    }
    let reached: u64 = (0..3)
        .map(|i| stack.upstream.executions_of(&format!("/slow?acme={i}")))
        .sum();
    assert_eq!(reached, 3);
    assert_eq!(stack.upstream.executions_of("/slow?bob"), 1);
    assert_eq!(stack.upstream.executions_of("/slow"), 0);
}

/// A leased bucket of 20 an hour per API key, batches of 4, that takes
/// stored plans.
fn leased_config() -> String {
    filter_config(1000)
        .limits(
            r#"[{"name": "leased", "match": {"pathPrefix": "/api/"},
                 "descriptor": [{"header": "x-api-key"}],
                 "tokenBucket": {"capacity": 20, "refill": 20, "periodMs": 3600000},
                 "lease": {"tokens": 4, "ttlMs": 600000},
                 "overrides": {"redis": true}}]"#,
        )
        .build()
}

#[test]
fn a_customer_with_a_plan_on_a_leased_limit_gets_exactly_its_plan_while_others_keep_leasing() {
    let stack = Stack::start(&leased_config(), 2);
    let dir = Scratch::new("leased-plans");
    let config_path = dir.0.join("filter.json");
    std::fs::write(&config_path, leased_config()).unwrap();
    let which = ["--limit", "leased", "--value", "x-api-key=acme"];
    let set = ["override", "set", "--capacity", "12", "--refill", "12"];
    let bin = env!("CARGO_BIN_EXE_redis-guard");
    cli_json(bin, &stack, &config_path, &[&set[..], &which[..]].concat());
    let agent = agent();
    let spent = || stack.counter("redis_guard.lease.spent");
    let fetches = || stack.counter("redis_guard.lease.fetches");

    // acme, over both Envoys: every request decided in Redis under its plan
    // of 12 (each a lease call granting nothing), its headers stating 12.
    let mut admitted = 0;
    for i in 0..30 {
        let e = &stack.envoys[i % 2];
        let r = http_with(
            &agent,
            "GET",
            &e.url("/api/x"),
            &[("x-api-key", "acme")],
            None,
        );
        if r.status != 200 {
            assert_eq!(r.status, 429, "request {i}");
            assert_eq!(r.header("x-ratelimit-limit"), Some("12"), "the 429 too");
            break;
        }
        admitted += 1;
        let left = (12 - admitted).to_string();
        assert_eq!(r.header("x-ratelimit-limit"), Some("12"), "request {i}");
        assert_eq!(r.header("x-ratelimit-remaining"), Some(left.as_str()));
        assert_eq!(
            r.header("ratelimit-policy"),
            Some("\"leased\";q=12;w=3600"),
            "request {i}"
        );
    }
    assert_eq!(admitted, 12);
    assert_eq!(stack.upstream.executed(), 12);
    assert_eq!(spent(), 0, "nothing leased to acme");
    assert_eq!(fetches(), 13, "each of acme's 13 requests one lease call");
    let records: Vec<String> = redis::cmd("KEYS")
        .arg("*:ret")
        .query(&mut stack.redis.conn())
        .unwrap();
    assert!(
        records.is_empty(),
        "no grant, no give-back record: {records:?}"
    );

    // bob, without a plan, on one Envoy: leased batches, the configured 20
    // exactly (one Envoy spends every token it holds).
    let e1 = std::slice::from_ref(&stack.envoys[0]);
    assert_eq!(
        admitted_until_429(e1, "/api/x", &[("x-api-key", "bob")], 40),
        20
    );
    assert!(spent() > 0, "bob's requests spent leased tokens");
    assert!(fetches() < 13 + 20, "fewer lease calls than bob's requests");
    assert_eq!(stack.upstream.executed(), 32);
}

#[test]
fn a_plan_set_while_an_envoy_holds_leased_tokens_applies_once_they_are_spent() {
    let stack = Stack::start(&leased_config(), 1);
    let dir = Scratch::new("leased-plan-change");
    let config_path = dir.0.join("filter.json");
    std::fs::write(&config_path, leased_config()).unwrap();
    let e = stack.envoy();
    let agent = agent();
    let carol = || {
        http_with(
            &agent,
            "GET",
            &e.url("/api/x"),
            &[("x-api-key", "carol")],
            None,
        )
    };
    let spent = || e.counter("redis_guard.lease.spent");
    let returned = || e.counter("redis_guard.lease.returned");

    // Without a plan: the request and a batch of 4 leave the bucket (15
    // left in Redis), the 4 held by this Envoy.
    assert_eq!(carol().status, 200);
    assert_eq!(e.counter("redis_guard.lease.fetches"), 1);
    // Downgraded to 2 while the Envoy holds them.
    let which = ["--limit", "leased", "--value", "x-api-key=carol"];
    let set = ["override", "set", "--capacity", "2", "--refill", "2"];
    let bin = env!("CARGO_BIN_EXE_redis-guard");
    cli_json(bin, &stack, &config_path, &[&set[..], &which[..]].concat());
    let (spent0, returned0) = (spent(), returned());
    let mut admitted = 0;
    let mut refused = None;
    for _ in 0..20 {
        let r = carol();
        if r.status != 200 {
            refused = Some(r);
            break;
        }
        admitted += 1;
    }
    let refused = refused.expect("refused within 20");
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("x-ratelimit-limit"), Some("2"));
    // The held tokens, spent under the numbers they were granted under (or
    // given back, to nothing: a key with a plan takes none back), then
    // exactly the plan's 2, decided in Redis.
    let (held_spent, held_back) = (spent() - spent0, returned() - returned0);
    assert_eq!(held_spent + held_back, 4, "the 4 held");
    assert_eq!(admitted, held_spent + 2);
    assert_eq!(stack.upstream.executed(), 1 + admitted);
}
