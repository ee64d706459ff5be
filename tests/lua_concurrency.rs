//! The concurrency kind of `lua/ratelimit.lua` (lua/concurrency.lua) and the
//! two scripts around it, the renewal (lua/concurrency_renew.lua) and the
//! release (lua/concurrency_release.lua), against a real redis-server:
//! exactly `max` slots, costs that take several slots or can never fit, a
//! release and a renewal that touch exactly one request's slots, leases that
//! end, clocks that step back, expiry, memory per key, all-or-nothing with
//! every other kind and the idempotency key, malformed calls, batches and
//! racing calls.
//!
//! Where exact time matters, the scripts run with a test clock
//! (`support::script::RATELIMIT_AT`, `BATCH_AT` and `CC_RENEW_AT`: the
//! production source with its TIME preamble replaced by a read of a clock
//! key; the release reads no clock), so every lease end is an exact number
//! and nothing sleeps. Keys still expire on Redis' real clock: every lease
//! under the test clock is a minute or more, far above a test's run time.
//! Elsewhere (expiry on Redis' own clock, EVALSHA, races) the real scripts
//! run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::script::{
    self, admits, at, batch_at, cc, complete, fw, gcra, idem, one, rejects, sw, swc, tb, Decision,
    Held, Limit, Reply, Verdict, CC_RENEW_AT, HOUR, MINUTE, SECOND, T0,
};
use support::{
    assert_expires_in, assert_within, key_exists as exists, key_pttl as pttl, pexpiretime,
    redis_now_ms as now_ms, wait_until,
};

use std::collections::BTreeSet;

use redis::Connection;
use redis_guard::scripts::{Script, CC_RELEASE, RATELIMIT};

// ---------------------------------------------------------------------------
// Calling the scripts at a test-clock instant

/// A concurrency limit's admitting verdict: capacity comes back when
/// requests end, not with time, so its reset is always 0.
fn cc_admits(remaining: i64) -> Verdict {
    admits(remaining, 0)
}

/// A concurrency limit's rejection: retry 1 s (CC_RETRY_MS, the shortest
/// Retry-After), reset 0.
fn cc_rejects(remaining: i64) -> Verdict {
    Verdict {
        allowed: false,
        remaining,
        retry_ms: SECOND,
        reset_ms: 0,
    }
}

/// The slots `limits` hold, as the renewal and the release name them.
fn held(limits: &[Limit]) -> Vec<Held> {
    limits.iter().map(Limit::held).collect()
}

/// The renewal at test-clock instant `now`: 1 or 0 per key.
fn renew(con: &mut Connection, now: i64, slot: &str, limits: &[Limit]) -> Vec<i64> {
    script::cc_renew_at(con, now, slot, &held(limits))
}

/// The release: how many of the keys held the slot.
fn release(con: &mut Connection, slot: &str, limits: &[Limit]) -> i64 {
    script::cc_release(con, slot, &held(limits))
}

// ---------------------------------------------------------------------------
// Reading state directly

/// The sorted set's members with their scores (lease ends), in ZRANGE
/// order: by score, then by name.
fn slots(con: &mut Connection, key: &str) -> Vec<(String, i64)> {
    support::zset_scores(con, key)
}

/// `slots` expected: each member with its lease end.
fn ends(members: &[(&str, i64)]) -> Vec<(String, i64)> {
    members.iter().map(|(m, s)| (m.to_string(), *s)).collect()
}

/// Every member and score, and the absolute expiry: equal before and after
/// a call means the call wrote nothing (not even a PEXPIRE).
fn state(con: &mut Connection, key: &str) -> (Vec<(String, i64)>, i64) {
    (slots(con, key), pexpiretime(con, key))
}

fn zscore(con: &mut Connection, key: &str, member: &str) -> Option<i64> {
    redis::cmd("ZSCORE")
        .arg(key)
        .arg(member)
        .query(con)
        .unwrap()
}

fn zcard(con: &mut Connection, key: &str) -> i64 {
    redis::cmd("ZCARD").arg(key).query(con).unwrap()
}

/// The serialized value of `key` (DUMP), or None.
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

// ---------------------------------------------------------------------------
// At most max slots

#[test]
fn concurrency_admits_exactly_max_slots_then_rejects_with_a_one_second_retry_and_writes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{k}:cc:max";
    let c = |slot: &str| cc(key, 3, MINUTE, slot);
    // Three requests, a second apart: the free slots count down exactly.
    assert_eq!(one(&mut con, T0, &c("a1")), cc_admits(2));
    assert_eq!(one(&mut con, T0 + SECOND, &c("a2")), cc_admits(1));
    assert_eq!(one(&mut con, T0 + 2 * SECOND, &c("a3")), cc_admits(0));
    // One member per request, scored by the end of its lease.
    assert_eq!(
        slots(&mut con, key),
        ends(&[
            ("a1", T0 + MINUTE),
            ("a2", T0 + SECOND + MINUTE),
            ("a3", T0 + 2 * SECOND + MINUTE)
        ])
    );
    let before = state(&mut con, key);
    assert_eq!(one(&mut con, T0 + 2 * SECOND, &c("a4")), cc_rejects(0));
    // Time brings nothing back while the leases run: only a release or a
    // lease's end does.
    assert_eq!(one(&mut con, T0 + MINUTE - 1, &c("a4")), cc_rejects(0));
    assert_eq!(state(&mut con, key), before, "rejections write nothing");
    // A max lowered below the slots held (the key is named by "cc" alone,
    // so it outlives a change of max): remaining 0, never negative.
    assert_eq!(
        one(&mut con, T0 + 2 * SECOND, &cc(key, 2, MINUTE, "a4")),
        cc_rejects(0)
    );
    // And one raised above them: exactly the difference is free.
    assert_eq!(
        one(&mut con, T0 + 2 * SECOND, &cc(key, 5, MINUTE, "a4")),
        cc_admits(1)
    );
    assert_eq!(zcard(&mut con, key), 4);
}

