//! Large idempotent responses in an object store, end to end: a real Envoy
//! (V8, two workers) running the filter, real Redis and Webdis, the demo
//! upstream counting executions, and moto's S3 server verifying every
//! request's AWS Signature V4 (tests/support/s3.rs). The filter signs its own
//! PUTs and GETs; the tests look at the bucket with an independent client.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use sha2::{Digest, Sha256};
use support::s3::S3;
use support::*;

const THRESHOLD: usize = 64 << 10;
const RECORD_TTL_MS: u64 = 3_600_000;

/// Credentials in the config as given (`None`: from Envoy's environment).
fn config(s3: &S3, secret: Option<&str>) -> String {
    let credentials = match secret {
        Some(secret) => format!(
            r#"{{"accessKeyId":"{}","secretAccessKey":"{secret}"}}"#,
            s3.access_key_id
        ),
        None => r#"{"fromEnvironment":true}"#.to_string(),
    };
    filter_config(3000)
        .object_store(&format!(
            r#"{{"cluster":"objectstore","authority":"127.0.0.1:{port}",
              "bucket":"{bucket}","region":"us-east-1","keyPrefix":"idem/","timeoutMs":10000,
              "credentials":{credentials}}}"#,
            port = s3.port,
            bucket = s3.bucket,
        ))
        .idempotency(&format!(
            r#"[{{"name":"pay","match":{{"pathPrefix":"/pay"}},
              "tenant":[{{"header":"x-tenant"}}],"storeHeaders":["content-type"],
              "recordTtlMs":{RECORD_TTL_MS},
              "maxStoredBodyBytes":16777216,"offloadAboveBytes":{THRESHOLD}}}]"#
        ))
        .build()
}

struct World {
    s3: S3,
    redis: Redis,
    webdis: Webdis,
    upstream: Upstream,
}

impl World {
    fn start() -> World {
        let redis = Redis::start();
        let webdis = Webdis::start(redis.port);
        World {
            s3: S3::start(),
            webdis,
            redis,
            upstream: Upstream::start(),
        }
    }

    /// An Envoy whose filter signs with `secret` (the right one by default).
    fn envoy(&self, secret: Option<&str>) -> Envoy {
        let secret = secret.unwrap_or(&self.s3.secret_access_key);
        self.envoy_with(&config(&self.s3, Some(secret)), &[])
    }

    fn envoy_with(&self, config: &str, env: &[(&str, &str)]) -> Envoy {
        Envoy::start_full(
            config,
            self.webdis.port,
            self.upstream.port,
            Some(self.s3.port),
            env,
            |yaml| yaml,
        )
    }

    /// The idempotency records in Redis.
    fn record_keys(&self) -> Vec<String> {
        let mut con = self.redis.conn();
        redis::cmd("KEYS").arg("rg:idem:*").query(&mut con).unwrap()
    }

    /// The one idempotency record in Redis: its key and fields.
    fn record(&self) -> (String, std::collections::HashMap<String, String>) {
        let keys = self.record_keys();
        assert_eq!(keys.len(), 1, "one record: {keys:?}");
        let fields = hash_fields(&mut self.redis.conn(), &keys[0])
            .into_iter()
            .collect();
        (keys[0].clone(), fields)
    }
}

/// A keyed POST whose upstream answers `bytes` pseudo-random bytes (another
/// execution would send other bytes).
fn pay(e: &Envoy, key: &str, bytes: usize) -> Resp {
    let n = bytes.to_string();
    http(
        "POST",
        &e.url("/pay/order"),
        &[
            ("idempotency-key", key),
            ("x-tenant", "acme"),
            ("x-upstream-binary-bytes", &n),
        ],
        Some(b"{\"amount\":10}"),
    )
}

