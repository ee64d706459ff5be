//! `lua/lease_return.lua` (with lua/token_bucket.lua joined in, as the
//! filter sends it) against a real redis-server: unspent leased tokens given
//! back, never more than a bucket that never leased them would hold, worked
//! case by case (the seeded fleet: tests/lua_lease_safety.rs). The cases use
//! the test clock (tests/support/script/lease.rs) with TTLs dropped, so
//! every level is exact; the record's TTL and the contract errors run at
//! Redis' own clock.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use redis::Connection;
use redis_guard::scripts::LEASE_RETURN;
use support::script::{
    self, bucket, eval_lease, give_back, lease_at, lease_record, lease_returned, level_at,
    start_leasing as start, strict_at, Bucket, RETURN_AT, RETURN_SMALL, T0 as T,
};
use support::{key_exists as exists, key_pttl as pttl, read_bucket as state};

/// One hour: with one credit per ms, a test never refills a whole token.
const HOUR: i64 = 3_600_000;

/// lua/lease.lua's TTL of the give-back record (ms).
const RETURNED_TTL: i64 = 660_000;

/// A slow bucket: one token per hour (one credit per ms).
fn hourly(capacity: i64) -> Bucket {
    bucket(capacity, 1, HOUR)
}

/// The script's one error reply for a malformed give-back.
const BAD_RETURN: (&str, &str) = ("ERR", "redis-guard lease return: seven numbers per key");

/// Issue 51's case: three Envoys' grants at one instant, each give-back
/// capped on its own against the same peak, left 24 tokens where a bucket
/// that never leased holds 20.
#[test]
fn three_envoys_giving_back_never_leave_more_than_a_bucket_that_never_leased() {
    let (_redis, mut con) = start();
    let key = "t:{x}:lease:three";
    // 100 tokens, one a second (a credit a ms).
    let b = bucket(100, 1, 1000);
    script::set_clock(&mut con, script::T0);
    // X, Y and Z fetch 10 each (prefetches: no request rides on them).
    let (rx, x) = lease_at(&mut con, key, b, 0, 10);
    let (ry, y) = lease_at(&mut con, key, b, 0, 10);
    let (rz, z) = lease_at(&mut con, key, b, 0, 10);
    assert_eq!((rx[5], ry[5], rz[5]), (10, 10, 10));
    assert_eq!([x[1], y[1], z[1]], [90_000, 80_000, 70_000]);
    // 1 s later X gives its 10 back: 9 come back (a bucket that never
    // leased X's 10 would be full already and hold 100 - 20 + 1).
    script::set_clock(&mut con, script::T0 + 1_000);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 10, x), 9);
    assert_eq!(level_at(&mut con, key, b, script::T0 + 1_000), 80_000);
    // At 15 s the bucket holds 94; a strict request takes 80.
    let at = script::T0 + 15_000;
    script::set_clock(&mut con, at);
    assert_eq!(level_at(&mut con, key, b, at), 94_000);
    assert!(strict_at(&mut con, key, b, 80));
    // A bucket that never leased the 9 X gave back would hold 19 + 15 of
    // refill, capped at 100, less 80: 20. Z's 10 had they never left: 6 of
    // them fit; then Y's: none. Judging each against the same peak took
    // 5 and 5.
    let from_z = give_back(&mut con, &RETURN_AT, key, b, 10, z);
    let from_y = give_back(&mut con, &RETURN_AT, key, b, 10, y);
    let mut admitted = 0;
    while strict_at(&mut con, key, b, 1) {
        admitted += 1;
    }
    assert_eq!(
        (from_z, from_y, admitted),
        (6, 0, 20),
        "given back by Z and Y, then admitted in the same ms"
    );
}

