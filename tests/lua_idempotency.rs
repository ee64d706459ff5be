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

use support::script::{
    self, admits, complete, complete_offloaded, idem, release, sw, tb, Decision, Idem, Limit, Reply,
};
use support::{
    assert_expires_in, assert_within, bucket_bytes, key_exists as exists, key_pttl as pttl,
    pexpiretime, read_bucket, redis_now_ms as now_ms, wait_until,
};

use std::sync::{Arc, Barrier};
use std::time::Duration;

use redis::{Connection, Value};
use redis_guard::scripts::{IDEM_COMPLETE, IDEM_RELEASE, RATELIMIT};

/// One minute: the lock TTL of most tests, and the period of the slow bucket.
const MINUTE: i64 = 60_000;

/// One day: the record TTL of completed keys.
const DAY: i64 = 86_400_000;

// ---------------------------------------------------------------------------
// Calling the scripts

/// One request through lua/ratelimit.lua: its limits and its key.
fn request(con: &mut Connection, limits: &[Limit], idem: &Idem) -> Reply {
    script::request(con, limits, Some(idem))
}

/// Takes the free key `key` for `owner` (fingerprint "fp-1"), asserting it was free.
fn acquire(con: &mut Connection, key: &str, owner: &str, lock_ms: i64) {
    assert_eq!(
        request(con, &[], &idem(key, owner, "fp-1", lock_ms)),
        Reply::admitted(vec![])
    );
}

/// Takes the free key for "owner-a" and completes it with a 201, `HEADERS`
/// and `BINARY_BODY` for a day, asserting both steps and that the record
/// expires a day after the complete. Returns its PEXPIRETIME.
fn complete_as_owner_a(con: &mut Connection, key: &str) -> i64 {
    acquire(con, key, "owner-a", MINUTE);
    let t0 = now_ms(con);
    assert_eq!(
        complete(con, key, "owner-a", 201, HEADERS, BINARY_BODY, DAY),
        1
    );
    assert_expires_in(con, key, DAY, t0);
    pexpiretime(con, key)
}

/// Asserts `key` is still owner-a's lock (fingerprint "fp-1"), expiring at
/// `expire_at`: untouched.
#[track_caller]
fn assert_owner_a_lock_untouched(con: &mut Connection, key: &str, expire_at: i64) {
    assert_eq!(hash(con, key), in_progress("owner-a", "fp-1"));
    assert_eq!(pexpiretime(con, key), expire_at, "lock TTL untouched");
}

/// Asserts `key` still holds owner-a's completed record from
/// `complete_as_owner_a`, expiring at `expire_at`: untouched.
#[track_caller]
fn assert_owner_a_record_untouched(con: &mut Connection, key: &str, expire_at: i64) {
    assert_eq!(hash(con, key), completed("fp-1", 201, HEADERS, BINARY_BODY));
    assert_eq!(
        pexpiretime(con, key),
        expire_at,
        "the record's TTL untouched"
    );
}

/// Sends `req` against the lock on its key and asserts the busy answer is
/// the lock's remaining time on Redis' clock (its PEXPIRETIME less the
/// script's TIME, which lies between TIME read before and after the call),
/// and that the lock's expiry is untouched. Returns the answer.
#[track_caller]
fn assert_busy(con: &mut Connection, limits: &[Limit], req: &Idem) -> i64 {
    let expire_at = pexpiretime(con, &req.key);
    let t0 = now_ms(con);
    let reply = request(con, limits, req);
    let t1 = now_ms(con);
    let Reply::Busy(ms) = reply else {
        panic!("an in-progress key with the same fingerprint answers busy, got {reply:?}")
    };
    assert_within("busy PTTL", ms, expire_at - t1, expire_at - t0);
    assert_eq!(pexpiretime(con, &req.key), expire_at, "lock TTL untouched");
    ms
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

/// A body no text encoding survives: CR LF, NUL and 0xff among others.
const BINARY_BODY: &[u8] = b"{\"id\":1}\r\n\0\xff\xfe\x00end\r\n\r\n\xff";

/// Stored headers, equally binary (the scripts never look inside).
const HEADERS: &[u8] = b"content-type\0application/json\0x-raw\0\xff\r\n\0";

// ---------------------------------------------------------------------------
// Taking the lock

#[test]
fn free_key_without_limits_is_admitted_and_locked_for_its_owner() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:k1";

    let t0 = now_ms(&mut con);
    acquire(&mut con, key, "owner-a", MINUTE);
    assert_eq!(hash(&mut con, key), in_progress("owner-a", "fp-1"));
    // The lock lasts its full TTL: a shorter one would free the key while
    // its request still runs.
    assert_expires_in(&mut con, key, MINUTE, t0);
}

