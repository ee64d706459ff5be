//! Idempotency keys without the host: key validation, the record's Redis key,
//! the request fingerprint and the stored-headers encoding.

use sha2::{Digest, Sha256};

use crate::codec::hex;
use crate::config::Idempotency;
use crate::keys::push_value;

/// Longest key accepted (draft-ietf-httpapi-idempotency-key-header leaves the
/// length to the resource; 255 keeps keys UUID-sized and records small).
pub const MAX_KEY_LEN: usize = 255;

/// Validates an `Idempotency-Key` value and returns the key itself.
///
/// The draft defines the field as a Structured Field String (`"…"`, with `\"`
/// and `\\` escapes); bare printable ASCII, as most clients send it, is
/// accepted too. Empty, over-long, non-ASCII or control characters are not.
pub fn parse_key(raw: &[u8]) -> Result<Vec<u8>, String> {
    let raw = trim_ows(raw);
    let key = if raw.first() == Some(&b'"') {
        unquote(raw)?
    } else {
        if let Some(b) = raw.iter().find(|b| !(0x21..=0x7e).contains(*b)) {
            return Err(format!(
                "the key contains byte 0x{b:02x}; use printable ASCII, or a quoted string"
            ));
        }
        raw.to_vec()
    };
    if key.is_empty() {
        return Err("the key is empty".to_string());
    }
    if key.len() > MAX_KEY_LEN {
        return Err(format!("the key is longer than {MAX_KEY_LEN} bytes"));
    }
    Ok(key)
}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

/// RFC 8941 sf-string: `"` printable ASCII with `\"` and `\\` escapes `"`.
fn unquote(raw: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 1;
    while i < raw.len() {
        match raw[i] {
            b'\\' => match raw.get(i + 1) {
                Some(&c @ (b'"' | b'\\')) => {
                    out.push(c);
                    i += 2;
                }
                _ => return Err("a quoted key may only escape '\"' and '\\'".to_string()),
            },
            b'"' => {
                if i + 1 != raw.len() {
                    return Err("text after the quoted key".to_string());
                }
                return Ok(out);
            }
            c if (0x20..=0x7e).contains(&c) => {
                out.push(c);
                i += 1;
            }
            c => return Err(format!("the key contains byte 0x{c:02x}")),
        }
    }
    Err("the quoted key is not terminated".to_string())
}

/// SHA-256 over method, path (with query) and body, each length-prefixed so
/// no two requests share a fingerprint by shifting bytes between fields.
pub fn fingerprint(method: &str, path: &[u8], body: &[u8]) -> String {
    let mut h = Sha256::new();
    for field in [method.as_bytes(), path, body] {
        h.update((field.len() as u64).to_be_bytes());
        h.update(field);
    }
    hex(&h.finalize())
}

/// `<prefix>:idem:{<tag>}:<rule>:<tenant descriptor>:<len>:<key>`
pub fn record_key(
    prefix: &str,
    tag: &str,
    rule: &Idempotency,
    tenant: &[u8],
    key: &[u8],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        prefix.len() + tag.len() + rule.name.len() + tenant.len() + key.len() + 24,
    );
    out.extend_from_slice(prefix.as_bytes());
    out.extend_from_slice(b":idem:{");
    out.extend_from_slice(tag.as_bytes());
    out.extend_from_slice(b"}:");
    out.extend_from_slice(rule.name.as_bytes());
    out.push(b':');
    out.extend_from_slice(tenant);
    out.push(b':');
    // Keys are at most 255 bytes, so push_value keeps them verbatim.
    push_value(&mut out, key);
    out
}

/// Stored headers: `<len>:<name><len>:<value>` repeated (binary-safe, no
/// escaping, and cheap to read back).
pub fn encode_headers(headers: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        push_value_raw(&mut out, name.as_bytes());
        push_value_raw(&mut out, value);
    }
    out
}

fn push_value_raw(out: &mut Vec<u8>, v: &[u8]) {
    out.extend_from_slice(v.len().to_string().as_bytes());
    out.push(b':');
    out.extend_from_slice(v);
}

pub fn decode_headers(mut raw: &[u8]) -> Result<Vec<(String, Vec<u8>)>, String> {
    fn take<'a>(raw: &mut &'a [u8]) -> Result<&'a [u8], String> {
        let colon = raw
            .iter()
            .position(|&b| b == b':')
            .ok_or("stored headers: missing length")?;
        let len: u64 = std::str::from_utf8(&raw[..colon])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or("stored headers: bad length")?;
        // A length past what this target can address (wasm32: 2^32) is
        // longer than any input it holds: truncated, as on 64 bits.
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        let rest = &raw[colon + 1..];
        if rest.len() < len {
            return Err("stored headers: truncated".to_string());
        }
        let (v, tail) = rest.split_at(len);
        *raw = tail;
        Ok(v)
    }
    let mut out = Vec::new();
    while !raw.is_empty() {
        let name = take(&mut raw)?;
        let value = take(&mut raw)?;
        out.push((String::from_utf8_lossy(name).into_owned(), value.to_vec()));
    }
    Ok(out)
}