#[test]
fn a_give_back_after_the_bucket_refilled_to_the_cap_returns_at_most_c_minus_m() {
    let (_redis, mut con) = start();
    // 40 tokens, one a second.
    let b = bucket(40, 1, 1000);
    let case = |con: &mut Connection, key: &str, wait: i64| {
        script::set_clock(con, script::T0);
        // Full: 1 charged, 8 granted (a quarter of 39 is 9), 31 left.
        let (reply, tuple) = lease_at(con, key, b, 1, 8);
        assert_eq!(reply, [1, 1, 31, 0, 9_000, 8]);
        assert_eq!(tuple, [script::T0, 31_000, 0]);
        script::set_clock(con, script::T0 + wait);
        assert!(strict_at(con, key, b, 3));
        give_back(con, &RETURN_AT, key, b, 8, tuple)
    };
    // 9 s later the bucket refilled to the cap while the 8 were out (M = C):
    // a bucket that never leased them holds 40 - 3 = 37, as this one does
    // already. The naive give-back (8, capped at 40) would make it 40.
    assert_eq!(case(&mut con, "t:{x}:lease:cap", 9_000), 0);
    assert_eq!(
        level_at(&mut con, "t:{x}:lease:cap", b, script::T0 + 9_000),
        37_000
    );
    // 5 s later it reached 36 (M): C - M = 4 come back, 33 + 4 = 37, what a
    // bucket that never leased them holds (39 + 5 capped at 40, less 3).
    assert_eq!(case(&mut con, "t:{x}:lease:part", 5_000), 4);
    assert_eq!(
        level_at(&mut con, "t:{x}:lease:part", b, script::T0 + 5_000),
        37_000
    );
    assert_eq!(lease_returned(&mut con, "t:{x}:lease:part"), 4);
    // At once (no refill, no charge between): all 8.
    script::set_clock(&mut con, script::T0);
    let (_, tuple) = lease_at(&mut con, "t:{x}:lease:now", b, 1, 8);
    assert_eq!(
        give_back(&mut con, &RETURN_AT, "t:{x}:lease:now", b, 8, tuple),
        8
    );
    assert_eq!(level_at(&mut con, "t:{x}:lease:now", b, script::T0), 39_000);
    // Two Envoys taking turns: grants of 8 and 7 (a quarter of 30), the
    // second given back whole (30 left), then a strict request takes 10.
    // The first counts no give-back in its bound: the 7 were granted after
    // it (in the same ms, at a lower level), so a bucket that never lent
    // them rises no higher from the first grant on. All 8 come back, and
    // the bucket holds 28, exactly what a bucket that never leased holds
    // (40 - 1 - 1 - 10). (Counting every give-back since the grant would
    // have let 2 come back.)
    let key = "t:{x}:lease:two";
    let (r1, t1) = lease_at(&mut con, key, b, 1, 8);
    let (r2, t2) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!((r1[5], r2[5]), (8, 7));
    assert_eq!((t1, t2), ([T, 31_000, 0], [T, 23_000, 0]));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 7, t2), 7);
    assert!(strict_at(&mut con, key, b, 10));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, t1), 8);
    assert_eq!(level_at(&mut con, key, b, T), 28_000);
    let record = lease_record(&mut con, key).unwrap();
    assert_eq!((record.count, record.since), (15, T));
    assert_eq!(
        record.entries,
        [[T, 23_000, 0, 7, T, 1], [T, 31_000, 0, 8, T, 1]],
        "each give-back: its grant's tuple, the tokens, when"
    );
    // A give-back after a grant, of a grant before it, counts: grant A at
    // 28 (cost 1, 6 granted: 21 left), the strict side takes 5 (16), grant
    // B (cost 1, 3 granted: 12 left), A gives back 6 (18), and B's bound
    // is 12 + 6: all 3 come back (21), what a bucket that never leased
    // holds (28 - 1 - 5 - 1).
    let (ra, ta) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!((ra[5], ta), (6, [T, 21_000, 15]));
    assert!(strict_at(&mut con, key, b, 5));
    let (rb, tb) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!((rb[5], tb), (3, [T, 12_000, 15]));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 6, ta), 6);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 3, tb), 3);
    assert_eq!(level_at(&mut con, key, b, T), 21_000);
    assert_eq!(lease_returned(&mut con, key), 24);

    // And one that lets the refill reach the cap: B takes 8 (31 left), the
    // strict side 16 (15), A takes 3 at 11, B gives back 8 (19), 21 s later
    // the bucket is full, the strict side takes 3 (37). A's level was 11,
    // 11 + 21 < 40, but with B's 8 never lent the bucket would have reached
    // the cap: nothing comes back (a bucket that never leased holds 37 too).
    let key = "t:{x}:lease:peak";
    script::set_clock(&mut con, T);
    let (rb, tb) = lease_at(&mut con, key, b, 1, 8);
    assert!(strict_at(&mut con, key, b, 16));
    let (ra, ta) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!((rb[5], ra[5], ta[1]), (8, 3, 11_000));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, tb), 8);
    script::set_clock(&mut con, T + 21_000);
    assert!(strict_at(&mut con, key, b, 3));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 3, ta), 0);
    assert_eq!(level_at(&mut con, key, b, T + 21_000), 37_000);
}

