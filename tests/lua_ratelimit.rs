//! `lua/ratelimit.lua` against a real redis-server: the KEYS/ARGV/reply
//! contract documented in the script's header, exact arithmetic for both
//! algorithms, all-or-nothing charging, TTLs, and atomicity under concurrency.
//!
//! Redis TIME cannot be mocked. Exact assertions therefore use state written
//! beforehand: a token bucket whose `t` lies in the future gets no refill; one
//! whose `t` lies far in the past is full; a slow refill (one token per minute)
//! keeps `floor()` results stable against a few ms of slop. Where the reply
//! depends on the script's own clock, it is bounded by TIME read before and
//! after the call.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::script::{self, admits, rejects, sw, tb, Decision, Limit};
use support::{
    assert_expires_in, assert_less_than_a_token_left, assert_within, bucket_bytes,
    key_exists as exists, key_pttl as pttl, read_bucket as bucket, redis_now_ms as now_ms,
    write_bucket as set_bucket,
};

use redis::{Connection, Value};
use redis_guard::scripts::RATELIMIT;

/// One minute: the window of most sliding-window tests, and the period of the
/// slow token buckets.
const MINUTE: i64 = 60_000;

// ---------------------------------------------------------------------------
// Calling the script

/// One request's limits through the script (EVAL, no idempotency key).
fn eval(con: &mut Connection, limits: &[Limit]) -> Decision {
    script::request(con, limits, None).decision()
}

/// EVALSHA of one limit, as the filter sends it (the script must be loaded).
fn evalsha_cmd(limit: &Limit) -> redis::Cmd {
    script::with_limits(
        script::evalsha(&RATELIMIT),
        std::slice::from_ref(limit),
        None,
    )
}

/// Loads the script, checking Redis names it as the filter does.
fn load_script(con: &mut Connection) {
    assert_eq!(script::load(con, &RATELIMIT), RATELIMIT.sha1);
}

// ---------------------------------------------------------------------------
// Reading and writing state directly

fn zadd(con: &mut Connection, key: &str, score: i64, member: &str) {
    redis::cmd("ZADD")
        .arg(key)
        .arg(score)
        .arg(member)
        .query::<()>(con)
        .unwrap();
}

/// A sorted set's `(member, score)` pairs, oldest first.
fn members(con: &mut Connection, key: &str) -> Vec<(String, i64)> {
    support::zset_scores(con, key)
}

fn zcard(con: &mut Connection, key: &str) -> i64 {
    redis::cmd("ZCARD").arg(key).query(con).unwrap()
}

// ---------------------------------------------------------------------------
// Token bucket

#[test]
fn token_bucket_fresh_key_admits_capacity_then_rejects() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:tb:fresh";
    // One token per minute: the few ms this test takes refill far less than a token.
    let limit = tb(key, 5, 1, MINUTE);

    let before = now_ms(&mut con);
    // A missing key is a full bucket, independent of the clock: exact.
    assert_eq!(
        eval(&mut con, std::slice::from_ref(&limit)).limits,
        vec![admits(4, MINUTE)]
    );
    for spent in 2..=5 {
        let r = eval(&mut con, std::slice::from_ref(&limit));
        let slop = now_ms(&mut con) - before;
        assert!(
            r.admitted,
            "call {spent} of capacity 5 must be admitted: {r:?}"
        );
        let v = r.limits[0];
        assert_eq!((v.allowed, v.remaining, v.retry_ms), (true, 5 - spent, 0));
        // Time to full: `spent` tokens, less whatever refilled since the first call.
        assert_within(
            "reset_ms",
            v.reset_ms,
            spent * MINUTE - slop,
            spent * MINUTE,
        );
    }
    for _ in 0..3 {
        let r = eval(&mut con, std::slice::from_ref(&limit));
        let slop = now_ms(&mut con) - before;
        assert!(!r.admitted, "bucket is empty: {r:?}");
        let v = r.limits[0];
        assert_eq!((v.allowed, v.remaining), (false, 0));
        assert_within("retry_ms", v.retry_ms, MINUTE - slop, MINUTE);
        assert_eq!(
            v.reset_ms, v.retry_ms,
            "a rejection's reset equals its retry"
        );
    }
    // Rejections did not touch the stored state: 5 tokens spent, a few ms of refill.
    let (c, _) = bucket(&mut con, key).unwrap();
    let slop = now_ms(&mut con) - before;
    assert_within("stored credits", c, 0, slop);
}

#[test]
fn token_bucket_rejection_reports_exact_retry_and_writes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:tb:short";
    // `t` in the future: the script adds no refill, so every number is exact.
    let future = now_ms(&mut con) + 3_600_000;
    set_bucket(&mut con, key, 2500, future);
    let before = bucket_bytes(&mut con, key);

    // capacity 10, 1 credit/ms, 1 token = 1000 credits: 2.5 tokens held, 3 needed.
    let r = eval(&mut con, &[tb(key, 10, 1, 1000).cost(3)]);
    assert_eq!(
        r,
        Decision {
            admitted: false,
            limits: vec![rejects(2, 500)]
        }
    );
    // 3 credits/ms: 500 missing credits take ceil(500 / 3) = 167 ms.
    let r = eval(&mut con, &[tb(key, 10, 3, 1000).cost(3)]);
    assert_eq!(r.limits, vec![rejects(2, 167)]);
    // Exactly one credit short: 1 ms.
    set_bucket(&mut con, key, 2999, future);
    let r = eval(&mut con, &[tb(key, 10, 1, 1000).cost(3)]);
    assert_eq!(r.limits, vec![rejects(2, 1)]);
    set_bucket(&mut con, key, 2500, future);

    assert_eq!(
        bucket_bytes(&mut con, key),
        before,
        "a rejection must not write"
    );
    assert_eq!(bucket(&mut con, key), Some((2500, future)));
}

