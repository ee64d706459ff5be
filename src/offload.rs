//! Large idempotent responses in an S3-compatible object store, without the
//! host: the object's key, the signed PUT and GET, and what their answers
//! mean. Redis keeps only the record with the object's key, length and
//! SHA-256; the body never enters Redis memory.

use std::time::Duration;

use crate::codec::sha256_hex;
use crate::config::ObjectStore;
use crate::sigv4::{self, Request};

/// What the COMPLETED record keeps of an offloaded body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectRef {
    pub key: String,
    /// Lower-case hex SHA-256 of the body (also the upload's signed payload
    /// hash, which S3 checks against the body it receives).
    pub sha256: String,
    pub len: usize,
}

/// The object's key: `<keyPrefix><rule>/<expiry>/<record digest>-<owner>`.
///
/// The expiry (UTC, `YYYYMMDDTHHMMSSZ`) is when the record that points at
/// the object is gone at the latest, so a sweeper that lists keys can delete
/// by it where the store has no lifecycle rules. The record key's digest
/// keeps tenants' keys out of object names; the owner token keeps a second
/// execution (after a lock expired) from overwriting the first one's object.
pub fn object_key(
    store: &ObjectStore,
    rule: &str,
    record_key: &[u8],
    owner: &str,
    expires_unix: u64,
) -> String {
    let digest = sha256_hex(record_key);
    let (stamp, _) = sigv4::amz_date(expires_unix);
    format!("{}{rule}/{stamp}/{digest}-{owner}", store.key_prefix)
}

/// When the record written after this upload expires at the latest, by the
/// proxy's clock: the record's TTL starts when the COMPLETED script runs,
/// which is within `within` (the upload's and the write's deadlines) from
/// `now`. Rounded up to the second.
pub fn expires_at(now: Duration, record_ttl_ms: u64, within: Duration) -> u64 {
    let ms = now
        .as_millis()
        .saturating_add(u128::from(record_ttl_ms))
        .saturating_add(within.as_millis());
    u64::try_from(ms.div_ceil(1000)).unwrap_or(u64::MAX)
}

/// Days for a bucket lifecycle expiration rule that never removes an object
/// before its record: S3 counts whole days from creation and rounds up to
/// the next midnight UTC, and one day is added for the upload's own delay
/// and clock skew.
pub fn lifecycle_days(record_ttl_ms: u64) -> u64 {
    record_ttl_ms.div_ceil(86_400_000) + 1
}

/// Headers of a signed request: pseudo-headers first, then what SigV4 adds.
fn signed(
    store: &ObjectStore,
    method: &str,
    key: &str,
    payload_sha256: &str,
    extra: &[(&str, &str)],
    now: Duration,
) -> Vec<(String, String)> {
    let path = sigv4::object_path(&store.bucket, key);
    let request = Request {
        method,
        host: &store.authority,
        path: &path,
        query: &[],
        headers: extra,
        payload_sha256,
    };
    let mut headers = vec![
        (":method".to_string(), method.to_string()),
        (":path".to_string(), path.clone()),
        (":authority".to_string(), store.authority.clone()),
    ];
    headers.extend(extra.iter().map(|(n, v)| (n.to_string(), v.to_string())));
    headers.extend(sigv4::sign(
        &request,
        &store.credentials,
        &store.region,
        "s3",
        now.as_secs(),
    ));
    headers
}

/// The upload: the body's SHA-256 is the signed payload hash, so a body
/// changed on the way fails the store's signature check.
pub fn put_headers(
    store: &ObjectStore,
    object: &ObjectRef,
    now: Duration,
) -> Vec<(String, String)> {
    signed(
        store,
        "PUT",
        &object.key,
        &object.sha256,
        &[("content-type", "application/octet-stream")],
        now,
    )
}

pub fn get_headers(
    store: &ObjectStore,
    object: &ObjectRef,
    now: Duration,
) -> Vec<(String, String)> {
    signed(store, "GET", &object.key, &sha256_hex(b""), &[], now)
}

/// What an object fetch for a replay came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched {
    /// The stored body, length and checksum verified.
    Body(Vec<u8>),
    /// The store says the object does not exist (deleted, or expired early).
    Missing,
    /// The store returned bytes that are not the stored body.
    Corrupt(String),
    /// No answer, or an error answer (signature refused, store down).
    Failed(String),
}

/// Reads a fetch's answer. `status` is `None` when the call itself failed.
pub fn check_fetch(status: Option<u32>, body: Vec<u8>, want: &ObjectRef) -> Fetched {
    match status {
        Some(200) => {}
        // S3 answers 404 (NoSuchKey) for a missing object when the caller may
        // list the bucket; without s3:ListBucket it says 403 instead, which
        // cannot be told from a refused signature and counts as a failure.
        Some(404) => return Fetched::Missing,
        Some(s) => return Fetched::Failed(format!("object store answered HTTP {s}")),
        None => return Fetched::Failed("object store call failed or timed out".to_string()),
    }
    if body.len() != want.len {
        return Fetched::Corrupt(format!(
            "object is {} bytes, the record says {}",
            body.len(),
            want.len
        ));
    }
    let got = sha256_hex(&body);
    if got != want.sha256 {
        return Fetched::Corrupt(format!(
            "object's SHA-256 is {got}, the record says {}",
            want.sha256
        ));
    }
    Fetched::Body(body)
}

