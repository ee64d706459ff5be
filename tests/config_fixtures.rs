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
use std::time::Duration;

use redis_guard::config::{
    Config, ConfigError, DEFAULT_OBJECT_KEY_PREFIX, DEFAULT_OBJECT_TIMEOUT_MS, MAX_OFFLOADED_BODY,
};
use serde_json::{json, Value};

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
    // Per-value overrides.
    (
        "overrides_on_gcra.json",
        "limits[0].overrides.redis",
        "GCRA limit's state is kept in units of its rate",
    ),
    (
        "overrides_with_lease.json",
        "limits[0].overrides.request",
        "cannot go with `lease`",
    ),
    (
        "overrides_without_source.json",
        "limits[0].overrides",
        "set `redis`, `request` or both",
    ),
    // Blocking and response-counted limits.
    (
        "block_on_concurrency.json",
        "limits[0].block",
        "a concurrency limit is full only while requests run",
    ),
    ("block_on_shadow.json", "limits[0].block", "a shadow limit never rejects"),
    (
        "block_duration_too_short.json",
        "limits[0].block.durationMs",
        "between 1000",
    ),
    (
        "usage_count_status_unknown.json",
        "limits[0].usage.countStatuses[1]",
        "`6xx` is neither",
    ),
    (
        "usage_count_status_with_header.json",
        "limits[0].usage.countStatuses",
        "remove `header` and `json`",
    ),
    // Deny lists, exemptions and client networks.
    ("deny_match_empty.json", "deny[0].match", "would refuse every request"),
    (
        "deny_network_overlap.json",
        "deny[0].match.clientNetworks[1]",
        "overlaps entry 0",
    ),
    (
        "deny_network_host_bits.json",
        "deny[0].match.clientNetworks[0]",
        "has host bits set: write `198.51.100.0/24`",
    ),
    ("deny_name_duplicate.json", "deny[1].name", "duplicate deny rule name"),
    ("unless_empty.json", "limits[0].unless", "would exempt every request"),
    (
        "unless_network_malformed.json",
        "limits[0].unless.clientNetworks[1]",
        "`office-lan` is not a network",
    ),
    ("match_one_of_empty.json", "limits[0].match.headers[0].oneOf", "at least one value"),
    (
        "match_one_of_and_exact.json",
        "limits[0].match.headers[0]",
        "set exactly one of",
    ),
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
    (
        "access_log_key_unknown.json",
        "accessLog.key",
        "unknown variant `raw`, expected one of `hash`, `plain`, `none`",
    ),
    (
        "access_log_unknown_field.json",
        "accessLog.fields",
        "unknown field `fields`, expected `enabled` or `key`",
    ),
    // Limit shape and name.
    (
        "limit_no_algorithm.json",
        "limits[0]",
        "set exactly one of `tokenBucket`, `slidingWindow`, `gcra`, `fixedWindow`, `slidingWindowCounter`, `quota` and `concurrency`",
    ),
    ("limit_both_algorithms.json", "limits[0]", "not several"),
    // Calendar quotas.
    (
        "quota_amount_zero.json",
        "limits[0].quota.amount",
        "must be between 1 and 2^50",
    ),
    (
        "quota_amount_too_large.json",
        "limits[0].quota.amount",
        "must be between 1 and 2^50",
    ),
    (
        "quota_per_year.json",
        "limits[0].quota.per",
        "must be \"month\", \"week\", \"day\" or \"hour\"",
    ),
    (
        "quota_time_zone_unknown.json",
        "limits[0].quota.timeZone",
        "is not a time zone the filter knows",
    ),
    (
        "quota_time_zone_missing.json",
        "limits[0].quota",
        "missing field `timeZone`",
    ),
    (
        "quota_anchor_day_32.json",
        "limits[0].quota.anchorDay",
        "must be between 1 and 31 for a month",
    ),
    (
        "quota_anchor_day_week_8.json",
        "limits[0].quota.anchorDay",
        "must be between 1 and 7 for a week",
    ),
    (
        "quota_anchor_day_on_day.json",
        "limits[0].quota.anchorDay",
        "a day starts at midnight or on the hour: remove it",
    ),
    (
        "quota_unknown_field.json",
        "limits[0].quota.windowMs",
        "unknown field `windowMs`",
    ),
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
    // gcra, fixedWindow, slidingWindowCounter
    (
        "gcra_rate_zero.json",
        "limits[0].gcra.rate",
        "must be at least 1",
    ),
    (
        "gcra_period_zero.json",
        "limits[0].gcra.periodMs",
        "must be at least 1",
    ),
    (
        "gcra_burst_zero.json",
        "limits[0].gcra.burst",
        "must be at least 1",
    ),
    (
        "gcra_burst_missing.json",
        "limits[0].gcra",
        "missing field `burst`",
    ),
    (
        "gcra_burst_times_period_overflow.json",
        "limits[0].gcra",
        "burst * periodMs must stay below 2^52",
    ),
    (
        "gcra_rate_times_period_overflow.json",
        "limits[0].gcra",
        "rate * periodMs must stay below 2^53",
    ),
    (
        "gcra_cost_above_burst.json",
        "limits[0].cost",
        "must be between 1 and 20 (the limit's quota",
    ),
    (
        "gcra_unknown_field.json",
        "limits[0].gcra.capacity",
        "unknown field `capacity`",
    ),
    (
        "lease_on_gcra.json",
        "limits[0].lease",
        "tokenBucket limits only",
    ),
    (
        "fixed_window_limit_zero.json",
        "limits[0].fixedWindow.limit",
        "must be at least 1",
    ),
    (
        "fixed_window_limit_too_large.json",
        "limits[0].fixedWindow.limit",
        "at most 2^50",
    ),
    (
        "fixed_window_window_zero.json",
        "limits[0].fixedWindow.windowMs",
        "must be at least 1",
    ),
    (
        "fixed_window_window_too_large.json",
        "limits[0].fixedWindow.windowMs",
        "below 2^53",
    ),
    (
        "fixed_window_cost_header_max_above_limit.json",
        "limits[0].costHeader.max",
        "must be between 1 and 100",
    ),
    (
        "sliding_window_counter_limit_zero.json",
        "limits[0].slidingWindowCounter.limit",
        "must be at least 1",
    ),
    (
        "sliding_window_counter_limit_too_large.json",
        "limits[0].slidingWindowCounter.limit",
        "at most 2^50",
    ),
    (
        "sliding_window_counter_window_zero.json",
        "limits[0].slidingWindowCounter.windowMs",
        "must be at least 1",
    ),
    (
        "sliding_window_counter_window_too_large.json",
        "limits[0].slidingWindowCounter.windowMs",
        "below 2^53",
    ),
    (
        "sliding_window_counter_cost_above_limit.json",
        "limits[0].cost",
        "must be between 1 and 100",
    ),
    (
        "limit_gcra_and_fixed_window.json",
        "limits[0]",
        "not several",
    ),
    // concurrency
    (
        "concurrency_max_zero.json",
        "limits[0].concurrency.max",
        "must be at least 1",
    ),
    (
        "concurrency_max_too_large.json",
        "limits[0].concurrency.max",
        "at most 1000000",
    ),
    (
        "concurrency_max_missing.json",
        "limits[0].concurrency",
        "missing field `max`",
    ),
    (
        "concurrency_lease_too_short.json",
        "limits[0].concurrency.leaseMs",
        "between 300 and 3600000",
    ),
    (
        "concurrency_lease_too_long.json",
        "limits[0].concurrency.leaseMs",
        "between 300 and 3600000",
    ),
    (
        "concurrency_lease_below_four_timeouts.json",
        "limits[0].concurrency.leaseMs",
        "must be at least 400 ms (4 × redis.timeoutMs)",
    ),
    (
        "concurrency_cost_above_max.json",
        "limits[0].cost",
        "must be between 1 and 10 (the limit's quota",
    ),
    (
        "concurrency_cost_header_max_above_1000.json",
        "limits[0].costHeader.max",
        "must be between 1 and 1000",
    ),
    (
        "concurrency_failure_mode_local.json",
        "limits[0].failureMode",
        "no local budget",
    ),
    (
        "concurrency_inherits_failure_mode_local.json",
        "limits[0].failureMode",
        "set this limit's failureMode to `allow` or `deny`",
    ),
    (
        "concurrency_unknown_field.json",
        "limits[0].concurrency.ttlMs",
        "unknown field `ttlMs`",
    ),
    (
        "lease_on_concurrency.json",
        "limits[0].lease",
        "tokenBucket limits only",
    ),
    (
        "limit_concurrency_and_token_bucket.json",
        "limits[0]",
        "not several",
    ),
    // usage
    (
        "usage_on_sliding_window.json",
        "limits[0].usage",
        "a sliding-window log keeps a member per unit",
    ),
    (
        "usage_on_concurrency.json",
        "limits[0].usage",
        "counts requests in flight, not units",
    ),
    (
        "usage_with_cost.json",
        "limits[0].usage",
        "remove `cost` and `costHeader`",
    ),
    ("usage_with_lease.json", "limits[0].usage", "cannot go with `lease`"),
    (
        "usage_without_a_source.json",
        "limits[0].usage",
        "set `header`, `json` or both",
    ),
    (
        "usage_pointer_not_a_pointer.json",
        "limits[0].usage.json[0].pointer",
        "must be a JSON Pointer",
    ),
    (
        "usage_reserve_from_not_a_pointer.json",
        "limits[0].usage.reserveFrom[0].pointer",
        "must be a JSON Pointer",
    ),
    (
        "usage_weight_zero.json",
        "limits[0].usage.json[0].weight",
        "must be at least 1",
    ),
    (
        "usage_reserve_above_quota.json",
        "limits[0].usage.reserve",
        "must be between 1 and 1000",
    ),
    (
        "usage_max_body_too_large.json",
        "limits[0].usage.maxBodyBytes",
        "between 1 and 16777216",
    ),
    (
        "usage_header_bad_name.json",
        "limits[0].usage.header",
        "is not a valid header name",
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
        "exactly one of `present`, `exact`, `prefix`, `regex` and `oneOf`",
    ),
    (
        "match_header_no_condition.json",
        "limits[0].match.headers[0]",
        "exactly one of `present`, `exact`, `prefix`, `regex` and `oneOf`",
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
        "unknown variant `cookie`, expected one of `header`, `query`, `literal`, `clientAddress`, `clientPrefix`, `metadata`, `attribute`, `path`, `method`, `grpcService`, `grpcMethod`",
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
    (
        "descriptor_query_empty.json",
        "limits[0].descriptor[0].query",
        "must name a query parameter",
    ),
    (
        "descriptor_client_prefix_ipv4_above_32.json",
        "limits[0].descriptor[0].clientPrefix.ipv4",
        "must be between 0 and 32",
    ),
    (
        "descriptor_client_prefix_ipv6_above_128.json",
        "limits[0].descriptor[0].clientPrefix.ipv6",
        "must be between 0 and 128",
    ),
    (
        "match_value_two_conditions.json",
        "limits[0].match.values[0]",
        "set exactly one of `present`, `exact`, `prefix`, `regex` and `oneOf`",
    ),
    (
        "match_value_regex_invalid.json",
        "limits[0].match.values[0].regex",
        "is not a valid regex",
    ),
    (
        "match_header_regex_invalid.json",
        "limits[0].match.headers[0].regex",
        "is not a valid regex",
    ),
    (
        "match_value_part_unknown.json",
        "limits[0].match.values[0].part",
        "unknown variant `cookie`",
    ),
    (
        "descriptor_metadata_namespace_empty.json",
        "limits[0].descriptor[0].metadata.namespace",
        "must name a filter namespace",
    ),
    (
        "descriptor_metadata_path_empty.json",
        "limits[0].descriptor[0].metadata.path",
        "must be one or more non-empty keys",
    ),
    (
        "descriptor_metadata_type_unknown.json",
        "limits[0].descriptor[0].metadata.type",
        "unknown variant `list`, expected one of `string`, `number`, `bool`",
    ),
    (
        "descriptor_attribute_empty_segment.json",
        "limits[0].descriptor[0].attribute",
        "must be a dotted attribute name",
    ),
    (
        "descriptor_client_prefix_unknown_field.json",
        "limits[0].descriptor[0].clientPrefix.ipv8",
        "unknown field `ipv8`",
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
        "redis_batch_max_requests_zero.json",
        "redis.batch.maxRequests",
        "between 1 and 256",
    ),
    (
        "redis_batch_max_requests_too_large.json",
        "redis.batch.maxRequests",
        "between 1 and 256",
    ),
    (
        "redis_batch_in_flight_zero.json",
        "redis.batch.maxInFlight",
        "between 1 and 8",
    ),
    (
        "redis_batch_in_flight_too_large.json",
        "redis.batch.maxInFlight",
        "between 1 and 8",
    ),
    (
        "redis_batch_unknown_field.json",
        "redis.batch.maxSize",
        "unknown field `maxSize`",
    ),
    (
        "redis_batch_enabled_not_bool.json",
        "redis.batch.enabled",
        "expected a boolean",
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
        "unknown variant `cookie`, expected one of `header`, `query`, `literal`, `clientAddress`, `clientPrefix`, `metadata`, `attribute`, `path`, `method`, `grpcService`, `grpcMethod`",
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
        "idempotency_grpc_store_status_unknown.json",
        "idempotency[0].grpcStoreStatuses[1]",
        "`NOT_FOUNDED` is not a gRPC status code name",
    ),
    (
        "idempotency_max_request_body_too_large.json",
        "idempotency[0].maxRequestBodyBytes",
        "at most 67108864",
    ),
    (
        "idempotency_max_stored_body_too_large.json",
        "idempotency[0].maxStoredBodyBytes",
        "at most 8388608: larger responses do not belong in Redis (set offloadAboveBytes",
    ),
    // idempotency: failureMode.
    (
        "idempotency_failure_mode_unknown.json",
        "idempotency[0].failureMode",
        "unknown variant `closed`, expected one of `allow`, `deny`, `local`",
    ), // objectStore: shape.
    (
        "object_store_unknown_field.json",
        "objectStore.endpoint",
        "unknown field `endpoint`",
    ),
    (
        "object_store_cluster_missing.json",
        "objectStore",
        "missing field `cluster`",
    ),
    (
        "object_store_credentials_missing.json",
        "objectStore",
        "missing field `credentials`",
    ),
    (
        "object_store_credentials_unknown_field.json",
        "objectStore.credentials.secretKey",
        "unknown field `secretKey`",
    ),
    // objectStore: where requests go.
    (
        "object_store_cluster_space.json",
        "objectStore.cluster",
        "printable ASCII, no spaces",
    ),
    (
        "object_store_authority_slash.json",
        "objectStore.authority",
        "without spaces or '/'",
    ),
    (
        "object_store_bucket_too_short.json",
        "objectStore.bucket",
        "must be 3 to 63 of a-z 0-9 . - starting and ending with a letter or digit",
    ),
    (
        "object_store_bucket_upper_case.json",
        "objectStore.bucket",
        "must be 3 to 63 of a-z 0-9 . -",
    ),
    (
        "object_store_bucket_leading_dash.json",
        "objectStore.bucket",
        "starting and ending with a letter or digit",
    ),
    (
        "object_store_bucket_underscore.json",
        "objectStore.bucket",
        "must be 3 to 63 of a-z 0-9 . -",
    ),
    (
        "object_store_region_empty.json",
        "objectStore.region",
        "a region name such as us-east-1 (a-z 0-9 -)",
    ),
    (
        "object_store_region_upper_case.json",
        "objectStore.region",
        "a region name such as us-east-1 (a-z 0-9 -)",
    ),
    (
        "object_store_key_prefix_leading_slash.json",
        "objectStore.keyPrefix",
        "not starting with '/'",
    ),
    (
        "object_store_key_prefix_space.json",
        "objectStore.keyPrefix",
        "printable ASCII characters without spaces",
    ),
    (
        "object_store_key_prefix_dot_segment.json",
        "objectStore.keyPrefix",
        "must not contain empty, `.` or `..` path segments",
    ),
    (
        "object_store_key_prefix_empty_segment.json",
        "objectStore.keyPrefix",
        "must not contain empty, `.` or `..` path segments",
    ),
    (
        "idempotency_offload_lock_ttl_too_short.json",
        "idempotency[0].lockTtlMs",
        "must be above objectStore.timeoutMs + redis.timeoutMs (20100 ms)",
    ),
    (
        "idempotency_offload_rule_name_dot_dot.json",
        "idempotency[0].name",
        "`.` and `..` cannot name a rule that offloads",
    ),
    (
        "object_store_key_prefix_too_long.json",
        "objectStore.keyPrefix",
        "at most 256",
    ),
    (
        "object_store_timeout_zero.json",
        "objectStore.timeoutMs",
        "between 1 and 300000",
    ),
    (
        "object_store_timeout_too_large.json",
        "objectStore.timeoutMs",
        "between 1 and 300000",
    ),
    // objectStore: credentials (fromEnvironment reads the process environment:
    // see the parse_with_env tests below).
    (
        "object_store_credentials_environment_and_static.json",
        "objectStore.credentials",
        "set either fromEnvironment or accessKeyId/secretAccessKey, not both",
    ),
    (
        "object_store_credentials_access_key_missing.json",
        "objectStore.credentials.accessKeyId",
        "is required (or set fromEnvironment: true)",
    ),
    (
        "object_store_credentials_secret_missing.json",
        "objectStore.credentials.secretAccessKey",
        "is required with accessKeyId",
    ),
    (
        "object_store_credentials_access_key_space.json",
        "objectStore.credentials.accessKeyId",
        "printable ASCII without spaces",
    ),
    (
        "object_store_credentials_session_token_space.json",
        "objectStore.credentials.sessionToken",
        "printable ASCII without spaces",
    ),
    // idempotency: offloadAboveBytes.
    (
        "idempotency_offload_without_object_store.json",
        "idempotency[0].offloadAboveBytes",
        "needs a top-level objectStore",
    ),
    (
        "idempotency_offload_not_below_max_stored.json",
        "idempotency[0].offloadAboveBytes",
        "must be below maxStoredBodyBytes (8388608)",
    ),
    (
        "idempotency_offload_above_too_large.json",
        "idempotency[0].offloadAboveBytes",
        "at most 8388608: bodies up to it are kept in Redis",
    ),
    (
        "idempotency_offload_max_stored_too_large.json",
        "idempotency[0].maxStoredBodyBytes",
        "at most 67108864: the filter holds a body this large in memory",
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
fn every_limit_kind_parses_to_its_algorithm_and_key_signature() {
    use redis_guard::config::Algorithm;
    let config = Config::parse(&read_fixture("good", "every_limit_kind.json")).unwrap();
    let got: Vec<(Algorithm, String, u64, u64)> = config
        .limits
        .iter()
        .map(|l| {
            (
                l.algorithm,
                l.algorithm.signature(),
                l.algorithm.quota(),
                l.algorithm.window_ms(),
            )
        })
        .collect();
    let max = 1u64 << 50;
    let want = vec![
        (
            Algorithm::TokenBucket {
                capacity: 10,
                refill: 1,
                period_ms: 1000,
            },
            "tb2.10.1.1000".to_string(),
            10,
            10_000,
        ),
        (
            Algorithm::SlidingWindow {
                limit: 10,
                window_ms: 1000,
            },
            "sw.10.1000".to_string(),
            10,
            1000,
        ),
        (
            Algorithm::Gcra {
                rate: 3,
                period_ms: 1000,
                burst: 5,
            },
            "gcra.3.1000.5".to_string(),
            5,
            // 5 units at 3 per second: 1667 ms from empty to full.
            1667,
        ),
        (
            Algorithm::FixedWindow {
                limit: max,
                window_ms: 60_000,
            },
            format!("fw.{max}.60000"),
            max,
            60_000,
        ),
        (
            Algorithm::SlidingWindowCounter {
                limit: 100,
                window_ms: 9_007_199_254_740_991,
            },
            "swc.100.9007199254740991".to_string(),
            100,
            9_007_199_254_740_991,
        ),
        // No window: capacity comes back when requests end. The key does
        // not name max or lease, so a changed limit keeps counting the
        // requests in flight.
        (
            Algorithm::Concurrency {
                max: 1_000_000,
                lease_ms: 300,
            },
            "cc".to_string(),
            1_000_000,
            0,
        ),
        (
            Algorithm::Concurrency {
                max: 3,
                lease_ms: 30_000,
            },
            "cc".to_string(),
            3,
            0,
        ),
    ];
    assert_eq!(got, want);
}

#[test]
fn quota_fixture_parses_to_calendars() {
    use redis_guard::config::Algorithm;
    use redis_guard::quota::{zone, Calendar, Per};
    let config = Config::parse(&read_fixture("good", "quota.json")).unwrap();
    let got: Vec<(Algorithm, String, u64)> = config
        .limits
        .iter()
        .map(|l| {
            (
                l.algorithm,
                l.algorithm.signature(),
                l.algorithm.window_ms(),
            )
        })
        .collect();
    let q = |amount, per, z: &str, anchor| Algorithm::Quota {
        amount,
        calendar: Calendar {
            per,
            zone: zone(z).unwrap(),
            anchor,
        },
    };
    assert_eq!(
        got,
        vec![
            (
                q(1_000_000, Per::Month, "Europe/Berlin", 31),
                "cq.month.Europe/Berlin".to_string(),
                2_592_000_000
            ),
            (
                q(5000, Per::Week, "America/New_York", 7),
                "cq.week.America/New_York".to_string(),
                604_800_000
            ),
            (
                q(50000, Per::Day, "UTC", 1),
                "cq.day.UTC".to_string(),
                86_400_000
            ),
            (
                q(100, Per::Hour, "Asia/Kolkata", 1),
                "cq.hour.Asia/Kolkata".to_string(),
                3_600_000
            ),
        ]
    );
    assert!(config.limits[0].overrides.redis);
    assert_eq!(config.limits[3].block_ms, Some(60_000));
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
    // The demo config shipped with the Envoy setup, read where it lives. It
    // takes object-store and Webdis credentials from the environment the
    // demo and compose give Envoy: here, fake ones.
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("envoy/filter.json");
    let bytes = fs::read(&demo).unwrap_or_else(|e| panic!("reading {}: {e}", demo.display()));
    let env = |name: &str| {
        matches!(
            name,
            "AWS_ACCESS_KEY_ID"
                | "AWS_SECRET_ACCESS_KEY"
                | "REDIS_GUARD_WEBDIS_USERNAME"
                | "REDIS_GUARD_WEBDIS_PASSWORD"
        )
        .then(|| "AKIDDEMO".to_string())
    };
    if let Err(e) = Config::parse_with_env(&bytes, &env) {
        problems.push(format!("envoy/filter.json: {e}"));
    }
    fail_if_any(&problems);
}

#[test]
fn the_books_configuration_example_parses() {
    let page = fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/src/using/configuration.md"),
    )
    .unwrap();
    let start = page.find("```json\n").unwrap() + "```json\n".len();
    let end = start + page[start..].find("```").unwrap();
    let config = Config::parse(&page.as_bytes()[start..end]);
    assert!(config.is_ok(), "the book's example: {:?}", config.err());
    assert_eq!(config.unwrap().limits.len(), 2);
}

// ---------------------------------------------------------------------------
// objectStore and offloadAboveBytes: compiled values, credentials from the
// environment (given to `parse_with_env`, never the test process's own), and
// secrets kept out of errors and debug output.

#[test]
fn object_store_offload_fixture_compiles_every_field() {
    let config = Config::parse(&read_fixture("good", "object_store_offload.json")).unwrap();
    let store = config.object_store.clone().expect("objectStore compiled");
    assert_eq!(store.cluster, "outbound|443||s3.eu-west-1.amazonaws.com");
    assert_eq!(store.authority, "s3.eu-west-1.amazonaws.com");
    assert_eq!(store.bucket, "acme.redis-guard-bodies-01");
    assert_eq!(store.region, "eu-west-1");
    assert_eq!(store.key_prefix, "prod/idempotency/");
    assert_eq!(store.timeout, Duration::from_millis(300_000));
    assert_eq!(store.credentials.access_key_id, "AKIAIOSFODNN7EXAMPLE");
    assert_eq!(
        store.credentials.secret_access_key,
        "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    );
    assert_eq!(
        store.credentials.session_token.as_deref(),
        Some("FwoGZXIvYXdzEXAMPLE/sessiontoken+/=")
    );
    let rules: Vec<(&str, Option<usize>, usize)> = config
        .idempotency
        .iter()
        .map(|r| (r.name.as_str(), r.offload_above, r.max_stored_body))
        .collect();
    assert_eq!(
        rules,
        [
            ("payments", Some(8 << 20), 64 << 20),
            ("orders", Some(0), 1 << 20),
            ("small", None, 8 << 20),
        ]
    );
    assert_eq!(MAX_OFFLOADED_BODY, 64 << 20);
    // The largest maxStoredBodyBytes of any rule, whichever rule it is in.
}

#[test]
fn object_store_defaults_fixture_fills_in_defaults() {
    let config = Config::parse(&read_fixture("good", "object_store_defaults.json")).unwrap();
    let store = config.object_store.clone().expect("objectStore compiled");
    assert_eq!(store.cluster, "minio");
    assert_eq!(
        store.authority, "minio",
        "authority defaults to the cluster"
    );
    assert_eq!(store.key_prefix, "redis-guard/");
    assert_eq!(store.key_prefix, DEFAULT_OBJECT_KEY_PREFIX);
    assert_eq!(store.timeout, Duration::from_millis(5000));
    assert_eq!(DEFAULT_OBJECT_TIMEOUT_MS, 5000);
    assert_eq!(store.credentials.access_key_id, "minioadmin");
    assert_eq!(store.credentials.secret_access_key, "minioadmin");
    assert_eq!(store.credentials.session_token, None);
    let rule = &config.idempotency[0];
    assert_eq!(rule.offload_above, Some(32768));
    assert_eq!(rule.max_stored_body, 64 << 10, "default maxStoredBodyBytes");

    // Without the section there is no store.
    let minimal = Config::parse(&read_fixture("good", "minimal.json")).unwrap();
    assert_eq!(minimal.object_store, None);
}

/// `good/object_store_defaults.json` with its credentials replaced.
fn with_credentials(credentials: Value) -> Value {
    let mut doc: Value =
        serde_json::from_slice(&read_fixture("good", "object_store_defaults.json")).unwrap();
    doc["objectStore"]["credentials"] = credentials;
    doc
}

/// Parses `doc` with `env` as the whole environment.
fn parse_with_env(doc: &Value, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let lookup = |name: &str| {
        env.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| (*v).to_string())
    };
    Config::parse_with_env(&serde_json::to_vec(doc).unwrap(), &lookup)
}

#[test]
fn credentials_from_environment_fail_naming_the_missing_variable() {
    let doc = with_credentials(json!({"fromEnvironment": true}));
    let no_key_id: &[&[(&str, &str)]] = &[
        &[],
        &[("AWS_SECRET_ACCESS_KEY", "secret")],
        &[
            ("AWS_SESSION_TOKEN", "token"),
            ("AWS_SECRET_ACCESS_KEY", "secret"),
        ],
        // Set but empty counts as unset.
        &[
            ("AWS_ACCESS_KEY_ID", ""),
            ("AWS_SECRET_ACCESS_KEY", "secret"),
        ],
    ];
    for env in no_key_id {
        let e = parse_with_env(&doc, env).expect_err("no AWS_ACCESS_KEY_ID");
        assert_eq!(
            e.field, "objectStore.credentials.fromEnvironment",
            "{env:?}: {e}"
        );
        assert!(e.reason.contains("AWS_ACCESS_KEY_ID"), "{env:?}: {e}");
    }
    for env in [
        &[("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")][..],
        &[
            ("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE"),
            ("AWS_SECRET_ACCESS_KEY", ""),
        ][..],
    ] {
        let e = parse_with_env(&doc, env).expect_err("no AWS_SECRET_ACCESS_KEY");
        assert_eq!(
            e.field, "objectStore.credentials.fromEnvironment",
            "{env:?}: {e}"
        );
        assert!(e.reason.contains("AWS_SECRET_ACCESS_KEY"), "{env:?}: {e}");
    }
}

#[test]
fn credentials_from_environment_land_in_the_config() {
    let doc = with_credentials(json!({"fromEnvironment": true}));
    let credentials = |env: &[(&str, &str)]| {
        let config = parse_with_env(&doc, env).unwrap_or_else(|e| panic!("{env:?}: {e}"));
        config.object_store.unwrap().credentials
    };

    let c = credentials(&[
        ("AWS_ACCESS_KEY_ID", "ASIAENVEXAMPLE"),
        ("AWS_SECRET_ACCESS_KEY", "env/secret+key"),
        ("AWS_SESSION_TOKEN", "env-session-token"),
    ]);
    assert_eq!(c.access_key_id, "ASIAENVEXAMPLE");
    assert_eq!(c.secret_access_key, "env/secret+key");
    assert_eq!(c.session_token.as_deref(), Some("env-session-token"));

    // The session token is optional; empty counts as unset.
    for token in [None, Some("")] {
        let mut env = vec![
            ("AWS_ACCESS_KEY_ID", "AKIAENVEXAMPLE"),
            ("AWS_SECRET_ACCESS_KEY", "env-secret"),
        ];
        env.extend(token.map(|t| ("AWS_SESSION_TOKEN", t)));
        let c = credentials(&env);
        assert_eq!(c.access_key_id, "AKIAENVEXAMPLE");
        assert_eq!(c.secret_access_key, "env-secret");
        assert_eq!(c.session_token, None, "AWS_SESSION_TOKEN {token:?}");
    }

    // Static credentials (fromEnvironment false or absent) ignore the environment.
    let env = [
        ("AWS_ACCESS_KEY_ID", "ASIAENVEXAMPLE"),
        ("AWS_SECRET_ACCESS_KEY", "env/secret+key"),
        ("AWS_SESSION_TOKEN", "env-session-token"),
    ];
    for from_environment in [json!(false), Value::Null] {
        let mut creds = json!({"accessKeyId": "AKIASTATIC", "secretAccessKey": "static"});
        if !from_environment.is_null() {
            creds["fromEnvironment"] = from_environment;
        }
        let config = parse_with_env(&with_credentials(creds), &env).unwrap();
        let c = config.object_store.unwrap().credentials;
        assert_eq!(c.access_key_id, "AKIASTATIC");
        assert_eq!(c.secret_access_key, "static");
        assert_eq!(c.session_token, None);
    }
}

/// Part of every secret below; it must never be shown.
const NEVER: &str = "NEVER-LOG-ME";
const SECRET: &str = "wJalrXUtnFEMI-NEVER-LOG-ME";
const TOKEN: &str = "FwoGZXIvYXdzEXAMPLE-NEVER-LOG-ME-TOKEN";
/// The access key id is not secret: it is in every Authorization header.
const KEY_ID: &str = "AKIAIOSFODNN7EXAMPLE";

/// (what, config, environment).
type Case<'a> = (&'a str, Value, &'a [(&'a str, &'a str)]);

#[test]
fn no_error_or_debug_output_contains_a_secret() {
    let long = SECRET.repeat(200);
    let static_creds =
        json!({"accessKeyId": KEY_ID, "secretAccessKey": SECRET, "sessionToken": TOKEN});
    let full_env: &[(&str, &str)] = &[
        ("AWS_ACCESS_KEY_ID", KEY_ID),
        ("AWS_SECRET_ACCESS_KEY", SECRET),
        ("AWS_SESSION_TOKEN", TOKEN),
    ];
    let from_env = json!({"fromEnvironment": true});

    // Accepted: the compiled config's debug form redacts the secret and token.
    let accepted: Vec<Case> = vec![
        ("static", with_credentials(static_creds.clone()), &[]),
        ("environment", with_credentials(from_env.clone()), full_env),
    ];
    let mut problems = Vec::new();
    for (what, doc, env) in &accepted {
        match parse_with_env(doc, env) {
            Err(e) => problems.push(format!("{what}: rejected: {e}")),
            Ok(config) => {
                let store = config.object_store.as_ref().unwrap();
                assert_eq!(store.credentials.secret_access_key, SECRET);
                assert_eq!(store.credentials.session_token.as_deref(), Some(TOKEN));
                let shown = format!("{config:?}\n{config:#?}\n{:?}", store.credentials);
                if shown.contains(NEVER) {
                    problems.push(format!("{what}: Debug shows a secret"));
                }
                // The access key id may be shown.
                if !shown.contains(KEY_ID) {
                    problems.push(format!("{what}: Debug hides the access key id"));
                }
            }
        }
    }

    // Rejected: neither the field, the reason, Display nor Debug carries it.
    let rejected: Vec<Case> = vec![
        (
            "secret with a space",
            with_credentials(
                json!({"accessKeyId": KEY_ID, "secretAccessKey": format!("{SECRET} x")}),
            ),
            &[],
        ),
        (
            "secret with a newline",
            with_credentials(
                json!({"accessKeyId": KEY_ID, "secretAccessKey": format!("{SECRET}\n")}),
            ),
            &[],
        ),
        (
            "secret too long",
            with_credentials(json!({"accessKeyId": KEY_ID, "secretAccessKey": long})),
            &[],
        ),
        (
            "secret without accessKeyId",
            with_credentials(json!({"secretAccessKey": SECRET, "sessionToken": TOKEN})),
            &[],
        ),
        (
            "secret with fromEnvironment",
            with_credentials(json!({"fromEnvironment": true, "secretAccessKey": SECRET})),
            full_env,
        ),
        (
            "token with a space",
            with_credentials(
                json!({"accessKeyId": KEY_ID, "secretAccessKey": SECRET, "sessionToken": format!("{TOKEN} x")}),
            ),
            &[],
        ),
        (
            "secret under a misspelled name",
            with_credentials(json!({"accessKeyId": KEY_ID, "secretKey": SECRET})),
            &[],
        ),
        (
            "valid credentials, bad bucket",
            {
                let mut doc = with_credentials(static_creds.clone());
                doc["objectStore"]["bucket"] = json!("Bodies");
                doc
            },
            &[],
        ),
        (
            "valid credentials, later error",
            {
                let mut doc = with_credentials(static_creds.clone());
                doc["keyPrefix"] = json!("r g");
                doc
            },
            &[],
        ),
        (
            "valid credentials, offload rule error",
            {
                let mut doc = with_credentials(static_creds.clone());
                doc["idempotency"][0]["offloadAboveBytes"] = json!(1 << 20);
                doc
            },
            &[],
        ),
        (
            "environment secret with a space",
            with_credentials(from_env.clone()),
            &[
                ("AWS_ACCESS_KEY_ID", KEY_ID),
                ("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI-NEVER-LOG-ME x"),
            ],
        ),
        (
            "environment token with a space",
            with_credentials(from_env.clone()),
            &[
                ("AWS_ACCESS_KEY_ID", KEY_ID),
                ("AWS_SECRET_ACCESS_KEY", SECRET),
                (
                    "AWS_SESSION_TOKEN",
                    "FwoGZXIvYXdzEXAMPLE-NEVER-LOG-ME-TOKEN x",
                ),
            ],
        ),
        (
            "environment secret without its key id",
            with_credentials(from_env.clone()),
            &[
                ("AWS_SECRET_ACCESS_KEY", SECRET),
                ("AWS_SESSION_TOKEN", TOKEN),
            ],
        ),
    ];
    for (what, doc, env) in &rejected {
        match parse_with_env(doc, env) {
            Ok(_) => problems.push(format!("{what}: accepted")),
            Err(e) => {
                let shown = format!("{}\n{}\n{e}\n{e:?}", e.field, e.reason);
                if shown.contains(NEVER) {
                    problems.push(format!("{what}: the error shows a secret"));
                }
            }
        }
    }
    fail_if_any(&problems);
}

/// A secret pasted where another type belongs ends up in serde's
/// "invalid type: string \"...\"" reason, which `on_configure` logs.
#[test]
fn a_misplaced_secret_is_not_echoed() {
    let cases = [
        ("credentials as a string", with_credentials(json!(SECRET))),
        (
            "fromEnvironment as a string",
            with_credentials(json!({"fromEnvironment": SECRET})),
        ),
        (
            "accessKeyId as an object",
            with_credentials(json!({"accessKeyId": {"id": KEY_ID}, "secretAccessKey": SECRET})),
        ),
    ];
    let mut problems = Vec::new();
    for (what, doc) in &cases {
        match parse_with_env(doc, &[]) {
            Ok(_) => problems.push(format!("{what}: accepted")),
            Err(e) if format!("{e}\n{e:?}").contains(NEVER) => {
                problems.push(format!("{what}: the error shows a secret: {}", e.reason))
            }
            Err(_) => {}
        }
    }
    fail_if_any(&problems);
}

/// A bad value read from the environment is reported at the switch that
/// read it, naming the variable: the config has no secretAccessKey field.
#[test]
fn a_bad_environment_value_names_its_variable() {
    let doc = with_credentials(json!({"fromEnvironment": true}));
    for (var, env) in [
        (
            "AWS_SECRET_ACCESS_KEY",
            [
                ("AWS_ACCESS_KEY_ID", KEY_ID),
                ("AWS_SECRET_ACCESS_KEY", "has a space"),
            ],
        ),
        (
            "AWS_ACCESS_KEY_ID",
            [
                ("AWS_ACCESS_KEY_ID", "AKID\tTAB"),
                ("AWS_SECRET_ACCESS_KEY", SECRET),
            ],
        ),
    ] {
        let e = parse_with_env(&doc, &env).expect_err(var);
        assert_eq!(e.field, "objectStore.credentials.fromEnvironment");
        assert!(e.reason.contains(var), "{e}");
        assert!(!e.reason.contains("has a space"), "{e}");
    }
}

// ---------------------------------------------------------------------------
// redis.credentials: Webdis' HTTP Basic credentials, as the Authorization
// value every call carries; from the config or the environment; never shown.

fn with_webdis_credentials(credentials: Value) -> Value {
    json!({"redis": {"cluster": "webdis", "credentials": credentials}})
}

#[test]
fn webdis_credentials_become_the_basic_authorization_of_every_call() {
    use base64::Engine;
    let basic = |user: &str, pass: &str| {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"))
        )
    };
    let doc = with_webdis_credentials(json!({"username": "envoy", "password": "p@ss/w0rd:x"}));
    let config = parse_with_env(&doc, &[]).unwrap();
    assert_eq!(config.redis.auth.unwrap().0, basic("envoy", "p@ss/w0rd:x"));

    let doc = with_webdis_credentials(json!({"fromEnvironment": true}));
    let env = [
        ("REDIS_GUARD_WEBDIS_USERNAME", "gw"),
        ("REDIS_GUARD_WEBDIS_PASSWORD", "from-env"),
    ];
    let config = parse_with_env(&doc, &env).unwrap();
    assert_eq!(config.redis.auth.unwrap().0, basic("gw", "from-env"));

    let config = parse_with_env(&json!({"redis": {"cluster": "webdis"}}), &env).unwrap();
    assert_eq!(config.redis.auth, None, "none configured: none sent");
}