#[test]
fn token_bucket_admission_reports_exact_remaining_and_time_to_full() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:tb:admit";
    let future = now_ms(&mut con) + 3_600_000;
    set_bucket(&mut con, key, 7500, future);

    // capacity 10, 7 credits/ms, 1 token = 1000 credits; 7.5 tokens held, 2 spent.
    let t0 = now_ms(&mut con);
    let r = eval(&mut con, &[tb(key, 10, 7, 1000).cost(2)]);
    let t1 = now_ms(&mut con);
    // 5500 credits left: floor(5.5) = 5 tokens; (10000 - 5500) / 7 = 642.9 -> 643 ms to full.
    assert_eq!(
        r,
        Decision {
            admitted: true,
            limits: vec![admits(5, 643)]
        }
    );
    let (c, t) = bucket(&mut con, key).unwrap();
    assert_eq!(c, 5500, "exactly 2 tokens charged");
    assert_within("stored t (the script's now)", t, t0, t1);
    // The key lives exactly until the bucket is full again, not a ms less.
    assert_expires_in(&mut con, key, 643, t0);
}

/// The commonest call (one enforced bucket, no key: the seven ARGV the
/// filter sends) takes lua/decide.lua's short way; the same call with an
/// explicit "no key" flag (eight ARGV) takes the general one. Both must
/// answer and charge alike, fresh key or held credits, admitted or not, the
/// cost within capacity or above it. A bucket stamped in the future gets no
/// refill, so every figure is exact.
#[test]
fn a_lone_bucket_call_is_decided_exactly_as_the_general_way_decides_it() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let future = now_ms(&mut con) + 3_600_000;
    // (capacity, refill, period ms, credits held or None for a fresh key, cost)
    let cases = [
        // A fresh bucket, one token of ten spent. A slow refill: 7 tokens a
        // minute, full again 8572 ms after the call (7 a second made it
        // 143 ms, and a loaded machine could pass that between the call and
        // the second read of its TTL: issue 42).
        (10, 7, 60_000, None, 1),
        (10, 7, 1000, None, 10),
        (10, 7, 1000, None, 11),
        (10, 7, 1000, Some(7500), 2),
        (10, 7, 1000, Some(2500), 3),
        (10, 7, 1000, Some(3000), 3),
        (1, 1, 3_600_000, Some(0), 1),
        (5, 2, 60_000, Some(-120_000), 1),
        // A fresh bucket of large figures. A slow refill: full again 1 s
        // after the call, so its key lives long enough to read its TTL (a
        // refill of 10^9 a second made it 1 ms, and the key could be gone
        // between two reads: it failed once in make test).
        (1_000_000_000, 1, 1000, None, 1),
        (
            1_000_000_000,
            1_000_000_000,
            1000,
            Some(5_000_000_000),
            999_999_999,
        ),
    ];
    // The same script, answering only which way it would take.
    let tail = "local reply = decide(KEYS, ARGV)";
    let probe = redis_guard::scripts::Script {
        source: RATELIMIT.source.replacen(
            tail,
            "do return decide_lone(KEYS, ARGV) ~= nil and 1 or 0 end",
            1,
        ),
        sha1: String::new(),
    };
    assert_ne!(probe.source, RATELIMIT.source);
    let mut rejected = 0;
    for (i, &(capacity, refill, period, held, cost)) in cases.iter().enumerate() {
        let limit = |key: &str| tb(key, capacity, refill, period).cost(cost);
        let (short, general) = (format!("t:{{x}}:short:{i}"), format!("t:{{x}}:general:{i}"));
        if let Some(credits) = held {
            set_bucket(&mut con, &short, credits, future);
            set_bucket(&mut con, &general, credits, future);
        }
        let argv = script::request_argv(&[limit(&short)], None);
        assert_eq!(argv.len(), 7, "the filter's lone call");
        let mut flagged = argv.clone();
        flagged.push("0".to_string());
        let way = |con: &mut Connection, argv: &[String]| {
            script::eval_raw(con, &probe, &[format!("t:{{x}}:probe:{i}")], argv).unwrap()
        };
        assert_eq!(
            way(&mut con, &argv),
            Value::Int(1),
            "case {i}: the short way"
        );
        assert_eq!(
            way(&mut con, &flagged),
            Value::Int(0),
            "case {i}: the general way"
        );
        let call = |con: &mut Connection, key: &str, argv: &[String]| {
            let t0 = now_ms(con);
            (script::eval_raw(con, &RATELIMIT, &[key], argv).unwrap(), t0)
        };
        let (a, ta) = call(&mut con, &short, &argv);
        let (b, tb_) = call(&mut con, &general, &flagged);
        assert_eq!(a, b, "case {i}");
        let (ca, cb) = (bucket(&mut con, &short), bucket(&mut con, &general));
        assert_eq!(ca.map(|s| s.0), cb.map(|s| s.0), "case {i}: credits left");
        let Value::Array(items) = &a else {
            panic!("case {i}: {a:?}")
        };
        if items[0] == Value::Int(1) {
            // An admitted call's key lives exactly its reset (time to full).
            let reset = match &items[4] {
                Value::Int(n) => *n,
                Value::BulkString(b) => String::from_utf8_lossy(b).parse().unwrap(),
                v => panic!("case {i}: reset {v:?}"),
            };
            assert_expires_in(&mut con, &short, reset, ta);
            assert_expires_in(&mut con, &general, reset, tb_);
        } else {
            // A rejected one writes nothing: the TTL is the one it had.
            rejected += 1;
            assert_eq!(pttl(&mut con, &short), pttl(&mut con, &general), "case {i}");
        }
    }
    assert_eq!(
        rejected, 5,
        "above capacity, three short of credits, a debt"
    );
}

