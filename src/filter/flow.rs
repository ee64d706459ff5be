//! One request's path through the filter, independent of proxy-wasm: the
//! order of the stages at each point of the stream's life, and which stage
//! owns each callout in flight. What each stage does is in [`super::stage`].
//!
//! Request side: the rate limits that apply and, for a request carrying an
//! idempotency key, the key's lock are decided by one script call (after the
//! body is read, since the fingerprint covers it). Response side: a locked
//! request's response is copied while it streams; its last chunk is held until
//! Redis has the COMPLETED record (or, if that write failed, the lock's
//! release), so a retry sent after the client saw the whole response is a
//! replay, or, its record lost, runs again: never a 409.

use std::rc::Rc;

use crate::breaker::Breakers;
use crate::config::{Config, FailureMode};
use crate::filter::call::{Budget, ScriptCall};
use crate::filter::owner::{Calls, Owner};
use crate::filter::stage::access_log::AccessLogStage;
use crate::filter::stage::batch::Verdict as BatchVerdict;
use crate::filter::stage::concurrency::Concurrency;
use crate::filter::stage::decision::{Decision, Step};
use crate::filter::stage::deny;
use crate::filter::stage::fallback::{self, Undecided};
use crate::filter::stage::idempotency::intake::{Intake, Ready};
use crate::filter::stage::idempotency::record::Record;
use crate::filter::stage::idempotency::replay::Replay;
use crate::filter::stage::idempotency::upload::UPLOAD_REPLY_LIMIT;
use crate::filter::stage::lease::{LeaseStage, Spend};
use crate::filter::stage::overlimit;
use crate::filter::stage::ratelimit::RateLimit;
use crate::filter::stage::usage::UsageStage;
use crate::filter::{Action, CalloutReply, ErrorKind, Host};
use crate::ratelimit::{parse_verdict, Verdict};
use crate::request::RequestLine;
use crate::response::{Completion, LocalReply};
use crate::scripts::RATELIMIT;
use crate::webdis::Reply;

pub struct Flow {
    config: Rc<Config>,
    calls: Calls,
    limits: RateLimit,
    slots: Concurrency,
    usage: UsageStage,
    lease: LeaseStage,
    decision: Decision,
    intake: Intake,
    record: Record,
    replay: Replay,
    log: AccessLogStage,
    /// When the client has the whole response.
    response: Completion,
    /// The stream is over (`on_stream_end` ran): Envoy may still hand a
    /// reply to its context until it deletes it, but the decision was given
    /// up and nothing may touch the stream any more.
    ended: bool,
    /// Nothing applies to the request (no limit, no idempotency key, no
    /// deny rule): nothing on the response side or at its end can act.
    inert: bool,
}

impl Flow {
    pub fn new(config: Rc<Config>, breakers: Rc<Breakers>) -> Flow {
        Flow {
            config,
            calls: Calls::default(),
            limits: RateLimit::default(),
            slots: Concurrency::default(),
            usage: UsageStage::default(),
            lease: LeaseStage::default(),
            decision: Decision::new(breakers),
            intake: Intake::default(),
            record: Record::default(),
            replay: Replay::default(),
            log: AccessLogStage::default(),
            response: Completion::default(),
            ended: false,
            inert: false,
        }
    }

    /// The stream is over: the host drops whatever would change it.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// The request went on with nothing applied to it: no later callback
    /// of the stream has anything to do, so the context may let the flow
    /// go (a request no limit applies to then costs the callbacks' dispatch
    /// alone).
    pub fn inert(&self) -> bool {
        self.inert
    }

