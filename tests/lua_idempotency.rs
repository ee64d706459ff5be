//! The idempotency record against a real redis-server: the part of
//! `lua/ratelimit.lua` that checks and takes a key's lock (joined in from
//! `lua/idempotency.lua`), and the two transitions `lua/idempotency_complete.lua`
//! and `lua/idempotency_release.lua`, exactly as the filter sends them.
//!
//! Record layout (one hash per key): s = "P" (in progress) or "C" (completed),
//! o = owner token (only while in progress), f = request fingerprint, and once
//! completed st = status, h = stored headers, b = stored body.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::{key_exists as exists, key_pttl as pttl, redis_now_ms as now_ms};

use std::sync::{Arc, Barrier};
use std::time::Duration;

use redis::{Connection, Value};

/// One minute: the lock TTL of most tests, and the period of the slow bucket.
const MINUTE: i64 = 60_000;

/// One day: the record TTL of completed keys.
const DAY: i64 = 86_400_000;

// ---------------------------------------------------------------------------
// Calling the scripts

/// One rate limit (cost 1, enforced) as lua/ratelimit.lua takes it.
#[derive(Debug, Clone)]
struct Limit {
    key: &'static str,
    alg: &'static str,
    a: i64,
    b: i64,
    c: i64,
}

/// Token bucket: `capacity` tokens, `refill` tokens every `period_ms`.
fn tb(key: &'static str, capacity: i64, refill: i64, period_ms: i64) -> Limit {
    Limit {
        key,
        alg: "tb",
        a: capacity,
        b: refill,
        c: period_ms,
    }
}

/// One request's idempotency part: record key, owner token, fingerprint, lock TTL.
#[derive(Debug, Clone)]
struct Idem {
    key: &'static str,
    owner: String,
    fingerprint: &'static str,
    lock_ms: i64,
}

fn idem(key: &'static str, owner: &str, fingerprint: &'static str, lock_ms: i64) -> Idem {
    Idem {
        key,
        owner: owner.to_string(),
        fingerprint,
        lock_ms,
    }
}

/// Takes the free key `key` for `owner` (fingerprint "fp-1"), asserting it was free.
fn acquire(con: &mut Connection, key: &'static str, owner: &str, lock_ms: i64) {
    assert_eq!(
        request(con, &[], &idem(key, owner, "fp-1", lock_ms)),
        Reply::Admitted(vec![])
    );
}

/// Takes the free key for "owner-a" and completes it with a 201, `HEADERS`
/// and `BINARY_BODY` for a day, asserting both steps.
fn complete_as_owner_a(con: &mut Connection, key: &'static str) {
    acquire(con, key, "owner-a", MINUTE);
    assert_eq!(
        complete(con, key, "owner-a", 201, HEADERS, BINARY_BODY, DAY),
        1
    );
}

/// The main script's reply, by verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Reply {
    /// 1: every limit charged and the lock taken; 4 integers per limit.
    Admitted(Vec<i64>),
    /// 0: rejected by a rate limit; 4 integers per limit.
    RateLimited(Vec<i64>),
    /// 2: another request holds the lock, for this many more ms.
    Busy(i64),
    /// 3: the stored response.
    Completed {
        status: i64,
        headers: Vec<u8>,
        body: Vec<u8>,
    },
    /// 3 with the body in the object store: the reference instead.
    Offloaded {
        status: i64,
        headers: Vec<u8>,
        object_key: Vec<u8>,
        sha256: Vec<u8>,
        len: i64,
    },
    /// 4: the key was used with another fingerprint.
    Mismatch,
}

