//! A rolling upgrade to the one-string token bucket (lua/token_bucket.lua):
//! the filter before it kept a bucket as a hash (`c` credits, `t` ms) under
//! the signature `tb.`, this one as a string under `tb2.`. A bucket with no
//! string yet is read from the older filter's hash, so an upgrade does not
//! fill every spent bucket again (a day's quota would start over); the hash
//! is only read, never written. Against a real redis-server, at the test
//! clock (`support::script::RATELIMIT_AT`, `BATCH_AT`), so every figure is
//! exact.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use redis::{Connection, Value};
use support::script::{
    self, admits, at, rejects, tb, Decision, Limit, Verdict, BATCH_AT, HOUR, T0,
};
use support::{hash_fields, key_exists as exists, pexpiretime, read_bucket, write_bucket};

/// A limit's key as the filter names it, under an algorithm signature.
fn key(user: &str, signature: &str) -> String {
    format!("rg:rl:{{9f86d081884c7d65}}:per-user:{signature}:5:{user}")
}

/// The bucket of 10 tokens, one back a second, as this filter names it.
fn bucket(user: &str) -> Limit {
    tb(&key(user, "tb2.10.1.1000"), 10, 1, 1000)
}

/// Writes the older filter's hash of `user`'s bucket: `credits` as of
/// `t_ms` (one token is 1000 credits), expiring in an hour.
fn older_hash(con: &mut Connection, user: &str, credits: i64, t_ms: i64) -> String {
    let old = key(user, "tb.10.1.1000");
    redis::pipe()
        .cmd("HSET")
        .arg(&old)
        .arg("c")
        .arg(credits)
        .arg("t")
        .arg(t_ms)
        .cmd("PEXPIRE")
        .arg(&old)
        .arg(HOUR)
        .query::<()>(con)
        .unwrap();
    old
}

/// The hash's fields and the instant it expires: what a write would change.
fn hash_state(con: &mut Connection, key: &str) -> (Vec<(String, String)>, i64) {
    (hash_fields(con, key), pexpiretime(con, key))
}

fn one(con: &mut Connection, now: i64, limit: &Limit) -> Verdict {
    let d = at(con, now, std::slice::from_ref(limit));
    assert_eq!(d.admitted, d.limits[0].allowed, "{d:?}");
    d.limits[0]
}

/// lua/batch.lua at `now` for one-limit members: each member's verdict.
fn batch_at(con: &mut Connection, now: i64, members: &[Limit]) -> Vec<Verdict> {
    let members: Vec<Vec<Limit>> = members.iter().map(|l| vec![l.clone()]).collect();
    let (keys, packed) = script::packed_batch(&members);
    script::set_clock(con, now);
    let v: Vec<i64> = script::eval(&BATCH_AT)
        .arg(keys.len())
        .arg(&keys)
        .arg(&packed)
        .query(con)
        .unwrap_or_else(|e| panic!("batch at {now}: {e}"));
    // [M, then per member: 5, verdict, allowed, remaining, retry, reset].
    assert_eq!(v.len(), 1 + 6 * members.len(), "{v:?}");
    v[1..]
        .chunks(6)
        .map(|m| {
            assert_eq!(m[0], 5, "{v:?}");
            let d = Decision {
                admitted: m[1] == 1,
                limits: vec![Verdict {
                    allowed: m[2] == 1,
                    remaining: m[3],
                    retry_ms: m[4],
                    reset_ms: m[5],
                }],
            };
            assert_eq!(d.admitted, d.limits[0].allowed, "{d:?}");
            d.limits[0]
        })
        .collect()
}

#[test]
fn a_bucket_an_older_filter_spent_is_read_from_its_hash_and_the_hash_is_never_written() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    // 2.5 tokens at T0; 100 ms later 2.6.
    let old = older_hash(&mut con, "ann", 2500, T0);
    let before = hash_state(&mut con, &old);
    let limit = bucket("ann");

    // 3 tokens do not fit: 400 credits, 400 ms, short. Nothing is written.
    assert_eq!(
        one(&mut con, T0 + 100, &limit.clone().cost(3)),
        rejects(2, 400)
    );
    assert!(!exists(&mut con, &limit.key));
    // 2 do: 600 credits left, full again in 9400 ms.
    assert_eq!(
        one(&mut con, T0 + 100, &limit.clone().cost(2)),
        admits(0, 9400)
    );
    assert_eq!(read_bucket(&mut con, &limit.key), Some((600, T0 + 100)));
    assert_eq!(
        hash_state(&mut con, &old),
        before,
        "the hash is never written"
    );
    // From then on the string decides, whatever the hash holds.
    older_hash(&mut con, "ann", 10_000, T0);
    let before = hash_state(&mut con, &old);
    assert_eq!(
        one(&mut con, T0 + 100, &limit.clone().cost(1)),
        rejects(0, 400)
    );
    assert_eq!(
        hash_state(&mut con, &old),
        before,
        "the hash is never written"
    );
}

#[test]
fn a_batch_reads_the_older_hash_once_and_charges_its_members_in_turn() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    older_hash(&mut con, "bob", 4000, T0);
    let limit = bucket("bob").cost(2);
    let verdicts = batch_at(&mut con, T0, &[limit.clone(), limit.clone(), limit.clone()]);
    assert_eq!(
        verdicts,
        [admits(2, 8000), admits(0, 10_000), rejects(0, 2000)]
    );
    assert_eq!(read_bucket(&mut con, &limit.key), Some((0, T0)));
}

#[test]
fn a_full_bucket_is_full_whatever_names_a_hash_it_does_not_derive() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    // A spent hash under another limit name, another user, and a key not in
    // the filter's layout: none of them is this bucket's older hash.
    older_hash(&mut con, "cat", 0, T0);
    let other = key("dan", "tb.10.1.1000").replace("per-user", "per-key");
    write_hash(&mut con, &other);
    let plain = tb("plain:tb2.10.1.1000", 10, 1, 1000);
    write_hash(&mut con, "plain:tb.10.1.1000");
    for limit in [bucket("dan"), plain] {
        assert_eq!(one(&mut con, T0, &limit), admits(9, 1000), "{}", limit.key);
    }
    // And a string this filter wrote is read as it is: 1.5 tokens.
    let limit = bucket("eve");
    write_bucket(&mut con, &limit.key, 1500, T0);
    older_hash(&mut con, "eve", 10_000, T0);
    assert_eq!(one(&mut con, T0, &limit.clone().cost(2)), rejects(1, 500));
}

/// A spent bucket's hash at `key` (no credits as of T0).
fn write_hash(con: &mut Connection, key: &str) {
    let _: Value = redis::cmd("HSET")
        .arg(key)
        .arg("c")
        .arg(0)
        .arg("t")
        .arg(T0)
        .query(con)
        .unwrap();
}
