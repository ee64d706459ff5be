//! Rate limiting end to end: a real Envoy (V8 runtime, two workers) running the
//! filter, real Webdis, real Redis, the demo upstream; all on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use support::probe::*;
use support::*;

/// 2^40 ms: a fixed window no run crosses the edge of (aligned to the epoch,
/// the current one ends in 2039).
const LONG_WINDOW_MS: u64 = 1 << 40;

fn config(timeout_ms: u64, failure: &str, limits: &str) -> String {
    filter_config(timeout_ms)
        .failure_mode(failure)
        .limits(limits)
        .build()
}

/// The same, with every key's hash tag taken from the `x-tenant` header.
fn tenant_config(limits: &str) -> String {
    filter_config(2000)
        .hash_tag(r#"[{"header":"x-tenant"}]"#)
        .limits(limits)
        .build()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The key the filter must use, computed here independently of the crate:
/// `rg:rl:{<first 8 bytes of sha256("<len>:<tenant>:")>}:<limit>:<signature>:<len>:<tenant>:<len>:<value>`.
fn expected_key(tenant: &[u8], limit: &str, signature: &str, value: &[u8]) -> Vec<u8> {
    let mut tag_src = format!("{}:", tenant.len()).into_bytes();
    tag_src.extend_from_slice(tenant);
    tag_src.push(b':');
    let tag = hex(&Sha256::digest(&tag_src)[..8]);
    let mut key = format!("rg:rl:{{{tag}}}:{limit}:{signature}:").into_bytes();
    key.extend_from_slice(&tag_src);
    if value.len() > 128 {
        key.push(b'#');
        key.extend_from_slice(hex(&Sha256::digest(value)).as_bytes());
    } else {
        key.extend_from_slice(format!("{}:", value.len()).as_bytes());
        key.extend_from_slice(value);
    }
    key
}

fn all_keys(redis: &Redis) -> Vec<Vec<u8>> {
    let mut keys: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg("*")
        .query(&mut redis.conn())
        .unwrap();
    keys.sort();
    keys
}

#[test]
fn rejects_the_request_after_the_limit_with_429_and_rate_limit_headers() {
    let cfg = config(
        2000,
        "deny",
        r#"[{"name":"per-user","match":{"pathPrefix":"/api/"},"descriptor":[{"header":"x-user"}],
             "slidingWindow":{"limit":3,"windowMs":60000}}]"#,
    );
    let stack = Stack::start(&cfg, 1);
    let e = stack.envoy();
    for expected_remaining in ["2", "1", "0"] {
        let r = get(&e.url("/api/orders"), &[("x-user", "alice")]);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-ratelimit-limit"), Some("3"));
        assert_eq!(r.header("x-ratelimit-remaining"), Some(expected_remaining));
        assert_eq!(r.header("ratelimit-policy"), Some("\"per-user\";q=3;w=60"));
        let state = r.header("ratelimit").unwrap();
        assert!(
            state.starts_with(&format!("\"per-user\";r={expected_remaining};t=")),
            "{state}"
        );
    }
    let r = get(&e.url("/api/orders"), &[("x-user", "alice")]);
    assert_eq!(r.status, 429);
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(
        (1..=60).contains(&retry),
        "Retry-After {retry} outside the window"
    );
    assert_eq!(
        r.header("x-ratelimit-reset"),
        Some(retry.to_string().as_str())
    );
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(
        r.header("ratelimit"),
        Some(format!("\"per-user\";r=0;t={retry}").as_str())
    );
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let body = r.json();
    assert_eq!(body["status"], 429);
    assert_eq!(body["limits"], serde_json::json!(["per-user"]));
    assert_eq!(body["retryAfter"], retry);
    assert_eq!(
        stack.upstream.executed(),
        3,
        "the rejected request never reached the upstream"
    );
    // Envoy normalises the path before the filter sees it: no way around the prefix.
    for sneaky in ["//api/orders", "/./api/orders", "/x/../api/orders"] {
        let r = get(&e.url(sneaky), &[("x-user", "alice")]);
        assert_eq!(r.status, 429, "{sneaky}");
    }

    // Paths the limit does not match are not limited and carry no headers.
    let r = get(&e.url("/health"), &[("x-user", "alice")]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-limit"), None);
    assert_eq!(e.counter("redis_guard.ratelimit.per-user.allowed"), 3);
    assert_eq!(e.counter("redis_guard.ratelimit.per-user.rejected"), 4);
}

#[test]
fn different_descriptor_values_have_independent_budgets() {
    let cfg = tenant_config(
        r#"[{"name":"per-user","descriptor":[{"header":"x-tenant"},{"header":"x-user"}],
             "tokenBucket":{"capacity":2,"refill":1,"periodMs":3600000}}]"#,
    );
    let stack = Stack::start(&cfg, 1);
    let e = stack.envoy();
    let statuses = |user: &str, tenant: &str| -> Vec<u16> {
        (0..3)
            .map(|_| get(&e.url("/x"), &[("x-user", user), ("x-tenant", tenant)]).status)
            .collect()
    };
    assert_eq!(statuses("alice", "t1"), [200, 200, 429]);
    assert_eq!(statuses("bob", "t1"), [200, 200, 429]);
    // The same user under another tenant is another descriptor's budget too.
    assert_eq!(statuses("alice", "t2"), [200, 200, 429]);
    // Requests without a descriptor header are not limited by it.
    let r = get(&e.url("/x"), &[("x-tenant", "t1")]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-limit"), None);
    assert_eq!(stack.upstream.executed(), 7);
}

