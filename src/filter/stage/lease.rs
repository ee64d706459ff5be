//! The lease stage: tokens an Envoy holds for a leased limit, spent without
//! a call; a request that finds too few fetches the next batch with its own
//! decision, or a background fetch tops them up from the root context.

use std::time::Duration;

use crate::config::Config;
use crate::filter::call::{transport, Budget, ScriptCall, Transport};
use crate::filter::cas::{self, Update};
use crate::filter::{millis, CalloutReply, Counter, ErrorKind, Host};
use crate::lease::{self, Slot};
use crate::ratelimit::{parse_lease, Outcome, Plan};
use crate::scripts::LEASE;
use crate::webdis::parse_reply;

/// What a request on a leased limit does (see [`lease::Step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spend {
    /// Admitted from this Envoy's tokens; start a background fetch of this
    /// many when the batch ran low.
    Spent(Option<u64>),
    /// This request fetches a batch of this many with its decision.
    Fetch(u64),
    /// Redis decides (nothing to spend, another worker fetching, contention).
    Strict,
}

/// A background lease fetch in flight: where its grant goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prefetch {
    pub limit_key: Vec<u8>,
    pub ttl: Duration,
    pub sent_at: Duration,
    /// The lease's batch: an Envoy never holds more.
    pub batch: u64,
}

#[derive(Debug, Default)]
pub struct LeaseStage {
    /// The decision in flight fetches a lease for this check (plan index),
    /// this many tokens.
    fetching: Option<(usize, u64)>,
}

impl LeaseStage {
    /// The plan's one check, when it is a leased limit: only then can a
    /// request be admitted without Redis (with more checks, or a shadow one,
    /// Redis must see it).
    pub fn leased_check(config: &Config, plan: &Plan) -> Option<usize> {
        match plan.checks.as_slice() {
            [only] if config.limits[only.limit].lease.is_some() => Some(0),
            _ => None,
        }
    }

    /// Spends leased tokens or, with `claim`, claims the fetch of a new
    /// batch by this request (then remembered for its decision).
    pub fn spend<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        plan: &Plan,
        i: usize,
        claim: bool,
    ) -> Spend {
        let check = &plan.checks[i];
        let Some(batch) = config.limits[check.limit].lease.map(|l| l.tokens) else {
            return Spend::Strict;
        };
        let slot = Slot::of_digest(check.digest());
        let now_ms = millis(host.now());
        let fetch_for = millis(config.redis.timeout).saturating_add(1000);
        let mut next = Spend::Strict;
        let update = cas::update(host, &slot.shared_key, |stored| {
            let step = slot.step(stored, check.cost, now_ms, fetch_for, batch, claim);
            let (bytes, spend) = match step {
                lease::Step::Spend { bytes, prefetch } => (bytes, Spend::Spent(prefetch)),
                lease::Step::Fetch { bytes, want } => (bytes, Spend::Fetch(want)),
                lease::Step::Strict => return None,
            };
            next = spend;
            Some(bytes)
        });
        match (update, next) {
            (Update::Written, Spend::Fetch(want)) => {
                self.fetching = Some((i, want));
                next
            }
            (Update::Written, _) => next,
            _ => Spend::Strict,
        }
    }

    /// Counts a request admitted from the lease and starts the background
    /// fetch its spend claimed.
    pub fn spent<H: Host>(
        &self,
        host: &mut H,
        config: &Config,
        plan: &Plan,
        i: usize,
        prefetch: Option<u64>,
    ) {
        if let Some(want) = prefetch {
            prefetch_batch(host, config, plan, i, want);
        }
        host.count(Counter::LeaseSpent);
        host.count(Counter::Allowed(plan.checks[i].limit));
    }

    /// The decision's call, when this request fetches a batch.
    pub fn call(&self, config: &Config, plan: &Plan, budget: Budget) -> Option<ScriptCall> {
        let (i, want) = self.fetching?;
        let args = plan.lease_args(config, i, false, want)?;
        Some(ScriptCall::new(&LEASE, args, budget))
    }

    pub fn fetching(&self) -> bool {
        self.fetching.is_some()
    }

    /// The decision's answer when it fetched a batch: the grant joins this
    /// Envoy's tokens, counted from when the call left.
    pub fn on_answer<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        plan: &Plan,
        sent_at: Duration,
        reply: &crate::webdis::Reply,
    ) -> Result<Outcome, String> {
        let (outcome, granted) = parse_lease(reply)?;
        host.count(Counter::LeaseFetched);
        if let Some(check) = self.fetching.and_then(|(i, _)| plan.checks.get(i)) {
            if let Some(l) = config.limits[check.limit].lease {
                add_grant(host, &check.key, granted, millis(sent_at + l.ttl), l.tokens);
            }
        }
        Ok(outcome)
    }

    /// The decision will not fetch (failed, or its stream left): free the
    /// claim so the next spend may try.
    pub fn abandon<H: Host>(&mut self, host: &mut H, plan: &Plan) {
        if let Some((i, _)) = self.fetching.take() {
            if let Some(check) = plan.checks.get(i) {
                release_claim(host, &check.key);
            }
        }
    }
}

