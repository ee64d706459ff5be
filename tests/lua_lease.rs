//! `lua/lease.lua` (with lua/token_bucket.lua joined in, exactly as the filter
//! sends it) against a real redis-server: the KEYS/ARGV/reply contract in the
//! script's header, the grant arithmetic, one budget shared with the strict
//! `lua/ratelimit.lua` token bucket, TTLs, contract errors and EVALSHA.
//!
//! Redis TIME cannot be mocked, so exactness comes from the state:
//! - a bucket written by hand with `t` in the future gets no refill, so the
//!   next call's every number is a constant;
//! - after an admitting call the stored `t` is the script's own clock, so the
//!   reply is recomputed exactly from the state before and after (`expected`);
//! - periods of an hour with one credit per ms keep every whole-token count
//!   (remaining, granted) constant however long the test takes.
//!
//! Only what genuinely depends on when Redis ran the script is bounded: the
//! retry of a rejection (nothing is written, so its clock is not recorded) and
//! the key's expiry (PEXPIRE counts from the moment it runs, a moment after
//! the script read TIME). Those bounds come from TIME read around the call,
//! never from a fixed slack.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::script::{self, bucket, eval_lease, Bucket};
use support::{
    assert_less_than_a_token_left, bucket_bytes, key_exists as exists, key_pttl as pttl,
    pexpiretime, read_bucket as state, redis_now_ms as now_ms, wait_until,
    write_bucket as set_state,
};

use redis::Connection;
use redis_guard::scripts::{LEASE, RATELIMIT};

/// One hour: with one credit per ms, a test never refills a whole token.
const HOUR: i64 = 3_600_000;

/// lua/lease.lua grants at most this share of the whole tokens a charge
/// leaves (1/SHARE).
const SHARE: i64 = 4;

/// The script's one error reply, as the client sees it (code, detail).
const BAD_ARGS: (&str, &str) = ("ERR", "redis-guard lease: one key and five numbers");

// ---------------------------------------------------------------------------
// The bucket and the contract's arithmetic

/// A slow bucket: one token per hour (one credit per ms).
fn hourly(capacity: i64) -> Bucket {
    bucket(capacity, 1, HOUR)
}

/// Ceiling of `a / b` for `a >= 0`, `b > 0`.
fn ceil_div(a: i64, b: i64) -> i64 {
    assert!(a >= 0 && b > 0, "ceil_div({a}, {b})");
    (a + b - 1) / b
}

/// The reply the header promises for one call, given the bucket's stored
/// `(credits, t)` before it (None: a missing key, a full bucket) and the
/// script's clock `now`; and the credits it leaves when it admits.
///
/// `lease = 0` is the strict token bucket of lua/ratelimit.lua: the same
/// admission and numbers, without the grant.
fn expected(
    b: Bucket,
    cost: i64,
    lease: i64,
    before: Option<(i64, i64)>,
    now: i64,
) -> ([i64; 6], Option<i64>) {
    let full = b.capacity * b.period;
    let credits = match before {
        None => full,
        Some((c, t)) if now > t => full.min(c + (now - t) * b.refill),
        Some((c, _)) => full.min(c),
    };
    let need = cost * b.period;
    if credits < need {
        let retry = ceil_div(need - credits, b.refill);
        return ([0, 0, credits / b.period, retry, retry, 0], None);
    }
    let granted = lease.min((credits - need) / b.period / SHARE);
    let left = credits - need - granted * b.period;
    let reset = ceil_div(full - left, b.refill);
    ([1, 1, left / b.period, 0, reset, granted], Some(left))
}

// ---------------------------------------------------------------------------
// Calling the scripts

/// lua/lease.lua's TTL of the give-back counter (ms).
const RETURNED_TTL: i64 = 660_000;

/// EVALSHA by the SHA-1 the filter sends.
fn evalsha_lease(
    con: &mut Connection,
    key: &str,
    b: Bucket,
    cost: i64,
    lease: i64,
) -> redis::RedisResult<Vec<i64>> {
    script::with_lease(script::evalsha(&LEASE), key, b, cost, lease).query(con)
}