#[test]
fn a_rejected_request_costs_nothing_in_any_limit() {
    // "wide" has room; "narrow" rejects the third request. All or nothing: the
    // rejected request must not spend from "wide".
    let cfg = config(
        2000,
        "deny",
        r#"[{"name":"wide","descriptor":[{"literal":"all"}],"slidingWindow":{"limit":10,"windowMs":60000}},
            {"name":"narrow","match":{"pathPrefix":"/narrow"},"descriptor":[{"literal":"n"}],
             "tokenBucket":{"capacity":2,"refill":1,"periodMs":3600000}}]"#,
    );
    let stack = Stack::start(&cfg, 1);
    let e = stack.envoy();
    let s: Vec<u16> = (0..4).map(|_| get(&e.url("/narrow"), &[]).status).collect();
    assert_eq!(s, [200, 200, 429, 429]);
    let r = get(&e.url("/other"), &[]);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-remaining"),
        Some("7"),
        "wide spent 2 (admitted) + 1 (this request), not the 2 rejected ones"
    );
}

#[test]
fn shadow_limit_never_rejects_but_reports() {
    let cfg = config(
        2000,
        "deny",
        r#"[{"name":"trial","shadow":true,"descriptor":["clientAddress"],
             "slidingWindow":{"limit":2,"windowMs":60000}}]"#,
    );
    let stack = Stack::start(&cfg, 1);
    let e = stack.envoy();
    for _ in 0..5 {
        let r = get(&e.url("/search"), &[]);
        assert_eq!(r.status, 200);
        assert_eq!(
            r.header("x-ratelimit-limit"),
            None,
            "shadow limits are not advertised"
        );
    }
    assert_eq!(stack.upstream.executed(), 5);
    assert_eq!(e.counter("redis_guard.ratelimit.trial.allowed"), 2);
    assert_eq!(e.counter("redis_guard.ratelimit.trial.shadow_rejected"), 3);
    assert_eq!(e.counter("redis_guard.ratelimit.trial.rejected"), 0);
}

/// Fires `total` GETs at `urls` (round robin) from `threads` threads; returns
/// how many requests got each status. Bounded in count and in time.
fn hammer(
    urls: &[String],
    headers: &[(&str, &str)],
    total: usize,
    threads: usize,
) -> BTreeMap<u16, usize> {
    let counts = Arc::new(Mutex::new(BTreeMap::new()));
    let deadline = Instant::now() + Duration::from_secs(60);
    std::thread::scope(|s| {
        for t in 0..threads {
            let counts = Arc::clone(&counts);
            s.spawn(move || {
                let agent = agent();
                let mut i = t;
                while i < total && Instant::now() < deadline {
                    let r = http_with(&agent, "GET", &urls[i % urls.len()], headers, None);
                    *counts.lock().unwrap().entry(r.status).or_insert(0) += 1;
                    i += threads;
                }
            });
        }
    });
    let counts = counts.lock().unwrap().clone();
    assert_eq!(
        counts.values().sum::<usize>(),
        total,
        "load loop hit its time bound"
    );
    counts
}