#[test]
fn the_counter_outlives_every_lease_and_a_stale_or_unknown_tuple_gives_nothing_back() {
    let (_redis, mut con) = start();
    let key = "t:{x}:lease:counter";
    let ck = format!("{key}:ret");
    let b = hourly(40);
    let (reply, tuple) = script::split_lease(eval_lease(&mut con, key, b, 1, 4));
    assert_eq!(reply[5], 4);
    assert!(pttl(&mut con, &ck) > 600_000);
    // Given back at once: all 4 (the refill of a few ms is far from a token).
    assert_eq!(give_back(&mut con, &LEASE_RETURN, key, b, 4, tuple), 4);
    assert_eq!(lease_returned(&mut con, key), 4);
    let ttl = pttl(&mut con, &ck);
    assert!(
        600_000 < ttl && ttl <= RETURNED_TTL,
        "the give-back keeps the TTL: {ttl}"
    );

    let (_, tuple) = script::split_lease(eval_lease(&mut con, key, b, 1, 4));
    assert_eq!(tuple[2], 4, "the next grant carries the count");
    let stored = state(&mut con, key);
    // Older than the longest lease: nothing.
    let [t0, level, counted] = tuple;
    let stale = [t0 - 600_001, level, counted];
    assert_eq!(give_back(&mut con, &LEASE_RETURN, key, b, 4, stale), 0);
    // A counter below the tuple's (it went backwards): nothing.
    assert_eq!(
        give_back(&mut con, &LEASE_RETURN, key, b, 4, [t0, level, 5]),
        0
    );
    // A tuple from Redis' future (a clock stepped back): nothing.
    assert_eq!(
        give_back(&mut con, &LEASE_RETURN, key, b, 4, [t0 + HOUR, level, 4]),
        0
    );
    // The counter gone: nothing, and it is not created.
    redis::cmd("DEL").arg(&ck).query::<()>(&mut con).unwrap();
    assert_eq!(give_back(&mut con, &LEASE_RETURN, key, b, 4, tuple), 0);
    assert!(!exists(&mut con, &ck));
    assert_eq!(state(&mut con, key), stored, "nothing written");
}

