//! The batch stage: one worker's decisions grouped into calls (group
//! commit). While a group's calls are out, its requests queue; each reply
//! sends what queued meanwhile as one call of lua/batch.lua. With nothing
//! out, a request's call leaves at once, so a quiet worker adds no wait.
//!
//! A group is one hash tag, so every call still touches one slot. Calls are
//! the worker's, not a request's: the proxy sends them from its root
//! context (woken through a shared queue), so their replies come to the
//! root and a client that leaves cancels nothing.

use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use crate::batch::{pack, split_reply};
use crate::breaker::Breakers;
use crate::config::{Batch, RedisTarget};
use crate::filter::call::{Answer, Budget, Failure, ScriptCall};
use crate::filter::counter::Histogram;
use crate::filter::handoff::Member;
use crate::filter::retry::{pause_before, tell_breaker, MAX_PAUSES};
use crate::filter::{CalloutReply, Counter, ErrorKind, Host};
use crate::ratelimit::ScriptArgs;
use crate::scripts::BATCH;
use crate::webdis::Reply;

/// Who a member is, for the host: its stream. A stream that is gone is
/// dropped from the batch it waits for.
pub trait Waiter: Clone {
    fn gone(&self) -> bool;
}

/// What a member's request learns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Its own reply, as its single call would have had it.
    Ran(Reply),
    /// The batch failed, or the script refused this member alone (its lone
    /// call would have had an error reply: a quota's edges past Redis'
    /// clock): the member applies its own failure mode. The breaker has
    /// heard of a failed batch once, for the whole batch, and of a refused
    /// member not at all (Redis answered).
    Failed(Failure),
}

impl Verdict {
    /// A member's part of the batch's reply: a refused member fails as its
    /// lone call's error reply would (src/filter/call.rs), others ran.
    fn of(part: Reply) -> Verdict {
        match part {
            Reply::Error(why) => Verdict::Failed((ErrorKind::Redis, format!("redis error: {why}"))),
            part => Verdict::Ran(part),
        }
    }
}

struct Group<W> {
    queued: Vec<(W, Member)>,
    out: usize,
}

struct InFlight<W> {
    tag: String,
    call: ScriptCall,
    members: Vec<W>,
    /// The one immediate resend after a refusal was spent.
    resent: bool,
    /// Pauses taken after refusals.
    pauses: u8,
}

pub struct Batcher<W> {
    limits: Batch,
    /// The worker's breakers, the batch's slot group's told once per
    /// failed batch.
    breakers: Rc<Breakers>,
    groups: HashMap<String, Group<W>>,
    calls: crate::filter::in_flight::ByToken<InFlight<W>>,
    /// Calls refused before they ran, waiting out a pause: (due, call).
    retrying: Vec<(Duration, InFlight<W>)>,
}

impl<W: Waiter> Batcher<W> {
    pub fn new(limits: Batch, breakers: Rc<Breakers>) -> Batcher<W> {
        Batcher {
            limits,
            breakers,
            groups: HashMap::new(),
            calls: Default::default(),
            retrying: Vec::new(),
        }
    }

    /// Adds a request to its group's queue. True when the group has a call
    /// to spare, so the worker should [`Batcher::flush`] soon: the request
    /// then leaves at once, with whatever else queued by then.
    pub fn join(&mut self, who: W, member: Member) -> bool {
        // Looked up by reference: the tag is copied only for a new group.
        if !self.groups.contains_key(&member.tag) {
            let group = Group {
                queued: Vec::new(),
                out: 0,
            };
            self.groups.insert(member.tag.clone(), group);
        }
        let Some(group) = self.groups.get_mut(&member.tag) else {
            return false;
        };
        group.queued.push((who, member));
        group.out < self.limits.max_in_flight
    }

    /// True if a request of `tag` may send its own call at once: no call of
    /// its group is out and none queued. The group then counts that call as
    /// out until [`Batcher::release`], so what arrives meanwhile queues.
    pub fn try_alone(&mut self, tag: &str) -> bool {
        match self.groups.get_mut(tag) {
            None => {
                let group = Group {
                    queued: Vec::new(),
                    out: 1,
                };
                self.groups.insert(tag.to_string(), group);
                true
            }
            Some(group) if group.out == 0 && group.queued.is_empty() => {
                group.out = 1;
                true
            }
            Some(_) => false,
        }
    }

