//! The limit kinds beyond the token bucket and the sliding-window log (GCRA,
//! fixed window, sliding-window counter) end to end: real Envoys, Webdis and
//! Redis. Each admits exactly its budget across two Envoys under concurrent
//! load, and answers with its own headers and Retry-After.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use support::*;

/// A window no test run can cross the edge of: 2^40 ms (about 35 years),
/// aligned to the Unix epoch, so its current window ends in 2039.
const LONG_WINDOW_MS: u64 = 1 << 40;

/// One limit per kind, each on its own path, keyed by x-user.
fn config(gcra: &str, fixed: &str, counter: &str) -> String {
    filter_config(5000)
        .limits(&format!(
            r#"[{{"name":"g","match":{{"pathPrefix":"/gcra"}},"descriptor":[{{"header":"x-user"}}],
                 "gcra":{gcra}}},
               {{"name":"f","match":{{"pathPrefix":"/fw"}},"descriptor":[{{"header":"x-user"}}],
                 "fixedWindow":{fixed}}},
               {{"name":"s","match":{{"pathPrefix":"/swc"}},"descriptor":[{{"header":"x-user"}}],
                 "slidingWindowCounter":{counter}}}]"#
        ))
        .build()
}

#[test]
fn two_envoys_under_concurrent_load_admit_exactly_each_kinds_budget() {
    // GCRA: a burst of 30, then one per hour; the windows: 30 per window
    // that no run crosses the edge of.
    let cfg = config(
        r#"{"rate":1,"periodMs":3600000,"burst":30}"#,
        &format!(r#"{{"limit":30,"windowMs":{LONG_WINDOW_MS}}}"#),
        &format!(r#"{{"limit":30,"windowMs":{LONG_WINDOW_MS}}}"#),
    );
    let stack = Stack::start(&cfg, 2);
    for path in ["/gcra", "/fw", "/swc"] {
        let jobs: Vec<usize> = (0..80).collect();
        let statuses = run_jobs(&jobs, 32, Duration::from_secs(60), agent, |agent, i, _| {
            let e = &stack.envoys[i % 2];
            http_with(agent, "GET", &e.url(path), &[("x-user", "load")], None).status
        });
        let admitted = statuses.iter().filter(|s| **s == 200).count();
        let rejected = statuses.iter().filter(|s| **s == 429).count();
        assert_eq!((admitted, rejected), (30, 50), "{path}: exactly the budget");
        assert_eq!(stack.upstream.executions_of(path), 30, "{path}");
    }
    let errors = stack.counter("redis_guard.redis.errors");
    assert_eq!(errors, 0);
}

/// Ms since the Unix epoch on this machine, which runs Redis too.
fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

#[test]
fn each_kind_admits_its_budget_with_its_headers_then_answers_429_with_retry_after() {
    let cfg = config(
        // 3 at once, then one every 20 s: a minute from empty to full (the
        // fourth request must come before a unit is back, on any machine).
        r#"{"rate":1,"periodMs":20000,"burst":3}"#,
        &format!(r#"{{"limit":3,"windowMs":{LONG_WINDOW_MS}}}"#),
        &format!(r#"{{"limit":3,"windowMs":{LONG_WINDOW_MS}}}"#),
    );
    let stack = Stack::start(&cfg, 1);
    let e = stack.envoy();
    let mut con = stack.redis.conn();
    let user = [("x-user", "alice")];
    for (path, name, window_s) in [
        ("/gcra", "g", 60),
        ("/fw", "f", LONG_WINDOW_MS.div_ceil(1000)),
        ("/swc", "s", LONG_WINDOW_MS.div_ceil(1000)),
    ] {
        // Redis' clock, which the scripts read, before the first request.
        let first = redis_now_ms(&mut con);
        for remaining in ["2", "1", "0"] {
            let r = get(&e.url(path), &user);
            assert_eq!(r.status, 200, "{path}");
            assert_eq!(r.header("x-ratelimit-limit"), Some("3"), "{path}");
            assert_eq!(r.header("x-ratelimit-remaining"), Some(remaining), "{path}");
            assert_eq!(
                r.header("ratelimit-policy"),
                Some(format!("\"{name}\";q=3;w={window_s}").as_str()),
                "{path}"
            );
        }
        let sent = redis_now_ms(&mut con);
        let r = get(&e.url(path), &user);
        let answered = redis_now_ms(&mut con);
        assert_eq!(r.status, 429, "{path}");
        let retry: i64 = r.header("retry-after").unwrap().parse().unwrap();
        assert_eq!(r.header("x-ratelimit-remaining"), Some("0"), "{path}");
        // When a unit is back, on Redis' clock. GCRA: 20 s after the first
        // of the burst (decided at or after `first`, at or before `sent`).
        // The windows: at the end of the current one (the next multiple of
        // 2^40 ms since the epoch), and the counter 1 ms later: its three
        // units weigh less than 3 from 1 ms into the next window
        // (floor(3 (W - 1) / W) = 2).
        let (earliest, latest) = match path {
            "/gcra" => (first + 20_000, sent + 20_000),
            _ => {
                let end = i64::try_from((now_ms() / LONG_WINDOW_MS + 1) * LONG_WINDOW_MS).unwrap();
                let late = i64::from(path == "/swc");
                (end + late, end + late)
            }
        };
        // Retry-After rounds the wait from the 429's decision, made between
        // `sent` and `answered`, up to whole seconds.
        let up_to_s = |ms: i64| (ms.max(0) + 999) / 1000;
        let (lo, hi) = (up_to_s(earliest - answered), up_to_s(latest - sent));
        assert!(
            (lo..=hi).contains(&retry),
            "{path}: Retry-After {retry}, not within {lo}..={hi}"
        );
    }
    assert_eq!(
        stack.upstream.executed(),
        9,
        "three per kind reached the upstream"
    );
}

#[test]
fn with_redis_down_each_kind_takes_its_failure_mode_and_gcra_runs_locally_as_its_bucket() {
    // GCRA in `local` mode with the whole budget local (localFraction 1):
    // the Envoy's own bucket of capacity `burst` admits 3, then 429. The
    // fixed window denies; the counter allows.
    let cfg = filter_config(300)
        .limits(
            r#"[{"name":"g","match":{"pathPrefix":"/gcra"},"descriptor":[{"header":"x-user"}],
                 "gcra":{"rate":1,"periodMs":3600000,"burst":3},
                 "failureMode":"local","localFraction":1},
               {"name":"f","match":{"pathPrefix":"/fw"},"descriptor":[{"header":"x-user"}],
                 "fixedWindow":{"limit":3,"windowMs":60000},"failureMode":"deny"},
               {"name":"s","match":{"pathPrefix":"/swc"},"descriptor":[{"header":"x-user"}],
                 "slidingWindowCounter":{"limit":3,"windowMs":60000},"failureMode":"allow"}]"#,
        )
        .build();
    let mut stack = Stack::start(&cfg, 1);
    stack.redis.stop();
    let e = stack.envoy();
    let agent = agent();
    let user = [("x-user", "down")];
    let local: Vec<u16> = (0..4)
        .map(|_| http_with(&agent, "GET", &e.url("/gcra"), &user, None).status)
        .collect();
    assert_eq!(local, [200, 200, 200, 429], "the local bucket: burst 3");
    assert_eq!(
        http_with(&agent, "GET", &e.url("/fw"), &user, None).status,
        503
    );
    assert_eq!(
        http_with(&agent, "GET", &e.url("/swc"), &user, None).status,
        200
    );
    assert_eq!(e.counter("redis_guard.local.allowed"), 3);
    assert_eq!(e.counter("redis_guard.local.rejected"), 1);
    assert_eq!(e.counter("redis_guard.failure_mode.denied"), 1);
    assert_eq!(e.counter("redis_guard.failure_mode.allowed"), 1);
    assert_eq!(stack.upstream.executed(), 4, "3 local, 1 allowed");
}