#[test]
fn concurrency_cost_k_takes_k_members_and_a_cost_that_does_not_fit_or_exceeds_max_writes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{k}:cc:cost";
    let c = |slot: &str, cost: i64| cc(key, 5, MINUTE, slot).cost(cost);
    assert_eq!(one(&mut con, T0, &c("b", 3)), cc_admits(2));
    let end = T0 + MINUTE;
    assert_eq!(
        slots(&mut con, key),
        ends(&[("b:1", end), ("b:2", end), ("b:3", end)])
    );
    let before = state(&mut con, key);
    // Two free: a cost of 3 does not fit, one above max never will; both
    // report what is free.
    assert_eq!(one(&mut con, T0, &c("c", 3)), cc_rejects(2));
    assert_eq!(one(&mut con, T0, &c("c", 6)), cc_rejects(2));
    assert_eq!(state(&mut con, key), before, "rejections write nothing");
    // Exactly what is free.
    assert_eq!(one(&mut con, T0, &c("c", 2)), cc_admits(0));
    assert_eq!(
        slots(&mut con, key),
        ends(&[
            ("b:1", end),
            ("b:2", end),
            ("b:3", end),
            ("c:1", end),
            ("c:2", end)
        ])
    );

    // A fresh key: a cost above max creates nothing; exactly max fits.
    let fresh = |cost: i64| cc("t:{k}:cc:cost-fresh", 5, MINUTE, "d").cost(cost);
    assert_eq!(one(&mut con, T0, &fresh(6)), cc_rejects(5));
    assert!(!exists(&mut con, "t:{k}:cc:cost-fresh"));
    assert_eq!(one(&mut con, T0, &fresh(5)), cc_admits(0));
    assert_eq!(zcard(&mut con, "t:{k}:cc:cost-fresh"), 5);

    // The largest cost the config allows: 1000 members in one charge (the
    // script adds them in chunks), renewed and released whole.
    let big = cc("t:{k}:cc:cost-big", 1000, MINUTE, "e").cost(1000);
    assert_eq!(one(&mut con, T0, &big), cc_admits(0));
    let members = slots(&mut con, &big.key);
    let names: BTreeSet<String> = members.iter().map(|(m, _)| m.clone()).collect();
    let want: BTreeSet<String> = (1..=1000).map(|j| format!("e:{j}")).collect();
    assert_eq!(names, want);
    assert!(
        members.iter().all(|(_, s)| *s == end),
        "one lease end for all"
    );
    assert_eq!(
        renew(&mut con, T0 + SECOND, "e", std::slice::from_ref(&big)),
        [1]
    );
    assert!(slots(&mut con, &big.key)
        .iter()
        .all(|(_, s)| *s == end + SECOND));
    assert_eq!(release(&mut con, "e", std::slice::from_ref(&big)), 1);
    assert!(!exists(&mut con, &big.key), "every member removed");
}

// ---------------------------------------------------------------------------
// Release

#[test]
fn a_release_frees_exactly_its_requests_slots_in_every_key_that_held_them() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let (k1, k2) = ("t:{k}:cc:rel1", "t:{k}:cc:rel2");
    // One request in two concurrency limits (cost 1 and 2), beside two
    // others whose ids share a prefix with its id.
    let req = |slot: &str, cost2: i64| {
        vec![
            cc(k1, 5, MINUTE, slot),
            cc(k2, 5, 2 * MINUTE, slot).cost(cost2),
        ]
    };
    let mine = req("a1", 2);
    assert_eq!(
        at(&mut con, T0, &req("a", 1)).limits,
        [cc_admits(4), cc_admits(4)]
    );
    assert_eq!(at(&mut con, T0, &mine).limits, [cc_admits(3), cc_admits(2)]);
    assert_eq!(
        at(&mut con, T0, &req("a10", 2)).limits,
        [cc_admits(2), cc_admits(0)]
    );
    assert!(
        !at(&mut con, T0 + SECOND, &req("b1", 1)).admitted,
        "k2 full"
    );

    assert_eq!(release(&mut con, "a1", &mine), 2);
    let (e1, e2) = (T0 + MINUTE, T0 + 2 * MINUTE);
    assert_eq!(slots(&mut con, k1), ends(&[("a", e1), ("a10", e1)]));
    assert_eq!(
        slots(&mut con, k2),
        ends(&[("a", e2), ("a10:1", e2), ("a10:2", e2)])
    );

    // Released twice, or never taken: nothing held, nothing removed.
    let before = (state(&mut con, k1), state(&mut con, k2));
    assert_eq!(release(&mut con, "a1", &mine), 0);
    assert_eq!(release(&mut con, "ff", &req("ff", 2)), 0);
    // A key that does not exist is not created.
    let none = cc("t:{k}:cc:rel-none", 5, MINUTE, "a1");
    assert_eq!(release(&mut con, "a1", std::slice::from_ref(&none)), 0);
    assert!(!exists(&mut con, &none.key));
    assert_eq!((state(&mut con, k1), state(&mut con, k2)), before);

    // What was released is free again: exactly its cost in k2.
    assert_eq!(
        at(&mut con, T0 + SECOND, &req("b1", 2)).limits,
        [cc_admits(2), cc_admits(0)]
    );
    // Held in one key of two: counted once.
    assert_eq!(
        release(&mut con, "a10", &[cc(k1, 5, MINUTE, "a10"), none.clone()]),
        1
    );
    assert_eq!(
        slots(&mut con, k1),
        ends(&[("a", e1), ("b1", T0 + SECOND + MINUTE)])
    );
}

