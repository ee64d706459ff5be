//! The book's *Recipes* (docs/src/using/recipes.md), each the file in envoy/recipes/ it quotes, through
//! real Envoys, Redis and Webdis: payment throttling with declines counted
//! and blocked, partner webhooks per mTLS identity counting only the
//! receiver's failures, and a public API's free and paid tiers by JWT claim
//! with overrides (stored ones set by the CLI, carried ones in a claim). The
//! login recipe has its own file (e2e_login). Built with the `cli` feature
//! (its binary sets an override).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::identity::{Issuer, Pki};
use support::probe::poll;
use support::*;

#[test]
fn every_recipe_parses_and_the_book_quotes_each_verbatim() {
    let readme = std::fs::read_to_string(root().join("docs/src/using/recipes.md")).unwrap();
    for name in ["login", "payments", "webhooks", "tiers", "quota", "llm"] {
        let config = filter_config(1000).recipe(name).build();
        redis_guard::config::Config::parse(config.as_bytes())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let text =
            std::fs::read_to_string(root().join(format!("envoy/recipes/{name}.json"))).unwrap();
        assert!(
            readme.contains(text.trim_end()),
            "the book's Recipes (docs/src/using/recipes.md) must quote envoy/recipes/{name}.json as it is"
        );
    }
}

// ---------------------------------------------------------------------------
// Payment throttling

/// A payment for `customer` with idempotency key `key`; the upstream's
/// answer is `status` (402: declined).
fn pay(agent: &ureq::Agent, envoy: &Envoy, customer: &str, key: &str, status: &str) -> Resp {
    let headers = [
        ("x-customer-id", customer),
        ("idempotency-key", key),
        ("x-upstream-status", status),
    ];
    http_with(
        agent,
        "POST",
        &envoy.url("/v1/payments"),
        &headers,
        Some(b"{\"amount\":100}"),
    )
}

#[test]
fn declined_payments_block_the_customer_and_a_retried_payment_runs_once() {
    let stack = Stack::start(&filter_config(1000).recipe("payments").build(), 2);
    let agent = agent();
    // The declines count in hour-long fixed windows: all of them in one.
    inside_one_window(&mut stack.redis.conn(), 3_600_000, 60_000);
    // Three declines (card testing) across both Envoys: each ran.
    for i in 0..3 {
        let r = pay(
            &agent,
            &stack.envoys[i % 2],
            "mallory",
            &format!("k{i}"),
            "402",
        );
        assert_eq!(r.status, 402);
    }
    // The third decline's settlement found the window exhausted and started
    // the block (the settlement runs after the stream: wait for it). The
    // fourth attempt is refused, and even a good card waits.
    let mut con = stack.redis.conn();
    poll("mallory's block", std::time::Duration::from_secs(5), || {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("rg:bl:*declines-per-customer*mallory")
            .query(&mut con)
            .unwrap();
        (keys.len() == 1).then_some(())
    });
    for (i, status) in ["402", "200"].iter().enumerate() {
        let r = pay(
            &agent,
            &stack.envoys[i % 2],
            "mallory",
            &format!("k{}", 3 + i),
            status,
        );
        assert_eq!(r.status, 429);
        let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
        assert!(retry > 3500 && retry <= 3600, "Retry-After {retry}");
    }
    assert_eq!(stack.upstream.executions_of("/v1/payments"), 3);

    // The operator's view: `inspect` shows the block, `reset` lifts it (and
    // the declines counted), and the customer pays again.
    let dir = Scratch::new("payments");
    let config_path = dir.0.join("filter.json");
    std::fs::write(&config_path, filter_config(1000).recipe("payments").build()).unwrap();
    let cli = |args: &[&str]| {
        let which = [
            "--limit",
            "declines-per-customer",
            "--value",
            "x-customer-id=mallory",
        ];
        let args = [args, &which[..]].concat();
        cli_json(
            env!("CARGO_BIN_EXE_redis-guard"),
            &stack,
            &config_path,
            &args,
        )
    };
    let seen = cli(&["inspect"]);
    assert_eq!(seen["allowed"], false);
    let blocked = seen["blockedMs"].as_i64().unwrap();
    assert!(blocked > 3_500_000 && blocked <= 3_600_000, "{seen}");
    let reset = cli(&["reset", "--yes"]);
    assert_eq!(
        (&reset["deleted"], &reset["unblocked"]),
        (&true.into(), &true.into())
    );
    assert_eq!(cli(&["inspect"])["blockedMs"], serde_json::Value::Null);
    // (An Envoy's over-limit cache may answer for Redis up to a second.)
    poll(
        "mallory pays again",
        std::time::Duration::from_secs(5),
        || {
            let r = pay(&agent, stack.envoy(), "mallory", "k-after-reset", "200");
            (r.status == 200).then_some(())
        },
    );
    assert_eq!(stack.upstream.executions_of("/v1/payments"), 4);

    // An honest customer's retry of one payment is a replay, not a second
    // charge; successes never count as declines.
    let first = pay(&agent, stack.envoy(), "alice", "order-1", "200");
    assert_eq!(first.status, 200);
    let retry = pay(&agent, &stack.envoys[1], "alice", "order-1", "200");
    assert_eq!((retry.status, retry.body), (200, first.body));
    for i in 0..5 {
        assert_eq!(
            pay(&agent, stack.envoy(), "alice", &format!("o{i}"), "200").status,
            200
        );
    }
    assert_eq!(stack.upstream.executions_of("/v1/payments"), 4 + 1 + 5);
    // A payment without a key is refused before it runs.
    let headers = [("x-customer-id", "alice")];
    let r = http_with(
        &agent,
        "POST",
        &stack.envoy().url("/v1/payments"),
        &headers,
        Some(b"{}"),
    );
    assert_eq!(r.status, 400);
}

