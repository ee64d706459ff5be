//! lua/settle.lua (issue 15's settlement, not sent by the filter yet) on a
//! real redis-server at a test clock: a usage-based cost charged after the
//! response, the difference from what the decision reserved, up (debt) or
//! down (refund), for every kind that settles; debt's recovery by refill;
//! each key's TTL after settling.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::LazyLock;

use redis::{Connection, Value};
use redis_guard::quota::{zone, Calendar, Per};
use redis_guard::scripts::{Script, SETTLE};
use support::script::{
    self, admits, at, eval, fw, gcra, one, rejects, swc, tb, with_test_clock, Limit, HOUR, SECOND,
    T0,
};
use support::{assert_expires_in, key_exists as exists, redis_now_ms};

static SETTLE_AT: LazyLock<Script> = LazyLock::new(|| with_test_clock(&SETTLE));

/// Settles `(limit, delta)` pairs at `now`, each decided just now (age 0):
/// the units left per limit.
fn settle(con: &mut Connection, now: i64, items: &[(&Limit, i64)]) -> Vec<i64> {
    let aged: Vec<(&Limit, i64, i64)> = items.iter().map(|(l, d)| (*l, *d, 0)).collect();
    settle_aged(con, now, &aged)
}

/// Settles `(limit, delta, age)`: age is the ms since the decision's call
/// left, as the filter measures it. The reply as Redis gives it.
fn settle_raw(con: &mut Connection, now: i64, items: &[(&Limit, i64, i64)]) -> Vec<Value> {
    script::set_clock(con, now);
    let mut cmd = eval(&SETTLE_AT);
    cmd.arg(items.len());
    for (l, _, _) in items {
        cmd.arg(&l.key);
    }
    for (l, delta, age) in items {
        cmd.arg(l.alg)
            .arg(l.a)
            .arg(l.b)
            .arg(&l.c)
            .arg(*delta)
            .arg(*age)
            .arg(0);
    }
    let v: Value = cmd.query(con).unwrap_or_else(|e| panic!("settle: {e}"));
    let Value::Array(items) = v else {
        panic!("{v:?}")
    };
    items
}

/// [`settle_raw`]'s units left per limit (every member settled).
fn settle_aged(con: &mut Connection, now: i64, items: &[(&Limit, i64, i64)]) -> Vec<i64> {
    settle_raw(con, now, items)
        .into_iter()
        .map(|v| match v {
            Value::Int(i) => i,
            Value::BulkString(b) => std::str::from_utf8(&b).unwrap().parse().unwrap(),
            other => panic!("{other:?}"),
        })
        .collect()
}

#[test]
fn a_token_bucket_charged_past_its_balance_is_in_debt_until_refill_pays_it() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    // 100 tokens, 10 back per second.
    let l = tb("s:{k}:tb", 100, 10, SECOND);
    // Admitted with a reservation of 10, the response says 250.
    assert_eq!(one(&mut con, T0, &l.clone().cost(10)), admits(90, SECOND));
    assert_eq!(settle(&mut con, T0, &[(&l, 240)]), [-150]);
    // In debt: nothing is admitted, and the wait is exact.
    assert_eq!(one(&mut con, T0, &l), rejects(0, 15_100));
    // 15.1 s later the debt is paid and one token is back.
    assert!(!one(&mut con, T0 + 15_099, &l).allowed);
    let t0 = redis_now_ms(&mut con);
    assert_eq!(one(&mut con, T0 + 15_100, &l), admits(0, 10_000));
    // The key lives until the bucket is full again: 10 s from there.
    assert_expires_in(&mut con, &l.key, 10_000, t0);
}

#[test]
fn a_refund_gives_back_the_difference_and_never_more_than_full() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let l = tb("s:{k}:tb", 100, 10, SECOND);
    assert!(one(&mut con, T0, &l.clone().cost(50)).allowed);
    // Used 20 of the 50 reserved.
    assert_eq!(settle(&mut con, T0, &[(&l, -30)]), [80]);
    assert_eq!(one(&mut con, T0, &l), admits(79, 2100));
    // A refund larger than what was taken stops at full.
    assert_eq!(settle(&mut con, T0, &[(&l, -1000)]), [100]);
    assert_eq!(one(&mut con, T0, &l), admits(99, 100));
}

#[test]
fn gcra_in_debt_admits_again_once_its_arrival_time_is_back_within_the_burst() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    // A burst of 30, 3 per second (one every 333.3 ms).
    let l = gcra("s:{k}:g", 30, 3, SECOND);
    assert!(one(&mut con, T0, &l.clone().cost(5)).allowed);
    // 95 more than reserved: 100 units, 70 past the burst.
    assert_eq!(settle(&mut con, T0, &[(&l, 95)]), [-70]);
    // 71 units must come back before one is admitted: 71 / 3 s.
    let back = (71 * SECOND + 2) / 3;
    assert_eq!(one(&mut con, T0, &l), rejects(0, back));
    assert!(!one(&mut con, T0 + back - 1, &l).allowed);
    let t0 = redis_now_ms(&mut con);
    assert!(one(&mut con, T0 + back, &l).allowed);
    // Its key lives until the arrival time: a backlog of 100 000 credits,
    // less 3 per ms for 23 667 ms, plus the 1000 just charged, is 29 999
    // credits: 10 000 ms at 3 a ms.
    assert_expires_in(&mut con, &l.key, 10_000, t0);
    // A refund past now leaves a whole limit: the key is gone.
    assert_eq!(settle(&mut con, T0 + back, &[(&l, -1000)]), [30]);
    assert!(!exists(&mut con, &l.key));
}

