//! The GCRA, fixed-window and sliding-window-counter kinds of
//! `lua/ratelimit.lua` (lua/gcra.lua, lua/fixed_window.lua,
//! lua/sliding_window_counter.lua) against a real redis-server: exact
//! boundaries, costs that can never fit, clocks that step back, expiry,
//! memory per key, all-or-nothing with every other kind, property tests
//! against the token bucket and against models, a batch against its members
//! one by one at one instant, and the sliding-window counter's documented
//! worst cases.
//!
//! Where exact time matters, the scripts run with a test clock
//! (`support::script::RATELIMIT_AT`: the production source with its TIME
//! preamble replaced by a read of a clock key), so every number is exact and
//! nothing sleeps. Keys still expire on Redis' real clock: a test whose calls
//! depend on a key written earlier either keeps that key's TTL far above the
//! test's run time, or (the property tests) removes the TTL in the same
//! MULTI as the call. Elsewhere (concurrency, EVALSHA, expiry on Redis' own
//! clock) the real script runs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::script::{
    self, admits, at, fw, gcra, one, rejects, sw, swc, tb, with_limits, Decision, Limit, Verdict,
    BATCH_AT, HOUR, MINUTE, RATELIMIT_AT, SECOND, T0,
};
use support::{
    assert_expires_in, key_exists as exists, key_pttl, pexpiretime, redis_now_ms as now_ms, set_key,
};

use std::cell::{Cell, RefCell};
use std::sync::LazyLock;

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestRunner;
use redis::{Connection, Value};
use redis_guard::scripts::{Script, BATCH, RATELIMIT};

// ---------------------------------------------------------------------------
// Calling the script at a test-clock instant

/// `one` by the script without expiry (`script::without_expiry`): the
/// property tests move the test clock freely, and a key that expired on the
/// real clock meanwhile would be a fresh key the model does not expect.
fn one_kept(con: &mut Connection, now: i64, limit: &Limit) -> Verdict {
    let d = decide_kept(con, now, std::slice::from_ref(limit));
    assert_eq!(d.admitted, d.limits[0].allowed, "{d:?}");
    d.limits[0]
}

/// `at` by the script without expiry (see `one_kept`).
fn decide_kept(con: &mut Connection, now: i64, limits: &[Limit]) -> Decision {
    let v = kept(
        con,
        now,
        with_limits(script::eval(&RATELIMIT_KEPT), limits, None),
    );
    let d = script::parse(v).decision();
    assert_eq!(d.limits.len(), limits.len());
    d
}

/// lua/ratelimit.lua and lua/batch.lua at the test clock, writing no TTL.
static RATELIMIT_KEPT: LazyLock<Script> = LazyLock::new(|| script::without_expiry(&RATELIMIT_AT));
static BATCH_KEPT: LazyLock<Script> = LazyLock::new(|| script::without_expiry(&BATCH_AT));

/// Runs `call` (a script without expiry) at `now` on the test clock.
fn kept(con: &mut Connection, now: i64, call: redis::Cmd) -> Value {
    script::set_clock(con, now);
    call.query(con)
        .unwrap_or_else(|e| panic!("call at {now}: {e}"))
}

// ---------------------------------------------------------------------------
// Reading state directly

fn get(con: &mut Connection, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query(con).unwrap()
}

/// A sliding-window counter's `(w, c, p)`.
fn swc_state(con: &mut Connection, key: &str) -> Option<(i64, i64, i64)> {
    let v: Vec<Option<i64>> = redis::cmd("HMGET")
        .arg(key)
        .arg("w")
        .arg("c")
        .arg("p")
        .query(con)
        .unwrap();
    match (v[0], v[1], v[2]) {
        (Some(w), Some(c), Some(p)) => Some((w, c, p)),
        (None, None, None) => None,
        other => panic!("half-written counter {key}: {other:?}"),
    }
}

/// The serialized value of `key` (DUMP), or None: equal before and after a
/// call means the call wrote nothing to it, whatever its type.
fn dump(con: &mut Connection, key: &str) -> Option<Vec<u8>> {
    redis::cmd("DUMP").arg(key).query(con).unwrap()
}

fn memory_usage(con: &mut Connection, key: &str) -> i64 {
    redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .arg("SAMPLES")
        .arg(0)
        .query(con)
        .unwrap()
}

/// The error reply of a hand-made call of the test-clock script.
fn contract_error(con: &mut Connection, keys: &[&str], argv: &[&str]) -> String {
    script::set_clock(con, T0);
    match script::eval_raw(con, &RATELIMIT_AT, keys, argv) {
        Ok(v) => panic!("{argv:?} answered {v:?}, not an error"),
        Err(e) => e.to_string(),
    }
}

// ---------------------------------------------------------------------------
// GCRA

#[test]
fn gcra_admits_exactly_the_burst_then_rejects_with_exact_remaining_retry_and_reset() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    // Burst 5, one unit back every second.
    let g = gcra("t:{k}:gcra:burst", 5, 1, SECOND);
    for n in 1..=5 {
        // Whole again n seconds from now, which is also the key's TTL.
        assert_eq!(one(&mut con, T0, &g), admits(5 - n, n * SECOND), "call {n}");
    }
    // The TAT on a whole ms is stored as a plain integer.
    let tat = (T0 + 5 * SECOND).to_string();
    assert_eq!(get(&mut con, &g.key), Some(tat.clone()));
    assert_eq!(one(&mut con, T0, &g), rejects(0, SECOND));
    assert_eq!(one(&mut con, T0 + SECOND - 1, &g), rejects(0, 1));
    assert_eq!(get(&mut con, &g.key), Some(tat), "rejections write nothing");
    // The ms the unit is back: admitted, and empty again.
    assert_eq!(one(&mut con, T0 + SECOND, &g), admits(0, 5 * SECOND));
    // A cost equal to what is back after 3 s: exactly at the limit.
    assert_eq!(
        one(&mut con, T0 + 4 * SECOND, &g.clone().cost(3)),
        admits(0, 5 * SECOND)
    );
    // TAT T0 + 9 s: at T0 + 5 s one unit is back, not two.
    assert_eq!(
        one(&mut con, T0 + 5 * SECOND, &g.clone().cost(2)),
        rejects(1, SECOND)
    );
    // At the TAT the key is as good as missing: the whole burst.
    assert_eq!(
        one(&mut con, T0 + 9 * SECOND, &g.clone().cost(5)),
        admits(0, 5 * SECOND)
    );
}

#[test]
fn gcra_with_a_fractional_emission_interval_stays_exact() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    // 7 units a minute: one every 8571 3/7 ms; burst 2.
    let g = gcra("t:{k}:gcra:frac", 2, 7, MINUTE);
    // TAT = T0 + 60000/7 = T0 + 8571 + 3/7: ms until it, rounded up.
    assert_eq!(one(&mut con, T0, &g), admits(1, 8572));
    assert_eq!(get(&mut con, &g.key), Some(format!("{}:3", T0 + 8571)));
    // T0 + 120000/7 = T0 + 17142 + 6/7.
    assert_eq!(one(&mut con, T0, &g), admits(0, 17143));
    assert_eq!(get(&mut con, &g.key), Some(format!("{}:6", T0 + 17142)));
    // Room for one unit at TAT - 60000/7 = T0 + 8571 3/7: from T0 + 8572.
    assert_eq!(one(&mut con, T0, &g), rejects(0, 8572));
    assert_eq!(one(&mut con, T0 + 8571, &g), rejects(0, 1));
    // At T0 + 8572 the backlog is (17142 6/7 - 8572) * 7 = 59996 credits
    // (a unit is 60000): admitted; TAT' = T0 + 8572 + 119996/7 =
    // T0 + 25714 2/7.
    assert_eq!(one(&mut con, T0 + 8572, &g), admits(0, 17143));
    assert_eq!(get(&mut con, &g.key), Some(format!("{}:2", T0 + 25714)));
    // Seven intervals of 8571 3/7 ms make a whole minute: a TAT on a whole
    // ms again, stored as a plain integer.
    let whole = gcra("t:{k}:gcra:frac-whole", 7, 7, MINUTE).cost(7);
    assert_eq!(one(&mut con, T0, &whole), admits(0, MINUTE));
    assert_eq!(get(&mut con, &whole.key), Some((T0 + MINUTE).to_string()));
}

