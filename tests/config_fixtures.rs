//! Configuration fixtures, in the style of envoyproxy/ratelimit: one file per
//! error under `tests/fixtures/config/bad/`, each a complete config that is
//! valid except for exactly one problem, and whole valid configs under
//! `tests/fixtures/config/good/`.
//!
//! Every bad fixture must appear in [`REJECTED`], with the field and the words
//! the error must carry.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use redis_guard::config::Config;

/// (fixture file in `bad/`, expected `ConfigError::field`, substring of `reason`).
/// An empty field means the error is about the document as a whole.
const REJECTED: &[(&str, &str, &str)] = &[
    // Document and JSON types.
    ("not_json.json", "", "expected value"),
    ("empty_file.json", "", "EOF while parsing"),
    ("top_level_not_object.json", "", "invalid type: string"),
    ("duplicate_key.json", "redis", "duplicate field `cluster`"),
    (
        "wrong_type_capacity_string.json",
        "limits[0].tokenBucket.capacity",
        "invalid type: string \"10\", expected u64",
    ),
    (
        "wrong_type_capacity_float.json",
        "limits[0].tokenBucket.capacity",
        "invalid type: floating point `10.5`",
    ),
    (
        "negative_number.json",
        "limits[0].tokenBucket.refill",
        "invalid value: integer `-1`",
    ),
    ("limits_not_array.json", "limits", "expected a sequence"),
    (
        "shadow_not_bool.json",
        "limits[0].shadow",
        "expected a boolean",
    ),
    // Unknown and missing fields.
    (
        "unknown_top_level_field.json",
        "rateLimits",
        "unknown field `rateLimits`",
    ),
    (
        "limit_misspelled_field.json",
        "limits[0].tokenBucket.capacty",
        "unknown field `capacty`",
    ),
    (
        "match_unknown_field.json",
        "limits[0].match.pathRegex",
        "unknown field `pathRegex`",
    ),
    ("redis_missing.json", "", "missing field `redis`"),
    (
        "redis_cluster_missing.json",
        "redis",
        "missing field `cluster`",
    ),
    (
        "limit_name_missing.json",
        "limits[0]",
        "missing field `name`",
    ),
    (
        "token_bucket_period_missing.json",
        "limits[0].tokenBucket",
        "missing field `periodMs`",
    ),
    // redis
    ("redis_cluster_empty.json", "redis.cluster", "Envoy cluster"),
    ("redis_cluster_blank.json", "redis.cluster", "Envoy cluster"),
    (
        "redis_authority_empty.json",
        "redis.authority",
        "must not be empty",
    ),
    (
        "redis_timeout_zero.json",
        "redis.timeoutMs",
        "between 1 and 60000",
    ),
    (
        "redis_timeout_too_large.json",
        "redis.timeoutMs",
        "between 1 and 60000",
    ),
    // keyPrefix, hashTag, failureMode, rateLimitHeaders
    ("key_prefix_brace.json", "keyPrefix", "'{' or '}'"),
    ("key_prefix_space.json", "keyPrefix", "without spaces"),
    ("key_prefix_empty.json", "keyPrefix", "1 to 64 characters"),
    (
        "key_prefix_too_long.json",
        "keyPrefix",
        "1 to 64 characters",
    ),
    (
        "hash_tag_header_invalid.json",
        "hashTag[0].header",
        "`x tenant` is not a valid header name",
    ),
    (
        "failure_mode_unknown.json",
        "failureMode",
        "unknown variant `open`, expected one of `allow`, `deny`, `local`",
    ),
    (
        "limit_failure_mode_unknown.json",
        "limits[0].failureMode",
        "unknown variant `closed`",
    ),
    (
        "rate_limit_headers_unknown.json",
        "rateLimitHeaders[1]",
        "unknown variant `draft-7`, expected `ietf` or `x-ratelimit`",
    ),
    // Limit shape and name.
    (
        "limit_no_algorithm.json",
        "limits[0]",
        "set exactly one of `tokenBucket` and `slidingWindow`",
    ),
    ("limit_both_algorithms.json", "limits[0]", "not both"),
    (
        "limit_name_duplicate.json",
        "limits[1].name",
        "duplicate limit name `per-user`",
    ),
    (
        "limit_name_space.json",
        "limits[0].name",
        "A-Z a-z 0-9 - _ .",
    ),
    (
        "limit_name_empty.json",
        "limits[0].name",
        "1 to 64 characters",
    ),
    // tokenBucket
    (
        "token_bucket_capacity_zero.json",
        "limits[0].tokenBucket.capacity",
        "must be at least 1",
    ),
    (
        "token_bucket_refill_zero.json",
        "limits[0].tokenBucket.refill",
        "must be at least 1",
    ),
    (
        "token_bucket_period_zero.json",
        "limits[0].tokenBucket.periodMs",
        "must be at least 1",
    ),
    (
        "token_bucket_capacity_times_period_overflow.json",
        "limits[0].tokenBucket",
        "capacity * periodMs must stay below 2^53",
    ),
    (
        "token_bucket_refill_times_period_overflow.json",
        "limits[0].tokenBucket",
        "refill * periodMs must stay below 2^53",
    ),
    // slidingWindow
    (
        "sliding_window_limit_zero.json",
        "limits[0].slidingWindow.limit",
        "must be at least 1",
    ),
    (
        "sliding_window_window_zero.json",
        "limits[0].slidingWindow.windowMs",
        "must be at least 1",
    ),
    (
        "sliding_window_limit_too_large.json",
        "limits[0].slidingWindow.limit",
        "at most 1000000",
    ),
    (
        "sliding_window_window_too_large.json",
        "limits[0].slidingWindow.windowMs",
        "below 2^53",
    ),
    // cost and costHeader
    (
        "cost_zero.json",
        "limits[0].cost",
        "must be between 1 and 10 (the limit's quota",
    ),
    (
        "cost_above_quota.json",
        "limits[0].cost",
        "must be between 1 and 10 (the limit's quota",
    ),
    (
        "cost_header_max_above_quota.json",
        "limits[0].costHeader.max",
        "must be between 1 and 10 (the limit's quota",
    ),
    (
        "cost_header_max_zero.json",
        "limits[0].costHeader.max",
        "must be between 1 and 10 (the limit's quota",
    ),
    (
        "cost_header_name_invalid.json",
        "limits[0].costHeader.name",
        "`x cost` is not a valid header name",
    ),
    (
        "cost_default_above_cost_header_max.json",
        "limits[0].cost",
        "must not exceed costHeader.max",
    ),
    // match
    (
        "match_path_prefix_no_slash.json",
        "limits[0].match.pathPrefix",
        "must start with '/'",
    ),
    (
        "match_path_exact_no_slash.json",
        "limits[0].match.pathExact",
        "must start with '/'",
    ),
    (
        "match_path_prefix_and_exact.json",
        "limits[0].match",
        "at most one of `pathPrefix` and `pathExact`",
    ),
    (
        "match_method_invalid.json",
        "limits[0].match.methods[1]",
        "`PO ST` is not an HTTP method",
    ),
    (
        "match_method_empty.json",
        "limits[0].match.methods[0]",
        "is not an HTTP method",
    ),
    (
        "match_host_empty.json",
        "limits[0].match.host",
        "must not be empty",
    ),
    (
        "match_header_present_and_exact.json",
        "limits[0].match.headers[0]",
        "exactly one of `present` and `exact`",
    ),
    (
        "match_header_no_condition.json",
        "limits[0].match.headers[0]",
        "exactly one of `present` and `exact`",
    ),
    (
        "match_header_name_invalid.json",
        "limits[0].match.headers[0].name",
        "`x:plan` is not a valid header name",
    ),
    // descriptor
    (
        "descriptor_unknown_part.json",
        "limits[0].descriptor[0]",
        "unknown variant `cookie`, expected one of `header`, `literal`, `clientAddress`",
    ),
    (
        "descriptor_unknown_unit_part.json",
        "limits[0].descriptor[0]",
        "unknown variant `clientIp`",
    ),
    (
        "descriptor_header_invalid.json",
        "limits[0].descriptor[0].header",
        "`x user` is not a valid header name",
    ),
    (
        "descriptor_header_empty.json",
        "limits[0].descriptor[0].header",
        "is not a valid header name",
    ),
    // Rejected at the right field, but the reason ("expected value at line ..")
    // does not say that a part takes exactly one key.
    (
        "descriptor_part_two_keys.json",
        "limits[0].descriptor[0]",
        "expected value",
    ),
    (
        "hash_tag_not_in_descriptor.json",
        "limits[0].descriptor",
        "must include every hashTag part (missing {\"header\": \"x-tenant\"})",
    ),
    (
        "sliding_window_cost_above_1000.json",
        "limits[0].cost",
        "at most 1000 for a sliding window",
    ),
    (
        "redis_breaker_failures_zero.json",
        "redis.circuitBreaker.failures",
        "between 1 and 1000",
    ),
    (
        "redis_breaker_cool_down_too_short.json",
        "redis.circuitBreaker.coolDownMs",
        "between 10 and 600000",
    ),
    (
        "redis_breaker_unknown_field.json",
        "redis.circuitBreaker.coolDown",
        "unknown field `coolDown`",
    ),
    (
        "limit_local_fraction_too_large.json",
        "limits[0].localFraction",
        "greater than 0 and at most 1",
    ),
    (
        "limit_local_fraction_zero.json",
        "limits[0].localFraction",
        "greater than 0 and at most 1",
    ),
    (
        "idempotency_failure_mode_local.json",
        "idempotency[0].failureMode",
        "`local` applies to rate limits only",
    ),
    (
        "redis_authority_header_injection.json",
        "redis.authority",
        "printable ASCII without spaces",
    ),
    // Shapes serde alone would accept.
    ("trailing_characters.json", "", "trailing characters"),
    ("config_as_array.json", "", "found an array"),
    // Token lease.
    (
        "lease_on_sliding_window.json",
        "limits[0].lease",
        "tokenBucket limits only",
    ),
    ("lease_on_shadow_limit.json", "limits[0].lease", "shadow"),
    (
        "lease_tokens_zero.json",
        "limits[0].lease.tokens",
        "between 1 and the capacity (10)",
    ),
    (
        "lease_tokens_over_capacity.json",
        "limits[0].lease.tokens",
        "between 1 and the capacity (10)",
    ),
    (
        "lease_ttl_too_small.json",
        "limits[0].lease.ttlMs",
        "between 10 and 600000",
    ),
    (
        "lease_unknown_field.json",
        "limits[0].lease.ttl",
        "unknown field `ttl`",
    ),
    (
        "token_bucket_as_array.json",
        "limits[0].tokenBucket",
        "found an array",
    ),
    // Values that would never match anything.
    (
        "match_host_with_port.json",
        "limits[0].match.host",
        "without port",
    ),
    (
        "match_path_with_query.json",
        "limits[0].match.pathExact",
        "must not contain '?'",
    ),
    ("redis_cluster_padded.json", "redis.cluster", "white space"),
    // idempotency: shape and JSON types.
    (
        "idempotency_not_array.json",
        "idempotency",
        "expected a sequence",
    ),
    (
        "idempotency_rule_as_array.json",
        "idempotency[0]",
        "found an array",
    ),
    (
        "idempotency_unknown_field.json",
        "idempotency[0].lockTtl",
        "unknown field `lockTtl`",
    ),
    (
        "idempotency_name_missing.json",
        "idempotency[0]",
        "missing field `name`",
    ),
    (
        "idempotency_required_not_bool.json",
        "idempotency[0].required",
        "expected a boolean",
    ),
    (
        "idempotency_fingerprint_body_not_bool.json",
        "idempotency[0].fingerprintBody",
        "expected a boolean",
    ),
    (
        "idempotency_tenant_not_array.json",
        "idempotency[0].tenant",
        "expected a sequence",
    ),
    (
        "idempotency_store_status_number.json",
        "idempotency[0].storeStatuses[0]",
        "invalid type: integer `201`, expected a string",
    ),
    // idempotency: name and header.
    (
        "idempotency_name_space.json",
        "idempotency[0].name",
        "A-Z a-z 0-9 - _ .",
    ),
    (
        "idempotency_name_empty.json",
        "idempotency[0].name",
        "1 to 64 characters",
    ),
    (
        "idempotency_name_too_long.json",
        "idempotency[0].name",
        "1 to 64 characters",
    ),
    (
        "idempotency_name_duplicate.json",
        "idempotency[1].name",
        "duplicate idempotency rule name `payments`",
    ),
    (
        "idempotency_header_invalid.json",
        "idempotency[0].header",
        "`idempotency key` is not a valid header name",
    ),
    (
        "idempotency_header_empty.json",
        "idempotency[0].header",
        "is not a valid header name",
    ),
    // idempotency: match.
    (
        "idempotency_match_path_prefix_no_slash.json",
        "idempotency[0].match.pathPrefix",
        "must start with '/'",
    ),
    (
        "idempotency_match_unknown_field.json",
        "idempotency[0].match.pathRegex",
        "unknown field `pathRegex`",
    ),
    (
        "idempotency_match_method_invalid.json",
        "idempotency[0].match.methods[1]",
        "`PO ST` is not an HTTP method",
    ),
    // idempotency: tenant and hashTag.
    (
        "idempotency_tenant_unknown_part.json",
        "idempotency[0].tenant[0]",
        "unknown variant `cookie`, expected one of `header`, `literal`, `clientAddress`",
    ),
    (
        "idempotency_tenant_header_invalid.json",
        "idempotency[0].tenant[0].header",
        "`x user` is not a valid header name",
    ),
    (
        "idempotency_hash_tag_not_in_tenant.json",
        "idempotency[0].tenant",
        "must include every hashTag part (missing {\"header\": \"x-tenant\"})",
    ),
    // idempotency: TTLs.
    (
        "idempotency_lock_ttl_too_small.json",
        "idempotency[0].lockTtlMs",
        "between 100 and 86400000",
    ),
    (
        "idempotency_lock_ttl_too_large.json",
        "idempotency[0].lockTtlMs",
        "between 100 and 86400000",
    ),
    (
        "idempotency_record_ttl_too_small.json",
        "idempotency[0].recordTtlMs",
        "between 1000 and 2592000000",
    ),
    (
        "idempotency_record_ttl_too_large.json",
        "idempotency[0].recordTtlMs",
        "between 1000 and 2592000000",
    ),
    // idempotency: what is stored.
    (
        "idempotency_store_status_bad_class.json",
        "idempotency[0].storeStatuses[1]",
        "`2xy` is neither a class (2xx, 3xx, 4xx, 5xx) nor a status from 200 to 599",
    ),
    (
        "idempotency_store_status_1xx_class.json",
        "idempotency[0].storeStatuses[0]",
        "`1xx` is neither a class",
    ),
    (
        "idempotency_store_status_199.json",
        "idempotency[0].storeStatuses[0]",
        "`199` is neither a class",
    ),
    (
        "idempotency_store_status_600.json",
        "idempotency[0].storeStatuses[2]",
        "`600` is neither a class",
    ),
    (
        "idempotency_store_header_invalid.json",
        "idempotency[0].storeHeaders[1]",
        "`x request id` is not a valid header name",
    ),
    (
        "idempotency_store_header_pseudo.json",
        "idempotency[0].storeHeaders[1]",
        "`:status` is not stored: pseudo-headers and framing headers",
    ),
    (
        "idempotency_store_header_framing.json",
        "idempotency[0].storeHeaders[1]",
        "`transfer-encoding` is not stored",
    ),
    (
        "idempotency_store_header_duplicate.json",
        "idempotency[0].storeHeaders[1]",
        "`etag` is listed twice",
    ),
    (
        "idempotency_header_pseudo.json",
        "idempotency[0].header",
        "`:path` cannot carry an idempotency key",
    ),
    (
        "idempotency_header_framing.json",
        "idempotency[0].header",
        "`content-length` cannot carry an idempotency key",
    ),
    (
        "idempotency_store_status_plus.json",
        "idempotency[0].storeStatuses[1]",
        "`+200` is neither a class",
    ),
    (
        "idempotency_max_request_body_too_large.json",
        "idempotency[0].maxRequestBodyBytes",
        "at most 67108864",
    ),
    (
        "idempotency_max_stored_body_too_large.json",
        "idempotency[0].maxStoredBodyBytes",
        "at most 8388608",
    ),
    // idempotency: failureMode.
    (
        "idempotency_failure_mode_unknown.json",
        "idempotency[0].failureMode",
        "unknown variant `closed`, expected one of `allow`, `deny`, `local`",
    ),
];