#[test]
fn same_key_in_progress_with_same_fingerprint_answers_busy_with_the_lock_pttl() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:k1";
    acquire(&mut con, key, "owner-a", MINUTE);

    for _ in 0..3 {
        let ms = assert_busy(&mut con, &[], &idem(key, "owner-b", "fp-1", MINUTE));
        assert!(ms > 0, "never 0 or negative: {ms}");
    }
    assert_eq!(
        hash(&mut con, key),
        in_progress("owner-a", "fp-1"),
        "a busy answer leaves the record (and its owner) alone"
    );
}

#[test]
fn busy_answer_carries_the_remaining_lock_time() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:k1";
    let lock_ms = 2_000;
    acquire(&mut con, key, "owner-a", lock_ms);
    // On Redis' clock, at least 500 ms of the lock pass.
    let taken = now_ms(&mut con);
    wait_until(&mut con, taken + 500);
    let ms = assert_busy(&mut con, &[], &idem(key, "owner-b", "fp-1", lock_ms));
    assert_within("busy PTTL", ms, 1, lock_ms - 500);
}

#[test]
fn in_progress_key_with_another_fingerprint_is_a_mismatch() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:k1";
    acquire(&mut con, key, "owner-a", MINUTE);
    let expire_at = pexpiretime(&mut con, key);

    assert_eq!(
        request(&mut con, &[], &idem(key, "owner-b", "fp-2", MINUTE)),
        Reply::Mismatch
    );
    assert_owner_a_lock_untouched(&mut con, key, expire_at);
}

#[test]
fn completed_key_with_another_fingerprint_is_a_mismatch() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:k1";
    let expire_at = complete_as_owner_a(&mut con, key);

    assert_eq!(
        request(&mut con, &[], &idem(key, "owner-b", "fp-2", MINUTE)),
        Reply::Mismatch
    );
    assert_owner_a_record_untouched(&mut con, key, expire_at);
}

// ---------------------------------------------------------------------------
// Completing

#[test]
fn owner_completes_and_retries_replay_the_binary_response_byte_for_byte() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:k1";
    complete_as_owner_a(&mut con, key);
    // The owner field is gone; everything else exactly as given.
    assert_eq!(
        hash(&mut con, key),
        completed("fp-1", 201, HEADERS, BINARY_BODY)
    );

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
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:k1";
    let sha = "5f".repeat(32);
    let object = ("idem/pay/20261203T000000Z/ab-cd", sha.as_str(), 4 << 20);
    acquire(&mut con, key, "owner-a", MINUTE);
    assert_eq!(
        complete_offloaded(&mut con, key, "owner-b", HEADERS, object, DAY),
        0,
        "only the owner completes"
    );
    let t0 = now_ms(&mut con);
    assert_eq!(
        complete_offloaded(&mut con, key, "owner-a", HEADERS, object, DAY),
        1
    );
    let mut want = completed("fp-1", 200, HEADERS, b"");
    want.extend([
        ("oc".to_string(), sha.as_bytes().to_vec()),
        ("ok".to_string(), object.0.as_bytes().to_vec()),
        ("ol".to_string(), b"4194304".to_vec()),
    ]);
    want.sort();
    assert_eq!(hash(&mut con, key), want);
    assert_expires_in(&mut con, key, DAY, t0);
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
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:big";
    // Every byte value, many times over.
    let body: Vec<u8> = (0..100 * 1024).map(|i| (i * 7 % 256) as u8).collect();
    acquire(&mut con, key, "owner-a", MINUTE);

    let t0 = now_ms(&mut con);
    assert_eq!(
        complete(&mut con, key, "owner-a", 200, HEADERS, &body, DAY),
        1
    );
    assert_eq!(hash(&mut con, key), completed("fp-1", 200, HEADERS, &body));
    assert_expires_in(&mut con, key, DAY, t0);
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
    let (_redis, mut con) = support::Redis::start_with_conn();
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
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:k1";
    acquire(&mut con, key, "owner-a", MINUTE);
    let expire_at = pexpiretime(&mut con, key);

    assert_eq!(
        complete(&mut con, key, "owner-b", 200, HEADERS, BINARY_BODY, DAY),
        0
    );
    assert_owner_a_lock_untouched(&mut con, key, expire_at);
    // The real owner still can.
    assert_eq!(
        complete(&mut con, key, "owner-a", 200, HEADERS, BINARY_BODY, DAY),
        1
    );
}