/// The strict script (lua/ratelimit.lua) with one enforced token-bucket
/// limit on `key`: [admitted, allowed, remaining, retry_ms, reset_ms].
fn eval_strict(con: &mut Connection, key: &str, b: Bucket, cost: i64) -> [i64; 5] {
    let raw: Vec<i64> = strict_cmd(script::eval(&RATELIMIT), key, b, cost)
        .query(con)
        .unwrap_or_else(|e| panic!("ratelimit EVAL on {key}: {e}"));
    raw.try_into()
        .unwrap_or_else(|raw| panic!("one limit's reply is five integers: {raw:?}"))
}

/// `cmd` (EVAL or EVALSHA of lua/ratelimit.lua) with the bucket as one limit.
fn strict_cmd(cmd: redis::Cmd, key: &str, b: Bucket, cost: i64) -> redis::Cmd {
    script::with_limits(cmd, &[b.limit(key, cost)], None)
}

// ---------------------------------------------------------------------------
// Reading and writing state directly

// ---------------------------------------------------------------------------
// One lease call, checked against the whole contract

/// A lease call with everything observed around it.
#[derive(Debug)]
struct Call {
    /// The verdict and the grant (the tuple apart).
    reply: [i64; 6],
    /// The grant's give-back tuple: Redis' now, the level after it
    /// (credits), the give-back counter.
    tuple: [i64; 3],
    /// Stored (credits, t) before and after.
    before: Option<(i64, i64)>,
    after: Option<(i64, i64)>,
    /// Redis TIME just before the EVAL and just after the reads that follow it.
    t0: i64,
    t1: i64,
    /// PEXPIRETIME and PTTL read right after the call.
    expire_at: i64,
    pttl: i64,
}

impl Call {
    fn granted(&self) -> i64 {
        self.reply[5]
    }
}

/// Runs lua/lease.lua once and asserts what holds for every call:
///
/// - admitted: the stored `t` is the script's clock (within TIME read around
///   the call), and the reply and stored credits are exactly what the header
///   computes from the state before and that clock; the key expires exactly
///   `reset_ms` after the PEXPIRE ran (see `assert_expires_at_reset`);
/// - rejected: nothing is written (state and absolute expiry unchanged), the
///   grant is 0, reset equals retry, and the reply is the header's for a
///   clock between the TIME reads around it.
fn lease(con: &mut Connection, key: &str, b: Bucket, cost: i64, lease: i64) -> Call {
    let before = state(con, key);
    let expire_before = pexpiretime(con, key);
    let t0 = now_ms(con);
    let full = eval_lease(con, key, b, cost, lease);
    let (reply, tuple) = script::split_lease(full);
    let expire_at = pexpiretime(con, key);
    let ttl = pttl(con, key);
    let t1 = now_ms(con);
    let after = state(con, key);
    let call = Call {
        reply,
        tuple,
        before,
        after,
        t0,
        t1,
        expire_at,
        pttl: ttl,
    };

    match reply[0] {
        1 => {
            let (c, t) = after.unwrap_or_else(|| panic!("admitted but nothing stored: {call:?}"));
            assert!(
                t0 <= t && t <= t1,
                "stored t {t} is not the script's clock (TIME {t0}..{t1}): {call:?}"
            );
            let (want, left) = expected(b, cost, lease, before, t);
            assert_eq!(
                reply, want,
                "reply for cost {cost}, lease {lease} from {before:?} at {t}"
            );
            assert_eq!(Some(c), left, "stored credits: {call:?}");
            assert_expires_at_reset(&call);
            if call.granted() > 0 {
                let counted = script::lease_returned(con, key);
                assert_eq!(call.tuple, [t, c, counted], "the tuple: {call:?}");
                let ttl = pttl(con, &format!("{key}:ret"));
                assert!(
                    600_000 < ttl && ttl <= RETURNED_TTL,
                    "the counter outlives the longest lease: {ttl}"
                );
            } else {
                assert_eq!(call.tuple, [0, 0, 0], "no grant, no tuple: {call:?}");
            }
        }
        0 => {
            assert_eq!(after, before, "a rejection must not write: {call:?}");
            assert_eq!(
                expire_at, expire_before,
                "a rejection must not touch the TTL: {call:?}"
            );
            let (early, _) = expected(b, cost, lease, before, t0);
            let (late, _) = expected(b, cost, lease, before, t1);
            assert_eq!(
                early[..3],
                late[..3],
                "rejected whichever ms it ran: {call:?}"
            );
            assert_eq!(reply[..3], early[..3], "{call:?}");
            // Refill between t0 and t1 can only shorten the wait.
            assert!(
                late[3] <= reply[3] && reply[3] <= early[3],
                "retry_ms {} outside [{}, {}]: {call:?}",
                reply[3],
                late[3],
                early[3]
            );
            assert!(reply[3] > 0, "{call:?}");
            assert_eq!(reply[4], reply[3], "a rejection's reset is its retry");
            assert_eq!(reply[5], 0, "a rejection grants nothing");
            assert_eq!(call.tuple, [0, 0, 0], "a rejection has no tuple");
        }
        _ => panic!("admitted must be 0 or 1: {call:?}"),
    }
    call
}

