//! What the filter counts, and the one place that names each Envoy stat:
//! the proxy defines its metrics from [`Counter::stats`], so a counter and
//! its stat cannot disagree.

/// Counters the filter reports; the host maps them to Envoy stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Counter {
    /// Requests a limit applied to (index into `Config::limits`).
    Checked(usize),
    Allowed(usize),
    Rejected(usize),
    /// A shadow limit that would have rejected.
    ShadowRejected(usize),
    /// A request the limit's `unless` exempted (no Redis call for it).
    Exempt(usize),
    /// A decision made with the override stored in Redis for its key.
    OverrideApplied(usize),
    /// A stored override that does not parse: ignored, the configured
    /// limit applied.
    OverrideInvalid(usize),
    /// A request the deny list answered 403, before any Redis call.
    Denied,
    RedisCalls,
    /// EVALSHA found no script and the filter fell back to EVAL.
    ScriptReloads,
    /// A call repeated after Webdis answered 503 (command not executed).
    RedisRetries,
    /// A Redis decision that failed, by why (the total is their sum).
    RedisError(ErrorKind),
    FailureAllowed,
    FailureDenied,
    /// Idempotency: lock taken and request forwarded.
    IdemAcquired,
    /// Answered from a COMPLETED record.
    IdemReplayed,
    /// 409: another request holds the key.
    IdemConflicts,
    /// 422: the key was used with another request.
    IdemMismatches,
    /// Lock released so a retry runs again (failure, non-storable, too large).
    IdemReleased,
    /// The client left after its keyed request was forwarded: the upstream
    /// may be running it, so the lock stays until `lockTtlMs`.
    IdemAbandoned,
    /// COMPLETED record written.
    IdemStored,
    /// The COMPLETED record could not be written (lock lost, Redis failed).
    IdemStoreFailed,
    /// Response over maxStoredBodyBytes: not stored, lock released.
    IdemTooLarge,
    /// Forwarded without the guarantee because Redis failed (failure mode allow).
    IdemUnguarded,
    /// Redis failed and the request was decided by the local budget.
    FailureLocal,
    LocalAllowed,
    LocalRejected,
    /// The circuit breaker opened after consecutive failures (or a failed probe).
    CircuitOpened,
    /// This worker's breaker went from closed to open (the open gauge rises).
    CircuitTripped,
    /// A probe succeeded and closed this worker's breaker (the gauge falls).
    CircuitClosed,
    /// A request sent to its failure mode by the open breaker, without a call.
    CircuitShortCircuited,
    /// 429 answered from the over-limit cache, without a call.
    OverLimitCached,
    /// A request admitted by spending leased tokens, without a call.
    LeaseSpent,
    /// A call that fetched a token lease.
    LeaseFetched,
    /// Leased tokens a worker sent back to Redis (counted as sent: Redis
    /// may keep some back, and a failed give-back loses them).
    LeaseReturned,
    /// A call that carried a batch of decisions (of any size; also counted
    /// in the Redis calls).
    BatchCalls,
    /// A batchable request that found no call of its hash tag out in its
    /// worker and sent its own at once (a single call, counted in the Redis
    /// calls): a quiet worker adds no wait.
    BatchAlone,
    /// A response body uploaded to the object store and its record stored.
    IdemOffloaded,
    /// The upload failed (refused, unreachable, timed out): the lock was
    /// released like a failed request's.
    IdemOffloadFailed,
    /// A replay served from the object store (checksum verified).
    IdemObjectFetched,
    /// A replay whose object is gone from the store: 502, never re-executed.
    IdemObjectMissing,
    /// A replay whose object does not match the record's checksum: 502.
    IdemObjectCorrupt,
    /// A replay whose object could not be fetched (refused, unreachable,
    /// timed out): 503 with Retry-After, never re-executed.
    IdemObjectFetchFailed,
    /// A request's concurrency slots given back at its stream's end.
    SlotsReleased,
    /// A forwarded request's response never completed (its client left):
    /// its slots are kept until their lease ends.
    SlotsAbandoned,
    /// A renewal of a running request's slot leases.
    SlotsRenewed,
    /// A running request's slot was gone at its renewal (its Envoy was cut
    /// off from Redis longer than the lease): the request runs on uncounted.
    SlotsLost,
    /// Usage-based units charged after the response, beyond the reserve
    /// (counted by the unit, `Host::count_n`).
    UsageCharged,
    /// Usage-based units refunded after the response (by the unit).
    UsageRefunded,
    /// A usage-based request charged its fallback: no usage arrived.
    UsageFallback,
    /// A limit left out of a request because a value its descriptor reads
    /// (metadata, an attribute) was of the wrong type.
    PartInvalid,
    /// A limit whose reservation the request body names took its fixed
    /// `reserve`: no body, not JSON, over the bound, or no such field.
    UsageReserveUnread,
    /// A settlement that could not be sent or did not run (its units are
    /// lost to the limit: refunds not given, charges not taken).
    UsageLost,
}