#[test]
fn token_bucket_partial_refill_floors_to_whole_tokens() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:tb:partial";
    // 1 token per minute; 2 tokens held as of 2.5 minutes ago: 4.5 tokens now
    // (plus the few ms between our TIME and the script's, far below a token).
    let t0 = now_ms(&mut con);
    set_bucket(&mut con, key, 2 * MINUTE, t0 - 150_000);

    let r = eval(&mut con, &[tb(key, 10, 1, MINUTE)]);
    let t1 = now_ms(&mut con);
    let slop = t1 - t0;
    assert!(r.admitted);
    let v = r.limits[0];
    // 4.5 tokens - 1 = 3.5 -> 3 remaining.
    assert_eq!((v.allowed, v.remaining, v.retry_ms), (true, 3, 0));
    // 3.5 tokens left, 6.5 to go at 1 credit/ms: 390000 ms, less the slop.
    assert_within("reset_ms", v.reset_ms, 390_000 - slop, 390_000);
    let (c, t) = bucket(&mut con, key).unwrap();
    assert_within("stored credits", c, 210_000, 210_000 + slop);
    assert_within("stored t", t, t0, t1);

    // Half a token is not a token: 0.5 held, 1 needed -> rejected with 0 remaining.
    let future = now_ms(&mut con) + 3_600_000;
    set_bucket(&mut con, key, MINUTE / 2, future);
    let r = eval(&mut con, &[tb(key, 10, 1, MINUTE)]);
    assert_eq!(r.limits, vec![rejects(0, MINUTE / 2)]);
}

#[test]
fn token_bucket_refill_never_exceeds_capacity() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:tb:cap";
    // Empty, but last touched ~11.6 days ago: refill would be a million tokens.
    let now = now_ms(&mut con);
    set_bucket(&mut con, key, 0, now - 1_000_000_000);

    // Capped at 10 tokens: 9 remain, 1000 credits missing at 1/ms -> exactly 1000 ms.
    let r = eval(&mut con, &[tb(key, 10, 1, 1000)]);
    assert_eq!(
        r,
        Decision {
            admitted: true,
            limits: vec![admits(9, 1000)]
        }
    );
    assert_eq!(bucket(&mut con, key).unwrap().0, 9000);

    // Same with a large refill rate and cost: full bucket, 10 - 4 = 6 left,
    // 4000 credits at 3/ms -> ceil(1333.3) = 1334 ms.
    set_bucket(&mut con, key, 0, now - 1_000_000_000);
    let r = eval(&mut con, &[tb(key, 10, 3, 1000).cost(4)]);
    assert_eq!(r.limits, vec![admits(6, 1334)]);
    assert_eq!(bucket(&mut con, key).unwrap().0, 6000);
}

#[test]
fn token_bucket_cost_spends_that_many_tokens() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:tb:cost";
    let limit = tb(key, 10, 1, MINUTE).cost(4);

    // Fresh key: exact.
    let t0 = now_ms(&mut con);
    assert_eq!(
        eval(&mut con, std::slice::from_ref(&limit)).limits,
        vec![admits(6, 4 * MINUTE)]
    );
    assert_eq!(bucket(&mut con, key).unwrap().0, 6 * MINUTE);

    let r = eval(&mut con, std::slice::from_ref(&limit));
    let slop = now_ms(&mut con) - t0;
    let v = r.limits[0];
    assert_eq!(
        (r.admitted, v.allowed, v.remaining, v.retry_ms),
        (true, true, 2, 0)
    );
    assert_within("reset_ms", v.reset_ms, 8 * MINUTE - slop, 8 * MINUTE);

    // 2 tokens left, 4 needed: rejected though tokens remain, 2 tokens of wait.
    let r = eval(&mut con, std::slice::from_ref(&limit));
    let slop = now_ms(&mut con) - t0;
    let v = r.limits[0];
    assert_eq!((r.admitted, v.allowed, v.remaining), (false, false, 2));
    assert_within("retry_ms", v.retry_ms, 2 * MINUTE - slop, 2 * MINUTE);
    assert_eq!(v.reset_ms, v.retry_ms);

    // Cost equal to what is left empties the bucket.
    let r = eval(&mut con, &[limit.cost(2)]);
    let slop = now_ms(&mut con) - t0;
    let v = r.limits[0];
    assert_eq!(
        (r.admitted, v.allowed, v.remaining, v.retry_ms),
        (true, true, 0, 0)
    );
    assert_within("reset_ms", v.reset_ms, 10 * MINUTE - slop, 10 * MINUTE);
    let (c, _) = bucket(&mut con, key).unwrap();
    assert_within("stored credits", c, 0, slop);
}

// ---------------------------------------------------------------------------
// Sliding window

#[test]
fn sliding_window_admits_exactly_limit_then_rejects() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:sw:fresh";
    let limit = sw(key, 5, MINUTE);

    let before = now_ms(&mut con);
    // An empty window is fully restored one window after this admission.
    assert_eq!(
        eval(&mut con, std::slice::from_ref(&limit)).limits,
        vec![admits(4, MINUTE)]
    );
    for n in 2..=5 {
        let r = eval(&mut con, std::slice::from_ref(&limit));
        let slop = now_ms(&mut con) - before;
        let v = r.limits[0];
        assert_eq!(
            (r.admitted, v.allowed, v.remaining, v.retry_ms),
            (true, true, 5 - n, 0)
        );
        assert_within("reset_ms", v.reset_ms, MINUTE - slop, MINUTE);
    }
    assert_eq!(zcard(&mut con, key), 5);
    let first = members(&mut con, key)[0].1;
    assert_within("first member's score", first, before, now_ms(&mut con));

    for _ in 0..3 {
        let t0 = now_ms(&mut con);
        let r = eval(&mut con, std::slice::from_ref(&limit));
        let t1 = now_ms(&mut con);
        assert!(!r.admitted, "window is full: {r:?}");
        let v = r.limits[0];
        assert_eq!((v.allowed, v.remaining), (false, 0));
        // The oldest member must leave: at its score + window.
        assert_within(
            "retry_ms",
            v.retry_ms,
            first + MINUTE - t1,
            first + MINUTE - t0,
        );
        assert_eq!(v.reset_ms, v.retry_ms);
    }
    assert_eq!(zcard(&mut con, key), 5, "rejections add nothing");
}