#[test]
fn gcra_cost_above_the_burst_rejects_with_the_time_until_whole_and_writes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let g = gcra("t:{k}:gcra:big", 5, 1, SECOND);
    // Fresh: whole already, so no wait would help: retry 0.
    assert_eq!(one(&mut con, T0, &g.clone().cost(6)), rejects(5, 0));
    assert!(!exists(&mut con, &g.key), "nothing written");
    // 2 units spent at T0; at T0 + 500 the limit is whole again in 1500 ms.
    assert_eq!(one(&mut con, T0, &g.clone().cost(2)), admits(3, 2 * SECOND));
    let before = dump(&mut con, &g.key);
    assert_eq!(
        one(&mut con, T0 + 500, &g.clone().cost(6)),
        rejects(3, 1500)
    );
    assert_eq!(dump(&mut con, &g.key), before, "nothing written");
}

#[test]
fn gcra_state_ahead_of_a_stepped_back_clock_admits_nothing_until_the_clock_catches_up() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let g = gcra("t:{k}:gcra:back", 5, 1, SECOND);
    // The burst spent at T0: TAT = T0 + 5 s.
    assert_eq!(one(&mut con, T0, &g.clone().cost(5)), admits(0, 5 * SECOND));
    let stored = get(&mut con, &g.key);
    // The clock steps back 10 s: the TAT now lies 15 s ahead, more than the
    // burst's 5 s could ever leave. Nothing is admitted until the clock is
    // back where one unit fits (T0 + 1 s), and retry says when, exactly.
    for back in (0..11).map(|s| T0 - 10 * SECOND + s * SECOND - 1) {
        let v = one(&mut con, back, &g);
        assert_eq!(v, rejects(0, T0 + SECOND - back), "at T0{:+}", back - T0);
    }
    // A cost above the burst: the time until the backlog is gone.
    assert_eq!(
        one(&mut con, T0 - 10 * SECOND, &g.clone().cost(6)),
        rejects(0, 15 * SECOND)
    );
    assert_eq!(get(&mut con, &g.key), stored, "rejections write nothing");
    assert_eq!(one(&mut con, T0 + SECOND, &g), admits(0, 5 * SECOND));
}

#[test]
fn the_script_without_expiry_decides_as_the_real_one_and_leaves_every_key_without_a_ttl() {
    // The property tests below rely on it (`one_kept`).
    let (_redis, mut con) = support::Redis::start_with_conn();
    let kinds = |p: &str| {
        vec![
            tb(&format!("{p}:{{x}}:tb"), 5, 1, SECOND),
            gcra(&format!("{p}:{{x}}:gcra"), 5, 1, SECOND),
            fw(&format!("{p}:{{x}}:fw"), 5, MINUTE),
            swc(&format!("{p}:{{x}}:swc"), 5, MINUTE),
            sw(&format!("{p}:{{x}}:sw"), 5, MINUTE),
        ]
    };
    for (i, t) in [T0 + 10, T0 + 10, T0 + 20].into_iter().enumerate() {
        let real = at(&mut con, t, &kinds("real"));
        let kept = decide_kept(&mut con, t, &kinds("kept"));
        assert_eq!(real, kept, "call {i}");
    }
    for l in kinds("real") {
        assert!(key_pttl(&mut con, &l.key) > 0, "{}", l.key);
    }
    for l in kinds("kept") {
        assert_eq!(key_pttl(&mut con, &l.key), -1, "{}", l.key);
    }
}