#[test]
fn a_give_back_sent_twice_returns_its_tokens_once_and_answers_the_same() {
    let (_redis, mut con) = start();
    // 40 tokens, one a second.
    let b = bucket(40, 1, 1000);
    script::set_clock(&mut con, T);
    let key = "t:{x}:lease:twice";
    // 1 charged, 8 granted: 31 left. Given back whole (39), then the same
    // call again (a late reply Webdis handed to another request, a 503
    // after the command ran): the same answer, nothing written. Counted
    // twice, the bound would have let a ninth token in (40, where a bucket
    // that never leased holds 39).
    let (_, tuple) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, tuple), 8);
    let record = lease_record(&mut con, key);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, tuple), 8);
    assert_eq!(level_at(&mut con, key, b, T), 39_000);
    assert_eq!(lease_record(&mut con, key), record, "nothing written");
    // Later, behind another Envoy's give-back, and cut by the bound: the
    // cut figure again. Grant A (8: 30 left), grant B (7: 22 left), 5 s
    // later (27) the strict side takes 20 (7), A gives back (M' = 30 + 5:
    // 5 of 8 come back, 12), B gives back (M' = 22 + 5 + 5: 7, 19); A's
    // and B's calls again: 5 and 7, and the bucket holds 19.
    let (_, ta) = lease_at(&mut con, key, b, 1, 8);
    let (_, tb) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!((ta[1], tb[1]), (30_000, 22_000));
    script::set_clock(&mut con, T + 5_000);
    assert!(strict_at(&mut con, key, b, 20));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, ta), 5);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 7, tb), 7);
    assert_eq!(level_at(&mut con, key, b, T + 5_000), 19_000);
    let record = lease_record(&mut con, key);
    script::set_clock(&mut con, T + 6_000);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, ta), 5);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 7, tb), 7);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, tuple), 8);
    assert_eq!(
        level_at(&mut con, key, b, T + 6_000),
        20_000,
        "refill alone"
    );
    assert_eq!(lease_record(&mut con, key), record, "nothing written");
    // One answered 0 is not kept: sent again later it is 0 again (its
    // bound only tightens). C takes 1 and 4 at 20 (15 left), the bucket
    // refills to the cap 25 s later: nothing comes back, then or later.
    let (_, tc) = lease_at(&mut con, key, b, 1, 4);
    assert_eq!(tc[1], 15_000);
    script::set_clock(&mut con, T + 31_000);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 4, tc), 0);
    assert!(strict_at(&mut con, key, b, 30));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 4, tc), 0);

    // A give-back merged with another (a record of 2 entries, as in the
    // seeded run) can no longer be told apart: sent again it gives
    // nothing back, and writes nothing.
    let key = "t:{x}:lease:merged";
    script::set_clock(&mut con, T);
    let tuples: Vec<_> = (0..3).map(|_| lease_at(&mut con, key, b, 0, 2).1).collect();
    for t in &tuples {
        assert_eq!(give_back(&mut con, &RETURN_SMALL, key, b, 2, *t), 2);
    }
    let record = lease_record(&mut con, key).unwrap();
    assert_eq!(
        record.entries.iter().map(|e| e[5]).collect::<Vec<_>>(),
        [2, 1]
    );
    for (t, again) in tuples.iter().zip([0, 0, 2]) {
        assert_eq!(give_back(&mut con, &RETURN_SMALL, key, b, 2, *t), again);
    }
    assert_eq!(lease_record(&mut con, key), Some(record), "nothing written");
    assert_eq!(level_at(&mut con, key, b, T), 40_000);
}

