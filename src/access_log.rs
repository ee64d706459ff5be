//! What one request's decision leaves in Envoy's access log, without the
//! host: the record the filter writes to its filter state as the stream
//! ends (`%FILTER_STATE(wasm.redis_guard:PLAIN)%`), one JSON object:
//!
//! `{"verdict": …, "limit": …, "remaining": …, "key": …, "idempotency": …}`
//!
//! * `verdict`: `admitted`, `rejected`, `shadow_rejected` (admitted; a
//!   shadow limit would have rejected), `cached_rejection` (the over-limit
//!   cache answered), `leased` (admitted from this Envoy's leased tokens),
//!   `failure_allowed` / `failure_denied` / `failure_local` (Redis could not
//!   decide: the failure mode), `refused` (400 or 413 before any decision),
//!   `denied` (403, a deny rule), `replayed`, `conflict` (409), `mismatch` (422), `replay_failed` (a
//!   completed key's response could not be served);
//! * `limit`: the deciding limit: the first enforced one that rejected, or
//!   the one with the fewest units left after an admission;
//! * `remaining`: that limit's units left;
//! * `key`: that limit's Redis key as the configuration's `accessLog.key`
//!   says (a digest by default: keys hold descriptor values);
//! * `idempotency`: for a keyed request that ran, what became of its key:
//!   `executed` (forwarded; the response never came back whole to the
//!   filter), `stored`, `released`, `store_failed`, `abandoned` (the client
//!   left while the upstream worked), `unguarded` (forwarded without the
//!   guarantee by the failure mode).
//!
//! Fields without a value are left out. No secret and no descriptor value
//! unless the operator asks for plain keys.

use crate::codec::hex;
use crate::config::KeyInLog;
use crate::keys::KeyDigest;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    pub verdict: Option<&'static str>,
    pub limit: Option<String>,
    pub remaining: Option<u64>,
    pub key: Option<String>,
    pub idempotency: Option<&'static str>,
}

impl Record {
    /// Nothing was decided or recorded: no access-log field is written.
    pub fn is_empty(&self) -> bool {
        self.verdict.is_none() && self.idempotency.is_none()
    }

    /// The deciding limit, its units left and its key as logged; `digest`
    /// keeps the key's SHA-256 (computed once per request for all its uses,
    /// and only if one needs it).
    pub fn decided_by(
        &mut self,
        limit: &str,
        remaining: Option<u64>,
        (key, digest): (&[u8], &KeyDigest),
        how: KeyInLog,
    ) {
        self.limit = Some(limit.to_string());
        self.remaining = remaining;
        self.key = match how {
            KeyInLog::Hash => Some(hex(&digest.of(key)[..8])),
            KeyInLog::Plain => Some(String::from_utf8_lossy(key).into_owned()),
            KeyInLog::None => None,
        };
    }

    /// The record as one JSON object, byte for byte what serde_json writes
    /// for it (fields in name order, its escapes), written directly: a
    /// serde_json map cost the filter more than half the record's
    /// instructions (envoy/cost_gate).
    pub fn to_json(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            112 + self.limit.as_ref().map_or(0, String::len)
                + self.key.as_ref().map_or(0, String::len),
        );
        out.push(b'{');
        if let Some(v) = self.idempotency {
            field(&mut out, b"\"idempotency\":");
            push_string(&mut out, v);
        }
        if let Some(v) = &self.key {
            field(&mut out, b"\"key\":");
            push_string(&mut out, v);
        }
        if let Some(v) = &self.limit {
            field(&mut out, b"\"limit\":");
            push_string(&mut out, v);
        }
        if let Some(n) = self.remaining {
            field(&mut out, b"\"remaining\":");
            crate::codec::extend_decimal(&mut out, n);
        }
        if let Some(v) = self.verdict {
            field(&mut out, b"\"verdict\":");
            push_string(&mut out, v);
        }
        out.push(b'}');
        out
    }
}

/// A field's name (written as JSON, with its colon), after a comma unless
/// it is the first.
fn field(out: &mut Vec<u8>, name: &[u8]) {
    if out.len() > 1 {
        out.push(b',');
    }
    out.extend_from_slice(name);
}

