//! lua/lease.lua and lua/lease_return.lua called as the filter sends them,
//! their replies and the give-back record read, and the same at the test
//! clock without TTLs for the seeded and worked cases (tests/lua_lease.rs,
//! tests/lua_lease_return.rs, tests/lua_lease_safety.rs).

use std::sync::LazyLock;

use redis::{Cmd, Connection};
use redis_guard::scripts::{Script, LEASE, LEASE_RETURN};

use super::RATELIMIT_AT;
use super::{eval, evalsha, load, tb, with_limits, with_test_clock, without_expiry, Limit};
use crate::support::read_bucket;

/// A token bucket as lua/lease.lua takes it: `capacity` tokens, `refill`
/// tokens every `period` ms.
#[derive(Debug, Clone, Copy)]
pub struct Bucket {
    pub capacity: i64,
    pub refill: i64,
    pub period: i64,
}

pub fn bucket(capacity: i64, refill: i64, period: i64) -> Bucket {
    Bucket {
        capacity,
        refill,
        period,
    }
}

impl Bucket {
    /// The same bucket as one enforced lua/ratelimit.lua limit on `key`.
    pub fn limit(self, key: &str, cost: i64) -> Limit {
        tb(key, self.capacity, self.refill, self.period).cost(cost)
    }
}

/// Appends lua/lease.lua's one key and five numbers: capacity, refill,
/// period, cost, lease.
pub fn with_lease(mut cmd: Cmd, key: &str, b: Bucket, cost: i64, lease: i64) -> Cmd {
    cmd.arg(1)
        .arg(key)
        .arg(b.capacity)
        .arg(b.refill)
        .arg(b.period)
        .arg(cost)
        .arg(lease);
    cmd
}

/// EVAL of lua/lease.lua: its nine integers (the verdict, the grant and the
/// grant's give-back tuple).
pub fn eval_lease(con: &mut Connection, key: &str, b: Bucket, cost: i64, lease: i64) -> [i64; 9] {
    let raw: Vec<i64> = with_lease(eval(&LEASE), key, b, cost, lease)
        .query(con)
        .unwrap_or_else(|e| panic!("lease EVAL on {key} ({b:?}, cost {cost}, lease {lease}): {e}"));
    raw.try_into()
        .unwrap_or_else(|raw| panic!("a lease reply is nine integers: {raw:?}"))
}

/// The lease script's reply: the verdict and grant, and the tuple.
pub fn split_lease(full: [i64; 9]) -> ([i64; 6], [i64; 3]) {
    let mut reply = [0; 6];
    reply.copy_from_slice(&full[..6]);
    let mut tuple = [0; 3];
    tuple.copy_from_slice(&full[6..]);
    (reply, tuple)
}

/// A leased bucket's give-back count: the first little-endian double of its
/// give-back record `<key>:ret` (lua/lease.lua, lua/lease_return.lua); 0
/// when missing.
pub fn lease_returned(con: &mut Connection, key: &str) -> i64 {
    lease_record(con, key).map_or(0, |r| r.count)
}

/// A give-back record (lua/lease_return.lua's layout): the count, the
/// instant it started, and one entry per accepted give-back (or two
/// merged), oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    pub count: i64,
    pub since: i64,
    /// (t0, level, returned, tokens, at, parts): the grant's tuple (of the
    /// earliest grant, when the entry merged several), the tokens accepted,
    /// when (the latest), and how many give-backs it holds.
    pub entries: Vec<[i64; 6]>,
}

/// The give-back record of a leased bucket, `None` when missing; panics on
/// any other layout.
pub fn lease_record(con: &mut Connection, key: &str) -> Option<LeaseRecord> {
    let b: Option<Vec<u8>> = redis::cmd("GET")
        .arg(format!("{key}:ret"))
        .query(con)
        .unwrap();
    let b = b?;
    assert!(
        b.len() >= 24 && (b.len() - 24) % 48 == 0,
        "a head and whole entries: {} bytes",
        b.len()
    );
    let whole = |i: usize| {
        let n = f64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
        assert_eq!(n.fract(), 0.0, "whole numbers: {n}");
        n as i64
    };
    assert_eq!(whole(1), -2, "the layout mark");
    let entries = (0..(b.len() - 24) / 48)
        .map(|e| [0, 1, 2, 3, 4, 5].map(|f| whole(3 + e * 6 + f)))
        .collect();
    Some(LeaseRecord {
        count: whole(0),
        since: whole(2),
        entries,
    })
}