#[test]
fn one_release_call_gives_back_the_slots_of_several_requests_each_its_own() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let (k1, k2) = ("t:{k}:cc:many1", "t:{k}:cc:many2");
    for slot in ["a", "b", "c"] {
        assert!(at(&mut con, T0, &[cc(k1, 5, MINUTE, slot)]).admitted);
    }
    assert!(at(&mut con, T0, &[cc(k2, 5, MINUTE, "b").cost(2)]).admitted);
    // As a worker joins the releases of streams that ended together: a
    // slot id and a cost per key, a key once per request; "d" never held one.
    let released: i64 = redis::cmd("EVAL")
        .arg(&CC_RELEASE.source)
        .arg(4)
        .arg(k1)
        .arg(k2)
        .arg(k1)
        .arg(k1)
        .arg("a")
        .arg(1)
        .arg("b")
        .arg(2)
        .arg("b")
        .arg(1)
        .arg("d")
        .arg(1)
        .query(&mut con)
        .unwrap();
    assert_eq!(released, 3);
    assert_eq!(slots(&mut con, k1), ends(&[("c", T0 + MINUTE)]));
    assert!(!exists(&mut con, k2), "its last slot gone, the set is gone");
}

// ---------------------------------------------------------------------------
// Renewal

#[test]
fn a_renewal_moves_the_lease_end_of_a_held_slot_to_now_plus_the_lease() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let (k1, k2) = ("t:{k}:cc:renew1", "t:{k}:cc:renew2");
    let mine = [cc(k1, 5, MINUTE, "a1").cost(2), cc(k2, 5, 2 * MINUTE, "a1")];
    assert!(at(&mut con, T0, &mine).admitted);
    assert_eq!(
        one(&mut con, T0 + SECOND, &cc(k1, 5, MINUTE, "b1")),
        cc_admits(2)
    );

    let now = T0 + 30 * SECOND;
    let t0 = now_ms(&mut con);
    assert_eq!(renew(&mut con, now, "a1", &mine), [1, 1]);
    // Every member of the slot, in each key with its own lease; the other
    // request's slot untouched.
    assert_eq!(
        slots(&mut con, k1),
        ends(&[
            ("b1", T0 + SECOND + MINUTE),
            ("a1:1", now + MINUTE),
            ("a1:2", now + MINUTE)
        ])
    );
    assert_eq!(slots(&mut con, k2), ends(&[("a1", now + 2 * MINUTE)]));
    // The keys live as long as the renewed leases, 2 ms more.
    assert_expires_in(&mut con, k1, MINUTE + 2, t0);
    assert_expires_in(&mut con, k2, 2 * MINUTE + 2, t0);

    // The last ms of the renewed lease: still held, renewed again.
    let last = now + MINUTE - 1;
    assert_eq!(renew(&mut con, last, "a1", &mine[..1]), [1]);
    assert_eq!(zscore(&mut con, k1, "a1:2"), Some(last + MINUTE));
    // Meanwhile b1's lease ended: only the renewed slot counts.
    assert_eq!(
        one(&mut con, last, &cc(k1, 5, MINUTE, "c1").cost(3)),
        cc_admits(0)
    );
}

#[test]
fn a_renewal_of_a_slot_whose_lease_ended_or_that_is_gone_returns_zero_and_writes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{k}:cc:gone";
    let c = |slot: &str| cc(key, 3, MINUTE, slot);
    assert_eq!(one(&mut con, T0, &c("a1")), cc_admits(2));
    assert_eq!(one(&mut con, T0 + SECOND, &c("a2")), cc_admits(1));
    let before = state(&mut con, key);
    // a1's lease ends at T0 + MINUTE: from that ms on it is gone, though
    // still in the set. Re-adding it could exceed the limit.
    assert_eq!(renew(&mut con, T0 + MINUTE, "a1", &[c("a1")]), [0]);
    assert_eq!(renew(&mut con, T0 + HOUR, "a1", &[c("a1")]), [0]);
    // A slot never taken, and a key that does not exist.
    assert_eq!(renew(&mut con, T0, "ff", &[c("ff")]), [0]);
    let none = cc("t:{k}:cc:gone-none", 3, MINUTE, "a1");
    assert_eq!(renew(&mut con, T0, "a1", std::slice::from_ref(&none)), [0]);
    assert!(!exists(&mut con, &none.key));
    assert_eq!(state(&mut con, key), before, "nothing written");

    // Pruned by the next charge: a renewal does not bring it back.
    assert_eq!(one(&mut con, T0 + MINUTE, &c("a3")), cc_admits(1));
    assert_eq!(zscore(&mut con, key, "a1"), None);
    assert_eq!(renew(&mut con, T0 + MINUTE, "a1", &[c("a1")]), [0]);
    assert_eq!(zscore(&mut con, key, "a1"), None, "not re-added");
    // Released: gone too.
    assert_eq!(release(&mut con, "a2", &[c("a2")]), 1);
    assert_eq!(renew(&mut con, T0 + MINUTE, "a2", &[c("a2")]), [0]);
    assert_eq!(zscore(&mut con, key, "a2"), None, "not re-added");
    // Held in one key of two: renewed there only.
    let before_none = dump(&mut con, &none.key);
    let now = T0 + MINUTE + SECOND;
    assert_eq!(renew(&mut con, now, "a3", &[none.clone(), c("a3")]), [0, 1]);
    assert_eq!(slots(&mut con, key), ends(&[("a3", now + MINUTE)]));
    assert_eq!(dump(&mut con, &none.key), before_none);
}

// ---------------------------------------------------------------------------
// Leases that end, clocks that step back

#[test]
fn a_slot_whose_lease_ended_is_not_counted_and_the_next_charge_prunes_it() {
    // An Envoy that died holds its slots until their leases end.
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{k}:cc:lease";
    let c = |slot: &str| cc(key, 2, MINUTE, slot);
    assert_eq!(one(&mut con, T0, &c("a1")), cc_admits(1));
    assert_eq!(one(&mut con, T0 + 10 * SECOND, &c("a2")), cc_admits(0));
    // A ms before a1's lease ends it still holds its slot.
    assert_eq!(one(&mut con, T0 + MINUTE - 1, &c("a3")), cc_rejects(0));
    // At its end it is free; a rejection there prunes nothing.
    let before = state(&mut con, key);
    assert_eq!(one(&mut con, T0 + MINUTE, &c("a3").cost(2)), cc_rejects(1));
    assert_eq!(state(&mut con, key), before, "rejections write nothing");
    // The next charge takes the freed slot and prunes the dead member.
    assert_eq!(one(&mut con, T0 + MINUTE, &c("a3")), cc_admits(0));
    assert_eq!(
        slots(&mut con, key),
        ends(&[("a2", T0 + 70 * SECOND), ("a3", T0 + 2 * MINUTE)])
    );
    // Once every lease ended the whole limit is free again at once.
    assert_eq!(
        one(&mut con, T0 + 2 * MINUTE, &c("a4").cost(2)),
        cc_admits(0)
    );
    assert_eq!(
        slots(&mut con, key),
        ends(&[("a4:1", T0 + 3 * MINUTE), ("a4:2", T0 + 3 * MINUTE)])
    );
}