#[test]
fn gcra_admits_exactly_what_the_token_bucket_admits_for_any_arrival_sequence() {
    let redis = support::Redis::start();
    let con = RefCell::new(redis.conn());
    let case_no = Cell::new(0usize);
    let (admitted, rejected) = (Cell::new(0u32), Cell::new(0u32));
    let mut runner = TestRunner::new(support::fixed_seed::config(
        64,
        support::fixed_seed::fresh_seed(),
        256,
    ));
    let result = runner.run(&bucketed_strategy(), |case| {
        let con = &mut *con.borrow_mut();
        let n = case_no.get();
        case_no.set(n + 1);
        let (kg, kt) = (format!("p{n}:{{g}}:gcra"), format!("p{n}:{{g}}:tb"));
        let mut t = T0 + case.start;
        let mut charged: Vec<(i64, i64)> = Vec::new();
        for (i, &(dt, cost)) in case.arrivals.iter().enumerate() {
            t += dt;
            let g = gcra(&kg, case.burst, case.rate, case.period).cost(cost);
            let b = tb(&kt, case.burst, case.rate, case.period).cost(cost);
            let vg = one_kept(con, t, &g);
            let vb = one_kept(con, t, &b);
            // Every number, not only the verdict: the token bucket's retry
            // and reset are the same quantities.
            prop_assert_eq!(vg, vb, "arrival {} at T0{:+}: {:?}", i, t - T0, case);
            if vg.allowed {
                bump(&admitted);
                charged.push((t, cost));
            } else {
                bump(&rejected);
            }
        }
        // Over any stretch [t1, t2] of arrivals, at most the burst plus
        // what the rate brings back in t2 - t1 (scaled by the period to
        // stay in integers).
        for i in 0..charged.len() {
            let mut units = 0;
            for &(t2, cost) in &charged[i..] {
                units += cost;
                let elapsed = t2 - charged[i].0;
                prop_assert!(
                    units * case.period <= case.burst * case.period + case.rate * elapsed,
                    "{} units in {} ms: {:?}",
                    units,
                    elapsed,
                    case
                );
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    assert!(
        admitted.get() > 0 && rejected.get() > 0,
        "{admitted:?} {rejected:?}"
    );
}

fn bump(c: &Cell<u32>) {
    c.set(c.get() + 1);
}

/// A GCRA / token bucket and the arrivals it sees: `(ms since the previous
/// arrival, cost)`, costs within the burst.
#[derive(Debug, Clone)]
struct Bucketed {
    burst: i64,
    rate: i64,
    period: i64,
    /// ms after T0 of the clock before the first arrival.
    start: i64,
    arrivals: Vec<(i64, i64)>,
}

fn bucketed_strategy() -> impl Strategy<Value = Bucketed> {
    // Periods from 1 ms (emission intervals below a ms) to a minute, and
    // rates that rarely divide them (fractional intervals).
    (
        1..=8i64,
        1..=7i64,
        select(vec![1i64, 3, 7, 333, SECOND, MINUTE]),
    )
        .prop_flat_map(|(burst, rate, period)| {
            // Gaps up to about two units' worth of refill, and many zeros
            // (same-ms arrivals), so the bucket is often empty.
            let gap = (2 * period / rate).max(2);
            (
                Just(burst),
                Just(rate),
                Just(period),
                0..MINUTE,
                vec((prop_oneof![Just(0i64), 0..=gap], 1..=burst), 1..=40),
            )
        })
        .prop_map(|(burst, rate, period, start, arrivals)| Bucketed {
            burst,
            rate,
            period,
            start,
            arrivals,
        })
}

// ---------------------------------------------------------------------------
// Fixed window

#[test]
fn fixed_window_admits_exactly_the_limit_then_rejects_until_the_window_ends() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let w = fw("t:{k}:fw:limit", 3, MINUTE);
    let idx = T0 / MINUTE;
    // 15 s into a minute window: 45 s to its end, the reset and the TTL.
    let now = T0 + 15 * SECOND;
    assert_eq!(one(&mut con, now, &w), admits(2, 45 * SECOND));
    assert_eq!(
        one(&mut con, now, &w.clone().cost(2)),
        admits(0, 45 * SECOND)
    );
    assert_eq!(get(&mut con, &w.key), Some(format!("{idx}:3")));
    assert_eq!(one(&mut con, now, &w), rejects(0, 45 * SECOND));
    assert_eq!(one(&mut con, T0 + MINUTE - 1, &w), rejects(0, 1));
    assert_eq!(
        get(&mut con, &w.key),
        Some(format!("{idx}:3")),
        "rejections write nothing"
    );
    // The next window starts empty, at its first ms.
    assert_eq!(one(&mut con, T0 + MINUTE, &w), admits(2, MINUTE));
    assert_eq!(get(&mut con, &w.key), Some(format!("{}:1", idx + 1)));
}

#[test]
fn fixed_window_admits_twice_the_limit_across_a_window_edge() {
    // The documented price of a fixed window: a full window's worth in its
    // last ms and another in the next window's first ms.
    let (_redis, mut con) = support::Redis::start_with_conn();
    let w = fw("t:{k}:fw:edge", 3, MINUTE).cost(3);
    assert_eq!(one(&mut con, T0 + MINUTE - 1, &w), admits(0, 1));
    assert_eq!(one(&mut con, T0 + MINUTE, &w), admits(0, MINUTE));
    assert_eq!(
        one(&mut con, T0 + MINUTE + 1, &w.clone().cost(1)),
        rejects(0, MINUTE - 1)
    );
}

#[test]
fn fixed_window_cost_above_the_limit_rejects_and_writes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let w = fw("t:{k}:fw:big", 3, MINUTE);
    // Empty: no wait would help, retry 0.
    assert_eq!(
        one(&mut con, T0 + 10 * SECOND, &w.clone().cost(4)),
        rejects(3, 0)
    );
    assert!(!exists(&mut con, &w.key));
    // With a count: until the window's end, when it is empty again.
    assert_eq!(one(&mut con, T0 + 10 * SECOND, &w), admits(2, 50 * SECOND));
    let before = dump(&mut con, &w.key);
    assert_eq!(
        one(&mut con, T0 + 20 * SECOND, &w.clone().cost(4)),
        rejects(2, 40 * SECOND)
    );
    assert_eq!(dump(&mut con, &w.key), before);
}

#[test]
fn fixed_window_never_reads_an_old_windows_count_as_the_current_one() {
    // A key that outlived its window (Redis decides expiry by the time the
    // script started, which may lag the script's TIME at the edge) holds
    // the previous window's full count: it must not count now.
    let (_redis, mut con) = support::Redis::start_with_conn();
    let w = fw("t:{k}:fw:old", 3, MINUTE);
    let idx = T0 / MINUTE;
    set_key(&mut con, &w.key, &format!("{}:3", idx - 1));
    assert_eq!(one(&mut con, T0, &w), admits(2, MINUTE));
    assert_eq!(get(&mut con, &w.key), Some(format!("{idx}:1")));
    // Nor one from windows further back.
    set_key(&mut con, &w.key, &format!("{}:3", idx - 7));
    assert_eq!(one(&mut con, T0, &w), admits(2, MINUTE));
}

#[test]
fn fixed_window_count_stamped_ahead_of_a_stepped_back_clock_counts_until_that_window_ends() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let w = fw("t:{k}:fw:back", 3, MINUTE);
    let idx = T0 / MINUTE;
    // Two units in window idx + 1, then the clock steps back into window idx.
    assert_eq!(
        one(&mut con, T0 + MINUTE + 5 * SECOND, &w.clone().cost(2)),
        admits(1, 55 * SECOND)
    );
    let back = T0 + 30 * SECOND;
    // The later window's count is the current one until that window ends,
    // 90 s from the stepped-back clock; what is admitted counts against it.
    assert_eq!(one(&mut con, back, &w), admits(0, 90 * SECOND));
    assert_eq!(get(&mut con, &w.key), Some(format!("{}:3", idx + 1)));
    assert_eq!(one(&mut con, back, &w), rejects(0, 90 * SECOND));
    // So window idx + 1, reached again, still holds only its 3.
    assert_eq!(
        one(&mut con, T0 + MINUTE + 10 * SECOND, &w),
        rejects(0, 50 * SECOND)
    );
    assert_eq!(one(&mut con, T0 + 2 * MINUTE, &w), admits(2, MINUTE));
}

#[test]
fn fixed_window_admits_exactly_the_model_and_never_more_than_the_limit_per_aligned_window() {
    let redis = support::Redis::start();
    let con = RefCell::new(redis.conn());
    let case_no = Cell::new(0usize);
    let (admitted, rejected) = (Cell::new(0u32), Cell::new(0u32));
    let mut runner = TestRunner::new(support::fixed_seed::config(64, 0x6677_5f6d_6f64_656c, 256));
    let result = runner.run(
        &windowed_strategy(&[1, 7, SECOND, MINUTE], &[1, 2, 3, 6]),
        |case| {
            let con = &mut *con.borrow_mut();
            let n = case_no.get();
            case_no.set(n + 1);
            let key = format!("p{n}:{{w}}:fw");
            let (limit, window) = (case.limit, case.window);
            let mut t = T0 + case.start;
            // The model: units counted per aligned window.
            let mut count: std::collections::BTreeMap<i64, i64> = Default::default();
            for (i, &(dt, cost)) in case.arrivals.iter().enumerate() {
                t += dt;
                let idx = t.div_euclid(window);
                let ends = (idx + 1) * window - t;
                let held = count.get(&idx).copied().unwrap_or(0);
                let v = one_kept(con, t, &fw(&key, limit, window).cost(cost));
                let want = if held + cost <= limit {
                    *count.entry(idx).or_default() += cost;
                    bump(&admitted);
                    admits(limit - held - cost, ends)
                } else {
                    bump(&rejected);
                    rejects(limit - held, ends)
                };
                prop_assert_eq!(v, want, "arrival {} at T0{:+}: {:?}", i, t - T0, case);
            }
            for (idx, units) in &count {
                prop_assert!(*units <= limit, "window {}: {} units", idx, units);
            }
            Ok(())
        },
    );
    if let Err(e) = result {
        panic!("{e}");
    }
    assert!(
        admitted.get() > 0 && rejected.get() > 0,
        "{admitted:?} {rejected:?}"
    );
}

/// A windowed limit and the arrivals it sees: `(ms since the previous
/// arrival, cost)`, costs within the limit.
#[derive(Debug, Clone)]
struct Windowed {
    limit: i64,
    window: i64,
    start: i64,
    arrivals: Vec<(i64, i64)>,
}

fn windowed_strategy(windows: &[i64], limits: &[i64]) -> impl Strategy<Value = Windowed> {
    (select(limits.to_vec()), select(windows.to_vec()))
        .prop_flat_map(|(limit, window)| {
            // Gaps from 0 to a little over a window: arrivals bunch in one
            // window, spread over two, or skip one.
            (
                Just(limit),
                Just(window),
                0..window,
                vec(
                    (
                        prop_oneof![Just(0i64), 0..=window / 4, 0..=window + window / 4 + 1],
                        1..=limit,
                    ),
                    1..=40,
                ),
            )
        })
        .prop_map(|(limit, window, start, arrivals)| Windowed {
            limit,
            window,
            start,
            arrivals,
        })
}

// ---------------------------------------------------------------------------
// Sliding-window counter

#[test]
fn sliding_window_counter_admits_exactly_the_limit_then_rejects_with_exact_retry() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = swc("t:{k}:swc:limit", 4, MINUTE);
    let idx = T0 / MINUTE;
    let now = T0 + 15 * SECOND;
    // Reset: 45 s to the window's end, then until the count's weight in the
    // next window, floor(c * (60000 - e) / 60000), is 0: from
    // e = 60000 - floor(59999 / c) on, i.e. 1, 30001, 40001, 45001 ms for
    // c = 1..4.
    assert_eq!(one(&mut con, now, &c), admits(3, 45 * SECOND + 1));
    assert_eq!(one(&mut con, now, &c), admits(2, 45 * SECOND + 30_001));
    assert_eq!(one(&mut con, now, &c), admits(1, 45 * SECOND + 40_001));
    assert_eq!(one(&mut con, now, &c), admits(0, 45 * SECOND + 45_001));
    assert_eq!(swc_state(&mut con, &c.key), Some((idx, 4, 0)));
    // Full: only in the next window, once the 4 weigh 3: floor(4 (60000 -
    // e) / 60000) <= 3 from e = 1.
    assert_eq!(one(&mut con, now, &c), rejects(0, 45 * SECOND + 1));
    assert_eq!(one(&mut con, T0 + MINUTE, &c), rejects(0, 1));
    assert_eq!(
        swc_state(&mut con, &c.key),
        Some((idx, 4, 0)),
        "rejections write nothing"
    );
    // The window moved on: the 4 are now the previous count.
    assert_eq!(
        one(&mut con, T0 + MINUTE + 1, &c),
        admits(0, MINUTE - 1 + 1)
    );
    assert_eq!(swc_state(&mut con, &c.key), Some((idx + 1, 1, 4)));
}