fn parse(v: Value) -> Reply {
    let Value::Array(items) = v else {
        panic!("reply is not an array: {v:?}")
    };
    let int = |v: &Value| match v {
        Value::Int(i) => *i,
        other => panic!("expected an integer, got {other:?} in {items:?}"),
    };
    let bytes = |v: &Value| match v {
        Value::BulkString(b) => b.clone(),
        other => panic!("expected a bulk string, got {other:?} in {items:?}"),
    };
    assert!(!items.is_empty(), "empty reply");
    match int(&items[0]) {
        v @ (0 | 1) => {
            let rest: Vec<i64> = items[1..].iter().map(int).collect();
            if v == 1 {
                Reply::Admitted(rest)
            } else {
                Reply::RateLimited(rest)
            }
        }
        2 => {
            assert_eq!(items.len(), 2, "busy reply: {items:?}");
            Reply::Busy(int(&items[1]))
        }
        3 if items.len() == 7 => {
            assert_eq!(bytes(&items[3]), b"", "no body beside a reference");
            Reply::Offloaded {
                status: int(&items[1]),
                headers: bytes(&items[2]),
                object_key: bytes(&items[4]),
                sha256: bytes(&items[5]),
                len: int(&items[6]),
            }
        }
        3 => {
            assert_eq!(items.len(), 4, "completed reply: {items:?}");
            Reply::Completed {
                status: int(&items[1]),
                headers: bytes(&items[2]),
                body: bytes(&items[3]),
            }
        }
        4 => {
            assert_eq!(items.len(), 1, "mismatch reply: {items:?}");
            Reply::Mismatch
        }
        other => panic!("unknown verdict {other} in {items:?}"),
    }
}

/// Appends numkeys, KEYS and ARGV in lua/ratelimit.lua's documented order.
fn with_args(mut cmd: redis::Cmd, limits: &[Limit], idem: &Idem) -> redis::Cmd {
    cmd.arg(limits.len() + 1);
    for l in limits {
        cmd.arg(l.key);
    }
    cmd.arg(idem.key).arg(limits.len());
    for l in limits {
        cmd.arg(l.alg).arg(l.a).arg(l.b).arg(l.c).arg(1).arg("1");
    }
    cmd.arg("1")
        .arg(&idem.owner)
        .arg(idem.fingerprint)
        .arg(idem.lock_ms);
    cmd
}

/// One request through the main script (EVAL of the joined source).
fn request(con: &mut Connection, limits: &[Limit], idem: &Idem) -> Reply {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(&redis_guard::scripts::RATELIMIT.source);
    let v: Value = with_args(cmd, limits, idem)
        .query(con)
        .unwrap_or_else(|e| panic!("EVAL failed for {limits:?} {idem:?}: {e}"));
    parse(v)
}

/// lua/idempotency_complete.lua: 1 if stored, 0 if the lock is not ours.
fn complete(
    con: &mut Connection,
    key: &str,
    owner: &str,
    status: i64,
    headers: &[u8],
    body: &[u8],
    record_ms: i64,
) -> i64 {
    complete_cmd(key, owner, status, headers, body, record_ms)
        .query(con)
        .unwrap()
}

fn complete_cmd(
    key: &str,
    owner: &str,
    status: i64,
    headers: &[u8],
    body: &[u8],
    record_ms: i64,
) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(&redis_guard::scripts::IDEM_COMPLETE.source)
        .arg(1)
        .arg(key)
        .arg(owner)
        .arg(status)
        .arg(headers)
        .arg(body)
        .arg(record_ms);
    cmd
}

/// lua/idempotency_complete.lua for a body in the object store: an empty
/// body and the object's key, SHA-256 and length.
fn complete_offloaded(
    con: &mut Connection,
    key: &str,
    owner: &str,
    object: (&str, &str, usize),
    record_ms: i64,
) -> i64 {
    complete_cmd(key, owner, 200, HEADERS, b"", record_ms)
        .arg(object.0)
        .arg(object.1)
        .arg(object.2)
        .query(con)
        .unwrap()
}

/// lua/idempotency_release.lua: 1 if released, 0 if the lock is not ours.
fn release(con: &mut Connection, key: &str, owner: &str) -> i64 {
    redis::cmd("EVAL")
        .arg(&redis_guard::scripts::IDEM_RELEASE.source)
        .arg(1)
        .arg(key)
        .arg(owner)
        .query(con)
        .unwrap()
}

// ---------------------------------------------------------------------------
// Reading state directly

/// A hash's fields, sorted by name (empty if the key is absent).
fn hash(con: &mut Connection, key: &str) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = redis::cmd("HGETALL").arg(key).query(con).unwrap();
    v.sort();
    v
}

/// The fields of an in-progress record, sorted as `hash` returns them.
fn in_progress(owner: &str, fingerprint: &str) -> Vec<(String, Vec<u8>)> {
    vec![
        ("f".to_string(), fingerprint.as_bytes().to_vec()),
        ("o".to_string(), owner.as_bytes().to_vec()),
        ("s".to_string(), b"P".to_vec()),
    ]
}