/// A keyed POST that runs upstream, then its retry, which must replay it
/// exactly. Returns the first response.
fn run_then_replay(e: &Envoy, key: &str, bytes: usize) -> Resp {
    let first = pay(e, key, bytes);
    assert_eq!(first.status, 200);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(first.body.len(), bytes);
    let again = pay(e, key, bytes);
    assert_eq!(again.status, 200);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert!(again.body == first.body, "the replay is the stored body");
    first
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn memory_usage(world: &World, key: &str) -> u64 {
    let mut con = world.redis.conn();
    redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .arg("SAMPLES")
        .arg("0")
        .query(&mut con)
        .unwrap()
}

#[test]
fn a_large_response_runs_once_and_its_retries_replay_byte_for_byte_from_the_object_store() {
    let world = World::start();
    let e = world.envoy(None);
    let first = pay(&e, "order-1", 1 << 20);
    assert_eq!(first.status, 200);
    assert_eq!(first.body.len(), 1 << 20);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(world.upstream.executed(), 1);

    // The bucket holds the body, under the rule's prefix.
    let objects = world.s3.keys();
    assert_eq!(objects.len(), 1, "{objects:?}");
    let (object_key, size) = &objects[0];
    assert!(object_key.starts_with("idem/pay/"), "{object_key}");
    assert_eq!(*size, 1 << 20);
    assert_eq!(world.s3.get(object_key).unwrap(), first.body);

    // Redis holds the reference, not the body.
    let (_, fields) = world.record();
    assert_eq!(fields["s"], "C");
    assert_eq!(fields["b"], "");
    assert_eq!(&fields["ok"], object_key);
    assert_eq!(fields["oc"], sha256_hex(&first.body));
    assert_eq!(fields["ol"], (1 << 20).to_string());

    for _ in 0..2 {
        let again = pay(&e, "order-1", 1 << 20);
        assert_eq!(again.status, 200);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(
            again.header("content-type"),
            Some("application/octet-stream")
        );
        assert!(again.body == first.body, "the replay is the stored body");
    }
    assert_eq!(world.upstream.executed(), 1, "never run again");
    assert_eq!(e.counter("redis_guard.idempotency.offloaded"), 1);
    assert_eq!(e.counter("redis_guard.idempotency.stored"), 1);
    assert_eq!(e.counter("redis_guard.idempotency.object_fetched"), 2);
    assert_eq!(e.counter("redis_guard.idempotency.replayed"), 2);
    assert_eq!(e.counter("redis_guard.idempotency.offload_failed"), 0);

    // At the threshold the body stays in Redis: no second object.
    run_then_replay(&e, "order-2", THRESHOLD);
    assert_eq!(world.s3.keys().len(), 1);
    assert_eq!(e.counter("redis_guard.idempotency.offloaded"), 1);
    assert_eq!(e.counter("redis_guard.idempotency.object_fetched"), 2);
}

#[test]
fn the_redis_record_stays_small_whatever_the_body_size_and_outlives_no_object() {
    let world = World::start();
    // Credentials from Envoy's environment this time.
    let e = world.envoy_with(
        &config(&world.s3, None),
        &[
            ("AWS_ACCESS_KEY_ID", &world.s3.access_key_id),
            ("AWS_SECRET_ACCESS_KEY", &world.s3.secret_access_key),
        ],
    );
    let mut usage = Vec::new();
    // Same number of digits in each length, so the records differ in
    // nothing but the object key's digest and owner.
    for (i, bytes) in [1 << 20, 4 << 20].into_iter().enumerate() {
        let key = format!("big-{i}");
        run_then_replay(&e, &key, bytes);
        let mut con = world.redis.conn();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("rg:idem:*{key}"))
            .query(&mut con)
            .unwrap();
        assert_eq!(keys.len(), 1);
        usage.push(memory_usage(&world, &keys[0]));

        // The object's key carries when its record is gone at the latest:
        // never before the record's own expiry (Redis' clock; one machine).
        let fields: std::collections::HashMap<String, String> =
            hash_fields(&mut con, &keys[0]).into_iter().collect();
        let expiry = fields["ok"].split('/').nth(2).unwrap().to_string();
        let record_ends_ms = redis_now_ms(&mut con) + key_pttl(&mut con, &keys[0]);
        // The stamps are YYYYMMDDTHHMMSSZ: they sort as the instants do.
        let stamp = |ms: i64| redis_guard::sigv4::amz_date((ms / 1000) as u64).0;
        assert!(
            expiry >= stamp(record_ends_ms),
            "object expiry {expiry} before the record's end {}",
            stamp(record_ends_ms)
        );
        assert!(
            expiry <= stamp(record_ends_ms + 60_000),
            "object expiry {expiry} is the record's, not a guess ({})",
            stamp(record_ends_ms)
        );
    }
    assert_eq!(world.upstream.executed(), 2);
    assert_eq!(
        usage[0], usage[1],
        "the record does not grow with the body (1 MiB vs 4 MiB)"
    );
    // About 1 KiB: the object key is longer than Redis' 64-byte listpack
    // value limit, so the record is a small hashtable (984 B measured).
    assert!(usage[0] < 2048, "record of {} bytes", usage[0]);

    // At the rule's cap (16 MiB, the demo's): still one execution and an
    // exact replay through Envoy's callouts.
    run_then_replay(&e, "big-cap", 16 << 20);
    assert_eq!(world.upstream.executed(), 3);
    assert_eq!(e.counter("redis_guard.idempotency.offloaded"), 3);
}