#[test]
fn sliding_window_counter_weighs_the_previous_window_by_its_part_still_in_the_span() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = swc("t:{k}:swc:weigh", 4, MINUTE);
    let idx = T0 / MINUTE;
    assert_eq!(
        one(&mut con, T0 + 50 * SECOND, &c.clone().cost(4)),
        admits(0, 10 * SECOND + 45_001)
    );
    // Half-way through the next window the 4 weigh floor(4 * 30000 /
    // 60000) = 2: 2 left.
    let half = T0 + MINUTE + 30 * SECOND;
    // Cost 3 needs the weight at 1: floor(4 (60000 - e) / 60000) <= 1 from
    // e = 30001, one ms later.
    assert_eq!(one(&mut con, half, &c.clone().cost(3)), rejects(2, 1));
    assert_eq!(
        one(&mut con, half, &c.clone().cost(2)),
        admits(0, 30 * SECOND + 30_001)
    );
    assert_eq!(swc_state(&mut con, &c.key), Some((idx + 1, 2, 4)));
    // Now 2 + weight 2: a unit needs the weight at 1 (e = 30001), ...
    assert_eq!(one(&mut con, half, &c), rejects(0, 1));
    // ... and cost 3 can only fit in the window after, where the 2 weigh
    // floor(2 (60000 - e) / 60000) <= 1 from e = 1.
    assert_eq!(
        one(&mut con, half, &c.clone().cost(3)),
        rejects(0, 30 * SECOND + 1)
    );
    // Two windows on, nothing weighs any more: as fresh.
    assert_eq!(
        one(&mut con, T0 + 3 * MINUTE, &c.clone().cost(4)),
        admits(0, MINUTE + 45_001)
    );
    assert_eq!(swc_state(&mut con, &c.key), Some((idx + 3, 4, 0)));
}

#[test]
fn sliding_window_counter_cost_above_the_limit_rejects_and_writes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = swc("t:{k}:swc:big", 4, MINUTE);
    assert_eq!(one(&mut con, T0, &c.clone().cost(5)), rejects(4, 0));
    assert!(!exists(&mut con, &c.key));
    // 1 unit at T0 + 10 s: the estimate is 0 again 1 ms into the next window.
    assert_eq!(
        one(&mut con, T0 + 10 * SECOND, &c),
        admits(3, 50 * SECOND + 1)
    );
    let before = dump(&mut con, &c.key);
    assert_eq!(
        one(&mut con, T0 + 20 * SECOND, &c.clone().cost(5)),
        rejects(3, 40 * SECOND + 1)
    );
    // In the next window only the previous count weighs: 4 units weigh
    // until floor(4 (60000 - e) / 60000) = 0, from e = 45001.
    let d = swc("t:{k}:swc:big2", 4, MINUTE);
    assert_eq!(
        one(&mut con, T0, &d.clone().cost(4)),
        admits(0, MINUTE + 45_001)
    );
    // 5 s in, the 4 weigh floor(4 * 55000 / 60000) = 3: 1 left.
    assert_eq!(
        one(&mut con, T0 + MINUTE + 5_000, &d.clone().cost(5)),
        rejects(1, 40_001)
    );
    assert_eq!(dump(&mut con, &c.key), before);
}

#[test]
fn sliding_window_counter_stamped_ahead_of_a_stepped_back_clock_stands_at_that_windows_start() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = swc("t:{k}:swc:back", 4, MINUTE);
    let idx = T0 / MINUTE;
    // 4 at T0 + 59 s; 2 more half-way through the next window (the 4 weigh 2).
    assert_eq!(
        one(&mut con, T0 + 59 * SECOND, &c.clone().cost(4)),
        admits(0, SECOND + 45_001)
    );
    let later = T0 + MINUTE + 30 * SECOND;
    assert_eq!(
        one(&mut con, later, &c.clone().cost(2)),
        admits(0, 30 * SECOND + 30_001)
    );
    let stored = swc_state(&mut con, &c.key);
    assert_eq!(stored, Some((idx + 1, 2, 4)));
    // The clock steps back to T0 + 50 s: time stands at window idx + 1's
    // start, where the previous 4 weigh fully: estimate 6. A unit needs the
    // weight at 1, 30001 ms into that window: 10000 + 30001 ms from now.
    let back = T0 + 50 * SECOND;
    assert_eq!(one(&mut con, back, &c), rejects(0, 10 * SECOND + 30_001));
    // A cost above the limit: until the 2 no longer weigh in window idx + 2.
    assert_eq!(
        one(&mut con, back, &c.clone().cost(5)),
        rejects(0, 10 * SECOND + MINUTE + 30_001)
    );
    assert_eq!(
        swc_state(&mut con, &c.key),
        stored,
        "rejections write nothing"
    );
    // Back on the original time line, exactly where the wait said.
    assert_eq!(one(&mut con, T0 + MINUTE + 30_000, &c), rejects(0, 1));
    assert_eq!(
        one(&mut con, T0 + MINUTE + 30_001, &c),
        admits(0, 29_999 + 40_001)
    );
}

#[test]
fn sliding_window_counter_admits_twice_the_limit_in_one_window_span_unlike_the_log() {
    // The documented over-admission (lua/sliding_window_counter.lua): L units
    // in the last ms of window i-1, then the k-th unit at
    // e = floor((k - 1) W / L) + 1 into window i. The log (sw) sees the same
    // arrivals. Without expiry: the first unit's key lives 2 ms, so a
    // moment's real wait between calls would drop it.
    let (_redis, mut con) = support::Redis::start_with_conn();
    const L: i64 = 10;
    let c = swc("t:{k}:worst:swc", L, MINUTE);
    let log = sw("t:{k}:worst:sw", L, MINUTE);
    let last_ms = T0 + MINUTE - 1;
    for _ in 0..L {
        let d = decide_kept(
            &mut con,
            last_ms,
            &[c.clone().shadow(), log.clone().shadow()],
        );
        assert!(d.limits[0].allowed && d.limits[1].allowed, "{d:?}");
    }
    let start = T0 + MINUTE;
    let (mut by_counter, mut by_log) = (L, L);
    let mut last = 0;
    for k in 1..=L {
        let e = (k - 1) * MINUTE / L + 1;
        // A ms earlier the weight is one unit too high.
        assert_eq!(
            one_kept(&mut con, start + e - 1, &c),
            rejects(0, 1),
            "k = {k}"
        );
        let d = decide_kept(
            &mut con,
            start + e,
            &[c.clone().shadow(), log.clone().shadow()],
        );
        assert_eq!(
            (d.limits[0].allowed, d.limits[0].remaining),
            (true, 0),
            "k = {k}: {d:?}"
        );
        // The log holds the L units of last_ms until last_ms + W.
        assert_eq!(
            d.limits[1],
            rejects(0, last_ms + MINUTE - (start + e)),
            "k = {k}"
        );
        by_counter += i64::from(d.limits[0].allowed);
        by_log += i64::from(d.limits[1].allowed);
        last = start + e;
    }
    // All 2L arrivals lie in (last - W, last]: a span of one window.
    assert_eq!(last, start + 54_001);
    assert!(last - MINUTE < last_ms);
    assert_eq!((by_counter, by_log), (2 * L, L));
}

#[test]
fn sliding_window_counter_holds_back_the_whole_limit_that_the_log_admits_after_a_full_window_at_its_first_ms(
) {
    // The documented under-admission: L units in the first ms of window
    // i-1. At the start of window i the log admits all L again (they left
    // its span); the counter still weighs them fully.
    let (_redis, mut con) = support::Redis::start_with_conn();
    const L: i64 = 10;
    let c = swc("t:{k}:under:swc", L, MINUTE);
    let log = sw("t:{k}:under:sw", L, MINUTE);
    let d = at(&mut con, T0, &[c.clone().cost(L), log.clone().cost(L)]);
    assert!(d.admitted, "{d:?}");
    let start = T0 + MINUTE;
    assert_eq!(
        one(&mut con, start, &log.clone().cost(L)),
        admits(0, MINUTE)
    );
    // A cost of L waits until the weight is 0: e = 60000 - floor(59999 / 10).
    assert_eq!(one(&mut con, start, &c.clone().cost(L)), rejects(0, 54_001));
    assert_eq!(one(&mut con, start, &c), rejects(0, 1));
    // A ms before, they still weigh floor(10 * 6000 / 60000) = 1.
    assert_eq!(
        one(&mut con, start + 54_000, &c.clone().cost(L)),
        rejects(L - 1, 1)
    );
    assert_eq!(
        one(&mut con, start + 54_001, &c.clone().cost(L)),
        admits(0, 5_999 + 54_001)
    );
}

