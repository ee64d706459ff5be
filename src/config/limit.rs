//! Rate limits: the algorithm and its parameters, the cost of one request,
//! the local budget and the token lease.

use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;

use super::algorithm::Algorithm;
use super::block::{compile_block, RawBlock};
use super::bounds::{
    CONCURRENCY_LEASE_MS, GCRA_EXACT_MAX, LUA_EXACT_MAX, MAX_CONCURRENCY, MAX_COUNTER_LIMIT,
    MAX_WINDOW_COST,
};
use super::matcher::{compile_match, Matcher, RawMatch};
use super::overrides::{compile_overrides, Overrides, RawOverrides};
use super::parts::{compile_parts, Part, RawPart};
use super::quota::{compile_quota, RawQuota};
use super::usage::{compile_usage, RawUsage, Usage};
use super::{header_name, valid_name, ConfigError, FailureMode};

/// A tenth of the global budget per Envoy when Redis is down.
pub const DEFAULT_LOCAL_PER_MILLE: u64 = 100;

/// The algorithm fields of a limit, by their JSON names, for its errors.
const ALGORITHM_FIELDS: &str =
    "`tokenBucket`, `slidingWindow`, `gcra`, `fixedWindow`, `slidingWindowCounter`, `quota` and `concurrency`";
/// A concurrency slot's lease when the config names none: long enough that
/// its renewals (four per lease) cost nothing to speak of, short enough that
/// a crashed Envoy's slots come back within a minute.
pub const DEFAULT_CONCURRENCY_LEASE_MS: u64 = 30_000;
/// Leases are renewed this many times per lease: two renewals in a row may
/// fail (a slow or restarting Redis) before a running request loses its
/// slot, the third landing before the lease ends (config keeps `timeoutMs`
/// at most a quarter of `leaseMs`, so each renewal is over before the next).
pub const RENEWALS_PER_LEASE: u32 = 4;

/// One rate limit: exactly one of tokenBucket, slidingWindow, gcra,
/// fixedWindow, slidingWindowCounter, quota or concurrency.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Limit")]
#[schemars(extend("oneOf" = [
    {"required": ["tokenBucket"]},
    {"required": ["slidingWindow"]},
    {"required": ["gcra"]},
    {"required": ["fixedWindow"]},
    {"required": ["slidingWindowCounter"]},
    {"required": ["quota"]},
    {"required": ["concurrency"]}
]))]
pub(super) struct RawLimit {
    /// Unique limit name: letters, digits, '-', '_', '.'; part of keys and stats.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9._-]+$"))]
    name: String,
    /// Which requests the limit applies to.
    #[serde(default, rename = "match")]
    #[schemars(default = "super::defaults::all_defaults")]
    matcher: RawMatch,
    /// Requests `match` covers that the limit still skips, without a Redis
    /// call: trusted networks, health checkers, a claim (any `match` condition).
    #[serde(default)]
    unless: Option<RawMatch>,
    /// Parts whose values pick the bucket (one bucket per distinct value list).
    #[serde(default)]
    #[schemars(default = "super::defaults::no_items")]
    descriptor: Vec<RawPart>,
    /// A token bucket (a limit sets exactly one of the seven kinds).
    #[serde(default)]
    token_bucket: Option<RawTokenBucket>,
    /// A sliding-window log: exact, one entry per admitted unit.
    #[serde(default)]
    sliding_window: Option<RawSlidingWindow>,
    /// GCRA: the token bucket's promise in one value per key.
    #[serde(default)]
    gcra: Option<RawGcra>,
    /// A fixed window, aligned to the Unix epoch on Redis' clock.
    #[serde(default)]
    fixed_window: Option<RawFixedWindow>,
    /// A sliding-window counter: approximate, constant memory.
    #[serde(default)]
    sliding_window_counter: Option<RawSlidingWindowCounter>,
    /// A calendar quota: an allowance per month, week, day or hour of a
    /// time zone's wall clock.
    #[serde(default)]
    quota: Option<RawQuota>,
    /// A concurrency limit: requests in flight at once.
    #[serde(default)]
    concurrency: Option<RawConcurrency>,
    /// Units one request spends (default 1).
    #[serde(default)]
    #[schemars(range(min = 1))]
    #[schemars(default = "super::defaults::one")]
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
    #[schemars(default = "super::defaults::local_fraction")]
    local_fraction: Option<f64>,
    /// Token bucket only: each Envoy takes tokens in batches and spends them
    /// without a Redis call. Never admits more than the bucket; may admit
    /// fewer (at most `tokens` per Envoy held unspent until the lease ends).
    #[serde(default)]
    lease: Option<RawLease>,
    /// Charge what the response says the request cost (token bucket, GCRA,
    /// fixed window and sliding-window counter).
    #[serde(default)]
    usage: Option<RawUsage>,
    /// Once the limit rejects a key, refuse the key for a while.
    #[serde(default)]
    block: Option<RawBlock>,
    /// Per-value numbers stored in Redis replace the configured ones.
    #[serde(default)]
    overrides: Option<RawOverrides>,
}