#[test]
fn two_envoys_sharing_one_redis_admit_exactly_the_limit() {
    let cfg = config(
        5000,
        "deny",
        r#"[{"name":"window","match":{"pathPrefix":"/sw"},"descriptor":[{"literal":"shared"}],
             "slidingWindow":{"limit":100,"windowMs":600000}},
            {"name":"bucket","match":{"pathPrefix":"/tb"},"descriptor":[{"literal":"shared"}],
             "tokenBucket":{"capacity":100,"refill":1,"periodMs":3600000}}]"#,
    );
    let stack = Stack::start(&cfg, 2);
    for path in ["/sw", "/tb"] {
        let urls: Vec<String> = stack.envoys.iter().map(|e| e.url(path)).collect();
        let before = stack.upstream.executed();
        let counts = hammer(&urls, &[], 300, 24);
        let logs: String = stack.envoys.iter().map(|e| e.log()).collect();
        let filter_lines: Vec<&str> = logs.lines().filter(|l| l.contains("redis-guard")).collect();
        assert_eq!(
            counts,
            BTreeMap::from([(200, 100), (429, 200)]),
            "{path}: exactly 100 of 300 admitted across both Envoys; filter log:\n{}",
            filter_lines.join("\n")
        );
        assert_eq!(stack.upstream.executed() - before, 100);
    }
    // Both Envoys took part.
    for e in &stack.envoys {
        assert!(e.counter("redis_guard.ratelimit.window.allowed") > 0);
        assert!(e.counter("redis_guard.ratelimit.bucket.rejected") > 0);
    }
}

#[test]
fn hostile_descriptor_values_are_limited_under_exactly_the_expected_key() {
    let cfg = tenant_config(
        r#"[{"name":"hostile","descriptor":[{"header":"x-tenant"},{"header":"x-user"}],
             "tokenBucket":{"capacity":2,"refill":1,"periodMs":3600000}}]"#,
    );
    let stack = Stack::start(&cfg, 1);
    let e = stack.envoy();
    let long = "L".repeat(300);
    let values: Vec<&[u8]> = vec![
        b"a/b",
        b"%2F",
        b"%",
        b"+plus+",
        b"?q=1&x=2",
        b"..",
        b".raw",
        b"sp ace",
        b"GET/other",
        b"}{",
        b"\"quote\\",
        "ünïcødé ✓".as_bytes(),
        b"\xff\xfe raw",
        long.as_bytes(),
    ];
    let mut expected = Vec::new();
    for v in &values {
        let statuses: Vec<u16> = (0..3)
            .map(|_| raw_get(e.port, "/x", &[("x-user", v), ("x-tenant", b"t1")]).0)
            .collect();
        assert_eq!(
            statuses,
            [200, 200, 429],
            "value {:?}",
            String::from_utf8_lossy(v)
        );
        expected.push(expected_key(b"t1", "hostile", "tb2.2.1.3600000", v));
    }
    expected.sort();
    assert_eq!(
        all_keys(&stack.redis),
        expected,
        "exactly one key per value, byte for byte, and nothing else"
    );
}

/// `/open` fails open (the top-level mode), `/closed` fails closed.
const OPEN_AND_CLOSED: &str = r#"[
    {"name":"open","match":{"pathPrefix":"/open"},"slidingWindow":{"limit":100,"windowMs":60000}},
    {"name":"closed","match":{"pathPrefix":"/closed"},"failureMode":"deny",
     "slidingWindow":{"limit":100,"windowMs":60000}}]"#;

