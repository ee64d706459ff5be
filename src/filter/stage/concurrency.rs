//! The concurrency stage: the request's slots in its concurrency limits. The
//! decision takes them (with every other limit, all or nothing); this stage
//! renews their leases while the request runs and gives them back when its
//! stream ends in any way, from the root context so the release outlives
//! the stream.

use std::time::Duration;

use crate::concurrency::Slots;
use crate::config::Config;
use crate::filter::call::{Answer, Budget, ScriptCall};
use crate::filter::flow::{Calls, Owner};
use crate::filter::{CalloutReply, Counter, Host};
use crate::ratelimit::{Outcome, Plan};
use crate::scripts::{CC_RELEASE, CC_RENEW};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum State {
    /// No concurrency limit applies, or the request took no slot.
    #[default]
    None,
    /// Limits apply; no call that could take a slot has left yet.
    Planned,
    /// The decision's call left: its script may have taken the slots.
    Asked,
    /// The decision took them: renewed until the stream ends.
    Held,
    /// Given back (or never taken): nothing more to do.
    Done,
}

#[derive(Debug, Default)]
pub struct Concurrency {
    slots: Option<Slots>,
    state: State,
    /// The renewal in flight (its answer may send it again after NOSCRIPT).
    renewal: Option<ScriptCall>,
    /// When the next renewal is due, on the host's clock.
    due: Duration,
}

impl Concurrency {
    /// Names the request's slot when a concurrency limit applies: a slot id
    /// no other request of any Envoy has.
    pub fn on_request<H: Host>(&mut self, host: &mut H, config: &Config, plan: &Plan) {
        self.slots = Slots::of_plan(config, plan, || host.unique_token());
        if self.slots.is_some() {
            self.state = State::Planned;
        }
    }

    /// The slot id the decision takes the slots under.
    pub fn slot(&self) -> Option<&str> {
        self.slots.as_ref().map(|s| s.id.as_str())
    }

    /// The decision's call is leaving: from now on its script may take the
    /// slots, so the stream's end gives them back.
    pub fn asking(&mut self) {
        if self.state == State::Planned {
            self.state = State::Asked;
        }
    }

    /// The decision failed. If its call never left, nothing was taken; if it
    /// did (a timeout, a reset), the script may have run: the stream's end
    /// gives back what it may hold.
    pub fn on_failed(&mut self, sent: bool) {
        if !sent && self.state == State::Asked {
            self.state = State::Done;
        }
    }

    /// Redis answered without deciding the limits (a replay, a conflict):
    /// no slot was taken.
    pub fn not_taken(&mut self) {
        if self.state == State::Asked {
            self.state = State::Done;
        }
    }

    /// Redis decided the limits: an admitted request holds the slots of the
    /// limits that admitted it, renewed every third of the shortest lease.
    pub fn on_outcome<H: Host>(&mut self, host: &mut H, plan: &Plan, outcome: &Outcome) {
        if self.state != State::Asked {
            return;
        }
        let Some(slots) = self.slots.as_mut() else {
            return;
        };
        if !slots.keep_taken(plan, outcome) {
            self.state = State::Done;
            return;
        }
        self.state = State::Held;
        let every = slots.renew_every();
        self.due = host.now() + every;
        if !host.wake_later(every) {
            log::warn!(
                "redis-guard: cannot schedule a slot renewal: the request's slot ends with its lease"
            );
        }
    }

    /// A wake-up: renews the leases when due (at most one renewal in flight)
    /// and schedules the next.
    pub fn on_wake<H: Host>(&mut self, host: &mut H, config: &Config, calls: &mut Calls) {
        if self.state != State::Held || host.now() < self.due {
            return;
        }
        let Some(slots) = self.slots.as_ref() else {
            return;
        };
        let every = slots.renew_every();
        if self.renewal.is_none() {
            let budget = Budget::Each(config.redis.timeout);
            let call = ScriptCall::new(&CC_RENEW, slots.renew_args(), budget);
            match call.send(host, &config.redis) {
                Ok(token) => {
                    calls.expect(token, Owner::Slots);
                    self.renewal = Some(call);
                }
                Err((_, why)) => log::warn!("redis-guard: cannot renew slot leases: {why}"),
            }
        }
        self.due = host.now() + every;
        host.wake_later(every);
    }

    /// The answer to a renewal.
    pub fn on_reply<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
        reply: &CalloutReply,
    ) {
        let Some(call) = self.renewal.as_mut() else {
            return;
        };
        let answer = call.answer(host, &config.redis, reply);
        if let Answer::Resent(token) = answer {
            calls.expect(token, Owner::Slots);
            return;
        }
        self.renewal = None;
        let Some(slots) = self.slots.as_mut() else {
            return;
        };
        match answer {
            Answer::Ran(reply) => match slots.on_renewed(&reply) {
                Ok(lost) => {
                    host.count(Counter::SlotsRenewed);
                    for limit in lost {
                        log::warn!(
                            "redis-guard: concurrency slot in `{}` lost before its renewal (Redis unreachable for longer than its lease); the request runs on uncounted",
                            config.limits[limit].name
                        );
                        host.count(Counter::SlotsLost);
                    }
                    if slots.held.is_empty() {
                        self.state = State::Done;
                    }
                }
                Err(why) => log::warn!("redis-guard: slot renewal: {why}"),
            },
            // The next renewal tries again: a lease outlives two failures.
            Answer::Refused((_, why)) | Answer::Failed((_, why)) => {
                log::warn!("redis-guard: slot renewal failed: {why}")
            }
            Answer::Resent(_) => {}
        }
    }

    /// The stream is over, however it ended: gives back what the request
    /// holds or may hold, as the root context (the stream is going away).
    /// The script is sent whole: nobody reads the answer to fall back on
    /// after a NOSCRIPT. A slot that cannot be given back ends with its lease.
    pub fn on_stream_end<H: Host>(&mut self, host: &mut H, config: &Config) {
        if !matches!(self.state, State::Asked | State::Held) {
            return;
        }
        self.state = State::Done;
        let Some(slots) = self.slots.as_ref() else {
            return;
        };
        let call = ScriptCall::new(
            &CC_RELEASE,
            slots.release_args(),
            Budget::Each(config.redis.timeout),
        );
        match call.with_source().send_detached(host, &config.redis) {
            Ok(_) => host.count(Counter::SlotsReleased),
            Err((_, why)) => log::warn!(
                "redis-guard: cannot release concurrency slots (they end with their lease): {why}"
            ),
        }
    }
}