/// The key's PEXPIRE equals the reset the call reported. PEXPIRE counts from
/// the moment it runs inside the script, which Redis does not report (it may
/// be a millisecond after the script read TIME), so the absolute expiry is
/// bounded by TIME read before and after the call; PTTL, read a moment later
/// still, is at most `reset_ms` and at least `reset_ms` less the time the
/// call and reads took.
#[track_caller]
fn assert_expires_at_reset(call: &Call) {
    let reset = call.reply[4];
    assert!(
        call.t0 + reset <= call.expire_at && call.expire_at <= call.t1 + reset,
        "PEXPIRETIME {} is not reset_ms {reset} after the call ({}..{}): {call:?}",
        call.expire_at,
        call.t0,
        call.t1
    );
    assert!(
        reset - (call.t1 - call.t0) <= call.pttl && call.pttl <= reset,
        "PTTL {} is not reset_ms {reset} less the {} ms the call took: {call:?}",
        call.pttl,
        call.t1 - call.t0
    );
}

/// A strict (lua/ratelimit.lua) call on the same bucket, checked the same way
/// against the shared arithmetic (a strict request is a lease of 0).
fn strict(con: &mut Connection, key: &str, b: Bucket, cost: i64) -> [i64; 5] {
    let before = state(con, key);
    let t0 = now_ms(con);
    let reply = eval_strict(con, key, b, cost);
    let t1 = now_ms(con);
    let after = state(con, key);
    let [admitted, allowed, remaining, retry, reset] = reply;
    if admitted == 1 {
        let (c, t) = after.unwrap();
        assert!(t0 <= t && t <= t1);
        let (want, left) = expected(b, cost, 0, before, t);
        assert_eq!(want[..5], reply[..], "strict reply from {before:?} at {t}");
        assert_eq!(Some(c), left);
    } else {
        assert_eq!(after, before, "a strict rejection must not write");
        let (early, _) = expected(b, cost, 0, before, t0);
        let (late, _) = expected(b, cost, 0, before, t1);
        assert_eq!((admitted, allowed, remaining), (0, 0, early[2]));
        assert_eq!(early[2], late[2]);
        assert!(late[3] <= retry && retry <= early[3] && retry == reset);
    }
    reply
}

// ---------------------------------------------------------------------------
// The grant

#[test]
fn grants_the_full_lease_while_the_bucket_holds_four_times_it() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:lease:full";
    let b = hourly(40);

    // A missing key is a full bucket: 40 - 1 charged leaves 39, a quarter of
    // which (9) holds the lease of 4: 35 left, 5 tokens (5 hours at 1
    // credit/ms) until full again. Exact.
    let c = lease(&mut con, key, b, 1, 4);
    assert_eq!(c.reply, [1, 1, 35, 0, 5 * HOUR, 4]);
    assert_eq!(c.after.unwrap().0, 35 * HOUR);

    // 35 tokens (plus a few ms of refill): 34 after the charge, a quarter
    // (8) still holds the lease.
    let c = lease(&mut con, key, b, 1, 4);
    let (left, t) = c.after.unwrap();
    let elapsed = t - c.before.unwrap().1;
    assert_eq!(
        left,
        30 * HOUR + elapsed,
        "35 tokens and the refill, less 5"
    );
    assert_eq!(c.reply, [1, 1, 30, 0, 10 * HOUR - elapsed, 4]);
}

