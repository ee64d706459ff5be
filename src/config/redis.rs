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
/// Batches: the requests one call may carry by default, and at most. More
/// members make a longer script run, which blocks Redis for every client.
pub const DEFAULT_BATCH_MAX_REQUESTS: u32 = 32;
const MAX_BATCH_REQUESTS: u32 = 256;
/// Calls a worker keeps out before its requests queue: with one, a slow
/// reply holds every queued request for two round trips.
pub const DEFAULT_BATCH_IN_FLIGHT: u32 = 2;
const MAX_BATCH_IN_FLIGHT: u32 = 8;

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
    #[schemars(default = "super::defaults::timeout_ms")]
    timeout_ms: Option<u64>,
    /// Opens after consecutive failed calls, sending requests to their failure mode without a call.
    #[serde(default)]
    #[schemars(default = "super::defaults::all_defaults")]
    circuit_breaker: Option<RawBreaker>,
    /// Requests of one Envoy worker decided together: while its calls are
    /// out, further requests queue and leave as one call (group commit).
    #[serde(default)]
    #[schemars(default = "super::defaults::all_defaults")]
    batch: Option<RawBatch>,
    /// HTTP Basic credentials Webdis' http_basic_auth ACL admits (sent on
    /// every call): given here, or read from the Envoy environment.
    #[serde(default)]
    credentials: Option<RawWebdisCredentials>,
}

/// Either username and password, or fromEnvironment: true to read
/// REDIS_GUARD_WEBDIS_USERNAME and REDIS_GUARD_WEBDIS_PASSWORD from the Wasm
/// VM's environment (Envoy vm_config.environment_variables; Istio
/// WasmPlugin vmConfig.env).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "WebdisCredentials")]
struct RawWebdisCredentials {
    /// The user of Webdis' http_basic_auth.
    #[serde(default)]
    username: Option<String>,
    /// Its password (never logged).
    #[serde(default)]
    password: Option<String>,
    /// true: read both from the VM's environment instead.
    #[serde(default)]
    #[schemars(default = "super::defaults::off")]
    from_environment: Option<bool>,
}

pub const ENV_WEBDIS_USERNAME: &str = "REDIS_GUARD_WEBDIS_USERNAME";
pub const ENV_WEBDIS_PASSWORD: &str = "REDIS_GUARD_WEBDIS_PASSWORD";

/// The `Authorization` value of every call to Webdis; never shown (the
/// configuration's debug form and its errors name where it comes from).
#[derive(Clone, PartialEq, Eq)]
pub struct WebdisAuth(pub String);

impl std::fmt::Debug for WebdisAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebdisAuth(<redacted>)")
    }
}

/// Batched decisions: while a worker has calls out, its further requests
/// of one hash tag go to Redis together, each decided exactly (on by default).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Batch")]
struct RawBatch {
    /// false: every request sends its own call.
    #[serde(default)]
    #[schemars(default = "super::defaults::on")]
    enabled: Option<bool>,
    /// Most requests one call decides (default 32).
    #[serde(default)]
    #[schemars(range(min = 1, max = 256))]
    #[schemars(default = "super::defaults::batch_max_requests")]
    max_requests: Option<u32>,
    /// Calls a worker keeps out at once before requests queue (default 2).
    #[serde(default)]
    #[schemars(range(min = 1, max = 8))]
    #[schemars(default = "super::defaults::batch_max_in_flight")]
    max_in_flight: Option<u32>,
}

/// Group commit of one worker's decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    pub max_requests: usize,
    pub max_in_flight: usize,
}

/// After consecutive failed calls, requests take their failure mode
/// without a call for a while, then one probes (per worker and slot group).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "CircuitBreaker")]
struct RawBreaker {
    /// Consecutive failed calls that open the circuit (default 5).
    #[serde(default)]
    #[schemars(range(min = 1, max = 1000))]
    #[schemars(default = "super::defaults::breaker_failures")]
    failures: Option<u32>,
    /// How long it stays open (ms, default 1000).
    #[serde(default)]
    #[schemars(range(min = 10, max = 600000))]
    #[schemars(default = "super::defaults::breaker_cool_down_ms")]
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
    /// `None`: every request sends its own call.
    pub batch: Option<Batch>,
    /// `None`: calls carry no credentials (a Webdis open to its network).
    pub auth: Option<WebdisAuth>,
}

