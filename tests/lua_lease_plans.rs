//! Leased token buckets and stored plans (issue 54, item 1), against a real
//! redis-server at the test clock: lua/lease.lua called with its sixth ARGV
//! "o" (the limit takes plans) decides a key that has a plan strictly under
//! it, as lua/ratelimit.lua's token bucket does, and grants nothing;
//! lua/lease_return.lua takes nothing back while a plan is stored, and
//! nothing handed out before a plan charged the bucket once it is gone
//! (lua/keys.lua plan_restarts_give_back). A key without a plan leases
//! exactly as before.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::LazyLock;

use redis::Connection;
use redis_guard::scripts::{Script, LEASE, LEASE_RETURN};
use support::script::{self, HOUR, T0};
use support::{key_exists, read_bucket, set_key, Redis};

static LEASE_AT: LazyLock<Script> = LazyLock::new(|| script::with_test_clock(&LEASE));
static RETURN_AT: LazyLock<Script> = LazyLock::new(|| script::with_test_clock(&LEASE_RETURN));

/// The configured bucket: 100 tokens, 1 per hour (one credit per ms, so
/// the test clock standing still refills nothing).
const CAPACITY: i64 = 100;

/// The state key of the leased limit for `who`, and its override key.
fn keys(who: &str) -> (String, String) {
    let state = redis_guard::keys::rate_limit_key(
        "rg",
        "t",
        &format!(":api:tb2.{CAPACITY}.1.{HOUR}:"),
        who.as_bytes(),
    );
    let over = redis_guard::keys::override_key(&state).unwrap();
    (
        String::from_utf8(state).unwrap(),
        String::from_utf8(over).unwrap(),
    )
}

/// One lease call of `cost` wanting `lease` tokens; `plans`: the limit
/// takes stored plans (ARGV[6] "o"). The whole reply.
fn lease(con: &mut Connection, key: &str, cost: i64, lease: i64, plans: bool) -> Vec<i64> {
    let mut argv = vec![
        CAPACITY.to_string(),
        "1".to_string(),
        HOUR.to_string(),
        cost.to_string(),
        lease.to_string(),
    ];
    if plans {
        argv.push("o".to_string());
    }
    let v = script::eval_raw(con, &LEASE_AT, &[key], &argv).unwrap();
    redis::from_redis_value(&v).unwrap()
}

/// A strict decision of cost 1 through lua/ratelimit.lua (`tb+o`, as the
/// filter sends a leased limit with plans when a worker decides in Redis).
fn strict(con: &mut Connection, key: &str) -> Vec<i64> {
    let argv = [
        "1",
        "tb+o",
        &CAPACITY.to_string(),
        "1",
        &HOUR.to_string(),
        "1",
        "1",
    ];
    let v = script::eval_raw(con, &script::RATELIMIT_AT, &[key], &argv).unwrap();
    redis::from_redis_value(&v).unwrap()
}

/// Gives `tokens` back under the grant's tuple (reply items 6 to 8): the
/// tokens Redis took back.
fn give_back(con: &mut Connection, key: &str, tokens: i64, grant: &[i64]) -> i64 {
    let argv = [CAPACITY, 1, HOUR, tokens, grant[6], grant[7], grant[8]].map(|v| v.to_string());
    let v = script::eval_raw(con, &RETURN_AT, &[key], &argv).unwrap();
    let got: Vec<i64> = redis::from_redis_value(&v).unwrap();
    assert_eq!(got.len(), 1, "{got:?}");
    got[0]
}

fn del(con: &mut Connection, key: &str) {
    redis::cmd("DEL").arg(key).query::<()>(con).unwrap();
}

fn tokens_in(con: &mut Connection, key: &str) -> i64 {
    read_bucket(con, key).map_or(CAPACITY, |(c, _)| c / HOUR)
}

#[test]
fn a_key_with_a_stored_plan_is_decided_strictly_under_it_and_granted_nothing() {
    let (_redis, mut con) = Redis::start_with_conn();
    script::set_clock(&mut con, T0);
    let (state, over) = keys("acme");
    set_key(&mut con, &over, "tb 10 10");
    // Ten admitted, leased calls and strict ones alternating on one budget,
    // each granting nothing and stating the plan (verdict 1 + 2, then its
    // capacity and refill after the tuple).
    for i in 0..10 {
        let left = 9 - i;
        if i % 2 == 0 {
            let r = lease(&mut con, &state, 1, 8, true);
            let reset = (10 - left) * HOUR / 10;
            assert_eq!(r, [1, 3, left, 0, reset, 0, 0, 0, 0, 10, 10], "call {i}");
        } else {
            let r = strict(&mut con, &state);
            assert_eq!(r[..3], [1, 3, left], "call {i}: {r:?}");
        }
    }
    // The 11th is refused under the plan: a token in 6 minutes (10 an hour).
    let r = lease(&mut con, &state, 1, 8, true);
    assert_eq!(r, [0, 2, 0, HOUR / 10, HOUR / 10, 0, 0, 0, 0, 10, 10]);
    assert!(
        !key_exists(&mut con, &format!("{state}:ret")),
        "no grant, no record"
    );
    // A limit that takes no plans never reads one: the configured 100 and a
    // grant of 8 for another customer.
    let (plain, _) = keys("initech");
    let r = lease(&mut con, &plain, 1, 8, false);
    assert_eq!(r[..6], [1, 1, 91, 0, 9 * HOUR, 8]);
}