fn fixtures_dir(kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/config")
        .join(kind)
}

fn read_fixture(kind: &str, name: &str) -> Vec<u8> {
    let path = fixtures_dir(kind).join(name);
    fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The `.json` files in `tests/fixtures/config/<kind>/`, sorted.
fn json_files(kind: &str) -> BTreeSet<String> {
    let dir = fixtures_dir(kind);
    fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.ends_with(".json"))
        .collect()
}

fn fail_if_any(problems: &[String]) {
    if !problems.is_empty() {
        panic!(
            "{} problem(s):\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
}

#[test]
fn bad_fixtures_are_rejected_naming_the_problem() {
    let mut problems = Vec::new();
    for &(name, field, reason) in REJECTED {
        match Config::parse(&read_fixture("bad", name)) {
            Ok(_) => problems.push(format!("{name}: accepted, expected rejection at `{field}`")),
            Err(e) => {
                if e.field != field {
                    problems.push(format!(
                        "{name}: field `{}`, expected `{field}` (reason: {})",
                        e.field, e.reason
                    ));
                } else if !e.reason.contains(reason) {
                    problems.push(format!(
                        "{name}: reason `{}` does not contain `{reason}`",
                        e.reason
                    ));
                }
            }
        }
    }
    fail_if_any(&problems);
}

#[test]
fn every_bad_fixture_is_in_a_table() {
    let mut listed = BTreeSet::new();
    let mut problems = Vec::new();
    let names = REJECTED.iter().map(|&(name, _, _)| name);
    for name in names {
        if !listed.insert(name.to_string()) {
            problems.push(format!("{name}: listed twice"));
        }
    }
    let on_disk = json_files("bad");
    for name in on_disk.difference(&listed) {
        problems.push(format!("{name}: in bad/ but not in REJECTED"));
    }
    for name in listed.difference(&on_disk) {
        problems.push(format!("{name}: listed but missing from bad/"));
    }
    fail_if_any(&problems);
}

#[test]
fn good_fixtures_parse() {
    let mut problems = Vec::new();
    let good = json_files("good");
    if good.is_empty() {
        problems.push("no fixtures in good/".to_string());
    }
    for name in &good {
        if let Err(e) = Config::parse(&read_fixture("good", name)) {
            problems.push(format!("good/{name}: {e}"));
        }
    }
    // The demo config shipped with the Envoy setup, read where it lives.
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("envoy/filter.json");
    let bytes = fs::read(&demo).unwrap_or_else(|e| panic!("reading {}: {e}", demo.display()));
    if let Err(e) = Config::parse(&bytes) {
        problems.push(format!("envoy/filter.json: {e}"));
    }
    fail_if_any(&problems);
}

#[test]
fn the_readme_configuration_example_parses() {
    let readme =
        fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let section = &readme[readme.find("## Configuration").unwrap()..];
    let start = section.find("```json\n").unwrap() + "```json\n".len();
    let end = start + section[start..].find("```").unwrap();
    let config = Config::parse(&section.as_bytes()[start..end]);
    assert!(config.is_ok(), "README example: {:?}", config.err());
    assert_eq!(config.unwrap().limits.len(), 2);
}
