//! Failure handling end to end: Redis and Webdis stopped and started for real
//! under a running Envoy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use support::probe::*;
use support::*;

/// `/open` fails open, `/closed` fails closed; the breaker opens after 3
/// consecutive failures per worker and probes after 300 ms.
fn config() -> String {
    filter_config(300)
        .circuit_breaker(3, 300)
        .failure_mode("allow")
        .limits(
            r#"[
    {"name":"open","match":{"pathPrefix":"/open"},"slidingWindow":{"limit":100000,"windowMs":60000}},
    {"name":"closed","match":{"pathPrefix":"/closed"},"failureMode":"deny",
     "slidingWindow":{"limit":100000,"windowMs":60000}}]"#,
        )
        .build()
}

/// Sends `/closed` until it is decided by Redis again (200); returns how long
/// that took. Bounded to 5 s.
fn time_to_recover(e: &Envoy) -> Duration {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if get(&e.url("/closed"), &[]).status == 200 {
            return t.elapsed();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("not back on Redis within 5 s");
}

fn outage_is_answered_by_the_failure_modes(e: &Envoy) {
    let calls_before = e.counter("redis_guard.redis.calls");
    let errors_before = e.counter("redis_guard.redis.errors");
    let skipped_before = e.counter("redis_guard.circuit.short_circuited");
    for _ in 0..20 {
        let t = Instant::now();
        assert_eq!(get(&e.url("/closed"), &[]).status, 503);
        assert_eq!(get(&e.url("/open"), &[]).status, 200);
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "took {:?}",
            t.elapsed()
        );
    }
    let calls = e.counter("redis_guard.redis.calls") - calls_before;
    let errors = e.counter("redis_guard.redis.errors") - errors_before;
    let skipped = e.counter("redis_guard.circuit.short_circuited") - skipped_before;
    // Every one of the 40 requests was either tried and failed, or sent to
    // its failure mode by an open breaker without a call.
    assert_eq!(errors + skipped, 40);
    assert!(e.counter("redis_guard.circuit.opened") >= 1);
    assert!(skipped > 0, "the open breaker spared Redis");
    // A tried request costs its call plus at most 3 paused retries.
    assert!(
        calls <= 4 * errors,
        "{calls} calls for {errors} failed requests"
    );
}

#[test]
fn a_stopped_redis_opens_the_breaker_and_the_filter_recovers_by_itself() {
    let mut stack = Stack::start(&config(), 1);
    let up_before = stack.envoy().uptime();
    let started = Instant::now();
    assert_eq!(get(&stack.envoy().url("/closed"), &[]).status, 200);
    stack.redis.stop();
    outage_is_answered_by_the_failure_modes(stack.envoy());
    let denied = stack.envoy().counter("redis_guard.failure_mode.denied");
    stack.redis.restart();
    let took = time_to_recover(stack.envoy());
    assert!(took < Duration::from_secs(2), "recovered after {took:?}");
    // Same Envoy, no restart: the process started with the stack is still
    // running, the server's uptime kept growing across the outage (whole
    // seconds: its clock and ours may each be up to 1 s apart), and the
    // filter's counters from the outage are still there (a new Envoy or a
    // reloaded VM would start them at 0).
    let e = &mut stack.envoys[0];
    assert!(e.alive(), "envoy (pid {}) exited", e.pid());
    let grew = e.uptime().saturating_sub(up_before);
    assert!(
        grew + Duration::from_secs(1) >= started.elapsed(),
        "uptime grew {grew:?} in {:?}",
        started.elapsed()
    );
    assert_eq!(denied, 20, "every /closed request of the outage");
    assert!(e.counter("redis_guard.failure_mode.denied") >= denied);
}

#[test]
fn a_restarted_webdis_is_used_again_without_restarting_envoy() {
    let mut stack = Stack::start(&config(), 1);
    assert_eq!(get(&stack.envoy().url("/closed"), &[]).status, 200);
    stack.webdis.stop();
    outage_is_answered_by_the_failure_modes(stack.envoy());
    stack.webdis.restart();
    let took = time_to_recover(stack.envoy());
    assert!(took < Duration::from_secs(2), "recovered after {took:?}");
}

#[test]
fn with_local_mode_a_dead_redis_leaves_each_envoy_its_local_budget() {
    // 100 per hour globally; each Envoy may admit a tenth (10) on its own,
    // a unit back every 6 minutes: none while the 30 requests run, however
    // slow the machine (a minute's window gave one back every 6 s).
    let cfg = r#"{"redis":{"cluster":"webdis","timeoutMs":300},
      "limits":[{"name":"api","descriptor":[{"literal":"all"}],"failureMode":"local",
                 "localFraction":0.1,"slidingWindow":{"limit":100,"windowMs":3600000}}]}"#;
    let mut stack = Stack::start(cfg, 2);
    for e in &stack.envoys {
        assert_eq!(get(&e.url("/x"), &[]).status, 200);
    }
    stack.redis.stop();
    let before = stack.upstream.executed();
    for e in &stack.envoys {
        let statuses: Vec<u16> = (0..30).map(|_| get(&e.url("/x"), &[]).status).collect();
        let admitted = statuses.iter().filter(|s| **s == 200).count();
        let rejected = statuses.iter().filter(|s| **s == 429).count();
        assert_eq!(
            (admitted, rejected),
            (10, 20),
            "per Envoy, both workers on one budget"
        );
        assert_eq!(e.counter("redis_guard.local.allowed"), 10);
    }
    assert_eq!(stack.upstream.executed() - before, 20);
}