#[test]
fn grants_shrink_with_the_bucket_to_none_near_exhaustion() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:lease:shrink";
    let b = hourly(12);

    // (remaining, granted) of each call of cost 1 asking for 4: a quarter
    // of the whole tokens the charge leaves, then none below 4 (strict).
    let want = [(9, 2), (6, 2), (4, 1), (3, 0), (2, 0), (1, 0), (0, 0)];
    for (i, (remaining, granted)) in want.into_iter().enumerate() {
        let c = lease(&mut con, key, b, 1, 4);
        assert_eq!(
            [c.reply[0], c.reply[1], c.reply[2], c.reply[3], c.reply[5]],
            [1, 1, remaining, 0, granted],
            "call {i}: {c:?}"
        );
    }
    // Less than a token: rejected, nothing granted, nothing written; the
    // wait is the rest of a token (bounded by the refill while it ran).
    let r = lease(&mut con, key, b, 1, 4);
    assert_eq!(
        [r.reply[0], r.reply[1], r.reply[2], r.reply[5]],
        [0, 0, 0, 0]
    );
    let (c0, t) = r.before.unwrap();
    assert!(HOUR - c0 - (r.t1 - t) <= r.reply[3] && r.reply[3] <= HOUR - c0 - (r.t0 - t));
    assert_less_than_a_token_left(&mut con, key, HOUR);
}

#[test]
fn the_grant_is_a_quarter_of_the_whole_tokens_left_at_its_boundaries() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:lease:sizing";
    // capacity 100, 1 token = 1000 credits, no refill (t in the future,
    // written again before each call): every number exact.
    let b = bucket(100, 1, 1000);
    // (credits held, cost, lease, granted)
    let cases = [
        (4_999, 1, 10, 0),     // 3.999 spare: strict
        (5_000, 1, 10, 1),     // 4 spare: one token
        (5_999, 1, 10, 1),     // 4.999: still one (whole tokens only)
        (8_999, 1, 10, 1),     // 7.999 spare
        (9_000, 1, 10, 2),     // 8 spare
        (40_000, 1, 10, 9),    // 39 spare: a quarter is 9, under the lease
        (41_000, 1, 10, 10),   // 40 spare: the lease
        (100_000, 1, 10, 10),  // full: the lease caps it
        (5_000, 1, 1, 1),      // a lease of 1 at 4 spare
        (4_000, 1, 1, 0),      // and at 3 spare
        (100_000, 0, 30, 25),  // a prefetch (cost 0): a quarter of 100
        (100_000, 100, 10, 0), // the cost takes it all
    ];
    for (held, cost, lease_of, granted) in cases {
        let future = now_ms(&mut con) + HOUR;
        set_state(&mut con, key, held, future);
        let c = lease(&mut con, key, b, cost, lease_of);
        assert_eq!(
            c.granted(),
            granted,
            "{held} credits, cost {cost}, lease {lease_of}: {c:?}"
        );
        assert_eq!(
            c.after.unwrap().0,
            held - (cost + granted) * 1000,
            "charged and granted, no more"
        );
    }
}

#[test]
fn a_rejection_grants_nothing_and_writes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:lease:reject";
    // `t` in the future: no refill, every number exact.
    let future = now_ms(&mut con) + HOUR;
    set_state(&mut con, key, 2500, future);
    // An expiry of its own, far from anything the script would set.
    let expire_at = future + 10 * HOUR;
    redis::cmd("PEXPIREAT")
        .arg(key)
        .arg(expire_at)
        .query::<()>(&mut con)
        .unwrap();
    let stored = bucket_bytes(&mut con, key);

    // capacity 10, 1 credit/ms, 1 token = 1000 credits: 2.5 held, 3 needed,
    // 500 credits short. The lease changes nothing about that.
    let b = bucket(10, 1, 1000);
    let r = lease(&mut con, key, b, 3, 4);
    assert_eq!(r.reply, [0, 0, 2, 500, 500, 0]);
    // 3 credits/ms: ceil(500 / 3) = 167 ms.
    let r = lease(&mut con, key, bucket(10, 3, 1000), 3, 4);
    assert_eq!(r.reply, [0, 0, 2, 167, 167, 0]);
    // A lease of 1 and a lease of 1000 are rejected alike.
    assert_eq!(lease(&mut con, key, b, 3, 1).reply, [0, 0, 2, 500, 500, 0]);
    assert_eq!(
        lease(&mut con, key, b, 3, 1000).reply,
        [0, 0, 2, 500, 500, 0]
    );

    assert_eq!(
        bucket_bytes(&mut con, key),
        stored,
        "a rejection must not write"
    );
    assert_eq!(state(&mut con, key), Some((2500, future)));
    assert_eq!(pexpiretime(&mut con, key), expire_at, "TTL untouched");

    // A key without a TTL keeps none.
    redis::cmd("PERSIST")
        .arg(key)
        .query::<()>(&mut con)
        .unwrap();
    assert_eq!(lease(&mut con, key, b, 3, 4).reply, [0, 0, 2, 500, 500, 0]);
    assert_eq!(pttl(&mut con, key), -1);
}

