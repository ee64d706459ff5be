//! Plugin configuration: the JSON users write, and the compiled form the
//! filter uses on every request. Parsing happens once, in `on_configure`;
//! every rejection names the field it is about.

use std::fmt;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;

/// Largest integer a Lua (double) number holds exactly. The token bucket keeps
/// `capacity * period_ms` credits, so that product must stay below it.
const LUA_EXACT_MAX: u64 = 1 << 53;

/// A rejected configuration: which field, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl ConfigError {
    fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "invalid configuration: {}", self.reason)
        } else {
            write!(
                f,
                "invalid configuration at `{}`: {}",
                self.field, self.reason
            )
        }
    }
}

impl std::error::Error for ConfigError {}

// ---------------------------------------------------------------------------
// The JSON as written. Unknown fields are errors everywhere: a misspelled key
// must not silently turn a limit off. The same types generate the JSON Schema
// editors validate against (`envoy/filter.schema.json`), so the schema cannot
// drift from the parser; doc comments become its descriptions.

/// redis-guard filter configuration (the Envoy wasm filter's `configuration`
/// or an Istio WasmPlugin's `pluginConfig`).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(title = "redis-guard filter configuration")]
struct RawConfig {
    /// How the filter reaches Redis: an Envoy cluster in front of Webdis.
    redis: RawRedis,
    /// First segment of every Redis key (default "rg"); printable ASCII without '{' or '}'.
    #[serde(default)]
    #[schemars(length(min = 1, max = 64))]
    key_prefix: Option<String>,
    /// Parts whose values pick the Redis Cluster hash tag, so every key of one
    /// tenant lives in one slot. Every non-literal part must also be in each
    /// limit's descriptor and each idempotency rule's tenant.
    #[serde(default)]
    hash_tag: Vec<RawPart>,
    /// What a request gets when Redis cannot decide it (default "allow").
    #[serde(default)]
    failure_mode: Option<FailureMode>,
    /// Rate-limit header families on responses (default both).
    #[serde(default)]
    rate_limit_headers: Option<Vec<HeaderSet>>,
    /// Rate limits; every matching limit is checked in one Redis call.
    #[serde(default)]
    limits: Vec<RawLimit>,
    /// Idempotency-key rules; the first matching rule applies.
    #[serde(default)]
    idempotency: Vec<RawIdempotency>,
    /// S3-compatible object store for large idempotent responses (rules with
    /// offloadAboveBytes): Redis keeps a reference and a checksum, the store the body.
    #[serde(default)]
    object_store: Option<RawObjectStore>,
    /// The schema this file follows (for editors); ignored by the filter.
    #[serde(default, rename = "$schema")]
    #[allow(dead_code)]
    schema: Option<String>,
}

/// One idempotency rule.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "IdempotencyRule")]
// maxStoredBodyBytes may reach 64 MiB only with an object store to put it in.
#[schemars(extend(
    "if" = {"not": {"required": ["offloadAboveBytes"]}},
    "then" = {"properties": {"maxStoredBodyBytes": {"maximum": 8388608}}}
))]
struct RawIdempotency {
    /// Unique rule name: letters, digits, '-', '_', '.'; part of the record key.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9._-]+$"))]
    name: String,
    /// Which requests the rule covers (methods default to POST and PATCH).
    #[serde(default, rename = "match")]
    matcher: RawMatch,
    /// Request header carrying the key (default "idempotency-key").
    #[serde(default)]
    header: Option<String>,
    /// Reject (400) a matching request without the header.
    #[serde(default)]
    required: bool,
    /// Parts scoping a key to a tenant (a key of one tenant never replays another's response).
    #[serde(default)]
    tenant: Vec<RawPart>,
    /// How long a request in flight holds the key (ms, default 30000); keep it above the upstream timeout.
    #[serde(default)]
    #[schemars(range(min = 100, max = 86400000))]
    lock_ttl_ms: Option<u64>,
    /// How long a completed response is replayed (ms, default 86400000, at most 30 days).
    #[serde(default)]
    #[schemars(range(min = 1000, max = 2592000000u64))]
    record_ttl_ms: Option<u64>,
    /// Statuses whose responses are stored: classes ("2xx" to "5xx") or exact codes ("201"); default ["2xx"].
    #[serde(default)]
    store_statuses: Option<Vec<String>>,
    /// Response headers stored and replayed (default ["content-type"]).
    #[serde(default)]
    store_headers: Option<Vec<String>>,
    /// Largest request body fingerprinted (bytes, default 1 MiB, at most 64 MiB).
    #[serde(default)]
    #[schemars(range(max = 67108864))]
    max_request_body_bytes: Option<u64>,
    /// Largest response body stored (bytes, default 64 KiB; at most 8 MiB,
    /// or 64 MiB with offloadAboveBytes).
    #[serde(default)]
    #[schemars(range(max = 67108864))]
    max_stored_body_bytes: Option<u64>,
    /// Overrides the top-level failureMode ("local" is for limits only).
    #[serde(default)]
    failure_mode: Option<FailureMode>,
    /// Include the request body in the fingerprint, so a retry with another
    /// body gets 422 (default true). The filter then holds the headers until
    /// the body is read, which needs Envoy's allow_on_headers_stop_iteration;
    /// an Istio WasmPlugin cannot set it: there, set false and the key is
    /// decided on method and path alone (the body is not read, so
    /// maxRequestBodyBytes applies to Content-Length only).
    #[serde(default)]
    fingerprint_body: Option<bool>,
    /// Responses whose body is larger than this many bytes are stored in the
    /// object store (top-level objectStore), Redis keeping only a reference;
    /// smaller ones stay in Redis. maxStoredBodyBytes still caps every stored
    /// body, and may then be up to 64 MiB.
    #[serde(default)]
    #[schemars(range(max = 8388608))]
    offload_above_bytes: Option<u64>,
}