#[test]
fn complete_after_the_lock_expired_stores_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
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
        Reply::admitted(vec![]),
        "the key is free again"
    );
}

#[test]
fn a_lock_taken_again_after_expiry_belongs_to_the_new_owner_only() {
    let (_redis, mut con) = support::Redis::start_with_conn();
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
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:k1";
    let expire_at = complete_as_owner_a(&mut con, key);
    assert_eq!(
        complete(&mut con, key, "owner-a", 500, b"", b"second", 1_000),
        0
    );
    assert_owner_a_record_untouched(&mut con, key, expire_at);
}

// ---------------------------------------------------------------------------
// Releasing

#[test]
fn owner_release_frees_the_key_for_the_next_request() {
    let (_redis, mut con) = support::Redis::start_with_conn();
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
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:k1";
    acquire(&mut con, key, "owner-a", MINUTE);
    let expire_at = pexpiretime(&mut con, key);

    assert_eq!(release(&mut con, key, "owner-b"), 0);
    assert_owner_a_lock_untouched(&mut con, key, expire_at);
}

#[test]
fn a_completed_record_cannot_be_released() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:k1";
    let expire_at = complete_as_owner_a(&mut con, key);

    assert_eq!(release(&mut con, key, "owner-a"), 0);
    assert_owner_a_record_untouched(&mut con, key, expire_at);
}

#[test]
fn release_of_a_missing_key_writes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
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
fn admit_first(con: &mut Connection) -> (Option<Vec<u8>>, i64) {
    let key = "t:{x}:idem:k1";
    let before = now_ms(con);
    // A fresh bucket is full: exact. [allowed, remaining, retry, reset]
    assert_eq!(
        request(con, &[one_token()], &idem(key, "owner-a", "fp-1", MINUTE)),
        Reply::admitted(vec![admits(0, MINUTE)])
    );
    let after = now_ms(con);
    assert_eq!(hash(con, key), in_progress("owner-a", "fp-1"));
    // The lock and the bucket expire exactly a minute after the call: the
    // lock's TTL, and the time until the one token is back.
    assert_expires_in(con, key, MINUTE, before);
    assert_expires_in(con, BUCKET, MINUTE, before);

    let (credits, t) = read_bucket(con, BUCKET).unwrap();
    assert_eq!(credits, 0, "bucket charged");
    assert_within("bucket t", t, before, after);
    let bucket = bucket_bytes(con, BUCKET);
    (bucket, t)
}

#[test]
fn keyed_request_within_the_limit_takes_the_lock_and_charges_the_bucket() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    admit_first(&mut con);
}

#[test]
fn replay_of_a_completed_key_spends_no_quota() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:k1";
    let (bucket, _) = admit_first(&mut con);
    assert_eq!(
        complete(&mut con, key, "owner-a", 201, HEADERS, BINARY_BODY, DAY),
        1
    );
    let bucket_expiry = pexpiretime(&mut con, BUCKET);

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
    assert_eq!(bucket_bytes(&mut con, BUCKET), bucket, "bucket unchanged");
    assert_eq!(
        pexpiretime(&mut con, BUCKET),
        bucket_expiry,
        "bucket TTL untouched"
    );
}

#[test]
fn busy_and_mismatch_answers_spend_no_quota_and_come_before_the_limit() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:k1";
    let (bucket, _) = admit_first(&mut con);

    // An in-progress key is busy even with the bucket empty.
    assert_busy(
        &mut con,
        &[one_token()],
        &idem(key, "owner-b", "fp-1", MINUTE),
    );
    assert_eq!(
        request(
            &mut con,
            &[one_token()],
            &idem(key, "owner-b", "fp-2", MINUTE)
        ),
        Reply::Mismatch
    );
    assert_eq!(bucket_bytes(&mut con, BUCKET), bucket, "bucket unchanged");
    assert_eq!(hash(&mut con, key), in_progress("owner-a", "fp-1"));
}