#[test]
fn sliding_window_prunes_a_member_exactly_one_window_old() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:sw:edge-out";
    // The window is (now - W, now]: a member scored now_read - W is out, since
    // the script's now >= now_read.
    let now = now_ms(&mut con);
    let old = format!("{}:0", now - MINUTE);
    zadd(&mut con, key, now - MINUTE, &old);

    let r = eval(&mut con, &[sw(key, 1, MINUTE)]);
    assert_eq!(
        r,
        Decision {
            admitted: true,
            limits: vec![admits(0, MINUTE)]
        }
    );
    let m = members(&mut con, key);
    assert_eq!(
        m.len(),
        1,
        "the old member is pruned, the new one added: {m:?}"
    );
    assert_ne!(m[0].0, old);
    assert!(m[0].1 >= now);
}

#[test]
fn sliding_window_counts_a_member_inside_the_window() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:sw:edge-in";
    let t0 = now_ms(&mut con);
    let score = t0 - MINUTE + 5000;
    zadd(&mut con, key, score, &format!("{score}:0"));

    let r = eval(&mut con, &[sw(key, 1, MINUTE)]);
    let t1 = now_ms(&mut con);
    assert!(!r.admitted, "the member 55 s old still counts: {r:?}");
    let v = r.limits[0];
    assert_eq!((v.allowed, v.remaining), (false, 0));
    // It leaves the window 5 s after t0.
    assert_within("retry_ms", v.retry_ms, score + MINUTE - t1, 5000);
    assert_eq!(v.reset_ms, v.retry_ms);
    assert_eq!(members(&mut con, key), vec![(format!("{score}:0"), score)]);
}

#[test]
fn sliding_window_retry_is_when_the_kth_oldest_member_leaves() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:sw:retry";
    let t0 = now_ms(&mut con);
    // Five members, 50 s .. 10 s old; limit 5, window 60 s.
    let scores: Vec<i64> = [50_000, 40_000, 30_000, 20_000, 10_000]
        .iter()
        .map(|age| t0 - age)
        .collect();
    for s in &scores {
        zadd(&mut con, key, *s, &format!("{s}:0"));
    }
    let before = members(&mut con, key);

    for cost in 1..=5 {
        let r = eval(&mut con, &[sw(key, 5, MINUTE).cost(cost)]);
        let t1 = now_ms(&mut con);
        // count 5 + cost - limit 5 = cost: the cost-th oldest must leave first.
        let kth = scores[(cost - 1) as usize];
        let v = r.limits[0];
        assert_eq!(
            (r.admitted, v.allowed, v.remaining),
            (false, false, 0),
            "cost {cost}"
        );
        assert_within(
            &format!("retry_ms for cost {cost}"),
            v.retry_ms,
            kth + MINUTE - t1,
            kth + MINUTE - t0,
        );
        assert_eq!(v.reset_ms, v.retry_ms);
    }

    // With 2 of 5 used, cost 5 needs the 2nd oldest gone; remaining reports 3.
    redis::cmd("ZREMRANGEBYRANK")
        .arg(key)
        .arg(2)
        .arg(-1)
        .query::<()>(&mut con)
        .unwrap();
    let r = eval(&mut con, &[sw(key, 5, MINUTE).cost(5)]);
    let t1 = now_ms(&mut con);
    let v = r.limits[0];
    assert_eq!((r.admitted, v.allowed, v.remaining), (false, false, 3));
    assert_within(
        "retry_ms",
        v.retry_ms,
        scores[1] + MINUTE - t1,
        scores[1] + MINUTE - t0,
    );
    assert_eq!(
        members(&mut con, key),
        before[..2].to_vec(),
        "rejections write nothing"
    );
}

#[test]
fn sliding_window_cost_adds_that_many_members() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:sw:cost";
    let t0 = now_ms(&mut con);

    assert_eq!(
        eval(&mut con, &[sw(key, 10, MINUTE).cost(4)]).limits,
        vec![admits(6, MINUTE)]
    );
    let m = members(&mut con, key);
    assert_eq!(m.len(), 4, "{m:?}");

    // 7 more would make 11 > 10: rejected, remaining still 6, nothing added.
    let r = eval(&mut con, &[sw(key, 10, MINUTE).cost(7)]);
    let t1 = now_ms(&mut con);
    let v = r.limits[0];
    assert_eq!((r.admitted, v.allowed, v.remaining), (false, false, 6));
    assert_within("retry_ms", v.retry_ms, m[0].1 + MINUTE - t1, MINUTE);
    assert_eq!(zcard(&mut con, key), 4);

    // Exactly the rest fits.
    let r = eval(&mut con, &[sw(key, 10, MINUTE).cost(6)]);
    let v = r.limits[0];
    assert_eq!(
        (r.admitted, v.allowed, v.remaining, v.retry_ms),
        (true, true, 0, 0)
    );
    let m = members(&mut con, key);
    assert_eq!(m.len(), 10, "{m:?}");
    let t2 = now_ms(&mut con);
    for (member, score) in &m {
        assert_within(&format!("score of {member}"), *score, t0, t2);
    }
}