#[test]
fn slots_taken_ahead_of_a_stepped_back_clock_stay_held_and_nothing_is_over_admitted() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{k}:cc:back";
    let c = |slot: &str| cc(key, 3, MINUTE, slot);
    let later = T0 + 30 * SECOND;
    assert_eq!(one(&mut con, later, &c("a1")), cc_admits(2));
    assert_eq!(one(&mut con, later, &c("a2")), cc_admits(1));
    // The clock steps back 30 s: a1 and a2 look 30 s longer, and count.
    assert_eq!(one(&mut con, T0, &c("a3")), cc_admits(0));
    assert_eq!(one(&mut con, T0, &c("a4")), cc_rejects(0));
    assert_eq!(one(&mut con, T0 - HOUR, &c("a4")), cc_rejects(0));
    // a3's lease, taken on the stepped-back clock, ends first ...
    assert_eq!(one(&mut con, T0 + MINUTE - 1, &c("a4")), cc_rejects(0));
    assert_eq!(one(&mut con, T0 + MINUTE, &c("a4")), cc_admits(0));
    assert_eq!(
        slots(&mut con, key),
        ends(&[
            ("a1", later + MINUTE),
            ("a2", later + MINUTE),
            ("a4", T0 + 2 * MINUTE)
        ])
    );
    // A renewal on the stepped-back clock ends a2's lease `lease` from
    // that clock's now (as the renewal's header says), still held.
    assert_eq!(renew(&mut con, T0 + MINUTE, "a2", &[c("a2")]), [1]);
    assert_eq!(zscore(&mut con, key, "a2"), Some(T0 + 2 * MINUTE));
    assert_eq!(one(&mut con, T0 + MINUTE, &c("a5")), cc_rejects(0));
    // a1 only when its own lease ends, a2 and a4 when theirs do.
    assert_eq!(one(&mut con, later + MINUTE - 1, &c("a5")), cc_rejects(0));
    assert_eq!(one(&mut con, later + MINUTE, &c("a5")), cc_admits(0));
    assert_eq!(one(&mut con, T0 + 2 * MINUTE - 1, &c("a6")), cc_rejects(0));
    assert_eq!(
        one(&mut con, T0 + 2 * MINUTE, &c("a6").cost(2)),
        cc_admits(0)
    );
    assert_eq!(
        slots(&mut con, key),
        ends(&[
            ("a5", later + 2 * MINUTE),
            ("a6:1", T0 + 3 * MINUTE),
            ("a6:2", T0 + 3 * MINUTE)
        ])
    );
}

// ---------------------------------------------------------------------------
// Expiry

#[test]
fn the_keys_expiry_is_the_lease_plus_two_ms_and_only_ever_pushed_later() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{k}:cc:ttl";
    let t0 = now_ms(&mut con);
    assert_eq!(
        one(&mut con, T0 + 30 * SECOND, &cc(key, 5, 10 * MINUTE, "a1")),
        cc_admits(4)
    );
    assert_expires_in(&mut con, key, 10 * MINUTE + 2, t0);
    let end = pexpiretime(&mut con, key);
    // A charge on a stepped-back clock with a shorter lease (a lowered
    // leaseMs keeps the key, which is named by "cc" alone): a1 still holds
    // its slot for 10 minutes, so the key must not end sooner.
    let short = cc(key, 5, MINUTE, "a2");
    assert_eq!(one(&mut con, T0, &short), cc_admits(3));
    assert_eq!(pexpiretime(&mut con, key), end, "charge shortened the TTL");
    // Nor a renewal with the shorter lease.
    assert_eq!(renew(&mut con, T0, "a2", std::slice::from_ref(&short)), [1]);
    assert_eq!(pexpiretime(&mut con, key), end, "renewal shortened the TTL");
    // A longer lease pushes it out, by a charge or by a renewal.
    let t0 = now_ms(&mut con);
    assert_eq!(
        one(&mut con, T0, &cc(key, 5, 20 * MINUTE, "a3")),
        cc_admits(2)
    );
    assert_expires_in(&mut con, key, 20 * MINUTE + 2, t0);
    let t0 = now_ms(&mut con);
    assert_eq!(
        renew(&mut con, T0, "a1", &[cc(key, 5, 30 * MINUTE, "a1")]),
        [1]
    );
    assert_expires_in(&mut con, key, 30 * MINUTE + 2, t0);
}