/// The fields of a completed record, sorted as `hash` returns them.
fn completed(
    fingerprint: &str,
    status: i64,
    headers: &[u8],
    body: &[u8],
) -> Vec<(String, Vec<u8>)> {
    vec![
        ("b".to_string(), body.to_vec()),
        ("f".to_string(), fingerprint.as_bytes().to_vec()),
        ("h".to_string(), headers.to_vec()),
        ("s".to_string(), b"C".to_vec()),
        ("st".to_string(), status.to_string().into_bytes()),
    ]
}

/// Asserts `lo <= v <= hi`.
#[track_caller]
fn assert_within(what: &str, v: i64, lo: i64, hi: i64) {
    assert!(
        lo <= v && v <= hi,
        "{what} = {v}, expected within [{lo}, {hi}]"
    );
}

/// A body no text encoding survives: CR LF, NUL and 0xff among others.
const BINARY_BODY: &[u8] = b"{\"id\":1}\r\n\0\xff\xfe\x00end\r\n\r\n\xff";

/// Stored headers, equally binary (the scripts never look inside).
const HEADERS: &[u8] = b"content-type\0application/json\0x-raw\0\xff\r\n\0";

// ---------------------------------------------------------------------------
// Taking the lock

#[test]
fn free_key_without_limits_is_admitted_and_locked_for_its_owner() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";

    acquire(&mut con, key, "owner-a", MINUTE);
    assert_eq!(hash(&mut con, key), in_progress("owner-a", "fp-1"));
    assert_within("record PTTL", pttl(&mut con, key), 1, MINUTE);
}

#[test]
fn same_key_in_progress_with_same_fingerprint_answers_busy_with_the_lock_pttl() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    acquire(&mut con, key, "owner-a", MINUTE);
    let ttl_before = pttl(&mut con, key);

    for _ in 0..3 {
        let Reply::Busy(ms) = request(&mut con, &[], &idem(key, "owner-b", "fp-1", MINUTE)) else {
            panic!("an in-progress key with the same fingerprint must answer busy")
        };
        // Read after `ttl_before`, so never more; never 0 or negative.
        assert_within("busy PTTL", ms, 1, ttl_before);
    }
    assert_eq!(
        hash(&mut con, key),
        in_progress("owner-a", "fp-1"),
        "a busy answer leaves the record (and its owner) alone"
    );
    assert_within("record PTTL", pttl(&mut con, key), 1, ttl_before);
}

#[test]
fn busy_answer_carries_the_remaining_lock_time() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    let lock_ms = 2_000;
    acquire(&mut con, key, "owner-a", lock_ms);
    std::thread::sleep(Duration::from_millis(500));
    let Reply::Busy(ms) = request(&mut con, &[], &idem(key, "owner-b", "fp-1", lock_ms)) else {
        panic!("expected busy")
    };
    // At least 500 ms of the lock have passed.
    assert_within("busy PTTL", ms, 1, lock_ms - 500);
}

#[test]
fn in_progress_key_with_another_fingerprint_is_a_mismatch() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    acquire(&mut con, key, "owner-a", MINUTE);
    let ttl_before = pttl(&mut con, key);

    assert_eq!(
        request(&mut con, &[], &idem(key, "owner-b", "fp-2", MINUTE)),
        Reply::Mismatch
    );
    assert_eq!(hash(&mut con, key), in_progress("owner-a", "fp-1"));
    assert_within("record PTTL", pttl(&mut con, key), 1, ttl_before);
}

#[test]
fn completed_key_with_another_fingerprint_is_a_mismatch() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    complete_as_owner_a(&mut con, key);

    assert_eq!(
        request(&mut con, &[], &idem(key, "owner-b", "fp-2", MINUTE)),
        Reply::Mismatch
    );
    assert_eq!(
        hash(&mut con, key),
        completed("fp-1", 201, HEADERS, BINARY_BODY)
    );
}

// ---------------------------------------------------------------------------
// Completing

#[test]
fn owner_completes_and_retries_replay_the_binary_response_byte_for_byte() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    acquire(&mut con, key, "owner-a", MINUTE);

    assert_eq!(
        complete(&mut con, key, "owner-a", 201, HEADERS, BINARY_BODY, DAY),
        1
    );
    // The owner field is gone; everything else exactly as given.
    assert_eq!(
        hash(&mut con, key),
        completed("fp-1", 201, HEADERS, BINARY_BODY)
    );
    assert_within("record PTTL", pttl(&mut con, key), DAY - 5_000, DAY);

    for owner in ["owner-b", "owner-c"] {
        assert_eq!(
            request(&mut con, &[], &idem(key, owner, "fp-1", MINUTE)),
            Reply::Completed {
                status: 201,
                headers: HEADERS.to_vec(),
                body: BINARY_BODY.to_vec(),
            }
        );
    }
    assert_eq!(
        hash(&mut con, key),
        completed("fp-1", 201, HEADERS, BINARY_BODY),
        "a replay leaves the record alone"
    );
}

