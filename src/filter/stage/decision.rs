//! The decision stage: the request's one script call, its retries after a
//! refusal, and the circuit breaker that keeps a dead Redis from costing
//! every request its timeout.

use std::rc::Rc;
use std::time::Duration;

use crate::breaker::{Breaker, Breakers};
use crate::config::RedisTarget;
use crate::filter::call::{Answer, Budget, Failure, ScriptCall};
use crate::filter::handoff::Member;
use crate::filter::retry::{pause_before, tell_breaker, MAX_PAUSES};
use crate::filter::stage::batch::Verdict as BatchVerdict;
use crate::filter::{CalloutReply, Counter, ErrorKind, Host};
use crate::webdis::Reply;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Idle,
    /// The call is out; its reply is owned by this stage.
    Sent,
    /// Refused before it ran: the same call goes again after a pause.
    Waiting,
    Done,
}

/// What became of the decision.
#[derive(Debug)]
pub enum Step {
    /// A call left under this token (first, retried, or EVAL after NOSCRIPT).
    Sent(u32),
    /// Waiting out a pause before the next attempt.
    Waiting,
    /// Redis answered.
    Answered(Reply),
    /// Redis could not decide. `sent`: a call had left whose script may
    /// have run (a timeout, a reset), so what it took must be given back.
    Failed { failure: Failure, sent: bool },
}

pub struct Decision {
    /// The worker's breakers, one per slot group.
    breakers: Rc<Breakers>,
    /// The breaker of this request's slot group, from its call's start.
    breaker: Rc<Breaker>,
    call: Option<ScriptCall>,
    state: State,
    /// The single immediate retry (when the host cannot pause) was spent.
    retried: bool,
    /// Pauses taken after refusals.
    pauses: u8,
    /// When the call being answered left: the over-limit cache and a lease
    /// count from it.
    sent_at: Duration,
    /// This request is the open breaker's probe.
    probe: bool,
    /// The breaker sent this request to its failure mode without a call.
    short_circuited: bool,
    /// The decision rides a batch: the batch tells the breaker, once.
    batched: bool,
    /// The hash tag whose batch group this request's own call holds (it
    /// found its worker quiet and went alone): released when the call is
    /// over, so what queued behind it leaves.
    alone: Option<String>,
}

impl Decision {
    pub fn new(breakers: Rc<Breakers>) -> Decision {
        Decision {
            breaker: breakers.for_tag(None),
            breakers,
            call: None,
            state: State::Idle,
            retried: false,
            pauses: 0,
            sent_at: Duration::ZERO,
            probe: false,
            short_circuited: false,
            batched: false,
            alone: None,
        }
    }

    /// The request's deadline: every attempt shares the one configured
    /// timeout, counted from now.
    pub fn budget<H: Host>(host: &H, target: &RedisTarget) -> Budget {
        Budget::Until(host.now() + target.timeout)
    }

    /// Sends the call, unless the breaker of its slot group (the slot of its
    /// first key, which every key of it shares) is open. With `tag`, the
    /// call joins the worker's batch of that hash tag instead; a probe of an
    /// open breaker goes alone, so that one request tests Redis.
    pub fn start<H: Host>(
        &mut self,
        host: &mut H,
        target: &RedisTarget,
        call: ScriptCall,
        tag: Option<&str>,
    ) -> Step {
        self.breaker = self.breakers.for_key(call.first_key());
        // A request sent again (a quota's anchor moved) may go otherwise
        // than its first call did.
        self.batched = false;
        let now = host.now();
        let tripped = self.breaker.tripped();
        if !self.breaker.allow(now) {
            self.short_circuited = true;
            host.count(Counter::CircuitShortCircuited);
            return self.failed((ErrorKind::Dispatch, "circuit breaker open".to_string()));
        }
        self.probe = tripped;
        match tag {
            // A quiet worker: nothing to wait for, the call leaves now from
            // this stream, as a single call (its reply, retries and failure
            // are this stage's, as with batching off).
            Some(tag) if !tripped && host.batch_alone(tag) => {
                self.alone = Some(tag.to_string());
                self.call = Some(call);
                let step = self.send(host, target);
                if matches!(step, Step::Sent(_)) {
                    host.count(Counter::BatchAlone);
                }
                self.settle(host, step)
            }
            Some(tag) if !tripped => self.join(host, target, call, tag),
            _ => {
                self.call = Some(call);
                self.send(host, target)
            }
        }
    }

    /// Releases the batch group a lone call held once the decision is over.
    fn settle<H: Host>(&mut self, host: &mut H, step: Step) -> Step {
        if matches!(step, Step::Answered(_) | Step::Failed { .. }) {
            if let Some(tag) = self.alone.take() {
                host.batch_release(&tag);
            }
        }
        step
    }

    fn join<H: Host>(
        &mut self,
        host: &mut H,
        target: &RedisTarget,
        call: ScriptCall,
        tag: &str,
    ) -> Step {
        let deadline = match call.budget() {
            Budget::Until(deadline) => deadline,
            Budget::Each(timeout) => host.now() + timeout,
        };
        let member = Member {
            tag: tag.to_string(),
            args: call.into_args(),
            deadline,
        };
        self.sent_at = host.now();
        self.batched = true;
        match host.join_batch(target, member) {
            Ok(()) => {
                self.state = State::Sent;
                Step::Waiting
            }
            Err(failure) => self.failed(failure),
        }
    }

