//! The access log through a real Envoy (envoy/envoy.yaml's JSON access log
//! on stdout): every kind of answer the filter gives has its own response
//! code details, and every request it acted on carries its record
//! (`%FILTER_STATE(wasm.redis_guard:PLAIN)%`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::{Duration, Instant};

use serde_json::Value;
use support::*;

/// Two per x-user on /api; an idempotency rule on /pay (tenant x-tenant);
/// fail closed.
fn config() -> String {
    filter_config(1000)
        .limits(
            r#"[{"name":"per-user","match":{"pathPrefix":"/api"},"descriptor":[{"header":"x-user"}],
                 "tokenBucket":{"capacity":2,"refill":1,"periodMs":3600000}}]"#,
        )
        .idempotency(
            r#"[{"name":"pay","match":{"pathPrefix":"/pay"},"tenant":[{"header":"x-tenant"}]}]"#,
        )
        .build()
}

/// The access-log lines so far, once there are `n` (bounded wait: Envoy
/// flushes its log every 100 ms in the tests).
fn lines(e: &Envoy, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got: Vec<Value> = e
            .log()
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        if got.len() >= n {
            return got;
        }
        assert!(
            Instant::now() < deadline,
            "{} access-log lines, waited for {n}",
            got.len()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The filter's record in a line (a JSON string in the JSON line).
fn record(line: &Value) -> Value {
    serde_json::from_str(line["redis_guard"].as_str().unwrap()).unwrap()
}

fn pay(e: &Envoy, key: &str, body: &[u8]) -> Resp {
    let h = [("idempotency-key", key), ("x-tenant", "acme")];
    http("POST", &e.url("/pay/x"), &h, Some(body))
}

#[test]
fn every_answer_has_its_details_and_every_decision_its_record() {
    let mut stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    let alice = [("x-user", "alice")];
    let codes: Vec<u16> = (0..4)
        .map(|_| get(&e.url("/api/a"), &alice).status)
        .collect();
    assert_eq!(codes, [200, 200, 429, 429]);
    assert_eq!(pay(e, "k1", b"one").status, 200);
    assert_eq!(
        pay(e, "k1", b"one").header("idempotent-replayed"),
        Some("true")
    );
    assert_eq!(pay(e, "k1", b"two").status, 422);
    assert_eq!(pay(e, "", b"one").status, 400);
    let log = lines(e, 8);
    let details: Vec<&str> = log
        .iter()
        .map(|l| l["response_code_details"].as_str().unwrap())
        .collect();

    // Admitted: the limit, its units left and its key, hashed.
    for (i, left) in [(0, 1), (1, 0)] {
        assert_eq!(details[i], "via_upstream");
        let r = record(&log[i]);
        assert_eq!(r["verdict"], "admitted");
        assert_eq!(r["limit"], "per-user");
        assert_eq!(r["remaining"], left);
        let key = r["key"].as_str().unwrap();
        assert_eq!(key.len(), 16);
        assert!(!key.contains("alice"), "the value is not logged: {key}");
    }
    // Rejected by Redis, then (within its hold) by the over-limit cache.
    assert_eq!(details[2], "redis_guard_rate_limited");
    assert_eq!(record(&log[2])["verdict"], "rejected");
    assert_eq!(record(&log[2])["remaining"], 0);
    let cached = e.counter("redis_guard.overlimit_cache.rejected");
    let (want_details, want_verdict) = if cached == 1 {
        ("redis_guard_rate_limited_cached", "cached_rejection")
    } else {
        ("redis_guard_rate_limited", "rejected")
    };
    assert_eq!(
        (details[3], record(&log[3])["verdict"].as_str().unwrap()),
        (want_details, want_verdict)
    );

    // Idempotency: executed and stored, replayed, used with another body, a bad key.
    assert_eq!(record(&log[4])["idempotency"], "stored");
    assert_eq!(details[5], "redis_guard_idempotent_replay");
    assert_eq!(record(&log[5])["verdict"], "replayed");
    assert_eq!(details[6], "redis_guard_idempotency_mismatch");
    assert_eq!(record(&log[6])["verdict"], "mismatch");
    assert_eq!(details[7], "redis_guard_bad_request");
    assert_eq!(record(&log[7])["verdict"], "refused");

    // A conflict: the first attempt still runs.
    let url = e.url("/pay/slow");
    let first = std::thread::spawn(move || {
        let h = [
            ("idempotency-key", "k2"),
            ("x-tenant", "acme"),
            ("x-upstream-delay-ms", "1500"),
        ];
        http("POST", &url, &h, Some(b"x")).status
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while stack.upstream.in_flight("/pay/slow") != 1 {
        assert!(Instant::now() < deadline, "the first attempt never ran");
        std::thread::sleep(Duration::from_millis(10));
    }
    let h = [("idempotency-key", "k2"), ("x-tenant", "acme")];
    assert_eq!(
        http("POST", &e.url("/pay/slow"), &h, Some(b"x")).status,
        409
    );
    assert_eq!(first.join().unwrap(), 200);
    let log = lines(e, 10);
    let conflict = log
        .iter()
        .find(|l| l["response_code"] == 409)
        .expect("the 409's line");
    assert_eq!(
        conflict["response_code_details"],
        "redis_guard_idempotency_conflict"
    );
    assert_eq!(record(conflict)["verdict"], "conflict");

    // Redis gone: the failure mode answers, and says so.
    let url = e.url("/api/a");
    stack.redis.stop();
    let e = stack.envoy();
    assert_eq!(get(&url, &[("x-user", "bob")]).status, 503);
    let log = lines(e, 11);
    assert_eq!(
        log[10]["response_code_details"],
        "redis_guard_failure_mode_denied"
    );
    assert_eq!(record(&log[10])["verdict"], "failure_denied");
    // A request no limit or rule applies to leaves no record.
    assert_eq!(get(&e.url("/public"), &[]).status, 200);
    let log = lines(e, 12);
    assert_eq!(log[11]["redis_guard"], Value::Null);
}

#[test]
fn a_plain_key_is_logged_only_when_the_configuration_asks() {
    let cfg = filter_config(1000)
        .limits(
            r#"[{"name":"per-user","descriptor":[{"header":"x-user"}],
                 "tokenBucket":{"capacity":2,"refill":1,"periodMs":3600000}}]"#,
        )
        .field("accessLog", r#"{"key":"plain"}"#)
        .build();
    let stack = Stack::start(&cfg, 1);
    let e = stack.envoy();
    assert_eq!(get(&e.url("/x"), &[("x-user", "alice")]).status, 200);
    let log = lines(e, 1);
    let key = record(&log[0])["key"].as_str().unwrap().to_string();
    assert!(
        key.starts_with("rg:rl:") && key.ends_with(":alice"),
        "{key}"
    );
}