#[test]
fn an_offloaded_record_keeps_the_object_reference_and_no_body() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    let sha = "5f".repeat(32);
    let object = ("idem/pay/20261203T000000Z/ab-cd", sha.as_str(), 4 << 20);
    acquire(&mut con, key, "owner-a", MINUTE);
    assert_eq!(
        complete_offloaded(&mut con, key, "owner-b", object, DAY),
        0,
        "only the owner completes"
    );
    assert_eq!(complete_offloaded(&mut con, key, "owner-a", object, DAY), 1);
    let mut want = completed("fp-1", 200, HEADERS, b"");
    want.extend([
        ("oc".to_string(), sha.as_bytes().to_vec()),
        ("ok".to_string(), object.0.as_bytes().to_vec()),
        ("ol".to_string(), b"4194304".to_vec()),
    ]);
    want.sort();
    assert_eq!(hash(&mut con, key), want);
    assert_within("record PTTL", pttl(&mut con, key), DAY - 5_000, DAY);
    assert_eq!(
        request(&mut con, &[], &idem(key, "owner-c", "fp-1", MINUTE)),
        Reply::Offloaded {
            status: 200,
            headers: HEADERS.to_vec(),
            object_key: object.0.as_bytes().to_vec(),
            sha256: sha.as_bytes().to_vec(),
            len: 4 << 20,
        }
    );
    assert_eq!(
        request(&mut con, &[], &idem(key, "owner-c", "fp-2", MINUTE)),
        Reply::Mismatch,
        "a reference is still checked against the fingerprint"
    );
}

#[test]
fn a_100_kb_body_is_stored_and_replayed_whole() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:big";
    // Every byte value, many times over.
    let body: Vec<u8> = (0..100 * 1024).map(|i| (i * 7 % 256) as u8).collect();
    acquire(&mut con, key, "owner-a", MINUTE);

    assert_eq!(
        complete(&mut con, key, "owner-a", 200, HEADERS, &body, DAY),
        1
    );
    assert_eq!(hash(&mut con, key), completed("fp-1", 200, HEADERS, &body));
    assert_within("record PTTL", pttl(&mut con, key), DAY - 5_000, DAY);
    let replay = request(&mut con, &[], &idem(key, "owner-b", "fp-1", MINUTE));
    let Reply::Completed {
        status,
        headers,
        body: replayed,
    } = replay
    else {
        panic!("expected the stored response, got {replay:?}")
    };
    assert_eq!((status, headers.as_slice()), (200, HEADERS));
    assert_eq!(replayed.len(), 100 * 1024);
    assert!(
        replayed == body,
        "the 100 KB body differs from the stored one"
    );
}

#[test]
fn an_empty_body_and_no_headers_replay_as_empty_strings() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:empty";
    acquire(&mut con, key, "owner-a", MINUTE);
    assert_eq!(complete(&mut con, key, "owner-a", 204, b"", b"", DAY), 1);
    assert_eq!(
        request(&mut con, &[], &idem(key, "owner-b", "fp-1", MINUTE)),
        Reply::Completed {
            status: 204,
            headers: vec![],
            body: vec![],
        }
    );
}

#[test]
fn another_owner_cannot_complete_the_lock() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    acquire(&mut con, key, "owner-a", MINUTE);
    let ttl_before = pttl(&mut con, key);

    assert_eq!(
        complete(&mut con, key, "owner-b", 200, HEADERS, BINARY_BODY, DAY),
        0
    );
    assert_eq!(hash(&mut con, key), in_progress("owner-a", "fp-1"));
    assert_within("record PTTL", pttl(&mut con, key), 1, ttl_before);
    // The real owner still can.
    assert_eq!(
        complete(&mut con, key, "owner-a", 200, HEADERS, BINARY_BODY, DAY),
        1
    );
}

