//! Per-value overrides in lua/ratelimit.lua and lua/batch.lua against a real
//! redis-server: a limit whose algorithm is suffixed `+o` reads the override
//! stored for its key (src/keys.rs override_key) in the same call and decides
//! with its numbers; the first value of its verdict says so (+2), or that a
//! stored override was ignored (+4) and the configured numbers applied.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use redis::Connection;
use redis_guard::quota::{zone, Calendar, Per};
use redis_guard::scripts::{RATELIMIT, SETTLE};
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
    for alg in ["gcra+o", "+o", "tb+x"] {
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
    // Per member: its length (5, or 7 with the plan that decided it), then
    // [admitted, allowed+flags, ...].
    let mut verdicts: Vec<(i64, i64)> = Vec::new();
    let mut at = 1;
    while at < flat.len() {
        let len = usize::try_from(flat[at]).unwrap();
        let m = &flat[at + 1..at + 1 + len];
        verdicts.push((m[0], m[1]));
        // A member a plan decided states it, as its own call would.
        let stated = if m[1] & 2 == 2 { vec![5, 5] } else { vec![] };
        assert_eq!(m[5..], stated[..], "{m:?}");
        at += 1 + len;
    }
    let acme: Vec<_> = verdicts.iter().step_by(2).copied().collect();
    let free: Vec<_> = verdicts.iter().skip(1).step_by(2).copied().collect();
    assert_eq!(acme, [(1, 3), (1, 3), (1, 3), (1, 3), (1, 3), (0, 2)]);
    assert_eq!(free, [(1, 1), (1, 1), (1, 1), (0, 0), (0, 0), (0, 0)]);
}

/// The reply of one request of `cost` under the limits `(key, alg, a, b,
/// c)`, as integers.
fn request(con: &mut Connection, limits: &[(&str, &str, u64, u64, &str)], cost: u64) -> Vec<i64> {
    let keys: Vec<&str> = limits.iter().map(|l| l.0).collect();
    let mut argv = vec![limits.len().to_string()];
    for (_, alg, a, b, c) in limits {
        argv.extend([alg.to_string(), a.to_string(), b.to_string(), c.to_string()]);
        argv.extend([cost.to_string(), "1".to_string()]);
    }
    let v = script::eval_raw(con, &RATELIMIT, &keys, &argv).unwrap();
    redis::from_redis_value(&v).unwrap()
}

/// One settlement of `delta` units (decided just now) under `(key, alg, a,
/// b, c)`: the units left.
fn settle(
    con: &mut Connection,
    (key, alg, a, b, c): (&str, &str, u64, u64, &str),
    delta: i64,
) -> i64 {
    let argv = [
        alg.to_string(),
        a.to_string(),
        b.to_string(),
        c.to_string(),
        delta.to_string(),
        "0".to_string(),
        "0".to_string(),
    ];
    let v = script::eval_raw(con, &SETTLE, &[key], &argv).unwrap();
    let left: Vec<i64> = redis::from_redis_value(&v).unwrap();
    left[0]
}

#[test]
fn a_decision_states_the_plan_that_decided_each_limit_after_every_verdict() {
    let (_redis, mut con) = Redis::start_with_conn();
    let (state, over) = keys("api", "acme");
    let (win, _) = keys("win", "acme");
    set_key(&mut con, &over, "tb 10 7");
    let hour = HOUR.to_string();
    let d = request(
        &mut con,
        &[
            (&win, "fw+o", 5, 1 << 40, "0"),
            (&state, "tb+o", 3, 1, &hour),
        ],
        1,
    );
    // [admitted, fw's four, tb's four (applied: 1 + 2), then tb's plan].
    assert_eq!(d.len(), 1 + 4 + 4 + 2, "{d:?}");
    assert_eq!((d[0], d[1], d[2], d[5], d[6]), (1, 1, 4, 3, 9), "{d:?}");
    assert_eq!(d[9..], [10, 7], "the plan's capacity and refill: {d:?}");
    // A window's plan: its limit, and 0.
    let (w2, w2_over) = keys("win", "big");
    set_key(&mut con, &w2_over, "fw 40");
    let d = request(&mut con, &[(&w2, "fw+o", 5, 1 << 40, "0")], 1);
    assert_eq!(d, [1, 3, 39, 0, d[4], 40, 0], "{d:?}");
    // A plan with no room for the cost is ignored (4) and states nothing.
    let d = request(&mut con, &[(&w2, "fw+o", 5, 1 << 40, "0")], 41);
    assert_eq!(d[..2], [0, 4], "{d:?}");
    assert_eq!(d.len(), 5, "{d:?}");
}