pub(super) fn compile_redis(
    raw: RawRedis,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<RedisTarget, ConfigError> {
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
        batch: compile_batch(raw.batch)?,
        auth: raw
            .credentials
            .map(|c| compile_credentials(c, env))
            .transpose()?,
    })
}

/// HTTP Basic (RFC 7617): `user:password` in base64. A user name cannot
/// hold `:` (the first one separates it), and neither part control bytes;
/// errors name the field or the variable, never a value.
fn compile_credentials(
    raw: RawWebdisCredentials,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<WebdisAuth, ConfigError> {
    use base64::Engine;
    const AT: &str = "redis.credentials";
    let given = raw.username.is_some() || raw.password.is_some();
    let from_env = raw.from_environment == Some(true);
    let (username, password) = match (from_env, given) {
        (true, true) => {
            return Err(ConfigError::new(
                AT,
                "set either fromEnvironment or username/password, not both",
            ))
        }
        (true, false) => (
            super::from_vm_env(env, AT, ENV_WEBDIS_USERNAME)?,
            super::from_vm_env(env, AT, ENV_WEBDIS_PASSWORD)?,
        ),
        (false, _) => match (raw.username, raw.password) {
            (Some(u), Some(p)) => (u, p),
            (None, _) => {
                return Err(ConfigError::new(
                    format!("{AT}.username"),
                    "is required (or set fromEnvironment: true)",
                ))
            }
            (Some(_), None) => {
                return Err(ConfigError::new(
                    format!("{AT}.password"),
                    "is required with username",
                ))
            }
        },
    };
    let field = |name: &str, var: &str| {
        if from_env {
            format!("{AT}.fromEnvironment ({var})")
        } else {
            format!("{AT}.{name}")
        }
    };
    let printable =
        |v: &str| !v.is_empty() && v.len() <= 256 && v.bytes().all(|b| b.is_ascii_graphic());
    if !printable(&username) || username.contains(':') {
        return Err(ConfigError::new(
            field("username", ENV_WEBDIS_USERNAME),
            "must be 1 to 256 printable ASCII characters without spaces or ':'",
        ));
    }
    if !printable(&password) {
        return Err(ConfigError::new(
            field("password", ENV_WEBDIS_PASSWORD),
            "must be 1 to 256 printable ASCII characters without spaces",
        ));
    }
    let token = base64::engine::general_purpose::STANDARD.encode(format!("{username}:{password}"));
    Ok(WebdisAuth(format!("Basic {token}")))
}

fn compile_batch(raw: Option<RawBatch>) -> Result<Option<Batch>, ConfigError> {
    let raw = raw.unwrap_or(RawBatch {
        enabled: None,
        max_requests: None,
        max_in_flight: None,
    });
    let max_requests = raw.max_requests.unwrap_or(DEFAULT_BATCH_MAX_REQUESTS);
    if !(1..=MAX_BATCH_REQUESTS).contains(&max_requests) {
        return Err(ConfigError::new(
            "redis.batch.maxRequests",
            format!("must be between 1 and {MAX_BATCH_REQUESTS}"),
        ));
    }
    let max_in_flight = raw.max_in_flight.unwrap_or(DEFAULT_BATCH_IN_FLIGHT);
    if !(1..=MAX_BATCH_IN_FLIGHT).contains(&max_in_flight) {
        return Err(ConfigError::new(
            "redis.batch.maxInFlight",
            format!("must be between 1 and {MAX_BATCH_IN_FLIGHT}"),
        ));
    }
    if raw.enabled == Some(false) {
        return Ok(None);
    }
    Ok(Some(Batch {
        max_requests: max_requests as usize,
        max_in_flight: max_in_flight as usize,
    }))
}
