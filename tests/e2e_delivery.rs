//! The idempotency writes after the decision are delivered, not sent once:
//! a store of a completed response, or the release of a lock whose acquire
//! went unanswered, that meets a fault is kept by the worker's root and sent
//! again until it lands or the lock's TTL passes. Through a real Envoy,
//! Webdis and Redis, with Webdis killed as the store goes out: once it is
//! back, a retry of the key is a replay of the one run (not a 409 until
//! `lockTtlMs`, not a second run). The release's delivery is the same code
//! path (src/filter/tests/delivered.rs, idempotency.rs).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::{Duration, Instant};

use support::probe::poll;
use support::*;

/// Keyed POSTs to /pay: a 20 s lock (far beyond the test's waits, so only a
/// delivered write frees or completes it in time), calls of 300 ms, and
/// `deny` (the test harness' default): a keyed request Redis cannot decide
/// is a 503, never run unguarded.
fn config() -> String {
    filter_config(300)
        .idempotency(r#"[{"name":"pay","match":{"pathPrefix":"/pay"},"lockTtlMs":20000}]"#)
        .build()
}

fn pay(envoy: &Envoy, key: &str, delay_ms: u64) -> Resp {
    http(
        "POST",
        &envoy.url("/pay/1"),
        &[
            ("idempotency-key", key),
            ("x-upstream-delay-ms", &delay_ms.to_string()),
        ],
        Some(b"{\"amount\":1}"),
    )
}

#[test]
fn a_store_that_met_a_dead_webdis_lands_when_it_is_back_and_the_retry_is_a_replay() {
    let redis = Redis::start();
    let mut webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let envoy = Envoy::start(&config(), webdis.port, upstream.port);

    // The upstream takes 1.5 s; Webdis dies once the lock is taken (the
    // acquire long answered), so the store finds no Webdis: it never ran.
    let first = std::thread::scope(|s| {
        let call = s.spawn(|| pay(&envoy, "k-store", 1_500));
        poll("the request upstream", Duration::from_secs(10), || {
            (upstream.executions_of("/pay/1") == 1).then_some(())
        });
        webdis.stop();
        call.join().unwrap()
    });
    // The client has its response: the store's fault did not hold it, and
    // the key was not released (a retry now would run it again).
    assert_eq!(first.status, 200);
    assert_eq!(envoy.counter("redis_guard.idempotency.released"), 0);
    webdis.restart();
    webdis.wait_until_redis_answers();
    // Webdis back: the root's next send lands; the retry is a replay of the
    // one run, long before the lock's 20 s would have freed the key.
    let back = Instant::now();
    let replay = poll("the stored response", Duration::from_secs(10), || {
        let r = pay(&envoy, "k-store", 0);
        (r.status != 409).then_some(r)
    });
    assert!(
        back.elapsed() < Duration::from_secs(10),
        "{:?}",
        back.elapsed()
    );
    assert_eq!(replay.status, 200);
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.executions_of("/pay/1"), 1, "run once");
    assert_eq!(envoy.counter("redis_guard.idempotency.replayed"), 1);
    assert_eq!(envoy.counter("redis_guard.idempotency.store_failed"), 0);
}