    /// A lone call of `tag` ([`Batcher::try_alone`]) is over. True when
    /// requests queued behind it and the group has a call to spare: the
    /// worker should [`Batcher::flush`] soon (as its root: a batch must not
    /// be the call of one of its members' streams).
    pub fn release(&mut self, tag: &str) -> bool {
        let Some(group) = self.groups.get_mut(tag) else {
            return false;
        };
        group.out = group.out.saturating_sub(1);
        if group.out == 0 && group.queued.is_empty() {
            self.groups.remove(tag);
            return false;
        }
        !group.queued.is_empty() && group.out < self.limits.max_in_flight
    }

    /// Sends every group that has queued members and a call to spare.
    /// Verdicts of members decided at once (late, or a call that could not
    /// be sent) are returned.
    pub fn flush<H: Host>(&mut self, host: &mut H, target: &RedisTarget) -> Vec<(W, Verdict)> {
        let ready: Vec<String> = self
            .groups
            .iter()
            .filter(|(_, g)| !g.queued.is_empty() && g.out < self.limits.max_in_flight)
            .map(|(tag, _)| tag.clone())
            .collect();
        let mut verdicts = Vec::new();
        for tag in ready {
            verdicts.extend(self.send_next(host, target, &tag));
        }
        verdicts
    }

    /// Whether `token` is one of this worker's batch calls.
    pub fn owns(&self, token: u32) -> bool {
        self.calls.contains_key(&token)
    }

    /// The answer to batch call `token`: each member's verdict, to deliver
    /// through its own stream; what queued meanwhile has left already.
    pub fn on_reply<H: Host>(
        &mut self,
        host: &mut H,
        target: &RedisTarget,
        token: u32,
        reply: &CalloutReply,
    ) -> Vec<(W, Verdict)> {
        let Some(mut flight) = self.calls.remove(&token) else {
            return Vec::new();
        };
        let failure = match flight.call.answer(host, target, reply) {
            Answer::Resent(token) => {
                self.calls.insert(token, flight);
                return Vec::new();
            }
            Answer::Ran(reply) => match split_reply(reply, flight.members.len()) {
                Ok(parts) => {
                    let mut verdicts: Vec<(W, Verdict)> = flight
                        .members
                        .into_iter()
                        .zip(parts)
                        .map(|(w, part)| (w, Verdict::of(part)))
                        .collect();
                    verdicts.extend(self.finished(host, target, &flight.tag));
                    return verdicts;
                }
                Err(e) => (ErrorKind::Reply, format!("unexpected batch reply: {e}")),
            },
            // Nothing ran: the same batch again after a pause, as a single
            // call would be, or at once, once, if the host cannot wait.
            Answer::Refused(failure) => {
                let left = match flight.call.budget() {
                    Budget::Until(deadline) => deadline.saturating_sub(host.now()),
                    Budget::Each(timeout) => timeout,
                };
                let pause = pause_before(flight.pauses);
                if flight.pauses < MAX_PAUSES && left > pause && host.wake_later(pause) {
                    host.count(Counter::RedisRetries);
                    flight.pauses += 1;
                    self.retrying.push((host.now() + pause, flight));
                    return Vec::new();
                }
                if flight.resent {
                    failure
                } else {
                    match flight.call.send(host, target) {
                        Ok(token) => {
                            host.count(Counter::RedisRetries);
                            flight.resent = true;
                            self.calls.insert(token, flight);
                            return Vec::new();
                        }
                        Err(failure) => failure,
                    }
                }
            }
            Answer::Failed(failure) => failure,
        };
        // One failed call, one failure for its slot group's breaker, however
        // many rode it.
        tell_breaker(host, &self.breakers.for_tag(Some(&flight.tag)));
        let mut verdicts = failed_all(flight.members, &failure);
        verdicts.extend(self.finished(host, target, &flight.tag));
        verdicts
    }

