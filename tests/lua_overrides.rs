//! Per-value overrides in lua/ratelimit.lua and lua/batch.lua against a real
//! redis-server: a limit whose algorithm is suffixed `+o` reads the override
//! stored for its key (src/keys.rs override_key) in the same call and decides
//! with its numbers; the first value of its verdict says so (+2), or that a
//! stored override was ignored (+4) and the configured numbers applied.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use redis::Connection;
use redis_guard::scripts::RATELIMIT;
use support::script;
use support::{set_key, Redis};

const HOUR: u64 = 3_600_000;

/// The state key of limit `name` (a token bucket of 3, 1 per hour) for the
/// customer `who`, and its override key.
fn keys(name: &str, who: &str) -> (String, String) {
    let state = redis_guard::keys::rate_limit_key(
        "rg",
        "t",
        &format!(":{name}:tb.3.1.{HOUR}:"),
        who.as_bytes(),
    );
    let over = redis_guard::keys::override_key(&state).unwrap();
    (
        String::from_utf8(state).unwrap(),
        String::from_utf8(over).unwrap(),
    )
}

/// One request of cost 1 under `alg` (e.g. "tb+o") with `a`, `b`, `c`:
/// [admitted, allowed+flags, remaining, retry, reset].
fn decide(con: &mut Connection, key: &str, alg: &str, a: u64, b: u64, c: u64) -> Vec<i64> {
    let argv = [
        "1",
        alg,
        &a.to_string(),
        &b.to_string(),
        &c.to_string(),
        "1",
        "1",
    ];
    let v = script::eval_raw(con, &RATELIMIT, &[key], &argv).unwrap();
    redis::from_redis_value(&v).unwrap()
}

#[test]
fn a_stored_override_replaces_the_configured_numbers_in_the_same_call() {
    let (_redis, mut con) = Redis::start_with_conn();
    let (state, over) = keys("api", "acme");
    // No override: the configured 3, flagged as such (1, not 3).
    for _ in 0..2 {
        assert_eq!(decide(&mut con, &state, "tb+o", 3, 1, HOUR)[..2], [1, 1]);
    }
    // acme's tier: 10. The bucket keeps its level (one token left stays
    // one token: the stored state is credits, which a capacity only caps).
    set_key(&mut con, &over, "tb 10 10");
    let d = decide(&mut con, &state, "tb+o", 3, 1, HOUR);
    assert_eq!(d[..3], [1, 3, 0], "applied (1 + 2), 0 left: {d:?}");
    let d = decide(&mut con, &state, "tb+o", 3, 1, HOUR);
    assert_eq!(d[..2], [0, 2], "rejected under the override: {d:?}");
    // With the override's refill of 10 per hour, the wait is 6 minutes, not
    // the configured hour.
    assert!(d[3] > 0 && d[3] <= 360_000, "{d:?}");
    // Unset: the configured numbers again.
    redis::cmd("DEL").arg(&over).query::<()>(&mut con).unwrap();
    let d = decide(&mut con, &state, "tb+o", 3, 1, HOUR);
    assert_eq!(d[..2], [0, 0], "{d:?}");
    // A limit that does not take overrides never reads one.
    set_key(&mut con, &over, "tb 10 10");
    let (plain, _) = keys("api", "acme");
    let d = decide(&mut con, &plain, "tb", 3, 1, HOUR);
    assert_eq!(d[..2], [0, 0], "{d:?}");
}

#[test]
fn a_fresh_key_under_an_override_gets_the_overrides_whole_quota() {
    let (_redis, mut con) = Redis::start_with_conn();
    let (state, over) = keys("api", "big");
    set_key(&mut con, &over, "tb 5 5");
    let admitted = (0..8)
        .filter(|_| decide(&mut con, &state, "tb+o", 3, 1, HOUR)[0] == 1)
        .count();
    assert_eq!(admitted, 5);
    // Window kinds: the limit is replaced.
    let (fw_state, fw_over) = keys("win", "big");
    set_key(&mut con, &fw_over, "fw 4");
    let admitted = (0..8)
        .filter(|_| decide(&mut con, &fw_state, "fw+o", 2, 1 << 40, 0)[0] == 1)
        .count();
    assert_eq!(admitted, 4);
}

