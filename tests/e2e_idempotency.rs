//! Idempotency keys end to end: a real Envoy (V8, two workers) running the
//! filter, real Webdis and Redis, the demo upstream counting executions.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use support::probe::*;
use support::*;

/// One rule on /pay: tenant from x-tenant, bodies up to 1 KiB, responses up
/// to the default 64 KiB stored; `extra` adds fields to the rule, `limits`
/// sets limits.
fn config_with(extra: &str, limits: &str) -> String {
    filter_config(3000)
        .limits(limits)
        .idempotency(&format!(
            r#"[{{"name":"pay","match":{{"pathPrefix":"/pay"}},
              "tenant":[{{"header":"x-tenant"}}],
              "storeHeaders":["content-type","x-tag"],
              "maxRequestBodyBytes":1024{extra}}}]"#
        ))
        .build()
}

fn config(extra: &str) -> String {
    config_with(extra, "[]")
}

/// The demo upstream's instruction to add these response headers, in order
/// (each byte one character: `x-upstream-headers` in envoy/upstream.py).
fn upstream_headers(pairs: &[(&str, &[u8])]) -> String {
    let pairs: Vec<(&str, String)> = pairs
        .iter()
        .map(|(n, v)| (*n, v.iter().map(|b| char::from(*b)).collect()))
        .collect();
    // ASCII only (as \u00XX escapes): a request header is read as Latin-1.
    serde_json::to_string(&pairs)
        .unwrap()
        .chars()
        .map(|c| match c.is_ascii() {
            true => c.to_string(),
            false => format!("\\u{:04x}", u32::from(c)),
        })
        .collect()
}

/// Every `rg:` key in Redis.
fn keys(stack: &Stack) -> Vec<Vec<u8>> {
    redis::cmd("KEYS")
        .arg("rg:*")
        .query(&mut stack.redis.conn())
        .unwrap()
}

fn post(e: &Envoy, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
    http("POST", &e.url(path), headers, Some(body))
}

fn executions_of(stack: &Stack, path: &str) -> u64 {
    let r = get(
        &format!("http://127.0.0.1:{}/__stats", stack.upstream.port),
        &[],
    );
    r.json()["byPath"][path].as_u64().unwrap_or(0)
}

/// After a scenario: every idempotency key in Redis has a TTL, and no
/// IN_PROGRESS lock outlived its request.
fn assert_no_lock_survives(stack: &Stack) {
    let mut con = stack.redis.conn();
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("rg:*").query(&mut con).unwrap();
    for key in keys {
        let pttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut con).unwrap();
        assert!(pttl > 0, "{} has no TTL", String::from_utf8_lossy(&key));
        if key.starts_with(b"rg:idem:") {
            let state: Option<String> = redis::cmd("HGET")
                .arg(&key)
                .arg("s")
                .query(&mut con)
                .unwrap();
            assert_eq!(
                state.as_deref(),
                Some("C"),
                "{} is still locked",
                String::from_utf8_lossy(&key)
            );
        }
    }
}

#[test]
fn a_retry_after_completion_replays_the_stored_response_byte_for_byte() {
    let stack = Stack::start(&config(""), 1);
    let e = stack.envoy();
    let h = [("idempotency-key", "order-1"), ("x-tenant", "acme")];
    let first = post(e, "/pay/a", &h, b"{\"amount\":10}");
    assert_eq!(first.status, 200);
    assert_eq!(first.header("idempotent-replayed"), None);
    for _ in 0..3 {
        let again = post(e, "/pay/a", &h, b"{\"amount\":10}");
        assert_eq!(again.status, 200);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(again.body, first.body, "byte-identical body");
        assert_eq!(again.header("content-type"), first.header("content-type"));
    }
    // The quoted structured-field form names the same key.
    let quoted = post(
        e,
        "/pay/a",
        &[("idempotency-key", "\"order-1\""), ("x-tenant", "acme")],
        b"{\"amount\":10}",
    );
    assert_eq!(quoted.header("idempotent-replayed"), Some("true"));
    assert_eq!(executions_of(&stack, "/pay/a"), 1);
    assert_eq!(e.counter("redis_guard.idempotency.stored"), 1);
    assert_eq!(e.counter("redis_guard.idempotency.replayed"), 4);
    assert_no_lock_survives(&stack);
}