#[test]
fn a_concurrency_key_expires_two_ms_after_its_newest_lease_on_redis_own_clock() {
    // The real scripts: lease ends and TTLs from Redis TIME, bounded by
    // TIME read around each call. A lease of 1 s (the config's least is
    // 300 ms; the renewal below must land within the lease on a loaded
    // machine too).
    let (_redis, mut con) = support::Redis::start_with_conn();
    let lease = 1000;
    let c = cc("t:{k}:cc:real", 2, lease, "a1");
    let key = c.key.clone();
    let t0 = now_ms(&mut con);
    let reply = script::request(&mut con, std::slice::from_ref(&c), None);
    let t1 = now_ms(&mut con);
    assert_eq!(reply, Reply::admitted(vec![cc_admits(1)]));
    assert_expires_in(&mut con, &key, lease + 2, t0);
    let score = zscore(&mut con, &key, "a1").unwrap();
    assert_within("lease end", score, t0 + lease, t1 + lease);

    // Renewed 100 ms later: the lease and the key run from then.
    wait_until(&mut con, t0 + 100);
    let t2 = now_ms(&mut con);
    assert_eq!(script::cc_renew(&mut con, "a1", &[c.held()]), [1]);
    let t3 = now_ms(&mut con);
    assert_expires_in(&mut con, &key, lease + 2, t2);
    let score = zscore(&mut con, &key, "a1").unwrap();
    assert_within("renewed lease end", score, t2 + lease, t3 + lease);
    // The key never vanishes before its newest lease ends (Redis may count
    // a PEXPIRE inside a script from a ms before the script's TIME).
    let gone_at = pexpiretime(&mut con, &key);
    assert!(gone_at > score, "key gone at {gone_at}, lease ends {score}");

    // Gone once it expires: every slot free, nothing left to renew.
    wait_until(&mut con, gone_at + 1);
    assert!(!exists(&mut con, &key));
    assert_eq!(script::cc_renew(&mut con, "a1", &[c.held()]), [0]);
    assert!(!exists(&mut con, &key), "a renewal re-created the key");
    assert_eq!(pttl(&mut con, &key), -2);
}

// ---------------------------------------------------------------------------
// Memory

#[test]
fn a_concurrency_key_costs_well_under_a_hundred_bytes_per_slot() {
    // MEMORY USAGE of a key as the filter names it (prefix, hash tag, limit
    // name, signature "cc", descriptor) with slot ids as the filter makes
    // them (16 hex digits), and lease ends of today's magnitude.
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = |n: usize| format!("rg:rl:{{9f86d081884c7d65}}:in-flight-{n}:cc:5:alice");
    let now = now_ms(&mut con);
    let mut report = Vec::new();
    let mut per_slot = Vec::new();
    for n in [1usize, 10, 100, 200] {
        for i in 0..n {
            let slot = format!(
                "{:016x}",
                0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 1)
            );
            let v = one(&mut con, now, &cc(&key(n), 1000, HOUR, &slot));
            assert!(v.allowed, "slot {i} of {n}");
        }
        assert_eq!(zcard(&mut con, &key(n)), n as i64);
        let bytes = memory_usage(&mut con, &key(n));
        let encoding: String = redis::cmd("OBJECT")
            .arg("ENCODING")
            .arg(key(n))
            .query(&mut con)
            .unwrap();
        report.push(format!(
            "{n} slots: {bytes} bytes ({} per slot, {encoding})",
            bytes / n as i64
        ));
        per_slot.push((n, bytes, encoding));
    }
    eprintln!(
        "MEMORY USAGE of a concurrency key ({} byte key name, 16-digit slot ids):\n  {}",
        key(1).len(),
        report.join("\n  ")
    );
    for (n, bytes, encoding) in per_slot {
        // Measured with Redis 7.0 and jemalloc: 152, 424 and 3176 bytes for
        // 1, 10 and 100 slots, one listpack (a slot costs its id and its
        // score, some 31 bytes); 24752 for 200, past the 128 members
        // (zset-max-listpack-entries) where Redis turns the set into a
        // skiplist and a hash table, some 120 bytes a slot. The bounds leave
        // about twice that.
        let n = n as i64;
        let bound = if n <= 128 { 64 * n + 128 } else { 160 * n };
        assert!(
            bytes <= bound,
            "{n} slots ({encoding}): {bytes} bytes, bound {bound}"
        );
    }
}

// ---------------------------------------------------------------------------
// All or nothing, shadow limits, the idempotency key

/// One limit of every other kind under `ns`, each 3 units a minute (the
/// GCRA: a burst of 3, one unit back every 20 s; the token bucket the same).
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
fn a_concurrency_limit_takes_no_slot_when_any_other_kind_rejects() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let now = T0 + 10 * SECOND;
    // What each kind says at T0 + 10 s, spent at T0 + 10 s.
    let rejecting = [
        // One token back 20 s after the charge.
        rejects(0, 20 * SECOND),
        // The members leave at T0 + 70 s.
        rejects(0, MINUTE),
        rejects(0, 20 * SECOND),
        // The window ends at T0 + 60 s.
        rejects(0, 50 * SECOND),
        // Then 1 ms into the next window until 3 weigh 2.
        rejects(0, 50 * SECOND + 1),
    ];
    for (r, other) in one_of_each("o:{a}").into_iter().enumerate() {
        assert!(one(&mut con, now, &other.clone().cost(3)).allowed);
        let before_other = dump(&mut con, &other.key);
        // One slot of two held by another request.
        let key = format!("o:{{a}}:cc{r}");
        assert_eq!(one(&mut con, now, &cc(&key, 2, MINUTE, "a1")), cc_admits(1));
        let before = state(&mut con, &key);
        for mine in [
            cc(&key, 2, MINUTE, "b1"),
            cc(&key, 2, MINUTE, "b1").shadow(),
        ] {
            let d = at(&mut con, now, &[mine.clone(), other.clone()]);
            // The slot reported as it stands: one free.
            assert_eq!(
                d,
                Decision {
                    admitted: false,
                    limits: vec![cc_admits(1), rejecting[r]]
                },
                "{}",
                other.alg
            );
            assert_eq!(state(&mut con, &key), before, "{}: slot taken", other.alg);
        }
        // A fresh key is not even created.
        let fresh = cc(&format!("o:{{a}}:fresh{r}"), 2, MINUTE, "b1");
        let d = at(&mut con, now, &[other.clone(), fresh.clone()]);
        assert_eq!(d.limits, [rejecting[r], cc_admits(2)], "{}", other.alg);
        assert!(!exists(&mut con, &fresh.key), "{}", other.alg);
        assert_eq!(dump(&mut con, &other.key), before_other, "{}", other.alg);
    }
}

