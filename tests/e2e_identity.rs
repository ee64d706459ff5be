//! Limits keyed on who the caller is, end to end through a real Envoy: a
//! query parameter (its first value, percent-decoded once) and the client's
//! network prefix (addresses of one /24 share a budget). Requests come from
//! chosen loopback sources (Linux routes all of 127.0.0.0/8 to lo).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::identity::{Issuer, Pki};
use support::*;

/// A window no run crosses the edge of: 2^40 ms, aligned to the Unix epoch
/// (the current one ends in 2039). An hour-long window would reset at the
/// top of the hour in the middle of a test about once in a hundred runs.
const LONG_WINDOW_MS: u64 = 1 << 40;

/// 2 per window per `api_key` on /q/, 3 per client /24 on /n/.
fn config() -> String {
    filter_config(1000)
        .limits(&format!(
            r#"[{{"name":"per-key","match":{{"pathPrefix":"/q/"}},"descriptor":[{{"query":"api_key"}}],
                 "fixedWindow":{{"limit":2,"windowMs":{LONG_WINDOW_MS}}}}},
                {{"name":"per-net","match":{{"pathPrefix":"/n/"}},"descriptor":[{{"clientPrefix":{{"ipv4":24}}}}],
                 "fixedWindow":{{"limit":3,"windowMs":{LONG_WINDOW_MS}}}}}]"#
        ))
        .build()
}

#[test]
fn a_query_parameter_budget_is_per_decoded_first_value_and_absent_means_unlimited() {
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    let status = |path: &str| get(&e.url(path), &[]).status;
    assert_eq!(status("/q/a?api_key=a%20b"), 200);
    // The same key: decoded, first of two, among other parameters.
    assert_eq!(status("/q/b?x=1&api_key=a%20b&api_key=zzz"), 200);
    assert_eq!(status("/q/a?api_key=a%20b"), 429);
    // Other keys: `+` is not a space; %2520 decodes once, to %20.
    assert_eq!(status("/q/a?api_key=a+b"), 200);
    assert_eq!(status("/q/a?api_key=a%2520b"), 200);
    assert_eq!(status("/q/a?api_key=zzz"), 200);
    // Without the parameter the limit does not apply.
    for _ in 0..5 {
        assert_eq!(status("/q/a?other=1"), 200);
    }
    assert_eq!(stack.upstream.executed(), 2 + 3 + 5);
}

#[test]
fn addresses_in_one_ipv4_prefix_share_a_budget_and_other_prefixes_have_their_own() {
    let stack = Stack::start(&config(), 1);
    let port = stack.envoy().port;
    let status_from = |source: &str| get_from(source, port, "/n/x", &[]).0;
    // 127.0.0.2 and 127.0.0.3 are one /24: three between them.
    assert_eq!(status_from("127.0.0.2"), 200);
    assert_eq!(status_from("127.0.0.2"), 200);
    assert_eq!(status_from("127.0.0.3"), 200);
    assert_eq!(status_from("127.0.0.3"), 429);
    assert_eq!(status_from("127.0.0.2"), 429);
    // 127.0.1.2 is another /24, with its own three.
    for _ in 0..3 {
        assert_eq!(status_from("127.0.1.2"), 200);
    }
    assert_eq!(status_from("127.0.1.2"), 429);
    assert_eq!(stack.upstream.executed(), 6);
}

// ---------------------------------------------------------------------------
// JWT claims: Envoy's jwt_authn in front of the filter

/// The JWT part: `claim` of the payload jwt_authn verified.
fn claim(name: &str, ty: &str) -> String {
    format!(
        r#"{{"metadata":{{"namespace":"envoy.filters.http.jwt_authn","path":["payload","{name}"],"type":"{ty}"}}}}"#
    )
}