#[test]
fn sliding_window_counter_past_exact_products_is_off_by_at_most_one_unit_and_still_admits_when_it_says(
) {
    // prev * (W - e) above 2^53: the weight may be a unit off (the header),
    // and retry and reset come from searching the weight as computed, so
    // they must still be the first ms at which the script itself admits.
    let (_redis, mut con) = support::Redis::start_with_conn();
    const W: i64 = 1_000_000_000_039;
    const L: i64 = 999_999_937;
    let (a, b) = (swc("t:{k}:big:a", L, W), swc("t:{k}:big:b", L, W));
    // The whole limit in the last ms but 5 of window 0 = [0, W), on both keys.
    let charged = W - 5;
    let reset = one(&mut con, charged, &a.clone().cost(L)).reset_ms;
    assert_eq!(one(&mut con, charged, &b.clone().cost(L)).reset_ms, reset);
    // 12345 ms into window 1: the L weigh floor(L (W - 12345) / W).
    let t = W + 12_345;
    let third = a.clone().cost(L / 3);
    let v = one(&mut con, t, &third);
    let exact = i64::try_from(i128::from(L) * i128::from(W - 12_345) / i128::from(W)).unwrap();
    assert!(!v.allowed, "{v:?}");
    assert!(
        (v.remaining - (L - exact)).abs() <= 1,
        "{v:?}, exact estimate {exact}"
    );
    let r = v.retry_ms;
    assert!(!one(&mut con, t + r - 1, &third).allowed, "retry {r}");
    assert!(one(&mut con, t + r, &third).allowed, "retry {r}");
    // Fully restored (the estimate 0: a request of L fits) exactly at reset.
    let whole = b.clone().cost(L);
    assert!(
        !one(&mut con, charged + reset - 1, &whole).allowed,
        "reset {reset}"
    );
    assert!(
        one(&mut con, charged + reset, &whole).allowed,
        "reset {reset}"
    );
}

#[test]
fn sliding_window_counter_answers_as_its_formula_with_a_retry_and_reset_that_hold_to_the_ms() {
    // A model written from the header's formula alone, in exact integers:
    // the verdict and remaining must match it, a rejection's retry must be
    // the first ms the model admits the same request, and an admission's
    // reset the first ms the model's estimate is 0. Also the documented
    // bound: at most 2L in any span of W ms.
    let redis = support::Redis::start();
    let con = RefCell::new(redis.conn());
    let case_no = Cell::new(0usize);
    let (admitted, in_window, next_window) = (Cell::new(0u32), Cell::new(0u32), Cell::new(0u32));
    let mut runner = TestRunner::new(support::fixed_seed::config(96, 0x7377_635f_6d6f_6465, 256));
    let windows = [1, 2, 7, 10, SECOND, MINUTE];
    let result = runner.run(
        &windowed_strategy(&windows, &[1, 2, 3, 6, 50, 1000]),
        |case| {
            let con = &mut *con.borrow_mut();
            let n = case_no.get();
            case_no.set(n + 1);
            let key = format!("p{n}:{{c}}:swc");
            let (limit, window) = (case.limit, case.window);
            let m = SwcModel { window };
            let mut state = None;
            let mut t = T0 + case.start;
            let mut charged: Vec<(i64, i64)> = Vec::new();
            for (i, &(dt, cost)) in case.arrivals.iter().enumerate() {
                t += dt;
                let at_ = format!("arrival {i} at T0{:+}: {case:?}", t - T0);
                let v = one_kept(con, t, &swc(&key, limit, window).cost(cost));
                let est = m.estimate(state, t);
                prop_assert_eq!(v.allowed, est + cost <= limit, "{}", at_);
                if v.allowed {
                    bump(&admitted);
                    prop_assert_eq!(
                        (v.remaining, v.retry_ms),
                        (limit - est - cost, 0),
                        "{}",
                        at_
                    );
                    state = Some(m.charge(state, t, cost));
                    charged.push((t, cost));
                    let r = v.reset_ms;
                    prop_assert!(r >= 1, "{}", at_);
                    prop_assert_eq!(m.estimate(state, t + r), 0, "reset {}: {}", r, at_);
                    prop_assert!(m.estimate(state, t + r - 1) > 0, "reset {}: {}", r, at_);
                } else {
                    let r = v.retry_ms;
                    prop_assert_eq!(
                        (v.remaining, v.reset_ms),
                        ((limit - est).max(0), r),
                        "{}",
                        at_
                    );
                    prop_assert!(r >= 1, "{}", at_);
                    prop_assert!(
                        m.estimate(state, t + r) + cost <= limit,
                        "retry {}: {}",
                        r,
                        at_
                    );
                    prop_assert!(
                        m.estimate(state, t + r - 1) + cost > limit,
                        "retry {}: {}",
                        r,
                        at_
                    );
                    if (t + r).div_euclid(window) == t.div_euclid(window) {
                        bump(&in_window);
                    } else {
                        bump(&next_window);
                    }
                }
            }
            for i in 0..charged.len() {
                let mut units = 0;
                for &(t2, cost) in charged[i..]
                    .iter()
                    .take_while(|(t2, _)| *t2 - charged[i].0 < window)
                {
                    units += cost;
                    prop_assert!(
                        units <= 2 * limit,
                        "{} units by T0{:+}: {:?}",
                        units,
                        t2 - T0,
                        case
                    );
                }
            }
            Ok(())
        },
    );
    if let Err(e) = result {
        panic!("{e}");
    }
    assert!(
        admitted.get() > 0 && in_window.get() > 0 && next_window.get() > 0,
        "admitted {admitted:?}, retries within the window {in_window:?}, in the next {next_window:?}"
    );
}

/// The sliding-window counter as lua/sliding_window_counter.lua's header
/// states it, in i128 so nothing rounds: state (window index, count, count
/// of the window before).
struct SwcModel {
    window: i64,
}

impl SwcModel {
    /// (count of the current window, count of the previous, ms into the current).
    fn view(&self, state: Option<(i64, i64, i64)>, t: i64) -> (i64, i64, i64) {
        let idx = t.div_euclid(self.window);
        let e = t - idx * self.window;
        match state {
            Some((w, c, p)) if w == idx => (c, p, e),
            Some((w, c, _)) if w == idx - 1 => (0, c, e),
            _ => (0, 0, e),
        }
    }

    fn estimate(&self, state: Option<(i64, i64, i64)>, t: i64) -> i64 {
        let (cur, prev, e) = self.view(state, t);
        let w = i128::from(self.window);
        let weight = i128::from(prev) * (w - i128::from(e)) / w;
        i64::try_from(weight).unwrap() + cur
    }

    fn charge(&self, state: Option<(i64, i64, i64)>, t: i64, cost: i64) -> (i64, i64, i64) {
        let (cur, prev, _) = self.view(state, t);
        (t.div_euclid(self.window), cur + cost, prev)
    }
}

// ---------------------------------------------------------------------------
// Expiry

