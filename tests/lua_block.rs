//! Blocking limits in lua/ratelimit.lua and lua/batch.lua against a real
//! redis-server: a rejection by a limit whose enforce value is a block (ms)
//! starts a block key beside its state (same hash tag, TTL the block); while
//! it lives the key is refused with Retry-After at the block's end, whatever
//! the state says, and nothing else is written.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use redis::Connection;
use redis_guard::scripts::{RATELIMIT, SETTLE};
use support::script::{self, fw, tb, Limit, HOUR};
use support::{assert_expires_in, key_exists, key_pttl, redis_now_ms, Redis};

/// A state key as the filter builds it (tag `t`), and its block key.
fn keys(name: &str) -> (String, String) {
    let state = redis_guard::keys::rate_limit_key("rg", "t", &format!(":{name}:fw.2.x:"), b"ann");
    let block = redis_guard::keys::block_key(&state);
    (
        String::from_utf8(state).unwrap(),
        String::from_utf8(block).unwrap(),
    )
}

fn decide(con: &mut Connection, limits: &[Limit]) -> script::Decision {
    script::request(con, limits, None).decision()
}

#[test]
fn a_rejection_blocks_the_key_until_the_block_ends_whatever_the_state_says() {
    let (_redis, mut con) = Redis::start_with_conn();
    let (state, block) = keys("login");
    let limit = fw(&state, 2, HOUR).block(5_000);
    assert!(decide(&mut con, std::slice::from_ref(&limit)).admitted);
    assert!(decide(&mut con, std::slice::from_ref(&limit)).admitted);
    assert!(!key_exists(&mut con, &block), "no block before a rejection");
    // The third is rejected: its retry is the block, not the window's end.
    let d = decide(&mut con, std::slice::from_ref(&limit));
    assert!(!d.admitted);
    assert_eq!((d.limits[0].retry_ms, d.limits[0].reset_ms), (5_000, 5_000));
    let ttl = key_pttl(&mut con, &block);
    assert!(ttl > 4_000 && ttl <= 5_000, "{ttl}");
    // The state gone (the window over, a reset): still blocked, the retry
    // the block's time left, and the state is not read or written.
    redis::cmd("DEL").arg(&state).query::<()>(&mut con).unwrap();
    let d = decide(&mut con, std::slice::from_ref(&limit));
    assert!(!d.admitted);
    assert!(
        d.limits[0].retry_ms > 0 && d.limits[0].retry_ms <= ttl,
        "{d:?}"
    );
    assert_eq!(d.limits[0].remaining, 0);
    assert!(!key_exists(&mut con, &state));
    // The block lifted (its end, or `redis-guard reset`): counted afresh.
    redis::cmd("DEL").arg(&block).query::<()>(&mut con).unwrap();
    assert!(decide(&mut con, &[limit]).admitted);
}

#[test]
fn only_an_enforced_limit_that_itself_rejected_starts_a_block() {
    let (_redis, mut con) = Redis::start_with_conn();
    let (a, a_block) = keys("a");
    let (b, b_block) = keys("b");
    // `b` rejects; `a` (blocking, would admit) is not blocked by it.
    let d = decide(
        &mut con,
        &[fw(&a, 5, HOUR).block(9_000), tb(&b, 1, 1, HOUR).cost(1)],
    );
    assert!(d.admitted);
    let d = decide(
        &mut con,
        &[fw(&a, 5, HOUR).block(9_000), tb(&b, 1, 1, HOUR)],
    );
    assert!(!d.admitted);
    assert!(!key_exists(&mut con, &a_block));
    assert!(!key_exists(&mut con, &b_block));
    // A shadow limit never blocks (its enforce value is 0, not a block).
    let (s, s_block) = keys("s");
    for _ in 0..3 {
        decide(&mut con, &[fw(&s, 1, HOUR).block(9_000).shadow()]);
    }
    assert!(!key_exists(&mut con, &s_block));
}