/// 3 per window per JWT `sub` on /jwt/, 2 per numeric `org_id` on /org/, one
/// keyed on a list claim (never a valid string) on /roles/; on /plan/, 1
/// per `sub` whose `plan` claim is `free` and 2 for all subjects named
/// `svc-<digits>` together; idempotency on /pay/ with the `sub` as tenant.
fn jwt_config() -> String {
    filter_config(1000)
        .limits(&format!(
            r#"[{{"name":"per-sub","match":{{"pathPrefix":"/jwt/"}},"descriptor":[{sub}],
                  "fixedWindow":{{"limit":3,"windowMs":{LONG_WINDOW_MS}}}}},
                {{"name":"per-org","match":{{"pathPrefix":"/org/"}},"descriptor":[{org}],
                  "fixedWindow":{{"limit":2,"windowMs":{LONG_WINDOW_MS}}}}},
                {{"name":"per-roles","match":{{"pathPrefix":"/roles/"}},"descriptor":[{roles}],
                  "fixedWindow":{{"limit":1,"windowMs":{LONG_WINDOW_MS}}}}},
                {{"name":"free-plan","match":{{"pathPrefix":"/plan/","values":[{{"part":{plan},"exact":"free"}}]}},
                  "descriptor":[{sub}],"fixedWindow":{{"limit":1,"windowMs":{LONG_WINDOW_MS}}}}},
                {{"name":"services","match":{{"pathPrefix":"/plan/","values":[{{"part":{sub},"regex":"svc-[0-9]+"}}]}},
                  "fixedWindow":{{"limit":2,"windowMs":{LONG_WINDOW_MS}}}}}]"#,
            sub = claim("sub", "string"),
            plan = claim("plan", "string"),
            org = claim("org_id", "number"),
            roles = claim("roles", "string"),
        ))
        .idempotency(&format!(
            r#"[{{"name":"pay","match":{{"pathPrefix":"/pay/"}},"tenant":[{}]}}]"#,
            claim("sub", "string")
        ))
        .build()
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

#[test]
fn per_subject_budgets_are_exact_across_two_envoys_and_unverified_tokens_never_reach_redis() {
    let issuer = Issuer::new();
    let stack = Stack::start_edited(&jwt_config(), 2, |y| issuer.trusted_by(y));
    let (a, b) = (&stack.envoys[0], &stack.envoys[1]);
    let alice = bearer(&issuer.token(serde_json::json!({"sub": "alice"})));
    let bob = bearer(&issuer.token(serde_json::json!({"sub": "bob"})));
    let status = |e: &Envoy, auth: &str| get(&e.url("/jwt/x"), &[("authorization", auth)]).status;
    // Three each, whichever Envoy; the fourth is refused on both.
    let alices: Vec<u16> = [a, b, a, b, a].iter().map(|e| status(e, &alice)).collect();
    assert_eq!(alices, [200, 200, 200, 429, 429]);
    let bobs: Vec<u16> = [b, b, a, a].iter().map(|e| status(e, &bob)).collect();
    assert_eq!(bobs, [200, 200, 200, 429]);
    let calls = stack.counter("redis_guard.redis.calls");
    // jwt_authn refuses a bad signature and an expired token before the
    // filter runs: no call to Redis.
    let forged = {
        // A signature character well inside (the last one carries padding
        // bits a decoder may ignore).
        let mut t = issuer
            .token(serde_json::json!({"sub": "alice"}))
            .into_bytes();
        let i = t.len() - 10;
        t[i] = if t[i] == b'A' { b'B' } else { b'A' };
        bearer(&String::from_utf8(t).unwrap())
    };
    let expired = bearer(&issuer.token(serde_json::json!({"sub": "carol", "exp": 1_000_000_000})));
    for auth in [&forged, &expired] {
        assert_eq!(status(a, auth), 401, "{auth}");
    }
    assert_eq!(stack.counter("redis_guard.redis.calls"), calls);
    // No token, or a token without `sub`: the limit does not apply.
    let anonymous = bearer(&issuer.token(serde_json::json!({"scope": "read"})));
    for _ in 0..4 {
        assert_eq!(get(&a.url("/jwt/x"), &[]).status, 200);
        assert_eq!(status(b, &anonymous), 200);
    }
    assert_eq!(stack.counter("redis_guard.redis.calls"), calls);
    assert_eq!(stack.upstream.executed(), 3 + 3 + 8);
}