    /// Something waits for the host's timer: a refused call's pause, or a
    /// queued group with a call to spare (its wake-up could not be queued).
    pub fn needs_tick(&self) -> bool {
        !self.retrying.is_empty()
            || self
                .groups
                .values()
                .any(|g| !g.queued.is_empty() && g.out < self.limits.max_in_flight)
    }

    /// The host's timer: refused calls whose pause is over go again, and
    /// groups with room send what queued.
    pub fn on_tick<H: Host>(&mut self, host: &mut H, target: &RedisTarget) -> Vec<(W, Verdict)> {
        let now = host.now();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retrying)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.retrying = later;
        let mut verdicts = Vec::new();
        for (_, mut flight) in due {
            flight.resent = true;
            match flight.call.send(host, target) {
                Ok(token) => {
                    self.calls.insert(token, flight);
                }
                Err(failure) => {
                    tell_breaker(host, &self.breakers.for_tag(Some(&flight.tag)));
                    verdicts.extend(failed_all(flight.members, &failure));
                    verdicts.extend(self.finished(host, target, &flight.tag));
                }
            }
        }
        verdicts.extend(self.flush(host, target));
        verdicts
    }

    /// A call of `tag` is over: the next batch leaves if any queued.
    fn finished<H: Host>(
        &mut self,
        host: &mut H,
        target: &RedisTarget,
        tag: &str,
    ) -> Vec<(W, Verdict)> {
        if let Some(group) = self.groups.get_mut(tag) {
            group.out = group.out.saturating_sub(1);
        }
        self.send_next(host, target, tag)
    }

    /// Sends the group's queued members (up to maxRequests) as one call.
    /// Members whose stream is gone are dropped; members whose deadline has
    /// passed fail as timed out; the call gets the oldest one's deadline.
    fn send_next<H: Host>(
        &mut self,
        host: &mut H,
        target: &RedisTarget,
        tag: &str,
    ) -> Vec<(W, Verdict)> {
        let Some(group) = self.groups.get_mut(tag) else {
            return Vec::new();
        };
        let now = host.now();
        let mut late = Vec::new();
        let mut members = Vec::new();
        let mut waiting = std::mem::take(&mut group.queued).into_iter();
        for (who, member) in waiting.by_ref() {
            if who.gone() {
                continue;
            }
            if member.deadline < now + Duration::from_millis(1) {
                late.push(who);
                continue;
            }
            members.push((who, member));
            if members.len() == self.limits.max_requests {
                break;
            }
        }
        group.queued = waiting.collect();
        let mut verdicts = failed_all(
            late,
            &(
                ErrorKind::Timeout,
                "redis timeout spent in the queue".to_string(),
            ),
        );
        if members.is_empty() {
            if group.out == 0 && group.queued.is_empty() {
                self.groups.remove(tag);
            }
            return verdicts;
        }
        let deadline = members.iter().map(|(_, m)| m.deadline).min().unwrap_or(now);
        let size = members.len();
        let (waiters, args): (Vec<W>, Vec<ScriptArgs>) =
            members.into_iter().map(|(w, m)| (w, m.args)).unzip();
        let sent = pack(&args)
            .map_err(|e| (ErrorKind::Reply, format!("cannot pack a batch: {e}")))
            .map(|packed| ScriptCall::packed(&BATCH, packed, Budget::Until(deadline)))
            .and_then(|call| call.send(host, target).map(|token| (token, call)));
        match sent {
            Ok((token, call)) => {
                host.count(Counter::BatchCalls);
                host.observe(Histogram::BatchSize, size as u64);
                group.out += 1;
                self.calls.insert(
                    token,
                    InFlight {
                        tag: tag.to_string(),
                        call,
                        members: waiters,
                        resent: false,
                        pauses: 0,
                    },
                );
            }
            Err(failure) => {
                tell_breaker(host, &self.breakers.for_tag(Some(tag)));
                verdicts.extend(failed_all(waiters, &failure));
            }
        }
        verdicts
    }
}

fn failed_all<W>(members: Vec<W>, failure: &Failure) -> Vec<(W, Verdict)> {
    members
        .into_iter()
        .map(|w| (w, Verdict::Failed(failure.clone())))
        .collect()
}