#[test]
fn sliding_window_same_millisecond_requests_all_count() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:sw:burst";
    let limit = sw(key, 100, MINUTE);

    // One pipeline: the server runs the 50 calls back to back, many per ms.
    load_script(&mut con);
    let mut pipe = redis::pipe();
    for _ in 0..50 {
        pipe.add_command(evalsha_cmd(&limit));
    }
    let replies: Vec<redis::Value> = pipe.query(&mut con).unwrap();
    let m = members(&mut con, key);
    let mut scores: Vec<i64> = m.iter().map(|(_, s)| *s).collect();
    scores.dedup();
    assert_eq!(
        m.len(),
        50,
        "every admitted request must be one member; got {} over {} distinct ms: {m:?}",
        m.len(),
        scores.len()
    );
    for (i, raw) in replies.into_iter().enumerate() {
        let r = script::parse(raw).decision();
        let v = r.limits[0];
        assert_eq!(
            (r.admitted, v.allowed, v.remaining, v.retry_ms),
            (true, true, 99 - i as i64, 0),
            "call {}",
            i + 1
        );
    }
    // 50 admitted, 50 left: the 51st..100th are admitted too, the 101st is not.
    for i in 0..50 {
        let v = eval(&mut con, std::slice::from_ref(&limit)).limits[0];
        assert_eq!((v.allowed, v.remaining), (true, 49 - i), "call {}", 51 + i);
    }
    assert!(!eval(&mut con, &[limit]).admitted, "call 101 of limit 100");
    assert_eq!(zcard(&mut con, key), 100);
}

#[test]
fn sliding_window_counts_every_request_while_the_newest_stamp_is_ahead_of_the_clock() {
    // After Redis' clock steps back (e.g. a failover to a replica whose clock
    // is behind), the script keeps stamping new members with the newest
    // member's score, so every call is effectively in one millisecond. This
    // makes the same-millisecond numbering deterministic to test.
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:sw:ahead";
    let now = now_ms(&mut con);
    let ahead = now + 3000;
    zadd(&mut con, key, ahead, &format!("{ahead}:0"));

    let limit = sw(key, 25, MINUTE);
    // TIME around the last admission, and its reset.
    let mut last = (0, 0, 0);
    for i in 1..25 {
        let t0 = now_ms(&mut con);
        let r = eval(&mut con, std::slice::from_ref(&limit));
        let v = r.limits[0];
        last = (t0, now_ms(&mut con), v.reset_ms);
        assert_eq!(
            (r.admitted, v.allowed, v.remaining),
            (true, true, 24 - i),
            "call {i}"
        );
        assert_eq!(zcard(&mut con, key), 1 + i, "call {i} must add one member");
    }
    let m = members(&mut con, key);
    assert!(m.iter().all(|(_, s)| *s == ahead), "{m:?}");
    assert!(!eval(&mut con, &[limit]).admitted, "limit 25 reached");
    // Fully restored once the newest member, stamped `ahead`, leaves: the
    // last admission's reset, and exactly the key's PEXPIRE.
    let (t0, t1, reset) = last;
    assert_within(
        "last reset_ms",
        reset,
        ahead + MINUTE - t1,
        ahead + MINUTE - t0,
    );
    assert_expires_in(&mut con, key, reset, t0);
}

#[test]
fn sliding_window_reset_is_the_time_until_fully_restored() {
    // The header: "reset_ms  allowed: ms until the limit is fully restored".
    // After an admission, the limit is fully restored when the member just
    // added leaves the window: one window from now (and the key's PEXPIRE,
    // "the time after which its state is indistinguishable from a fresh key",
    // is that same instant).
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:sw:reset";
    let t0 = now_ms(&mut con);
    let score = t0 - 30_000;
    zadd(&mut con, key, score, &format!("{score}:0"));

    let before = now_ms(&mut con);
    let r = eval(&mut con, &[sw(key, 5, MINUTE)]);
    let v = r.limits[0];
    assert_eq!(
        (r.admitted, v.allowed, v.remaining, v.retry_ms),
        (true, true, 3, 0)
    );
    assert_eq!(
        v.reset_ms, MINUTE,
        "reset_ms must be the time until fully restored (the new member leaves in one window), \
         not until the oldest member leaves (~30000 ms)"
    );
    assert_expires_in(&mut con, key, MINUTE, before);
}

// ---------------------------------------------------------------------------
// All or nothing, shadow limits

#[test]
fn rejection_by_one_limit_writes_nothing_to_the_others() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let tb_fresh = "t:{x}:aon:tb-fresh";
    let tb_held = "t:{x}:aon:tb-held";
    let sw_fresh = "t:{x}:aon:sw-fresh";
    let sw_held = "t:{x}:aon:sw-held";
    let full = "t:{x}:aon:full";

    let t0 = now_ms(&mut con);
    let future = t0 + 3_600_000;
    set_bucket(&mut con, tb_held, 4000, future);
    let s = t0 - 1000;
    zadd(&mut con, sw_held, s, &format!("{s}:0"));
    zadd(&mut con, full, s, &format!("{s}:0"));
    let tb_held_before = bucket_bytes(&mut con, tb_held);
    let sw_held_before = members(&mut con, sw_held);
    let full_before = members(&mut con, full);

    let r = eval(
        &mut con,
        &[
            tb(tb_fresh, 10, 1, 1000).cost(2),
            tb(tb_held, 10, 1, 1000).cost(2),
            sw(sw_fresh, 10, MINUTE).cost(2),
            sw(sw_held, 10, MINUTE).cost(2),
            sw(full, 1, MINUTE),
        ],
    );
    let t1 = now_ms(&mut con);
    assert!(!r.admitted, "the full window rejects the request: {r:?}");
    // Each would admit; not charged, each reports its budget as it stands.
    assert_eq!(
        r.limits[0],
        admits(10, 0),
        "fresh bucket: full, nothing to restore"
    );
    assert_eq!(
        r.limits[1],
        admits(4, 6000),
        "4 tokens held, 6000 credits to full"
    );
    assert_eq!(
        r.limits[2],
        admits(10, 0),
        "fresh window: nothing to restore"
    );
    let v = r.limits[3];
    assert_eq!((v.allowed, v.remaining, v.retry_ms), (true, 9, 0));
    assert_within("held window reset_ms", v.reset_ms, 1, s + MINUTE - t0);
    let v = r.limits[4];
    assert_eq!((v.allowed, v.remaining), (false, 0));
    assert_within("retry_ms", v.retry_ms, s + MINUTE - t1, s + MINUTE - t0);
    assert_eq!(v.reset_ms, v.retry_ms);

    assert!(
        !exists(&mut con, tb_fresh),
        "uncharged bucket must not be created"
    );
    assert!(
        !exists(&mut con, sw_fresh),
        "uncharged window must not be created"
    );
    assert_eq!(bucket_bytes(&mut con, tb_held), tb_held_before);
    assert_eq!(members(&mut con, sw_held), sw_held_before);
    assert_eq!(members(&mut con, full), full_before);

    // An empty bucket rejecting blocks a window too, whichever comes first.
    let empty = "t:{x}:aon:empty";
    set_bucket(&mut con, empty, 0, future);
    let r = eval(
        &mut con,
        &[sw(sw_fresh, 10, MINUTE), tb(empty, 10, 1, 1000)],
    );
    assert_eq!(
        r,
        Decision {
            admitted: false,
            limits: vec![admits(10, 0), rejects(0, 1000)]
        }
    );
    assert!(!exists(&mut con, sw_fresh));
    assert_eq!(bucket(&mut con, empty), Some((0, future)));
}