#[test]
fn the_cost_is_charged_first_and_the_grant_comes_from_what_is_left() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:lease:cost";
    // capacity 40, 1 credit/ms, 1 token = 1000 credits; 26.5 tokens held, no
    // refill (t in the future, written again before each call).
    let b = bucket(40, 1, 1000);
    let call = |con: &mut Connection, cost: i64, lease_of: i64| {
        let future = now_ms(con) + HOUR;
        set_state(con, key, 26_500, future);
        lease(con, key, b, cost, lease_of)
    };

    // cost 4 leaves 22.5: a quarter of 22 is 5, the lease of 5 in full,
    // 17.5 left, 22500 ms to full.
    let c = call(&mut con, 4, 5);
    assert_eq!(c.reply, [1, 1, 17, 0, 22_500, 5]);
    assert_eq!(c.after.unwrap().0, 17_500);
    // cost 5 leaves 21.5: 5 granted of the 6 asked.
    let c = call(&mut con, 5, 6);
    assert_eq!(c.reply, [1, 1, 16, 0, 23_500, 5]);
    assert_eq!(c.after.unwrap().0, 16_500);
    // cost 23 leaves 3.5: admitted, nothing to grant.
    let c = call(&mut con, 23, 4);
    assert_eq!(c.reply, [1, 1, 3, 0, 36_500, 0]);
    assert_eq!(c.after.unwrap().0, 3_500);
    // cost 1 leaves 25.5: a lease of 3 is granted in full, 22.5 left.
    let c = call(&mut con, 1, 3);
    assert_eq!(c.reply, [1, 1, 22, 0, 17_500, 3]);
    assert_eq!(c.after.unwrap().0, 22_500);
    // cost 27 > 26.5 held: a lease never makes an unaffordable request fit.
    let c = call(&mut con, 27, 4);
    assert_eq!(c.reply, [0, 0, 26, 500, 500, 0]);
    assert_eq!(c.after.unwrap().0, 26_500);
}

// ---------------------------------------------------------------------------
// One budget with the strict script

#[test]
fn leased_and_strict_requests_spend_one_budget() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:lease:shared";
    let b = hourly(20);
    let mut charged = 0; // costs of admitted requests, leased or strict
    let mut granted = 0;

    // 20 - 1 - 4 = 15: the strict script sees the leased tokens gone.
    let c = lease(&mut con, key, b, 1, 4);
    assert_eq!(c.reply, [1, 1, 15, 0, 5 * HOUR, 4]);
    (charged, granted) = (charged + 1, granted + c.granted());
    for left in [14, 13, 12] {
        let r = strict(&mut con, key, b, 1);
        assert_eq!(r[..4], [1, 1, left, 0]);
        charged += 1;
    }
    // 12 - 2 = 10, a quarter of which is 2 of the 5 asked: 8 left.
    let c = lease(&mut con, key, b, 2, 5);
    assert_eq!(c.reply[..4], [1, 1, 8, 0]);
    assert_eq!(c.granted(), 2);
    (charged, granted) = (charged + 2, granted + c.granted());
    for left in [5, 2] {
        let r = strict(&mut con, key, b, 3);
        assert_eq!(r[..4], [1, 1, left, 0]);
        charged += 3;
    }
    // 2 < 3: the strict script rejects, as it would without leases.
    let r = strict(&mut con, key, b, 3);
    assert_eq!(r[..3], [0, 0, 2]);
    // The last 2 tokens go one by one, nothing granted (strict near the end).
    for left in [1, 0] {
        let c = lease(&mut con, key, b, 1, 4);
        assert_eq!(c.reply[..4], [1, 1, left, 0]);
        assert_eq!(c.granted(), 0);
        charged += 1;
    }
    // Empty for both.
    assert_eq!(strict(&mut con, key, b, 1)[..3], [0, 0, 0]);
    assert_eq!(lease(&mut con, key, b, 1, 4).reply[..3], [0, 0, 0]);

    assert_eq!((charged, granted), (14, 6));
    assert_eq!(
        charged + granted,
        b.capacity,
        "every token spent exactly once"
    );
    assert_less_than_a_token_left(&mut con, key, HOUR);
}

