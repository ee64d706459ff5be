//! `accessLog`: what the filter leaves in Envoy's access log for each
//! request it acted on (filter state `wasm.redis_guard`, printed with
//! `%FILTER_STATE(wasm.redis_guard:PLAIN)%`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How the deciding limit's key appears in the record. A key holds the
/// descriptor's values (a user, a client address, an API key): personal
/// data an operator must choose to log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum KeyInLog {
    /// Its SHA-256, 16 hex digits: the same key always logs the same, and
    /// `redis-guard` finds it, but the log does not show the values.
    #[default]
    Hash,
    /// The Redis key itself, values and all.
    Plain,
    /// Left out.
    None,
}

/// The record of each decision the filter leaves for Envoy's access log.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawAccessLog {
    /// Record each decision in the request's filter state (default true):
    /// one host call per request the filter acted on.
    #[serde(default)]
    #[schemars(default = "super::defaults::on")]
    enabled: Option<bool>,
    /// How the deciding limit's key is logged (default "hash").
    #[serde(default)]
    #[schemars(default = "super::defaults::access_log_key")]
    key: Option<KeyInLog>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccessLog {
    pub enabled: bool,
    pub key: KeyInLog,
}

impl Default for AccessLog {
    fn default() -> AccessLog {
        AccessLog {
            enabled: true,
            key: KeyInLog::Hash,
        }
    }
}

pub fn compile_access_log(raw: Option<RawAccessLog>) -> AccessLog {
    let raw = raw.unwrap_or_default();
    AccessLog {
        enabled: raw.enabled.unwrap_or(true),
        key: raw.key.unwrap_or_default(),
    }
}