#[test]
fn redis_down_follows_the_failure_mode_without_hanging() {
    let cfg = config(300, "allow", OPEN_AND_CLOSED);
    let mut stack = Stack::start(&cfg, 1);
    assert_eq!(get(&stack.envoy().url("/open"), &[]).status, 200);
    assert_eq!(get(&stack.envoy().url("/closed"), &[]).status, 200);
    stack.redis.stop();
    let e = stack.envoy();
    for _ in 0..3 {
        let t = Instant::now();
        let r = get(&e.url("/closed"), &[]);
        assert_eq!(r.status, 503);
        assert_eq!(r.json()["status"], 503);
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "deny took {:?}",
            t.elapsed()
        );
        let t = Instant::now();
        let r = get(&e.url("/open"), &[]);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-ratelimit-limit"), None);
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "allow took {:?}",
            t.elapsed()
        );
    }
    assert_eq!(e.counter("redis_guard.failure_mode.denied"), 3);
    assert_eq!(e.counter("redis_guard.failure_mode.allowed"), 3);
}

#[test]
fn a_restarted_redis_gets_the_script_again_without_a_failed_request() {
    let cfg = config(
        2000,
        "deny",
        r#"[{"name":"w","descriptor":[{"literal":"x"}],"slidingWindow":{"limit":100,"windowMs":60000}}]"#,
    );
    let mut stack = Stack::start(&cfg, 1);
    for _ in 0..3 {
        assert_eq!(get(&stack.envoy().url("/a"), &[]).status, 200);
    }
    // A fresh Redis has no script: the first call loads it, the rest hit EVALSHA.
    assert_eq!(stack.envoy().counter("redis_guard.redis.script_reloads"), 1);
    assert_eq!(stack.envoy().counter("redis_guard.redis.calls"), 4);
    stack.redis.restart();
    // Webdis answers 503 for a few tens of ms while it reconnects: the
    // filter waits it out within the timeout, so no request fails.
    for _ in 0..3 {
        assert_eq!(get(&stack.envoy().url("/a"), &[]).status, 200);
    }
    let e = stack.envoy();
    assert_eq!(
        e.counter("redis_guard.redis.script_reloads"),
        2,
        "loaded again once after the restart"
    );
    assert_eq!(e.counter("redis_guard.failure_mode.denied"), 0);
    assert_eq!(e.counter("redis_guard.redis.errors"), 0);
    // Whether the first call met Webdis still reconnecting (it tries every
    // 100 ms) is a race, so the retries are not a fixed number; but each is
    // one call more, and nothing else is: three decisions, the NOSCRIPT and
    // its EVAL, and the retries, on top of the four before the restart.
    let retries = e.counter("redis_guard.redis.retries");
    assert_eq!(e.counter("redis_guard.redis.calls"), 4 + 3 + 1 + retries);
}

#[test]
fn a_webdis_503_is_sent_again_three_times_after_pauses_then_the_failure_mode_decides() {
    // 2 s leave room for every pause: the count of retries is the limit.
    let cfg = config(2000, "allow", OPEN_AND_CLOSED);
    let mut stack = Stack::start(&cfg, 1);
    assert_eq!(get(&stack.envoy().url("/closed"), &[]).status, 200);
    // With Redis gone, Webdis answers every command with its own 503 (the
    // command never reached Redis), which is safe to send again.
    stack.redis.stop();
    let e = stack.envoy();
    let c = |name: &str| e.counter(&format!("redis_guard.{name}"));
    let calls = c("redis.calls");
    let t = Instant::now();
    let r = get(&e.url("/closed"), &[]);
    let took = t.elapsed();
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["status"], 503);
    // Inside Envoy: the call, then three more after a pause each; then the
    // failure mode, once, as one HTTP error.
    assert_eq!(c("redis.calls") - calls, 4);
    assert_eq!(c("redis.retries"), 3);
    assert_eq!(c("redis.errors"), 1);
    assert_eq!(c("redis.errors_by_kind.http"), 1);
    assert_eq!(c("failure_mode.denied"), 1);
    // Three 25 ms pauses on Envoy's timer, and nothing near the timeout.
    assert!(
        took + ENVOY_TIMER_GRANULARITY >= Duration::from_millis(3 * 25),
        "three pauses took {took:?}"
    );
    assert!(took < Duration::from_millis(1000), "took {took:?}");
}

