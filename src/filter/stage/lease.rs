//! The lease stage: tokens an Envoy holds for a leased limit, spent without
//! a call; a request that finds too few fetches the next batch with its own
//! decision, or a background fetch tops them up from the root context.
//! The worker that received a grant remembers its slot, and its root gives
//! the unspent tokens back to Redis when the lease ends or the key's traffic
//! stops ([`give_back`]).

use std::collections::HashMap;
use std::time::Duration;

use crate::config::{Algorithm, Config};
use crate::filter::call::{transport, Budget, ScriptCall, Transport};
use crate::filter::cas::{self, Update};
use crate::filter::deferred::Kind;
use crate::filter::handoff::Prefetch;
use crate::filter::{millis, CalloutReply, Counter, ErrorKind, Host};
use crate::lease::{self, Slot, Tuple};
use crate::ratelimit::{parse_lease, Outcome, Plan};
use crate::scripts::{LEASE, LEASE_RETURN};
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
        let (outcome, granted, tuple) = parse_lease(reply)?;
        host.count(Counter::LeaseFetched);
        if let Some(check) = self.fetching.and_then(|(i, _)| plan.checks.get(i)) {
            if let Some(l) = config.limits[check.limit].lease {
                let grant = (granted, tuple);
                let expires = millis(sent_at + l.ttl);
                add_grant(host, (&check.key, check.limit), grant, expires, l.tokens);
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
        limit: check.limit,
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
            .map(|(_, granted, tuple)| (granted, tuple))
            .ok_or(ErrorKind::Reply),
        Transport::Refused(_) => Err(ErrorKind::Http),
        Transport::Failed((kind, _)) => Err(kind),
    };
    match granted {
        Ok(grant) => {
            host.count(Counter::LeaseFetched);
            let expires = millis(note.sent_at + note.ttl);
            let limit = (note.limit_key.as_slice(), note.limit);
            add_grant(host, limit, grant, expires, note.batch);
        }
        Err(kind) => {
            host.count(Counter::RedisError(kind));
            release_claim(host, &note.limit_key);
        }
    }
}

/// Adds a fetched grant to this Envoy's lease of `limit_key` (limit
/// `limit`); the worker then watches the slot to give back what is left.
fn add_grant<H: Host>(
    host: &mut H,
    (limit_key, limit): (&[u8], usize),
    (granted, tuple): (u64, Tuple),
    expires_ms: u64,
    batch: u64,
) {
    let slot = Slot::of(limit_key);
    let now_ms = millis(host.now());
    let update = cas::update(host, &slot.shared_key, |stored| {
        slot.granted(stored, granted, tuple, now_ms, expires_ms, batch)
    });
    match update {
        Update::Written if granted > 0 => host.lease_held(&slot, limit_key, limit),
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

/// A give-back as the worker sends it: seven values per bucket key.
pub const GIVE_BACK: Kind = Kind {
    script: &LEASE_RETURN,
    per_key: 7,
    what: "a lease give-back",
    lost: None,
    resend_for: None,
};

/// How often (ms) a worker's root looks at the slots it watches: often
/// enough that idle tokens are back within about [`lease::IDLE_MS`], rarely
/// enough that a tick every millisecond costs no shared-data reads.
pub const CHECK_MS: u64 = 20;

/// The lease slots one worker filled (by shared-data key: the limit key and
/// limit index), which its root watches to give their unspent tokens back.
/// Only the filler watches a slot: every slot with tokens was filled by some
/// worker, so no root scans all [`lease::SLOTS`] of them, and no spend pays
/// for a table insert.
#[derive(Debug, Default)]
pub struct Held {
    /// Shared-data key -> the slot (its key's digest: hashed once, when the
    /// grant landed), the limit key and the limit's index.
    slots: HashMap<String, (Slot, Vec<u8>, usize)>,
    checked_ms: u64,
}

impl Held {
    /// Watches `limit_key`'s slot (at most one entry per slot: a key that
    /// took a slot over replaces the one before, whose tokens lapsed).
    pub fn add(&mut self, slot: &Slot, limit_key: &[u8], limit: usize) {
        let known = self.slots.get(&slot.shared_key);
        if known.map(|(_, k, _)| k.as_slice()) != Some(limit_key) {
            let entry = (slot.clone(), limit_key.to_vec(), limit);
            self.slots.insert(slot.shared_key.clone(), entry);
        }
    }

    /// Nothing to watch: the root's tick may stop.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }
}

/// On the root's tick: takes out of every watched slot the tokens due back
/// (lease ending, or no spend for [`lease::IDLE_MS`]), with the spends'
/// compare-and-swap, and hands them to the worker's deferred calls, which
/// join them into one call per hash tag, sent this tick (the keys of one
/// tag live in one Redis Cluster slot; lua/lease_return.lua takes any
/// number of keys, up to the deferred calls' 256 a call).
/// Slots that hold nothing any more are forgotten. A give-back that fails
/// loses its tokens: under-admission, never over-admission.
///
/// `slow`: this is the slow tick that runs only for watched slots, which
/// looks every [`CHECK_MS`]. The millisecond tick that calls wait on (a
/// batch, a background fetch) looks at most once per [`lease::IDLE_MS`]:
/// a worker whose fast tick never stops still gives idle tokens back, and
/// the calls' ticks do not read every watched slot each time (nor, in the
/// cost gate, at instants that depend on the round's length).
pub fn give_back<H: Host>(host: &mut H, config: &Config, held: &mut Held, slow: bool) {
    let now_ms = millis(host.now());
    let every = if slow { CHECK_MS } else { lease::IDLE_MS };
    if now_ms < held.checked_ms.saturating_add(every) {
        return;
    }
    held.checked_ms = now_ms;
    held.slots.retain(|shared_key, (slot, limit_key, limit)| {
        let Some(l) = config.limits.get(*limit) else {
            return false;
        };
        let (
            Some(lease),
            Algorithm::TokenBucket {
                capacity,
                refill,
                period_ms,
            },
        ) = (l.lease, l.algorithm)
        else {
            return false;
        };
        let ending = lease::ENDING_MS.min(millis(lease.ttl) / 4);
        let mut taken = Err(true);
        let update = cas::update(host, shared_key, |stored| {
            taken = slot.take_all_back(stored, now_ms, lease::IDLE_MS, ending);
            taken.as_ref().ok().map(|(bytes, _)| bytes.clone())
        });
        match (update, taken) {
            (Update::Written, Ok((_, backs))) => {
                let tag = lease::tag_of(limit_key);
                // One give-back per tuple, in the slot's order: the deferred
                // calls keep it when they join them.
                for back in backs {
                    let args = back.args(capacity, refill, period_ms).to_vec();
                    let sent = host.defer(
                        GIVE_BACK,
                        &tag,
                        (vec![limit_key.clone()], args),
                        Duration::ZERO,
                    );
                    match sent {
                        Ok(()) => host.count_n(Counter::LeaseReturned, back.tokens),
                        Err(why) => log::warn!(
                            "redis-guard: cannot give {} leased tokens back (lost): {why}",
                            back.tokens
                        ),
                    }
                }
                false
            }
            // Lost every race: tried again at the next check.
            (Update::Contended, _) => true,
            (_, Err(watch)) => watch,
            (_, Ok(_)) => true,
        }
    });
}