#[test]
fn a_rejecting_concurrency_limit_charges_no_other_kind_and_takes_no_lock() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let now = T0 + 10 * SECOND;
    let key = "n:{a}:cc";
    assert_eq!(one(&mut con, now, &cc(key, 1, MINUTE, "a1")), cc_admits(0));
    let before = state(&mut con, key);
    let others = one_of_each("n:{a}");
    let record = idem("n:{a}:idem", "owner-1", "fp-1", MINUTE);
    // In first, middle and last place among the others.
    for place in [0, 3, 5] {
        let mut limits = others.clone();
        limits.insert(place, cc(key, 1, MINUTE, "b1"));
        let reply = script::request_at(&mut con, now, &limits, Some(&record));
        // Every other kind fresh: whole, nothing to restore.
        let mut want = vec![admits(3, 0); 5];
        want.insert(place, cc_rejects(0));
        assert_eq!(reply, Reply::rate_limited(want), "cc in place {place}");
        for l in &others {
            assert!(!exists(&mut con, &l.key), "{} charged", l.key);
        }
        assert!(!exists(&mut con, &record.key), "lock taken");
        assert_eq!(state(&mut con, key), before);
    }
}

#[test]
fn a_concurrency_limit_takes_no_slot_when_the_idempotency_key_answers_first() {
    // Busy, completed and mismatched keys are answered before any limit is
    // looked at: no slot taken, so nothing to release.
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "i:{a}:cc";
    let c = |slot: &str| cc(key, 5, MINUTE, slot);
    let rec = |owner: &str, fp: &str| idem("i:{a}:idem", owner, fp, MINUTE);
    assert_eq!(
        script::request_at(&mut con, T0, &[c("a1")], Some(&rec("owner-1", "fp-1"))),
        Reply::admitted(vec![cc_admits(4)])
    );
    let before = state(&mut con, key);
    let busy = script::request_at(&mut con, T0, &[c("b1")], Some(&rec("owner-2", "fp-1")));
    assert!(
        matches!(busy, Reply::Busy(ms) if ms > 0 && ms <= MINUTE),
        "{busy:?}"
    );
    assert_eq!(
        script::request_at(&mut con, T0, &[c("b2")], Some(&rec("owner-3", "fp-2"))),
        Reply::Mismatch
    );
    assert_eq!(state(&mut con, key), before);
    assert_eq!(
        complete(&mut con, "i:{a}:idem", "owner-1", 201, b"", b"done", MINUTE),
        1
    );
    assert_eq!(
        script::request_at(&mut con, T0, &[c("b3")], Some(&rec("owner-4", "fp-1"))),
        Reply::Completed {
            status: 201,
            headers: b"".to_vec(),
            body: b"done".to_vec()
        }
    );
    assert_eq!(state(&mut con, key), before);
}

#[test]
fn a_shadow_concurrency_limit_that_would_reject_admits_and_takes_no_slot() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let now = T0 + 10 * SECOND;
    let key = "s:{a}:cc";
    assert_eq!(one(&mut con, now, &cc(key, 1, MINUTE, "a1")), cc_admits(0));
    let before = state(&mut con, key);
    let others = one_of_each("s:{a}");
    let mut limits = vec![cc(key, 1, MINUTE, "b1").shadow()];
    limits.extend(others.iter().cloned());
    let d = at(&mut con, now, &limits);
    assert_eq!(
        d,
        Decision {
            admitted: true,
            limits: vec![
                cc_rejects(0),
                admits(2, 20 * SECOND),
                admits(2, MINUTE),
                admits(2, 20 * SECOND),
                admits(2, 50 * SECOND),
                admits(2, 50 * SECOND + 1),
            ]
        }
    );
    assert_eq!(state(&mut con, key), before, "shadow rejection took a slot");
    for l in &others {
        assert!(exists(&mut con, &l.key), "{} not charged", l.key);
    }
}

#[test]
fn a_shadow_concurrency_limit_that_admits_takes_its_slot() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let now = T0 + 10 * SECOND;
    let key = "s:{b}:cc";
    let shadow = cc(key, 2, MINUTE, "b1").shadow();
    assert_eq!(
        at(&mut con, now, std::slice::from_ref(&shadow)),
        Decision {
            admitted: true,
            limits: vec![cc_admits(1)]
        }
    );
    assert_eq!(slots(&mut con, key), ends(&[("b1", now + MINUTE)]));
    // Beside enforced limits of every kind too, all charged.
    let mut limits = one_of_each("s:{b}");
    limits.push(cc(key, 2, MINUTE, "b2").cost(1).shadow());
    let d = at(&mut con, now, &limits);
    assert!(d.admitted, "{d:?}");
    assert_eq!(d.limits[5], cc_admits(0));
    assert_eq!(
        slots(&mut con, key),
        ends(&[("b1", now + MINUTE), ("b2", now + MINUTE)])
    );
}

#[test]
fn a_request_admitted_by_every_kind_charges_each_and_every_key_it_writes_expires() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let now = T0 + 10 * SECOND;
    let mut limits = one_of_each("e:{a}");
    limits.push(cc("e:{a}:cc", 3, MINUTE, "a1").cost(2));
    let record = idem("e:{a}:idem", "owner-1", "fp-1", MINUTE);
    let t0 = now_ms(&mut con);
    let reply = script::request_at(&mut con, now, &limits, Some(&record));
    assert_eq!(
        reply,
        Reply::admitted(vec![
            admits(2, 20 * SECOND),
            admits(2, MINUTE),
            admits(2, 20 * SECOND),
            admits(2, 50 * SECOND),
            admits(2, 50 * SECOND + 1),
            cc_admits(1),
        ])
    );
    assert_eq!(
        slots(&mut con, "e:{a}:cc"),
        ends(&[("a1:1", now + MINUTE), ("a1:2", now + MINUTE)])
    );
    assert_expires_in(&mut con, "e:{a}:cc", MINUTE + 2, t0);
    assert_expires_in(&mut con, &record.key, MINUTE, t0);
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("e:*").query(&mut con).unwrap();
    keys.sort();
    assert_eq!(keys.len(), 7, "{keys:?}");
    for k in &keys {
        let ttl = pttl(&mut con, k);
        assert!(ttl > 0 && ttl <= MINUTE + 2, "{k} PTTL {ttl}");
    }
}