/// A JSON string as serde_json writes it: `"` and `\\` escaped, the short
/// escapes for backspace, form feed, newline, return and tab, `\u00xx` for
/// the other control characters, everything else (non-ASCII included) as
/// it is.
fn push_string(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = s.as_bytes();
    // Most values (verdicts, limit names, hashed keys) need no escape.
    if !bytes.iter().any(|&b| b < 0x20 || b == b'"' || b == b'\\') {
        out.extend_from_slice(bytes);
        out.push(b'"');
        return;
    }
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short = match b {
            b'"' => b'"',
            b'\\' => b'\\',
            0x08 => b'b',
            0x0c => b'f',
            b'\n' => b'n',
            b'\r' => b'r',
            b'\t' => b't',
            0x00..=0x1f => b'u',
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        out.push(b'\\');
        out.push(short);
        if short == b'u' {
            out.extend_from_slice(&[
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 15)],
            ]);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value as Json};

    fn digest(_key: &[u8]) -> KeyDigest {
        KeyDigest::default()
    }

    fn decided(r: &mut Record, remaining: Option<u64>, key: &[u8], how: KeyInLog) {
        r.decided_by("per-user", remaining, (key, &digest(key)), how);
    }

    #[test]
    fn a_record_is_one_json_object_with_the_key_hashed_by_default() {
        let mut r = Record {
            verdict: Some("rejected"),
            ..Record::default()
        };
        let key = b"rg:rl:{t}:per-user:5:alice";
        decided(&mut r, Some(0), key, KeyInLog::Hash);
        let doc: Json = serde_json::from_slice(&r.to_json()).unwrap();
        assert_eq!(doc["verdict"], "rejected");
        assert_eq!(doc["limit"], "per-user");
        assert_eq!(doc["remaining"], 0);
        // The first 16 hex digits of the key's SHA-256, as documented.
        assert_eq!(
            doc["key"],
            crate::codec::sha256_hex(key)[..16].to_string().as_str()
        );
        assert!(doc.get("idempotency").is_none());

        decided(&mut r, None, key, KeyInLog::Plain);
        let doc: Json = serde_json::from_slice(&r.to_json()).unwrap();
        assert_eq!(doc["key"], "rg:rl:{t}:per-user:5:alice");
        assert!(doc.get("remaining").is_none());
        decided(&mut r, None, b"k", KeyInLog::None);
        let doc: Json = serde_json::from_slice(&r.to_json()).unwrap();
        assert!(doc.get("key").is_none());
        assert_eq!(Record::default().to_json(), b"{}");
    }

    /// What the record wrote before it wrote its own JSON: a serde_json map
    /// (fields in name order).
    fn by_serde(r: &Record) -> Vec<u8> {
        let mut m = serde_json::Map::new();
        if let Some(v) = r.verdict {
            m.insert("verdict".into(), json!(v));
        }
        if let Some(v) = &r.limit {
            m.insert("limit".into(), json!(v));
        }
        if let Some(v) = r.remaining {
            m.insert("remaining".into(), json!(v));
        }
        if let Some(v) = &r.key {
            m.insert("key".into(), json!(v));
        }
        if let Some(v) = r.idempotency {
            m.insert("idempotency".into(), json!(v));
        }
        Json::Object(m).to_string().into_bytes()
    }

    #[test]
    fn the_record_is_byte_for_byte_what_serde_json_wrote() {
        // Every byte a plain key can hold (control characters, quotes,
        // backslashes, DEL, invalid UTF-8 made lossy, multi-byte text), in
        // every combination of fields.
        let mut wild: Vec<u8> = (0u8..=255).collect();
        wild.extend_from_slice("é€😀\"\\/".as_bytes());
        let keys: [&[u8]; 4] = [b"", b"rg:rl:{t}:a:tb:5:alice", &wild, b"\"\\\n\x7f"];
        let mut seen = 0;
        for key in keys {
            for how in [KeyInLog::Hash, KeyInLog::Plain, KeyInLog::None] {
                for remaining in [None, Some(0), Some(7), Some(u64::MAX)] {
                    for verdict in [None, Some("admitted")] {
                        for idem in [None, Some("stored")] {
                            let mut r = Record {
                                verdict,
                                idempotency: idem,
                                ..Record::default()
                            };
                            if remaining.is_some() || how != KeyInLog::None {
                                r.decided_by("li\"mit\u{1}", remaining, (key, &digest(key)), how);
                            }
                            assert_eq!(
                                String::from_utf8_lossy(&r.to_json()),
                                String::from_utf8_lossy(&by_serde(&r)),
                                "{r:?}"
                            );
                            seen += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(seen, 4 * 3 * 4 * 2 * 2);
        // One character of each kind alone in a value (a value with nothing
        // to escape is copied whole).
        for c in (0u8..0x80).map(char::from).chain(['\u{e9}', '\u{80}']) {
            let value = format!("a{c}z");
            let mut r = Record {
                verdict: Some("admitted"),
                ..Record::default()
            };
            r.decided_by(
                &value,
                Some(1),
                (value.as_bytes(), &digest(b"")),
                KeyInLog::Plain,
            );
            assert_eq!(r.to_json(), by_serde(&r), "{c:?}");
        }
    }
}
