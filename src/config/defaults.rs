//! The defaults the schema states: `envoy/filter.schema.json`'s `default`
//! of each field, which the configuration reference shows in its default
//! column. Each is what the parser takes for the field left out, read from
//! the constants the parser itself uses where it has one. A field points
//! here with `#[schemars(default = "super::defaults::…")]` (schema only: serde
//! still reads the field as it did). `tests/config_schema.rs` writes every
//! stated default into the example configurations where the field is left
//! out and checks that the parser then reads the same configuration.

use super::access_log::KeyInLog;
use super::idempotency::{
    DEFAULT_IDEMPOTENCY_HEADER, DEFAULT_LOCK_TTL_MS, DEFAULT_MAX_REQUEST_BODY,
    DEFAULT_MAX_STORED_BODY, DEFAULT_RECORD_TTL_MS, GRPC_STORED,
};
use super::limit::{DEFAULT_CONCURRENCY_LEASE_MS, DEFAULT_LOCAL_PER_MILLE};
use super::object_store::{DEFAULT_OBJECT_KEY_PREFIX, DEFAULT_OBJECT_TIMEOUT_MS};
use super::parts::{DEFAULT_V4_PREFIX, DEFAULT_V6_PREFIX};
use super::redis::{
    DEFAULT_BATCH_IN_FLIGHT, DEFAULT_BATCH_MAX_REQUESTS, DEFAULT_BREAKER_COOL_DOWN_MS,
    DEFAULT_BREAKER_FAILURES, DEFAULT_TIMEOUT_MS,
};
use super::usage::DEFAULT_USAGE_BODY;
use super::{FailureMode, HeaderSet, DEFAULT_KEY_PREFIX};

/// A list left out: no items.
pub(super) fn no_items() -> [u8; 0] {
    []
}

/// An object left out whose fields all have defaults: the same as `{}`.
pub(super) fn all_defaults() -> serde_json::Map<String, serde_json::Value> {
    serde_json::Map::new()
}

pub(super) fn off() -> bool {
    false
}

pub(super) fn on() -> bool {
    true
}

/// A cost, a reserve, a weight, a quota's anchor day.
pub(super) fn one() -> u64 {
    1
}

// The top level.

pub(super) fn key_prefix() -> &'static str {
    DEFAULT_KEY_PREFIX
}

pub(super) fn failure_mode() -> FailureMode {
    FailureMode::default()
}

pub(super) fn rate_limit_headers() -> [HeaderSet; 2] {
    [HeaderSet::Ietf, HeaderSet::XRateLimit]
}

// redis

pub(super) fn timeout_ms() -> u64 {
    DEFAULT_TIMEOUT_MS
}

pub(super) fn breaker_failures() -> u32 {
    DEFAULT_BREAKER_FAILURES
}

pub(super) fn breaker_cool_down_ms() -> u64 {
    DEFAULT_BREAKER_COOL_DOWN_MS
}

pub(super) fn batch_max_requests() -> u32 {
    DEFAULT_BATCH_MAX_REQUESTS
}

pub(super) fn batch_max_in_flight() -> u32 {
    DEFAULT_BATCH_IN_FLIGHT
}

// limits[]

pub(super) fn local_fraction() -> f64 {
    DEFAULT_LOCAL_PER_MILLE as f64 / 1000.0
}

pub(super) fn concurrency_lease_ms() -> u64 {
    DEFAULT_CONCURRENCY_LEASE_MS
}

pub(super) fn usage_max_body_bytes() -> usize {
    DEFAULT_USAGE_BODY
}

pub(super) fn metadata_type() -> &'static str {
    "string"
}

pub(super) fn client_prefix_v4() -> u8 {
    DEFAULT_V4_PREFIX
}

pub(super) fn client_prefix_v6() -> u8 {
    DEFAULT_V6_PREFIX
}

// idempotency[]

pub(super) fn idempotency_header() -> &'static str {
    DEFAULT_IDEMPOTENCY_HEADER
}

pub(super) fn lock_ttl_ms() -> u64 {
    DEFAULT_LOCK_TTL_MS
}

pub(super) fn record_ttl_ms() -> u64 {
    DEFAULT_RECORD_TTL_MS
}

pub(super) fn store_statuses() -> [&'static str; 1] {
    ["2xx"]
}

pub(super) fn store_headers() -> [&'static str; 1] {
    ["content-type"]
}

pub(super) fn grpc_store_statuses() -> [&'static str; 6] {
    GRPC_STORED
}

pub(super) fn max_request_body_bytes() -> u64 {
    DEFAULT_MAX_REQUEST_BODY
}

pub(super) fn max_stored_body_bytes() -> u64 {
    DEFAULT_MAX_STORED_BODY
}

// objectStore, accessLog

pub(super) fn object_key_prefix() -> &'static str {
    DEFAULT_OBJECT_KEY_PREFIX
}

pub(super) fn object_timeout_ms() -> u64 {
    DEFAULT_OBJECT_TIMEOUT_MS
}

pub(super) fn access_log_key() -> KeyInLog {
    KeyInLog::default()
}
