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

use serde_json::{Map, Value};

use crate::codec::sha256_hex;
use crate::config::KeyInLog;

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

    /// The deciding limit, its units left and its key as logged.
    pub fn decided_by(&mut self, limit: &str, remaining: Option<u64>, key: &[u8], how: KeyInLog) {
        self.limit = Some(limit.to_string());
        self.remaining = remaining;
        self.key = match how {
            KeyInLog::Hash => Some(sha256_hex(key)[..16].to_string()),
            KeyInLog::Plain => Some(String::from_utf8_lossy(key).into_owned()),
            KeyInLog::None => None,
        };
    }

    pub fn to_json(&self) -> Vec<u8> {
        let mut m = Map::new();
        if let Some(v) = self.verdict {
            m.insert("verdict".into(), Value::from(v));
        }
        if let Some(v) = &self.limit {
            m.insert("limit".into(), Value::from(v.as_str()));
        }
        if let Some(v) = self.remaining {
            m.insert("remaining".into(), Value::from(v));
        }
        if let Some(v) = &self.key {
            m.insert("key".into(), Value::from(v.as_str()));
        }
        if let Some(v) = self.idempotency {
            m.insert("idempotency".into(), Value::from(v));
        }
        Value::Object(m).to_string().into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_one_json_object_with_the_key_hashed_by_default() {
        let mut r = Record {
            verdict: Some("rejected"),
            ..Record::default()
        };
        r.decided_by(
            "per-user",
            Some(0),
            b"rg:rl:{t}:per-user:5:alice",
            KeyInLog::Hash,
        );
        let doc: Value = serde_json::from_slice(&r.to_json()).unwrap();
        assert_eq!(doc["verdict"], "rejected");
        assert_eq!(doc["limit"], "per-user");
        assert_eq!(doc["remaining"], 0);
        let key = doc["key"].as_str().unwrap();
        assert_eq!(key.len(), 16);
        assert!(!key.contains("alice"));
        assert!(doc.get("idempotency").is_none());

        r.decided_by(
            "per-user",
            None,
            b"rg:rl:{t}:per-user:5:alice",
            KeyInLog::Plain,
        );
        let doc: Value = serde_json::from_slice(&r.to_json()).unwrap();
        assert_eq!(doc["key"], "rg:rl:{t}:per-user:5:alice");
        assert!(doc.get("remaining").is_none());
        r.decided_by("per-user", None, b"k", KeyInLog::None);
        let doc: Value = serde_json::from_slice(&r.to_json()).unwrap();
        assert!(doc.get("key").is_none());
        assert!(!Record::default().is_empty() || Record::default().to_json() == b"{}");
    }
}