#[test]
fn a_numeric_claim_keys_in_decimal_and_a_list_claim_is_counted_and_does_not_apply() {
    let issuer = Issuer::new();
    let stack = Stack::start_edited(&jwt_config(), 1, |y| issuer.trusted_by(y));
    let e = stack.envoy();
    let token = bearer(&issuer.token(serde_json::json!({
        "sub": "dave", "org_id": 42, "roles": ["admin", "dev"]
    })));
    let status = |path: &str| get(&e.url(path), &[("authorization", &token)]).status;
    assert_eq!(
        [status("/org/a"), status("/org/a"), status("/org/a")],
        [200, 200, 429]
    );
    let mut con = stack.redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:per-org:*")
        .query(&mut con)
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys[0].ends_with(":2:42"), "the claim 42 as text: {keys:?}");
    // A list where a string is configured: the limit does not apply.
    for _ in 0..3 {
        assert_eq!(status("/roles/a"), 200);
    }
    assert_eq!(stack.counter("redis_guard.descriptor.invalid"), 3);
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:per-roles:*")
        .query(&mut con)
        .unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

#[test]
fn an_idempotency_tenant_on_the_subject_keeps_two_users_identical_keys_apart() {
    let issuer = Issuer::new();
    let stack = Stack::start_edited(&jwt_config(), 1, |y| issuer.trusted_by(y));
    let e = stack.envoy();
    let pay = |auth: Option<&str>| {
        let mut headers = vec![("idempotency-key", "k-1")];
        if let Some(auth) = auth {
            headers.push(("authorization", auth));
        }
        http("POST", &e.url("/pay/1"), &headers, Some(b"{\"amount\":10}"))
    };
    let alice = bearer(&issuer.token(serde_json::json!({"sub": "alice"})));
    let bob = bearer(&issuer.token(serde_json::json!({"sub": "bob"})));
    let first = pay(Some(&alice));
    assert_eq!(
        (first.status, first.header("idempotent-replayed")),
        (200, None)
    );
    let other = pay(Some(&bob));
    assert_eq!(
        (other.status, other.header("idempotent-replayed")),
        (200, None)
    );
    let again = pay(Some(&alice));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(stack.upstream.executed(), 2, "once per user");
    // Without a token there is no tenant: refused, not shared.
    assert_eq!(pay(None).status, 400);
    assert_eq!(stack.upstream.executed(), 2);
}

#[test]
fn a_limit_applies_by_claim_value_exactly_or_by_a_whole_value_regex() {
    let issuer = Issuer::new();
    let stack = Stack::start_edited(&jwt_config(), 1, |y| issuer.trusted_by(y));
    let e = stack.envoy();
    let statuses = |claims: serde_json::Value, n: usize| -> Vec<u16> {
        let auth = bearer(&issuer.token(claims));
        (0..n)
            .map(|_| get(&e.url("/plan/x"), &[("authorization", &auth)]).status)
            .collect()
    };
    // The free plan: one each; other plans are not limited here.
    let free = serde_json::json!({"sub": "ann", "plan": "free"});
    assert_eq!(statuses(free, 2), [200, 429]);
    let free = serde_json::json!({"sub": "ben", "plan": "free"});
    assert_eq!(statuses(free, 2), [200, 429]);
    let pro = serde_json::json!({"sub": "cat", "plan": "pro"});
    assert_eq!(statuses(pro, 3), [200, 200, 200]);
    let freedom = serde_json::json!({"sub": "dan", "plan": "freedom"});
    assert_eq!(statuses(freedom, 3), [200, 200, 200], "exact, not a prefix");
    // svc-12 and svc-7 share two; names the regex does not cover whole
    // are not limited.
    assert_eq!(statuses(serde_json::json!({"sub": "svc-12"}), 1), [200]);
    assert_eq!(statuses(serde_json::json!({"sub": "svc-7"}), 2), [200, 429]);
    for sub in ["svc-x", "my-svc-1", "svc-1a"] {
        assert_eq!(
            statuses(serde_json::json!({"sub": sub}), 3),
            [200, 200, 200],
            "{sub}"
        );
    }
    assert_eq!(stack.upstream.executed(), 2 + 3 + 3 + 2 + 9);
}