/// Tokens of a token bucket one Envoy worker takes in one call and spends
/// without a call per request.
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

/// Burst of `capacity`, refilled by `refill` units every `periodMs`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "TokenBucket")]
struct RawTokenBucket {
    /// Most units the bucket holds: the largest burst.
    #[schemars(range(min = 1))]
    capacity: u64,
    /// Units added every `periodMs`, up to `capacity`.
    #[schemars(range(min = 1))]
    refill: u64,
    /// The refill's period (ms); `capacity` × `periodMs` must stay below 2^53.
    #[schemars(range(min = 1))]
    period_ms: u64,
}

/// At most `limit` units in any `windowMs` (exact, a log of admissions).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "SlidingWindow")]
struct RawSlidingWindow {
    /// Most units admitted in any span of `windowMs`.
    #[schemars(range(min = 1, max = 1000000))]
    limit: u64,
    /// The window's length (ms).
    #[schemars(range(min = 1))]
    window_ms: u64,
}

/// GCRA (generic cell rate algorithm): `rate` units per `periodMs`, up to
/// `burst` at once. Exact, like the token bucket with capacity `burst`, but
/// its state is one value per key (the theoretical arrival time).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Gcra")]
struct RawGcra {
    /// Units allowed per `periodMs` over time.
    #[schemars(range(min = 1))]
    rate: u64,
    /// The period `rate` is counted over (ms).
    #[schemars(range(min = 1))]
    period_ms: u64,
    /// Most units admitted at once; `burst` × `periodMs` must stay below 2^52.
    #[schemars(range(min = 1))]
    burst: u64,
}

/// At most `limit` units per window of `windowMs`, windows aligned to the
/// Unix epoch on Redis' clock. One counter per key; up to twice `limit` may
/// pass across a window's edge.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "FixedWindow")]
struct RawFixedWindow {
    /// Most units admitted in one window.
    #[schemars(range(min = 1, max = 1125899906842624_u64))]
    limit: u64,
    /// The window's length (ms); windows start at multiples of it since the epoch.
    #[schemars(range(min = 1))]
    window_ms: u64,
}

/// About `limit` units in any `windowMs`: the current and the previous
/// fixed window, the previous weighted by its overlap with the sliding
/// window. Constant memory, approximate (docs/src/using/limits.md gives its worst case).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "SlidingWindowCounter")]
struct RawSlidingWindowCounter {
    /// About this many units in any span of `windowMs`.
    #[schemars(range(min = 1, max = 1125899906842624_u64))]
    limit: u64,
    /// The window's length (ms).
    #[schemars(range(min = 1))]
    window_ms: u64,
}

