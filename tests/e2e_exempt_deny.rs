//! Exemptions and deny lists through a real Envoy: a limit's `unless`
//! (trusted client networks, a header a trusted filter sets) skips the limit
//! without a Redis call; a deny rule (client networks, revoked keys) answers
//! `403` before any limit, and the upstream never sees the request. Requests
//! come from chosen loopback sources (Linux routes 127.0.0.0/8 to lo).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::*;

/// A window no run crosses the edge of (2^40 ms, epoch-aligned).
const LONG_WINDOW_MS: u64 = 1 << 40;

fn config() -> String {
    filter_config(1000)
        .field(
            "deny",
            r#"[{"name": "bad-nets", "match": {"clientNetworks": ["127.0.9.0/24", "2001:db8:bad::/48"]}},
                {"name": "revoked", "match": {"headers": [{"name": "x-api-key", "oneOf": ["k-leaked", "k-old"]}]}}]"#,
        )
        .limits(&format!(
            r#"[{{"name": "per-key", "match": {{"pathPrefix": "/api/"}},
                  "unless": {{"clientNetworks": ["127.0.5.0/24", "::1"]}},
                  "descriptor": [{{"header": "x-api-key"}}],
                  "fixedWindow": {{"limit": 3, "windowMs": {LONG_WINDOW_MS}}}}},
                 {{"name": "per-plan", "match": {{"pathPrefix": "/api/"}},
                  "unless": {{"headers": [{{"name": "x-plan", "oneOf": ["enterprise", "internal"]}}]}},
                  "descriptor": [{{"header": "x-api-key"}}],
                  "fixedWindow": {{"limit": 1000, "windowMs": {LONG_WINDOW_MS}}}}}]"#
        ))
        .build()
}

#[test]
fn exempt_clients_skip_the_limit_without_a_redis_call_and_denied_ones_never_reach_the_upstream() {
    let stack = Stack::start(&config(), 1);
    let port = stack.envoy().port;
    let key: &[(&str, &[u8])] = &[("x-api-key", b"k1")];

    // An ordinary client spends the key's three, one script call each.
    let codes: Vec<u16> = (0..4)
        .map(|_| get_from("127.0.0.2", port, "/api/x", key).0)
        .collect();
    assert_eq!(codes, [200, 200, 200, 429]);
    // (Four decisions; the first also loaded the script: EVALSHA, then EVAL.)
    let calls = scripts_run(&stack.redis);
    assert_eq!(calls, 4 + stack.counter("redis_guard.redis.script_reloads"));

    // From the trusted network the same key is not limited by `per-key`;
    // `per-plan` still applies, so each request is one call deciding it.
    for _ in 0..5 {
        assert_eq!(get_from("127.0.5.7", port, "/api/x", key).0, 200);
    }
    assert_eq!(scripts_run(&stack.redis), calls + 5);
    assert_eq!(stack.counter("redis_guard.ratelimit.per-key.exempt"), 5);

    // Trusted network and an exempt plan: no limit applies, no Redis call.
    let enterprise: &[(&str, &[u8])] = &[("x-api-key", b"k1"), ("x-plan", b"enterprise")];
    for _ in 0..10 {
        assert_eq!(get_from("127.0.5.8", port, "/api/x", enterprise).0, 200);
    }
    assert_eq!(scripts_run(&stack.redis), calls + 5, "exempt: no call");
    assert_eq!(stack.counter("redis_guard.ratelimit.per-key.exempt"), 15);
    assert_eq!(stack.counter("redis_guard.ratelimit.per-plan.exempt"), 10);
    // The plan exemption alone leaves `per-key`, spent: still 429.
    assert_eq!(get_from("127.0.0.2", port, "/api/x", enterprise).0, 429);
    let executed = stack.upstream.executed();
    assert_eq!(executed, 3 + 5 + 10);
    let calls = scripts_run(&stack.redis);

    // Denied networks and revoked keys: 403 before any limit or call, even
    // when exempt from every limit; nothing reaches the upstream.
    for headers in [key, enterprise] {
        let (status, body) = get_from("127.0.9.3", port, "/api/x", headers);
        assert_eq!(status, 403);
        let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(doc["rule"], "bad-nets");
    }
    for revoked in [&b"k-leaked"[..], b"k-old"] {
        let (status, body) = get_from("127.0.5.7", port, "/api/x", &[("x-api-key", revoked)]);
        assert_eq!(status, 403);
        let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(doc["rule"], "revoked");
    }
    // Outside the deny rules: served as before (a fresh key, its own three).
    assert_eq!(
        get_from("127.0.8.1", port, "/api/x", &[("x-api-key", b"k2")]).0,
        200
    );
    assert_eq!(stack.counter("redis_guard.denied"), 4);
    assert_eq!(stack.upstream.executed(), executed + 1);
    assert_eq!(scripts_run(&stack.redis), calls + 1);
}

#[test]
fn ipv6_client_networks_exempt_and_deny_as_ipv4_ones_do() {
    // Behind one trusted proxy, the address it appended is the client's
    // (how IPv6 clients reach these tests over loopback).
    let stack = Stack::start_edited(&config(), 1, behind_one_proxy);
    let url = stack.envoy().url("/api/x");
    let from = |client: &str, key: &str| {
        get(&url, &[("x-forwarded-for", client), ("x-api-key", key)]).status
    };
    // Denied: 2001:db8:bad::/48, however the address is written.
    for client in [
        "2001:db8:bad::1",
        "2001:db8:bad:ffff::9",
        "2001:DB8:BAD:0:0:0:0:2",
    ] {
        assert_eq!(from(client, "k1"), 403, "{client}");
    }
    // Another network's clients share k1's three.
    let codes: Vec<u16> = (0..4).map(|_| from("2001:db8:bee::1", "k1")).collect();
    assert_eq!(codes, [200, 200, 200, 429]);
    let calls = scripts_run(&stack.redis);
    // ::1 is exempt from `per-key` (its own /128): `per-plan` still decides.
    for _ in 0..3 {
        assert_eq!(from("::1", "k1"), 200);
    }
    assert_eq!(scripts_run(&stack.redis), calls + 3);
    assert_eq!(stack.counter("redis_guard.ratelimit.per-key.exempt"), 3);
    assert_eq!(stack.counter("redis_guard.denied"), 3);
    assert_eq!(stack.upstream.executed(), 3 + 3);
}