// ---------------------------------------------------------------------------
// Contract errors

/// The error reply of a hand-made call of `script`.
fn error_of(con: &mut Connection, script: &Script, keys: &[&str], argv: &[&str]) -> String {
    script::set_clock(con, T0 + 10 * SECOND);
    match script::eval_raw(con, script, keys, argv) {
        Ok(v) => panic!("{argv:?} answered {v:?}, not an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_bad_slot_id_or_numbers_out_of_range_are_an_error_and_write_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let k = "t:{k}:cc:err";
    let long = "a".repeat(33);
    let slot_cases = [
        ("a ':' in the slot", "a1:1"),
        ("upper case", "A1"),
        ("33 digits", long.as_str()),
        ("empty", ""),
        ("not hex", "g1"),
        ("a space", "a1 "),
    ];
    for (what, slot) in slot_cases {
        let argv = ["1", "cc", "5", "60000", slot, "1", "1"];
        let err = error_of(&mut con, &script::RATELIMIT_AT, &[k], &argv);
        assert!(err.contains("limit 1 needs a slot id"), "{what}: {err}");
        assert!(!exists(&mut con, k), "{what}: wrote {k}");
    }
    let number_cases: [(&str, [&str; 6]); 12] = [
        ("max 0", ["cc", "0", "60000", "a1", "1", "1"]),
        ("max above 2^20", ["cc", "1048577", "60000", "a1", "1", "1"]),
        ("negative max", ["cc", "-5", "60000", "a1", "1", "1"]),
        ("fractional max", ["cc", "5.5", "60000", "a1", "1", "1"]),
        ("lease 0", ["cc", "5", "0", "a1", "1", "1"]),
        (
            "lease above 2^32",
            ["cc", "5", "4294967297", "a1", "1", "1"],
        ),
        ("fractional lease", ["cc", "5", "1.5", "a1", "1", "1"]),
        ("lease nan", ["cc", "5", "nan", "a1", "1", "1"]),
        ("lease inf", ["cc", "5", "inf", "a1", "1", "1"]),
        ("cost 0", ["cc", "5", "60000", "a1", "0", "1"]),
        ("cost 1001", ["cc", "1001", "60000", "a1", "1001", "1"]),
        ("fractional cost", ["cc", "5", "60000", "a1", "1.5", "1"]),
    ];
    for (what, limit) in number_cases {
        let argv: Vec<&str> = ["1"].iter().chain(&limit).copied().collect();
        let err = error_of(&mut con, &script::RATELIMIT_AT, &[k], &argv);
        assert!(
            err.contains("limit 1 has numbers out of range"),
            "{what}: {err}"
        );
        assert!(!exists(&mut con, k), "{what}: wrote {k}");
    }
    let err = error_of(
        &mut con,
        &script::RATELIMIT_AT,
        &[k],
        &["1", "cc", "x", "60000", "a1", "1", "1"],
    );
    assert!(err.contains("limit 1 needs numbers"), "{err}");
    // A bad concurrency limit after a valid one: neither is written.
    let tb_key = "t:{k}:cc:err-tb";
    let argv = [
        "2", "tb", "3", "1", "1000", "1", "1", "cc", "2", "60000", "A1", "1", "1",
    ];
    let err = error_of(&mut con, &script::RATELIMIT_AT, &[tb_key, k], &argv);
    assert!(err.contains("limit 2 needs a slot id"), "{err}");
    assert!(!exists(&mut con, tb_key) && !exists(&mut con, k));

    // The largest numbers the script allows pass: 2^20 slots, a lease of
    // 2^32 ms, a cost of 1000, a slot id of 32 digits.
    let slot = "0123456789abcdef0123456789abcdef";
    let big = cc(k, 1 << 20, 1 << 32, slot).cost(1000);
    assert_eq!(one(&mut con, T0, &big), cc_admits((1 << 20) - 1000));
    assert_eq!(
        zscore(&mut con, k, &format!("{slot}:1000")),
        Some(T0 + (1 << 32))
    );
    let ttl = pttl(&mut con, k);
    assert!(ttl > (1 << 32) - 1000 && ttl <= (1 << 32) + 2, "PTTL {ttl}");
}

#[test]
fn a_renewal_or_release_with_a_bad_slot_or_bad_numbers_is_an_error_and_writes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let (k1, k2) = ("t:{k}:cc:bad1", "t:{k}:cc:bad2");
    assert!(
        at(
            &mut con,
            T0,
            &[cc(k1, 5, MINUTE, "a1"), cc(k2, 5, MINUTE, "a1")]
        )
        .admitted
    );
    let before = (state(&mut con, k1), state(&mut con, k2));
    let long = "a".repeat(33);
    // Each at T0 + 10 s, where a renewal would move both lease ends.
    let renewals: Vec<(&str, Vec<&str>)> = vec![
        ("upper case slot", vec!["A1", "60000", "1", "60000", "1"]),
        (
            "a ':' in the slot",
            vec!["a1:1", "60000", "1", "60000", "1"],
        ),
        ("empty slot", vec!["", "60000", "1", "60000", "1"]),
        ("33-digit slot", vec![&long, "60000", "1", "60000", "1"]),
        ("one key's numbers missing", vec!["a1", "60000", "1"]),
        (
            "a value too many",
            vec!["a1", "60000", "1", "60000", "1", "1"],
        ),
        // The second key's numbers are bad: the first, valid, is not
        // renewed either.
        ("lease 0", vec!["a1", "60000", "1", "0", "1"]),
        (
            "lease above 2^32",
            vec!["a1", "60000", "1", "4294967297", "1"],
        ),
        ("fractional lease", vec!["a1", "60000", "1", "1.5", "1"]),
        ("lease not a number", vec!["a1", "60000", "1", "x", "1"]),
        ("lease nan", vec!["a1", "60000", "1", "nan", "1"]),
        ("cost 0", vec!["a1", "60000", "1", "60000", "0"]),
        ("cost 1001", vec!["a1", "60000", "1", "60000", "1001"]),
        ("fractional cost", vec!["a1", "60000", "1", "60000", "1.5"]),
    ];
    for (what, argv) in renewals {
        let err = error_of(&mut con, &CC_RENEW_AT, &[k1, k2], &argv);
        assert!(
            err.contains("redis-guard concurrency renew"),
            "renewal, {what}: {err}"
        );
        assert_eq!(
            (state(&mut con, k1), state(&mut con, k2)),
            before,
            "renewal, {what}: written"
        );
    }
    let releases: Vec<(&str, Vec<&str>)> = vec![
        // The first pair is well formed: the second's fault stops both.
        ("upper case slot", vec!["a1", "1", "A1", "1"]),
        ("a ':' in the slot", vec!["a1", "1", "a1:1", "1"]),
        ("empty slot", vec!["a1", "1", "", "1"]),
        ("33-digit slot", vec!["a1", "1", &long, "1"]),
        ("one key's cost missing", vec!["a1", "1", "a1"]),
        ("a value too many", vec!["a1", "1", "a1", "1", "1"]),
        ("cost 0", vec!["a1", "1", "a1", "0"]),
        ("cost 1001", vec!["a1", "1", "a1", "1001"]),
        ("fractional cost", vec!["a1", "1", "a1", "1.5"]),
        ("cost not a number", vec!["a1", "1", "a1", "x"]),
        ("cost nan", vec!["a1", "1", "a1", "nan"]),
    ];
    for (what, argv) in releases {
        let err = error_of(&mut con, &CC_RELEASE, &[k1, k2], &argv);
        assert!(
            err.contains("redis-guard concurrency release"),
            "release, {what}: {err}"
        );
        assert_eq!(
            (state(&mut con, k1), state(&mut con, k2)),
            before,
            "release, {what}: written"
        );
    }
    // The same calls, well formed, do write.
    assert_eq!(
        renew(
            &mut con,
            T0 + 10 * SECOND,
            "a1",
            &[cc(k1, 5, MINUTE, "a1"), cc(k2, 5, MINUTE, "a1")]
        ),
        [1, 1]
    );
    assert_eq!(
        release(
            &mut con,
            "a1",
            &[cc(k1, 5, MINUTE, "a1"), cc(k2, 5, MINUTE, "a1")]
        ),
        2
    );
}

// ---------------------------------------------------------------------------
// Batches, racing calls

#[test]
fn members_of_a_batch_see_each_others_slots_exactly() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let (k, k2, t) = ("b:{a}:cc", "b:{a}:cc2", "b:{a}:tb");
    let c = |slot: &str| cc(k, 2, MINUTE, slot);
    let c2 = |slot: &str, cost: i64| cc(k2, 3, MINUTE, slot).cost(cost);
    let bucket = || tb(t, 1, 1, MINUTE);
    let decisions = batch_at(
        &mut con,
        T0,
        &[
            vec![c("a1")],
            vec![c("a2"), bucket()],
            // Both slots taken by the members before it.
            vec![c("a3")],
            // The bucket is empty: no slot taken in k2 ...
            vec![c2("a4", 2), bucket()],
            // ... so all three are still there for this member.
            vec![c2("a5", 3)],
            // Shadow limits that would reject: admitted, nothing taken.
            vec![c2("a6", 1).shadow(), c("a6").shadow()],
        ],
    );
    let verdicts: Vec<(bool, Vec<Verdict>)> = decisions
        .into_iter()
        .map(|d| (d.admitted, d.limits))
        .collect();
    assert_eq!(
        verdicts,
        vec![
            (true, vec![cc_admits(1)]),
            (true, vec![cc_admits(0), admits(0, MINUTE)]),
            (false, vec![cc_rejects(0)]),
            (false, vec![cc_admits(3), rejects(0, MINUTE)]),
            (true, vec![cc_admits(0)]),
            (true, vec![cc_rejects(0), cc_rejects(0)]),
        ]
    );
    let end = T0 + MINUTE;
    assert_eq!(slots(&mut con, k), ends(&[("a1", end), ("a2", end)]));
    assert_eq!(
        slots(&mut con, k2),
        ends(&[("a5:1", end), ("a5:2", end), ("a5:3", end)])
    );
}