#[test]
fn a_local_mode_429_carries_retry_after_and_no_rate_limit_fields() {
    // 10 per minute globally; on its own this Envoy may admit a tenth of
    // that per minute: a bucket of 1 that refills one token every 60 s.
    let cfg = r#"{"redis":{"cluster":"webdis","timeoutMs":300},
      "limits":[{"name":"api","descriptor":[{"literal":"all"}],"failureMode":"local",
                 "localFraction":0.1,"slidingWindow":{"limit":10,"windowMs":60000}}]}"#;
    let mut stack = Stack::start(cfg, 1);
    let e = stack.envoy();
    // Decided by Redis, the answer advertises the limit.
    let by_redis = get(&e.url("/x"), &[]);
    assert_eq!(by_redis.status, 200);
    assert_eq!(
        rate_limit_fields(&by_redis.headers),
        [
            "ratelimit-policy",
            "ratelimit",
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset"
        ]
    );
    stack.redis.stop();
    let e = stack.envoy();
    let started = Instant::now();
    let admitted = get(&e.url("/x"), &[]);
    assert_eq!(admitted.status, 200);
    assert_eq!(rate_limit_fields(&admitted.headers), Vec::<String>::new());
    let rejected = get(&e.url("/x"), &[]);
    let between = started.elapsed();
    assert_eq!(rejected.status, 429, "the local budget of 1 is spent");
    assert_eq!(
        e.counter("redis_guard.local.rejected"),
        1,
        "decided locally"
    );
    // The local bucket knows when its next token comes: 60 s after the
    // token it gave, less the whole seconds since (none, unless this
    // machine took a second between the two decisions)...
    let retry_after: u64 = rejected.header("retry-after").unwrap().parse().unwrap();
    let earliest = 60 - between.as_secs().min(59);
    assert!(
        (earliest..=60).contains(&retry_after),
        "retry-after {retry_after}, {between:?} after the token was taken"
    );
    // ...but not the global count: no RateLimit field claims one.
    assert_eq!(rate_limit_fields(&rejected.headers), Vec::<String>::new());
    assert_eq!(
        rejected.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(rejected.json()["status"], 429);
}

/// `threads` clients send `per_thread` GETs to `url` each; statuses counted.
fn burst(url: &str, threads: usize, per_thread: usize) -> BTreeMap<u16, usize> {
    burst_counting(url, threads, per_thread, &AtomicUsize::new(0))
}

/// The same, adding one to `answered` as each response arrives, so another
/// thread can act at a known point of the burst.
fn burst_counting(
    url: &str,
    threads: usize,
    per_thread: usize,
    answered: &AtomicUsize,
) -> BTreeMap<u16, usize> {
    let counts = std::sync::Mutex::new(BTreeMap::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let agent = agent();
                for _ in 0..per_thread {
                    let status = http_with(&agent, "GET", url, &[], None).status;
                    *counts.lock().unwrap().entry(status).or_insert(0) += 1;
                    answered.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    counts.into_inner().unwrap()
}

#[test]
fn under_load_a_killed_redis_changes_only_who_decides() {
    let cfg = r#"{"redis":{"cluster":"webdis","timeoutMs":300},"failureMode":"allow",
      "limits":[
        {"name":"open","match":{"pathPrefix":"/open"},"slidingWindow":{"limit":100000,"windowMs":60000}},
        {"name":"closed","match":{"pathPrefix":"/closed"},"failureMode":"deny",
         "slidingWindow":{"limit":100000,"windowMs":60000}},
        {"name":"local","match":{"pathPrefix":"/local"},"failureMode":"local","localFraction":0.01,
         "slidingWindow":{"limit":1000,"windowMs":60000}}]}"#;
    let mut stack = Stack::start(cfg, 1);
    let open = stack.envoy().url("/open");
    // Redis dies in the middle of a burst (after 50 of its 200 requests were
    // answered): fail-open traffic never notices.
    let answered = AtomicUsize::new(0);
    let (counts, before_stop, after_stop) = std::thread::scope(|s| {
        let load = s.spawn(|| burst_counting(&open, 8, 25, &answered));
        poll(
            "50 requests of the burst answered",
            Duration::from_secs(30),
            || (answered.load(Ordering::SeqCst) >= 50).then_some(()),
        );
        let before_stop = answered.load(Ordering::SeqCst);
        stack.redis.stop();
        let after_stop = answered.load(Ordering::SeqCst);
        (load.join().unwrap(), before_stop, after_stop)
    });
    assert_eq!(counts, [(200, 200)].into(), "allow: every request served");
    let e = stack.envoy();
    // Who decided: Redis admitted every request answered before it was
    // stopped, and at most the 8 in flight besides; the failure mode took
    // every later one. Together, every request exactly once.
    let by_redis = e.counter("redis_guard.ratelimit.open.allowed");
    let by_failure_mode = e.counter("redis_guard.failure_mode.allowed");
    assert_eq!(by_redis + by_failure_mode, 200);
    assert_eq!(e.counter("redis_guard.ratelimit.open.checked"), 200);
    assert!(by_redis >= before_stop as u64, "{by_redis} < {before_stop}");
    assert!(
        by_failure_mode >= (200 - after_stop - 8) as u64,
        "only {by_failure_mode} met the failure mode, {after_stop} answered at the stop"
    );
    // Each of those was a failed call or a call the open breaker spared.
    assert_eq!(
        e.counter("redis_guard.redis.errors") + e.counter("redis_guard.circuit.short_circuited"),
        by_failure_mode
    );
    // Fail-closed traffic: every request answered 503 within the timeout.
    let t = Instant::now();
    let closed = burst(&e.url("/closed"), 8, 5);
    assert_eq!(closed, [(503, 40)].into());
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "40 requests took {:?}",
        t.elapsed()
    );
    // Local: 1% of 1000 = 10 per Envoy, both workers on one budget.
    let local = burst(&e.url("/local"), 8, 5);
    assert_eq!(local, [(200, 10), (429, 30)].into());
}