/// Queues the background fetch this request's spend claimed. Its reply goes
/// to [`on_prefetch_reply`], whatever becomes of this stream.
fn prefetch_batch<H: Host>(host: &mut H, config: &Config, plan: &Plan, i: usize, want: u64) {
    let Some(check) = plan.checks.get(i) else {
        return;
    };
    let Some(lease) = config.limits[check.limit].lease else {
        return;
    };
    let Some(args) = plan.lease_args(config, i, true, want) else {
        return;
    };
    let timeout = config.redis.timeout;
    // No NOSCRIPT fallback: nobody waits on it, and the next fetching
    // request reloads the script.
    let call = ScriptCall::new(&LEASE, args, Budget::Each(timeout));
    let note = Prefetch {
        limit_key: check.key.clone(),
        ttl: lease.ttl,
        sent_at: host.now(),
        batch: lease.tokens,
    };
    if let Err(e) = call.send_prefetch(host, &config.redis, note) {
        log::warn!("redis-guard: cannot prefetch a lease: {e}");
        release_claim(host, &check.key);
    }
}

/// The answer to a background lease fetch: its grant joins the Envoy's
/// tokens; whatever else happened, the claim is released so the next spend
/// may try again.
pub fn on_prefetch_reply<H: Host>(host: &mut H, note: &Prefetch, reply: CalloutReply) {
    let granted = match transport(&reply) {
        Transport::Answered => parse_reply(&reply.body)
            .ok()
            .and_then(|r| parse_lease(&r).ok())
            .map(|(_, granted)| granted)
            .ok_or(ErrorKind::Reply),
        Transport::Refused(_) => Err(ErrorKind::Http),
        Transport::Failed((kind, _)) => Err(kind),
    };
    match granted {
        Ok(granted) => {
            host.count(Counter::LeaseFetched);
            let expires = millis(note.sent_at + note.ttl);
            add_grant(host, &note.limit_key, granted, expires, note.batch);
        }
        Err(kind) => {
            host.count(Counter::RedisError(kind));
            release_claim(host, &note.limit_key);
        }
    }
}

/// Adds a fetched grant to this Envoy's lease of `limit_key`.
fn add_grant<H: Host>(host: &mut H, limit_key: &[u8], granted: u64, expires_ms: u64, batch: u64) {
    let slot = Slot::of(limit_key);
    let now_ms = millis(host.now());
    let update = cas::update(host, &slot.shared_key, |stored| {
        slot.granted(stored, granted, now_ms, expires_ms, batch)
    });
    match update {
        Update::Written => {}
        Update::Declined => {
            log::info!("redis-guard: lease slot taken by another key; {granted} tokens dropped");
        }
        Update::Contended => {
            log::warn!("redis-guard: lease slot contended; {granted} tokens dropped");
        }
    }
}

fn release_claim<H: Host>(host: &mut H, limit_key: &[u8]) {
    let slot = Slot::of(limit_key);
    cas::update(host, &slot.shared_key, |stored| slot.fetch_failed(stored));
}