#[test]
fn a_fixed_window_in_debt_waits_for_its_next_window_and_a_refund_stops_at_zero() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let l = fw("s:{k}:fw", 100, HOUR);
    assert!(one(&mut con, T0, &l.clone().cost(10)).allowed);
    assert_eq!(settle(&mut con, T0, &[(&l, 140)]), [-50]);
    assert_eq!(one(&mut con, T0 + SECOND, &l), rejects(0, HOUR - SECOND));
    let t0 = redis_now_ms(&mut con);
    assert!(
        one(&mut con, T0 + HOUR, &l).allowed,
        "a new window, debt gone"
    );
    // The count expires with its window (+2 ms, lua/fixed_window.lua).
    assert_expires_in(&mut con, &l.key, HOUR + 2, t0);
    // A refund of a reserve taken in this window comes off this window's
    // count, never below 0.
    assert!(one(&mut con, T0 + HOUR, &l.clone().cost(30)).allowed);
    assert_eq!(settle(&mut con, T0 + HOUR, &[(&l, -50)]), [100]);
}

#[test]
fn a_window_refund_is_dropped_unless_its_reserve_was_surely_taken_in_the_current_window() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    for l in [fw("s:{k}:fw", 100, HOUR), swc("s:{k}:swc", 100, HOUR)] {
        // A reserves 50 in the last second of a window, B 50 in the first
        // second of the next; A's answer cost 5.
        assert!(one(&mut con, T0 + HOUR - SECOND, &l.clone().cost(50)).allowed);
        assert!(one(&mut con, T0 + HOUR + 100, &l.clone().cost(50)).allowed);
        let dump = |con: &mut Connection| {
            redis::cmd("DUMP")
                .arg(&l.key)
                .query::<Option<Vec<u8>>>(con)
                .unwrap()
        };
        let before = dump(&mut con);
        // A's decision left 1.2 s before its settlement: its window is not
        // this one, so its refund must not lower B's window's count.
        settle_aged(&mut con, T0 + HOUR + 200, &[(&l, -45, 1200)]);
        assert_eq!(
            before,
            dump(&mut con),
            "{}: refunded into the wrong window",
            l.alg
        );
        // B's own refund, decided 100 ms ago in this window, comes off it.
        let left = settle_aged(&mut con, T0 + HOUR + 200, &[(&l, -45, 100)])[0];
        assert!(left > 0, "{}: {left}", l.alg);
        // A charge lands whatever the age.
        let more = settle_aged(&mut con, T0 + HOUR + 300, &[(&l, 10, 5000)])[0];
        assert_eq!(more, left - 10, "{}", l.alg);
    }
}

#[test]
fn a_sliding_window_counter_carries_its_debt_by_weight_into_the_next_window() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let l = swc("s:{k}:swc", 100, HOUR);
    assert!(one(&mut con, T0, &l.clone().cost(10)).allowed);
    assert_eq!(settle(&mut con, T0, &[(&l, 190)]), [-100]);
    // Half into the next window, the 200 weigh 100: still nothing left.
    assert!(!one(&mut con, T0 + HOUR + HOUR / 2, &l).allowed);
    // Three quarters in, they weigh 50.
    assert_eq!(one(&mut con, T0 + HOUR + 3 * HOUR / 4, &l).remaining, 49);
    // A refund of more than the current window's count stops at 0.
    assert_eq!(
        settle(&mut con, T0 + HOUR + 3 * HOUR / 4, &[(&l, -1000)]),
        [50]
    );
    // The same key twice in one call, a refund to nothing then a charge:
    // the charge counts from the refunded state (the kind's own cache).
    assert_eq!(
        settle(&mut con, T0 + HOUR + 3 * HOUR / 4, &[(&l, -10), (&l, 3)]),
        [50, 47]
    );
}

#[test]
fn several_limits_settle_in_one_call_and_a_zero_delta_changes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let a = tb("s:{k}:a", 100, 10, SECOND);
    let b = fw("s:{k}:b", 1000, HOUR);
    let d = at(&mut con, T0, &[a.clone().cost(5), b.clone().cost(5)]);
    assert!(d.admitted);
    let before: Vec<Option<Vec<u8>>> = [&a.key, &b.key]
        .iter()
        .map(|k| redis::cmd("DUMP").arg(k).query(&mut con).unwrap())
        .collect();
    assert_eq!(settle(&mut con, T0, &[(&a, 0), (&b, 0)]), [95, 995]);
    let after: Vec<Option<Vec<u8>>> = [&a.key, &b.key]
        .iter()
        .map(|k| redis::cmd("DUMP").arg(k).query(&mut con).unwrap())
        .collect();
    assert_eq!(before, after);
    assert_eq!(settle(&mut con, T0, &[(&a, 15), (&b, 995)]), [80, 0]);
    // Two requests' settlements of one key in one call apply in order.
    assert_eq!(settle(&mut con, T0, &[(&a, 50), (&a, -20)]), [30, 50]);
}