/// Why a Redis call did not decide a request: one stat each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// No reply within the deadline, or the connection was reset.
    Timeout,
    /// The host refused to send the call (unknown cluster, no capacity).
    Dispatch,
    /// Webdis or Envoy answered with an HTTP error status.
    Http,
    /// Redis answered with an error (OOM, CROSSSLOT, script error).
    Redis,
    /// A reply the filter cannot read (gateway or script mismatch, corrupt record).
    Reply,
    /// Refused for its credentials: Webdis' ACL (HTTP 401/403: none sent,
    /// or not the ones it admits), or Redis' (NOPERM: the Redis user may
    /// not run that command or touch that key).
    Auth,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 6] = [
        ErrorKind::Timeout,
        ErrorKind::Dispatch,
        ErrorKind::Http,
        ErrorKind::Redis,
        ErrorKind::Reply,
        ErrorKind::Auth,
    ];

    /// The stat name's last segment.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Timeout => "timeout",
            ErrorKind::Dispatch => "dispatch",
            ErrorKind::Http => "http",
            ErrorKind::Redis => "redis",
            ErrorKind::Reply => "reply",
            ErrorKind::Auth => "auth",
        }
    }
}

/// How Envoy keeps a stat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatKind {
    Counter,
    Gauge,
}

/// One stat a counter event moves: its name (Envoy shows it under
/// `wasmcustom.`), its kind and by how much. Names carry the limit or the
/// error kind as a dotted segment that `stats_tags` in envoy.yaml turn into
/// Prometheus labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stat {
    pub name: String,
    pub kind: StatKind,
    pub by: i64,
}

/// Distributions the filter records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Histogram {
    /// Requests decided by one batch call.
    BatchSize,
}

impl Histogram {
    pub const ALL: [Histogram; 1] = [Histogram::BatchSize];

    pub fn name(self) -> &'static str {
        match self {
            Histogram::BatchSize => "redis_guard.batch.size",
        }
    }
}

/// The histogram of callout round trips, in microseconds (loopback calls
/// take well under a millisecond, which a ms histogram would show as 0).
pub const CALLOUT_LATENCY_US: &str = "redis_guard.redis.callout_latency_us";

/// The gauge naming the tz database release compiled in
/// ([`crate::quota::TZDB_RELEASE`]): `redis_guard.tzdb.<release>`, set to 1
/// at configuration (an "info" stat: its value says nothing, its name
/// does; envoy.yaml's `stats_tags` make the release a `tzdb` label). Set
/// once per configuration, never on a request.
pub fn tzdb_stat() -> String {
    format!("redis_guard.tzdb.{}", crate::quota::TZDB_RELEASE)
}