#[test]
fn a_batch_blocks_exactly_as_its_members_one_by_one() {
    let (_redis, mut con) = Redis::start_with_conn();
    let (state, block) = keys("login");
    let limit = fw(&state, 1, HOUR).block(7_000);
    let flat = script::batch_flat(
        &mut con,
        script::packed_batch(&vec![vec![limit.clone()]; 3]),
    );
    // Member 1 admitted; member 2 rejected and starts the block (retry
    // 7000); member 3 finds the block (its PTTL: 7000 at the batch's instant).
    assert_eq!(flat.len(), 19, "{flat:?}");
    assert_eq!(flat[..7], [3, 5, 1, 1, 0, 0, flat[6]]);
    assert_eq!(flat[7..13], [5, 0, 0, 0, 7_000, 7_000]);
    assert_eq!(flat[13..17], [5, 0, 0, 0]);
    assert!(flat[17] > 6_000 && flat[17] <= 7_000, "{flat:?}");
    assert_eq!(flat[17], flat[18]);
    assert!(key_exists(&mut con, &block));
}

#[test]
fn a_bad_enforce_value_is_an_error_that_writes_nothing() {
    let (_redis, mut con) = Redis::start_with_conn();
    for bad in [
        "2",
        "999",
        "x",
        "1.5",
        "4398046511105",
        "-1",
        "-999",
        "-4398046511105",
    ] {
        let argv = ["1", "fw", "2", "60000", "0", "1", bad];
        let err = script::eval_raw(&mut con, &RATELIMIT, &["rg:rl:{t}:k"], &argv).unwrap_err();
        assert!(
            err.to_string().contains("bad enforce value"),
            "{bad}: {err}"
        );
    }
    // A concurrency limit cannot block.
    let argv = ["1", "cc", "2", "60000", "s1", "1", "5000"];
    let err = script::eval_raw(&mut con, &RATELIMIT, &["rg:rl:{t}:c"], &argv).unwrap_err();
    assert!(err.to_string().contains("bad enforce value"), "{err}");
    let n: i64 = redis::cmd("DBSIZE").query(&mut con).unwrap();
    assert_eq!(n, 0);
}

#[test]
fn a_usage_based_limit_honours_a_block_but_only_its_settlement_starts_one() {
    let (_redis, mut con) = Redis::start_with_conn();
    let (state, block) = keys("login");
    // Enforce value -9000: reserves of running requests fill the window,
    // and the rejection they cause starts no block.
    let limit = fw(&state, 2, HOUR).block(-9_000);
    assert!(decide(&mut con, std::slice::from_ref(&limit)).admitted);
    assert!(decide(&mut con, std::slice::from_ref(&limit)).admitted);
    let d = decide(&mut con, std::slice::from_ref(&limit));
    assert!(!d.admitted);
    assert!(
        !key_exists(&mut con, &block),
        "a rejection started the block"
    );
    // The settlements: one request's response did not count (refund), the
    // other's did (nothing moves, the block's ms carried): the window is
    // exhausted only after the second, which starts the block.
    let settle = |con: &mut Connection, delta: &str, block_ms: &str| {
        let argv = ["fw", "2", &HOUR.to_string(), "0", delta, "0", block_ms].map(String::from);
        let v = script::eval_raw(
            con,
            &SETTLE,
            &[&state],
            &argv.each_ref().map(String::as_str),
        )
        .unwrap();
        redis::from_redis_value::<Vec<i64>>(&v).unwrap()[0]
    };
    assert_eq!(settle(&mut con, "-1", "0"), 1);
    assert!(!key_exists(&mut con, &block));
    assert!(decide(&mut con, std::slice::from_ref(&limit)).admitted);
    assert_eq!(
        settle(&mut con, "0", "9000"),
        0,
        "exhausted by counted usage"
    );
    let ttl = key_pttl(&mut con, &block);
    assert!(ttl > 8_000 && ttl <= 9_000, "{ttl}");
    // Now the block is honoured, its time left as the retry.
    let d = decide(&mut con, std::slice::from_ref(&limit));
    assert!(!d.admitted && d.limits[0].retry_ms > 8_000, "{d:?}");
    // A settlement that leaves room starts none.
    let (other, other_block) = keys("other");
    let l2 = fw(&other, 5, HOUR).block(-9_000);
    assert!(decide(&mut con, std::slice::from_ref(&l2)).admitted);
    let argv = ["fw", "5", &HOUR.to_string(), "0", "0", "0", "9000"].map(String::from);
    script::eval_raw(
        &mut con,
        &SETTLE,
        &[&other],
        &argv.each_ref().map(String::as_str),
    )
    .unwrap();
    assert!(!key_exists(&mut con, &other_block));
}