/// The marker of a member that could not be settled, as lua/settle.lua
/// replies it in that member's place.
fn failed(why: &str) -> Value {
    Value::BulkString(format!("ERR redis-guard settle: {why}").into_bytes())
}

#[test]
fn a_stale_quota_settlement_fails_alone_and_the_one_joined_with_it_is_applied() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let a = tb("s:{k}:a", 100, 10, SECOND);
    assert!(one(&mut con, T0, &a.clone().cost(5)).allowed);
    assert_eq!(settle(&mut con, T0, &[(&a, 0)]), [95]);
    // Another customer's hourly quota, decided an hour and a second ago:
    // its edges (computed then) no longer hold Redis' clock. Joined in one
    // call (one hash tag, one tick), it fails alone; the bucket's 5 more
    // are charged.
    let hourly = Calendar {
        per: Per::Hour,
        zone: zone("UTC").unwrap(),
        anchor: 1,
    };
    let [e0, e1, e2, e3] = hourly.edges(T0 - HOUR - SECOND).unwrap();
    let stale = Limit {
        key: "s:{k}:q".to_string(),
        alg: "cq",
        a: 1000,
        b: 0,
        c: format!("{e0},{e1},{e2},{e3}"),
        cost: 1,
        enforce: true,
        block: 0,
    };
    assert_eq!(
        settle_raw(&mut con, T0, &[(&a, 5, 0), (&stale, 3, HOUR + SECOND)]),
        [
            Value::Int(90),
            failed("limit 2: no window of its edges holds Redis' clock")
        ]
    );
    assert_eq!(one(&mut con, T0, &a).remaining, 89);
    let written: Vec<String> = redis::cmd("KEYS").arg("s:{k}:q*").query(&mut con).unwrap();
    assert_eq!(written, Vec::<String>::new());
    // First in the call, it fails alone too.
    assert_eq!(
        settle_raw(&mut con, T0, &[(&stale, 3, HOUR + SECOND), (&a, -9, 0)]),
        [
            failed("limit 1: no window of its edges holds Redis' clock"),
            Value::Int(98)
        ]
    );
}

#[test]
fn a_kind_that_cannot_settle_or_a_bad_number_fails_alone_and_writes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let a = tb("s:{k}:a", 100, 10, SECOND);
    assert!(one(&mut con, T0, &a).allowed);
    let mut left = 99;
    for (what, second) in [
        ("a sliding-window log", ["sw", "10", "1000", "0", "1"]),
        ("a concurrency limit", ["cc", "10", "1000", "a1", "1"]),
        ("a fractional delta", ["tb", "100", "10", "1000", "1.5"]),
        (
            "a delta past 2^50",
            ["tb", "100", "10", "1000", "1125899906842624"],
        ),
        ("a zero period", ["tb", "100", "10", "0", "1"]),
        (
            "capacity x period at 2^53",
            ["tb", "9007199254740992", "1", "1", "1"],
        ),
        ("unreadable quota edges", ["cq", "100", "0", "0", "1"]),
    ] {
        script::set_clock(&mut con, T0);
        let mut cmd = eval(&SETTLE_AT);
        cmd.arg(2).arg(&a.key).arg("s:{k}:other");
        cmd.arg(&["tb", "100", "10", "1000", "5", "0", "0"][..])
            .arg(&second[..])
            .arg(0)
            .arg(0);
        left -= 5;
        assert_eq!(
            cmd.query::<Vec<Value>>(&mut con).unwrap(),
            [
                Value::Int(left),
                failed(if second[0] == "cq" {
                    "limit 2: no window of its edges holds Redis' clock"
                } else {
                    "limit 2 has an unknown kind or numbers out of range"
                })
            ],
            "{what}"
        );
        assert!(!exists(&mut con, "s:{k}:other"), "{what}");
    }
    // A call that does not parse (not seven values per key) settles
    // nothing: an error for the whole call.
    let before: Option<Vec<u8>> = redis::cmd("DUMP").arg(&a.key).query(&mut con).unwrap();
    script::set_clock(&mut con, T0);
    let err = eval(&SETTLE_AT)
        .arg(1)
        .arg(&a.key)
        .arg(&["tb", "100", "10", "1000", "5", "0"][..])
        .query::<Value>(&mut con)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("redis-guard settle: seven values per key"),
        "{err}"
    );
    let now: Option<Vec<u8>> = redis::cmd("DUMP").arg(&a.key).query(&mut con).unwrap();
    assert_eq!(now, before);
}