/// A stored response's header fields and trailers (a gRPC call's status is
/// in its trailers) in the one `h` field of the record: the headers, then,
/// when there are trailers, a pair with an empty name (which no header can
/// have) and the trailers. A record without that pair has no trailers, as
/// every record written before trailers were kept.
pub fn encode_response_fields(
    headers: &[(String, Vec<u8>)],
    trailers: &[(String, Vec<u8>)],
) -> Vec<u8> {
    let mut out = encode_headers(headers);
    if !trailers.is_empty() {
        push_value_raw(&mut out, b"");
        push_value_raw(&mut out, b"");
        out.extend_from_slice(&encode_headers(trailers));
    }
    out
}

/// Adds trailers to headers captured for [`encode_headers`], so that the
/// result encodes as [`encode_response_fields`] does.
pub fn append_trailers(headers: &mut Vec<(String, Vec<u8>)>, trailers: Vec<(String, Vec<u8>)>) {
    if !trailers.is_empty() {
        headers.push((String::new(), Vec::new()));
        headers.extend(trailers);
    }
}

/// The headers and the trailers of [`encode_response_fields`].
pub type ResponseFields = (Vec<(String, Vec<u8>)>, Vec<(String, Vec<u8>)>);

pub fn decode_response_fields(raw: &[u8]) -> Result<ResponseFields, String> {
    let mut headers = decode_headers(raw)?;
    match headers.iter().position(|(n, _)| n.is_empty()) {
        Some(at) => {
            let trailers = headers.split_off(at + 1);
            headers.pop();
            Ok((headers, trailers))
        }
        None => Ok((headers, Vec::new())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailers_are_kept_apart_from_headers_in_one_field() {
        let h = vec![("content-type".to_string(), b"application/grpc".to_vec())];
        let t = vec![
            ("grpc-status".to_string(), b"0".to_vec()),
            ("grpc-status-details-bin".to_string(), b"\0\xff".to_vec()),
        ];
        let both = encode_response_fields(&h, &t);
        assert_eq!(decode_response_fields(&both).unwrap(), (h.clone(), t));
        let plain = encode_response_fields(&h, &[]);
        assert_eq!(
            plain,
            encode_headers(&h),
            "a record without trailers is as before"
        );
        assert_eq!(decode_response_fields(&plain).unwrap(), (h, Vec::new()));
    }

    #[test]
    fn accepts_bare_and_quoted_keys() {
        assert_eq!(parse_key(b"abc-123").unwrap(), b"abc-123");
        assert_eq!(
            parse_key(b" \"8e03978e-40d5-43e8-bc93-6894a57f9324\" ").unwrap(),
            b"8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
        assert_eq!(parse_key(br#""a \"b\" \\ c""#).unwrap(), br#"a "b" \ c"#);
        assert_eq!(parse_key(&[b'k'; 255]).unwrap().len(), 255);
    }

    #[test]
    fn rejects_malformed_keys() {
        for bad in [
            &b""[..],
            b"   ",
            b"\"\"",
            b"a b",
            b"tab\there",
            b"nul\x00",
            b"del\x7f",
            "ünï".as_bytes(),
            b"\"unterminated",
            b"\"x\"y",
            b"\"bad \\n escape\"",
            b"\"ctl \x01\"",
            &[b'k'; 256],
        ] {
            assert!(
                parse_key(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn fingerprints_differ_when_any_field_differs() {
        let base = fingerprint("POST", b"/pay", b"{}");
        assert_eq!(base.len(), 64);
        assert_eq!(base, fingerprint("POST", b"/pay", b"{}"));
        assert_ne!(base, fingerprint("POST", b"/pay", b"{ }"));
        assert_ne!(base, fingerprint("PUT", b"/pay", b"{}"));
        assert_ne!(base, fingerprint("POST", b"/pay?x=1", b"{}"));
        assert_ne!(
            fingerprint("POST", b"/a", b"b"),
            fingerprint("POST", b"/ab", b"")
        );
    }

    #[test]
    fn headers_round_trip_byte_for_byte() {
        let h = vec![
            ("content-type".to_string(), b"application/json".to_vec()),
            ("x-odd".to_string(), b"1:2:3 \xff".to_vec()),
            ("x-empty".to_string(), Vec::new()),
        ];
        assert_eq!(decode_headers(&encode_headers(&h)).unwrap(), h);
        assert!(decode_headers(b"5:abc").is_err());
        assert!(decode_headers(b"x:abc").is_err());
        assert!(decode_headers(b"3:abc").is_err(), "a name without a value");
    }
}