/// An upload stored the object only on 200: S3 answers PUT Object with 200
/// and nothing else; anything else (403 for a refused signature, 400 for a
/// bad digest, 5xx) leaves no object to point at.
pub fn check_put(status: Option<u32>) -> Result<(), String> {
    match status {
        Some(200) => Ok(()),
        Some(s) => Err(format!("object store answered HTTP {s}")),
        None => Err("object store call failed or timed out".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sigv4::Credentials;

    fn store() -> ObjectStore {
        ObjectStore {
            cluster: "objectstore".into(),
            authority: "127.0.0.1:9000".into(),
            bucket: "redis-guard".into(),
            region: "us-east-1".into(),
            key_prefix: "rg/".into(),
            timeout: Duration::from_secs(5),
            credentials: Credentials {
                access_key_id: "AKIDEXAMPLE".into(),
                secret_access_key: "secret".into(),
                session_token: None,
            },
        }
    }

    fn object(body: &[u8]) -> ObjectRef {
        ObjectRef {
            key: "rg/pay/20261203T000000Z/ab-cd".into(),
            sha256: sha256_hex(body),
            len: body.len(),
        }
    }

    #[test]
    fn object_keys_carry_rule_expiry_record_digest_and_owner() {
        // 2026-12-02T17:26:00Z
        let key = object_key(&store(), "pay", b"rg:idem:{t}:pay:x", "00ff", 1_796_232_360);
        let digest = sha256_hex(b"rg:idem:{t}:pay:x");
        assert_eq!(key, format!("rg/pay/20261202T172600Z/{digest}-00ff"));
        let other = object_key(&store(), "pay", b"rg:idem:{t}:pay:y", "00ff", 1_796_232_360);
        assert_ne!(key, other, "another record, another object");
        let again = object_key(&store(), "pay", b"rg:idem:{t}:pay:x", "0100", 1_796_232_360);
        assert_ne!(key, again, "another owner, another object");
    }

    #[test]
    fn the_expiry_is_never_before_the_records() {
        let now = Duration::from_millis(1_000_000_500);
        // TTL 1000 ms + timeout 5000 ms after 1_000_000.5 s, rounded up.
        assert_eq!(expires_at(now, 1000, Duration::from_secs(5)), 1_000_007);
        assert_eq!(
            expires_at(Duration::from_secs(10), 1000, Duration::ZERO),
            11
        );
    }

    #[test]
    fn lifecycle_days_cover_the_record_ttl() {
        assert_eq!(lifecycle_days(1000), 2);
        assert_eq!(lifecycle_days(86_400_000), 2);
        assert_eq!(lifecycle_days(86_400_001), 3);
        assert_eq!(lifecycle_days(30 * 86_400_000), 31);
    }

    #[test]
    fn uploads_sign_the_body_hash_and_fetches_the_empty_hash() {
        let body = b"large body";
        let obj = object(body);
        let now = Duration::from_secs(1_796_232_360);
        let put = put_headers(&store(), &obj, now);
        let get = |h: &[(String, String)], n: &str| {
            h.iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        assert_eq!(get(&put, ":method"), "PUT");
        assert_eq!(
            get(&put, ":path"),
            "/redis-guard/rg/pay/20261203T000000Z/ab-cd"
        );
        assert_eq!(get(&put, ":authority"), "127.0.0.1:9000");
        assert_eq!(get(&put, "x-amz-content-sha256"), obj.sha256);
        assert_eq!(get(&put, "x-amz-date"), "20261202T172600Z");
        let auth = get(&put, "authorization");
        assert!(auth.starts_with(
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20261202/us-east-1/s3/aws4_request, "
        ));
        assert!(auth.contains("content-type;host;x-amz-content-sha256;x-amz-date"));
        assert!(!auth.contains("secret"));
        let fetch = get_headers(&store(), &obj, now);
        assert_eq!(get(&fetch, ":method"), "GET");
        assert_eq!(get(&fetch, "x-amz-content-sha256"), sha256_hex(b""));
    }

    #[test]
    fn fetches_are_verified_before_they_are_served() {
        let body = b"the stored body".to_vec();
        let obj = object(&body);
        assert_eq!(
            check_fetch(Some(200), body.clone(), &obj),
            Fetched::Body(body)
        );
        assert_eq!(check_fetch(Some(404), Vec::new(), &obj), Fetched::Missing);
        assert!(matches!(
            check_fetch(Some(200), b"the stored bodY".to_vec(), &obj),
            Fetched::Corrupt(_)
        ));
        assert!(matches!(
            check_fetch(Some(200), b"short".to_vec(), &obj),
            Fetched::Corrupt(_)
        ));
        assert!(matches!(
            check_fetch(Some(403), Vec::new(), &obj),
            Fetched::Failed(_)
        ));
        assert!(matches!(
            check_fetch(Some(503), Vec::new(), &obj),
            Fetched::Failed(_)
        ));
        assert!(matches!(
            check_fetch(None, Vec::new(), &obj),
            Fetched::Failed(_)
        ));
    }

    #[test]
    fn only_a_200_stores_an_object() {
        assert!(check_put(Some(200)).is_ok());
        for s in [Some(201), Some(400), Some(403), Some(500), Some(503), None] {
            assert!(check_put(s).is_err(), "{s:?}");
        }
    }
}