#[test]
fn shadow_limit_that_would_reject_neither_blocks_nor_is_charged() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let enforced_tb = "t:{x}:shadow:enforced-tb";
    let enforced_sw = "t:{x}:shadow:enforced-sw";
    let shadow_sw = "t:{x}:shadow:sw";
    let shadow_tb = "t:{x}:shadow:tb";

    let t0 = now_ms(&mut con);
    let s = t0 - 1000;
    zadd(&mut con, shadow_sw, s, &format!("{s}:0"));
    let future = t0 + 3_600_000;
    set_bucket(&mut con, shadow_tb, 500, future);
    let shadow_sw_before = members(&mut con, shadow_sw);
    let shadow_tb_before = bucket_bytes(&mut con, shadow_tb);

    let r = eval(
        &mut con,
        &[
            tb(enforced_tb, 10, 1, 1000).cost(3),
            sw(shadow_sw, 1, MINUTE).shadow(),
            sw(enforced_sw, 10, MINUTE).cost(2),
            tb(shadow_tb, 10, 1, 1000).shadow(),
        ],
    );
    let t1 = now_ms(&mut con);
    assert!(r.admitted, "shadow rejections do not block: {r:?}");
    assert_eq!(r.limits[0], admits(7, 3000));
    let v = r.limits[1];
    assert_eq!(
        (v.allowed, v.remaining),
        (false, 0),
        "the shadow window reports its rejection"
    );
    assert_within(
        "shadow retry_ms",
        v.retry_ms,
        s + MINUTE - t1,
        s + MINUTE - t0,
    );
    assert_eq!(v.reset_ms, v.retry_ms);
    assert_eq!(r.limits[2], admits(8, MINUTE));
    assert_eq!(
        r.limits[3],
        rejects(0, 500),
        "the shadow bucket reports its rejection"
    );

    // The enforced limits are charged...
    assert_eq!(bucket(&mut con, enforced_tb).unwrap().0, 7000);
    assert_eq!(zcard(&mut con, enforced_sw), 2);
    // ...the rejecting shadow limits are not.
    assert_eq!(members(&mut con, shadow_sw), shadow_sw_before);
    assert_eq!(bucket_bytes(&mut con, shadow_tb), shadow_tb_before);
}

#[test]
fn shadow_limit_that_admits_is_charged() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let shadow_tb = "t:{x}:shadow-ok:tb";
    let shadow_sw = "t:{x}:shadow-ok:sw";
    let r = eval(
        &mut con,
        &[
            tb(shadow_tb, 10, 1, 1000).cost(2).shadow(),
            sw(shadow_sw, 10, MINUTE).cost(3).shadow(),
        ],
    );
    assert_eq!(
        r,
        Decision {
            admitted: true,
            limits: vec![admits(8, 2000), admits(7, MINUTE)]
        }
    );
    assert_eq!(bucket(&mut con, shadow_tb).unwrap().0, 8000);
    assert_eq!(zcard(&mut con, shadow_sw), 3);
}

// ---------------------------------------------------------------------------
// TTLs

#[test]
fn every_written_key_expires_exactly_when_it_would_be_fresh_again() {
    // Too long a TTL only keeps a key that equals a fresh one; too short a
    // TTL drops a spent budget, which then refills. So the expiry is asserted
    // from both sides on Redis' own clock: every admission sets the key's
    // PEXPIRE to its reset_ms (for a bucket, the time until full; for a
    // window, until its newest member leaves), and the first round's resets
    // are known numbers.
    let (_redis, mut con) = support::Redis::start_with_conn();
    let tb_fresh = "t:{x}:ttl:tb-fresh";
    let tb_held = "t:{x}:ttl:tb-held";
    let tb_slow = "t:{x}:ttl:tb-slow";
    let sw_fresh = "t:{x}:ttl:sw-fresh";
    let sw_short = "t:{x}:ttl:sw-short";

    let now = now_ms(&mut con);
    set_bucket(&mut con, tb_held, 7500, now + 3_600_000);
    // Held keys written by hand have no TTL; the script must set one.
    assert_eq!(pttl(&mut con, tb_held), -1);

    let limits = [
        tb(tb_fresh, 10, 1, 1000),
        tb(tb_held, 10, 7, 1000).cost(2),
        tb(tb_slow, 3, 1, MINUTE),
        sw(sw_fresh, 10, MINUTE).cost(3),
        sw(sw_short, 10, 1500),
    ];
    for round in 0..3 {
        let t0 = now_ms(&mut con);
        let r = eval(&mut con, &limits);
        assert!(r.admitted, "round {round}: {r:?}");
        if round == 0 {
            // tb-fresh: 1 of 10 tokens at 1 credit/ms; tb-held: 5500 of
            // 10000 credits left at 7/ms (ceil 642.9); tb-slow: 1 of 3 tokens
            // at one a minute; each window: its length.
            let resets: Vec<i64> = r.limits.iter().map(|v| v.reset_ms).collect();
            assert_eq!(resets, [1000, 643, MINUTE, MINUTE, 1500]);
        }
        for (l, v) in limits.iter().zip(&r.limits) {
            if l.alg == "sw" {
                // No member is ahead of the clock: the newest is this call's.
                assert_eq!(v.reset_ms, l.b, "round {round}: {}", l.key);
            }
            assert_expires_in(&mut con, &l.key, v.reset_ms, t0);
        }
    }
}