#[test]
fn a_call_webdis_refused_is_sent_again_after_a_pause_and_redis_decides_it_once() {
    let cfg = config(
        2000,
        "deny",
        r#"[{"name":"w","descriptor":[{"literal":"x"}],"slidingWindow":{"limit":100,"windowMs":60000}}]"#,
    );
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    // Webdis refuses the first two calls as it does while reconnecting to
    // Redis, then answers: a restart's reconnect window, made exact.
    let refusing = WebdisRefusingFirst::start(webdis.port, 2);
    let e = Envoy::start(&cfg, refusing.port, upstream.port);
    let r = get(&e.url("/a"), &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-remaining"), Some("99"));
    // Refused, paused, refused, paused, then EVALSHA (NOSCRIPT: fresh
    // Redis) and EVAL: four calls, two of them retries, no failure.
    assert_eq!(refusing.calls(), 4);
    assert_eq!(e.counter("redis_guard.redis.calls"), 4);
    assert_eq!(e.counter("redis_guard.redis.retries"), 2);
    assert_eq!(e.counter("redis_guard.redis.script_reloads"), 1);
    assert_eq!(e.counter("redis_guard.redis.errors"), 0);
    assert_eq!(e.counter("redis_guard.failure_mode.denied"), 0);
    // Redis charged the request once: one member in the window.
    let keys = all_keys(&redis);
    assert_eq!(keys.len(), 1);
    let members: i64 = redis::cmd("ZCARD")
        .arg(&keys[0])
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(members, 1);
    assert_eq!(upstream.executed(), 1);
}

#[test]
fn a_stalled_redis_is_given_up_at_the_timeout() {
    let cfg = config(400, "allow", OPEN_AND_CLOSED);
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let e = &envoy_flushing_stats(&cfg, webdis.port, upstream.port);
    assert_eq!(get(&e.url("/closed"), &[]).status, 200);
    // EVALSHA, NOSCRIPT, EVAL: two quick calls, two latency samples.
    let (_, _, quick) = scrape_with_samples(e, LATENCY, 2).histogram(LATENCY);
    // Webdis keeps its connection; Redis just stops answering.
    redis.freeze(true);
    for path in ["/closed", "/open"] {
        let t = Instant::now();
        let r = get(&e.url(path), &[]);
        let took = t.elapsed();
        assert_eq!(
            r.status,
            if path == "/closed" { 503 } else { 200 },
            "{path}"
        );
        assert!(
            took + ENVOY_TIMER_GRANULARITY >= Duration::from_millis(400),
            "{path}: decided before the timeout ({took:?})"
        );
        assert!(
            took < Duration::from_millis(1400),
            "{path}: waited {took:?} for a 400 ms timeout"
        );
    }
    redis.freeze(false);
    assert_eq!(e.counter("redis_guard.failure_mode.denied"), 1);
    assert_eq!(e.counter("redis_guard.failure_mode.allowed"), 1);
    // What ended each request was the callout's own timeout (Envoy's 504
    // for a callout out of time), not a retry or an error...
    assert_eq!(e.counter("redis_guard.redis.errors_by_kind.timeout"), 2);
    assert_eq!(e.counter("redis_guard.redis.errors"), 2);
    assert_eq!(e.counter("redis_guard.redis.retries"), 0);
    // ...and on Envoy's own clock each of the two calls lasted the timeout
    // (the histogram keeps two significant digits: 1.25 % at 400 ms; a
    // loaded machine may fire Envoy's timer late, not early).
    let (_, samples, sum) = scrape_with_samples(e, LATENCY, 4).histogram(LATENCY);
    assert_eq!(samples, 4);
    let stalled_ms = (sum - quick) / 1000.0 / 2.0;
    let floor = 400.0 - ENVOY_TIMER_GRANULARITY.as_millis() as f64;
    assert!(
        (floor * 0.9875..=400.0 * 1.0125 + 300.0).contains(&stalled_ms),
        "each stalled call took {stalled_ms} ms on Envoy's clock"
    );
}

#[test]
fn figures_of_2_to_the_31_and_more_reach_the_filter_through_webdis() {
    // Webdis 0.1.9 truncates an integer reply of 2^31 or more, and drops the
    // connection on one inside an array: the scripts send such figures as
    // strings. Here every verdict carries some: a bucket of 3e9 tokens, one
    // refilled per 2^32 ms (about 50 days), and a leased one.
    let period: u64 = 1 << 32;
    let cfg = config(
        2000,
        "deny",
        &format!(
            r#"[{{"name":"big","match":{{"pathPrefix":"/big"}},"descriptor":[{{"header":"x-user"}}],
                 "tokenBucket":{{"capacity":3000000000,"refill":3000000000,"periodMs":1000}}}},
               {{"name":"slow","match":{{"pathPrefix":"/slow"}},"descriptor":[{{"header":"x-user"}}],
                 "tokenBucket":{{"capacity":2,"refill":1,"periodMs":{period}}}}},
               {{"name":"leased","match":{{"pathPrefix":"/leased"}},"descriptor":[{{"header":"x-user"}}],
                 "tokenBucket":{{"capacity":3000000000,"refill":1,"periodMs":1000}},
                 "lease":{{"tokens":2500000000,"ttlMs":60000}}}}]"#
        ),
    );
    let stack = Stack::start(&cfg, 1);
    let e = stack.envoy();
    let user = [("x-user", "big")];
    let r = get(&e.url("/big"), &user);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-remaining"), Some("2999999999"));
    let r = get(&e.url("/slow"), &user);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-remaining"), Some("1"));
    // One token short of full: back in one period, 2^32 ms.
    let reset: u64 = r.header("x-ratelimit-reset").unwrap().parse().unwrap();
    assert_eq!(reset, period.div_ceil(1000));
    get(&e.url("/slow"), &user);
    let r = get(&e.url("/slow"), &user);
    assert_eq!(r.status, 429);
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(
        retry > (1 << 31) / 1000 && retry <= period.div_ceil(1000),
        "Retry-After {retry}"
    );
    // The lease's reply: a grant of a quarter of 3e9 (750 million) and
    // its tuple, Redis' clock and the level in credits (above 2^31).
    let r = get(&e.url("/leased"), &user);
    assert_eq!(r.status, 200);
    assert_eq!(e.counter("redis_guard.lease.fetches"), 1);
    assert_eq!(e.counter("redis_guard.redis.errors"), 0);
    assert_eq!(stack.upstream.executed(), 4, "big, slow twice, leased");
}