#[test]
fn a_record_refuses_tuples_older_than_itself_and_keeps_only_entries_that_may_count() {
    let (_redis, mut con) = start();
    // 100 tokens, one an hour: no refill to speak of.
    let b = hourly(100);
    script::set_clock(&mut con, T);
    // The record lost after a grant: the next grant starts it again, and
    // the tuple from before (whose give-backs it no longer knows) gives
    // nothing back, though its count (0) is not above the new record's.
    let key = "t:{x}:lease:lost";
    let (_, before) = lease_at(&mut con, key, b, 1, 8);
    redis::cmd("DEL")
        .arg(format!("{key}:ret"))
        .query::<()>(&mut con)
        .unwrap();
    script::set_clock(&mut con, T + 1);
    let (_, after) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!((before[2], after[2]), (0, 0));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, before), 0);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, after), 8);
    let record = lease_record(&mut con, key).unwrap();
    assert_eq!((record.count, record.since), (8, T + 1));

    // An older filter's record (a count of 5 and one peak): the next grant
    // starts this layout at 0, and every tuple from before gives nothing.
    let key = "t:{x}:lease:older";
    let (_, old) = lease_at(&mut con, key, b, 1, 8);
    let older: Vec<u8> = [5.0f64, 5.0, 30_000.0, T as f64]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    redis::cmd("SET")
        .arg(format!("{key}:ret"))
        .arg(older)
        .query::<()>(&mut con)
        .unwrap();
    let old = [old[0], old[1], 5];
    assert_eq!(
        give_back(&mut con, &RETURN_AT, key, b, 8, old),
        0,
        "not this layout"
    );
    script::set_clock(&mut con, T + 2);
    let (_, new) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!(new[2], 0);
    assert_eq!(
        give_back(&mut con, &RETURN_AT, key, b, 8, old),
        0,
        "older than the record"
    );
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, new), 8);

    // What a reset must leave (lua/lease_return.lua's header): a record
    // started after the reset's ms refuses every tuple up to it, those of
    // grants made after the reset in that ms too. (A deleted record, started
    // again by a grant in that ms, could not tell them apart.)
    let key = "t:{x}:lease:restarted";
    let (_, before) = lease_at(&mut con, key, b, 1, 8);
    let restarted: Vec<u8> = [0.0f64, -2.0, (T + 3) as f64]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    redis::cmd("SET")
        .arg(format!("{key}:ret"))
        .arg(restarted)
        .query::<()>(&mut con)
        .unwrap();
    let (_, same_ms) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!((before[0], same_ms[0]), (T + 2, T + 2));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, before), 0);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, same_ms), 0);
    script::set_clock(&mut con, T + 3);
    let (_, after) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, after), 8);

    // A tuple as old as the longest lease (600 s) gives nothing; 1 ms
    // younger, it does.
    let key = "t:{x}:lease:oldest";
    script::set_clock(&mut con, T);
    let (_, first) = lease_at(&mut con, key, b, 1, 8);
    let (_, second) = lease_at(&mut con, key, b, 1, 8);
    script::set_clock(&mut con, T + 600_000);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, first), 0);
    script::set_clock(&mut con, T + 599_999);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, second), 8);

    // 40 give-backs, one a ms: the record keeps 32 entries, the oldest 9
    // merged into one under the earliest grant's tuple; an entry made
    // 600 s before a give-back is dropped by it.
    let key = "t:{x}:lease:bounded";
    let mut tuples = Vec::new();
    for i in 0..40 {
        script::set_clock(&mut con, T + i);
        let (reply, tuple) = lease_at(&mut con, key, b, 0, 1);
        assert_eq!(reply[5], 1);
        assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 1, tuple), 1);
        tuples.push(tuple);
    }
    let record = lease_record(&mut con, key).unwrap();
    assert_eq!(record.count, 40);
    assert_eq!(record.entries.len(), 32);
    let [t0, level, returned] = tuples[0];
    assert_eq!(record.entries[0], [t0, level, returned, 9, T + 8, 9]);
    assert_eq!(record.entries[1][..5], [T + 9, 99 * HOUR, 9, 1, T + 9]);
    script::set_clock(&mut con, T + 600_010);
    let (_, late) = lease_at(&mut con, key, b, 0, 1);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 1, late), 1);
    let record = lease_record(&mut con, key).unwrap();
    assert_eq!(
        record.entries.iter().map(|e| e[4]).collect::<Vec<_>>(),
        [
            T + 11,
            T + 12,
            T + 13,
            T + 14,
            T + 15,
            T + 16,
            T + 17,
            T + 18,
            T + 19,
            T + 20,
            T + 21,
            T + 22,
            T + 23,
            T + 24,
            T + 25,
            T + 26,
            T + 27,
            T + 28,
            T + 29,
            T + 30,
            T + 31,
            T + 32,
            T + 33,
            T + 34,
            T + 35,
            T + 36,
            T + 37,
            T + 38,
            T + 39,
            T + 600_010
        ],
        "the entries of the last 600 s"
    );
}

#[test]
fn a_give_back_refuses_anything_but_seven_whole_numbers_per_key() {
    let (_redis, mut con) = start();
    let (a, b) = ("t:{x}:lease:rerr-a", "t:{x}:lease:rerr-b");
    let good = ["10", "1", "1000", "2", "1700000000000", "5000", "0"];
    let mut cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec![], vec![]),
        (vec![a], good[..6].to_vec()),
        (vec![a, b], good.to_vec()),
        (vec![a], [&good[..], &["1"]].concat()),
    ];
    for i in 0..good.len() {
        for bad in ["nan", "inf", "", "2.5", "-1", "x"] {
            let mut argv = good.to_vec();
            argv[i] = bad;
            cases.push((vec![a], argv));
        }
    }
    // No tokens, or more than the capacity.
    for tokens in ["0", "11"] {
        let mut argv = good.to_vec();
        argv[3] = tokens;
        cases.push((vec![a], argv));
    }
    // A bad second key spoils the first: nothing written.
    cases.push((vec![a, b], [&good[..], &good[..6], &["-1"]].concat()));
    for (keys, argv) in &cases {
        let Err(err) = script::eval_raw(&mut con, &LEASE_RETURN, keys, argv) else {
            panic!("KEYS {keys:?} ARGV {argv:?} must fail");
        };
        assert_eq!(
            (err.code(), err.detail()),
            (Some(BAD_RETURN.0), Some(BAD_RETURN.1)),
            "KEYS {keys:?} ARGV {argv:?}: {err}"
        );
    }
    for k in [a, b] {
        assert!(!exists(&mut con, k) && !exists(&mut con, &format!("{k}:ret")));
    }
}
