//! The rate-limit stage: which limits apply, what Redis decided for each
//! (stats, the 429) and the RateLimit headers an admitted response carries.

use crate::config::{Config, FailureMode};
use crate::filter::{Counter, Host};
use crate::ratelimit::{IdemArgs, Outcome, OverrideUse, Plan, ScriptArgs};
use crate::request::RequestLine;
use crate::response::{bad_request, rate_limit_headers, too_many_requests, LocalReply};

#[derive(Debug, Default)]
pub struct RateLimit {
    plan: Plan,
    /// Its quotas' windows.
    quota: super::quota::QuotaStage,
    /// Added to the response once it starts.
    headers: Vec<(String, String)>,
}

impl RateLimit {
    /// Collects the limits that apply; a bad cost header is a 400.
    pub fn on_request<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        line: &RequestLine,
    ) -> Result<(), LocalReply> {
        self.plan = Plan::build(config, line, host).map_err(|bad| bad_request(&bad.detail))?;
        self.quota.on_request(host, config, &mut self.plan);
        for (limit, why) in &self.plan.invalid {
            log::debug!(
                "redis-guard: limit `{}` does not apply: {why}",
                config.limits[*limit].name
            );
            host.count(Counter::PartInvalid);
        }
        for check in &self.plan.checks {
            host.count(Counter::Checked(check.limit));
        }
        for limit in &self.plan.exempt {
            host.count(Counter::Exempt(*limit));
        }
        for (limit, why) in &self.plan.bad_overrides {
            log::warn!(
                "redis-guard: the override the request carries for `{}` is not valid ({why}): the configured limit applies",
                config.limits[*limit].name
            );
            host.count(Counter::OverrideInvalid(*limit));
        }
        Ok(())
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The request's hash tag, if the limits computed it already.
    pub fn tag(&self) -> Option<&str> {
        self.plan.tag.as_deref()
    }

    /// KEYS and ARGV of the request script, with the idempotency acquire
    /// and the slot id its concurrency limits take their slots under.
    pub fn script_args(
        &self,
        config: &Config,
        idem: Option<&IdemArgs>,
        slot: Option<&str>,
    ) -> ScriptArgs {
        self.plan.script_args(config, idem, slot)
    }

    /// A stored override moved quotas of the request to other anchor days
    /// (`Verdict::Anchors`): true when the plan is ready to go again.
    pub fn on_anchors<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        moved: &[(usize, u8)],
    ) -> bool {
        self.quota.on_anchors(host, config, &mut self.plan, moved)
    }

    /// The request takes `units` under its check `check` (a usage-based
    /// reservation read from its body), before the decision.
    pub fn reserve(&mut self, check: usize, units: u64) {
        if let Some(c) = self.plan.checks.get_mut(check) {
            c.cost = units;
        }
    }

    pub fn failure_mode(&self, config: &Config) -> FailureMode {
        self.plan.failure_mode(config)
    }

    /// Counts what Redis decided per limit; `Err` is the 429 to send.
    pub fn on_outcome<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        outcome: &Outcome,
    ) -> Result<(), LocalReply> {
        for (check, result) in self.plan.checks.iter().zip(&outcome.results) {
            let limit = &config.limits[check.limit];
            match (limit.shadow, result.allowed) {
                (true, false) => {
                    log::info!("redis-guard: shadow limit `{}` would reject", limit.name);
                    host.count(Counter::ShadowRejected(check.limit));
                }
                (_, true) => host.count(Counter::Allowed(check.limit)),
                (false, false) => host.count(Counter::Rejected(check.limit)),
            }
            match result.overridden {
                OverrideUse::None if check.carried.is_some() => {
                    host.count(Counter::OverrideApplied(check.limit))
                }
                OverrideUse::None => {}
                OverrideUse::Applied => host.count(Counter::OverrideApplied(check.limit)),
                OverrideUse::Invalid => {
                    log::warn!(
                        "redis-guard: the override stored for a key of `{}` is not valid (see `redis-guard override show`): the configured limit applied",
                        limit.name
                    );
                    host.count(Counter::OverrideInvalid(check.limit));
                }
            }
        }
        if !outcome.admitted {
            return Err(too_many_requests(config, &self.plan, outcome));
        }
        self.headers = rate_limit_headers(config, &self.plan, outcome);
        Ok(())
    }

    pub fn on_response_headers<H: Host>(&mut self, host: &mut H) {
        for (name, value) in self.headers.drain(..) {
            host.add_response_header(&name, &value);
        }
    }
}