// ---------------------------------------------------------------------------
// Partner webhooks per mTLS identity

#[test]
fn a_partners_webhooks_are_throttled_only_while_the_receiver_fails_them() {
    // Two names for the failing partner: the second only if the first's
    // requests straddle a window's edge (below).
    let partners = ["acme", "acme-again"];
    let pki = Pki::new();
    for name in partners.iter().chain(&["globex"]) {
        pki.client(name, &format!("spiffe://partners.example/{name}"));
    }
    let cfg = filter_config(1000).recipe("webhooks").build();
    let stack = Stack::start_edited(&cfg, 1, |y| pki.listener(y));
    let port = stack.envoy().port;
    let failing = [("x-upstream-status", "503")];
    // Failures count in a sliding-window counter whose windows (aligned on
    // Redis' clock) weigh the one before: five failures and two refusals
    // are exact only inside one window. Redis' clock says whether the seven
    // requests were (its TIME before the first and after the last): if they
    // straddled an edge (slower than the window's time left: a loaded
    // machine), the second name sends them again from just after that edge,
    // with the whole window ahead. No room to wait for, no speed assumed.
    let recipe: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("envoy/recipes/webhooks.json")).unwrap(),
    )
    .unwrap();
    let window = recipe["limits"][1]["slidingWindowCounter"]["windowMs"]
        .as_i64()
        .unwrap();
    let mut con = stack.redis.conn();
    let mut executed = 0;
    let mut inside = None;
    for partner in partners {
        let t0 = redis_now_ms(&mut con);
        // Our receiver fails the partner's deliveries: five failures, then
        // its retries are refused before they reach it.
        let codes: Vec<u16> = (0..7)
            .map(|_| pki.get_with(port, "/webhooks/orders", Some(partner), &failing))
            .collect();
        let t1 = redis_now_ms(&mut con);
        executed += codes.iter().filter(|c| **c != 429).count();
        if t0 / window == t1 / window {
            inside = Some(codes);
            break;
        }
        eprintln!("{partner}'s requests straddled a window's edge (TIME {t0}..{t1}): {codes:?}");
    }
    let codes = inside.expect("each name's seven requests took longer than a window");
    assert_eq!(codes, [503, 503, 503, 503, 503, 429, 429]);
    // globex's deliveries succeed: never counted as failures.
    for _ in 0..20 {
        assert_eq!(
            pki.get_with(port, "/webhooks/orders", Some("globex"), &[]),
            200
        );
    }
    assert_eq!(
        stack.upstream.executions_of("/webhooks/orders") as usize,
        executed + 20
    );
}

// ---------------------------------------------------------------------------
// A public API's free and paid tiers

/// The JWT part of the tiers recipe, for the CLI: a metadata path after its
/// namespace.
fn set_override(stack: &Stack, config: &std::path::Path, sub: &str, capacity: &str) {
    let value = format!("payload.sub={sub}");
    let args = [
        "override",
        "set",
        "--limit",
        "free-tier",
        "--value",
        &value,
        "--capacity",
        capacity,
        "--refill",
        capacity,
    ];
    cli_json(env!("CARGO_BIN_EXE_redis-guard"), stack, config, &args);
}

/// Requests with `token`, alternating Envoys, until the first 429
/// (bounded): how many were admitted.
fn admitted(stack: &Stack, token: &str, most: usize) -> usize {
    let auth = format!("Bearer {token}");
    admitted_until_429(
        &stack.envoys,
        "/v1/things",
        &[("authorization", &auth)],
        most,
    )
}

#[test]
fn free_and_paid_tiers_follow_the_plan_claim_and_overrides_follow_the_customer() {
    let issuer = Issuer::new();
    let cfg = filter_config(1000).recipe("tiers").build();
    let stack = Stack::start_edited(&cfg, 2, |y| issuer.trusted_by(y));
    let dir = Scratch::new("tiers");
    let config_path = dir.0.join("filter.json");
    std::fs::write(&config_path, &cfg).unwrap();
    let token = |claims: serde_json::Value| issuer.token(claims);

    // Free (no plan claim): 100 an hour per subject, exactly, over both.
    assert_eq!(
        admitted(&stack, &token(serde_json::json!({"sub": "sam"})), 150),
        100
    );
    // A free customer with a stored override: its own 200, from the first
    // request on, on both Envoys.
    set_override(&stack, &config_path, "ann", "200");
    assert_eq!(
        admitted(&stack, &token(serde_json::json!({"sub": "ann"})), 250),
        200
    );
    // Paid, with a quota in its token: that quota.
    let pat = token(serde_json::json!({"sub": "pat", "plan": "pro", "quota": 7}));
    assert_eq!(admitted(&stack, &pat, 20), 7);
    // Paid without one: the paid tier, stated in the headers.
    let paula = token(serde_json::json!({"sub": "paula", "plan": "enterprise"}));
    let r = get(
        &stack.envoy().url("/v1/things"),
        &[("authorization", &format!("Bearer {paula}"))],
    );
    assert_eq!(
        (r.status, r.header("x-ratelimit-limit")),
        (200, Some("10000"))
    );
    // A revoked token is refused before any limit.
    let revoked = token(serde_json::json!({"sub": "eve", "jti": "revoked-1"}));
    let r = get(
        &stack.envoy().url("/v1/things"),
        &[("authorization", &format!("Bearer {revoked}"))],
    );
    assert_eq!(r.status, 403);
    assert_eq!(
        stack.counter("redis_guard.ratelimit.free-tier.override_applied"),
        201,
        "every decision of ann's, her 429 included"
    );
}
