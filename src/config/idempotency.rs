//! Idempotency-key rules: which requests carry a key, how long a key is
//! held and a response kept, and which responses are stored.

use schemars::JsonSchema;
use serde::Deserialize;

use super::matcher::{compile_match, Matcher, RawMatch};
use super::parts::{compile_parts, Part, RawPart};
use super::{header_name, valid_name, ConfigError, FailureMode};
use crate::statuses::HttpStatuses;

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

/// One idempotency rule.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "IdempotencyRule")]
// maxStoredBodyBytes may reach 64 MiB only with an object store to put it in.
#[schemars(extend(
    "if" = {"not": {"required": ["offloadAboveBytes"]}},
    "then" = {"properties": {"maxStoredBodyBytes": {"maximum": 8388608}}}
))]
pub(super) struct RawIdempotency {
    /// Unique rule name: letters, digits, '-', '_', '.'; part of the record key.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9._-]+$"))]
    name: String,
    /// Which requests the rule covers (methods default to POST and PATCH).
    #[serde(default, rename = "match")]
    #[schemars(default = "super::defaults::all_defaults")]
    matcher: RawMatch,
    /// Request header carrying the key (default "idempotency-key").
    #[serde(default)]
    #[schemars(default = "super::defaults::idempotency_header")]
    header: Option<String>,
    /// Reject (400) a matching request without the header.
    #[serde(default)]
    required: bool,
    /// Parts scoping a key to a tenant (a key of one tenant never replays another's response).
    #[serde(default)]
    #[schemars(default = "super::defaults::no_items")]
    tenant: Vec<RawPart>,
    /// How long a request in flight holds the key (ms, default 30000); keep it above the upstream timeout.
    #[serde(default)]
    #[schemars(range(min = 100, max = 86400000))]
    #[schemars(default = "super::defaults::lock_ttl_ms")]
    lock_ttl_ms: Option<u64>,
    /// How long a completed response is replayed (ms, default 86400000, at most 30 days).
    #[serde(default)]
    #[schemars(range(min = 1000, max = 2592000000u64))]
    #[schemars(default = "super::defaults::record_ttl_ms")]
    record_ttl_ms: Option<u64>,
    /// Statuses whose responses are stored: classes ("2xx" to "5xx") or exact codes ("201"); default ["2xx"].
    #[serde(default)]
    #[schemars(default = "super::defaults::store_statuses")]
    store_statuses: Option<Vec<String>>,
    /// Response headers stored and replayed (default ["content-type"]).
    #[serde(default)]
    #[schemars(default = "super::defaults::store_headers")]
    store_headers: Option<Vec<String>>,
    /// gRPC calls: the grpc-status codes, by name, whose responses are
    /// stored and replayed (default OK, INVALID_ARGUMENT, NOT_FOUND,
    /// ALREADY_EXISTS, FAILED_PRECONDITION, OUT_OF_RANGE); any other code
    /// frees the key, so a retry runs again. A gRPC call stores all its
    /// headers and trailers; storeStatuses and storeHeaders do not apply.
    #[serde(default)]
    #[schemars(default = "super::defaults::grpc_store_statuses")]
    grpc_store_statuses: Option<Vec<String>>,
    /// Largest request body fingerprinted (bytes, default 1 MiB, at most 64 MiB).
    #[serde(default)]
    #[schemars(range(max = 67108864))]
    #[schemars(default = "super::defaults::max_request_body_bytes")]
    max_request_body_bytes: Option<u64>,
    /// Largest response body stored (bytes, default 64 KiB; at most 8 MiB,
    /// or 64 MiB with offloadAboveBytes).
    #[serde(default)]
    #[schemars(range(max = 67108864))]
    #[schemars(default = "super::defaults::max_stored_body_bytes")]
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
    #[schemars(default = "super::defaults::on")]
    fingerprint_body: Option<bool>,
    /// Responses whose body is larger than this many bytes are stored in the
    /// object store (top-level objectStore), Redis keeping only a reference;
    /// smaller ones stay in Redis. maxStoredBodyBytes still caps every stored
    /// body, and may then be up to 64 MiB.
    #[serde(default)]
    #[schemars(range(max = 8388608))]
    offload_above_bytes: Option<u64>,
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
    pub store: HttpStatuses,
    /// Lower-case response headers stored and replayed.
    pub store_headers: Vec<String>,
    /// gRPC status codes whose responses are stored.
    pub grpc_store: Vec<u32>,
    pub max_request_body: usize,
    pub max_stored_body: usize,
    pub failure_mode: FailureMode,
    /// The body is part of the fingerprint (the decision waits for it).
    pub fingerprint_body: bool,
    /// Bodies larger than this go to the object store.
    pub offload_above: Option<usize>,
}

impl Idempotency {
    pub fn stores(&self, status: u32) -> bool {
        self.store.contains(status)
    }

    pub fn stores_grpc(&self, code: u32) -> bool {
        self.grpc_store.contains(&code)
    }
}

/// The gRPC outcomes a retry gets again by default: success, and the errors
/// that say the request itself is what they are about (running it again
/// would give the same answer). Transient, auth and server-side failures
/// free the key.
pub(super) const GRPC_STORED: [&str; 6] = [
    "OK",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "FAILED_PRECONDITION",
    "OUT_OF_RANGE",
];

pub(super) fn compile_idempotency(
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
    let mut store = HttpStatuses::default();
    for (i, st) in raw
        .store_statuses
        .unwrap_or_else(|| vec!["2xx".to_string()])
        .iter()
        .enumerate()
    {
        let field = format!("{at}.storeStatuses[{i}]");
        if !store.add(st) {
            return Err(ConfigError::new(
                field,
                format!(
                    "`{st}` is neither a class (2xx, 3xx, 4xx, 5xx) nor a status from 200 to 599"
                ),
            ));
        }
    }
    let mut grpc_store = Vec::new();
    let names = raw
        .grpc_store_statuses
        .unwrap_or_else(|| GRPC_STORED.iter().map(|s| s.to_string()).collect());
    for (i, name) in names.iter().enumerate() {
        let Some(code) = crate::grpc::code_of(name) else {
            return Err(ConfigError::new(
                format!("{at}.grpcStoreStatuses[{i}]"),
                format!(
                    "`{name}` is not a gRPC status code name (OK, INVALID_ARGUMENT, NOT_FOUND, ...)"
                ),
            ));
        };
        if !grpc_store.contains(&code) {
            grpc_store.push(code);
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
        store,
        store_headers,
        grpc_store,
        max_request_body: usize::try_from(max_request_body).unwrap_or(usize::MAX),
        max_stored_body: usize::try_from(max_stored_body).unwrap_or(usize::MAX),
        failure_mode,
        fingerprint_body: raw.fingerprint_body.unwrap_or(true),
        offload_above: raw
            .offload_above_bytes
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
    })
}