#[test]
fn complete_after_the_lock_expired_stores_nothing() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    acquire(&mut con, key, "owner-a", 50);
    std::thread::sleep(Duration::from_millis(100));

    assert_eq!(
        complete(&mut con, key, "owner-a", 200, HEADERS, BINARY_BODY, DAY),
        0
    );
    assert!(!exists(&mut con, key), "no record after a late complete");
    assert_eq!(
        request(&mut con, &[], &idem(key, "owner-b", "fp-1", MINUTE)),
        Reply::Admitted(vec![]),
        "the key is free again"
    );
}

#[test]
fn a_lock_taken_again_after_expiry_belongs_to_the_new_owner_only() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    acquire(&mut con, key, "owner-a", 50);
    std::thread::sleep(Duration::from_millis(100));
    acquire(&mut con, key, "owner-b", MINUTE);

    // The first owner, late, can neither store its response nor drop the lock.
    assert_eq!(
        complete(&mut con, key, "owner-a", 500, b"", b"late", DAY),
        0
    );
    assert_eq!(release(&mut con, key, "owner-a"), 0);
    assert_eq!(hash(&mut con, key), in_progress("owner-b", "fp-1"));
    assert_eq!(
        complete(&mut con, key, "owner-b", 200, HEADERS, BINARY_BODY, DAY),
        1
    );
    assert_eq!(
        hash(&mut con, key),
        completed("fp-1", 200, HEADERS, BINARY_BODY)
    );
}

#[test]
fn a_completed_record_cannot_be_completed_again() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    complete_as_owner_a(&mut con, key);
    assert_eq!(
        complete(&mut con, key, "owner-a", 500, b"", b"second", 1_000),
        0
    );
    assert_eq!(
        hash(&mut con, key),
        completed("fp-1", 201, HEADERS, BINARY_BODY)
    );
    assert_within("record PTTL", pttl(&mut con, key), DAY - 5_000, DAY);
}

// ---------------------------------------------------------------------------
// Releasing

#[test]
fn owner_release_frees_the_key_for_the_next_request() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    acquire(&mut con, key, "owner-a", MINUTE);

    assert_eq!(release(&mut con, key, "owner-a"), 1);
    assert!(!exists(&mut con, key), "a released key is gone");
    assert_eq!(release(&mut con, key, "owner-a"), 0, "released once only");

    acquire(&mut con, key, "owner-b", MINUTE);
    assert_eq!(hash(&mut con, key), in_progress("owner-b", "fp-1"));
}

#[test]
fn another_owner_cannot_release_the_lock() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    acquire(&mut con, key, "owner-a", MINUTE);
    let ttl_before = pttl(&mut con, key);

    assert_eq!(release(&mut con, key, "owner-b"), 0);
    assert_eq!(hash(&mut con, key), in_progress("owner-a", "fp-1"));
    assert_within("record PTTL", pttl(&mut con, key), 1, ttl_before);
}

#[test]
fn a_completed_record_cannot_be_released() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    complete_as_owner_a(&mut con, key);

    assert_eq!(release(&mut con, key, "owner-a"), 0);
    assert_eq!(
        hash(&mut con, key),
        completed("fp-1", 201, HEADERS, BINARY_BODY)
    );
    assert_within("record PTTL", pttl(&mut con, key), DAY - 5_000, DAY);
}

#[test]
fn release_of_a_missing_key_writes_nothing() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:never";
    assert_eq!(release(&mut con, key, "owner-a"), 0);
    assert_eq!(
        complete(&mut con, key, "owner-a", 200, HEADERS, BINARY_BODY, DAY),
        0
    );
    assert!(!exists(&mut con, key));
}

// ---------------------------------------------------------------------------
// Together with a rate limit

const BUCKET: &str = "t:{x}:tb:b1";

/// One token, refilled once a minute: one call empties it for the whole test.
fn one_token() -> Limit {
    tb(BUCKET, 1, 1, MINUTE)
}

