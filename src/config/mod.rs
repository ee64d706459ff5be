//! Plugin configuration: the JSON users write, and the compiled form the
//! filter uses on every request. Parsing happens once, in `on_configure`;
//! every rejection names the field it is about.
//!
//! This module holds the whole configuration and the rules that span
//! features (hash tag parts in every descriptor and tenant, offloading rules
//! against the object store); each feature's types and checks are in its file.

mod access_log;
mod algorithm;
mod block;
mod bounds;
mod defaults;
mod deny;
mod idempotency;
mod limit;
mod matcher;
mod object_store;
mod overrides;
mod parts;
mod quota;
mod redis;
mod usage;

use std::fmt;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::request::{RequestLine, RequestView};

pub use access_log::{AccessLog, KeyInLog};
pub use algorithm::Algorithm;
pub use bounds::{CONCURRENCY_LEASE_MS, MAX_CONCURRENCY, MAX_COUNTER_LIMIT, MAX_WINDOW_COST};
pub use deny::DenyRule;
pub use idempotency::{
    Idempotency, DEFAULT_IDEMPOTENCY_HEADER, DEFAULT_LOCK_TTL_MS, DEFAULT_MAX_REQUEST_BODY,
    DEFAULT_MAX_STORED_BODY, DEFAULT_RECORD_TTL_MS, MAX_OFFLOADED_BODY,
};
pub use limit::{
    Cost, Lease, Limit, DEFAULT_CONCURRENCY_LEASE_MS, DEFAULT_LOCAL_PER_MILLE, RENEWALS_PER_LEASE,
};
pub use matcher::{Condition, Matcher, PathMatch};
pub use object_store::{
    ObjectStore, DEFAULT_OBJECT_KEY_PREFIX, DEFAULT_OBJECT_TIMEOUT_MS, ENV_ACCESS_KEY_ID,
    ENV_SECRET_ACCESS_KEY, ENV_SESSION_TOKEN,
};
pub use overrides::Overrides;
pub use parts::{descriptor, Part, Read};
pub use redis::{
    Batch, RedisTarget, DEFAULT_BREAKER_COOL_DOWN_MS, DEFAULT_BREAKER_FAILURES, DEFAULT_TIMEOUT_MS,
};
pub use usage::{Usage, DEFAULT_USAGE_BODY, MAX_USAGE_BODY, MAX_USAGE_UNITS};

use access_log::{compile_access_log, RawAccessLog};
use deny::{compile_deny, RawDenyRule};
use idempotency::{compile_idempotency, RawIdempotency};
use limit::{compile_limit, RawLimit};
use object_store::{compile_object_store, RawObjectStore};
use parts::{compile_parts, static_hash_tag, RawPart};
use redis::{compile_redis, RawRedis};

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

// The JSON as written (`Raw*` types, each in its feature's file beside the
// compiled form and its `compile_*`). Unknown fields are errors everywhere: a
// misspelled key must not silently turn a limit off. The same types generate
// the JSON Schema editors validate against (`envoy/filter.schema.json`), so
// the schema cannot drift from the parser; doc comments become its descriptions.

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
    #[schemars(default = "defaults::key_prefix")]
    key_prefix: Option<String>,
    /// Parts whose values pick the Redis Cluster hash tag, so every key of one
    /// tenant lives in one slot. Every non-literal part must also be in each
    /// limit's descriptor and each idempotency rule's tenant.
    #[serde(default)]
    #[schemars(default = "defaults::no_items")]
    hash_tag: Vec<RawPart>,
    /// What a request gets when Redis cannot decide it (default "allow").
    #[serde(default)]
    #[schemars(default = "defaults::failure_mode")]
    failure_mode: Option<FailureMode>,
    /// Rate-limit header families on responses (default both).
    #[serde(default)]
    #[schemars(default = "defaults::rate_limit_headers")]
    rate_limit_headers: Option<Vec<HeaderSet>>,
    /// Requests refused `403` before any limit or Redis call (client
    /// networks, keys, claims): the first rule that matches refuses.
    #[serde(default)]
    #[schemars(default = "defaults::no_items")]
    deny: Vec<RawDenyRule>,
    /// Rate limits; every matching limit is checked in one Redis call.
    #[serde(default)]
    #[schemars(default = "defaults::no_items")]
    limits: Vec<RawLimit>,
    /// Idempotency-key rules; the first matching rule applies.
    #[serde(default)]
    #[schemars(default = "defaults::no_items")]
    idempotency: Vec<RawIdempotency>,
    /// S3-compatible object store for large idempotent responses (rules with
    /// offloadAboveBytes): Redis keeps a reference and a checksum, the store the body.
    #[serde(default)]
    object_store: Option<RawObjectStore>,
    /// What each decision leaves in Envoy's access log (filter state
    /// `wasm.redis_guard`).
    #[serde(default)]
    #[schemars(default = "defaults::all_defaults")]
    access_log: Option<RawAccessLog>,
    /// The schema this file follows (for editors); ignored by the filter.
    #[serde(default, rename = "$schema")]
    #[allow(dead_code)]
    schema: Option<String>,
}