#[test]
fn a_limit_keyed_on_the_grpc_service_and_method_counts_each_method_apart_and_skips_other_requests()
{
    // Two a method per window for gRPC calls (a window no run crosses the
    // edge of: an hour-long one resets at the top of the hour, now and then
    // mid-test); plain HTTP on the same paths is not a gRPC call, so the
    // limit does not apply to it.
    let cfg = config(
        2000,
        "deny",
        &format!(
            r#"[{{"name":"per-method","descriptor":["grpcService","grpcMethod"],
             "fixedWindow":{{"limit":2,"windowMs":{LONG_WINDOW_MS}}}}}]"#
        ),
    );
    // gRPC calls go to the demo upstream too (it answers any POST 200),
    // not to envoy.yaml's HTTP/2 gRPC cluster: this test is about keys.
    let grpc_route = "              - match: { prefix: \"/\", grpc: {} }\n                route: { cluster: grpc_upstream, timeout: 10s }\n";
    let stack = Stack::start_edited(&cfg, 1, |yaml: String| {
        assert_eq!(yaml.matches(grpc_route).count(), 1);
        yaml.replace(grpc_route, "")
    });
    let e = stack.envoy();
    // (HTTP status, grpc-status): the filter answers a limited gRPC call
    // in gRPC's form, HTTP 200 and RESOURCE_EXHAUSTED (8).
    let call = |path: &str, content_type: &str| {
        let r = http(
            "POST",
            &e.url(path),
            &[("content-type", content_type)],
            Some(b"\0\0\0\0\0"),
        );
        (r.status, r.header("grpc-status").map(str::to_string))
    };
    let admitted = (200, None);
    let limited = (200, Some("8".to_string()));
    let grpc = "application/grpc";
    let create = "/shop.v1.Orders/Create";
    let list = "/shop.v1.Orders/List";
    assert_eq!(
        [call(create, grpc), call(create, grpc), call(create, grpc)],
        [admitted.clone(), admitted.clone(), limited.clone()]
    );
    assert_eq!(
        [
            call(list, "application/grpc+proto"),
            call(list, grpc),
            call(list, grpc)
        ],
        [admitted.clone(), admitted.clone(), limited]
    );
    for _ in 0..3 {
        assert_eq!(call(create, "application/json"), admitted, "not gRPC");
    }
    let keys = all_keys(&stack.redis);
    let mut tails: Vec<String> = keys
        .iter()
        .map(|k| {
            String::from_utf8_lossy(k)
                .split_once(&format!(":fw.2.{LONG_WINDOW_MS}:"))
                .unwrap()
                .1
                .to_string()
        })
        .collect();
    tails.sort();
    assert_eq!(
        tails,
        ["14:shop.v1.Orders:4:List", "14:shop.v1.Orders:6:Create"]
    );
    assert_eq!(stack.upstream.executed(), 2 + 2 + 3);
}

