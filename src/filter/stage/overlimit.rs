//! The over-limit cache: a 429 Redis gave is answered again by this Envoy,
//! without a call, until Redis said the request's cost could fit again.

use crate::config::{Algorithm, Config};
use crate::filter::{millis, Counter, Host};
use crate::overlimit::Slot;
use crate::ratelimit::{LimitResult, Outcome, Plan};
use crate::response::{too_many_requests, LocalReply};
use std::time::Duration;

/// A 429 for the enforced limits the cache says cannot admit this request
/// now (counted); `None` when Redis has to decide.
pub fn cached<H: Host>(host: &mut H, config: &Config, plan: &Plan) -> Option<LocalReply> {
    let now_ms = millis(host.now());
    let mut rejecting = Plan::default();
    let mut results = Vec::new();
    for check in &plan.checks {
        if config.limits[check.limit].shadow {
            continue;
        }
        let slot = Slot::of_digest(check.digest());
        let (stored, _) = host.shared_get(&slot.shared_key);
        if let Some((retry_ms, remaining)) = slot.rejects(stored.as_deref(), check.cost, now_ms) {
            results.push(LimitResult {
                allowed: false,
                remaining,
                retry_ms,
                reset_ms: retry_ms,
                // The cache keeps no quota: a limit an override may decide
                // is left out of the headers rather than misstated.
                overridden: if config.limits[check.limit].overrides.redis {
                    crate::ratelimit::OverrideUse::Applied
                } else {
                    crate::ratelimit::OverrideUse::None
                },
                plan: None,
            });
            rejecting.checks.push(check.clone());
        }
    }
    if rejecting.checks.is_empty() {
        return None;
    }
    let outcome = Outcome {
        admitted: false,
        results,
    };
    host.count(Counter::OverLimitCached);
    for check in &rejecting.checks {
        host.count(Counter::Rejected(check.limit));
    }
    Some(
        too_many_requests(config, &rejecting, &outcome)
            .with_details("redis_guard_rate_limited_cached"),
    )
}

/// Records every enforced limit that rejected, counted from when the call
/// left (never later than Redis' own view of it). A plain write, not a
/// compare-and-swap: any worker's newer answer is as good as ours. Never a
/// concurrency limit or a usage-based one: their capacity also comes back
/// when a request ends (a released slot, a refund), which no time-out in
/// this cache can foresee.
pub fn remember<H: Host>(
    host: &mut H,
    config: &Config,
    plan: &Plan,
    outcome: &Outcome,
    sent_at: Duration,
) {
    let sent_ms = millis(sent_at);
    for (check, result) in plan.checks.iter().zip(&outcome.results) {
        let limit = &config.limits[check.limit];
        if result.allowed
            || result.retry_ms == 0
            || limit.shadow
            || matches!(limit.algorithm, Algorithm::Concurrency { .. })
            || limit.usage.is_some()
        {
            continue;
        }
        let slot = Slot::of_digest(check.digest());
        let entry = slot.entry(sent_ms, result.retry_ms, check.cost, result.remaining);
        host.shared_set(&slot.shared_key, &entry.encode(), None);
    }
}