/// What to do with a request when Redis cannot decide it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, JsonSchema)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
pub enum HeaderSet {
    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers).
    #[serde(rename = "ietf")]
    Ietf,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    #[serde(rename = "x-ratelimit")]
    XRateLimit,
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
    pub deny: Vec<DenyRule>,
    pub limits: Vec<Limit>,
    pub idempotency: Vec<Idempotency>,
    pub object_store: Option<ObjectStore>,
    pub access_log: AccessLog,
}

pub const DEFAULT_KEY_PREFIX: &str = "rg";

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

    /// The hash tag of this request (16 hex digits), from the configured parts; a
    /// missing header counts as an empty value so the tag always exists.
    pub fn hash_tag_for(&self, line: &RequestLine, view: &dyn RequestView) -> String {
        if let Some(tag) = &self.static_tag {
            return tag.clone();
        }
        crate::keys::hash_tag_of(
            self.hash_tag
                .iter()
                .map(|part| part.value(line, view).unwrap_or_default()),
        )
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

/// Fields whose value is a list.
const LIST_FIELDS: &[&str] = &[
    "hashTag",
    "limits",
    "idempotency",
    "tenant",
    "storeStatuses",
    "storeHeaders",
    "grpcStoreStatuses",
    "descriptor",
    "methods",
    "headers",
    "rateLimitHeaders",
    "json",
    "reserveFrom",
    "path",
    "values",
    "deny",
    "countStatuses",
    "clientNetworks",
    "oneOf",
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

/// A credential read from the Wasm VM's environment (`fromEnvironment`
/// under `at`): set and not empty, or an error naming the variable (never a
/// value) and where Envoy and Istio pass it.
fn from_vm_env(
    env: &dyn Fn(&str) -> Option<String>,
    at: &str,
    name: &str,
) -> Result<String, ConfigError> {
    env(name).filter(|v| !v.is_empty()).ok_or_else(|| {
        ConfigError::new(
            format!("{at}.fromEnvironment"),
            format!("{name} is not set in the Wasm VM's environment (Envoy: vm_config.environment_variables.host_env_keys; Istio: vmConfig.env)"),
        )
    })
}

fn compile(raw: RawConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    let redis = compile_redis(raw.redis, env)?;
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
        // A running request renews its slot every quarter lease; each renewal
        // must be over (answered or timed out) before the next is due, or
        // one slow call costs the slot.
        if let Algorithm::Concurrency { lease_ms, .. } = limit.algorithm {
            let least = redis.timeout.saturating_mul(RENEWALS_PER_LEASE);
            if Duration::from_millis(lease_ms) < least {
                return Err(ConfigError::new(
                    format!("{at}.concurrency.leaseMs"),
                    format!(
                        "must be at least {} ms ({RENEWALS_PER_LEASE} × redis.timeoutMs): the lease is renewed every quarter of it, each renewal within the timeout",
                        least.as_millis()
                    ),
                ));
            }
        }
        limits.push(limit);
    }

    let deny = compile_deny(raw.deny)?;
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
        needs: needs(&hash_tag, &limits, &idempotency, &deny),
        static_tag: static_hash_tag(&hash_tag),
        hash_tag,
        headers_ietf,
        headers_x,
        deny,
        limits,
        idempotency,
        object_store,
        access_log: compile_access_log(raw.access_log),
    })
}