/// First call with key `k1`: admitted, lock taken, bucket charged.
/// Returns the bucket's hash right after, and its `t` (ms).
fn admit_first(con: &mut Connection) -> (Vec<(String, Vec<u8>)>, i64) {
    let key = "t:{x}:idem:k1";
    let before = now_ms(con);
    // A fresh bucket is full: exact. [allowed, remaining, retry, reset]
    assert_eq!(
        request(con, &[one_token()], &idem(key, "owner-a", "fp-1", MINUTE)),
        Reply::Admitted(vec![1, 0, 0, MINUTE])
    );
    let after = now_ms(con);
    assert_eq!(hash(con, key), in_progress("owner-a", "fp-1"));
    assert_within("record PTTL", pttl(con, key), 1, MINUTE);

    let bucket = hash(con, BUCKET);
    assert_eq!(bucket.len(), 2, "bucket hash: {bucket:?}");
    assert_eq!(
        bucket[0],
        ("c".to_string(), b"0".to_vec()),
        "bucket charged"
    );
    let t: i64 = String::from_utf8(bucket[1].1.clone())
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(bucket[1].0, "t");
    assert_within("bucket t", t, before, after);
    assert_within("bucket PTTL", pttl(con, BUCKET), 1, MINUTE);
    (bucket, t)
}

#[test]
fn keyed_request_within_the_limit_takes_the_lock_and_charges_the_bucket() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    admit_first(&mut con);
}

#[test]
fn replay_of_a_completed_key_spends_no_quota() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    let (bucket, _) = admit_first(&mut con);
    assert_eq!(
        complete(&mut con, key, "owner-a", 201, HEADERS, BINARY_BODY, DAY),
        1
    );
    let bucket_ttl = pttl(&mut con, BUCKET);

    // The bucket is empty, yet the replay is answered from the record.
    for owner in ["owner-b", "owner-c"] {
        assert_eq!(
            request(&mut con, &[one_token()], &idem(key, owner, "fp-1", MINUTE)),
            Reply::Completed {
                status: 201,
                headers: HEADERS.to_vec(),
                body: BINARY_BODY.to_vec(),
            }
        );
    }
    assert_eq!(hash(&mut con, BUCKET), bucket, "bucket unchanged");
    assert_within("bucket PTTL", pttl(&mut con, BUCKET), 1, bucket_ttl);
}

#[test]
fn busy_and_mismatch_answers_spend_no_quota_and_come_before_the_limit() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let key = "t:{x}:idem:k1";
    let (bucket, _) = admit_first(&mut con);
    let lock_ttl = pttl(&mut con, key);

    let Reply::Busy(ms) = request(
        &mut con,
        &[one_token()],
        &idem(key, "owner-b", "fp-1", MINUTE),
    ) else {
        panic!("an in-progress key is busy even with the bucket empty")
    };
    assert_within("busy PTTL", ms, 1, lock_ttl);
    assert_eq!(
        request(
            &mut con,
            &[one_token()],
            &idem(key, "owner-b", "fp-2", MINUTE)
        ),
        Reply::Mismatch
    );
    assert_eq!(hash(&mut con, BUCKET), bucket, "bucket unchanged");
    assert_eq!(hash(&mut con, key), in_progress("owner-a", "fp-1"));
}

#[test]
fn rate_limited_keyed_request_takes_no_lock() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let (bucket, t) = admit_first(&mut con);
    let key2 = "t:{x}:idem:k2";

    let before = now_ms(&mut con);
    let reply = request(
        &mut con,
        &[one_token()],
        &idem(key2, "owner-b", "fp-2", MINUTE),
    );
    let slop = now_ms(&mut con) - before;
    let Reply::RateLimited(limits) = reply else {
        panic!("the bucket is empty: expected verdict 0, got {reply:?}")
    };
    assert_eq!(limits.len(), 4, "{limits:?}");
    // [allowed, remaining, retry, reset]: the token is due one minute after
    // the charge at `t`; the script's clock lies within [before, before + slop].
    assert_eq!(limits[..2], [0, 0]);
    assert_within(
        "retry_ms",
        limits[2],
        MINUTE - (before + slop - t),
        MINUTE - (before - t),
    );
    assert_eq!(limits[3], limits[2], "a rejection's reset equals its retry");

    assert!(!exists(&mut con, key2), "a rejected request takes no lock");
    assert_eq!(hash(&mut con, BUCKET), bucket, "bucket unchanged");
    // Rejected again: still no lock, so the key is not busy.
    assert!(matches!(
        request(
            &mut con,
            &[one_token()],
            &idem(key2, "owner-c", "fp-2", MINUTE)
        ),
        Reply::RateLimited(_)
    ));
    assert!(!exists(&mut con, key2));
}

// ---------------------------------------------------------------------------
// Concurrency