// ---------------------------------------------------------------------------
// Concurrency

/// `threads` connections race `total` calls of `limit` (EVALSHA, as the
/// filter sends it); returns (admitted, rejected).
fn race(redis: &support::Redis, limit: &Limit, threads: usize, total: usize) -> (usize, usize) {
    load_script(&mut redis.conn());
    let admitted = redis.race(threads, total, |con, _| {
        let v = evalsha_cmd(limit)
            .query(con)
            .unwrap_or_else(|e| panic!("a racing call failed: {e}"));
        script::parse(v).decision().admitted
    });
    let yes = admitted.iter().filter(|a| **a).count();
    (yes, total - yes)
}

#[test]
fn concurrent_token_bucket_calls_admit_exactly_the_capacity() {
    let redis = support::Redis::start();
    let key = "t:{x}:race:tb";
    // One token per minute: refill during the race is far below one token.
    let (admitted, rejected) = race(&redis, &tb(key, 100, 1, MINUTE), 40, 300);
    assert_eq!((admitted, rejected), (100, 200));
    let mut con = redis.conn();
    assert_less_than_a_token_left(&mut con, key, MINUTE);
}

#[test]
fn concurrent_sliding_window_calls_admit_exactly_the_limit() {
    let redis = support::Redis::start();
    let key = "t:{x}:race:sw";
    let (admitted, rejected) = race(&redis, &sw(key, 100, MINUTE), 40, 300);
    let mut con = redis.conn();
    let stored = zcard(&mut con, key);
    assert_eq!(
        (admitted, rejected, stored),
        (100, 200, 100),
        "(admitted, rejected, members in the window)"
    );
}

// ---------------------------------------------------------------------------
// Contract errors

#[test]
fn rejects_a_limit_count_that_differs_from_the_keys() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let (a, b) = ("t:{x}:err:a", "t:{x}:err:b");
    let one = ["tb", "10", "1", "1000", "1", "1"];

    let argv: Vec<&str> = ["1"].iter().chain(&one).copied().collect();
    let err = script::eval_raw(&mut con, &RATELIMIT, &[a, b], &argv).unwrap_err();
    assert!(
        err.to_string().contains("ARGV[1] must match #KEYS"),
        "unexpected error: {err}"
    );
    let argv: Vec<&str> = ["2"].iter().chain(&one).chain(&one).copied().collect();
    let err = script::eval_raw(&mut con, &RATELIMIT, &[a], &argv).unwrap_err();
    assert!(
        err.to_string().contains("ARGV[1] must match #KEYS"),
        "{err}"
    );
    let argv: Vec<&str> = ["one"].iter().chain(&one).copied().collect();
    let err = script::eval_raw(&mut con, &RATELIMIT, &[a], &argv).unwrap_err();
    assert!(
        err.to_string().contains("ARGV[1] must match #KEYS"),
        "{err}"
    );
    assert!(
        script::eval_raw(&mut con, &RATELIMIT, &[a], &[] as &[&str]).is_err(),
        "a missing ARGV[1] is an error"
    );

    assert!(
        !exists(&mut con, a) && !exists(&mut con, b),
        "errors write nothing"
    );
}

#[test]
fn rejects_an_unknown_algorithm() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let (a, b) = ("t:{x}:err:a", "t:{x}:err:b");

    let err = script::eval_raw(
        &mut con,
        &RATELIMIT,
        &[a],
        &["1", "leaky", "10", "1", "1000", "1", "1"],
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("unknown algorithm"),
        "unexpected error: {err}"
    );
    // A valid limit before the unknown one is not charged either.
    let err = script::eval_raw(
        &mut con,
        &RATELIMIT,
        &[a, b],
        &[
            "2", "tb", "10", "1", "1000", "1", "1", "TB", "10", "1", "1000", "1", "1",
        ],
    )
    .unwrap_err();
    assert!(err.to_string().contains("unknown algorithm"), "{err}");

    assert!(
        !exists(&mut con, a) && !exists(&mut con, b),
        "errors write nothing"
    );
}

#[test]
fn rejects_a_keyed_request_without_its_idempotency_arguments_and_writes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let (a, rec) = ("t:{x}:err:a", "t:{x}:err:rec");
    // Keyed ("1" after the limit), but no owner, fingerprint or lock TTL.
    let err = script::eval_raw(
        &mut con,
        &RATELIMIT,
        &[a, rec],
        &["1", "tb", "10", "1", "1000", "1", "1", "1"],
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("needs owner, fingerprint and lock TTL"),
        "unexpected error: {err}"
    );
    assert!(
        !exists(&mut con, a) && !exists(&mut con, rec),
        "errors write nothing"
    );
}

