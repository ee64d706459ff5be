//! The bounds a limit's figures are checked against: what a Lua double
//! counts exactly, the largest limit, cost and concurrency, and a
//! concurrency lease's range. Both the limit kinds (limit.rs) and calendar
//! quotas (quota.rs) read them, so they live below both.

/// Largest integer a Lua (double) number holds exactly. The token bucket keeps
/// `capacity * period_ms` credits, so that product must stay below it.
pub(super) const LUA_EXACT_MAX: u64 = 1 << 53;
/// GCRA keeps its state in units of 1/rate ms and compares `burst * periodMs`
/// against a difference that can reach twice that: one bit of headroom.
pub(super) const GCRA_EXACT_MAX: u64 = 1 << 52;
/// Largest limit of a counting kind (fixed window, sliding-window counter):
/// their state is a count, so any limit a Lua double counts exactly, with
/// room for one request's cost on top.
pub const MAX_COUNTER_LIMIT: u64 = 1 << 50;
/// Most units one request may spend from a sliding window.
pub const MAX_WINDOW_COST: u64 = 1000;
/// Most requests one concurrency limit lets in flight (one sorted-set member
/// per slot).
pub const MAX_CONCURRENCY: u64 = 1_000_000;
/// Bounds of a lease: renewed every quarter of it, so not too often; a
/// crashed Envoy's slots come back within it, so not too long.
pub const CONCURRENCY_LEASE_MS: std::ops::RangeInclusive<u64> = 300..=3_600_000;
