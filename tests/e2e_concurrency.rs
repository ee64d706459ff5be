//! Concurrency limits end to end: real Envoys, Webdis, Redis and a slow
//! upstream that reports how many requests of each path it ran at once. A
//! slot is taken by the request's decision and given back when its stream
//! ends in any way; an Envoy renews the leases of its running requests, so
//! only a dead Envoy's slots wait for their lease to end.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use support::*;

/// One concurrency limit on /slow, per x-user. The Redis timeout is the
/// longest a lease allows (a renewal must be over before the next, every
/// quarter lease), at most 5 s.
fn config(max: u64, lease_ms: u64) -> String {
    filter_config((lease_ms / 4).min(5000))
        .limits(&format!(
            r#"[{{"name":"slots","match":{{"pathPrefix":"/slow"}},"descriptor":[{{"header":"x-user"}}],
                 "concurrency":{{"max":{max},"leaseMs":{lease_ms}}}}}]"#
        ))
        .build()
}

/// The sorted set of user `user`'s slots.
fn slots_key(con: &mut redis::Connection, user_hint: &str) -> Option<String> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*:slots:cc:*{user_hint}*"))
        .query(con)
        .unwrap();
    keys.into_iter().next()
}

fn slots_held(con: &mut redis::Connection) -> u64 {
    match slots_key(con, "") {
        Some(key) => redis::cmd("ZCARD").arg(key).query(con).unwrap(),
        None => 0,
    }
}

/// Waits (bounded) until Redis holds `n` slots; the release of a stream
/// that ended is sent as it ends, but arrives a moment later.
fn wait_for_slots(con: &mut redis::Connection, n: u64, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let held = slots_held(con);
        if held == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{held} slots held, waited for {n}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends one GET for `path` on a connection of its own and leaves it open:
/// the request runs until the upstream answers (after `delay_ms`), or until
/// the connection is dropped (the client left).
fn open_request(port: u16, path: &str, user: &str, delay_ms: u64) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let delay = delay_ms.to_string();
    let req = raw_request_bytes(
        "GET",
        path,
        "",
        &[
            ("x-user", user.as_bytes()),
            ("x-upstream-delay-ms", delay.as_bytes()),
        ],
        b"",
    );
    s.write_all(&req).unwrap();
    s
}