    /// The batch this request rode answered (or failed) for it.
    pub fn on_batch_verdict(&mut self, verdict: BatchVerdict) -> Step {
        if self.state != State::Sent || !self.batched {
            return Step::Waiting;
        }
        match verdict {
            BatchVerdict::Ran(reply) => {
                self.state = State::Done;
                Step::Answered(reply)
            }
            BatchVerdict::Failed(failure) => self.failed(failure),
        }
    }

    fn send<H: Host>(&mut self, host: &mut H, target: &RedisTarget) -> Step {
        let Some(call) = &self.call else {
            return self.failed((ErrorKind::Dispatch, "no call".to_string()));
        };
        self.sent_at = host.now();
        match call.send(host, target) {
            Ok(token) => {
                self.state = State::Sent;
                Step::Sent(token)
            }
            Err(failure) => self.failed(failure),
        }
    }

    fn failed(&mut self, failure: Failure) -> Step {
        let sent = self.state == State::Sent;
        self.state = State::Done;
        Step::Failed { failure, sent }
    }

    /// The call is out or waiting to go again: the request must wait.
    pub fn pending(&self) -> bool {
        matches!(self.state, State::Sent | State::Waiting)
    }

    pub fn sent_at(&self) -> Duration {
        self.sent_at
    }

    pub fn on_reply<H: Host>(
        &mut self,
        host: &mut H,
        target: &RedisTarget,
        reply: &CalloutReply,
    ) -> Step {
        let Some(call) = self.call.as_mut() else {
            return Step::Waiting;
        };
        let step = match call.answer(host, target, reply) {
            Answer::Ran(reply) => {
                self.state = State::Done;
                Step::Answered(reply)
            }
            Answer::Resent(token) => {
                self.sent_at = host.now();
                Step::Sent(token)
            }
            Answer::Refused(failure) => self.retry(host, target, failure),
            Answer::Failed(failure) => self.failed(failure),
        };
        self.settle(host, step)
    }

    /// A call refused before it ran: sent again after a pause, up to
    /// MAX_PAUSES times within the timeout, or at once, once, if the host
    /// cannot wait; then `exhausted`.
    fn retry<H: Host>(&mut self, host: &mut H, target: &RedisTarget, exhausted: Failure) -> Step {
        let deadline = match self.call.as_ref().map(|c| c.budget()) {
            Some(Budget::Until(deadline)) => deadline,
            _ => Duration::ZERO,
        };
        let left = deadline.saturating_sub(host.now());
        let pause = pause_before(self.pauses);
        if self.pauses < MAX_PAUSES && left > pause && host.wake_later(pause) {
            host.count(Counter::RedisRetries);
            self.pauses += 1;
            self.state = State::Waiting;
            Step::Waiting
        } else if !self.retried {
            host.count(Counter::RedisRetries);
            self.retried = true;
            self.send(host, target)
        } else {
            self.failed(exhausted)
        }
    }

    /// The pause after a refusal is over: send the call again.
    pub fn on_retry_due<H: Host>(&mut self, host: &mut H, target: &RedisTarget) -> Option<Step> {
        if self.state != State::Waiting {
            return None;
        }
        self.retried = true;
        let step = self.send(host, target);
        Some(self.settle(host, step))
    }

    /// Tells the breaker Redis answered.
    pub fn succeeded<H: Host>(&self, host: &mut H, log_it: bool) {
        if self.breaker.success() {
            if log_it {
                log::info!("redis-guard: circuit breaker closed: Redis answers again");
            }
            host.count(Counter::CircuitClosed);
        }
    }

    /// Counts a failure (one a call met, not the open breaker's) and tells
    /// the breaker; returns the level to log it at: one line per burst of
    /// failures (the first since a success), every request still counted.
    pub fn count_failure<H: Host>(&self, host: &mut H, kind: ErrorKind) -> log::Level {
        if !self.short_circuited {
            host.count(Counter::RedisError(kind));
            if !self.batched {
                tell_breaker(host, &self.breaker);
            }
        }
        if self.breaker.consecutive_failures() <= 1 && !self.short_circuited {
            log::Level::Warn
        } else {
            log::Level::Debug
        }
    }

    /// The pending decision rides a batch (its answer comes from the worker).
    pub fn batched(&self) -> bool {
        self.batched
    }

    /// The stream is gone: a probe whose answer will find no one must not
    /// keep the breaker waiting for it, nor a lone call the requests queued
    /// behind it (the host cancels a gone stream's calls: no reply will
    /// release them). True if the call was pending.
    pub fn on_stream_end<H: Host>(&mut self, host: &mut H) -> bool {
        let pending = self.pending();
        if pending && self.probe {
            self.breaker.abandon_probe();
        }
        if let Some(tag) = self.alone.take() {
            host.batch_release(&tag);
        }
        pending
    }
}