/// An S3-compatible object store reached through an Envoy cluster; requests
/// are signed with AWS Signature Version 4 (path-style addressing).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "ObjectStore")]
struct RawObjectStore {
    /// Envoy cluster of the store's endpoint.
    #[schemars(length(min = 1))]
    cluster: String,
    /// Host the requests are signed for and sent with, e.g.
    /// "s3.eu-west-1.amazonaws.com" (default: the cluster name).
    #[serde(default)]
    authority: Option<String>,
    /// Bucket name (3 to 63 of a-z 0-9 . -).
    #[schemars(
        length(min = 3, max = 63),
        regex(pattern = r"^[a-z0-9][a-z0-9.-]+[a-z0-9]$")
    )]
    bucket: String,
    /// Signing region, e.g. "us-east-1".
    #[schemars(length(min = 1, max = 32), regex(pattern = r"^[a-z0-9-]+$"))]
    region: String,
    /// Start of every object key (default "redis-guard/"); a bucket lifecycle
    /// rule on this prefix removes objects after their records expire.
    #[serde(default)]
    #[schemars(length(max = 256))]
    key_prefix: Option<String>,
    /// Deadline of one upload or fetch (ms, default 5000).
    #[serde(default)]
    #[schemars(range(min = 1, max = 300000))]
    timeout_ms: Option<u64>,
    /// Access key: given here, or read from the Envoy environment.
    credentials: RawCredentials,
}

/// Either accessKeyId and secretAccessKey (and sessionToken), or
/// fromEnvironment: true to read AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
/// AWS_SESSION_TOKEN from the Wasm VM's environment (Envoy
/// vm_config.environment_variables; Istio WasmPlugin vmConfig.env).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Credentials")]
struct RawCredentials {
    #[serde(default)]
    access_key_id: Option<String>,
    #[serde(default)]
    secret_access_key: Option<String>,
    #[serde(default)]
    session_token: Option<String>,
    #[serde(default)]
    from_environment: Option<bool>,
}

/// The Envoy cluster in front of Webdis.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Redis")]
struct RawRedis {
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

/// One rate limit: exactly one of tokenBucket or slidingWindow.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Limit")]
struct RawLimit {
    /// Unique limit name: letters, digits, '-', '_', '.'; part of keys and stats.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9._-]+$"))]
    name: String,
    /// Which requests the limit applies to.
    #[serde(default, rename = "match")]
    matcher: RawMatch,
    /// Parts whose values pick the bucket (one bucket per distinct value list).
    #[serde(default)]
    descriptor: Vec<RawPart>,
    #[serde(default)]
    token_bucket: Option<RawTokenBucket>,
    #[serde(default)]
    sliding_window: Option<RawSlidingWindow>,
    /// Units one request spends (default 1).
    #[serde(default)]
    #[schemars(range(min = 1))]
    cost: Option<u64>,
    /// Read the cost from a request header instead.
    #[serde(default)]
    cost_header: Option<RawCostHeader>,
    /// Count and report, never reject.
    #[serde(default)]
    shadow: bool,
    /// Overrides the top-level failureMode.
    #[serde(default)]
    failure_mode: Option<FailureMode>,
    /// With failureMode "local": each Envoy's share of the budget while Redis is down (default 0.1).
    #[serde(default)]
    #[schemars(range(max = 1), extend("exclusiveMinimum" = 0))]
    local_fraction: Option<f64>,
    /// Token bucket only: each Envoy takes tokens in batches and spends them
    /// without a Redis call. Never admits more than the bucket; may admit
    /// fewer (at most `tokens` per Envoy held unspent until the lease ends).
    #[serde(default)]
    lease: Option<RawLease>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Lease")]
struct RawLease {
    /// Most tokens one Envoy takes beyond the request that fetches them (1 to capacity).
    #[schemars(range(min = 1))]
    tokens: u64,
    /// How long unspent leased tokens stay usable (ms).
    #[schemars(range(min = 10, max = 600000))]
    ttl_ms: u64,
}

/// Conditions that must all hold; an empty match covers every request.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Match")]
struct RawMatch {
    /// The normalised path starts with this (starts with '/').
    #[serde(default)]
    path_prefix: Option<String>,
    /// The normalised path, without query, equals this.
    #[serde(default)]
    path_exact: Option<String>,
    /// Methods covered (any when empty).
    #[serde(default)]
    methods: Vec<String>,
    /// :authority, without port, case-insensitive.
    #[serde(default)]
    host: Option<String>,
    #[serde(default)]
    headers: Vec<RawHeaderMatch>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "HeaderMatch")]
struct RawHeaderMatch {
    name: String,
    #[serde(default)]
    present: Option<bool>,
    #[serde(default)]
    exact: Option<String>,
}

/// One piece of a descriptor: `{"header": "x-user"}`, `{"literal": "free"}`,
/// `"clientAddress"`, `"path"` or `"method"`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Part")]
enum RawPart {
    Header(String),
    Literal(String),
    ClientAddress,
    Path,
    Method,
}

/// Burst of `capacity`, refilled by `refill` units every `periodMs`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "TokenBucket")]
struct RawTokenBucket {
    #[schemars(range(min = 1))]
    capacity: u64,
    #[schemars(range(min = 1))]
    refill: u64,
    #[schemars(range(min = 1))]
    period_ms: u64,
}

/// At most `limit` units in any `windowMs` (exact, a log of admissions).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "SlidingWindow")]
struct RawSlidingWindow {
    #[schemars(range(min = 1, max = 1000000))]
    limit: u64,
    #[schemars(range(min = 1))]
    window_ms: u64,
}

/// Cost from a request header: a positive integer up to `max`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "CostHeader")]
struct RawCostHeader {
    name: String,
    #[schemars(range(min = 1))]
    max: u64,
}

// ---------------------------------------------------------------------------
// The compiled form.

/// What to do with a request when Redis cannot decide it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum FailureMode {
    /// Fail open: forward the request without the guarantee.
    #[default]
    Allow,
    /// Fail closed: answer 503.
    Deny,
    /// Rate limits only: decide with an in-process budget per Envoy, a
    /// fraction (`localFraction`) of the global one.
    Local,
}

/// Which families of rate-limit response headers are emitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
pub enum HeaderSet {
    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers).
    #[serde(rename = "ietf")]
    Ietf,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    #[serde(rename = "x-ratelimit")]
    XRateLimit,
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Header(String),
    Literal(String),
    ClientAddress,
    Path,
    Method,
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Part::Header(h) => write!(f, "{{\"header\": \"{h}\"}}"),
            Part::Literal(l) => write!(f, "{{\"literal\": \"{l}\"}}"),
            Part::ClientAddress => write!(f, "\"clientAddress\""),
            Part::Path => write!(f, "\"path\""),
            Part::Method => write!(f, "\"method\""),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    TokenBucket {
        capacity: u64,
        refill: u64,
        period_ms: u64,
    },
    SlidingWindow {
        limit: u64,
        window_ms: u64,
    },
}