#[test]
fn addresses_in_one_ipv6_prefix_share_a_budget_and_other_prefixes_have_their_own() {
    let cfg = filter_config(1000)
        .limits(
            &format!(r#"[{{"name":"per-net","match":{{"pathPrefix":"/n/"}},"descriptor":[{{"clientPrefix":{{"ipv6":56}}}}],
                 "fixedWindow":{{"limit":3,"windowMs":{LONG_WINDOW_MS}}}}}]"#),
        )
        .build();
    let stack = Stack::start_edited(&cfg, 1, behind_one_proxy);
    let e = stack.envoy();
    let from = |client: &str| get(&e.url("/n/x"), &[("x-forwarded-for", client)]).status;
    // 2001:db8:1:2ff:: and 2001:db8:1:2aa:: are both in 2001:db8:1:200::/56.
    assert_eq!(
        [
            from("2001:db8:1:2ff::1"),
            from("2001:db8:1:2aa::9"),
            from("2001:db8:1:2ff:ffff::2"),
            from("2001:db8:1:2aa::9"),
        ],
        [200, 200, 200, 429]
    );
    // 2001:db8:1:300::/56 is another network.
    for _ in 0..3 {
        assert_eq!(from("2001:db8:1:300::1"), 200);
    }
    assert_eq!(from("2001:db8:1:3ff::5"), 429);
    let mut con = stack.redis.conn();
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:per-net:*")
        .query(&mut con)
        .unwrap();
    keys.sort();
    assert!(
        keys.len() == 2
            && keys[0].ends_with(":2001:db8:1:200::/56")
            && keys[1].ends_with(":2001:db8:1:300::/56"),
        "{keys:?}"
    );
    assert_eq!(stack.upstream.executed(), 6);
}

#[test]
fn a_claim_in_a_limits_unless_exempts_its_holder_without_a_redis_call() {
    let issuer = Issuer::new();
    let cfg = filter_config(1000)
        .limits(&format!(
            r#"[{{"name":"per-sub","match":{{"pathPrefix":"/jwt/"}},"descriptor":[{sub}],
                  "unless":{{"values":[{{"part":{plan},"oneOf":["enterprise","internal"]}}]}},
                  "fixedWindow":{{"limit":1,"windowMs":{LONG_WINDOW_MS}}}}}]"#,
            sub = claim("sub", "string"),
            plan = claim("plan", "string"),
        ))
        .build();
    let stack = Stack::start_edited(&cfg, 1, |y| issuer.trusted_by(y));
    let url = stack.envoy().url("/jwt/x");
    let token = |claims| bearer(&issuer.token(claims));
    let free = token(serde_json::json!({"sub": "ann", "plan": "free"}));
    let codes: Vec<u16> = (0..2)
        .map(|_| get(&url, &[("authorization", &free)]).status)
        .collect();
    assert_eq!(codes, [200, 429]);
    let calls = stack.counter("redis_guard.redis.calls");
    // The same subject with an enterprise token: exempt, no call at all.
    let enterprise = token(serde_json::json!({"sub": "ann", "plan": "enterprise"}));
    for _ in 0..5 {
        assert_eq!(get(&url, &[("authorization", &enterprise)]).status, 200);
    }
    assert_eq!(stack.counter("redis_guard.redis.calls"), calls);
    assert_eq!(stack.counter("redis_guard.ratelimit.per-sub.exempt"), 5);
}

// ---------------------------------------------------------------------------
// mTLS: the peer certificate's URI SAN

