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

use redis::Connection;
use support::script::{admits, batch_at, one, rejects, tb, Limit, Verdict, T0};
use support::{
    command_calls, hash_fields, key_exists as exists, pexpiretime, read_bucket, write_bucket,
    write_older_bucket,
};

/// A limit's key as the filter names it, under an algorithm signature.
fn key(user: &str, signature: &str) -> String {
    format!("rg:rl:{{9f86d081884c7d65}}:per-user:{signature}:5:{user}")
}

/// The key of `user`'s bucket as the older filter named it.
fn older_key(user: &str) -> String {
    key(user, "tb.10.1.1000")
}

/// The bucket of 10 tokens, one back a second, as this filter names it.
fn bucket(user: &str) -> Limit {
    tb(&key(user, "tb2.10.1.1000"), 10, 1, 1000)
}

/// The hash's fields and the instant it expires: what a write would change.
fn hash_state(con: &mut Connection, key: &str) -> (Vec<(String, String)>, i64) {
    (hash_fields(con, key), pexpiretime(con, key))
}

fn reset_stats(con: &mut Connection) {
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query::<()>(con)
        .unwrap();
}

/// The fallback's reads since `reset_stats`: `PTTL`s and `HMGET`s (the
/// test clock's shim adds `GET`s and `SET`s, so those are not counted).
fn fallback_reads(con: &mut Connection) -> (i64, i64) {
    (command_calls(con, "pttl"), command_calls(con, "hmget"))
}

/// lua/batch.lua at `now` for one-limit members: each member's verdict.
fn batch_verdicts(con: &mut Connection, now: i64, members: &[Limit]) -> Vec<Verdict> {
    let members: Vec<Vec<Limit>> = members.iter().map(|l| vec![l.clone()]).collect();
    batch_at(con, now, &members)
        .into_iter()
        .map(|d| {
            assert_eq!(d.admitted, d.limits[0].allowed, "{d:?}");
            d.limits[0]
        })
        .collect()
}

#[test]
fn a_bucket_an_older_filter_spent_is_read_from_its_hash_and_the_hash_is_never_written() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    // 2.5 tokens at T0; 100 ms later 2.6.
    let old = older_key("ann");
    write_older_bucket(&mut con, &old, 2500, T0);
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
    write_older_bucket(&mut con, &old, 10_000, T0);
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
    write_older_bucket(&mut con, &older_key("bob"), 4000, T0);
    let limit = bucket("bob").cost(2);
    reset_stats(&mut con);
    let verdicts = batch_verdicts(&mut con, T0, &[limit.clone(), limit.clone(), limit.clone()]);
    assert_eq!(
        verdicts,
        [admits(2, 8000), admits(0, 10_000), rejects(0, 2000)]
    );
    assert_eq!(fallback_reads(&mut con), (1, 1), "PTTL and HMGET once");
    assert_eq!(read_bucket(&mut con, &limit.key), Some((0, T0)));
}

#[test]
fn a_full_bucket_is_full_whatever_names_a_hash_it_does_not_derive() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    // A spent hash under another limit name, another user, and a key not in
    // the filter's layout: none of them is this bucket's older hash.
    write_older_bucket(&mut con, &older_key("cat"), 0, T0);
    let other = older_key("dan").replace("per-user", "per-key");
    write_older_bucket(&mut con, &other, 0, T0);
    let plain = tb("plain:tb2.10.1.1000", 10, 1, 1000);
    write_older_bucket(&mut con, "plain:tb.10.1.1000", 0, T0);
    reset_stats(&mut con);
    for limit in [bucket("dan"), plain] {
        assert_eq!(one(&mut con, T0, &limit), admits(9, 1000), "{}", limit.key);
    }
    // The bucket in the layout looked for its hash (PTTL) and, finding
    // none, read nothing more; the other derives no key to look for.
    assert_eq!(fallback_reads(&mut con), (1, 0));
    // And a string this filter wrote is read as it is: 1.5 tokens.
    let limit = bucket("eve");
    write_bucket(&mut con, &limit.key, 1500, T0);
    write_older_bucket(&mut con, &older_key("eve"), 10_000, T0);
    assert_eq!(one(&mut con, T0, &limit.clone().cost(2)), rejects(1, 500));
}
