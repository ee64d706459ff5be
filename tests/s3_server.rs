//! The S3 server the harness starts (moto_server, tests/support/s3.rs) really
//! verifies AWS Signature V4, and stores objects byte for byte.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::s3::S3;

#[test]
fn rejects_requests_signed_with_the_wrong_secret() {
    let s3 = S3::start();
    s3.put("k", b"v");
    let wrong = format!("{}x", s3.secret_access_key);
    for (cmd, stdin) in [("get", None), ("put", Some(&b"w"[..])), ("delete", None)] {
        let out = s3.ctl(cmd, &["k", &s3.access_key_id, &wrong], stdin);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{cmd}: {err}");
        assert!(err.starts_with("403 SignatureDoesNotMatch"), "{cmd}: {err}");
    }
    let out = s3.ctl(
        "list",
        &["AKIAAAAAAAAAAAAAAAAA", &s3.secret_access_key],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("403 InvalidAccessKeyId"), "{err}");
    // Nothing the rejected requests asked for happened.
    assert_eq!(s3.get("k").as_deref(), Some(&b"v"[..]));
}

#[test]
fn stores_and_returns_objects_byte_for_byte() {
    let s3 = S3::start();
    let body: Vec<u8> = (0..300 * 1024u32)
        .map(|i| (i * 7 + i / 256) as u8)
        .collect();
    assert!(std::str::from_utf8(&body).is_err());
    s3.put("idem/a b=c", &body);
    assert_eq!(
        s3.keys(),
        vec![("idem/a b=c".to_string(), body.len() as u64)]
    );
    assert_eq!(s3.get("idem/a b=c").unwrap(), body);
    s3.put("idem/a b=c", b"other");
    assert_eq!(s3.get("idem/a b=c").unwrap(), b"other");
    s3.delete("idem/a b=c");
    assert_eq!(s3.keys(), vec![]);
}

#[test]
fn unknown_objects_are_missing() {
    let s3 = S3::start();
    assert_eq!(s3.get("never-written"), None);
    s3.delete("never-written");
}

#[test]
fn a_restart_loses_objects_but_keeps_bucket_and_credentials() {
    let mut s3 = S3::start();
    s3.put("k", b"v");
    let rules = s3.lifecycle(1, "idem/");
    assert_eq!(rules["Rules"][0]["Expiration"]["Days"], 1, "{rules}");
    s3.stop();
    s3.restart();
    assert_eq!(s3.get("k"), None);
    s3.put("k", b"again");
    assert_eq!(s3.keys(), vec![("k".to_string(), 5)]);
}