/// The docs' longest block (docs/src/using/abuse.md: "1 s to 30 days").
const THIRTY_DAYS: i64 = 30 * 24 * 3_600_000;

/// A configuration with one blocking fixed window, blocking for `ms`.
fn blocking_config(ms: i64) -> String {
    format!(
        r#"{{"redis":{{"cluster":"webdis"}},
            "limits":[{{"name":"login","descriptor":[{{"header":"x-user"}}],
                        "fixedWindow":{{"limit":1,"windowMs":60000}},
                        "block":{{"durationMs":{ms}}}}}]}}"#
    )
}

#[test]
fn the_longest_block_is_thirty_days_and_a_thirty_day_block_lasts_exactly_that() {
    // The configuration takes 30 days and refuses a ms more.
    let parse = |ms: i64| redis_guard::config::Config::parse(blocking_config(ms).as_bytes());
    assert!(parse(THIRTY_DAYS).is_ok());
    let err = parse(THIRTY_DAYS + 1).unwrap_err().to_string();
    assert!(
        err.contains("limits[0].block.durationMs") && err.contains("30 days"),
        "{err}"
    );

    // The scripts: a rejection starts a block whose key lives exactly 30
    // days, and the retry says so (past 2^31 ms: a figure 32 bits would
    // wrap); the key is refused for the block's time left.
    let (_redis, mut con) = Redis::start_with_conn();
    let (state, block) = keys("login");
    let limit = fw(&state, 1, HOUR).block(THIRTY_DAYS);
    assert!(decide(&mut con, std::slice::from_ref(&limit)).admitted);
    let t0 = redis_now_ms(&mut con);
    let d = decide(&mut con, std::slice::from_ref(&limit));
    assert!(!d.admitted);
    assert_eq!(
        (d.limits[0].retry_ms, d.limits[0].reset_ms),
        (THIRTY_DAYS, THIRTY_DAYS)
    );
    assert_expires_in(&mut con, &block, THIRTY_DAYS, t0);
    let d = decide(&mut con, std::slice::from_ref(&limit));
    let left = key_pttl(&mut con, &block);
    assert!(!d.admitted);
    assert!(
        d.limits[0].retry_ms >= left && d.limits[0].retry_ms <= THIRTY_DAYS,
        "{d:?}, PTTL {left}"
    );

    // A usage-based limit's block, started by its settlement: the same.
    let (other, other_block) = keys("settled");
    let limit = fw(&other, 1, HOUR).block(-THIRTY_DAYS);
    assert!(decide(&mut con, std::slice::from_ref(&limit)).admitted);
    let argv = [
        "fw".to_string(),
        "1".to_string(),
        HOUR.to_string(),
        "0".to_string(),
        "0".to_string(),
        "0".to_string(),
        THIRTY_DAYS.to_string(),
    ];
    let t0 = redis_now_ms(&mut con);
    script::eval_raw(
        &mut con,
        &SETTLE,
        &[&other],
        &argv.each_ref().map(String::as_str),
    )
    .unwrap();
    assert_expires_in(&mut con, &other_block, THIRTY_DAYS, t0);
}