#[test]
fn per_principal_budgets_follow_the_mtls_peers_uri_san() {
    let pki = Pki::new();
    pki.client("alice", "spiffe://cluster.local/ns/shop/sa/alice");
    pki.client("bob", "spiffe://cluster.local/ns/shop/sa/bob");
    let cfg = filter_config(1000)
        .limits(
            &format!(r#"[{{"name":"per-peer","descriptor":[{{"attribute":"connection.uri_san_peer_certificate"}}],
                 "fixedWindow":{{"limit":2,"windowMs":{LONG_WINDOW_MS}}}}}]"#),
        )
        .build();
    let stack = Stack::start_edited(&cfg, 1, |y| pki.listener(y));
    let port = stack.envoy().port;
    let alice: Vec<u16> = (0..3)
        .map(|_| pki.get(port, "/m/x", Some("alice")))
        .collect();
    assert_eq!(alice, [200, 200, 429]);
    let bob: Vec<u16> = (0..3).map(|_| pki.get(port, "/m/x", Some("bob"))).collect();
    assert_eq!(bob, [200, 200, 429]);
    // No certificate: the handshake fails, nothing reaches the filter.
    assert_eq!(pki.get(port, "/m/x", None), 0);
    let mut con = stack.redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:per-peer:*")
        .query(&mut con)
        .unwrap();
    let mut peers: Vec<&str> = keys
        .iter()
        .filter_map(|k| k.split_once(":spiffe://"))
        .map(|(_, peer)| peer)
        .collect();
    peers.sort_unstable();
    assert_eq!(
        peers,
        [
            "cluster.local/ns/shop/sa/alice",
            "cluster.local/ns/shop/sa/bob"
        ],
        "{keys:?}"
    );
    assert_eq!(stack.upstream.executed(), 4);
}

// ---------------------------------------------------------------------------
// Route metadata, as an attribute

#[test]
fn a_limit_keyed_on_route_metadata_reads_the_matched_routes_value() {
    // Two routes tagged with a tier in their metadata; one budget per tier.
    let cfg = filter_config(1000)
        .limits(
            &format!(r#"[{{"name":"per-tier","descriptor":[{{"attribute":"xds.route_metadata.filter_metadata.redis_guard.tier"}}],
                 "fixedWindow":{{"limit":2,"windowMs":{LONG_WINDOW_MS}}}}}]"#),
        )
        .build();
    let tiered = |yaml: String| {
        let anchor = "              - match: { prefix: \"/\" }\n                route:";
        assert_eq!(yaml.matches(anchor).count(), 1);
        let gold = "              - match: { prefix: \"/gold/\" }\n                \
             metadata: { filter_metadata: { redis_guard: { tier: gold } } }\n                \
             route: { cluster: upstream, timeout: 10s }\n";
        let free = "              - match: { prefix: \"/free/\" }\n                \
             metadata: { filter_metadata: { redis_guard: { tier: free } } }\n                \
             route: { cluster: upstream, timeout: 10s }\n";
        yaml.replace(anchor, &format!("{gold}{free}{anchor}"))
    };
    let stack = Stack::start_edited(&cfg, 1, tiered);
    let e = stack.envoy();
    let status = |path: &str| get(&e.url(path), &[]).status;
    // /gold/a and /gold/b are one route: one budget.
    assert_eq!(
        [status("/gold/a"), status("/gold/b"), status("/gold/a")],
        [200, 200, 429]
    );
    assert_eq!(
        [status("/free/a"), status("/free/a"), status("/free/a")],
        [200, 200, 429]
    );
    // The catch-all route has no tier: the limit does not apply.
    for _ in 0..3 {
        assert_eq!(status("/other"), 200);
    }
    let mut con = stack.redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:per-tier:*")
        .query(&mut con)
        .unwrap();
    let mut tiers: Vec<&str> = keys.iter().filter_map(|k| k.rsplit(':').next()).collect();
    tiers.sort_unstable();
    assert_eq!(tiers, ["free", "gold"], "{keys:?}");
    assert_eq!(stack.upstream.executed(), 2 + 2 + 3);
}

#[test]
fn the_shipped_envoy_verifies_bearer_tokens_only_where_a_limit_reads_their_claims() {
    // envoy/envoy.yaml as the demo and compose run it: jwt_authn covers
    // /v1/me only, so an API key sent as a bearer elsewhere is no 401.
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    let api_key = [("authorization", "Bearer sk-not-a-jwt")];
    assert_eq!(get(&e.url("/q/a?api_key=k"), &api_key).status, 200);
    assert_eq!(get(&e.url("/v1/me"), &api_key).status, 401);
    assert_eq!(get(&e.url("/v1/me"), &[]).status, 200, "no token: passes");
    assert_eq!(stack.upstream.executed(), 2);
}