#[test]
fn a_concurrency_limits_stored_plan_is_its_customers_own_maximum() {
    let (_redis, mut con) = Redis::start_with_conn();
    let (acme, acme_over) = keys("inflight", "acme");
    let (free, _) = keys("inflight", "free");
    set_key(&mut con, &acme_over, "cc 3");
    let held: Vec<i64> = ["a1", "a2", "a3", "a4"]
        .iter()
        .map(|slot| request(&mut con, &[(&acme, "cc+o", 1, 30_000, slot)], 1)[0])
        .collect();
    assert_eq!(held, [1, 1, 1, 0], "three in flight under a plan of 3");
    let d = request(&mut con, &[(&acme, "cc+o", 1, 30_000, "a5")], 1);
    assert_eq!((d[1], d.len()), (2, 7), "refused under the plan: {d:?}");
    assert_eq!(d[5..], [3, 0], "{d:?}");
    let held: Vec<i64> = ["b1", "b2"]
        .iter()
        .map(|slot| request(&mut con, &[(&free, "cc+o", 1, 30_000, slot)], 1)[0])
        .collect();
    assert_eq!(
        held,
        [1, 0],
        "the configured 1 for a customer without a plan"
    );
}

#[test]
fn a_usage_limits_reserve_and_its_settlement_are_judged_by_the_stored_plan() {
    let (_redis, mut con) = Redis::start_with_conn();
    // A daily token quota of 100 configured; acme's plan is 1,000.
    let day = Calendar {
        per: Per::Day,
        zone: zone("UTC").unwrap(),
        anchor: 1,
    };
    let [e0, e1, e2, e3] = day.edges(support::redis_now_ms(&mut con)).unwrap();
    let edges = format!("{e0},{e1},{e2},{e3}");
    let (acme, acme_over) = keys("tokens", "acme");
    let (free, _) = keys("tokens", "free");
    set_key(&mut con, &acme_over, "cq 1000");
    for (key, plan) in [(&acme, 1000), (&free, 100)] {
        let quota = (key.as_str(), "cq+o", 100, 0, edges.as_str());
        let mut spent = 0;
        // Requests reserve 1 token at admission and settle 99 more.
        loop {
            let d = request(&mut con, &[quota], 1);
            if d[0] == 0 {
                break;
            }
            assert!(spent < plan, "admitted past the plan: {d:?}");
            let left = settle(&mut con, quota, 99);
            spent += 100;
            assert_eq!(left, plan - spent, "settled under the plan");
        }
        assert_eq!(spent, plan, "exactly the plan's tokens: {key}");
    }
    // A token bucket's plan refills at its own rate in the settlement too.
    let (tb_key, tb_over) = keys("bucket", "acme");
    set_key(&mut con, &tb_over, "tb 10 10");
    let hour = HOUR.to_string();
    let bucket = (tb_key.as_str(), "tb+o", 3, 1, hour.as_str());
    assert_eq!(request(&mut con, &[bucket], 1)[..3], [1, 3, 9]);
    assert_eq!(settle(&mut con, bucket, 4), 5, "10 - 1 - 4 under the plan");
    // Without `+o` the configured numbers settle: capped at 3 it would say
    // at most 3 - 5 = -2 left; the plan's own state is not read as a plan.
    let (plain, _) = keys("plain", "acme");
    let configured = (plain.as_str(), "tb", 3, 1, hour.as_str());
    assert_eq!(request(&mut con, &[configured], 1)[..3], [1, 1, 2]);
    assert_eq!(settle(&mut con, configured, 4), -2);
}
