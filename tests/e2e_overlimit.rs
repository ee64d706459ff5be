//! The over-limit cache end to end: once Redis rejects a key until T, the
//! Envoy that heard it answers 429 itself until T (no Redis call), every such
//! answer is one Redis would have given at that moment, and from T on Redis
//! decides again. Not timed: the checks read Redis' own clock and state,
//! never the test's. (That every worker of the Envoy reads the one entry is
//! the flow's unit tests' to show: which worker takes a connection is Envoy's
//! choice.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::{Duration, Instant};

use support::*;

/// One token, refilled every 3 s: after one admission the key has no room
/// for a while, and that while is long enough for the checks below.
fn config() -> String {
    filter_config(2000)
        .limits(
            r#"[{"name":"per-user","match":{"pathPrefix":"/api/"},"descriptor":[{"header":"x-user"}],
             "tokenBucket":{"capacity":1,"refill":1,"periodMs":3000}}]"#,
        )
        .build()
}

/// Redis' clock, ms.
fn redis_now(redis: &Redis) -> i64 {
    redis_now_ms(&mut redis.conn())
}

/// When, on Redis' clock, the bucket holds one token again (from its state:
/// credits `c` at `t`, one token = 3000 credits, one credit per ms).
fn refill_at(redis: &Redis) -> i64 {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("rg:rl:*")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(keys.len(), 1);
    let (c, t) = read_bucket(&mut redis.conn(), &keys[0]).expect("the bucket");
    t + (3000 - c.min(3000))
}

fn calls(e: &Envoy) -> u64 {
    e.counter("redis_guard.redis.calls")
}

#[test]
fn rejections_are_answered_locally_until_redis_said_and_by_redis_after() {
    let stack = Stack::start(&config(), 2);
    let (e1, e2) = (&stack.envoys[0], &stack.envoys[1]);
    let user = [("x-user", "mallory")];

    assert_eq!(get(&e1.url("/api/x"), &user).status, 200);
    // An entry answers for at most a second after its call was sent, so
    // the loop below is timed from before this request (not from after the
    // reads between, which a loaded machine may stretch).
    let since = Instant::now();
    let r = get(&e1.url("/api/x"), &user);
    assert_eq!(r.status, 429, "Redis rejects the second");
    // Two decisions, and the EVAL after the fresh Redis' NOSCRIPT.
    let base = calls(e1);
    assert_eq!(base, 3);
    let t = refill_at(&stack.redis);

    // Every request now gets 429 from e1 itself: each `get` opens a new
    // connection, which Envoy gives to either worker. Each answer is checked
    // against Redis right after it: the bucket still cannot admit, so Redis
    // would have rejected it too. Bounded: 40 requests, and only while T is
    // more than a second away.
    // An entry answers for at most a second (then Redis is asked again): the
    // loop stays well inside it.
    let mut cached = 0;
    while cached < 40
        && since.elapsed() < Duration::from_millis(500)
        && redis_now(&stack.redis) + 1000 < t
    {
        let r = get(&e1.url("/api/x"), &user);
        assert_eq!(r.status, 429);
        assert!(r.header("retry-after").is_some());
        assert!(redis_now(&stack.redis) < t, "answered 429 at or after T");
        cached += 1;
    }
    assert!(cached >= 3, "only {cached} requests before T");
    assert_eq!(calls(e1), base, "no Redis call for {cached} rejections");
    assert_eq!(
        e1.counter("redis_guard.overlimit_cache.rejected"),
        cached as u64
    );
    assert_eq!(
        e1.counter("redis_guard.ratelimit.per-user.rejected"),
        cached as u64 + 1
    );

    // Another Envoy has heard nothing: it asks Redis, which rejects.
    assert_eq!(get(&e2.url("/api/x"), &user).status, 429);
    assert_eq!(calls(e2), 1);
    // Another user's key is not affected.
    assert_eq!(get(&e1.url("/api/x"), &[("x-user", "alice")]).status, 200);
    assert_eq!(calls(e1), base + 1);

    // Once Redis' clock reaches T, the next request goes to Redis and fits.
    let start = Instant::now();
    while redis_now(&stack.redis) < t {
        assert!(start.elapsed() < Duration::from_secs(5), "T never came");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(get(&e1.url("/api/x"), &user).status, 200);
    assert_eq!(calls(e1), base + 2);
    assert_eq!(stack.upstream.executed(), 3);
}