#[test]
fn a_key_without_a_plan_leases_exactly_as_a_limit_that_takes_none() {
    let (_redis, mut con) = Redis::start_with_conn();
    script::set_clock(&mut con, T0);
    let (with, _) = keys("acme");
    let (without, _) = keys("initech");
    for cost in [1, 3, 0, 2] {
        let a = lease(&mut con, &with, cost, 12, true);
        let b = lease(&mut con, &without, cost, 12, false);
        assert_eq!(a.len(), 9, "no plan, no figures: {a:?}");
        assert_eq!(a, b, "cost {cost}");
        assert!(a[5] > 0, "granted: {a:?}");
    }
}

#[test]
fn an_ignored_plan_decides_under_the_configured_numbers_and_grants_nothing() {
    let (_redis, mut con) = Redis::start_with_conn();
    script::set_clock(&mut con, T0);
    let (state, over) = keys("acme");
    // Another kind's text, and a capacity below the cost: ignored (1 + 4).
    set_key(&mut con, &over, "fw 5");
    let r = lease(&mut con, &state, 1, 8, true);
    assert_eq!(r, [1, 5, 99, 0, HOUR, 0, 0, 0, 0]);
    set_key(&mut con, &over, "tb 2 2");
    let r = lease(&mut con, &state, 3, 8, true);
    assert_eq!(r, [1, 5, 96, 0, 4 * HOUR, 0, 0, 0, 0]);
}

#[test]
fn a_give_back_to_a_key_with_a_stored_plan_takes_nothing_back() {
    let (_redis, mut con) = Redis::start_with_conn();
    script::set_clock(&mut con, T0);
    let (state, over) = keys("acme");
    let grant = lease(&mut con, &state, 1, 10, true);
    assert_eq!(grant[..6], [1, 1, 89, 0, 11 * HOUR, 10]);
    set_key(&mut con, &over, "tb 1000 1000");
    assert_eq!(give_back(&mut con, &state, 10, &grant), 0);
    assert_eq!(tokens_in(&mut con, &state), 89, "nothing went back");
    // The plan gone without having charged the bucket: the same tuple gives
    // all 10 back, as before plans.
    del(&mut con, &over);
    assert_eq!(give_back(&mut con, &state, 10, &grant), 10);
    assert_eq!(tokens_in(&mut con, &state), 99);
}

#[test]
fn a_plan_that_charged_the_bucket_refuses_every_earlier_tuple_once_it_is_gone() {
    let (_redis, mut con) = Redis::start_with_conn();
    let (state, over) = keys("acme");
    // Charged by a strict decision under the plan, then by a leased one.
    for (i, plan_charges) in [strict as fn(&mut Connection, &str) -> Vec<i64>, |c, k| {
        lease(c, k, 1, 10, true)
    }]
    .iter()
    .enumerate()
    {
        let t = T0 + i as i64 * 10 * HOUR;
        script::set_clock(&mut con, t);
        del(&mut con, &state);
        del(&mut con, &format!("{state}:ret"));
        let grant = lease(&mut con, &state, 1, 10, true);
        assert_eq!(grant[5], 10, "{grant:?}");
        // A plan with a refill of 1,000 an hour charges the bucket a minute
        // later: under it the bucket rose by 16 tokens since the grant, where
        // the configured refill brings 1 in an hour.
        set_key(&mut con, &over, "tb 1000 1000");
        script::set_clock(&mut con, t + 60_000);
        let r = plan_charges(&mut con, &state);
        assert_eq!(r[..3], [1, 3, 89 + 16 - 1], "charged under the plan: {r:?}");
        del(&mut con, &over);
        // Had the grant's tuple been taken, its 10 tokens would have gone
        // back on top (the bound sees a minute of the configured refill).
        assert_eq!(give_back(&mut con, &state, 10, &grant), 0);
        // The state keeps the plan's 104 until a read caps it at 100.
        assert_eq!(tokens_in(&mut con, &state), 104);
        // The next grant, under the configured numbers, takes its tuples
        // back again, and the older one stays refused.
        script::set_clock(&mut con, t + 120_000);
        let next = lease(&mut con, &state, 1, 10, true);
        assert_eq!(next[..6], [1, 1, 89, 0, 11 * HOUR, 10], "{next:?}");
        assert_eq!(give_back(&mut con, &state, 10, &grant), 0);
        assert_eq!(give_back(&mut con, &state, 10, &next), 10);
        assert_eq!(tokens_in(&mut con, &state), 99);
    }
}