#[test]
fn every_key_of_the_new_kinds_expires_exactly_when_its_state_is_as_good_as_missing() {
    // With the test clock the TTL each call sets is a known number; it must
    // equal the reply's reset, and one ms before it the state must still
    // matter (a request of the whole limit is rejected) while at it, it must
    // not (the same request is admitted).
    let (_redis, mut con) = support::Redis::start_with_conn();
    let now = T0 + 15 * SECOND;
    let cases = [
        // 60000/7 ms rounded up: 8572.
        (gcra("t:{k}:ttl:gcra", 2, 7, MINUTE), 8572, 0),
        // The window's end; the key lives 2 ms more, so that it never
        // vanishes before its window ends (lua/fixed_window.lua, fw_flush).
        (fw("t:{k}:ttl:fw", 3, MINUTE), 45 * SECOND, 2),
        // The window's end, then 1 ms until 1 unit weighs 0.
        (swc("t:{k}:ttl:swc", 3, MINUTE), 45 * SECOND + 1, 0),
    ];
    for (limit, ttl, edge) in cases {
        let t0 = now_ms(&mut con);
        assert_eq!(
            one(&mut con, now, &limit),
            admits(limit.a - 1, ttl),
            "{limit:?}"
        );
        assert_expires_in(&mut con, &limit.key, ttl + edge, t0);
        let whole = limit.clone().cost(limit.a);
        assert!(!one(&mut con, now + ttl - 1, &whole).allowed, "{limit:?}");
        assert!(one(&mut con, now + ttl, &whole).allowed, "{limit:?}");
    }
}

#[test]
fn every_key_of_the_new_kinds_expires_when_its_reply_says_on_redis_own_clock() {
    // The real script: TTLs set from Redis TIME, bounded by TIME read
    // around the call.
    let (_redis, mut con) = support::Redis::start_with_conn();
    let limits = [
        gcra("t:{k}:real:gcra", 5, 1, MINUTE).cost(2),
        fw("t:{k}:real:fw", 5, MINUTE),
        swc("t:{k}:real:swc", 5, MINUTE).cost(2),
    ];
    let t0 = now_ms(&mut con);
    let d = script::request(&mut con, &limits, None).decision();
    let t1 = now_ms(&mut con);
    assert!(d.admitted, "{d:?}");
    // A fresh GCRA key: two units take two minutes to come back, whatever the clock.
    assert_eq!(d.limits[0], admits(3, 2 * MINUTE));
    for (l, v) in limits.iter().zip(&d.limits) {
        let edge = if l.alg == "fw" { 2 } else { 0 };
        assert_expires_in(&mut con, &l.key, v.reset_ms + edge, t0);
    }
    // The window's end is an aligned minute edge. Redis counts a PEXPIRE
    // from its own reading of the clock (in 7.2+, the script's start, which
    // may be a ms before the script's TIME), so allow the call's duration
    // either way.
    let v = d.limits[1];
    let end = pexpiretime(&mut con, &limits[1].key);
    let slop = t1 - t0;
    assert!(v.reset_ms >= 1 && v.reset_ms <= MINUTE, "{v:?}");
    assert!(
        (t0 / MINUTE + 1) * MINUTE + 2 - slop <= end
            && end <= (t1 / MINUTE + 1) * MINUTE + 2 + slop,
        "fw expires 2 ms after its window's end, not at {end}, TIME {t0}..{t1}"
    );
    // The counter: the window's end, then until 2 units weigh 0 in the
    // next window (60000 - floor(59999 / 2) = 30001 ms into it).
    let v = d.limits[2];
    let end = pexpiretime(&mut con, &limits[2].key);
    assert!(
        (t0 / MINUTE + 1) * MINUTE + 30_001 - slop <= end
            && end <= (t1 / MINUTE + 1) * MINUTE + 30_001 + slop,
        "swc expires at {end} ({v:?}), TIME {t0}..{t1}"
    );
}

// ---------------------------------------------------------------------------
// Memory

#[test]
fn each_new_kind_keeps_one_small_key_per_limit() {
    // MEMORY USAGE of each kind's key as the filter names it (prefix, hash
    // tag, limit name, signature, descriptor), beside the existing kinds.
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = |sig: &str| format!("rg:rl:{{9f86d081884c7d65}}:per-user:{sig}:5:alice");
    let now = T0 + 15 * SECOND;
    let tb_key = tb(&key("tb2.100.10.1000"), 100, 10, SECOND);
    assert!(one(&mut con, now, &tb_key).allowed);
    let tb_bytes = memory_usage(&mut con, &tb_key.key);
    let mut report = vec![format!("tb: {tb_bytes} bytes")];
    let valkey = support::server::server() == support::server::Server::Valkey;
    let cases = [
        // (what, limit, bound in bytes on Redis 7.0.15 with jemalloc and on
        // Valkey 9.1.2 with libc malloc: each measured, plus one allocator
        // size class of headroom; 16 bytes for libc's)
        (
            "sw, one member",
            sw(&key("sw.100.60000"), 100, MINUTE),
            (0, 0),
        ),
        (
            "gcra, TAT on a whole ms",
            gcra(&key("gcra.100.10.1000"), 100, 10, SECOND),
            (112, 120),
        ),
        (
            "gcra, fractional TAT",
            gcra(&key("gcra.100.7.1000"), 100, 7, SECOND),
            (144, 120),
        ),
        ("fw", fw(&key("fw.100.60000"), 100, MINUTE), (128, 120)),
        ("swc", swc(&key("swc.100.60000"), 100, MINUTE), (144, 144)),
    ];
    for (what, limit, (on_redis, on_valkey)) in cases {
        assert!(one(&mut con, now, &limit).allowed, "{what}");
        let bytes = memory_usage(&mut con, &limit.key);
        report.push(format!("{what}: {bytes} bytes"));
        let bound = if valkey { on_valkey } else { on_redis };
        if bound > 0 {
            assert!(bytes <= bound, "{what}: {bytes} bytes, bound {bound}");
        }
        // And never more than the token bucket's one string, except the
        // counter's hash on Valkey: its key lives in the value's object
        // there, which makes a string one allocation (tb 104 bytes) and a
        // hash two (its listpack apart, 128).
        if bound > 0 && !(valkey && what == "swc") {
            assert!(bytes <= tb_bytes, "{what}: {bytes} bytes, tb {tb_bytes}");
        }
    }
    // The fractional TAT really is the "ms:rem" form, the other an integer.
    assert!(get(&mut con, &key("gcra.100.7.1000"))
        .unwrap()
        .contains(':'));
    assert!(!get(&mut con, &key("gcra.100.10.1000"))
        .unwrap()
        .contains(':'));
    println!(
        "MEMORY USAGE per key ({} byte key names):\n  {}",
        key("tb2.100.10.1000").len(),
        report.join("\n  ")
    );
}

/// The token bucket's state as the docs give it (docs/src/using/limits.md,
/// the kinds' table): "one string: credits and last update (ms), two
/// little-endian doubles", and its `MEMORY USAGE` on Redis 7.0.15 with a
/// key name of 56 bytes: 136, as `make bench` measured the filter's own
/// (docs/src/running/sizing.md, memory per key).
#[test]
fn a_token_bucket_is_sixteen_bytes_of_two_doubles_and_its_key_136_bytes_on_redis() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "rg:rl:{9f86d081884c7d65}:per-user:tb2.100.10.1000:4:anna";
    assert_eq!(key.len(), 56);
    let now = T0 + 15 * SECOND;
    assert!(one(&mut con, now, &tb(key, 100, 10, SECOND)).allowed);
    let value: Vec<u8> = redis::cmd("GET").arg(key).query(&mut con).unwrap();
    assert_eq!(value.len(), 16, "two doubles: {value:?}");
    let double = |b: &[u8]| f64::from_le_bytes(b.try_into().unwrap());
    // 100 tokens of 1000 credits, one spent, at the call's instant.
    assert_eq!(
        (double(&value[..8]), double(&value[8..])),
        (99_000.0, now as f64)
    );
    // The key's whole cost: the docs' figure on Redis; Valkey 9.1.2 (libc
    // malloc, the key inside the value's object) keeps it in one
    // allocation of 104.
    let want = match support::server::server() {
        support::server::Server::Redis => 136,
        support::server::Server::Valkey => 104,
    };
    assert_eq!(memory_usage(&mut con, key), want);
}

// ---------------------------------------------------------------------------
// All or nothing, shadow limits

/// One limit of every kind under `ns`, each 3 units a minute (the GCRA: a
/// burst of 3, one unit back every 20 s; the token bucket the same).
fn one_of_each(ns: &str) -> Vec<Limit> {
    vec![
        tb(&format!("{ns}:tb"), 3, 1, 20 * SECOND),
        sw(&format!("{ns}:sw"), 3, MINUTE),
        gcra(&format!("{ns}:gcra"), 3, 1, 20 * SECOND),
        fw(&format!("{ns}:fw"), 3, MINUTE),
        swc(&format!("{ns}:swc"), 3, MINUTE),
    ]
}

