//! Calls a worker's root sends for its streams, after they are gone or
//! when they need not wait: the release of concurrency slots, the
//! settlement of usage-based costs. Queued by streams as they end, sent on
//! the root's first tick at or after their due time, the calls of one
//! script and one hash tag joined into one (the scripts take a fixed number
//! of ARGV values per key, so joining is concatenating; every call touches
//! one Redis Cluster slot). Sent by `EVALSHA`, again as `EVAL` after a
//! NOSCRIPT, and after the decision's pauses when refused before it ran.
//!
//! A kind whose calls are idempotent (`resend_for`: the idempotency
//! record's completion and release, owner-checked) is delivered instead:
//! sent again after any failure, refused or of unknown outcome, with a
//! growing pause, until it lands or its lock's TTL has passed. A client's
//! retry after a fault then waits for the fault, not for `lockTtlMs`, and a
//! stored response stays stored whenever Redis is back within the TTL.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

use crate::config::RedisTarget;
use crate::filter::call::{Answer, Budget, ScriptCall};
use crate::filter::retry::pause_before;
use crate::filter::{CalloutReply, Counter, ErrorKind, Host};
use crate::ratelimit::ScriptArgs;
use crate::scripts::Script;
use crate::webdis::Reply;

/// Most keys one call carries: calls due together share one, but a
/// bounded one.
pub const MAX_KEYS: usize = 256;

/// Sends of one call refused before it ran (Webdis 503, TRYAGAIN…): a
/// refusal is sure not to have run, so it is safe to send again.
pub const TRIES: u8 = 4;

/// One script's calls as the root queues them.
#[derive(Debug, Clone, Copy)]
pub struct Kind {
    pub script: &'static LazyLock<Script>,
    /// ARGV values per key.
    pub per_key: usize,
    /// What the log calls it when it fails.
    pub what: &'static str,
    /// Counted, per key, when a call is dropped (could not be sent, or
    /// failed), and per key its script marks failed in a reply that
    /// settles the others (lua/settle.lua): only a kind that counts its
    /// losses reads its reply.
    pub lost: Option<Counter>,
    /// Delivered until it lands, for at most this long after it is queued
    /// (the lock's TTL), each call alone (one key, ARGV of any length);
    /// `None`: joined per script and tag, sent again only when refused
    /// before it ran.
    pub resend_for: Option<Duration>,
}

/// The longest pause between two sends of a delivered call.
const MOST_PAUSE: Duration = Duration::from_secs(1);

/// The pause before a delivered call's send `n` (1-based): 25 ms doubling,
/// at most a second, so a Redis back after an outage sees the call within a
/// second and a dead one about once a second.
fn delivery_pause(n: u8) -> Duration {
    pause_before(0)
        .saturating_mul(1u32 << n.saturating_sub(1).min(6))
        .min(MOST_PAUSE)
}

#[derive(Debug)]
struct Queued {
    due: Duration,
    kind: Kind,
    tag: String,
    args: ScriptArgs,
    /// Sends so far (a refused call comes back with one more).
    tries: u8,
    /// A delivered call: sent again until then (host clock).
    until: Option<Duration>,
}

#[derive(Debug, Default)]
pub struct Deferred {
    queued: Vec<Queued>,
    calls: HashMap<u32, Sent>,
}

/// A call out: its kind, tag, the call, its sends so far and, delivered,
/// until when.
#[derive(Debug)]
struct Sent {
    kind: Kind,
    tag: String,
    call: ScriptCall,
    tries: u8,
    until: Option<Duration>,
}

impl Deferred {
    /// Queues a call, to be sent at `due` (host clock) or after.
    pub fn add(&mut self, kind: Kind, tag: &str, args: ScriptArgs, due: Duration) {
        self.queued.push(Queued {
            due,
            kind,
            tag: tag.to_string(),
            args,
            tries: 0,
            until: kind.resend_for.map(|d| due.saturating_add(d)),
        });
    }

    /// Calls wait for a tick.
    pub fn pending(&self) -> bool {
        !self.queued.is_empty()
    }