#[test]
fn concurrent_leased_and_strict_calls_never_spend_more_than_the_capacity() {
    let redis = support::Redis::start();
    let key = "t:{x}:lease:race";
    let b = hourly(150);
    {
        let mut con = redis.conn();
        assert_eq!(script::load(&mut con, &LEASE), LEASE.sha1);
        assert_eq!(script::load(&mut con, &RATELIMIT), RATELIMIT.sha1);
    }

    // 8 connections race 400 calls: even-numbered calls lease (cost 1, up to
    // 3 more), odd ones are strict (cost 2). Enough to drain the bucket.
    const THREADS: usize = 8;
    const TOTAL: usize = 400;
    // Per call: [charged, granted, admitted, rejected].
    let sums = redis.race(THREADS, TOTAL, |con, i| {
        let leased = i % 2 == 0;
        let (cmd, cost) = if leased {
            let cmd = script::with_lease(script::evalsha(&LEASE), key, b, 1, 3);
            (cmd, 1)
        } else {
            (strict_cmd(script::evalsha(&RATELIMIT), key, b, 2), 2)
        };
        let raw: Vec<i64> = cmd
            .query(con)
            .unwrap_or_else(|e| panic!("a racing call failed: {e}"));
        match (raw[0], leased) {
            (1, true) => [cost, raw[5], 1, 0],
            (1, false) => [cost, 0, 1, 0],
            _ => [0, 0, 0, 1],
        }
    });
    let mut totals = [0i64; 4];
    for s in sums {
        totals.iter_mut().zip(s).for_each(|(t, s)| *t += s);
    }
    let [charged, granted, admitted, rejected] = totals;
    assert_eq!(admitted + rejected, TOTAL as i64);
    // Refill during the race is far below a token, and 400 calls drain 150
    // tokens: every token went to exactly one request or one grant.
    assert_eq!(
        charged + granted,
        b.capacity,
        "charged {charged} + granted {granted} (admitted {admitted}, rejected {rejected})"
    );
    let mut con = redis.conn();
    assert_less_than_a_token_left(&mut con, key, HOUR);
}

// ---------------------------------------------------------------------------
// TTL

#[test]
fn every_admission_expires_the_key_when_the_bucket_is_full_again() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    // `lease` asserts PEXPIRETIME and PTTL against reset_ms on every admission;
    // here the cases where the key's TTL before the call differs.
    let b = bucket(10, 7, 1000);

    // A fresh key: 10 - 2 - 2 (a quarter of 8) = 6 tokens left, 4000
    // credits at 7/ms -> ceil(571.4) = 572 ms.
    let fresh = "t:{x}:lease:ttl-fresh";
    let c = lease(&mut con, fresh, b, 2, 3);
    assert_eq!(c.reply, [1, 1, 6, 0, 572, 2]);

    // A hand-written key without a TTL gets one.
    let future = now_ms(&mut con) + HOUR;
    let bare = "t:{x}:lease:ttl-bare";
    set_state(&mut con, bare, 7500, future);
    assert_eq!(pttl(&mut con, bare), -1);
    // 7.5 - 1 - 1 (a quarter of 6) = 5.5 tokens left: 4500 credits at 7/ms
    // -> ceil(642.9) = 643 ms.
    let c = lease(&mut con, bare, b, 1, 4);
    assert_eq!(c.reply, [1, 1, 5, 0, 643, 1]);

    // A longer TTL set by hand is replaced, not kept.
    let long = "t:{x}:lease:ttl-long";
    set_state(&mut con, long, 7500, future);
    redis::cmd("PEXPIRE")
        .arg(long)
        .arg(10 * HOUR)
        .query::<()>(&mut con)
        .unwrap();
    let c = lease(&mut con, long, b, 1, 4);
    assert_eq!(c.reply, [1, 1, 5, 0, 643, 1]);

    // A slow bucket: 3 hours to full, the same on the key.
    let slow = "t:{x}:lease:ttl-slow";
    let c = lease(&mut con, slow, hourly(10), 1, 4);
    assert_eq!(c.reply, [1, 1, 7, 0, 3 * HOUR, 2]);
    assert!(c.pttl > 2 * HOUR, "{c:?}");
}