/// Waits (bounded) until the upstream runs `n` requests of `path`.
fn wait_in_flight(upstream: &Upstream, path: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while upstream.in_flight(path) != n {
        assert!(
            Instant::now() < deadline,
            "upstream never ran {n} of {path}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn two_envoys_under_concurrent_load_let_exactly_max_requests_reach_the_upstream_at_once() {
    let stack = Stack::start(&config(5, 30_000), 2);
    let mut con = stack.redis.conn();
    for round in 0..2 {
        // Every request arrives while the first five still run (3 s), so
        // exactly five are admitted, across both Envoys.
        let jobs: Vec<usize> = (0..40).collect();
        let path = format!("/slow?round={round}");
        let statuses = run_jobs(&jobs, 40, Duration::from_secs(60), agent, |agent, i, _| {
            let e = &stack.envoys[i % 2];
            let headers = [("x-user", "load"), ("x-upstream-delay-ms", "3000")];
            http_with(agent, "GET", &e.url(&path), &headers, None).status
        });
        let admitted = statuses.iter().filter(|s| **s == 200).count();
        let rejected = statuses.iter().filter(|s| **s == 429).count();
        assert_eq!((admitted, rejected), (5, 35), "round {round}");
        assert_eq!(stack.upstream.executions_of(&path), 5, "round {round}");
        assert_eq!(stack.upstream.peak_in_flight(&path), 5, "round {round}");
        // Every slot came back when its request ended: the next round
        // starts from an empty set, long before any lease (30 s) ends.
        wait_for_slots(&mut con, 0, Duration::from_secs(2));
    }
    let released = stack.counter("redis_guard.concurrency.released");
    assert_eq!(released, 10, "one release per admitted request");
    let cached = stack.counter("redis_guard.overlimit_cache.rejected");
    assert_eq!(cached, 0, "a concurrency 429 is never cached");
    let errors = stack.counter("redis_guard.redis.errors");
    assert_eq!(errors, 0);
}

#[test]
fn a_concurrency_limit_says_its_free_slots_and_rejects_with_retry_after_one_second() {
    let stack = Stack::start(&config(2, 30_000), 1);
    let e = stack.envoy();
    let user = [("x-user", "alice")];
    // Sequential requests: each ends (and frees its slot) before the next.
    for _ in 0..3 {
        let r = get(&e.url("/slow"), &user);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-ratelimit-limit"), Some("2"));
        assert_eq!(r.header("x-ratelimit-remaining"), Some("1"));
        assert_eq!(r.header("x-ratelimit-reset"), Some("0"));
        // No window: capacity comes back when requests end.
        assert_eq!(r.header("ratelimit-policy"), Some("\"slots\";q=2"));
        assert_eq!(r.header("ratelimit"), Some("\"slots\";r=1;t=0"));
    }
    let _a = open_request(e.port, "/slow?a", "alice", 10_000);
    let _b = open_request(e.port, "/slow?b", "alice", 10_000);
    wait_in_flight(&stack.upstream, "/slow?a", 1);
    wait_in_flight(&stack.upstream, "/slow?b", 1);
    let r = get(&e.url("/slow"), &user);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(r.json()["limits"], serde_json::json!(["slots"]));
    // Another descriptor has slots of its own.
    assert_eq!(get(&e.url("/slow"), &[("x-user", "bob")]).status, 200);
}

#[test]
fn a_client_that_leaves_frees_its_slot_at_once() {
    let stack = Stack::start(&config(1, 30_000), 1);
    let e = stack.envoy();
    let mut con = stack.redis.conn();
    let user = [("x-user", "carol")];
    let client = open_request(e.port, "/slow?left", "carol", 10_000);
    wait_in_flight(&stack.upstream, "/slow?left", 1);
    assert_eq!(
        get(&e.url("/slow?next"), &user).status,
        429,
        "the slot is held"
    );
    drop(client);
    // The lease is 30 s: only the release frees the slot this soon.
    wait_for_slots(&mut con, 0, Duration::from_secs(2));
    assert_eq!(get(&e.url("/slow?next"), &user).status, 200);
    assert_eq!(e.counter("redis_guard.concurrency.released"), 2);
}

#[test]
fn an_envoy_killed_with_sigkill_frees_its_slots_when_their_lease_ends() {
    const LEASE_MS: u64 = 1500;
    let mut stack = Stack::start(&config(2, LEASE_MS), 2);
    let other = stack.envoys[1].url("/slow?after");
    let user = [("x-user", "dave")];
    let port = stack.envoys[0].port;
    let _a = open_request(port, "/slow?a", "dave", 10_000);
    let _b = open_request(port, "/slow?b", "dave", 10_000);
    wait_in_flight(&stack.upstream, "/slow?a", 1);
    wait_in_flight(&stack.upstream, "/slow?b", 1);
    // Longer than a lease: the slots live on renewals.
    std::thread::sleep(Duration::from_millis(LEASE_MS + 500));
    assert_eq!(get(&other, &user).status, 429, "renewed past their lease");
    stack.envoys[0].kill();
    let killed = Instant::now();
    // Renewed every 375 ms, so the last lease ends 1125 to 1500 ms after
    // the kill: rejected until then, admitted after.
    let mut first_admitted = None;
    while killed.elapsed() < Duration::from_millis(LEASE_MS + 3000) {
        let status = get(&other, &user).status;
        if status == 200 {
            first_admitted = Some(killed.elapsed());
            break;
        }
        assert_eq!(status, 429);
        std::thread::sleep(Duration::from_millis(50));
    }
    let after = first_admitted.expect("the dead Envoy's slots never came back");
    assert!(
        after >= Duration::from_millis(LEASE_MS - 600),
        "freed {after:?} after the kill, before the lease could end"
    );
    assert!(
        after <= Duration::from_millis(LEASE_MS + 1000),
        "freed only {after:?} after the kill"
    );
}

#[test]
fn a_stream_longer_than_its_lease_keeps_its_slot() {
    const LEASE_MS: u64 = 600;
    let stack = Stack::start(&config(1, LEASE_MS), 2);
    let user = [("x-user", "erin")];
    let other = stack.envoys[1].url("/slow?other");
    let started = Instant::now();
    let long = std::thread::scope(|s| {
        let url = stack.envoys[0].url("/slow?long");
        let long = s.spawn(move || {
            let headers = [("x-user", "erin"), ("x-upstream-delay-ms", "3500")];
            http_with(&agent(), "GET", &url, &headers, None).status
        });
        wait_in_flight(&stack.upstream, "/slow?long", 1);
        // Five leases long: every check comes after at least one lease ended.
        let mut checks = 0;
        while started.elapsed() < Duration::from_millis(3000) {
            assert_eq!(get(&other, &user).status, 429, "at {:?}", started.elapsed());
            checks += 1;
            std::thread::sleep(Duration::from_millis(250));
        }
        assert!(checks >= 8, "{checks} checks");
        long.join().unwrap()
    });
    assert_eq!(long, 200);
    assert_eq!(get(&other, &user).status, 200, "free once the stream ended");
    let e = &stack.envoys[0];
    // Renewed every 150 ms for 3.5 s.
    let renewed = e.counter("redis_guard.concurrency.renewed");
    assert!((15..=24).contains(&renewed), "{renewed} renewals");
    assert_eq!(e.counter("redis_guard.concurrency.lost"), 0);
}

#[test]
fn a_client_sending_one_request_after_another_never_finds_its_own_slot_still_taken() {
    // The response's last piece waits for the release: once the client has
    // the whole response, its slot is free, on either Envoy.
    let stack = Stack::start(&config(1, 30_000), 2);
    let agent = agent();
    for i in 0..40 {
        let e = &stack.envoys[i % 2];
        let r = http_with(&agent, "GET", &e.url("/slow"), &[("x-user", "frank")], None);
        assert_eq!(r.status, 200, "request {i}");
        assert_eq!(r.header("x-ratelimit-remaining"), Some("0"), "request {i}");
    }
    let released = stack.counter("redis_guard.concurrency.released");
    assert_eq!(released, 40);
}