#[test]
fn a_batch_of_requests_sent_without_the_idempotency_flag_decides_each_as_unkeyed() {
    // The filter leaves the flag out for a request without a key; packed
    // (src/batch.rs), each member says it is unkeyed with a 0, and the key
    // both use is sent once.
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:wire:a";
    let member = vec![tb(key, 10, 1, 3_600_000)];
    let (keys, packed) = script::packed_batch(&[member.clone(), member]);
    assert_eq!(keys, [key.as_bytes()]);
    let reply: Value = script::eval(&redis_guard::scripts::BATCH)
        .arg(1)
        .arg(key)
        .arg(&packed)
        .query(&mut con)
        .unwrap();
    let ints: Vec<i64> = redis::from_redis_value(&reply).unwrap();
    // Two members, each admitted with its own verdicts (length 5).
    assert_eq!(
        ints,
        [2, 5, 1, 1, 9, 0, 3_600_000, 5, 1, 1, 8, 0, 7_200_000],
        "no member taken for a keyed one"
    );
    assert!(exists(&mut con, key));
}

#[test]
fn redis_names_the_script_by_the_sha1_the_filter_sends() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    assert_eq!(script::load(&mut con, &RATELIMIT), RATELIMIT.sha1);
}

#[test]
fn a_large_sliding_window_cost_is_one_atomic_charge() {
    // 1000 units (the configured maximum) in one call: more members than one
    // unpack() can take, so the script must add them in chunks.
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:sw:bulk";
    let r = eval(&mut con, &[sw(key, 5000, MINUTE).cost(1000)]);
    let v = r.limits[0];
    assert_eq!((r.admitted, v.allowed, v.remaining), (true, true, 4000));
    let n: i64 = redis::cmd("ZCARD").arg(key).query(&mut con).unwrap();
    assert_eq!(n, 1000);
}

#[test]
fn a_call_that_carries_a_nonce_gets_it_back_first_and_is_decided_as_without_it() {
    // The filter's proxy puts "~<nonce>" first in ARGV of every call of
    // these three scripts and takes a reply as the call's own only if it
    // starts with it (README, When things fail: Webdis may write another
    // connection's late reply to this one's socket).
    use redis_guard::scripts::{BATCH, LEASE};
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let b = |s: &str| s.as_bytes().to_vec();
    let nonce = b("~00c0ffee00c0ffee");
    let with = |argv: &[Vec<u8>]| [vec![nonce.clone()], argv.to_vec()].concat();
    let bare = |v: Value| match v {
        Value::Array(mut items) => {
            assert_eq!(
                items.remove(0),
                Value::BulkString(nonce.clone()),
                "the nonce first"
            );
            Value::Array(items)
        }
        other => panic!("not an array: {other:?}"),
    };
    let one = [b("1"), b("tb"), b("5"), b("1"), b("60000"), b("1"), b("1")];
    for (i, (script, argv)) in [
        (&*RATELIMIT, one.to_vec()),
        (&*LEASE, vec![b("5"), b("1"), b("60000"), b("1"), b("2")]),
    ]
    .into_iter()
    .enumerate()
    {
        // Two fresh buckets: one call with the nonce, one without.
        let (k1, k2) = (
            vec![b(&format!("a{i}:{{t}}"))],
            vec![b(&format!("b{i}:{{t}}"))],
        );
        let before = support::redis_now_ms(&mut con);
        let echoed = script::eval_raw(&mut con, script, &k1, &with(&argv)).unwrap();
        let plain = script::eval_raw(&mut con, script, &k2, &argv).unwrap();
        let after = support::redis_now_ms(&mut con);
        // A lease's reply carries Redis' clock at the grant (its 7th item):
        // the two calls may read it a millisecond apart, so it is checked to
        // lie between TIME read before and after, then left out.
        let (mut echoed, mut plain) = (bare(echoed), plain);
        if std::ptr::eq(script, &*LEASE) {
            for reply in [&mut echoed, &mut plain] {
                let Value::Array(items) = reply else {
                    panic!("not an array: {reply:?}")
                };
                let Value::BulkString(now) = std::mem::replace(&mut items[6], Value::Nil) else {
                    panic!("no clock at the grant: {items:?}")
                };
                let now: i64 = String::from_utf8(now).unwrap().parse().unwrap();
                assert!(
                    (before..=after).contains(&now),
                    "{before} <= {now} <= {after}"
                );
            }
        }
        assert_eq!(echoed, plain, "{}", script.sha1);
        assert!(
            bucket(&mut con, &format!("a{i}:{{t}}")).is_some(),
            "the call with the nonce charged its bucket"
        );
    }
    let member = |key: &str| {
        (
            vec![key.to_string()],
            one.iter()
                .map(|a| String::from_utf8(a.clone()).unwrap())
                .collect::<Vec<_>>(),
        )
    };
    let (k1, body1) = script::packed(&[member("c:{t}"), member("c:{t}")]);
    let (k2, body2) = script::packed(&[member("d:{t}"), member("d:{t}")]);
    let echoed = script::eval_raw(&mut con, &BATCH, &k1, &with(&[body1])).unwrap();
    let plain = script::eval_raw(&mut con, &BATCH, &k2, &[body2]).unwrap();
    assert_eq!(bare(echoed), plain, "a batch");
    // A contract error is the script's own, about the ARGV after the nonce
    // (taken out first), and carries no nonce: the filter reads it as is.
    let bad = [b("1"), b("xx"), b("5"), b("1"), b("60000"), b("1"), b("1")];
    let with_nonce = script::eval_raw(&mut con, &RATELIMIT, &[b("e:{t}")], &with(&bad));
    let without = script::eval_raw(&mut con, &RATELIMIT, &[b("e:{t}")], &bad);
    let detail = |r: redis::RedisResult<Value>| r.unwrap_err().detail().map(str::to_string);
    let (with_nonce, without) = (detail(with_nonce), detail(without));
    assert_eq!(with_nonce, without);
    assert_eq!(
        with_nonce.as_deref(),
        Some("redis-guard ratelimit: unknown algorithm")
    );
}