impl Algorithm {
    /// The most units one request may spend.
    pub fn quota(&self) -> u64 {
        match *self {
            Algorithm::TokenBucket { capacity, .. } => capacity,
            Algorithm::SlidingWindow { limit, .. } => limit,
        }
    }

    /// The policy window in ms: for a token bucket, the time to refill it from
    /// empty; for a sliding window, the window.
    pub fn window_ms(&self) -> u64 {
        match *self {
            Algorithm::TokenBucket {
                capacity,
                refill,
                period_ms,
            } => (capacity * period_ms).div_ceil(refill),
            Algorithm::SlidingWindow { window_ms, .. } => window_ms,
        }
    }

    /// The key segment naming the algorithm and every parameter that shapes
    /// its stored state, so a changed limit starts from a fresh key instead of
    /// reading a state written under other parameters.
    pub fn signature(&self) -> String {
        match *self {
            Algorithm::TokenBucket {
                capacity,
                refill,
                period_ms,
            } => format!("tb.{capacity}.{refill}.{period_ms}"),
            Algorithm::SlidingWindow { limit, window_ms } => format!("sw.{limit}.{window_ms}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    Fixed(u64),
    /// Read from a request header; `default` when the header is absent.
    Header {
        name: String,
        default: u64,
        max: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    Any,
    Prefix(String),
    Exact(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderCondition {
    Present(bool),
    Exact(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    pub path: PathMatch,
    /// Upper-case; empty means every method.
    pub methods: Vec<String>,
    /// Lower-case, without port.
    pub host: Option<String>,
    pub headers: Vec<(String, HeaderCondition)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    pub name: String,
    pub matcher: Matcher,
    pub descriptor: Vec<Part>,
    pub algorithm: Algorithm,
    pub cost: Cost,
    pub shadow: bool,
    pub failure_mode: FailureMode,
    /// With `failureMode: local`: the share of the global budget each Envoy
    /// may spend on its own, in thousandths.
    pub local_per_mille: u64,
    /// `:<name>:<signature>:`, precomputed for key building.
    pub key_infix: String,
    /// Token lease: batch size and lifetime.
    pub lease: Option<Lease>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub tokens: u64,
    pub ttl: Duration,
}

/// One idempotency rule: which requests it covers and how their keys behave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Idempotency {
    pub name: String,
    pub matcher: Matcher,
    /// Lower-case request header carrying the key.
    pub header: String,
    pub required: bool,
    /// Parts naming the tenant a key is scoped to.
    pub tenant: Vec<Part>,
    pub lock_ttl_ms: u64,
    pub record_ttl_ms: u64,
    /// Status classes (2 for 2xx…) and exact statuses whose responses are stored.
    pub store_classes: Vec<u32>,
    pub store_exact: Vec<u32>,
    /// Lower-case response headers stored and replayed.
    pub store_headers: Vec<String>,
    pub max_request_body: usize,
    pub max_stored_body: usize,
    pub failure_mode: FailureMode,
    /// The body is part of the fingerprint (the decision waits for it).
    pub fingerprint_body: bool,
    /// Bodies larger than this go to the object store.
    pub offload_above: Option<usize>,
}

/// Where offloaded bodies go, and how requests to it are signed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectStore {
    pub cluster: String,
    pub authority: String,
    pub bucket: String,
    pub region: String,
    pub key_prefix: String,
    pub timeout: Duration,
    pub credentials: crate::sigv4::Credentials,
}

impl Idempotency {
    pub fn stores(&self, status: u32) -> bool {
        self.store_exact.contains(&status) || self.store_classes.contains(&(status / 100))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub redis: RedisTarget,
    pub key_prefix: String,
    pub hash_tag: Vec<Part>,
    /// The hash tag when `hash_tag` depends on no request value.
    pub static_tag: Option<String>,
    /// The parts of the request line some limit or rule looks at.
    pub needs: crate::request::Needs,
    pub headers_ietf: bool,
    pub headers_x: bool,
    pub limits: Vec<Limit>,
    pub idempotency: Vec<Idempotency>,
    pub object_store: Option<ObjectStore>,
}

pub const DEFAULT_TIMEOUT_MS: u64 = 50;
/// A tenth of the global budget per Envoy when Redis is down.
pub const DEFAULT_LOCAL_PER_MILLE: u64 = 100;
pub const DEFAULT_BREAKER_FAILURES: u32 = 5;
pub const DEFAULT_BREAKER_COOL_DOWN_MS: u64 = 1000;
pub const DEFAULT_IDEMPOTENCY_HEADER: &str = "idempotency-key";
pub const DEFAULT_LOCK_TTL_MS: u64 = 30_000;
pub const DEFAULT_RECORD_TTL_MS: u64 = 86_400_000;
pub const DEFAULT_MAX_REQUEST_BODY: u64 = 1 << 20;
pub const DEFAULT_MAX_STORED_BODY: u64 = 64 << 10;
/// Webdis and Redis take bodies this large, but a record this size already
/// belongs in object storage, not in Redis memory.
const MAX_STORED_BODY: u64 = 8 << 20;
/// With an object store, the cap is what one stream may hold in the Wasm VM
/// while the upload is prepared (linear memory never shrinks back).
pub const MAX_OFFLOADED_BODY: u64 = 64 << 20;
pub const DEFAULT_OBJECT_TIMEOUT_MS: u64 = 5000;
const MAX_OBJECT_TIMEOUT_MS: u64 = 300_000;
pub const DEFAULT_OBJECT_KEY_PREFIX: &str = "redis-guard/";
/// The standard AWS SDK variable names, so existing secrets plumbing works.
pub const ENV_ACCESS_KEY_ID: &str = "AWS_ACCESS_KEY_ID";
pub const ENV_SECRET_ACCESS_KEY: &str = "AWS_SECRET_ACCESS_KEY";
pub const ENV_SESSION_TOKEN: &str = "AWS_SESSION_TOKEN";
/// Most units one request may spend from a sliding window.
pub const MAX_WINDOW_COST: u64 = 1000;
pub const DEFAULT_KEY_PREFIX: &str = "rg";
const MAX_TIMEOUT_MS: u64 = 60_000;

impl Config {
    /// Parses and validates the plugin configuration; object-store
    /// credentials given as fromEnvironment come from this process's
    /// environment (in Envoy: the Wasm VM's, see vm_config.environment_variables).
    pub fn parse(json: &[u8]) -> Result<Config, ConfigError> {
        Config::parse_with_env(json, &|name| std::env::var(name).ok())
    }

    /// As `parse`, with the environment given.
    pub fn parse_with_env(
        json: &[u8],
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let de = &mut serde_json::Deserializer::from_slice(json);
        let raw: RawConfig = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." { String::new() } else { path };
            // serde quotes a mistyped value in its message; under
            // credentials that value may be a secret, which ends up in
            // Envoy's log. Say what is expected instead.
            let reason = e.into_inner().to_string();
            let quotes_value = reason.starts_with("invalid type") || reason.starts_with("invalid value");
            let reason = if field.starts_with("objectStore.credentials") && quotes_value {
                "must be an object of accessKeyId, secretAccessKey and sessionToken strings, or fromEnvironment: true (the value is not repeated here: it may be a secret)".to_string()
            } else {
                reason
            };
            ConfigError::new(field, reason)
        })?;
        de.end()
            .map_err(|e| ConfigError::new("", format!("trailing characters: {e}")))?;
        // serde accepts `[a, b]` for a struct (fields by position); in a config
        // that silently binds values to whatever field comes first. Only the
        // list-valued fields may hold arrays.
        let shape: serde_json::Value = serde_json::from_slice(json)
            .map_err(|e| ConfigError::new("", format!("not valid JSON: {e}")))?;
        only_listed_arrays(&shape, "", false)?;
        compile(raw, env)
    }
}

/// The JSON Schema of the configuration, derived from the types the parser
/// reads. It checks shape, names, types and single-field bounds; rules that
/// span fields (hash tag parts in every descriptor, cost within the quota)
/// remain the parser's.
pub fn json_schema() -> serde_json::Value {
    schemars::generate::SchemaSettings::draft07()
        .into_generator()
        .into_root_schema_for::<RawConfig>()
        .to_value()
}

/// Hop-by-hop and framing headers: never a key, never stored.
const FRAMING_HEADERS: &[&str] = &[
    "connection",
    "content-length",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Fields whose value is a list.
const LIST_FIELDS: &[&str] = &[
    "hashTag",
    "limits",
    "idempotency",
    "tenant",
    "storeStatuses",
    "storeHeaders",
    "descriptor",
    "methods",
    "headers",
    "rateLimitHeaders",
];

fn only_listed_arrays(v: &serde_json::Value, at: &str, list_ok: bool) -> Result<(), ConfigError> {
    match v {
        serde_json::Value::Array(items) => {
            if !list_ok {
                return Err(ConfigError::new(
                    at,
                    "expected an object or a value, found an array",
                ));
            }
            for (i, item) in items.iter().enumerate() {
                only_listed_arrays(item, &format!("{at}[{i}]"), false)?;
            }
        }
        serde_json::Value::Object(map) => {
            for (k, item) in map {
                let path = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                only_listed_arrays(item, &path, LIST_FIELDS.contains(&k.as_str()))?;
            }
        }
        _ => {}
    }
    Ok(())
}

fn compile(raw: RawConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    let redis = compile_redis(raw.redis)?;
    let object_store = raw
        .object_store
        .map(|o| compile_object_store(o, env))
        .transpose()?;

    let key_prefix = raw
        .key_prefix
        .unwrap_or_else(|| DEFAULT_KEY_PREFIX.to_string());
    if key_prefix.is_empty() || key_prefix.len() > 64 {
        return Err(ConfigError::new("keyPrefix", "must be 1 to 64 characters"));
    }
    // A brace in the prefix would become the Redis Cluster hash tag and put
    // every key of every tenant into one slot.
    if key_prefix
        .bytes()
        .any(|b| b == b'{' || b == b'}' || !(b.is_ascii_graphic()))
    {
        return Err(ConfigError::new(
            "keyPrefix",
            "must be printable ASCII without spaces, '{' or '}'",
        ));
    }

    let hash_tag = compile_parts(raw.hash_tag, "hashTag")?;
    let default_failure = raw.failure_mode.unwrap_or_default();

    let (headers_ietf, headers_x) = match raw.rate_limit_headers {
        None => (true, true),
        Some(sets) => (
            sets.contains(&HeaderSet::Ietf),
            sets.contains(&HeaderSet::XRateLimit),
        ),
    };

    let mut limits: Vec<Limit> = Vec::with_capacity(raw.limits.len());
    for (i, raw_limit) in raw.limits.into_iter().enumerate() {
        let at = format!("limits[{i}]");
        let limit = compile_limit(raw_limit, &at, default_failure)?;
        // The hash tag is part of every key. A tag value the descriptor does
        // not also carry would let a client mint a fresh budget by changing it.
        let missing = hash_tag
            .iter()
            .find(|p| !matches!(p, Part::Literal(_)) && !limit.descriptor.contains(p));
        if let Some(part) = missing {
            return Err(ConfigError::new(
                format!("{at}.descriptor"),
                format!(
                    "must include every hashTag part (missing {part}): the hash tag is part of each key, so a value outside the descriptor would split one budget into many"
                ),
            ));
        }
        if limits.iter().any(|l| l.name == limit.name) {
            return Err(ConfigError::new(
                format!("{at}.name"),
                format!("duplicate limit name `{}`", limit.name),
            ));
        }
        limits.push(limit);
    }

    let mut idempotency: Vec<Idempotency> = Vec::with_capacity(raw.idempotency.len());
    for (i, raw_rule) in raw.idempotency.into_iter().enumerate() {
        let at = format!("idempotency[{i}]");
        let rule = compile_idempotency(raw_rule, &at, default_failure)?;
        if idempotency.iter().any(|r| r.name == rule.name) {
            return Err(ConfigError::new(
                format!("{at}.name"),
                format!("duplicate idempotency rule name `{}`", rule.name),
            ));
        }
        // Retries must find the record: its key carries the hash tag, so the
        // tag may only depend on what scopes the key.
        let missing = hash_tag
            .iter()
            .find(|p| !matches!(p, Part::Literal(_)) && !rule.tenant.contains(p));
        if let Some(part) = missing {
            return Err(ConfigError::new(
                format!("{at}.tenant"),
                format!("must include every hashTag part (missing {part}): the hash tag is part of the record's key"),
            ));
        }
        match (rule.offload_above, &object_store) {
            (Some(_), None) => {
                return Err(ConfigError::new(
                    format!("{at}.offloadAboveBytes"),
                    "needs a top-level objectStore to offload to",
                ));
            }
            (Some(_), Some(store)) => {
                // The lock is held through the upload and the record's
                // write: expiring first would let a retry run the request
                // again while the first response is still being stored.
                let held = store.timeout + redis.timeout;
                if Duration::from_millis(rule.lock_ttl_ms) <= held {
                    return Err(ConfigError::new(
                        format!("{at}.lockTtlMs"),
                        format!(
                            "must be above objectStore.timeoutMs + redis.timeoutMs ({} ms) plus the upstream's time: the lock is held while the response is uploaded and recorded",
                            held.as_millis()
                        ),
                    ));
                }
                // The name is a segment of every object key; stores and
                // proxies resolve these, so the key signed is not the key used.
                if rule.name == "." || rule.name == ".." {
                    return Err(ConfigError::new(
                        format!("{at}.name"),
                        "`.` and `..` cannot name a rule that offloads: the name is an object key segment",
                    ));
                }
            }
            (None, _) => {}
        }
        idempotency.push(rule);
    }

    Ok(Config {
        redis,
        key_prefix,
        needs: needs(&hash_tag, &limits, &idempotency),
        static_tag: crate::keys::static_hash_tag(&hash_tag),
        hash_tag,
        headers_ietf,
        headers_x,
        limits,
        idempotency,
        object_store,
    })
}

/// What of the request line the compiled rules read (see `Needs`). Every
/// idempotency rule matches on methods and fingerprints method and path.
fn needs(
    hash_tag: &[Part],
    limits: &[Limit],
    idempotency: &[Idempotency],
) -> crate::request::Needs {
    let matchers = limits
        .iter()
        .map(|l| &l.matcher)
        .chain(idempotency.iter().map(|r| &r.matcher));
    let parts: Vec<&Part> = hash_tag
        .iter()
        .chain(limits.iter().flat_map(|l| l.descriptor.iter()))
        .chain(idempotency.iter().flat_map(|r| r.tenant.iter()))
        .collect();
    let mut n = crate::request::Needs {
        method: !idempotency.is_empty() || parts.iter().any(|p| matches!(p, Part::Method)),
        path: !idempotency.is_empty() || parts.iter().any(|p| matches!(p, Part::Path)),
        host: false,
    };
    for m in matchers {
        n.method |= !m.methods.is_empty();
        n.path |= !matches!(m.path, PathMatch::Any);
        n.host |= m.host.is_some();
    }
    n
}

fn compile_redis(raw: RawRedis) -> Result<RedisTarget, ConfigError> {
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

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

fn valid_header_name(name: &str) -> bool {
    // RFC 9110 token characters; pseudo-headers (":authority") are allowed.
    let body = name.strip_prefix(':').unwrap_or(name);
    !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn header_name(name: &str, field: &str) -> Result<String, ConfigError> {
    if !valid_header_name(name) {
        return Err(ConfigError::new(
            field,
            format!("`{name}` is not a valid header name"),
        ));
    }
    // Envoy keeps header names lower-case.
    Ok(name.to_ascii_lowercase())
}

fn compile_parts(raw: Vec<RawPart>, at: &str) -> Result<Vec<Part>, ConfigError> {
    raw.into_iter()
        .enumerate()
        .map(|(i, p)| {
            Ok(match p {
                RawPart::Header(name) => {
                    Part::Header(header_name(&name, &format!("{at}[{i}].header"))?)
                }
                RawPart::Literal(v) => Part::Literal(v),
                RawPart::ClientAddress => Part::ClientAddress,
                RawPart::Path => Part::Path,
                RawPart::Method => Part::Method,
            })
        })
        .collect()
}

fn positive(value: u64, field: String) -> Result<u64, ConfigError> {
    if value == 0 {
        Err(ConfigError::new(field, "must be at least 1"))
    } else {
        Ok(value)
    }
}

fn compile_limit(
    raw: RawLimit,
    at: &str,
    default_failure: FailureMode,
) -> Result<Limit, ConfigError> {
    if !valid_name(&raw.name) {
        return Err(ConfigError::new(
            format!("{at}.name"),
            "must be 1 to 64 characters of A-Z a-z 0-9 - _ .",
        ));
    }
    let matcher = compile_match(raw.matcher, &format!("{at}.match"))?;
    let descriptor = compile_parts(raw.descriptor, &format!("{at}.descriptor"))?;

    let algorithm = match (raw.token_bucket, raw.sliding_window) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::new(
                at,
                "set exactly one of `tokenBucket` and `slidingWindow`, not both",
            ))
        }
        (None, None) => {
            return Err(ConfigError::new(
                at,
                "set exactly one of `tokenBucket` and `slidingWindow`",
            ))
        }
        (Some(tb), None) => {
            let capacity = positive(tb.capacity, format!("{at}.tokenBucket.capacity"))?;
            let refill = positive(tb.refill, format!("{at}.tokenBucket.refill"))?;
            let period_ms = positive(tb.period_ms, format!("{at}.tokenBucket.periodMs"))?;
            if capacity
                .checked_mul(period_ms)
                .is_none_or(|p| p >= LUA_EXACT_MAX)
            {
                return Err(ConfigError::new(
                    format!("{at}.tokenBucket"),
                    "capacity * periodMs must stay below 2^53 (Lua numbers are doubles)",
                ));
            }
            if refill
                .checked_mul(period_ms)
                .is_none_or(|p| p >= LUA_EXACT_MAX)
            {
                return Err(ConfigError::new(
                    format!("{at}.tokenBucket"),
                    "refill * periodMs must stay below 2^53 (Lua numbers are doubles)",
                ));
            }
            Algorithm::TokenBucket {
                capacity,
                refill,
                period_ms,
            }
        }
        (None, Some(sw)) => {
            let limit = positive(sw.limit, format!("{at}.slidingWindow.limit"))?;
            let window_ms = positive(sw.window_ms, format!("{at}.slidingWindow.windowMs"))?;
            // One sorted-set member per admitted unit: bound the memory a key can take.
            if limit > 1_000_000 {
                return Err(ConfigError::new(
                    format!("{at}.slidingWindow.limit"),
                    "must be at most 1000000 (one sorted-set member per request); use tokenBucket for larger budgets",
                ));
            }
            if window_ms >= LUA_EXACT_MAX {
                return Err(ConfigError::new(
                    format!("{at}.slidingWindow.windowMs"),
                    "must stay below 2^53 ms (Lua numbers are doubles)",
                ));
            }
            Algorithm::SlidingWindow { limit, window_ms }
        }
    };

    // A sliding window stores one member per unit: one request may add at
    // most MAX_WINDOW_COST of them (a bounded ZADD, a bounded script).
    let quota = match algorithm {
        Algorithm::SlidingWindow { limit, .. } => limit.min(MAX_WINDOW_COST),
        Algorithm::TokenBucket { capacity, .. } => capacity,
    };
    let fixed = raw.cost.unwrap_or(1);
    if fixed == 0 || fixed > quota {
        return Err(ConfigError::new(
            format!("{at}.cost"),
            format!("must be between 1 and {quota} (the limit's quota; at most {MAX_WINDOW_COST} for a sliding window)"),
        ));
    }
    let cost = match raw.cost_header {
        None => Cost::Fixed(fixed),
        Some(h) => {
            let name = header_name(&h.name, &format!("{at}.costHeader.name"))?;
            if h.max == 0 || h.max > quota {
                return Err(ConfigError::new(
                    format!("{at}.costHeader.max"),
                    format!("must be between 1 and {quota} (the limit's quota; at most {MAX_WINDOW_COST} for a sliding window)"),
                ));
            }
            if fixed > h.max {
                return Err(ConfigError::new(
                    format!("{at}.cost"),
                    "the default cost must not exceed costHeader.max",
                ));
            }
            Cost::Header {
                name,
                default: fixed,
                max: h.max,
            }
        }
    };

    let local_per_mille = match raw.local_fraction {
        None => DEFAULT_LOCAL_PER_MILLE,
        Some(f) if f > 0.0 && f <= 1.0 => ((f * 1000.0).round() as u64).max(1),
        Some(_) => {
            return Err(ConfigError::new(
                format!("{at}.localFraction"),
                "must be greater than 0 and at most 1",
            ))
        }
    };
    let lease = match raw.lease {
        None => None,
        Some(l) => {
            let Algorithm::TokenBucket { capacity, .. } = algorithm else {
                return Err(ConfigError::new(
                    format!("{at}.lease"),
                    "applies to tokenBucket limits only",
                ));
            };
            if raw.shadow {
                return Err(ConfigError::new(
                    format!("{at}.lease"),
                    "a shadow limit never rejects: it has nothing to lease",
                ));
            }
            if l.tokens == 0 || l.tokens > capacity {
                return Err(ConfigError::new(
                    format!("{at}.lease.tokens"),
                    format!("must be between 1 and the capacity ({capacity})"),
                ));
            }
            if !(10..=600_000).contains(&l.ttl_ms) {
                return Err(ConfigError::new(
                    format!("{at}.lease.ttlMs"),
                    "must be between 10 and 600000",
                ));
            }
            Some(Lease {
                tokens: l.tokens,
                ttl: Duration::from_millis(l.ttl_ms),
            })
        }
    };
    let key_infix = format!(":{}:{}:", raw.name, algorithm.signature());
    Ok(Limit {
        lease,
        local_per_mille,
        name: raw.name,
        matcher,
        descriptor,
        algorithm,
        cost,
        shadow: raw.shadow,
        failure_mode: raw.failure_mode.unwrap_or(default_failure),
        key_infix,
    })
}

fn compile_match(raw: RawMatch, at: &str) -> Result<Matcher, ConfigError> {
    let path = match (raw.path_prefix, raw.path_exact) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::new(
                at,
                "set at most one of `pathPrefix` and `pathExact`",
            ))
        }
        (Some(p), None) => PathMatch::Prefix(match_path(p, &format!("{at}.pathPrefix"))?),
        (None, Some(p)) => PathMatch::Exact(match_path(p, &format!("{at}.pathExact"))?),
        (None, None) => PathMatch::Any,
    };
    let mut methods = Vec::with_capacity(raw.methods.len());
    for (i, m) in raw.methods.iter().enumerate() {
        if m.starts_with(':') || !valid_header_name(m) {
            return Err(ConfigError::new(
                format!("{at}.methods[{i}]"),
                format!("`{m}` is not an HTTP method"),
            ));
        }
        methods.push(m.to_ascii_uppercase());
    }
    let host = match raw.host {
        Some(h) if h.is_empty() => {
            return Err(ConfigError::new(format!("{at}.host"), "must not be empty"))
        }
        Some(h) => {
            // Requests are matched on their host without the port.
            let bare = h.strip_prefix('[').map_or(!h.contains(':'), |v6| {
                v6.ends_with(']') && !v6.contains('[')
            });
            if !bare || h.contains('/') || h.bytes().any(|b| !b.is_ascii_graphic()) {
                return Err(ConfigError::new(
                    format!("{at}.host"),
                    "must be a host name without port, path or spaces (it is compared with the request's host, port removed)",
                ));
            }
            Some(h.to_ascii_lowercase())
        }
        None => None,
    };
    let mut headers = Vec::with_capacity(raw.headers.len());
    for (i, h) in raw.headers.into_iter().enumerate() {
        let hat = format!("{at}.headers[{i}]");
        let name = header_name(&h.name, &format!("{hat}.name"))?;
        let cond = match (h.present, h.exact) {
            (Some(p), None) => HeaderCondition::Present(p),
            (None, Some(v)) => HeaderCondition::Exact(v),
            _ => {
                return Err(ConfigError::new(
                    hat,
                    "set exactly one of `present` and `exact`",
                ))
            }
        };
        headers.push((name, cond));
    }
    Ok(Matcher {
        path,
        methods,
        host,
        headers,
    })
}

fn match_path(p: String, field: &str) -> Result<String, ConfigError> {
    if !p.starts_with('/') {
        return Err(ConfigError::new(field, "must start with '/'"));
    }
    if p.contains('?') {
        return Err(ConfigError::new(
            field,
            "must not contain '?': requests are matched on their path without the query string",
        ));
    }
    Ok(p)
}

fn compile_idempotency(
    raw: RawIdempotency,
    at: &str,
    default_failure: FailureMode,
) -> Result<Idempotency, ConfigError> {
    if !valid_name(&raw.name) {
        return Err(ConfigError::new(
            format!("{at}.name"),
            "must be 1 to 64 characters of A-Z a-z 0-9 - _ .",
        ));
    }
    let mut matcher = compile_match(raw.matcher, &format!("{at}.match"))?;
    if matcher.methods.is_empty() {
        // The methods that are not idempotent by definition (RFC 9110).
        matcher.methods = vec!["POST".to_string(), "PATCH".to_string()];
    }
    let header = header_name(
        raw.header.as_deref().unwrap_or(DEFAULT_IDEMPOTENCY_HEADER),
        &format!("{at}.header"),
    )?;
    // The key must be something the client chose: a pseudo-header or a
    // framing header would turn every request into a "retry" of another.
    if header.starts_with(':') || FRAMING_HEADERS.contains(&header.as_str()) {
        return Err(ConfigError::new(
            format!("{at}.header"),
            format!("`{header}` cannot carry an idempotency key"),
        ));
    }
    let tenant = compile_parts(raw.tenant, &format!("{at}.tenant"))?;
    let lock_ttl_ms = raw.lock_ttl_ms.unwrap_or(DEFAULT_LOCK_TTL_MS);
    if !(100..=86_400_000).contains(&lock_ttl_ms) {
        return Err(ConfigError::new(
            format!("{at}.lockTtlMs"),
            "must be between 100 and 86400000 (keep it above the upstream timeout)",
        ));
    }
    let record_ttl_ms = raw.record_ttl_ms.unwrap_or(DEFAULT_RECORD_TTL_MS);
    if !(1000..=30 * 86_400_000).contains(&record_ttl_ms) {
        return Err(ConfigError::new(
            format!("{at}.recordTtlMs"),
            "must be between 1000 and 2592000000 (30 days)",
        ));
    }
    let mut store_classes = Vec::new();
    let mut store_exact = Vec::new();
    for (i, st) in raw
        .store_statuses
        .unwrap_or_else(|| vec!["2xx".to_string()])
        .iter()
        .enumerate()
    {
        let field = format!("{at}.storeStatuses[{i}]");
        let b = st.as_bytes();
        if b.len() == 3 && (b"2345".contains(&b[0])) && &b[1..] == b"xx" {
            store_classes.push(u32::from(b[0] - b'0'));
        } else if let Some(code) = (b.len() == 3 && b.iter().all(u8::is_ascii_digit))
            .then(|| st.parse::<u32>().ok())
            .flatten()
            .filter(|c| (200..600).contains(c))
        {
            store_exact.push(code);
        } else {
            return Err(ConfigError::new(
                field,
                format!(
                    "`{st}` is neither a class (2xx, 3xx, 4xx, 5xx) nor a status from 200 to 599"
                ),
            ));
        }
    }
    let store_headers = match raw.store_headers {
        None => vec!["content-type".to_string()],
        Some(names) => names
            .iter()
            .enumerate()
            .map(|(i, n)| header_name(n, &format!("{at}.storeHeaders[{i}]")))
            .collect::<Result<_, _>>()?,
    };
    for (i, h) in store_headers.iter().enumerate() {
        // The replay is a local reply: Envoy frames it itself.
        if h.starts_with(':') || FRAMING_HEADERS.contains(&h.as_str()) {
            return Err(ConfigError::new(
                format!("{at}.storeHeaders[{i}]"),
                format!("`{h}` is not stored: pseudo-headers and framing headers belong to each response"),
            ));
        }
        if store_headers[..i].contains(h) {
            return Err(ConfigError::new(
                format!("{at}.storeHeaders[{i}]"),
                format!("`{h}` is listed twice"),
            ));
        }
    }
    let max_request_body = raw
        .max_request_body_bytes
        .unwrap_or(DEFAULT_MAX_REQUEST_BODY);
    if max_request_body > 64 << 20 {
        return Err(ConfigError::new(
            format!("{at}.maxRequestBodyBytes"),
            "must be at most 67108864: the body is held in the proxy to fingerprint it",
        ));
    }
    let failure_mode = raw.failure_mode.unwrap_or(default_failure);
    if failure_mode == FailureMode::Local {
        return Err(ConfigError::new(
            format!("{at}.failureMode"),
            "`local` applies to rate limits only: an idempotency key cannot be kept locally; set allow or deny",
        ));
    }
    let max_stored_body = raw.max_stored_body_bytes.unwrap_or(DEFAULT_MAX_STORED_BODY);
    match raw.offload_above_bytes {
        None if max_stored_body > MAX_STORED_BODY => {
            return Err(ConfigError::new(
                format!("{at}.maxStoredBodyBytes"),
                format!("must be at most {MAX_STORED_BODY}: larger responses do not belong in Redis (set offloadAboveBytes to use an object store)"),
            ));
        }
        Some(_) if max_stored_body > MAX_OFFLOADED_BODY => {
            return Err(ConfigError::new(
                format!("{at}.maxStoredBodyBytes"),
                format!("must be at most {MAX_OFFLOADED_BODY}: the filter holds a body this large in memory while it uploads it"),
            ));
        }
        Some(above) if above > MAX_STORED_BODY => {
            return Err(ConfigError::new(
                format!("{at}.offloadAboveBytes"),
                format!("must be at most {MAX_STORED_BODY}: bodies up to it are kept in Redis"),
            ));
        }
        Some(above) if above >= max_stored_body => {
            return Err(ConfigError::new(
                format!("{at}.offloadAboveBytes"),
                format!("must be below maxStoredBodyBytes ({max_stored_body}), or nothing is ever offloaded"),
            ));
        }
        _ => {}
    }
    Ok(Idempotency {
        name: raw.name,
        matcher,
        header,
        required: raw.required,
        tenant,
        lock_ttl_ms,
        record_ttl_ms,
        store_classes,
        store_exact,
        store_headers,
        max_request_body: usize::try_from(max_request_body).unwrap_or(usize::MAX),
        max_stored_body: usize::try_from(max_stored_body).unwrap_or(usize::MAX),
        failure_mode,
        fingerprint_body: raw.fingerprint_body.unwrap_or(true),
        offload_above: raw
            .offload_above_bytes
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
    })
}

fn compile_object_store(
    raw: RawObjectStore,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ObjectStore, ConfigError> {
    let printable = |v: &str| !v.is_empty() && v.bytes().all(|b| b.is_ascii_graphic());
    if !printable(&raw.cluster) {
        return Err(ConfigError::new(
            "objectStore.cluster",
            "must name the Envoy cluster of the object store (printable ASCII, no spaces)",
        ));
    }
    let authority = raw.authority.unwrap_or_else(|| raw.cluster.clone());
    if !printable(&authority) || authority.contains('/') {
        return Err(ConfigError::new(
            "objectStore.authority",
            "must be a host[:port], printable ASCII without spaces or '/'",
        ));
    }
    // S3's bucket naming rules; path-style requests put the name in the path
    // unescaped, so anything else would be signed differently than sent.
    let b = raw.bucket.as_bytes();
    let bucket_ok = (3..=63).contains(&b.len())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'.' || *c == b'-')
        && b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric);
    if !bucket_ok {
        return Err(ConfigError::new(
            "objectStore.bucket",
            "must be 3 to 63 of a-z 0-9 . - starting and ending with a letter or digit",
        ));
    }
    let region_ok = !raw.region.is_empty()
        && raw.region.len() <= 32
        && raw
            .region
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-');
    if !region_ok {
        return Err(ConfigError::new(
            "objectStore.region",
            "must be a region name such as us-east-1 (a-z 0-9 -)",
        ));
    }
    let key_prefix = raw
        .key_prefix
        .unwrap_or_else(|| DEFAULT_OBJECT_KEY_PREFIX.to_string());
    // Printable ASCII keeps the signed path and the sent path one string; a
    // leading '/' would make an empty first path segment.
    if key_prefix.len() > 256
        || key_prefix.starts_with('/')
        || !key_prefix.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(ConfigError::new(
            "objectStore.keyPrefix",
            "must be at most 256 printable ASCII characters without spaces, not starting with '/'",
        ));
    }
    // Path segments that stores and proxies normalise (`a//b`, `.`, `..`)
    // would make the key used differ from the key signed.
    let segments = key_prefix.strip_suffix('/').unwrap_or(&key_prefix);
    if !segments.is_empty()
        && segments
            .split('/')
            .any(|seg| matches!(seg, "" | "." | ".."))
    {
        return Err(ConfigError::new(
            "objectStore.keyPrefix",
            "must not contain empty, `.` or `..` path segments",
        ));
    }
    let timeout_ms = raw.timeout_ms.unwrap_or(DEFAULT_OBJECT_TIMEOUT_MS);
    if timeout_ms == 0 || timeout_ms > MAX_OBJECT_TIMEOUT_MS {
        return Err(ConfigError::new(
            "objectStore.timeoutMs",
            format!("must be between 1 and {MAX_OBJECT_TIMEOUT_MS}"),
        ));
    }
    let credentials = compile_credentials(raw.credentials, env)?;
    Ok(ObjectStore {
        cluster: raw.cluster,
        authority,
        bucket: raw.bucket,
        region: raw.region,
        key_prefix,
        timeout: Duration::from_millis(timeout_ms),
        credentials,
    })
}