#[test]
fn a_failed_upload_releases_the_key_so_the_retry_runs_again() {
    let mut world = World::start();
    let e = world.envoy(None);
    world.s3.stop();
    let first = pay(&e, "order-1", 256 << 10);
    assert_eq!(first.status, 200, "the client still gets the response");
    assert_eq!(first.body.len(), 256 << 10);
    assert_eq!(e.counter("redis_guard.idempotency.offload_failed"), 1);
    assert_eq!(e.counter("redis_guard.idempotency.released"), 1);
    assert_eq!(e.counter("redis_guard.idempotency.stored"), 0);
    assert_eq!(world.record_keys().len(), 0, "the lock is gone, no record");

    // The store is back: the retry runs (the first was never completed),
    // and from then on the key replays.
    world.s3.restart();
    let second = run_then_replay(&e, "order-1", 256 << 10);
    assert!(second.body != first.body, "a second execution");
    assert_eq!(world.upstream.executed(), 2);
    assert_eq!(e.counter("redis_guard.idempotency.offloaded"), 1);
}

#[test]
fn a_wrong_signature_key_stores_nothing_and_never_reruns_a_completed_key() {
    let world = World::start();
    let wrong_secret = "wJalrXUtnFEMI-wrong-secret-NEVER-LOGGED";
    let wrong = world.envoy(Some(wrong_secret));
    let right = world.envoy(None);
    for e in [&wrong, &right] {
        e.set_log_level("debug");
    }

    // Upload refused (403 SignatureDoesNotMatch): like a failed request.
    let first = pay(&wrong, "order-1", 128 << 10);
    assert_eq!(first.status, 200);
    assert_eq!(wrong.counter("redis_guard.idempotency.offload_failed"), 1);
    assert_eq!(world.record_keys().len(), 0);
    assert!(world.s3.keys().is_empty(), "nothing was stored");

    // Completed through the Envoy with the right key...
    let done = pay(&right, "order-2", 128 << 10);
    assert_eq!(done.status, 200);
    assert_eq!(world.upstream.executed(), 2);
    // ...a retry through the wrong one cannot fetch it: 503, not a re-run.
    for _ in 0..2 {
        let r = pay(&wrong, "order-2", 128 << 10);
        assert_eq!(r.status, 503);
        assert_eq!(r.header("retry-after"), Some("1"));
        assert_eq!(r.json()["storedResponse"], "unavailable");
    }
    assert_eq!(world.upstream.executed(), 2);
    assert_eq!(
        wrong.counter("redis_guard.idempotency.object_fetch_failed"),
        2
    );
    let replay = pay(&right, "order-2", 128 << 10);
    assert!(replay.body == done.body);
    assert_eq!(world.upstream.executed(), 2);

    // Debug logs of both Envoys: the secrets never appear.
    for e in [&wrong, &right] {
        let log = e.log();
        assert!(log.contains("redis-guard"), "the filter logged something");
        assert!(!log.contains(wrong_secret));
        assert!(!log.contains(&world.s3.secret_access_key));
    }
}

#[test]
fn a_deleted_or_altered_object_is_a_502_and_the_request_is_not_run_again() {
    let world = World::start();
    let e = world.envoy(None);
    let first = pay(&e, "order-1", 512 << 10);
    assert_eq!(first.status, 200);
    let (object_key, _) = world.s3.keys().pop().unwrap();

    // Same length, one byte different: the checksum catches it.
    let mut altered = first.body.clone();
    altered[1000] ^= 0x01;
    world.s3.put(&object_key, &altered);
    let r = pay(&e, "order-1", 512 << 10);
    assert_eq!(r.status, 502);
    assert_eq!(r.json()["storedResponse"], "corrupt");
    assert_eq!(e.counter("redis_guard.idempotency.object_corrupt"), 1);

    // Deleted behind the filter's back.
    world.s3.delete(&object_key);
    for _ in 0..2 {
        let r = pay(&e, "order-1", 512 << 10);
        assert_eq!(r.status, 502);
        assert_eq!(r.json()["storedResponse"], "missing");
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
    }
    assert_eq!(e.counter("redis_guard.idempotency.object_missing"), 2);
    assert_eq!(
        world.upstream.executed(),
        1,
        "the completed key never re-runs"
    );
    let (_, fields) = world.record();
    assert_eq!(fields["s"], "C", "the record stays until its TTL");
}