    pub fn on_request_headers<H: Host>(&mut self, host: &mut H, end_of_stream: bool) -> Action {
        let config = Rc::clone(&self.config);
        let line = RequestLine::read_needed(host, config.needs);
        if let Err(reply) = deny::on_request(host, &config, &line) {
            self.log.verdict("denied");
            return answer_locally(host, &reply);
        }
        if let Err(reply) = self.limits.on_request(host, &config, &line) {
            self.log.verdict("refused");
            return answer_locally(host, &reply);
        }
        self.slots.on_request(host, &config, self.limits.plan());
        let reserving = self
            .usage
            .on_request(host, &config, self.limits.plan(), end_of_stream);
        let tag = self.limits.tag();
        match self
            .intake
            .on_request_headers(host, &config, &line, tag, end_of_stream)
        {
            Err(reply) => return self.refuse(host, &reply),
            Ok(ready) => {
                if let Some(keyed) = self.intake.keyed() {
                    self.record.arm(keyed.clone());
                }
                if ready == Ready::AfterBody || reserving {
                    return Action::Pause;
                }
            }
        }
        if self.limits.plan().is_empty() && self.intake.keyed().is_none() {
            self.inert = true;
            return Action::Continue;
        }
        self.decide(host)
    }

    pub fn on_request_body<H: Host>(
        &mut self,
        host: &mut H,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if !self.intake.reading() && !self.usage.reading() {
            return self.waiting_for_decision();
        }
        let config = Rc::clone(&self.config);
        let reserved =
            self.usage
                .on_request_body(host, &config, self.limits.plan(), body_size, end_of_stream);
        for (check, units) in reserved.unwrap_or_default() {
            self.limits.reserve(check, units);
        }
        let intake_ready = !self.intake.reading()
            || match self
                .intake
                .on_request_body(host, &config, body_size, end_of_stream)
            {
                Err(reply) => return self.refuse(host, &reply),
                Ok(ready) => ready,
            };
        if intake_ready && !self.usage.reading() {
            self.decide(host)
        } else {
            Action::Pause
        }
    }

    /// Trailers end a request whose body did not say end-of-stream: the body
    /// buffered so far is all of it.
    pub fn on_request_trailers<H: Host>(&mut self, host: &mut H) -> Action {
        if !self.intake.reading() && !self.usage.reading() {
            return self.waiting_for_decision();
        }
        let intake_max = if self.intake.reading() {
            self.intake.max_body(&self.config)
        } else {
            0
        };
        let max = intake_max.max(self.usage.request_max_body());
        let size = host.request_body(max.saturating_add(1)).len();
        self.on_request_body(host, size, true)
    }

    /// Answers the request from the filter once its body is being read:
    /// nothing reads on, so no later body callback starts a decision.
    fn refuse<H: Host>(&mut self, host: &mut H, reply: &LocalReply) -> Action {
        self.usage.stop_reading();
        self.log.verdict("refused");
        answer_locally(host, reply)
    }