// ---------------------------------------------------------------------------
// Refill

#[test]
fn refills_by_redis_time_and_grants_what_the_state_holds() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:lease:refill";
    // 9 tokens, one every 200 ms (1 credit/ms, 1 token = 200 credits).
    let b = bucket(9, 1, 200);

    // Fresh: 1 charged, 2 granted (a quarter of 8), 6 left; 600 ms until full.
    let c = lease(&mut con, key, b, 1, 4);
    assert_eq!(c.reply, [1, 1, 6, 0, 600, 2]);
    let (c0, t0) = c.after.unwrap();
    assert_eq!(c0, 1200);

    // Wait until Redis has refilled 1.5 tokens: the grant is a quarter of
    // whatever whole tokens the state holds when the script runs.
    wait_until(&mut con, t0 + 300);
    let c = lease(&mut con, key, b, 1, 4);
    let (c1, t1) = c.after.unwrap();
    let credits = (c0 + t1 - t0).min(1800);
    assert!(credits >= 1500, "{c:?}");
    let granted = 4.min((credits - 200) / 200 / 4);
    assert_eq!(c.granted(), granted);
    assert_eq!(c1, credits - 200 - granted * 200);
    assert_eq!(c.reply, [1, 1, c1 / 200, 0, 1800 - c1, granted]);

    // Wait until it is full again: capped at 9 tokens, however long it took.
    wait_until(&mut con, t1 + 1800 - c1);
    let c = lease(&mut con, key, b, 1, 4);
    assert_eq!(c.reply, [1, 1, 6, 0, 600, 2]);
    assert_eq!(c.after.unwrap().0, 1200);
}

// ---------------------------------------------------------------------------
// Contract errors

#[test]
fn rejects_anything_but_one_key_and_five_numbers() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let (a, b) = ("t:{x}:lease:err-a", "t:{x}:lease:err-b");
    let good = ["10", "1", "1000", "1", "4"];

    let mut cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec![], good.to_vec()),
        (vec![a, b], good.to_vec()),
        (vec![a], good[..4].to_vec()),
        (vec![a], vec![]),
    ];
    for i in 0..good.len() {
        for bad in ["ten", "", "1x", "1,5"] {
            let mut argv = good.to_vec();
            argv[i] = bad;
            cases.push((vec![a], argv));
        }
    }
    for (keys, argv) in &cases {
        let Err(err) = script::eval_raw(&mut con, &LEASE, keys, argv) else {
            panic!("KEYS {keys:?} ARGV {argv:?} must fail");
        };
        assert_eq!(
            (err.code(), err.detail()),
            (Some(BAD_ARGS.0), Some(BAD_ARGS.1)),
            "KEYS {keys:?} ARGV {argv:?}: {err}"
        );
    }
    assert!(
        !exists(&mut con, a) && !exists(&mut con, b),
        "errors write nothing"
    );

    // Nor do they touch a key that holds a bucket.
    let future = now_ms(&mut con) + HOUR;
    set_state(&mut con, a, 2500, future);
    let stored = bucket_bytes(&mut con, a);
    for argv in [&["10", "1", "1000", "1", "four"][..], &good[..4]] {
        assert!(script::eval_raw(&mut con, &LEASE, &[a], argv).is_err());
    }
    assert!(script::eval_raw(&mut con, &LEASE, &[a, b], &good).is_err());
    assert_eq!(bucket_bytes(&mut con, a), stored);
    assert!(!exists(&mut con, b));
}

