//! The access-log stage: what this request's decision was, written once to
//! its filter state as the stream ends (`wasm.redis_guard`), where Envoy's
//! access log prints it (`%FILTER_STATE(wasm.redis_guard:PLAIN)%`): one
//! host call per request the filter acted on. The flow tells it what
//! happened at the points it learns it; the record's form is
//! [`crate::access_log`].

use crate::access_log::Record;
use crate::config::{Config, FailureMode};
use crate::filter::Host;
use crate::ratelimit::{Outcome, Plan};

/// Filter state name (Envoy stores it as `wasm.redis_guard`).
pub const FILTER_STATE: &str = "redis_guard";

#[derive(Debug, Default)]
pub struct AccessLogStage {
    record: Record,
}

impl AccessLogStage {
    pub fn verdict(&mut self, verdict: &'static str) {
        self.record.verdict = Some(verdict);
    }

    /// A keyed request forwarded without the guarantee (its failure mode
    /// let it through): that is what became of its key.
    pub fn unguarded(&mut self) {
        self.record.idempotency = Some("unguarded");
    }

    /// Redis could not decide: the failure mode applied.
    pub fn failure(&mut self, mode: FailureMode) {
        self.verdict(match mode {
            FailureMode::Allow => "failure_allowed",
            FailureMode::Deny => "failure_denied",
            FailureMode::Local => "failure_local",
        });
    }

    /// Redis decided the limits: the verdict, and the deciding limit (the
    /// first enforced one that rejected, or the one with the fewest units
    /// left).
    pub fn limits(&mut self, config: &Config, plan: &Plan, outcome: &Outcome) {
        // Nobody reads a record that is never written.
        if !config.access_log.enabled {
            return;
        }
        let enforced = |i: usize| !config.limits[plan.checks[i].limit].shadow;
        let results = &outcome.results;
        let rejecting = (0..results.len()).find(|&i| enforced(i) && !results[i].allowed);
        let shadow = (0..results.len()).any(|i| !enforced(i) && !results[i].allowed);
        self.verdict(match (outcome.admitted, shadow) {
            (false, _) => "rejected",
            (true, true) => "shadow_rejected",
            (true, false) => "admitted",
        });
        let deciding = rejecting.or_else(|| {
            (0..results.len())
                .filter(|&i| enforced(i))
                .min_by_key(|&i| results[i].remaining)
        });
        if let Some(i) = deciding {
            let check = &plan.checks[i];
            self.record.decided_by(
                &config.limits[check.limit].name,
                Some(results[i].remaining),
                (&check.key, &check.digest),
                config.access_log.key,
            );
        }
    }

    /// The stream is over: writes the record, with what became of the
    /// request's idempotency key (if it had one).
    pub fn on_stream_end<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        idempotency: Option<&'static str>,
    ) {
        if self.record.idempotency.is_none() {
            self.record.idempotency = idempotency;
        }
        if !config.access_log.enabled || self.record.is_empty() {
            return;
        }
        let record = std::mem::take(&mut self.record);
        host.set_filter_state(FILTER_STATE, &record.to_json());
    }
}