#[test]
fn a_malformed_override_is_ignored_and_reported_never_an_error() {
    let (_redis, mut con) = Redis::start_with_conn();
    let bad = [
        "tb -5 1",
        "tb 1125899906842625 1",
        "tb 5",
        "tb 0 1",
        "fw 5",
        "tb 5 5 5",
        "hello",
        "",
        "tb 5.5 1",
        "TB 5 5",
        "tb  5 5",
        "tb 5 5 ",
        "tb 150119987580 1",
    ];
    for (i, text) in bad.iter().enumerate() {
        let (state, over) = keys("api", &format!("c{i}"));
        set_key(&mut con, &over, text);
        let d = decide(&mut con, &state, "tb+o", 3, 1, HOUR);
        assert_eq!(
            d[..3],
            [1, 5, 2],
            "`{text}`: ignored (1 + 4), configured 3: {d:?}"
        );
    }
    // An override too small for the request's cost: ignored, not a
    // rejection forever with a Retry-After that never comes true.
    let (state, over) = keys("api", "tiny");
    set_key(&mut con, &over, "tb 1 1");
    let argv = ["1", "tb+o", "3", "1", &HOUR.to_string(), "2", "1"];
    let v = script::eval_raw(&mut con, &RATELIMIT, &[&state], &argv).unwrap();
    let d: Vec<i64> = redis::from_redis_value(&v).unwrap();
    assert_eq!(d[..3], [1, 5, 1], "cost 2 under the configured 3: {d:?}");
    // A key of another type, written by hand.
    let (state, over) = keys("api", "hash");
    redis::cmd("HSET")
        .arg(&over)
        .arg("f")
        .arg("v")
        .query::<()>(&mut con)
        .unwrap();
    let d = decide(&mut con, &state, "tb+o", 3, 1, HOUR);
    assert_eq!(d[..3], [1, 5, 2], "{d:?}");
    // A kind that cannot take overrides is a contract error.
    for alg in ["gcra+o", "cc+o", "+o", "tb+x"] {
        let err = script::eval_raw(
            &mut con,
            &RATELIMIT,
            &[&state],
            &["1", alg, "3", "1", "1000", "1", "1"],
        );
        assert!(err.is_err(), "{alg}");
    }
}

#[test]
fn a_batch_reads_each_members_override_as_its_own_call_would() {
    let (_redis, mut con) = Redis::start_with_conn();
    let (a, a_over) = keys("api", "acme");
    let (b, _) = keys("api", "free");
    set_key(&mut con, &a_over, "tb 5 5");
    let member = |key: &str| {
        (
            vec![key.to_string()],
            ["1", "tb+o", "3", "1", &HOUR.to_string(), "1", "1"]
                .map(String::from)
                .to_vec(),
        )
    };
    let members: Vec<_> = (0..12)
        .map(|j| member(if j % 2 == 0 { &a } else { &b }))
        .collect();
    let flat = script::batch_flat(&mut con, script::packed(&members));
    // Per member: its length 5, then [admitted, allowed+flags, ...].
    let verdicts: Vec<(i64, i64)> = flat[1..].chunks(6).map(|m| (m[1], m[2])).collect();
    let acme: Vec<_> = verdicts.iter().step_by(2).copied().collect();
    let free: Vec<_> = verdicts.iter().skip(1).step_by(2).copied().collect();
    assert_eq!(acme, [(1, 3), (1, 3), (1, 3), (1, 3), (1, 3), (0, 2)]);
    assert_eq!(free, [(1, 1), (1, 1), (1, 1), (0, 0), (0, 0), (0, 0)]);
}