    /// Sends what is due: one call per script and tag (per MAX_KEYS keys),
    /// a call refused before apart from first ones.
    pub fn flush<H: Host>(&mut self, host: &mut H, target: &RedisTarget) {
        let now = host.now();
        let (due, later): (Vec<Queued>, Vec<Queued>) = std::mem::take(&mut self.queued)
            .into_iter()
            .partition(|q| q.due <= now);
        self.queued = later;
        let mut groups: Vec<(Kind, String, u8, ScriptArgs, Option<Duration>)> = Vec::new();
        for q in due {
            let same = |g: &&mut (Kind, String, u8, ScriptArgs, Option<Duration>)| {
                g.0.script.sha1 == q.kind.script.sha1 && g.1 == q.tag && g.2 == q.tries
            };
            match groups.iter_mut().find(same) {
                Some(g) if q.kind.resend_for.is_none() => {
                    g.3 .0.extend(q.args.0);
                    g.3 .1.extend(q.args.1);
                }
                _ => groups.push((q.kind, q.tag, q.tries, q.args, q.until)),
            }
        }
        for (kind, tag, tries, (keys, argv), until) in groups {
            // A delivered call is one call whatever its ARGV's length.
            let per_call = if until.is_some() {
                argv.len().max(1)
            } else {
                kind.per_key * MAX_KEYS
            };
            for (k, a) in keys.chunks(MAX_KEYS).zip(argv.chunks(per_call)) {
                let budget = Budget::Each(target.timeout);
                let call = ScriptCall::new(kind.script, (k.to_vec(), a.to_vec()), budget);
                match call.send(host, target) {
                    Ok(token) => {
                        let sent = Sent {
                            kind,
                            tag: tag.clone(),
                            call,
                            tries: tries.saturating_add(1),
                            until,
                        };
                        self.calls.insert(token, sent);
                    }
                    Err((_, why)) => {
                        if let Some(at) = until.filter(|at| now < *at) {
                            // Not sent (the cluster gone with a reload…):
                            // again after a pause, while the lock lasts.
                            self.queued.push(Queued {
                                due: now + delivery_pause(tries.saturating_add(1)),
                                kind,
                                tag: tag.clone(),
                                args: call.into_args(),
                                tries: tries.saturating_add(1),
                                until: Some(at),
                            });
                            continue;
                        }
                        log::warn!(
                            "redis-guard: cannot send {} ({} keys): {why}",
                            kind.what,
                            k.len()
                        );
                        if let Some(lost) = kind.lost {
                            host.count_n(lost, k.len() as u64);
                        }
                    }
                }
            }
        }
    }

    /// The call behind `token` is one of these.
    pub fn owns(&self, token: u32) -> bool {
        self.calls.contains_key(&token)
    }

    /// A call's answer: after a NOSCRIPT it goes again as EVAL; one refused
    /// before it ran is queued again after a pause (as a decision would
    /// be); a failure is logged and let go.
    pub fn on_reply<H: Host>(
        &mut self,
        host: &mut H,
        target: &RedisTarget,
        token: u32,
        reply: &CalloutReply,
    ) {
        let Some(Sent {
            kind,
            tag,
            mut call,
            tries,
            until,
        }) = self.calls.remove(&token)
        else {
            return;
        };
        let answer = call.answer(host, target, reply);
        let redis_said_no = matches!(answer, Answer::Failed((ErrorKind::Redis, _)));
        let now = host.now();
        match answer {
            Answer::Resent(token) => {
                let sent = Sent {
                    kind,
                    tag,
                    call,
                    tries,
                    until,
                };
                self.calls.insert(token, sent);
            }
            Answer::Ran(reply) => {
                if let Some(lost) = kind.lost.filter(|_| until.is_none()) {
                    count_failed_members(host, &kind, lost, &reply);
                }
            }
            // Idempotent: again after a refusal or an unknown outcome while
            // the lock lasts (an error Redis answered would come again).
            Answer::Refused(_) | Answer::Failed(_)
                if until.is_some_and(|at| now < at) && !redis_said_no =>
            {
                self.queued.push(Queued {
                    due: now + delivery_pause(tries),
                    kind,
                    tag,
                    args: call.into_args(),
                    tries,
                    until,
                });
            }
            Answer::Refused(_) if until.is_none() && tries < TRIES => {
                self.queued.push(Queued {
                    due: now + pause_before(tries - 1),
                    kind,
                    tag,
                    args: call.into_args(),
                    tries,
                    until,
                });
            }
            Answer::Refused((_, why)) | Answer::Failed((_, why)) => {
                let keys = call.into_args().0.len() as u64;
                log::warn!("redis-guard: {} failed ({keys} keys): {why}", kind.what);
                if let Some(lost) = kind.lost {
                    host.count_n(lost, keys);
                }
            }
        }
    }
}

/// Counts the members a joined call's script could not apply: it marks each
/// in its place (one stale quota settlement must not lose the settlements of
/// the other requests of its tick, so the script applies those and names
/// that one). One log line per call, naming the first.
fn count_failed_members<H: Host>(host: &mut H, kind: &Kind, lost: Counter, reply: &Reply) {
    let Reply::Array(Some(items)) = reply else {
        return;
    };
    let mut failed = items.iter().filter_map(Reply::member_failure);
    let Some(first) = failed.next() else {
        return;
    };
    let n = 1 + failed.count() as u64;
    log::warn!(
        "redis-guard: {} failed for {n} of its keys: {first}",
        kind.what
    );
    host.count_n(lost, n);
}