#[test]
fn one_key_hammered_over_two_envoys_executes_exactly_once() {
    let stack = Stack::start(&config(""), 2);
    let statuses = Mutex::new(BTreeMap::new());
    let bodies = Mutex::new(Vec::new());
    let deadline = Instant::now() + Duration::from_secs(60);
    std::thread::scope(|s| {
        for t in 0..20 {
            let (stack, statuses, bodies) = (&stack, &statuses, &bodies);
            s.spawn(move || {
                let agent = agent();
                for i in 0..5 {
                    if Instant::now() > deadline {
                        return;
                    }
                    let e = &stack.envoys[(t + i) % 2];
                    let r = http_with(
                        &agent,
                        "POST",
                        &e.url("/pay/race"),
                        &[
                            ("idempotency-key", "race-1"),
                            ("x-tenant", "acme"),
                            // Keeps the first execution in flight while the rest arrive.
                            ("x-upstream-delay-ms", "300"),
                        ],
                        Some(b"{\"amount\":99}"),
                    );
                    let replayed = r.header("idempotent-replayed").is_some();
                    *statuses
                        .lock()
                        .unwrap()
                        .entry((r.status, replayed))
                        .or_insert(0) += 1;
                    if r.status == 200 {
                        bodies.lock().unwrap().push(r.body);
                    }
                }
            });
        }
    });
    let statuses = statuses.into_inner().unwrap();
    assert_eq!(
        statuses.values().sum::<usize>(),
        100,
        "load loop hit its time bound"
    );
    assert_eq!(executions_of(&stack, "/pay/race"), 1, "{statuses:?}");
    assert_eq!(
        statuses.get(&(200, false)),
        Some(&1),
        "one original answer: {statuses:?}"
    );
    let others: usize = statuses
        .iter()
        .filter(|((st, rep), _)| (*st, *rep) == (200, true) || *st == 409)
        .map(|(_, n)| n)
        .sum();
    assert_eq!(
        others, 99,
        "everything else is a replay or a 409: {statuses:?}"
    );
    let bodies = bodies.into_inner().unwrap();
    assert!(
        bodies.windows(2).all(|w| w[0] == w[1]),
        "replays are byte-identical"
    );
    assert_no_lock_survives(&stack);
}

#[test]
fn an_upstream_5xx_frees_the_key_so_the_retry_executes() {
    let stack = Stack::start(&config(""), 1);
    let e = stack.envoy();
    let key = [("idempotency-key", "k-5xx"), ("x-tenant", "acme")];
    let failing = [key[0], key[1], ("x-upstream-status", "503")];
    assert_eq!(post(e, "/pay/f", &failing, b"x").status, 503);
    let retry = post(e, "/pay/f", &key, b"x");
    assert_eq!(retry.status, 200);
    assert_eq!(retry.header("idempotent-replayed"), None);
    assert_eq!(executions_of(&stack, "/pay/f"), 2);
    assert_eq!(
        post(e, "/pay/f", &key, b"x").header("idempotent-replayed"),
        Some("true")
    );
    assert_eq!(executions_of(&stack, "/pay/f"), 2);
    assert_no_lock_survives(&stack);
}

