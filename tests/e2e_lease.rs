//! Token leases end to end, two Envoy processes (two workers each) sharing one
//! bucket in Redis. A leased token leaves Redis before any request spends it,
//! so the Envoys together never admit more than the bucket holds; an Envoy
//! that stops getting traffic strands at most one batch (`tokens`) until its
//! lease ends. Both bounds are asserted exactly, with no refill during the
//! test (one token per hour).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::probe::*;
use support::*;

fn config(capacity: u64, tokens: u64, ttl_ms: u64) -> String {
    filter_config(2000)
        .limits(&format!(
            r#"[{{"name":"leased","match":{{"pathPrefix":"/api/"}},
            "descriptor":[{{"header":"x-user"}}],
            "tokenBucket":{{"capacity":{capacity},"refill":1,"periodMs":3600000}},
            "lease":{{"tokens":{tokens},"ttlMs":{ttl_ms}}}}}]"#
        ))
        .build()
}

fn status(e: &Envoy) -> u16 {
    get(&e.url("/api/x"), &[("x-user", "u")]).status
}

fn admitted(e: &Envoy, n: usize) -> usize {
    (0..n).filter(|_| status(e) == 200).count()
}

#[test]
fn an_envoy_that_stops_getting_traffic_strands_exactly_one_batch() {
    // 20 tokens, batches of 5, leases that outlive the test.
    let stack = Stack::start(&config(20, 5, 600_000), 2);
    let (e1, e2) = (&stack.envoys[0], &stack.envoys[1]);

    // e1 fetches: its request plus 5 tokens leave the bucket (14 left).
    assert_eq!(admitted(e1, 1), 1);
    assert_eq!(e1.counter("redis_guard.lease.fetches"), 1);
    // All other traffic goes to e2, which can only get the 14 still in Redis.
    assert_eq!(admitted(e2, 30), 14);
    // 20 - 5: e1's unspent batch is the whole shortfall.
    assert_eq!(stack.upstream.executed(), 15);

    // Traffic back at e1: it spends its batch without deciding a request in
    // Redis (its only calls are background fetches, which find the bucket
    // empty), then is refused.
    let calls = e1.counter("redis_guard.redis.calls");
    let fetches = e1.counter("redis_guard.lease.fetches");
    assert_eq!(admitted(e1, 5), 5);
    assert_eq!(e1.counter("redis_guard.lease.spent"), 5);
    // A background fetch is counted as a call when queued and as a fetch
    // when answered: wait (bounded) for the answers before comparing.
    let start = std::time::Instant::now();
    let (sent, answered) = loop {
        let sent = e1.counter("redis_guard.redis.calls") - calls;
        let answered = e1.counter("redis_guard.lease.fetches") - fetches;
        if sent == answered || start.elapsed() > Duration::from_secs(3) {
            break (sent, answered);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(answered >= 1, "the low batch started a fetch");
    assert_eq!(sent, answered, "every call was a lease fetch");
    assert_eq!(admitted(e1, 3), 0);
    // Exactly the bucket, no more.
    assert_eq!(stack.upstream.executed(), 20);
}

#[test]
fn an_unspent_batch_lapses_with_its_lease_and_is_never_spent_after() {
    // Leases of 2 s: e1's batch is void before it gets traffic again (and
    // long enough for e2 to spend its own on a loaded machine).
    let stack = Stack::start(&config(10, 4, 2_000), 2);
    let (e1, e2) = (&stack.envoys[0], &stack.envoys[1]);
    assert_eq!(admitted(e1, 1), 1);
    assert_eq!(admitted(e2, 20), 5, "10 - 1 - 4 held by e1");
    // Wait out e1's lease (the proxy's clock; no refill in an hour).
    std::thread::sleep(Duration::from_millis(2_100));
    assert_eq!(admitted(e1, 5), 0, "the lapsed batch is gone");
    assert_eq!(stack.upstream.executed(), 6);
}

#[test]
fn two_envoys_under_concurrent_load_never_admit_more_than_the_bucket() {
    let capacity = 40;
    let stack = Arc::new(Stack::start(&config(capacity, 8, 600_000), 2));
    let ok = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let stack = Arc::clone(&stack);
            let ok = Arc::clone(&ok);
            std::thread::spawn(move || {
                let agent = agent();
                let e = &stack.envoys[t % 2];
                // Bounded: 15 requests per thread, 120 in all.
                for _ in 0..15 {
                    let r = http_with(&agent, "GET", &e.url("/api/x"), &[("x-user", "u")], None);
                    assert!(r.status == 200 || r.status == 429, "{}", r.status);
                    if r.status == 200 {
                        ok.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let admitted = ok.load(Ordering::SeqCst);
    assert_eq!(stack.upstream.executed(), admitted);
    // Never more than the bucket; never fewer than the bucket minus one
    // unspent batch per Envoy.
    assert!(admitted <= capacity, "over-admitted: {admitted}");
    assert!(admitted >= capacity - 2 * 8, "under-admitted: {admitted}");
    // Whatever was not admitted is held by the Envoys, not lost in Redis:
    // draining both (sequentially) reaches the bucket exactly.
    let more = admitted_both(&stack, 40);
    assert_eq!(admitted + more, capacity);
}

fn admitted_both(stack: &Stack, n: usize) -> u64 {
    (0..n)
        .map(|i| status(&stack.envoys[i % 2]))
        .filter(|s| *s == 200)
        .count() as u64
}

/// The full set of rate-limit fields a response decided by Redis carries.
const ALL_FIELDS: [&str; 5] = [
    "ratelimit-policy",
    "ratelimit",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
];

fn fields(r: &Resp) -> Vec<String> {
    rate_limit_fields(&r.headers)
}

fn leased_get(e: &Envoy) -> Resp {
    let r = get(&e.url("/api/x"), &[("x-user", "u")]);
    assert_eq!(r.status, 200);
    r
}

#[test]
fn locally_admitted_requests_carry_no_rate_limit_fields_and_the_fetching_request_does() {
    // Batches of 4: the fetch takes the request's token and 4 more.
    let stack = Stack::start(&config(100, 4, 600_000), 1);
    let e = stack.envoy();
    let fetching = leased_get(e);
    assert_eq!(e.counter("redis_guard.lease.fetches"), 1);
    assert_eq!(fields(&fetching), ALL_FIELDS);
    assert_eq!(fetching.header("x-ratelimit-remaining"), Some("95"));
    // Two spends leave 2 of 4: not below half, so no fetch and no call.
    let calls = e.counter("redis_guard.redis.calls");
    for _ in 0..2 {
        let local = leased_get(e);
        assert_eq!(fields(&local), Vec::<String>::new(), "{:?}", local.headers);
    }
    assert_eq!(e.counter("redis_guard.lease.spent"), 2);
    assert_eq!(e.counter("redis_guard.redis.calls"), calls);
    assert_eq!(stack.upstream.executed(), 3);
}

/// Scripts Redis holds (SCRIPT FLUSH empties it; EVAL adds one).
fn cached_scripts(redis: &Redis) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query(&mut redis.conn())
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("number_of_cached_scripts:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn a_background_fetch_meeting_noscript_is_dropped_and_the_next_fetching_request_reloads() {
    // Batches of 2: a spend that leaves 0 (below half) starts a background fetch.
    let stack = Stack::start(&config(100, 2, 600_000), 1);
    let e = stack.envoy();
    let c = |name: &str| e.counter(&format!("redis_guard.{name}"));
    leased_get(e);
    assert_eq!((c("lease.fetches"), c("redis.script_reloads")), (1, 1));
    // Redis loses its scripts (as after a restart), the Envoy keeps its 2 tokens.
    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query::<()>(&mut stack.redis.conn())
        .unwrap();
    assert_eq!(cached_scripts(&stack.redis), 0);
    let calls = c("redis.calls");
    leased_get(e);
    assert_eq!(c("redis.calls"), calls, "1 of 2 left: no fetch yet");
    // The last token: its spend sends a fetch from the root context, which
    // meets NOSCRIPT and is dropped (an unreadable lease reply).
    leased_get(e);
    poll_eq(
        "the background fetch answered",
        1,
        Duration::from_secs(5),
        || c("redis.errors_by_kind.reply"),
    );
    assert_eq!(c("redis.calls"), calls + 1);
    assert_eq!(c("redis.errors"), 1);
    assert_eq!(c("lease.spent"), 2);
    assert_eq!(c("lease.fetches"), 1, "nothing granted");
    assert_eq!(c("redis.script_reloads"), 1, "not reloaded by the fetch");
    assert_eq!(cached_scripts(&stack.redis), 0);
    // No tokens left and no fetch out: this request fetches itself, meets
    // NOSCRIPT, and loads the script with EVAL.
    let fetching = leased_get(e);
    assert_eq!(fields(&fetching), ALL_FIELDS);
    assert_eq!(c("redis.calls"), calls + 1 + 2);
    assert_eq!(c("redis.script_reloads"), 2);
    assert_eq!(c("lease.fetches"), 2);
    assert_eq!(cached_scripts(&stack.redis), 1);
    // 100 - (1 + 2) at the first fetch - (1 + 2) now: the dropped fetch
    // took nothing from the bucket.
    assert_eq!(fetching.header("x-ratelimit-remaining"), Some("94"));
    assert_eq!(stack.upstream.executed(), 4);
}
