//! Redis key building.
//!
//! Rate-limit keys look like `rg:rl:{9f86d081884c7d65}:per-user:tb.10.1.1000:5:alice`:
//! prefix, kind, Redis Cluster hash tag, limit name, algorithm signature, descriptor.
//!
//! * The hash tag is shared by every key one request touches, so one script
//!   call never crosses slots (no CROSSSLOT in Redis Cluster). It is a digest
//!   of the configured `hashTag` parts: never empty (an empty `{}` would hash
//!   the whole key) and never containing a brace.
//! * The signature carries every parameter that shapes the stored state, so a
//!   reconfigured limit starts from a fresh key.
//! * Descriptor values are client bytes and stay as they are; each is
//!   length-prefixed so no two descriptors can produce the same key, and a
//!   value longer than [`MAX_RAW_VALUE`] is replaced by its SHA-256 so keys
//!   stay small whatever the client sends.

use sha2::{Digest, Sha256};

use crate::codec::{hex, sha256_hex};
use crate::config::{Config, Limit, Part};
use crate::request::{client_ip, RequestLine, RequestView};

/// Longest descriptor value kept verbatim in a key.
pub const MAX_RAW_VALUE: usize = 128;

/// Appends one descriptor value: `<len>:<bytes>`, or `#<sha256 hex>` when long.
pub fn push_value(out: &mut Vec<u8>, value: &[u8]) {
    if value.len() > MAX_RAW_VALUE {
        out.push(b'#');
        out.extend_from_slice(sha256_hex(value).as_bytes());
    } else {
        out.extend_from_slice(value.len().to_string().as_bytes());
        out.push(b':');
        out.extend_from_slice(value);
    }
}

/// The value of one part for this request; `None` when a header is missing.
pub fn part_value(part: &Part, line: &RequestLine, view: &dyn RequestView) -> Option<Vec<u8>> {
    match part {
        Part::Header(name) => view.header(name),
        Part::Literal(v) => Some(v.as_bytes().to_vec()),
        Part::ClientAddress => view
            .client_address()
            .map(|a| client_ip(&a).as_bytes().to_vec()),
        Part::Path => Some(line.path.clone()),
        Part::Method => Some(line.method.as_bytes().to_vec()),
    }
}

/// The encoded descriptor of `parts`, or `None` when a header it names is
/// missing (as with Envoy's rate-limit actions, the limit then does not apply).
pub fn descriptor(parts: &[Part], line: &RequestLine, view: &dyn RequestView) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push(b':');
        }
        push_value(&mut out, &part_value(part, line, view)?);
    }
    Some(out)
}

/// The hash tag of this request (16 hex digits), from the configured parts; a
/// missing header counts as an empty value so the tag always exists.
pub fn hash_tag(config: &Config, line: &RequestLine, view: &dyn RequestView) -> String {
    if let Some(tag) = &config.static_tag {
        return tag.clone();
    }
    let mut enc = Vec::new();
    for part in &config.hash_tag {
        push_value(&mut enc, &part_value(part, line, view).unwrap_or_default());
        enc.push(b':');
    }
    let digest = Sha256::digest(&enc);
    hex(&digest[..8])
}

/// The hash tag of a configuration whose `hashTag` depends on no request
/// (none, or literals only): computed once, not per request.
pub fn static_hash_tag(parts: &[Part]) -> Option<String> {
    let mut enc = Vec::new();
    for part in parts {
        let Part::Literal(v) = part else {
            return None;
        };
        push_value(&mut enc, v.as_bytes());
        enc.push(b':');
    }
    Some(hex(&Sha256::digest(&enc)[..8]))
}

/// Where a limit key's record lives in a fixed table of `slots` entries of
/// Envoy's shared data (which is never freed, so tables do not grow with the
/// keys clients invent): the shared-data key `<table>/<index>`, and 16 bytes
/// of the key's digest, stored in the record so a collision never answers
/// for another key.
pub fn shared_slot(table: &str, slots: u32, limit_key: &[u8]) -> (String, [u8; 16]) {
    let full = Sha256::digest(limit_key);
    let mut digest = [0u8; 16];
    digest.copy_from_slice(&full[..16]);
    let index = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]) % slots;
    (format!("{table}/{index}"), digest)
}