#[test]
fn concurrent_requests_hold_exactly_max_slots_and_a_release_frees_exactly_its_own() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    assert_eq!(script::load(&mut con, &RATELIMIT), RATELIMIT.sha1);
    let key = "r:{c}:cc";
    // The real script, by EVALSHA as the filter sends it; leases of an hour.
    let limit = |i: usize| cc(key, 100, HOUR, &format!("{:x}", i + 0x1000));
    let race = |from: usize| {
        redis.race(40, 300, |con, i| {
            let v = script::with_limits(script::evalsha(&RATELIMIT), &[limit(from + i)], None)
                .query(con)
                .unwrap_or_else(|e| panic!("a racing call failed: {e}"));
            script::parse(v).decision().admitted
        })
    };
    let admitted = race(0);
    let yes: Vec<usize> = (0..300).filter(|&i| admitted[i]).collect();
    assert_eq!((yes.len(), 300 - yes.len()), (100, 200));
    assert_eq!(zcard(&mut con, key), 100);
    // Half of them end, all at once, each releasing its own slot.
    let released = redis.race(10, 50, |con, j| {
        script::cc_release(
            con,
            &format!("{:x}", yes[j] + 0x1000),
            &[limit(yes[j]).held()],
        )
    });
    assert!(released.iter().all(|&n| n == 1), "{released:?}");
    let left: BTreeSet<String> = slots(&mut con, key).into_iter().map(|(m, _)| m).collect();
    let want: BTreeSet<String> = yes[50..]
        .iter()
        .map(|i| format!("{:x}", i + 0x1000))
        .collect();
    assert_eq!(left, want);
    // Exactly the 50 freed slots go to the next 300 racing requests.
    let again = race(300);
    assert_eq!(again.iter().filter(|a| **a).count(), 50);
    assert_eq!(zcard(&mut con, key), 100);
}