#[test]
fn rate_limited_keyed_request_takes_no_lock() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let (bucket, t) = admit_first(&mut con);
    let key2 = "t:{x}:idem:k2";

    let before = now_ms(&mut con);
    let reply = request(
        &mut con,
        &[one_token()],
        &idem(key2, "owner-b", "fp-2", MINUTE),
    );
    let slop = now_ms(&mut con) - before;
    let Reply::Decided(Decision {
        admitted: false,
        limits,
    }) = reply
    else {
        panic!("the bucket is empty: expected verdict 0, got {reply:?}")
    };
    let [v] = limits[..] else {
        panic!("one verdict for one limit: {limits:?}")
    };
    // The token is due one minute after the charge at `t`; the script's clock
    // lies within [before, before + slop].
    assert_eq!((v.allowed, v.remaining), (false, 0));
    assert_within(
        "retry_ms",
        v.retry_ms,
        MINUTE - (before + slop - t),
        MINUTE - (before - t),
    );
    assert_eq!(
        v.reset_ms, v.retry_ms,
        "a rejection's reset equals its retry"
    );

    assert!(!exists(&mut con, key2), "a rejected request takes no lock");
    assert_eq!(bucket_bytes(&mut con, BUCKET), bucket, "bucket unchanged");
    // Rejected again: still no lock, so the key is not busy.
    assert!(matches!(
        request(
            &mut con,
            &[one_token()],
            &idem(key2, "owner-c", "fp-2", MINUTE)
        ),
        Reply::Decided(Decision {
            admitted: false,
            ..
        })
    ));
    assert!(!exists(&mut con, key2));
}

// ---------------------------------------------------------------------------
// Concurrency

#[test]
fn concurrent_acquires_of_one_key_admit_exactly_one() {
    const THREADS: usize = 50;
    let (redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:idem:race";
    assert_eq!(script::load(&mut con, &RATELIMIT), RATELIMIT.sha1);
    // Redis' clock before any call: the lock is set after it.
    let t0 = now_ms(&mut con);

    // Every connection is open before any thread starts, so none fails after
    // others are waiting at the barrier.
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let mut con = redis.conn_bounded();
            let barrier = Arc::clone(&barrier);
            let owner = format!("owner-{i}");
            std::thread::spawn(move || {
                let cmd = script::with_limits(
                    script::evalsha(&RATELIMIT),
                    &[],
                    Some(&idem(key, &owner, "fp-1", MINUTE)),
                );
                barrier.wait();
                let v: Value = cmd.query(&mut con).map_err(|e| e.to_string())?;
                Ok::<_, String>((owner, script::parse(v)))
            })
        })
        .collect();

    let mut winners = Vec::new();
    let mut busy = Vec::new();
    for h in handles {
        match h.join().unwrap() {
            Ok((owner, Reply::Decided(d))) => {
                assert!(d.admitted && d.limits.is_empty(), "{owner}: {d:?}");
                winners.push(owner);
            }
            Ok((_, Reply::Busy(ms))) => busy.push(ms),
            Ok((owner, other)) => panic!("{owner} got {other:?}"),
            Err(e) => panic!("a racing call failed: {e}"),
        }
    }
    assert_eq!(
        (winners.len(), busy.len()),
        (1, THREADS - 1),
        "winners: {winners:?}"
    );
    // Every busy answer is what is left of the winner's full minute: the
    // lock was set after `t0` and each answer given before `t1`.
    let t1 = now_ms(&mut con);
    for ms in busy {
        assert_within("busy PTTL", ms, MINUTE - (t1 - t0), MINUTE);
    }
    assert_eq!(hash(&mut con, key), in_progress(&winners[0], "fp-1"));
    assert_expires_in(&mut con, key, MINUTE, t0);
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
    let (_redis, mut con) = support::Redis::start_with_conn();
    let (k1, k2, k3) = ("t:{x}:idem:k1", "t:{x}:idem:k2", "t:{x}:idem:k3");
    let limits = [tb(BUCKET, 10, 1, MINUTE), sw("t:{x}:sw:w1", 10, MINUTE)];

    assert!(matches!(
        request(&mut con, &limits, &idem(k1, "owner-a", "fp-1", MINUTE)),
        Reply::Decided(Decision { admitted: true, .. })
    ));
    assert_every_key_expires(&mut con, "a keyed request with two limits");
    assert!(matches!(
        request(&mut con, &[], &idem(k2, "owner-b", "fp-2", MINUTE)),
        Reply::Decided(Decision { admitted: true, .. })
    ));
    assert!(matches!(
        request(&mut con, &limits, &idem(k3, "owner-c", "fp-3", MINUTE)),
        Reply::Decided(Decision { admitted: true, .. })
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
    let (_redis, mut con) = support::Redis::start_with_conn();
    for s in [&*IDEM_COMPLETE, &*IDEM_RELEASE] {
        assert_eq!(script::load(&mut con, s), s.sha1);
    }
}