#[test]
fn a_rejection_by_any_kind_writes_nothing_to_any_other_kind() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    // What each kind reports at T0 + 20 s after one unit at T0 + 10 s,
    // not charged (as it stands), and after all three at T0 + 10 s, when it
    // is the one that rejects.
    let as_it_stands = [
        // One unit back 20 s after the charge: 10 s to go.
        admits(2, 10 * SECOND),
        // The member leaves at T0 + 70 s.
        admits(2, 50 * SECOND),
        // Same as the token bucket.
        admits(2, 10 * SECOND),
        // The window ends at T0 + 60 s.
        admits(2, 40 * SECOND),
        // Then 1 ms into the next window until 1 unit weighs 0.
        admits(2, 40 * SECOND + 1),
    ];
    let rejecting = [
        rejects(0, 10 * SECOND),
        rejects(0, 50 * SECOND),
        rejects(0, 10 * SECOND),
        rejects(0, 40 * SECOND),
        // In the next window, once 3 weigh 2: from e = 1.
        rejects(0, 40 * SECOND + 1),
    ];
    for r in 0..5 {
        let held = one_of_each(&format!("h{r}:{{a}}"));
        let fresh = one_of_each(&format!("f{r}:{{a}}"));
        assert!(at(&mut con, T0 + 10 * SECOND, &held).admitted);
        assert!(at(&mut con, T0 + 10 * SECOND, &[held[r].clone().cost(2)]).admitted);
        let before: Vec<_> = held.iter().map(|l| dump(&mut con, &l.key)).collect();

        let all: Vec<Limit> = held.iter().chain(&fresh).cloned().collect();
        let d = at(&mut con, T0 + 20 * SECOND, &all);
        let mut want: Vec<Verdict> = as_it_stands.to_vec();
        want[r] = rejecting[r];
        // Fresh: whole, nothing to restore.
        want.extend([admits(3, 0); 5]);
        assert_eq!(
            d,
            Decision {
                admitted: false,
                limits: want
            },
            "rejected by {}",
            held[r].alg
        );
        let after: Vec<_> = held.iter().map(|l| dump(&mut con, &l.key)).collect();
        assert_eq!(
            after, before,
            "rejected by {}: held keys changed",
            held[r].alg
        );
        for l in &fresh {
            assert!(
                !exists(&mut con, &l.key),
                "rejected by {}: {} created",
                held[r].alg,
                l.key
            );
        }
    }
}

#[test]
fn a_shadow_limit_of_a_new_kind_that_would_reject_is_reported_and_not_charged() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let now = T0 + 10 * SECOND;
    for (i, shadow) in [
        gcra("s:{a}:gcra", 3, 1, 20 * SECOND),
        fw("s:{a}:fw", 3, MINUTE),
        swc("s:{a}:swc", 3, MINUTE),
    ]
    .into_iter()
    .enumerate()
    {
        assert!(one(&mut con, now, &shadow.clone().cost(3)).allowed);
        let before = dump(&mut con, &shadow.key);
        let enforced: Vec<Limit> = one_of_each(&format!("e{i}:{{a}}"));
        let mut limits = vec![shadow.clone().shadow()];
        limits.extend(enforced.iter().cloned());
        let d = at(&mut con, now, &limits);
        assert!(d.admitted, "a shadow rejection does not block: {d:?}");
        assert!(
            !d.limits[0].allowed,
            "the shadow {} reports its rejection",
            shadow.alg
        );
        assert_eq!(
            dump(&mut con, &shadow.key),
            before,
            "{} charged",
            shadow.alg
        );
        // Every enforced limit was charged one unit.
        assert!(
            d.limits[1..].iter().all(|v| v.allowed && v.remaining == 2),
            "{d:?}"
        );
        for l in &enforced {
            assert!(exists(&mut con, &l.key), "{} not charged", l.key);
        }
    }
}

#[test]
fn a_shadow_limit_of_a_new_kind_that_admits_is_charged() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let now = T0 + 15 * SECOND;
    let limits: Vec<Limit> = one_of_each("s:{b}")
        .into_iter()
        .map(|l| l.cost(2).shadow())
        .collect();
    let d = at(&mut con, now, &limits);
    assert_eq!(
        d,
        Decision {
            admitted: true,
            limits: vec![
                admits(1, 40 * SECOND),
                admits(1, MINUTE),
                admits(1, 40 * SECOND),
                admits(1, 45 * SECOND),
                admits(1, 45 * SECOND + 30_001),
            ]
        }
    );
    // The same request again: each has 1 unit left, so each rejects now.
    let d = at(&mut con, now, &limits);
    assert!(
        d.admitted && d.limits.iter().all(|v| !v.allowed && v.remaining == 1),
        "{d:?}"
    );
}

// ---------------------------------------------------------------------------
// Batches, concurrency, contract

#[test]
fn a_batch_reads_and_writes_each_key_of_the_new_kinds_once_however_many_members_charge_it() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    // Hour windows and periods; one batch runs at one instant, so the
    // counts below do not depend on the clock.
    let limits = [
        gcra("o:{b}:gcra", 100, 1, HOUR),
        fw("o:{b}:fw", 100, HOUR),
        swc("o:{b}:swc", 100, HOUR),
    ];
    let members: Vec<Vec<Limit>> = (0..20).map(|_| limits.to_vec()).collect();
    let (keys, argv) = script::packed_batch(&members);
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut con)
        .unwrap();
    let reply: Vec<i64> = script::eval(&BATCH)
        .arg(keys.len())
        .arg(&keys)
        .arg(&argv)
        .query(&mut con)
        .unwrap();
    // [20, then per member: length 13, verdict 1, 3 x 4 integers].
    assert_eq!(reply.len(), 1 + 20 * 14, "{reply:?}");
    for j in 0..20 {
        let m = &reply[1 + j * 14..1 + (j + 1) * 14];
        let left = 99 - j as i64;
        assert_eq!((m[0], m[1]), (13, 1), "member {j}: {m:?}");
        assert_eq!(
            [m[2], m[3], m[6], m[7], m[10], m[11]],
            [1, left, 1, left, 1, left],
            "member {j}"
        );
    }
    // GCRA and fixed window: one GET and one SET (with PX) each; the
    // counter: one HMGET, one HSET, one PEXPIRE.
    assert_eq!(
        support::state_commands(&mut con),
        [
            ("get", 2),
            ("set", 2),
            ("hmget", 1),
            ("hset", 1),
            ("pexpire", 1)
        ]
    );
    // What the single writes left is what twenty charges in a row would.
    let fw_value = get(&mut con, "o:{b}:fw").unwrap();
    assert!(fw_value.ends_with(":20"), "{fw_value}");
    let (_, c, p) = swc_state(&mut con, "o:{b}:swc").unwrap();
    assert_eq!((c, p), (20, 0));
    let tat: i64 = get(&mut con, "o:{b}:gcra").unwrap().parse().unwrap();
    let t = now_ms(&mut con);
    assert!(
        tat - t <= 20 * HOUR && tat - t > 20 * HOUR - 1000,
        "TAT {tat}, now {t}"
    );
}

/// lua/batch.lua at `now` on the test clock (keys kept, see `kept`): each
/// member's decision.
fn batch_kept(con: &mut Connection, now: i64, members: &[Vec<Limit>]) -> Vec<Decision> {
    let (keys, argv) = script::packed_batch(members);
    let mut call = script::eval(&BATCH_KEPT);
    call.arg(keys.len()).arg(&keys).arg(&argv);
    script::batch_decisions(kept(con, now, call), members.len())
}

/// One limit of each kind with drawn parameters, small periods and windows
/// included; members pick 1..=3 of them with a cost and enforce flag.
#[derive(Debug, Clone)]
struct Instant {
    pool: Vec<Limit>,
    /// Requests at `t1` that leave state behind (backlogs, counts that are
    /// the previous window's by `t2`).
    warmup: Vec<Vec<(usize, i64, bool)>>,
    /// The requests decided at `t2`, as one batch and one by one.
    members: Vec<Vec<(usize, i64, bool)>>,
    t1: i64,
    t2: i64,
}