/// Reads the `i`th big-endian u64 of a fixed-layout record after its
/// 16-byte digest (the caller checked the length).
pub fn record_u64(bytes: &[u8], i: usize) -> u64 {
    let at = 16 + 8 * i;
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_be_bytes(b)
}

pub fn rate_limit_key(prefix: &str, tag: &str, limit: &Limit, descriptor: &[u8]) -> Vec<u8> {
    let mut key =
        Vec::with_capacity(prefix.len() + tag.len() + limit.key_infix.len() + descriptor.len() + 8);
    key.extend_from_slice(prefix.as_bytes());
    key.extend_from_slice(b":rl:{");
    key.extend_from_slice(tag.as_bytes());
    key.push(b'}');
    key.extend_from_slice(limit.key_infix.as_bytes());
    key.extend_from_slice(descriptor);
    key
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::fake::FakeRequest;

    #[test]
    fn a_hash_tag_of_literals_is_computed_once_and_equals_the_per_request_one() {
        for tags in [r#"[]"#, r#"[{"literal":"eu"},{"literal":"v2"}]"#] {
            let json = format!(r#"{{"redis":{{"cluster":"w"}},"hashTag":{tags}}}"#);
            let mut config = crate::config::Config::parse(json.as_bytes()).unwrap();
            let fixed = config.static_tag.clone().expect("precomputed");
            config.static_tag = None;
            let req = FakeRequest::default();
            let line = RequestLine::read(&req);
            assert_eq!(hash_tag(&config, &line, &req), fixed);
        }
        let json = br#"{"redis":{"cluster":"w"},"hashTag":[{"header":"x-t"}],
            "limits":[{"name":"a","descriptor":[{"header":"x-t"}],
            "tokenBucket":{"capacity":1,"refill":1,"periodMs":1000}}]}"#;
        assert_eq!(crate::config::Config::parse(json).unwrap().static_tag, None);
    }

    #[test]
    fn length_prefixes_keep_distinct_descriptors_apart() {
        let mut a = Vec::new();
        push_value(&mut a, b"a:1");
        a.push(b':');
        push_value(&mut a, b"2");
        let mut b = Vec::new();
        push_value(&mut b, b"a");
        b.push(b':');
        push_value(&mut b, b"1:2");
        assert_ne!(a, b);
        assert_eq!(a, b"3:a:1:1:2");
    }

    #[test]
    fn long_values_are_replaced_by_their_digest() {
        let long = vec![b'x'; MAX_RAW_VALUE + 1];
        let mut out = Vec::new();
        push_value(&mut out, &long);
        assert_eq!(out.len(), 65);
        assert_eq!(out[0], b'#');
        let mut exact = Vec::new();
        push_value(&mut exact, &long[..MAX_RAW_VALUE]);
        assert_eq!(exact.len(), 4 + MAX_RAW_VALUE);
    }

    #[test]
    fn missing_header_means_no_descriptor() {
        let r = FakeRequest::new("GET", "/x");
        let line = RequestLine::read(&r);
        let parts = vec![Part::Header("x-user".into())];
        assert_eq!(descriptor(&parts, &line, &r), None);
        let r = r.with("x-user", b"al/ice");
        assert_eq!(descriptor(&parts, &line, &r), Some(b"6:al/ice".to_vec()));
    }

    #[test]
    fn client_address_part_drops_the_port() {
        let r = FakeRequest::new("GET", "/x").addr("127.0.0.9:4242");
        let line = RequestLine::read(&r);
        assert_eq!(
            descriptor(&[Part::ClientAddress, Part::Method, Part::Path], &line, &r),
            Some(b"9:127.0.0.9:3:GET:2:/x".to_vec())
        );
    }
}