/// Credentials are never echoed in an error: errors name the field or the
/// environment variable, not its value.
fn compile_credentials(
    raw: RawCredentials,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<crate::sigv4::Credentials, ConfigError> {
    const AT: &str = "objectStore.credentials";
    let given = raw.access_key_id.is_some()
        || raw.secret_access_key.is_some()
        || raw.session_token.is_some();
    let from_env = raw.from_environment == Some(true);
    let (access_key_id, secret_access_key, session_token) = match raw.from_environment {
        Some(true) if given => {
            return Err(ConfigError::new(
                AT,
                "set either fromEnvironment or accessKeyId/secretAccessKey, not both",
            ))
        }
        Some(true) => {
            let var = |name: &str| {
                env(name).filter(|v| !v.is_empty()).ok_or_else(|| {
                    ConfigError::new(
                        format!("{AT}.fromEnvironment"),
                        format!("{name} is not set in the Wasm VM's environment (Envoy: vm_config.environment_variables.host_env_keys; Istio: vmConfig.env)"),
                    )
                })
            };
            (
                var(ENV_ACCESS_KEY_ID)?,
                var(ENV_SECRET_ACCESS_KEY)?,
                env(ENV_SESSION_TOKEN).filter(|v| !v.is_empty()),
            )
        }
        _ => match (raw.access_key_id, raw.secret_access_key) {
            (Some(id), Some(secret)) => (id, secret, raw.session_token),
            (None, _) => {
                return Err(ConfigError::new(
                    format!("{AT}.accessKeyId"),
                    "is required (or set fromEnvironment: true)",
                ))
            }
            (Some(_), None) => {
                return Err(ConfigError::new(
                    format!("{AT}.secretAccessKey"),
                    "is required with accessKeyId",
                ))
            }
        },
    };
    // They go into request headers (the key id in Authorization, the token
    // as itself): printable ASCII only.
    let header_safe =
        |v: &str| !v.is_empty() && v.len() <= 4096 && v.bytes().all(|b| b.is_ascii_graphic());
    let unsafe_value = |field: &str, var: &str| {
        if from_env {
            ConfigError::new(
                format!("{AT}.fromEnvironment"),
                format!("{var} must be printable ASCII without spaces"),
            )
        } else {
            ConfigError::new(
                format!("{AT}.{field}"),
                "must be printable ASCII without spaces",
            )
        }
    };
    if !header_safe(&access_key_id) {
        return Err(unsafe_value("accessKeyId", ENV_ACCESS_KEY_ID));
    }
    if !header_safe(&secret_access_key) {
        return Err(unsafe_value("secretAccessKey", ENV_SECRET_ACCESS_KEY));
    }
    if session_token.as_deref().is_some_and(|t| !header_safe(t)) {
        return Err(unsafe_value("sessionToken", ENV_SESSION_TOKEN));
    }
    Ok(crate::sigv4::Credentials {
        access_key_id,
        secret_access_key,
        session_token,
    })
}
