//! Where Redis is: the Envoy cluster in front of Webdis, the decision deadline
//! and the circuit breaker.

use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;

use super::ConfigError;

pub const DEFAULT_TIMEOUT_MS: u64 = 50;
pub const DEFAULT_BREAKER_FAILURES: u32 = 5;
pub const DEFAULT_BREAKER_COOL_DOWN_MS: u64 = 1000;
const MAX_TIMEOUT_MS: u64 = 60_000;

/// The Envoy cluster in front of Webdis.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Redis")]
pub(super) struct RawRedis {
    /// Envoy cluster name (on Istio: outbound|PORT||HOST).
    #[schemars(length(min = 1))]
    cluster: String,
    /// :authority of the callouts (default: the cluster name).
    #[serde(default)]
    authority: Option<String>,
    /// Deadline of one Redis decision (ms, default 50).
    #[serde(default)]
    #[schemars(range(min = 1, max = 60000))]
    timeout_ms: Option<u64>,
    /// Opens after consecutive failed calls, sending requests to their failure mode without a call.
    #[serde(default)]
    circuit_breaker: Option<RawBreaker>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "CircuitBreaker")]
struct RawBreaker {
    /// Consecutive failed calls that open the circuit (default 5).
    #[serde(default)]
    #[schemars(range(min = 1, max = 1000))]
    failures: Option<u32>,
    /// How long it stays open (ms, default 1000).
    #[serde(default)]
    #[schemars(range(min = 10, max = 600000))]
    cool_down_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisTarget {
    pub cluster: String,
    pub authority: String,
    pub timeout: Duration,
    /// Consecutive failed calls that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker sends requests straight to their failure mode.
    pub breaker_cool_down: Duration,
}

pub(super) fn compile_redis(raw: RawRedis) -> Result<RedisTarget, ConfigError> {
    if raw.cluster.trim().is_empty() {
        return Err(ConfigError::new(
            "redis.cluster",
            "must name the Envoy cluster that fronts Webdis",
        ));
    }
    if raw.cluster.trim() != raw.cluster {
        return Err(ConfigError::new(
            "redis.cluster",
            "must not start or end with white space (it names an Envoy cluster)",
        ));
    }
    let timeout_ms = raw.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS);
    if timeout_ms == 0 || timeout_ms > MAX_TIMEOUT_MS {
        return Err(ConfigError::new(
            "redis.timeoutMs",
            format!("must be between 1 and {MAX_TIMEOUT_MS}"),
        ));
    }
    // Both end up in the callout's headers: no spaces or control bytes.
    if !raw.cluster.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError::new(
            "redis.cluster",
            "must be printable ASCII without spaces",
        ));
    }
    let authority = raw.authority.unwrap_or_else(|| raw.cluster.clone());
    if authority.is_empty() {
        return Err(ConfigError::new("redis.authority", "must not be empty"));
    }
    if !authority.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError::new(
            "redis.authority",
            "must be printable ASCII without spaces",
        ));
    }
    let (failures, cool_down_ms) = match raw.circuit_breaker {
        None => (DEFAULT_BREAKER_FAILURES, DEFAULT_BREAKER_COOL_DOWN_MS),
        Some(b) => (
            b.failures.unwrap_or(DEFAULT_BREAKER_FAILURES),
            b.cool_down_ms.unwrap_or(DEFAULT_BREAKER_COOL_DOWN_MS),
        ),
    };
    if !(1..=1000).contains(&failures) {
        return Err(ConfigError::new(
            "redis.circuitBreaker.failures",
            "must be between 1 and 1000",
        ));
    }
    if !(10..=600_000).contains(&cool_down_ms) {
        return Err(ConfigError::new(
            "redis.circuitBreaker.coolDownMs",
            "must be between 10 and 600000",
        ));
    }
    Ok(RedisTarget {
        cluster: raw.cluster,
        authority,
        timeout: Duration::from_millis(timeout_ms),
        breaker_failures: failures,
        breaker_cool_down: Duration::from_millis(cool_down_ms),
    })
}