#[test]
fn webdis_credentials_errors_name_the_field_and_never_the_secret() {
    // (credentials, environment, field, part of the reason)
    type Case<'a> = (Value, &'a [(&'a str, &'a str)], &'a str, &'a str);
    let cases: Vec<Case> = vec![
        (
            json!({"password": SECRET}),
            &[],
            "redis.credentials.username",
            "is required",
        ),
        (
            json!({"username": "u"}),
            &[],
            "redis.credentials.password",
            "is required",
        ),
        (
            json!({"username": "a:b", "password": SECRET}),
            &[],
            "redis.credentials.username",
            "without spaces or ':'",
        ),
        (
            json!({"username": "u", "password": format!("{SECRET} x")}),
            &[],
            "redis.credentials.password",
            "printable ASCII",
        ),
        (
            json!({"username": "u", "password": SECRET, "fromEnvironment": true}),
            &[],
            "redis.credentials",
            "not both",
        ),
        (
            json!({"fromEnvironment": true}),
            &[("REDIS_GUARD_WEBDIS_USERNAME", "u")],
            "redis.credentials.fromEnvironment",
            "REDIS_GUARD_WEBDIS_PASSWORD is not set",
        ),
        (
            json!({"fromEnvironment": true}),
            &[
                ("REDIS_GUARD_WEBDIS_USERNAME", "u"),
                ("REDIS_GUARD_WEBDIS_PASSWORD", "NEVER-LOG-ME\n"),
            ],
            "redis.credentials.fromEnvironment (REDIS_GUARD_WEBDIS_PASSWORD)",
            "printable ASCII",
        ),
    ];
    for (creds, env, field, reason) in cases {
        let e = parse_with_env(&with_webdis_credentials(creds.clone()), env)
            .expect_err(&creds.to_string());
        assert_eq!(e.field, field, "{creds}");
        assert!(e.reason.contains(reason), "{creds}: {e}");
        let shown = format!("{e}\n{e:?}");
        assert!(
            !shown.contains(NEVER),
            "{creds}: the error shows the secret"
        );
    }
    let config = parse_with_env(
        &with_webdis_credentials(json!({"username": "u", "password": SECRET})),
        &[],
    )
    .unwrap();
    let shown = format!("{config:?}\n{config:#?}");
    assert!(
        !shown.contains(NEVER) && !shown.contains("Basic "),
        "Debug shows it"
    );
}