/// What of the request line the compiled rules read (see `Needs`). Every
/// idempotency rule matches on methods and fingerprints method and path.
fn needs(
    hash_tag: &[Part],
    limits: &[Limit],
    idempotency: &[Idempotency],
    deny: &[DenyRule],
) -> crate::request::Needs {
    let matchers = limits
        .iter()
        .map(|l| &l.matcher)
        .chain(limits.iter().filter_map(|l| l.unless.as_ref()))
        .chain(deny.iter().map(|d| &d.matcher))
        .chain(idempotency.iter().map(|r| &r.matcher));
    let parts: Vec<&Part> = hash_tag
        .iter()
        .chain(limits.iter().flat_map(|l| l.descriptor.iter()))
        .chain(limits.iter().filter_map(|l| l.overrides.request.as_ref()))
        .chain(idempotency.iter().flat_map(|r| r.tenant.iter()))
        .chain(
            matchers
                .clone()
                .flat_map(|m| m.values.iter().map(|(p, _)| p)),
        )
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

#[cfg(test)]
mod tests {
    use crate::request::fake::FakeRequest;
    use crate::request::{fake, Needs, RequestLine};

    #[test]
    fn a_config_reads_only_the_request_line_parts_it_uses() {
        let needs = |json: &str| {
            crate::config::Config::parse(
                format!(r#"{{"redis":{{"cluster":"w"}},{json}}}"#).as_bytes(),
            )
            .unwrap()
            .needs
        };
        let tb = r#""tokenBucket":{"capacity":1,"refill":1,"periodMs":1000}"#;
        let none = Needs {
            method: false,
            path: false,
            host: false,
        };
        assert_eq!(
            needs(&format!(
                r#""limits":[{{"name":"a","descriptor":[{{"header":"x"}}],{tb}}}]"#
            )),
            none
        );
        assert_eq!(
            needs(&format!(
                r#""limits":[{{"name":"a","match":{{"pathPrefix":"/a"}},{tb}}}]"#
            )),
            Needs { path: true, ..none }
        );
        assert_eq!(
            needs(&format!(
                r#""limits":[{{"name":"a","match":{{"methods":["GET"]}},{tb}}}]"#
            )),
            Needs {
                method: true,
                ..none
            }
        );
        assert_eq!(
            needs(&format!(
                r#""limits":[{{"name":"a","match":{{"host":"h"}},{tb}}}]"#
            )),
            Needs { host: true, ..none }
        );
        assert_eq!(
            needs(&format!(
                r#""limits":[{{"name":"a","descriptor":["method","path"],{tb}}}]"#
            )),
            Needs {
                host: false,
                ..Needs::ALL
            }
        );
        assert_eq!(
            needs(r#""idempotency":[{"name":"p"}]"#),
            Needs {
                host: false,
                ..Needs::ALL
            }
        );
        // What is not needed is not read.
        let mut req = fake::FakeRequest::default();
        req.headers.insert(":method".into(), b"GET".to_vec());
        req.headers.insert(":path".into(), b"/x".to_vec());
        let line = RequestLine::read_needed(&req, Needs { path: true, ..none });
        assert_eq!((line.method.as_str(), &line.path[..]), ("", &b"/x"[..]));
    }

    #[test]
    fn a_hash_tag_of_literals_is_computed_once_and_equals_the_per_request_one() {
        for tags in [r#"[]"#, r#"[{"literal":"eu"},{"literal":"v2"}]"#] {
            let json = format!(r#"{{"redis":{{"cluster":"w"}},"hashTag":{tags}}}"#);
            let mut config = crate::config::Config::parse(json.as_bytes()).unwrap();
            let fixed = config.static_tag.clone().expect("precomputed");
            config.static_tag = None;
            let req = FakeRequest::default();
            let line = RequestLine::read(&req);
            assert_eq!(config.hash_tag_for(&line, &req), fixed);
        }
        let json = br#"{"redis":{"cluster":"w"},"hashTag":[{"header":"x-t"}],
            "limits":[{"name":"a","descriptor":[{"header":"x-t"}],
            "tokenBucket":{"capacity":1,"refill":1,"periodMs":1000}}]}"#;
        assert_eq!(crate::config::Config::parse(json).unwrap().static_tag, None);
    }
}