#[test]
fn every_decision_call_carries_a_nonce_that_its_reply_gives_back() {
    // README, When things fail: Webdis 0.1.9 may write a late reply to a
    // socket a new connection has since been given. The filter puts a nonce
    // first in ARGV of every decision call and takes a reply as its own only
    // if the script gave that nonce back first. These sequential requests
    // make lone calls (lua/ratelimit.lua; the batch and lease scripts share
    // lua/nonce.lua: tests/lua_ratelimit.rs calls all three with one);
    // they are decided exactly, so every reply passed that check.
    let stack = Stack::start(
        &config(
            2000,
            "deny",
            r#"[{"name":"u","descriptor":[{"header":"x-user"}],
                "tokenBucket":{"capacity":3,"refill":1,"periodMs":3600000}}]"#,
        ),
        1,
    );
    let mut con = stack.redis.conn();
    for (k, v) in [
        ("slowlog-log-slower-than", "0"),
        ("slowlog-max-len", "10000"),
    ] {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg(k)
            .arg(v)
            .query::<()>(&mut con)
            .unwrap();
    }
    // The log and the stats start together: an earlier slow call must not
    // count in one and not the other.
    for reset in [["CONFIG", "RESETSTAT"], ["SLOWLOG", "RESET"]] {
        redis::cmd(reset[0])
            .arg(reset[1])
            .query::<()>(&mut con)
            .unwrap();
    }
    let url = stack.envoys[0].url("/");
    let statuses: Vec<u16> = (0..5)
        .map(|_| get(&url, &[("x-user", "nonce")]).status)
        .collect();
    assert_eq!(statuses, [200, 200, 200, 429, 429], "decided exactly");
    let log: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(10000)
        .query(&mut con)
        .unwrap();
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        other => format!("{other:?}"),
    };
    let mut nonces = Vec::new();
    for entry in &log {
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let Some(redis::Value::Array(args)) = fields.get(3) else {
            continue;
        };
        let args: Vec<String> = args.iter().map(text).collect();
        if args.first().map(String::as_str) != Some("EVALSHA") {
            continue;
        }
        let nkeys: usize = args[2].parse().unwrap();
        let first_argv = &args[3 + nkeys];
        assert!(
            first_argv.len() == 17
                && first_argv.starts_with('~')
                && first_argv[1..].bytes().all(|b| b.is_ascii_hexdigit()),
            "a decision without its nonce: {args:?}"
        );
        nonces.push(first_argv.clone());
    }
    // Every EVALSHA Redis ran (its NOSCRIPT answers included) carried one.
    let evalsha = usize::try_from(support::command_calls(&mut con, "evalsha")).unwrap();
    assert!(evalsha >= 3, "one call at least for each admitted request");
    assert_eq!(nonces.len(), evalsha, "{nonces:?}");
    let distinct: std::collections::BTreeSet<_> = nonces.iter().collect();
    assert_eq!(
        distinct.len(),
        nonces.len(),
        "a nonce used twice: {nonces:?}"
    );
}