// ---------------------------------------------------------------------------
// At the test clock

/// `cmd` (EVAL of lua/ratelimit.lua) with the bucket as one limit.
fn strict_cmd(cmd: Cmd, key: &str, b: Bucket, cost: i64) -> Cmd {
    with_limits(cmd, &[b.limit(key, cost)], None)
}

/// lua/lease.lua at the test clock, without TTLs (the test clock jumps; a
/// TTL runs on Redis' own clock).
pub static LEASE_AT: LazyLock<Script> = LazyLock::new(|| without_expiry(&with_test_clock(&LEASE)));
/// lua/lease_return.lua at the test clock, without TTLs.
pub static RETURN_AT: LazyLock<Script> =
    LazyLock::new(|| without_expiry(&with_test_clock(&LEASE_RETURN)));
/// [`RETURN_AT`] with records of at most two entries, so that a seeded run
/// merges them often.
pub static RETURN_SMALL: LazyLock<Script> = LazyLock::new(|| {
    let at = &RETURN_AT.source;
    let from = "local MAX_ENTRIES = 32\n";
    assert_eq!(at.matches(from).count(), 1, "the record's bound");
    let source = at.replacen(from, "local MAX_ENTRIES = 2\n", 1);
    let sha1 = redis::Script::new(&source).get_hash().to_string();
    Script { source, sha1 }
});
/// The strict script at the test clock, without TTLs.
pub static STRICT_AT: LazyLock<Script> = LazyLock::new(|| without_expiry(&RATELIMIT_AT));

/// A fresh redis-server with the test-clock lease scripts and
/// lua/lease_return.lua loaded: the calls below go by EVALSHA (a seeded run
/// makes thousands).
pub fn start_leasing() -> (crate::support::Redis, Connection) {
    let (redis, mut con) = crate::support::Redis::start_with_conn();
    for s in [
        &*LEASE_AT,
        &*RETURN_AT,
        &*RETURN_SMALL,
        &*STRICT_AT,
        &*LEASE_RETURN,
    ] {
        load(&mut con, s);
    }
    (redis, con)
}

/// A lease at the test clock: the verdict and grant, and the tuple.
pub fn lease_at(
    con: &mut Connection,
    key: &str,
    b: Bucket,
    cost: i64,
    lease_of: i64,
) -> ([i64; 6], [i64; 3]) {
    let raw: Vec<i64> = with_lease(evalsha(&LEASE_AT), key, b, cost, lease_of)
        .query(con)
        .unwrap();
    split_lease(raw.try_into().unwrap())
}

/// A strict request of `cost` at the test clock; true if admitted.
pub fn strict_at(con: &mut Connection, key: &str, b: Bucket, cost: i64) -> bool {
    let raw: Vec<i64> = strict_cmd(evalsha(&STRICT_AT), key, b, cost)
        .query(con)
        .unwrap();
    raw[0] == 1
}

/// Gives `tokens` back to `key` with a grant's tuple; the tokens taken back.
pub fn give_back(
    con: &mut Connection,
    script: &Script,
    key: &str,
    b: Bucket,
    tokens: i64,
    tuple: [i64; 3],
) -> i64 {
    give_backs(con, script, key, b, &[(tokens, tuple)])[0]
}

/// Several give-backs to `key` in one call, in order, as a worker joins
/// them: (tokens, tuple) each; the tokens taken back of each.
pub fn give_backs(
    con: &mut Connection,
    script: &Script,
    key: &str,
    b: Bucket,
    parts: &[(i64, [i64; 3])],
) -> Vec<i64> {
    let mut cmd = evalsha(script);
    cmd.arg(parts.len());
    for _ in parts {
        cmd.arg(key);
    }
    for (tokens, tuple) in parts {
        cmd.arg(b.capacity)
            .arg(b.refill)
            .arg(b.period)
            .arg(tokens)
            .arg(&tuple[..]);
    }
    let raw: Vec<i64> = cmd
        .query(con)
        .unwrap_or_else(|e| panic!("give-backs {parts:?} to {key}: {e}"));
    assert_eq!(raw.len(), parts.len(), "one figure per key: {raw:?}");
    raw
}

/// The bucket's level (credits) at test-clock instant `now`.
pub fn level_at(con: &mut Connection, key: &str, b: Bucket, now: i64) -> i64 {
    let full = b.capacity * b.period;
    match read_bucket(con, key) {
        None => full,
        Some((c, t)) if now > t => full.min(c + (now - t) * b.refill),
        Some((c, _)) => full.min(c),
    }
}
