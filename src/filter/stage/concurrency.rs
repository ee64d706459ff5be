//! The concurrency stage: the request's slots in its concurrency limits. The
//! decision takes them (with every other limit, all or nothing); this stage
//! renews their leases while the request runs and gives them back when its
//! stream ends in any way. The release is the worker's ([`Releases`]): its
//! root sends the releases of every stream that ended since its last tick
//! as one call, so it outlives the stream and costs a request a fraction of
//! a call.

use std::time::Duration;

use crate::concurrency::Slots;
use crate::config::Config;
use crate::filter::call::{Answer, Budget, ScriptCall};
use crate::filter::deferred::Kind;
use crate::filter::owner::{Calls, Owner};
use crate::filter::{Action, CalloutReply, Counter, Host};
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
    /// The decision took them: renewed until the response ends.
    Held,
    /// The response ended: the release is out (its last piece may wait
    /// for it).
    Releasing,
    /// Given back (or never taken): nothing more to do.
    Done,
}

#[derive(Debug, Default)]
pub struct Concurrency {
    slots: Option<Slots>,
    /// The request's hash tag: its release joins those of that tag.
    tag: String,
    state: State,
    /// The renewal in flight, by token (its answer may send it again after
    /// NOSCRIPT).
    renewal: Option<(u32, ScriptCall)>,
    /// The release sent as the response ended, by token, and whether the
    /// response's last piece waits for it.
    release: Option<(u32, ScriptCall, bool)>,
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
            self.tag = plan.tag.clone().unwrap_or_default();
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
    /// limits that admitted it, renewed every quarter of the shortest lease.
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
                    self.renewal = Some((token, call));
                }
                Err((_, why)) => log::warn!("redis-guard: cannot renew slot leases: {why}"),
            }
        }
        self.due = host.now() + every;
        host.wake_later(every);
    }

    /// The response's last piece is here: the upstream is done with the
    /// request, so its slots go back now. With `hold`, that piece waits for
    /// the release, so a client that sends its next request once it has the
    /// whole response never finds its own slot still taken (`Pause`). The
    /// flow passes `hold` false where another stage may hold the piece (a
    /// keyed request: two stages resuming one response would let it go at
    /// the first); only enforced slots are worth the wait (a shadow limit
    /// never rejects). A request whose decision failed (it may hold a slot)
    /// releases at its stream's end instead (see `on_stream_end`).
    pub fn on_response_end<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
        hold: bool,
    ) -> Action {
        if self.state != State::Held {
            return Action::Continue;
        }
        let Some(slots) = self.slots.as_ref() else {
            return Action::Continue;
        };
        let hold = hold && slots.held.iter().any(|h| h.enforced);
        let budget = Budget::Each(config.redis.timeout);
        let call = ScriptCall::new(&CC_RELEASE, slots.release_args(), budget);
        match call.send(host, &config.redis) {
            Ok(token) => {
                calls.expect(token, Owner::Slots);
                host.count(Counter::SlotsReleased);
                self.state = State::Releasing;
                self.release = Some((token, call, hold));
                if hold {
                    Action::Pause
                } else {
                    Action::Continue
                }
            }
            Err((_, why)) => {
                log::debug!("redis-guard: releasing slots through the worker: {why}");
                self.release_through_worker(host, config, Duration::ZERO);
                Action::Continue
            }
        }
    }

    /// The request holds slots the response's completion gives back.
    pub fn held(&self) -> bool {
        self.state == State::Held
    }

    /// The response's end waits for the release.
    pub fn holding(&self) -> bool {
        matches!(self.release, Some((_, _, true)))
    }

    /// The answer to a renewal or to the release.
    pub fn on_reply<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
        token: u32,
        reply: &CalloutReply,
    ) {
        if let Some((t, call, held)) = self.release.as_mut() {
            if *t == token {
                let held = *held;
                match call.answer(host, &config.redis, reply) {
                    Answer::Resent(token) => {
                        *t = token;
                        calls.expect(token, Owner::Slots);
                        return;
                    }
                    Answer::Ran(_) => self.state = State::Done,
                    Answer::Refused((_, why)) | Answer::Failed((_, why)) => {
                        // The worker tries once more; the lease ends it
                        // otherwise.
                        log::warn!("redis-guard: slot release failed: {why}");
                        self.state = State::Held;
                        self.on_stream_end_queued(host);
                    }
                }
                self.release = None;
                if held {
                    host.resume_response();
                }
                return;
            }
        }
        let Some((t, call)) = self.renewal.as_mut() else {
            return;
        };
        if *t != token {
            return;
        }
        let answer = call.answer(host, &config.redis, reply);
        if let Answer::Resent(token) = answer {
            *t = token;
            calls.expect(token, Owner::Slots);
            return;
        }
        self.renewal = None;
        if self.state != State::Held {
            return;
        }
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
            // The next renewal tries again: a lease outlives two failed renewals.
            Answer::Refused((_, why)) | Answer::Failed((_, why)) => {
                log::warn!("redis-guard: slot renewal failed: {why}")
            }
            Answer::Resent(_) => {}
        }
    }

    /// A release that failed goes to the worker, not counted twice.
    fn on_stream_end_queued<H: Host>(&mut self, host: &mut H) {
        self.state = State::Done;
        if let Some(slots) = self.slots.as_ref() {
            let now = Duration::ZERO;
            if let Err(why) = host.defer(RELEASE, &self.tag, slots.release_args(), now) {
                log::warn!(
                    "redis-guard: cannot release concurrency slots (they end with their lease): {why}"
                );
            }
        }
    }

    /// The stream is over, however it ended: gives back what the request
    /// may hold but no upstream is working on, or what a release still out
    /// may not have given back (the host cancels a gone stream's calls).
    ///
    /// A request whose decision failed after its call left (a timeout, a
    /// reset) never reached the upstream: it is released once that call can
    /// no longer run (`timeoutMs` later, plus a margin), since a release
    /// sent first would find nothing and the late script would take a slot
    /// nobody gives back.
    ///
    /// A request that was forwarded and whose response never completed (its
    /// client left, or the response was cut off) keeps its slots until their
    /// lease ends: a slot stands for the upstream's work, and the upstream
    /// may still be running the request (an HTTP/1.1 server learns its
    /// client left only when it writes). Released here, a new request would
    /// run beside it, over the limit. The renewals stop with the stream, so
    /// the slot ends at most `leaseMs` after its last renewal.
    pub fn on_stream_end<H: Host>(&mut self, host: &mut H, config: &Config) {
        match self.state {
            State::Releasing => {
                self.release = None;
                self.on_stream_end_queued(host)
            }
            State::Asked => {
                let after = config.redis.timeout + LATE_CALL_MARGIN;
                self.release_through_worker(host, config, after)
            }
            State::Held => {
                self.state = State::Done;
                if self.slots.is_some() {
                    log::info!(
                        "redis-guard: response not completed (client left or stream reset): concurrency slots kept until their lease ends"
                    );
                    host.count(Counter::SlotsAbandoned);
                }
            }
            _ => {}
        }
    }

    /// Gives the slots back through the worker's root (the stream is going
    /// away), `after` from now. Without a worker to take it, the release
    /// goes at once as the root context, the script whole, since nobody
    /// reads the answer to fall back on after a NOSCRIPT. A slot that cannot
    /// be given back ends with its lease.
    fn release_through_worker<H: Host>(&mut self, host: &mut H, config: &Config, after: Duration) {
        self.state = State::Done;
        let Some(slots) = self.slots.as_ref() else {
            return;
        };
        let queued = host.defer(RELEASE, &self.tag, slots.release_args(), after);
        let sent = queued.or_else(|why| {
            log::debug!("redis-guard: releasing slots from the stream: {why}");
            let budget = Budget::Each(config.redis.timeout);
            let call = ScriptCall::new(&CC_RELEASE, slots.release_args(), budget);
            call.with_source()
                .send_detached(host, &config.redis)
                .map(|_| ())
                .map_err(|(_, why)| why)
        });
        match sent {
            Ok(()) => host.count(Counter::SlotsReleased),
            Err(why) => log::warn!(
                "redis-guard: cannot release concurrency slots (they end with their lease): {why}"
            ),
        }
    }
}

/// A release as the worker sends it: a slot id and a cost per key.
pub const RELEASE: Kind = Kind {
    script: &CC_RELEASE,
    per_key: 2,
    what: "the release of concurrency slots",
    lost: None,
    resend_for: None,
};

/// How long past its timeout a decision's call is still taken to be able to
/// run (it may sit in Webdis' or Redis' queue when Envoy gives up on it).
pub const LATE_CALL_MARGIN: Duration = Duration::from_millis(100);