/// The counter events that name no limit and no error kind, in the order
/// of [`Counter::all`] (and of [`Counter::index`]).
const FIXED: [Counter; 45] = [
    Counter::RedisCalls,
    Counter::ScriptReloads,
    Counter::RedisRetries,
    Counter::FailureAllowed,
    Counter::FailureDenied,
    Counter::FailureLocal,
    Counter::LocalAllowed,
    Counter::LocalRejected,
    Counter::IdemAcquired,
    Counter::IdemReplayed,
    Counter::IdemConflicts,
    Counter::IdemMismatches,
    Counter::IdemReleased,
    Counter::IdemAbandoned,
    Counter::IdemStored,
    Counter::IdemStoreFailed,
    Counter::IdemTooLarge,
    Counter::IdemUnguarded,
    Counter::IdemOffloaded,
    Counter::IdemOffloadFailed,
    Counter::IdemObjectFetched,
    Counter::IdemObjectMissing,
    Counter::IdemObjectCorrupt,
    Counter::IdemObjectFetchFailed,
    Counter::CircuitOpened,
    Counter::CircuitTripped,
    Counter::CircuitClosed,
    Counter::CircuitShortCircuited,
    Counter::OverLimitCached,
    Counter::LeaseSpent,
    Counter::LeaseFetched,
    Counter::BatchCalls,
    Counter::BatchAlone,
    Counter::SlotsReleased,
    Counter::SlotsAbandoned,
    Counter::SlotsRenewed,
    Counter::SlotsLost,
    Counter::UsageCharged,
    Counter::UsageRefunded,
    Counter::UsageFallback,
    Counter::UsageReserveUnread,
    Counter::UsageLost,
    Counter::PartInvalid,
    Counter::Denied,
    Counter::LeaseReturned,
];

impl Counter {
    /// Every counter event a configuration with `limits` limits can raise.
    pub fn all(limits: usize) -> Vec<Counter> {
        let mut all = Vec::with_capacity(7 * limits + 46);
        for i in 0..limits {
            all.extend([
                Counter::Checked(i),
                Counter::Allowed(i),
                Counter::Rejected(i),
                Counter::ShadowRejected(i),
                Counter::Exempt(i),
                Counter::OverrideApplied(i),
                Counter::OverrideInvalid(i),
            ]);
        }
        all.extend(ErrorKind::ALL.map(Counter::RedisError));
        all.extend(FIXED);
        all
    }

    /// This event's place in [`Counter::all`]`(limits)`: the host keeps
    /// what each event moves in a table in that order, so a count is an
    /// index, not a hash. `None` for a limit index out of range.
    pub fn index(self, limits: usize) -> Option<usize> {
        let per_limit = |i: usize, k: usize| (i < limits).then(|| 7 * i + k);
        let fixed = 7 * limits + ErrorKind::ALL.len();
        Some(match self {
            Counter::Checked(i) => return per_limit(i, 0),
            Counter::Allowed(i) => return per_limit(i, 1),
            Counter::Rejected(i) => return per_limit(i, 2),
            Counter::ShadowRejected(i) => return per_limit(i, 3),
            Counter::Exempt(i) => return per_limit(i, 4),
            Counter::OverrideApplied(i) => return per_limit(i, 5),
            Counter::OverrideInvalid(i) => return per_limit(i, 6),
            Counter::RedisError(kind) => 7 * limits + kind as usize,
            Counter::RedisCalls => fixed,
            Counter::ScriptReloads => fixed + 1,
            Counter::RedisRetries => fixed + 2,
            Counter::FailureAllowed => fixed + 3,
            Counter::FailureDenied => fixed + 4,
            Counter::FailureLocal => fixed + 5,
            Counter::LocalAllowed => fixed + 6,
            Counter::LocalRejected => fixed + 7,
            Counter::IdemAcquired => fixed + 8,
            Counter::IdemReplayed => fixed + 9,
            Counter::IdemConflicts => fixed + 10,
            Counter::IdemMismatches => fixed + 11,
            Counter::IdemReleased => fixed + 12,
            Counter::IdemAbandoned => fixed + 13,
            Counter::IdemStored => fixed + 14,
            Counter::IdemStoreFailed => fixed + 15,
            Counter::IdemTooLarge => fixed + 16,
            Counter::IdemUnguarded => fixed + 17,
            Counter::IdemOffloaded => fixed + 18,
            Counter::IdemOffloadFailed => fixed + 19,
            Counter::IdemObjectFetched => fixed + 20,
            Counter::IdemObjectMissing => fixed + 21,
            Counter::IdemObjectCorrupt => fixed + 22,
            Counter::IdemObjectFetchFailed => fixed + 23,
            Counter::CircuitOpened => fixed + 24,
            Counter::CircuitTripped => fixed + 25,
            Counter::CircuitClosed => fixed + 26,
            Counter::CircuitShortCircuited => fixed + 27,
            Counter::OverLimitCached => fixed + 28,
            Counter::LeaseSpent => fixed + 29,
            Counter::LeaseFetched => fixed + 30,
            Counter::BatchCalls => fixed + 31,
            Counter::BatchAlone => fixed + 32,
            Counter::SlotsReleased => fixed + 33,
            Counter::SlotsAbandoned => fixed + 34,
            Counter::SlotsRenewed => fixed + 35,
            Counter::SlotsLost => fixed + 36,
            Counter::UsageCharged => fixed + 37,
            Counter::UsageRefunded => fixed + 38,
            Counter::UsageFallback => fixed + 39,
            Counter::UsageReserveUnread => fixed + 40,
            Counter::UsageLost => fixed + 41,
            Counter::PartInvalid => fixed + 42,
            Counter::Denied => fixed + 43,
            Counter::LeaseReturned => fixed + 44,
        })
    }