/// At most `max` requests in flight at once, across every Envoy. Each holds
/// a slot from its decision until its stream ends; its Envoy renews the
/// slot's lease while it runs, so a crashed Envoy's slots come back when
/// their lease ends.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Concurrency")]
struct RawConcurrency {
    /// Most requests in flight at once (a request of cost k holds k slots).
    #[schemars(range(min = 1, max = 1000000))]
    max: u64,
    /// How long a slot outlives an Envoy that died holding it (ms, default 30000).
    #[serde(default)]
    #[schemars(range(min = 300, max = 3600000))]
    #[schemars(default = "super::defaults::concurrency_lease_ms")]
    lease_ms: Option<u64>,
}

/// Cost from a request header: a positive integer up to `max`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "CostHeader")]
struct RawCostHeader {
    /// The request header that carries the cost.
    name: String,
    /// The largest cost the header may ask for (1 to the limit's quota);
    /// anything else is a 400.
    #[schemars(range(min = 1))]
    max: u64,
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
pub struct Limit {
    pub name: String,
    pub matcher: Matcher,
    /// Exempt requests: the limit does not apply to them.
    pub unless: Option<Matcher>,
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
    /// Charged by the response's usage, settled after it.
    pub usage: Option<Usage>,
    /// A rejection blocks the key for this many ms.
    pub block_ms: Option<u64>,
    /// Where per-value overrides come from (Redis, the request).
    pub overrides: Overrides,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub tokens: u64,
    pub ttl: Duration,
}

fn positive(value: u64, field: String) -> Result<u64, ConfigError> {
    if value == 0 {
        Err(ConfigError::new(field, "must be at least 1"))
    } else {
        Ok(value)
    }
}

pub(super) fn compile_limit(
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
    let algorithm = compile_algorithm(&raw, at)?;
    let matcher = compile_match(raw.matcher, &format!("{at}.match"))?;
    let unless = match raw.unless {
        None => None,
        Some(u) => {
            let field = format!("{at}.unless");
            let unless = compile_match(u, &field)?;
            if unless.is_empty() {
                return Err(ConfigError::new(
                    field,
                    "has no condition: it would exempt every request (remove the limit instead)",
                ));
            }
            Some(unless)
        }
    };
    let descriptor = compile_parts(raw.descriptor, &format!("{at}.descriptor"))?;

    // A sliding window and a concurrency limit store one member per unit:
    // one request may add at most MAX_WINDOW_COST of them (a bounded ZADD,
    // a bounded script).
    let quota = match algorithm {
        Algorithm::SlidingWindow { limit, .. } | Algorithm::Concurrency { max: limit, .. } => {
            limit.min(MAX_WINDOW_COST)
        }
        other => other.quota(),
    };
    let fixed = raw.cost.unwrap_or(1);
    if fixed == 0 || fixed > quota {
        return Err(ConfigError::new(
            format!("{at}.cost"),
            format!("must be between 1 and {quota} (the limit's quota; at most {MAX_WINDOW_COST} for a sliding window or a concurrency limit)"),
        ));
    }
    let cost = match raw.cost_header {
        None => Cost::Fixed(fixed),
        Some(h) => {
            let name = header_name(&h.name, &format!("{at}.costHeader.name"))?;
            if h.max == 0 || h.max > quota {
                return Err(ConfigError::new(
                    format!("{at}.costHeader.max"),
                    format!("must be between 1 and {quota} (the limit's quota; at most {MAX_WINDOW_COST} for a sliding window or a concurrency limit)"),
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
    let failure_mode = raw.failure_mode.unwrap_or(default_failure);
    if matches!(algorithm, Algorithm::Concurrency { .. }) && failure_mode == FailureMode::Local {
        // A local slot would need a release of its own at the stream's end,
        // and a share of `max` per Envoy is no bound on the whole: not built.
        return Err(ConfigError::new(
            format!("{at}.failureMode"),
            "a concurrency limit has no local budget: set this limit's failureMode to `allow` or `deny`",
        ));
    }
    let usage = match raw.usage {
        None => None,
        Some(u) => {
            let field = format!("{at}.usage");
            match algorithm {
                Algorithm::SlidingWindow { .. } => {
                    return Err(ConfigError::new(
                        field,
                        "a sliding-window log keeps a member per unit (at most 1000 per request): use a token bucket, GCRA or a counter for costs known after the response",
                    ))
                }
                Algorithm::Concurrency { .. } => {
                    return Err(ConfigError::new(
                        field,
                        "a concurrency limit counts requests in flight, not units",
                    ))
                }
                _ => {}
            }
            if raw.cost.is_some() || matches!(cost, Cost::Header { .. }) {
                return Err(ConfigError::new(
                    field,
                    "sets the cost itself: remove `cost` and `costHeader` (`usage.reserve` is what a request takes at admission)",
                ));
            }
            if lease.is_some() {
                return Err(ConfigError::new(
                    field,
                    "cannot go with `lease`: leased tokens are spent without Redis, so nothing could be settled",
                ));
            }
            Some(compile_usage(u, &field, algorithm.quota())?)
        }
    };
    let cost = match &usage {
        Some(u) => Cost::Fixed(u.reserve),
        None => cost,
    };
    let block_ms = match raw.block {
        None => None,
        Some(b) => Some(compile_block(
            b,
            &format!("{at}.block"),
            &algorithm,
            raw.shadow,
            lease.is_some(),
        )?),
    };
    let overrides = match raw.overrides {
        None => Overrides::default(),
        Some(o) => compile_overrides(o, &format!("{at}.overrides"), &algorithm, lease.is_some())?,
    };
    let key_infix = format!(":{}:{}:", raw.name, algorithm.signature());
    Ok(Limit {
        overrides,
        block_ms,
        usage,
        lease,
        local_per_mille,
        name: raw.name,
        matcher,
        unless,
        descriptor,
        algorithm,
        cost,
        shadow: raw.shadow,
        failure_mode,
        key_infix,
    })
}

/// The one algorithm a limit names, checked so its Lua arithmetic stays exact.
fn compile_algorithm(raw: &RawLimit, at: &str) -> Result<Algorithm, ConfigError> {
    let set = [
        raw.token_bucket.is_some(),
        raw.sliding_window.is_some(),
        raw.gcra.is_some(),
        raw.fixed_window.is_some(),
        raw.sliding_window_counter.is_some(),
        raw.quota.is_some(),
        raw.concurrency.is_some(),
    ]
    .iter()
    .filter(|s| **s)
    .count();
    if set == 0 {
        return Err(ConfigError::new(
            at,
            format!("set exactly one of {ALGORITHM_FIELDS}"),
        ));
    }
    if set > 1 {
        return Err(ConfigError::new(
            at,
            format!("set exactly one of {ALGORITHM_FIELDS}, not several"),
        ));
    }
    if let Some(tb) = &raw.token_bucket {
        let capacity = positive(tb.capacity, format!("{at}.tokenBucket.capacity"))?;
        let refill = positive(tb.refill, format!("{at}.tokenBucket.refill"))?;
        let period_ms = positive(tb.period_ms, format!("{at}.tokenBucket.periodMs"))?;
        let field = format!("{at}.tokenBucket");
        exact_product(
            capacity,
            period_ms,
            LUA_EXACT_MAX,
            &field,
            "capacity * periodMs",
        )?;
        exact_product(
            refill,
            period_ms,
            LUA_EXACT_MAX,
            &field,
            "refill * periodMs",
        )?;
        return Ok(Algorithm::TokenBucket {
            capacity,
            refill,
            period_ms,
        });
    }
    if let Some(sw) = &raw.sliding_window {
        let limit = positive(sw.limit, format!("{at}.slidingWindow.limit"))?;
        let window_ms = positive(sw.window_ms, format!("{at}.slidingWindow.windowMs"))?;
        // One sorted-set member per admitted unit: bound the memory a key can take.
        if limit > 1_000_000 {
            return Err(ConfigError::new(
                format!("{at}.slidingWindow.limit"),
                "must be at most 1000000 (one sorted-set member per request); use tokenBucket for larger budgets",
            ));
        }
        exact_window(window_ms, format!("{at}.slidingWindow.windowMs"))?;
        return Ok(Algorithm::SlidingWindow { limit, window_ms });
    }
    if let Some(g) = &raw.gcra {
        let rate = positive(g.rate, format!("{at}.gcra.rate"))?;
        let period_ms = positive(g.period_ms, format!("{at}.gcra.periodMs"))?;
        let burst = positive(g.burst, format!("{at}.gcra.burst"))?;
        let field = format!("{at}.gcra");
        exact_product(burst, period_ms, GCRA_EXACT_MAX, &field, "burst * periodMs")?;
        exact_product(rate, period_ms, LUA_EXACT_MAX, &field, "rate * periodMs")?;
        return Ok(Algorithm::Gcra {
            rate,
            period_ms,
            burst,
        });
    }
    if let Some(q) = &raw.quota {
        return compile_quota(q, at);
    }
    if let Some(c) = &raw.concurrency {
        let max = positive(c.max, format!("{at}.concurrency.max"))?;
        if max > MAX_CONCURRENCY {
            return Err(ConfigError::new(
                format!("{at}.concurrency.max"),
                format!("must be at most {MAX_CONCURRENCY} (one sorted-set member per request in flight)"),
            ));
        }
        let lease_ms = c.lease_ms.unwrap_or(DEFAULT_CONCURRENCY_LEASE_MS);
        if !CONCURRENCY_LEASE_MS.contains(&lease_ms) {
            return Err(ConfigError::new(
                format!("{at}.concurrency.leaseMs"),
                format!(
                    "must be between {} and {}",
                    CONCURRENCY_LEASE_MS.start(),
                    CONCURRENCY_LEASE_MS.end()
                ),
            ));
        }
        return Ok(Algorithm::Concurrency { max, lease_ms });
    }
    let (field, limit, window_ms) = match (&raw.fixed_window, &raw.sliding_window_counter) {
        (Some(fw), _) => ("fixedWindow", fw.limit, fw.window_ms),
        (None, Some(swc)) => ("slidingWindowCounter", swc.limit, swc.window_ms),
        (None, None) => {
            return Err(ConfigError::new(
                at,
                format!("set exactly one of {ALGORITHM_FIELDS}"),
            ))
        }
    };
    let limit = positive(limit, format!("{at}.{field}.limit"))?;
    let window_ms = positive(window_ms, format!("{at}.{field}.windowMs"))?;
    if limit > MAX_COUNTER_LIMIT {
        return Err(ConfigError::new(
            format!("{at}.{field}.limit"),
            "must be at most 2^50 (1125899906842624)",
        ));
    }
    exact_window(window_ms, format!("{at}.{field}.windowMs"))?;
    Ok(if field == "fixedWindow" {
        Algorithm::FixedWindow { limit, window_ms }
    } else {
        Algorithm::SlidingWindowCounter { limit, window_ms }
    })
}

/// `a * b` stays below `max` (a power of two), so the Lua doubles that hold
/// it stay exact.
fn exact_product(a: u64, b: u64, max: u64, field: &str, what: &str) -> Result<(), ConfigError> {
    if a.checked_mul(b).is_none_or(|p| p >= max) {
        return Err(ConfigError::new(
            field,
            format!(
                "{what} must stay below 2^{} (Lua numbers are doubles)",
                max.trailing_zeros()
            ),
        ));
    }
    Ok(())
}

/// A window in ms that Lua doubles hold exactly.
fn exact_window(window_ms: u64, field: String) -> Result<(), ConfigError> {
    if window_ms >= LUA_EXACT_MAX {
        return Err(ConfigError::new(
            field,
            "must stay below 2^53 ms (Lua numbers are doubles)",
        ));
    }
    Ok(())
}