#[test]
fn concurrent_acquires_of_one_key_admit_exactly_one() {
    const THREADS: usize = 50;
    let redis = support::Redis::start();
    let key = "t:{x}:idem:race";
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(&redis_guard::scripts::RATELIMIT.source)
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(sha, redis_guard::scripts::RATELIMIT.sha1);

    // Every connection is open before any thread starts, so none fails after
    // others are waiting at the barrier.
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let mut con = redis.conn();
            con.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            con.set_write_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let barrier = Arc::clone(&barrier);
            let sha = sha.clone();
            let owner = format!("owner-{i}");
            std::thread::spawn(move || {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(&sha);
                let cmd = with_args(cmd, &[], &idem(key, &owner, "fp-1", MINUTE));
                barrier.wait();
                let v: Value = cmd.query(&mut con).map_err(|e| e.to_string())?;
                Ok::<_, String>((owner, parse(v)))
            })
        })
        .collect();

    let mut winners = Vec::new();
    let mut busy = 0;
    for h in handles {
        match h.join().unwrap() {
            Ok((owner, Reply::Admitted(rest))) => {
                assert!(rest.is_empty(), "{rest:?}");
                winners.push(owner);
            }
            Ok((_, Reply::Busy(ms))) => {
                assert_within("busy PTTL", ms, 1, MINUTE);
                busy += 1;
            }
            Ok((owner, other)) => panic!("{owner} got {other:?}"),
            Err(e) => panic!("a racing call failed: {e}"),
        }
    }
    assert_eq!(
        (winners.len(), busy),
        (1, THREADS - 1),
        "winners: {winners:?}"
    );
    let mut con = redis.conn();
    assert_eq!(hash(&mut con, key), in_progress(&winners[0], "fp-1"));
}

// ---------------------------------------------------------------------------
// Expiry

/// Asserts every key in the database expires (PTTL > 0).
#[track_caller]
fn assert_every_key_expires(con: &mut Connection, step: &str) {
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(con).unwrap();
    keys.sort();
    for k in &keys {
        let ms = pttl(con, k);
        assert!(ms > 0, "after {step}: {k} has PTTL {ms}");
    }
}

#[test]
fn every_key_written_has_a_ttl() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let (k1, k2, k3) = ("t:{x}:idem:k1", "t:{x}:idem:k2", "t:{x}:idem:k3");
    let window = Limit {
        key: "t:{x}:sw:w1",
        alg: "sw",
        a: 10,
        b: MINUTE,
        c: 0,
    };
    let limits = [tb(BUCKET, 10, 1, MINUTE), window];

    assert!(matches!(
        request(&mut con, &limits, &idem(k1, "owner-a", "fp-1", MINUTE)),
        Reply::Admitted(_)
    ));
    assert_every_key_expires(&mut con, "a keyed request with two limits");
    assert!(matches!(
        request(&mut con, &[], &idem(k2, "owner-b", "fp-2", MINUTE)),
        Reply::Admitted(_)
    ));
    assert!(matches!(
        request(&mut con, &limits, &idem(k3, "owner-c", "fp-3", MINUTE)),
        Reply::Admitted(_)
    ));
    assert_every_key_expires(&mut con, "three locks");
    assert_eq!(
        complete(&mut con, k1, "owner-a", 200, HEADERS, BINARY_BODY, DAY),
        1
    );
    assert_every_key_expires(&mut con, "complete");
    assert!(matches!(
        request(&mut con, &limits, &idem(k1, "owner-d", "fp-1", MINUTE)),
        Reply::Completed { .. }
    ));
    assert!(matches!(
        request(&mut con, &limits, &idem(k2, "owner-d", "fp-2", MINUTE)),
        Reply::Busy(_)
    ));
    assert!(matches!(
        request(&mut con, &limits, &idem(k3, "owner-d", "fp-x", MINUTE)),
        Reply::Mismatch
    ));
    assert_eq!(release(&mut con, k2, "owner-b"), 1);
    assert_every_key_expires(&mut con, "replay, busy, mismatch and release");

    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut con).unwrap();
    keys.sort();
    assert_eq!(keys, [k1, k3, "t:{x}:sw:w1", BUCKET]);
}

#[test]
fn redis_names_the_idempotency_scripts_by_the_sha1_the_filter_sends() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    for script in [
        &*redis_guard::scripts::IDEM_COMPLETE,
        &*redis_guard::scripts::IDEM_RELEASE,
    ] {
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(&script.source)
            .query(&mut con)
            .unwrap();
        assert_eq!(sha, script.sha1);
    }
}