/// One Envoy reaching Webdis through a relay that can hand a call another
/// call's reply (what Webdis 0.1.9 does), failing closed; one token an hour
/// per x-user. The servers are returned so they live as long as the test.
fn behind_a_replaying_relay() -> (Redis, Webdis, Upstream, WebdisReplaying, Envoy) {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    webdis.wait_until_redis_answers();
    let relay = WebdisReplaying::start(webdis.port);
    let upstream = Upstream::start();
    let cfg = filter_config(2000)
        .failure_mode("deny")
        .limits(
            r#"[{"name":"u","descriptor":[{"header":"x-user"}],
                 "tokenBucket":{"capacity":1,"refill":1,"periodMs":3600000}}]"#,
        )
        .build();
    let envoy = Envoy::start(&cfg, relay.port, upstream.port);
    (redis, webdis, upstream, relay, envoy)
}

#[test]
fn a_reply_webdis_hands_to_the_wrong_call_is_taken_as_no_answer_not_as_a_verdict() {
    let (_redis, _webdis, _upstream, relay, envoy) = behind_a_replaying_relay();
    let url = envoy.url("/");
    let status = |user: &str| get(&url, &[("x-user", user)]).status;
    assert_eq!(status("ann"), 200);
    assert_eq!(status("ann"), 429, "ann's one token is spent");
    // Bob's call now gets the reply Webdis gave ann's: her rejection. It is
    // not his call's (its nonce is another), so it decides nothing: the
    // failure mode, as for a call that got no answer.
    relay.arm();
    assert_eq!(
        status("bob"),
        503,
        "ann's verdict must not decide bob's request"
    );
    assert_eq!(relay.replayed(), 1);
    assert_eq!(envoy.counter("redis_guard.redis.errors_by_kind.timeout"), 1);
    assert_eq!(envoy.counter("redis_guard.failure_mode.denied"), 1);
    assert!(envoy.log().contains("not this call's"), "{}", envoy.log());
    // His call did run (the relay passed it on): his one token is spent, as
    // for any call whose answer was lost.
    assert_eq!(status("bob"), 429);
}

#[test]
fn a_reply_webdis_hands_to_the_wrong_eval_is_not_its_verdict_either() {
    // After a NOSCRIPT (a restarted Redis has no scripts) a call goes again
    // as EVAL with its script's source: it carries a nonce too. make soak
    // once saw a keyed request answered with another tenant's stored
    // response during a Redis restart, when EVAL carried none.
    let (redis, _webdis, _upstream, relay, envoy) = behind_a_replaying_relay();
    let url = envoy.url("/");
    let status = |user: &str| get(&url, &[("x-user", user)]).status;
    let flush = || {
        redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query::<()>(&mut redis.conn())
            .unwrap()
    };
    let reloads = || envoy.counter("redis_guard.redis.script_reloads");
    assert_eq!(status("ann"), 200);
    let before = reloads();
    // Ann's rejection comes back to an EVAL: Redis had lost the script.
    flush();
    assert_eq!(status("ann"), 429, "ann's one token is spent");
    assert_eq!(reloads(), before + 1);
    // Bob's EVAL now gets the reply Webdis gave ann's: it is not his.
    flush();
    relay.arm_eval();
    assert_eq!(
        status("bob"),
        503,
        "ann's verdict must not decide bob's request"
    );
    assert_eq!(relay.replayed(), 1);
    assert_eq!(reloads(), before + 2);
    assert_eq!(envoy.counter("redis_guard.failure_mode.denied"), 1);
    assert!(envoy.log().contains("not this call's"), "{}", envoy.log());
    // His EVAL did run: his one token is spent.
    assert_eq!(status("bob"), 429);
}