    /// What a body piece or trailers get once nothing reads them: held
    /// while the decision is out, and while a replay fetches its stored
    /// body (a key that completed is answered, never run again: a Continue
    /// here would send the request upstream, since Envoy continues a
    /// stopped request when a later piece says so).
    fn waiting_for_decision(&self) -> Action {
        if self.decision.pending() || self.replay.fetching() {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    /// The first call for this request, unless this Envoy's lease or its
    /// over-limit cache already knows the answer, or the breaker is open.
    fn decide<H: Host>(&mut self, host: &mut H) -> Action {
        let config = Rc::clone(&self.config);
        // A keyed request may be a retry owed a replay, which comes before
        // any limit: only Redis can tell.
        if self.intake.keyed().is_none() {
            let plan = self.limits.plan();
            let leased = LeaseStage::leased_check(&config, plan);
            // Tokens this Envoy holds first: they left Redis already, so an
            // empty bucket there (and a cached rejection) does not void them.
            if let Some(i) = leased {
                if let Spend::Spent(prefetch) = self.lease.spend(host, &config, plan, i, false) {
                    self.lease.spent(host, &config, plan, i, prefetch);
                    self.log.verdict("leased");
                    return Action::Continue;
                }
            }
            if let Some(reply) = overlimit::cached(host, &config, plan) {
                self.log.verdict("cached_rejection");
                return answer_locally(host, &reply);
            }
            if let Some(i) = leased {
                if let Spend::Spent(prefetch) = self.lease.spend(host, &config, plan, i, true) {
                    self.lease.spent(host, &config, plan, i, prefetch);
                    self.log.verdict("leased");
                    return Action::Continue;
                }
            }
        }
        self.send_decision(host, false)
    }

    /// Sends the request's call (alone or in its worker's batch).
    fn send_decision<H: Host>(&mut self, host: &mut H, paused: bool) -> Action {
        let config = Rc::clone(&self.config);
        let budget = Decision::budget(host, &config.redis);
        let call = self.request_call(budget);
        // Keyed requests and lease fetches keep their own call: a keyed
        // request's reply may carry a whole stored response, and a lease
        // fetch is one per Envoy already.
        let batchable =
            config.redis.batch.is_some() && self.intake.keyed().is_none() && !self.lease.fetching();
        let tag = self.limits.tag().filter(|_| batchable);
        self.slots.asking();
        let step = self.decision.start(host, &config.redis, call, tag);
        self.on_step(host, step, paused)
    }

    /// The request's one script call: a lease fetch, or every limit and the
    /// idempotency acquire together.
    fn request_call(&self, budget: Budget) -> ScriptCall {
        let plan = self.limits.plan();
        self.lease
            .call(&self.config, plan, budget)
            .unwrap_or_else(|| {
                let args =
                    self.limits
                        .script_args(&self.config, self.intake.args(), self.slots.slot());
                ScriptCall::new(&RATELIMIT, args, budget)
            })
    }

    /// Follows the decision: `paused` tells whether the request waits on us
    /// (a callout) or is still in a callback.
    fn on_step<H: Host>(&mut self, host: &mut H, step: Step, paused: bool) -> Action {
        match step {
            Step::Sent(token) => {
                self.calls.expect(token, Owner::Decision);
                Action::Pause
            }
            Step::Waiting => Action::Pause,
            Step::Answered(reply) => {
                self.on_answer(host, &reply);
                Action::Pause
            }
            Step::Failed { failure, sent } => self.fail(host, failure, sent, paused),
        }
    }

    /// The failure mode of everything this request is subject to: deny if
    /// any enforced limit or its idempotency rule says deny.
    fn failure_mode(&self) -> FailureMode {
        match self.intake.failure_mode(&self.config) {
            Some(FailureMode::Deny) => FailureMode::Deny,
            _ => self.limits.failure_mode(&self.config),
        }
    }

    /// Redis could not decide: give back what the call may have taken, then
    /// apply the failure mode.
    fn fail<H: Host>(
        &mut self,
        host: &mut H,
        (kind, why): (ErrorKind, String),
        sent: bool,
        paused: bool,
    ) -> Action {
        let config = Rc::clone(&self.config);
        self.lease.abandon(host, self.limits.plan());
        self.slots.on_failed(sent);
        let level = self.decision.count_failure(host, kind);
        let keyed = self.intake.keyed().is_some();
        if sent && keyed {
            // The script may have run (timeout, reset) and taken our lock:
            // release it (only if ours) so retries are not answered 409.
            self.record.release(host, &config, true);
        }
        let mode = self.failure_mode();
        self.log.failure(mode);
        if keyed && mode != FailureMode::Deny {
            self.log.unguarded();
        }
        let undecided = Undecided {
            mode,
            why: &why,
            level,
            keyed,
            paused,
        };
        fallback::apply(host, &config, &self.limits.plan().checks, undecided)
    }

    /// Redis answered the request's call.
    fn on_answer<H: Host>(&mut self, host: &mut H, reply: &Reply) {
        let config = Rc::clone(&self.config);
        let plan = self.limits.plan();
        let verdict = if self.lease.fetching() {
            let sent_at = self.decision.sent_at();
            self.lease
                .on_answer(host, &config, plan, sent_at, reply)
                .map(Verdict::Limits)
        } else {
            parse_verdict(reply, plan.checks.len())
        };
        let verdict = match verdict {
            Ok(v) => v,
            // The key completed but its record cannot be read. Redis itself
            // answered, so the breaker learns nothing bad.
            Err(e) if completed_reply(reply) => {
                self.decision.succeeded(host, false);
                self.slots.not_taken();
                return self.replay.unreadable(host, &e);
            }
            Err(e) => {
                let why = format!("unexpected script reply: {e}");
                self.fail(host, (ErrorKind::Reply, why), true, true);
                return;
            }
        };
        self.decision.succeeded(host, true);
        if let Verdict::Anchors(moved) = &verdict {
            // Nothing was decided: the quota stage moves the windows, the
            // request goes again.
            if self.limits.on_anchors(host, &config, moved) {
                self.send_decision(host, true);
            } else {
                let why = format!("a stored override moved a quota's anchor day again: {moved:?}");
                self.fail(host, (ErrorKind::Reply, why), false, true);
            }
            return;
        }
        match &verdict {
            Verdict::Limits(outcome) => {
                self.log.limits(&config, self.limits.plan(), outcome);
                self.slots.on_outcome(host, self.limits.plan(), outcome);
                let sent_at = self.decision.sent_at();
                self.usage
                    .on_outcome(&config, self.limits.plan(), outcome, sent_at);
            }
            _ => self.slots.not_taken(),
        }
        match verdict {
            Verdict::Limits(outcome) => match self.limits.on_outcome(host, &config, &outcome) {
                Ok(()) => {
                    self.record.acquired(host);
                    host.resume_request();
                }
                Err(too_many) => {
                    let sent_at = self.decision.sent_at();
                    overlimit::remember(host, &config, self.limits.plan(), &outcome, sent_at);
                    host.send_local(&too_many);
                }
            },
            Verdict::Busy { .. } => {
                self.log.verdict("conflict");
                self.replay.busy(host)
            }
            Verdict::Mismatch => {
                self.log.verdict("mismatch");
                self.replay.mismatch(host)
            }
            Verdict::Replay {
                status,
                headers,
                body,
                object,
            } => {
                let stored = (status, headers, body, object);
                self.replay.replay(host, &config, &mut self.calls, stored);
            }
            Verdict::Anchors(_) => {}
        }
    }

    /// The verdict of the batch this request rode.
    pub fn on_batch_verdict<H: Host>(&mut self, host: &mut H, verdict: BatchVerdict) {
        if self.ended {
            return;
        }
        let step = self.decision.on_batch_verdict(verdict);
        self.on_step(host, step, true);
    }

    /// A wake-up the request asked for: the pause after a refusal is over
    /// (send the call again), or its slots' leases are due for renewal.
    pub fn on_wake<H: Host>(&mut self, host: &mut H) {
        if self.ended {
            return;
        }
        let config = Rc::clone(&self.config);
        if let Some(step) = self.decision.on_retry_due(host, &config.redis) {
            self.on_step(host, step, true);
        }
        self.slots.on_wake(host, &config, &mut self.calls);
    }

    /// Hands a callout's reply to the stage that sent the call; replies to
    /// calls this request no longer waits for are dropped, and so is a
    /// decision that comes after the stream ended: it was given up then
    /// (the lease's claim, the breaker's probe), and read now it would count
    /// as Redis' failure or answer a stream that is gone.
    pub fn on_callout_reply<H: Host>(&mut self, host: &mut H, token: u32, reply: CalloutReply) {
        let config = Rc::clone(&self.config);
        match self.calls.take(token) {
            Some(Owner::Decision) if self.ended => {}
            Some(Owner::Decision) => {
                let step = self.decision.on_reply(host, &config.redis, &reply);
                self.on_step(host, step, true);
            }
            Some(Owner::Record) => self.record.on_reply(host, &config, &mut self.calls, &reply),
            Some(Owner::Upload) => {
                self.record
                    .on_upload_reply(host, &config, &mut self.calls, &reply)
            }
            Some(Owner::Replay) => self.replay.on_reply(host, reply),
            Some(Owner::Slots) => {
                self.slots
                    .on_reply(host, &config, &mut self.calls, token, &reply)
            }
            None => {}
        }
    }

    /// How much of the answer to `token` the host should read into the VM:
    /// an object fetch needs exactly the stored length, an upload's answer
    /// is a short status document. Redis replies are read whole: a record
    /// cut short must not look like a failure that forwards a completed key.
    pub fn reply_limit(&self, token: u32) -> usize {
        match self.calls.owner(token) {
            Some(Owner::Replay) => self.replay.reply_limit(),
            Some(Owner::Upload) => UPLOAD_REPLY_LIMIT,
            _ => usize::MAX,
        }
    }

    pub fn on_response_headers<H: Host>(&mut self, host: &mut H, end_of_stream: bool) -> Action {
        if let Some(action) = self.replay.on_response_headers(host, end_of_stream) {
            return action;
        }
        self.limits.on_response_headers(host);
        let config = Rc::clone(&self.config);
        self.usage.on_response_headers(host, &config, end_of_stream);
        let action = self
            .record
            .on_response_headers(host, &config, &mut self.calls, end_of_stream);
        // Only a held concurrency slot acts on the response's completion:
        // other responses are not asked for their length.
        let complete = if self.slots.held() {
            let length = host
                .response_header("content-length")
                .and_then(|v| crate::response::content_length(&v));
            self.response.headers(length, end_of_stream)
        } else {
            end_of_stream
        };
        self.on_response_part(host, action, complete)
    }

    /// After the record stage saw a piece of the response: when it
    /// completes the response, the concurrency slots go back (the piece
    /// waits for that unless the record already holds it).
    fn on_response_part<H: Host>(
        &mut self,
        host: &mut H,
        record: Action,
        complete: bool,
    ) -> Action {
        if !complete {
            // What follows a held piece waits with it (Envoy hands the
            // filter the rest, end of stream included, while it holds).
            return if self.slots.holding() {
                Action::Pause
            } else {
                record
            };
        }
        let config = Rc::clone(&self.config);
        // A keyed request's record may hold this piece, or one after it:
        // then the release does not hold it too (one resume would let it go).
        let hold = record == Action::Continue && self.intake.keyed().is_none();
        match self
            .slots
            .on_response_end(host, &config, &mut self.calls, hold)
        {
            Action::Pause => Action::Pause,
            Action::Continue => record,
        }
    }

    pub fn on_response_body<H: Host>(
        &mut self,
        host: &mut H,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if let Some(action) = self.replay.on_response_body(host, body_size, end_of_stream) {
            return action;
        }
        let config = Rc::clone(&self.config);
        self.usage.on_response_body(host, body_size, end_of_stream);
        let action =
            self.record
                .on_response_body(host, &config, &mut self.calls, body_size, end_of_stream);
        let complete = self.response.body(body_size, end_of_stream);
        self.on_response_part(host, action, complete)
    }

    pub fn on_response_trailers<H: Host>(&mut self, host: &mut H) -> Action {
        let config = Rc::clone(&self.config);
        self.usage.on_response_trailers(host, &config);
        let action = self
            .record
            .on_response_trailers(host, &config, &mut self.calls);
        let complete = self.response.trailers();
        self.on_response_part(host, action, complete)
    }

    /// The stream is over (done, reset or aborted): what this request held
    /// for others (its lock, its concurrency slots, the breaker's probe, a
    /// lease fetch's claim) must not stay held.
    pub fn on_stream_end<H: Host>(&mut self, host: &mut H) {
        let config = Rc::clone(&self.config);
        self.record.on_stream_end(host);
        self.slots.on_stream_end(host, &config);
        self.usage.on_stream_end(host, &config);
        if self.decision.on_stream_end(host) {
            self.lease.abandon(host, self.limits.plan());
        }
        // A replay's verdict is what the client got, known only now.
        if let Some(verdict) = self.replay.verdict() {
            self.log.verdict(verdict);
        }
        self.log.on_stream_end(host, &config, self.record.outcome());
        self.ended = true;
    }
}

/// Answers the request from the filter: it never reaches the upstream.
fn answer_locally<H: Host>(host: &mut H, reply: &LocalReply) -> Action {
    host.send_local(reply);
    Action::Pause
}

/// The request script said "completed" (verdict 3), whatever else it said.
fn completed_reply(reply: &Reply) -> bool {
    matches!(reply, Reply::Array(Some(items)) if items.first().and_then(Reply::as_int) == Some(3))
}