impl Instant {
    fn limits(&self, ns: &str, member: &[(usize, i64, bool)]) -> Vec<Limit> {
        member
            .iter()
            .map(|&(i, cost, enforce)| {
                let d = &self.pool[i];
                let mut l = d.clone().cost(cost.min(d.a));
                l.key = format!("{ns}:{}", d.alg);
                if !enforce {
                    l = l.shadow();
                }
                l
            })
            .collect()
    }
}

fn instant_strategy() -> impl Strategy<Value = Instant> {
    let periods = || select(vec![7i64, SECOND, MINUTE]);
    let windows = || select(vec![10i64, SECOND, MINUTE]);
    let pool = (
        (1..=6i64, 1..=5i64, periods()),
        (1..=6i64, windows()),
        (1..=6i64, 1..=7i64, periods()),
        (1..=6i64, windows()),
        (1..=6i64, windows()),
    )
        .prop_map(|(t, s, g, f, c)| {
            vec![
                tb("", t.0, t.1, t.2),
                sw("", s.0, s.1),
                gcra("", g.0, g.1, g.2),
                fw("", f.0, f.1),
                swc("", c.0, c.1),
            ]
        });
    let member = || {
        (
            proptest::sample::subsequence((0..5).collect::<Vec<usize>>(), 1..=3).prop_shuffle(),
            vec((1..=3i64, prop::bool::weighted(0.8)), 3),
        )
            .prop_map(|(defs, params)| {
                defs.into_iter()
                    .zip(params)
                    .map(|(i, (cost, enforce))| (i, cost, enforce))
                    .collect::<Vec<_>>()
            })
    };
    (
        pool,
        vec(member(), 0..=6),
        vec(member(), 1..=12),
        0..MINUTE,
        prop_oneof![Just(0i64), 0..=20i64, 0..=2 * MINUTE],
    )
        .prop_map(|(pool, warmup, members, start, gap)| Instant {
            pool,
            warmup,
            members,
            t1: T0 + start,
            t2: T0 + start + gap,
        })
}

#[test]
fn a_batch_at_one_instant_answers_and_writes_exactly_as_its_members_one_by_one() {
    // lua/batch.lua and lua/ratelimit.lua at the same test-clock instant,
    // over state left by earlier requests (backlogs, previous windows that
    // weigh, periods and windows of a few ms): every number of every reply,
    // and every key's value, must be identical. (tests/lua_batch.rs checks
    // the same on Redis' own clock, where only hour-scale limits compare.)
    let redis = support::Redis::start();
    let con = RefCell::new(redis.conn());
    let case_no = Cell::new(0usize);
    // Per kind (pool index): limits that admitted, and that rejected.
    let seen: [(Cell<u32>, Cell<u32>); 5] = Default::default();
    let mut runner = TestRunner::new(support::fixed_seed::config(
        64,
        support::fixed_seed::fresh_seed(),
        256,
    ));
    let result = runner.run(&instant_strategy(), |case| {
        let con = &mut *con.borrow_mut();
        let n = case_no.get();
        case_no.set(n + 1);
        let (na, nb) = (format!("a{n}:{{i}}"), format!("b{n}:{{i}}"));
        for m in &case.warmup {
            decide_kept(con, case.t1, &case.limits(&na, m));
            decide_kept(con, case.t1, &case.limits(&nb, m));
        }
        let members: Vec<Vec<Limit>> = case.members.iter().map(|m| case.limits(&na, m)).collect();
        let a = batch_kept(con, case.t2, &members);
        for (j, m) in case.members.iter().enumerate() {
            let b = decide_kept(con, case.t2, &case.limits(&nb, m));
            prop_assert_eq!(&a[j], &b, "member {}: {:?}", j, case);
            for (&(i, _, _), v) in m.iter().zip(&b.limits) {
                bump(if v.allowed { &seen[i].0 } else { &seen[i].1 });
            }
        }
        for d in &case.pool {
            let (ka, kb) = (format!("{na}:{}", d.alg), format!("{nb}:{}", d.alg));
            prop_assert_eq!(
                dump(con, &ka),
                dump(con, &kb),
                "{} vs {}: {:?}",
                ka,
                kb,
                case
            );
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    for (i, (yes, no)) in seen.iter().enumerate() {
        assert!(
            yes.get() > 0 && no.get() > 0,
            "kind {i}: {yes:?} admitted, {no:?} rejected"
        );
    }
}

#[test]
fn concurrent_calls_of_each_new_kind_admit_exactly_its_limit() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    assert_eq!(script::load(&mut con, &RATELIMIT), RATELIMIT.sha1);
    // The real script, by EVALSHA as the filter sends it. One unit back an
    // hour (GCRA), and windows of 2^42 ms (the current one ends in 2109):
    // nothing comes back and no window turns over while the race runs.
    for limit in [
        gcra("r:{c}:gcra", 100, 1, HOUR),
        fw("r:{c}:fw", 100, 1 << 42),
        swc("r:{c}:swc", 100, 1 << 42),
    ] {
        let admitted = redis.race(40, 300, |con, _| {
            let v = with_limits(
                script::evalsha(&RATELIMIT),
                std::slice::from_ref(&limit),
                None,
            )
            .query(con)
            .unwrap_or_else(|e| panic!("a racing call failed: {e}"));
            script::parse(v).decision().admitted
        });
        let yes = admitted.iter().filter(|a| **a).count();
        assert_eq!((yes, admitted.len() - yes), (100, 200), "{}", limit.alg);
    }
    assert!(get(&mut con, "r:{c}:fw").unwrap().ends_with(":100"));
    assert_eq!(swc_state(&mut con, "r:{c}:swc").map(|s| s.1), Some(100));
}

#[test]
fn numbers_that_would_corrupt_a_new_kinds_key_are_an_error_and_write_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let k = "t:{k}:err";
    let cases: [(&str, [&str; 6]); 11] = [
        ("gcra rate 0", ["gcra", "5", "0", "1000", "1", "1"]),
        ("gcra period 0", ["gcra", "5", "1", "0", "1", "1"]),
        (
            "gcra fractional burst",
            ["gcra", "5.5", "1", "1000", "1", "1"],
        ),
        (
            "gcra burst * period at 2^52",
            ["gcra", "4503599627370496", "1", "1", "1", "1"],
        ),
        ("gcra cost 0", ["gcra", "5", "1", "1000", "0", "1"]),
        ("fw window 0", ["fw", "5", "0", "0", "1", "1"]),
        (
            "fw limit above 2^50",
            ["fw", "1125899906842625", "1000", "0", "1", "1"],
        ),
        ("fw fractional cost", ["fw", "5", "1000", "0", "1.5", "1"]),
        ("swc window nan", ["swc", "5", "nan", "0", "1", "1"]),
        ("swc window inf", ["swc", "5", "inf", "0", "1", "1"]),
        ("swc negative limit", ["swc", "-5", "1000", "0", "1", "1"]),
    ];
    for (what, limit) in cases {
        let argv: Vec<&str> = ["1"].iter().chain(&limit).copied().collect();
        let err = contract_error(&mut con, &[k], &argv);
        assert!(
            err.contains("limit 1 has numbers out of range"),
            "{what}: {err}"
        );
        assert!(!exists(&mut con, k), "{what}: wrote {k}");
    }
    // The largest numbers the config allows pass, and decide exactly: a
    // burst of 2^52 - 1 units, one back every ms (whole again 1 ms per unit
    // taken), ...
    let max_burst = (1_i64 << 52) - 1;
    let g = gcra(k, max_burst, 1, 1);
    assert_eq!(one(&mut con, T0, &g), admits(max_burst - 1, 1));
    assert_eq!(one(&mut con, T0, &g), admits(max_burst - 2, 2));
    assert_eq!(get(&mut con, k), Some((T0 + 2).to_string()), "the TAT");
    // ... and a fixed window of 2^50 units (T0 is on a second's edge: the
    // whole window is left).
    let max_limit = 1_i64 << 50;
    let w = fw("t:{k}:err-fw", max_limit, SECOND);
    assert_eq!(one(&mut con, T0, &w), admits(max_limit - 1, SECOND));
    assert_eq!(
        one(&mut con, T0, &w.clone().cost(max_limit - 1)),
        admits(0, SECOND)
    );
    assert_eq!(one(&mut con, T0, &w), rejects(0, SECOND));
}
