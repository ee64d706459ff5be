//! The failure modes: what a request gets when Redis could not decide it.

use crate::config::{Config, FailureMode};
use crate::filter::cas::{self, Update};
use crate::filter::{millis, Action, Counter, Host};
use crate::local::{take, LocalBucket};
use crate::ratelimit::Check;
use crate::response::{too_many_requests_locally, unavailable, LocalReply};

/// One undecided request: why, and what it was subject to.
pub struct Undecided<'a> {
    pub mode: FailureMode,
    pub why: &'a str,
    /// Log at warning level (the first failure of a burst) or debug.
    pub level: log::Level,
    /// It carries an idempotency key, now forwarded without the guarantee.
    pub keyed: bool,
    /// The request waits for us (a callout) rather than for a callback's
    /// return value.
    pub paused: bool,
}

/// Applies the failure mode: deny (503), allow, or this Envoy's local
/// budget of every `local` limit in `checks`.
pub fn apply<H: Host>(
    host: &mut H,
    config: &Config,
    checks: &[Check],
    request: Undecided<'_>,
) -> Action {
    let Undecided {
        mode,
        why,
        level,
        keyed,
        paused,
    } = request;
    match mode {
        FailureMode::Deny => {
            log::log!(level, "redis-guard: request undecided, denying: {why}");
            host.count(Counter::FailureDenied);
            host.send_local(&unavailable(
                "rate limit or idempotency backend unavailable",
            ));
            return Action::Pause;
        }
        FailureMode::Local => {
            log::log!(
                level,
                "redis-guard: request undecided, deciding locally: {why}"
            );
            host.count(Counter::FailureLocal);
            if keyed {
                host.count(Counter::IdemUnguarded);
            }
            if let Some(reply) = decide_locally(host, config, checks) {
                host.send_local(&reply);
                return Action::Pause;
            }
        }
        FailureMode::Allow => {
            log::log!(level, "redis-guard: request undecided, allowing: {why}");
            host.count(Counter::FailureAllowed);
            if keyed {
                // Forwarded without the guarantee: say so in a stat.
                host.count(Counter::IdemUnguarded);
            }
        }
    }
    if paused {
        host.resume_request();
    }
    Action::Continue
}

/// Spends from this Envoy's local budget of every `local` limit that
/// applies; `Some(429)` when one of them is empty. Shared data with
/// compare-and-swap keeps the workers of one Envoy on one budget.
fn decide_locally<H: Host>(host: &mut H, config: &Config, checks: &[Check]) -> Option<LocalReply> {
    let now_ms = millis(host.now());
    for check in checks {
        let limit = &config.limits[check.limit];
        if limit.shadow || limit.failure_mode != FailureMode::Local {
            continue;
        }
        let Some(bucket) = LocalBucket::for_limit(&limit.algorithm, limit.local_per_mille) else {
            continue;
        };
        let key = format!("redis-guard/local/{}", crate::codec::sha256_hex(&check.key));
        let mut taken = None;
        let update = cas::update(host, &key, |state| {
            let t = take(&bucket, state, now_ms, check.cost);
            let state = t.state.clone();
            taken = Some(t);
            Some(state)
        });
        match (update, taken) {
            (Update::Written, Some(t)) if !t.allowed => {
                host.count(Counter::LocalRejected);
                host.count(Counter::Rejected(check.limit));
                return Some(too_many_requests_locally(&limit.name, t.retry_ms));
            }
            (Update::Written, _) => host.count(Counter::LocalAllowed),
            // Contended: counted as admitted rather than spin.
            _ => log::warn!("redis-guard: local budget of `{}` contended", limit.name),
        }
    }
    None
}