#[test]
fn a_4xx_is_stored_only_when_configured() {
    let stack = Stack::start(&config(""), 1);
    let e = stack.envoy();
    let h = [
        ("idempotency-key", "k-4xx"),
        ("x-tenant", "acme"),
        ("x-upstream-status", "404"),
    ];
    assert_eq!(post(e, "/pay/n", &h, b"x").status, 404);
    assert_eq!(
        post(e, "/pay/n", &h, b"x").header("idempotent-replayed"),
        None
    );
    assert_eq!(
        executions_of(&stack, "/pay/n"),
        2,
        "4xx not stored by default"
    );

    let stack = Stack::start(&config(r#","storeStatuses":["2xx","4xx"]"#), 1);
    let e = stack.envoy();
    assert_eq!(post(e, "/pay/n", &h, b"x").status, 404);
    let again = post(e, "/pay/n", &h, b"x");
    assert_eq!(
        (again.status, again.header("idempotent-replayed")),
        (404, Some("true"))
    );
    assert_eq!(executions_of(&stack, "/pay/n"), 1);
}

#[test]
fn the_same_key_with_another_body_is_422() {
    let stack = Stack::start(&config(""), 1);
    let e = stack.envoy();
    let h = [("idempotency-key", "k-body"), ("x-tenant", "acme")];
    assert_eq!(post(e, "/pay/b", &h, b"{\"amount\":1}").status, 200);
    let other = post(e, "/pay/b", &h, b"{\"amount\":2}");
    assert_eq!(other.status, 422);
    assert_eq!(other.json()["status"], 422);
    assert_eq!(executions_of(&stack, "/pay/b"), 1);
    assert_no_lock_survives(&stack);
}

#[test]
fn missing_malformed_and_oversized_requests_are_refused_before_the_upstream() {
    let stack = Stack::start(&config(r#","required":true"#), 1);
    let e = stack.envoy();
    let r = post(e, "/pay/v", &[("x-tenant", "acme")], b"x");
    assert_eq!(r.status, 400);
    assert!(r.json()["detail"]
        .as_str()
        .unwrap()
        .contains("idempotency-key"));
    let long = "k".repeat(256);
    for bad in ["", "   ", "a b", "\"unterminated", "\"x\"y", long.as_str()] {
        let r = post(
            e,
            "/pay/v",
            &[("idempotency-key", bad), ("x-tenant", "acme")],
            b"x",
        );
        assert_eq!(r.status, 400, "key {bad:?}");
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
    }
    let big = vec![b'x'; 1025];
    let r = post(
        e,
        "/pay/v",
        &[("idempotency-key", "k-big"), ("x-tenant", "acme")],
        &big,
    );
    assert_eq!(r.status, 413);
    // GET is not covered by the rule (POST and PATCH by default).
    assert_eq!(get(&e.url("/pay/v"), &[]).status, 200);
    assert_eq!(
        executions_of(&stack, "/pay/v"),
        1,
        "only the GET reached the upstream"
    );
}

#[test]
fn tenants_never_see_each_others_results() {
    let stack = Stack::start(&config(""), 1);
    let e = stack.envoy();
    let a = [("idempotency-key", "shared-key"), ("x-tenant", "tenant-a")];
    let b = [("idempotency-key", "shared-key"), ("x-tenant", "tenant-b")];
    let ra = post(e, "/pay/t", &a, b"same");
    let rb = post(e, "/pay/t", &b, b"same");
    assert_eq!(
        rb.header("idempotent-replayed"),
        None,
        "B executes its own request"
    );
    assert_ne!(ra.body, rb.body);
    assert_eq!(executions_of(&stack, "/pay/t"), 2);
    assert_eq!(post(e, "/pay/t", &a, b"same").body, ra.body);
    assert_eq!(post(e, "/pay/t", &b, b"same").body, rb.body);
    assert_eq!(executions_of(&stack, "/pay/t"), 2);
    // A request without its tenant gets no shared scope: 400.
    let r = post(e, "/pay/t", &[("idempotency-key", "shared-key")], b"same");
    assert_eq!(r.status, 400);
    assert_eq!(executions_of(&stack, "/pay/t"), 2);
    assert_no_lock_survives(&stack);
}

#[test]
fn replays_and_conflicts_spend_no_rate_limit_quota() {
    let limits = r#"[{"name":"per-tenant","descriptor":[{"header":"x-tenant"}],
                     "tokenBucket":{"capacity":3,"refill":1,"periodMs":3600000}}]"#;
    let stack = Stack::start(&config_with("", limits), 1);
    let e = stack.envoy();
    let k1 = [("idempotency-key", "q-1"), ("x-tenant", "acme")];
    let first = post(e, "/pay/q", &k1, b"x");
    assert_eq!(first.header("x-ratelimit-remaining"), Some("2"));
    for _ in 0..5 {
        let r = post(e, "/pay/q", &k1, b"x");
        assert_eq!(r.header("idempotent-replayed"), Some("true"));
    }
    // A slow request holds q-2 while its duplicate gets 409.
    let slow = [
        ("idempotency-key", "q-2"),
        ("x-tenant", "acme"),
        ("x-upstream-delay-ms", "3000"),
    ];
    std::thread::scope(|s| {
        let running = s.spawn(|| post(e, "/pay/q", &slow, b"x"));
        // q-2 holds its key once it is at the upstream.
        poll_eq("q-2 executing", 2, Duration::from_secs(5), || {
            executions_of(&stack, "/pay/q")
        });
        let dup = post(e, "/pay/q", &slow, b"x");
        assert_eq!(dup.status, 409);
        assert_eq!(dup.header("retry-after"), Some("1"));
        let done = running.join().unwrap();
        assert_eq!(
            (done.status, done.header("x-ratelimit-remaining")),
            (200, Some("1"))
        );
    });
    // Replays and the 409 spent nothing: one unit is left for q-3, none for q-4.
    let k3 = [("idempotency-key", "q-3"), ("x-tenant", "acme")];
    let third = post(e, "/pay/q", &k3, b"x");
    assert_eq!(
        (third.status, third.header("x-ratelimit-remaining")),
        (200, Some("0"))
    );
    let k4 = [("idempotency-key", "q-4"), ("x-tenant", "acme")];
    assert_eq!(post(e, "/pay/q", &k4, b"x").status, 429);
    assert_eq!(executions_of(&stack, "/pay/q"), 3);
    assert_eq!(e.counter("redis_guard.idempotency.conflicted"), 1);
    // The rejected key took no lock: with quota (another tenant) it runs.
    let k4b = [("idempotency-key", "q-4"), ("x-tenant", "other")];
    assert_eq!(post(e, "/pay/q", &k4b, b"x").status, 200);
    assert_no_lock_survives(&stack);
}

#[test]
fn a_lock_shorter_than_the_upstream_lets_a_retry_run_again() {
    // Documented hazard: lockTtlMs must exceed the upstream's time. Here the
    // lock (300 ms) expires while the upstream takes 900 ms: the retry runs
    // again, the first (late) response is not stored, the second is.
    let stack = Stack::start(&config(r#","lockTtlMs":300"#), 1);
    let e = stack.envoy();
    let h = [
        ("idempotency-key", "k-slow"),
        ("x-tenant", "acme"),
        ("x-upstream-delay-ms", "900"),
    ];
    std::thread::scope(|s| {
        let first = s.spawn(|| post(e, "/pay/s", &h, b"x"));
        // The first is at the upstream and its lock has expired in Redis.
        poll(
            "the first executing, its lock gone",
            Duration::from_secs(5),
            || (executions_of(&stack, "/pay/s") == 1 && keys(&stack).is_empty()).then_some(()),
        );
        // The retry is fast (the delay header is not part of the fingerprint).
        let second = post(e, "/pay/s", &h[..2], b"x");
        assert_eq!(
            (second.status, second.header("idempotent-replayed")),
            (200, None)
        );
        assert_eq!(first.join().unwrap().status, 200);
    });
    assert_eq!(executions_of(&stack, "/pay/s"), 2);
    assert_eq!(e.counter("redis_guard.idempotency.store_failed"), 1);
    assert_eq!(e.counter("redis_guard.idempotency.stored"), 1);
    let replay = post(e, "/pay/s", &h[..2], b"x");
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_no_lock_survives(&stack);
}

#[test]
fn a_response_over_the_stored_body_cap_is_not_stored_and_the_key_is_freed() {
    // The demo upstream answers ~70 bytes of JSON: over a 16-byte cap.
    let stack = Stack::start(&config(r#","maxStoredBodyBytes":16"#), 1);
    let e = stack.envoy();
    let h = [("idempotency-key", "k-large"), ("x-tenant", "acme")];
    let first = post(e, "/pay/l", &h, b"x");
    assert_eq!(first.status, 200);
    assert!(first.body.len() > 16);
    let again = post(e, "/pay/l", &h, b"x");
    assert_eq!(
        (again.status, again.header("idempotent-replayed")),
        (200, None)
    );
    assert_eq!(executions_of(&stack, "/pay/l"), 2);
    assert_eq!(e.counter("redis_guard.idempotency.too_large"), 2);
    assert_no_lock_survives(&stack);
}

#[test]
fn stored_responses_replay_every_value_of_a_repeated_header_byte_for_byte() {
    let stack = Stack::start(&config(""), 1);
    let e = stack.envoy();
    // Four values of one stored header: a comma inside one (not a list
    // separator to undo), quotes, and UTF-8 beyond ASCII (text, so stored).
    let values: [&[u8]; 4] = [b"one", b"two, three", b"a;b=\"c\"", "caf\u{e9}".as_bytes()];
    let spec = upstream_headers(&values.map(|v| ("x-tag", v)));
    let key: [(&str, &[u8]); 2] = [("idempotency-key", b"rep-1"), ("x-tenant", b"acme")];
    let asked = [key[0], key[1], ("x-upstream-headers", spec.as_bytes())];
    let first = raw_request(e.port, "POST", "/pay/h", &asked, b"x");
    assert_eq!(first.status, 200);
    assert_eq!(first.values("x-tag"), values, "what the upstream sent");
    let replay = raw_request(e.port, "POST", "/pay/h", &key, b"x");
    assert_eq!(replay.header("idempotent-replayed"), Some(&b"true"[..]));
    assert_eq!(replay.values("x-tag"), values, "every value, in order");
    assert_eq!(replay.body, first.body);
    assert_eq!(executions_of(&stack, "/pay/h"), 1);
    assert_eq!(e.counter("redis_guard.idempotency.stored"), 1);
}

#[test]
fn a_stored_header_value_that_is_not_text_leaves_the_response_unstored_and_frees_the_key() {
    let stack = Stack::start(&config(""), 1);
    let e = stack.envoy();
    let key: [(&str, &[u8]); 2] = [("idempotency-key", b"raw-1"), ("x-tenant", b"acme")];
    // x-tag is stored by the rule; 0xFF 0xFE is not UTF-8.
    let spec = upstream_headers(&[("x-tag", b"\xff\xfe")]);
    let asked = [key[0], key[1], ("x-upstream-headers", spec.as_bytes())];
    let first = raw_request(e.port, "POST", "/pay/raw", &asked, b"x");
    assert_eq!(first.status, 200);
    // The client still gets the response as the upstream sent it.
    assert_eq!(first.values("x-tag"), [&b"\xff\xfe"[..]]);
    assert_eq!(e.counter("redis_guard.idempotency.released"), 1);
    assert_eq!(e.counter("redis_guard.idempotency.stored"), 0);
    assert_eq!(keys(&stack), Vec::<Vec<u8>>::new(), "no record, no lock");
    // The key is free: the retry executes again, and (its headers text) is stored.
    let retry = raw_request(e.port, "POST", "/pay/raw", &key, b"x");
    assert_eq!(
        (retry.status, retry.header("idempotent-replayed")),
        (200, None)
    );
    assert_eq!(executions_of(&stack, "/pay/raw"), 2);
    let replay = raw_request(e.port, "POST", "/pay/raw", &key, b"x");
    assert_eq!(replay.header("idempotent-replayed"), Some(&b"true"[..]));
    assert_eq!(executions_of(&stack, "/pay/raw"), 2);

    // Bytes that are not text in a header the rule does not store do not
    // matter: that response is stored.
    let other: [(&str, &[u8]); 2] = [("idempotency-key", b"raw-2"), ("x-tenant", b"acme")];
    let spec = upstream_headers(&[("x-unstored", b"\xff")]);
    let asked = [other[0], other[1], ("x-upstream-headers", spec.as_bytes())];
    assert_eq!(
        raw_request(e.port, "POST", "/pay/ok", &asked, b"x").status,
        200
    );
    let replay = raw_request(e.port, "POST", "/pay/ok", &other, b"x");
    assert_eq!(replay.header("idempotent-replayed"), Some(&b"true"[..]));
    assert_eq!(executions_of(&stack, "/pay/ok"), 1);
    assert_eq!(e.counter("redis_guard.idempotency.released"), 1);
    assert_no_lock_survives(&stack);
}

#[test]
fn an_empty_tenant_part_gets_400_like_an_absent_one() {
    let stack = Stack::start(&config(""), 1);
    let e = stack.envoy();
    let key = ("idempotency-key", &b"k-empty"[..]);
    for tenant in [&[("x-tenant", &b""[..])][..], &[]] {
        let mut headers = vec![key];
        headers.extend_from_slice(tenant);
        let r = raw_request(e.port, "POST", "/pay/e", &headers, b"x");
        assert_eq!(r.status, 400, "tenant {tenant:?}");
        let detail: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert!(
            detail["detail"].as_str().unwrap().contains("tenant"),
            "{detail}"
        );
    }
    assert_eq!(executions_of(&stack, "/pay/e"), 0);
    assert_eq!(
        keys(&stack),
        Vec::<Vec<u8>>::new(),
        "nothing taken in Redis"
    );
    // The same key with a tenant runs: the 400s were about the tenant.
    let r = raw_request(
        e.port,
        "POST",
        "/pay/e",
        &[key, ("x-tenant", b"acme")],
        b"x",
    );
    assert_eq!(r.status, 200);
    assert_eq!(executions_of(&stack, "/pay/e"), 1);
}

#[test]
fn redis_down_follows_the_rule_failure_mode() {
    let open = r#"{"redis":{"cluster":"webdis","timeoutMs":300},
        "idempotency":[{"name":"open","match":{"pathPrefix":"/open"},"failureMode":"allow"},
                       {"name":"closed","match":{"pathPrefix":"/closed"},"failureMode":"deny"}]}"#;
    let mut stack = Stack::start(open, 1);
    stack.redis.stop();
    let e = stack.envoy();
    let h = [("idempotency-key", "k-down")];
    let r = post(e, "/open", &h, b"x");
    assert_eq!(r.status, 200, "forwarded without the guarantee");
    let r = post(e, "/closed", &h, b"x");
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["status"], 503);
    assert_eq!(e.counter("redis_guard.idempotency.unguarded"), 1);
    assert_eq!(executions_of(&stack, "/open"), 1);
    assert_eq!(executions_of(&stack, "/closed"), 0);
}

/// Envoy as an Istio `WasmPlugin` configures it: no
/// `allow_on_headers_stop_iteration`, so a filter holding the headers never
/// sees the body. A rule with `fingerprintBody: false` decides on the headers
/// and keeps every guarantee but the body comparison; a rule that fingerprints
/// the body cannot work there, and the request is held, never executed.
#[test]
fn without_headers_stop_iteration_a_headers_only_fingerprint_still_executes_once() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let cfg = r#"{"redis":{"cluster":"webdis","timeoutMs":3000},"failureMode":"deny",
        "idempotency":[
          {"name":"headers-only","match":{"pathPrefix":"/pay"},"fingerprintBody":false},
          {"name":"with-body","match":{"pathPrefix":"/stuck"}}]}"#;
    let envoy = Envoy::start_edited(cfg, webdis.port, upstream.port, |yaml| {
        let flag = "allow_on_headers_stop_iteration: true";
        assert!(yaml.contains(flag));
        yaml.replace(flag, "allow_on_headers_stop_iteration: false")
    });
    let pay = |body: &[u8]| post(&envoy, "/pay/1", &[("idempotency-key", "istio-1")], body);

    let first = pay(b"{\"amount\":10}");
    assert_eq!(first.status, 200);
    assert_eq!(upstream.executed(), 1);
    // The upstream got the whole body although the filter held the request.
    assert_eq!(first.json()["bodyBytes"], 13, "{:?}", first.json());
    let again = pay(b"{\"amount\":10}");
    assert_eq!(again.status, 200);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    // Not compared: another body under the same key replays too.
    let other = pay(b"{\"amount\":99}");
    assert_eq!(other.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.executed(), 1);

    // The body-fingerprinting rule on this Envoy: held until the client gives up.
    let calls = envoy.counter("redis_guard.redis.calls");
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_millis(1500))
        .build();
    let stuck = agent
        .post(&envoy.url("/stuck"))
        .set("idempotency-key", "istio-2")
        .send_bytes(b"{\"amount\":10}");
    assert!(
        matches!(stuck, Err(ureq::Error::Transport(_))),
        "expected the request to hang: {stuck:?}"
    );
    assert_eq!(envoy.counter("redis_guard.redis.calls"), calls);
    assert_eq!(upstream.executed(), 1);
}