/// Redis' Lua `tonumber()` takes "nan", "inf", fractions and negatives; the
/// script refuses all of them (the filter only sends whole numbers, so this
/// needs a hand-made call), and a cost above the capacity.
#[test]
fn rejects_nan_infinity_fractions_and_numbers_out_of_range() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:lease:nan";
    let good = ["10", "1", "1000", "1", "4"];
    for i in 0..good.len() {
        for bad in ["nan", "inf", "-inf", "2.5", "-3", "0"] {
            if i == 3 && bad == "0" {
                continue; // a cost of 0 is a prefetch: valid
            }
            let mut argv = good.to_vec();
            argv[i] = bad;
            let Err(err) = script::eval_raw(&mut con, &LEASE, &[key], &argv) else {
                panic!("ARGV {argv:?} must fail");
            };
            assert_eq!(
                (err.code(), err.detail()),
                (Some(BAD_ARGS.0), Some(BAD_ARGS.1))
            );
        }
    }
    let Err(err) = script::eval_raw(&mut con, &LEASE, &[key], &["10", "1", "1000", "11", "4"])
    else {
        panic!("a cost above the capacity must fail");
    };
    assert_eq!(
        (err.code(), err.detail()),
        (Some(BAD_ARGS.0), Some(BAD_ARGS.1))
    );
    assert!(!exists(&mut con, key));
}

// ---------------------------------------------------------------------------
// EVALSHA

#[test]
fn evalsha_by_the_filters_sha1_behaves_like_eval() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let b = bucket(10, 1, 1000);

    let err = evalsha_lease(&mut con, "t:{x}:lease:sha-none", b, 1, 4).unwrap_err();
    assert_eq!(err.kind(), redis::ErrorKind::NoScriptError, "{err}");
    assert!(!exists(&mut con, "t:{x}:lease:sha-none"));

    assert_eq!(script::load(&mut con, &LEASE), LEASE.sha1);
    let loaded: Vec<i64> = redis::cmd("SCRIPT")
        .arg("EXISTS")
        .arg(&LEASE.sha1)
        .query(&mut con)
        .unwrap();
    assert_eq!(loaded, [1]);

    // Each case on two keys holding the same state (t in the future: no
    // refill), one called by EVALSHA and one by EVAL: the same reply, the
    // same credits left.
    let future = now_ms(&mut con) + HOUR;
    let cases: [(Option<i64>, i64, i64, [i64; 6]); 5] = [
        (None, 1, 4, [1, 1, 7, 0, 3000, 2]), // fresh: a quarter of 9
        (Some(6500), 4, 5, [1, 1, 2, 0, 7500, 0]), // 2.5 left: strict
        (Some(6500), 6, 4, [1, 1, 0, 0, 9500, 0]), // cost fits, nothing spare
        (Some(2500), 3, 4, [0, 0, 2, 500, 500, 0]), // rejected
        (Some(10_000), 10, 4, [1, 1, 0, 0, 10_000, 0]), // cost = capacity
    ];
    for (i, (held, cost, lease_of, want)) in cases.into_iter().enumerate() {
        let (by_sha, by_eval) = (
            format!("t:{{x}}:lease:sha-{i}"),
            format!("t:{{x}}:lease:eval-{i}"),
        );
        if let Some(c) = held {
            set_state(&mut con, &by_sha, c, future);
            set_state(&mut con, &by_eval, c, future);
        }
        let sha_reply = evalsha_lease(&mut con, &by_sha, b, cost, lease_of).unwrap();
        let eval_reply = eval_lease(&mut con, &by_eval, b, cost, lease_of);
        assert_eq!(sha_reply[..6], want, "EVALSHA, case {i}");
        assert_eq!(eval_reply[..6], want, "EVAL, case {i}");
        // The tuple: Redis' now differs between the two calls; the level
        // and the counter do not.
        assert_eq!(sha_reply[7..], eval_reply[7..], "case {i}");
        // No refill (t in the future): what is left is the contract's exactly,
        // or what was held, for the rejection.
        let (_, left) = expected(b, cost, lease_of, held.map(|c| (c, future)), future);
        let credits = left.or(held);
        assert_eq!(state(&mut con, &by_sha).map(|s| s.0), credits, "case {i}");
        assert_eq!(state(&mut con, &by_eval).map(|s| s.0), credits, "case {i}");
    }
}