    /// The stats this event moves; `limit_name` names a limit by index.
    pub fn stats(self, limit_name: impl Fn(usize) -> String) -> Vec<Stat> {
        let count = |name: String| Stat {
            name,
            kind: StatKind::Counter,
            by: 1,
        };
        let open_workers = |by| Stat {
            name: "redis_guard.circuit.open_workers".to_string(),
            kind: StatKind::Gauge,
            by,
        };
        let per_limit =
            |i: usize, what: &str| count(format!("redis_guard.ratelimit.{}.{what}", limit_name(i)));
        let fixed = |name: &str| vec![count(format!("redis_guard.{name}"))];
        match self {
            Counter::Checked(i) => vec![per_limit(i, "checked")],
            Counter::Allowed(i) => vec![per_limit(i, "allowed")],
            Counter::Rejected(i) => vec![per_limit(i, "rejected")],
            Counter::ShadowRejected(i) => vec![per_limit(i, "shadow_rejected")],
            Counter::Exempt(i) => vec![per_limit(i, "exempt")],
            Counter::OverrideApplied(i) => vec![per_limit(i, "override_applied")],
            Counter::OverrideInvalid(i) => vec![per_limit(i, "override_invalid")],
            // The total and the kind: the total is their sum.
            Counter::RedisError(kind) => vec![
                count("redis_guard.redis.errors".to_string()),
                count(format!("redis_guard.redis.errors_by_kind.{}", kind.name())),
            ],
            // The gauge counts workers whose breaker is open (or probing).
            Counter::CircuitTripped => vec![open_workers(1)],
            Counter::CircuitClosed => vec![
                count("redis_guard.circuit.closed".to_string()),
                open_workers(-1),
            ],
            Counter::RedisCalls => fixed("redis.calls"),
            Counter::ScriptReloads => fixed("redis.script_reloads"),
            Counter::RedisRetries => fixed("redis.retries"),
            Counter::FailureAllowed => fixed("failure_mode.allowed"),
            Counter::FailureDenied => fixed("failure_mode.denied"),
            Counter::FailureLocal => fixed("failure_mode.local"),
            Counter::LocalAllowed => fixed("local.allowed"),
            Counter::LocalRejected => fixed("local.rejected"),
            Counter::IdemAcquired => fixed("idempotency.acquired"),
            Counter::IdemReplayed => fixed("idempotency.replayed"),
            Counter::IdemConflicts => fixed("idempotency.conflicted"),
            Counter::IdemMismatches => fixed("idempotency.mismatched"),
            Counter::IdemReleased => fixed("idempotency.released"),
            Counter::IdemAbandoned => fixed("idempotency.abandoned"),
            Counter::IdemStored => fixed("idempotency.stored"),
            Counter::IdemStoreFailed => fixed("idempotency.store_failed"),
            Counter::IdemTooLarge => fixed("idempotency.too_large"),
            Counter::IdemUnguarded => fixed("idempotency.unguarded"),
            Counter::IdemOffloaded => fixed("idempotency.offloaded"),
            Counter::IdemOffloadFailed => fixed("idempotency.offload_failed"),
            Counter::IdemObjectFetched => fixed("idempotency.object_fetched"),
            Counter::IdemObjectMissing => fixed("idempotency.object_missing"),
            Counter::IdemObjectCorrupt => fixed("idempotency.object_corrupt"),
            Counter::IdemObjectFetchFailed => fixed("idempotency.object_fetch_failed"),
            Counter::CircuitOpened => fixed("circuit.opened"),
            Counter::CircuitShortCircuited => fixed("circuit.short_circuited"),
            Counter::OverLimitCached => fixed("overlimit_cache.rejected"),
            Counter::LeaseSpent => fixed("lease.spent"),
            Counter::LeaseFetched => fixed("lease.fetches"),
            Counter::BatchCalls => fixed("batch.calls"),
            Counter::BatchAlone => fixed("batch.alone"),
            Counter::SlotsReleased => fixed("concurrency.released"),
            Counter::SlotsAbandoned => fixed("concurrency.abandoned"),
            Counter::SlotsRenewed => fixed("concurrency.renewed"),
            Counter::SlotsLost => fixed("concurrency.lost"),
            Counter::UsageCharged => fixed("usage.charged_units"),
            Counter::UsageRefunded => fixed("usage.refunded_units"),
            Counter::UsageFallback => fixed("usage.fallback"),
            Counter::UsageReserveUnread => fixed("usage.reserve_unread"),
            Counter::PartInvalid => fixed("descriptor.invalid"),
            Counter::UsageLost => fixed("usage.lost"),
            Counter::Denied => fixed("denied"),
            Counter::LeaseReturned => fixed("lease.returned"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn names(limits: usize) -> BTreeSet<String> {
        Counter::all(limits)
            .into_iter()
            .flat_map(|c| c.stats(|i| format!("l{i}")))
            .map(|s| s.name)
            .collect()
    }

    #[test]
    fn every_counter_event_names_the_stats_it_moves() {
        // The stat list as docs/src/running/stats.md and tests/e2e_stats.rs know it: 52
        // fixed stats (the gauge included) and seven per limit.
        assert_eq!(names(0).len(), 52);
        assert_eq!(names(2).len(), 52 + 14);
        assert!(names(1).contains("redis_guard.ratelimit.l0.shadow_rejected"));
        assert!(names(0).contains("redis_guard.redis.errors_by_kind.timeout"));
        assert!(names(0).iter().all(|n| n.starts_with("redis_guard.")));
    }

    #[test]
    fn a_counter_event_indexes_its_place_in_the_list() {
        for limits in [0, 1, 3] {
            let all = Counter::all(limits);
            for (i, c) in all.iter().enumerate() {
                assert_eq!(c.index(limits), Some(i), "{c:?} of {limits} limits");
            }
        }
        assert_eq!(Counter::Checked(1).index(1), None);
        assert_eq!(
            Counter::all(2).len(),
            14 + ErrorKind::ALL.len() + FIXED.len()
        );
    }

    #[test]
    fn a_stat_has_one_kind_whatever_event_moves_it() {
        let mut kinds = std::collections::HashMap::new();
        for stat in Counter::all(1)
            .into_iter()
            .flat_map(|c| c.stats(|_| "a".into()))
        {
            assert_eq!(
                *kinds.entry(stat.name.clone()).or_insert(stat.kind),
                stat.kind
            );
        }
        assert_eq!(kinds["redis_guard.circuit.open_workers"], StatKind::Gauge);
    }

    #[test]
    fn the_tz_database_gauge_names_the_release() {
        assert_eq!(tzdb_stat(), "redis_guard.tzdb.2025b");
        assert!(!names(0).contains(&tzdb_stat()), "not a counter event");
    }

    #[test]
    fn closing_a_breaker_counts_once_and_lowers_the_open_gauge() {
        let stats = Counter::CircuitClosed.stats(|_| String::new());
        let moves: Vec<(&str, i64)> = stats.iter().map(|s| (s.name.as_str(), s.by)).collect();
        assert_eq!(
            moves,
            [
                ("redis_guard.circuit.closed", 1),
                ("redis_guard.circuit.open_workers", -1)
            ]
        );
    }
}
