//! One request's path through the filter, independent of proxy-wasm.
//!
//! Request side: the rate limits that apply and, for a request carrying an
//! idempotency key, the key's lock are decided by one script call (after the
//! body is read, since the fingerprint covers it). Response side: a locked
//! request's response is copied while it streams; its last chunk is held until
//! Redis has the COMPLETED record, so a retry sent after the client saw the
//! whole response is always a replay.

use std::rc::Rc;
use std::time::Duration;

use crate::breaker::Breaker;
use crate::codec;
use crate::config::{Config, FailureMode};
use crate::filter::{Counter, ErrorKind, Host};
use crate::idempotency::{decode_headers, encode_headers, fingerprint, parse_key, record_key};
use crate::keys;
use crate::lease;
use crate::local::{take, LocalBucket};
use crate::offload::{self, check_fetch, check_put, Fetched, ObjectRef};
use crate::overlimit::Slot;
use crate::ratelimit::{parse_lease, parse_verdict, IdemArgs, LimitResult, Outcome, Plan, Verdict};
use crate::request::RequestLine;
use crate::response::{
    bad_request, idempotency_conflict, idempotency_mismatch, payload_too_large, rate_limit_headers,
    stored_response_corrupt, stored_response_missing, stored_response_unavailable,
    too_many_requests, too_many_requests_locally, unavailable, LocalReply,
};
use crate::scripts::{Script, IDEM_COMPLETE, IDEM_RELEASE, LEASE, RATELIMIT};
use crate::webdis::{command_body, parse_reply, Reply};

/// What the host should do after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    /// A keyed request: its body is being buffered for the fingerprint.
    ReadingBody,
    /// Waiting for the request script; `eval` once the EVALSHA fallback was
    /// taken, `retried` once the single retry after a Webdis 503 was spent.
    AwaitingRedis {
        token: u32,
        eval: bool,
        retried: bool,
    },
    /// Webdis said 503 (Redis not reachable from it yet, e.g. just after a
    /// Redis restart): the same call goes again after a short pause.
    RetryPending {
        eval: bool,
    },
    /// A replay whose body is in the object store: waiting for the fetch
    /// (what to answer with is in `Flow::fetch`).
    Fetching {
        token: u32,
    },
    /// Decided: forwarded, or answered locally.
    Done,
}

/// An upload's answer is empty or a short XML error; more is not read.
pub const UPLOAD_REPLY_LIMIT: usize = 64 << 10;

/// Webdis needs a moment to reconnect to a restarted Redis (measured: about
/// 30 ms); an immediate retry would meet the same 503.
pub const RETRY_DELAY: Duration = Duration::from_millis(25);
/// Pauses one request may take: enough for a reconnect, few enough that a
/// dead Redis costs at most 1 + MAX_PAUSES calls per request.
pub const MAX_PAUSES: u8 = 3;

/// The idempotency lock of this request, once it has one.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Lock {
    None,
    /// Taken; the response has not started.
    Held,
    /// A storable response is streaming; the copy so far. `expected` is its
    /// content-length: the chunk that completes it is the one to hold, since
    /// the client has the whole response as soon as that chunk is out.
    Capturing {
        status: u32,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
        expected: Option<usize>,
    },
    /// The body is being uploaded to the object store; the last chunk waits
    /// for it and then for the record. The body itself is not kept: Envoy
    /// holds the upload's copy.
    Uploading {
        token: u32,
        status: u32,
        headers: Vec<(String, Vec<u8>)>,
        object: ObjectRef,
    },
    /// The COMPLETED record is on its way; the last chunk waits for it.
    /// The call is kept for the one EVAL after a NOSCRIPT.
    Completing {
        token: u32,
        eval: bool,
        keys: Vec<Vec<u8>>,
        argv: Vec<Vec<u8>>,
        offloaded: bool,
    },
    /// The lock is being released (the response will not be stored); the
    /// response streams, but the piece that ends it waits for the release so
    /// a retry after it never meets our lock. `seen` counts body bytes
    /// against `expected` (content-length); `held` once that piece waits.
    Releasing {
        token: u32,
        expected: Option<usize>,
        seen: usize,
        held: bool,
    },
    /// Completed, released, or left to expire: nothing more to do.
    Finished,
}

/// The answer of a Redis callout, as the host saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalloutReply {
    /// The HTTP status of Webdis' answer; `None` when the call failed
    /// (timeout, connection refused, reset).
    pub status: Option<u32>,
    /// The answer came from Webdis itself (its `server` header), not from
    /// Envoy on its behalf.
    pub from_webdis: bool,
    pub body: Vec<u8>,
}

/// A replay waiting for its body from the object store.
#[derive(Debug, Clone)]
struct Fetch {
    status: u32,
    headers: Vec<(String, String)>,
    object: ObjectRef,
}

/// The idempotency key of this request, once validated.
#[derive(Debug, Clone)]
struct Keyed {
    rule: usize,
    args: IdemArgs,
}

pub struct Flow {
    config: Rc<Config>,
    breaker: Rc<Breaker>,
    /// The breaker sent this request to its failure mode (no call was made).
    short_circuited: bool,
    /// Pauses taken after Webdis 503s.
    pauses: u8,
    plan: Plan,
    keyed: Option<Keyed>,
    line: Option<RequestLine>,
    phase: Phase,
    lock: Lock,
    /// When the Redis decision must be in: every attempt (retry, NOSCRIPT
    /// fallback) shares the one configured timeout.
    deadline: Duration,
    /// When the call being answered left: the over-limit cache counts from it.
    sent_at: Duration,
    /// The call in flight fetches a token lease for this check (plan index),
    /// this many tokens.
    leasing: Option<(usize, u64)>,
    /// This request is the open breaker's probe.
    probe: bool,
    response_headers: Vec<(String, String)>,
    fetch: Option<Fetch>,
}

impl Flow {
    pub fn new(config: Rc<Config>, breaker: Rc<Breaker>) -> Flow {
        Flow {
            config,
            breaker,
            short_circuited: false,
            pauses: 0,
            plan: Plan::default(),
            keyed: None,
            line: None,
            phase: Phase::Idle,
            lock: Lock::None,
            deadline: Duration::ZERO,
            sent_at: Duration::ZERO,
            leasing: None,
            probe: false,
            response_headers: Vec::new(),
            fetch: None,
        }
    }

    fn reply_locally<H: Host>(&mut self, host: &mut H, reply: &LocalReply) -> Action {
        self.phase = Phase::Done;
        host.send_local(reply);
        Action::Pause
    }

    pub fn on_request_headers<H: Host>(&mut self, host: &mut H, end_of_stream: bool) -> Action {
        let line = RequestLine::read_needed(host, self.config.needs);
        self.plan = match Plan::build(&self.config, &line, host) {
            Ok(plan) => plan,
            Err(bad) => return self.reply_locally(host, &bad_request(&bad.detail)),
        };
        for check in &self.plan.checks {
            host.count(Counter::Checked(check.limit));
        }
        let rule_index = self
            .config
            .idempotency
            .iter()
            .position(|r| r.matcher.matches(&line, host));
        if let Some(i) = rule_index {
            let rule = &self.config.idempotency[i];
            match host.header(&rule.header) {
                None if rule.required => {
                    let detail = format!("this request needs an `{}` header", rule.header);
                    return self.reply_locally(host, &bad_request(&detail));
                }
                None => {}
                Some(raw) => {
                    let key = match parse_key(&raw) {
                        Ok(k) => k,
                        Err(why) => {
                            let detail = format!("invalid `{}`: {why}", rule.header);
                            return self.reply_locally(host, &bad_request(&detail));
                        }
                    };
                    if let Some(len) = host
                        .header("content-length")
                        .and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<usize>().ok())
                    {
                        if len > rule.max_request_body {
                            return self
                                .reply_locally(host, &payload_too_large(rule.max_request_body));
                        }
                    }
                    // Computed once per request: the limits may have it already.
                    let tag = match &self.plan.tag {
                        Some(t) => t.clone(),
                        None => self.config.hash_tag_for(&line, host),
                    };
                    let mut tenant = Vec::new();
                    for (j, part) in rule.tenant.iter().enumerate() {
                        if j > 0 {
                            tenant.push(b':');
                        }
                        // No tenant, no scope: an absent or empty tenant must
                        // not share one key space with every other such request.
                        let value = part.value(&line, host).unwrap_or_default();
                        if value.is_empty() {
                            let detail = format!(
                                "requests with `{}` need their tenant ({part})",
                                rule.header
                            );
                            return self.reply_locally(host, &bad_request(&detail));
                        }
                        keys::push_value(&mut tenant, &value);
                    }
                    self.keyed = Some(Keyed {
                        rule: i,
                        args: IdemArgs {
                            key: record_key(&self.config.key_prefix, &tag, rule, &tenant, &key),
                            owner: host.unique_token(),
                            fingerprint: String::new(),
                            lock_ttl_ms: rule.lock_ttl_ms,
                        },
                    });
                }
            }
        }
        let body_in_fingerprint = self
            .keyed
            .as_ref()
            .is_some_and(|k| self.config.idempotency[k.rule].fingerprint_body);
        if body_in_fingerprint && !end_of_stream {
            // The fingerprint covers the body: decide once it is all here.
            self.line = Some(line);
            self.phase = Phase::ReadingBody;
            return Action::Pause;
        }
        if let Some(keyed) = self.keyed.as_mut() {
            // No body yet, or a rule that leaves it out: decide on the headers
            // (the body waits in Envoy until the request is resumed).
            keyed.args.fingerprint = fingerprint(&line.method, &full_path(host), b"");
        }
        if self.plan.is_empty() && self.keyed.is_none() {
            self.phase = Phase::Done;
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
        match self.phase {
            Phase::ReadingBody => {}
            Phase::AwaitingRedis { .. } | Phase::RetryPending { .. } => return Action::Pause,
            _ => return Action::Continue,
        }
        let max = self.max_request_body();
        if body_size > max {
            return self.reply_locally(host, &payload_too_large(max));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = host.request_body(body_size);
        let method = self
            .line
            .as_ref()
            .map(|l| l.method.clone())
            .unwrap_or_default();
        let path = full_path(host);
        if let Some(keyed) = self.keyed.as_mut() {
            keyed.args.fingerprint = fingerprint(&method, &path, &body);
        }
        self.decide(host)
    }

    fn max_request_body(&self) -> usize {
        self.keyed.as_ref().map_or(usize::MAX, |k| {
            self.config.idempotency[k.rule].max_request_body
        })
    }

    /// Trailers end a request whose body did not say end-of-stream: the body
    /// buffered so far is all of it.
    pub fn on_request_trailers<H: Host>(&mut self, host: &mut H) -> Action {
        match self.phase {
            Phase::ReadingBody => {}
            Phase::AwaitingRedis { .. } | Phase::RetryPending { .. } => return Action::Pause,
            _ => return Action::Continue,
        }
        let max = self.max_request_body();
        let size = host.request_body(max.saturating_add(1)).len();
        self.on_request_body(host, size, true)
    }

    /// The first call for this request, unless the over-limit cache already
    /// knows the answer or the breaker is open.
    fn decide<H: Host>(&mut self, host: &mut H) -> Action {
        // A keyed request may be a retry owed a replay, which comes before
        // any limit: only Redis can tell.
        if self.keyed.is_none() {
            let leased = self.leased_check();
            // Tokens this Envoy holds first: they left Redis already, so an
            // empty bucket there (and a cached rejection) does not void them.
            if let Some(i) = leased {
                if let Lease::Spent(prefetch) = self.lease_step(host, i, false) {
                    return self.lease_spent(host, i, prefetch);
                }
            }
            if let Some((reply, limits)) = self.cached_rejection(host) {
                host.count(Counter::OverLimitCached);
                for limit in limits {
                    host.count(Counter::Rejected(limit));
                }
                return self.reply_locally(host, &reply);
            }
            if let Some(i) = leased {
                match self.lease_step(host, i, true) {
                    Lease::Spent(prefetch) => return self.lease_spent(host, i, prefetch),
                    Lease::Fetch(want) => self.leasing = Some((i, want)),
                    Lease::Strict => {}
                }
            }
        }
        let now = host.now();
        let tripped = self.breaker.tripped();
        if !self.breaker.allow(now) {
            self.short_circuited = true;
            host.count(Counter::CircuitShortCircuited);
            return self.fail(host, (ErrorKind::Dispatch, "circuit breaker open"), false);
        }
        self.probe = tripped;
        self.deadline = now + self.config.redis.timeout;
        match self.call(host, false, false) {
            Ok(()) => Action::Pause,
            Err((kind, why)) => self.fail(host, (kind, &why), false),
        }
    }

    fn call<H: Host>(
        &mut self,
        host: &mut H,
        eval: bool,
        retried: bool,
    ) -> Result<(), (ErrorKind, String)> {
        let leased = self
            .leasing
            .and_then(|(i, want)| self.plan.lease_args(&self.config, i, false, want));
        let (script, (keys, argv)) = match leased {
            Some(args) => (&*LEASE, args),
            None => {
                let idem = self.keyed.as_ref().map(|k| &k.args);
                (&*RATELIMIT, self.plan.script_args(&self.config, idem))
            }
        };
        self.sent_at = host.now();
        let token = self.run(host, script, eval, &keys, &argv)?;
        self.phase = Phase::AwaitingRedis {
            token,
            eval,
            retried,
        };
        Ok(())
    }

    /// Sends one script call within what is left of the deadline.
    fn run<H: Host>(
        &self,
        host: &mut H,
        script: &Script,
        eval: bool,
        keys: &[Vec<u8>],
        argv: &[Vec<u8>],
    ) -> Result<u32, (ErrorKind, String)> {
        let nkeys = keys.len().to_string();
        let mut args: Vec<&[u8]> = Vec::with_capacity(2 + keys.len() + argv.len());
        let command = if eval {
            args.push(script.source.as_bytes());
            "EVAL"
        } else {
            args.push(script.sha1.as_bytes());
            "EVALSHA"
        };
        args.push(nkeys.as_bytes());
        args.extend(keys.iter().map(Vec::as_slice));
        args.extend(argv.iter().map(Vec::as_slice));
        let body = command_body(command, &args);
        let left = self.deadline.saturating_sub(host.now());
        if left < Duration::from_millis(1) {
            return Err((ErrorKind::Timeout, "redis timeout spent".to_string()));
        }
        host.count(Counter::RedisCalls);
        host.dispatch_redis(&self.config.redis, &body, left)
            .map_err(|e| (ErrorKind::Dispatch, e))
    }

    /// The failure mode of everything this request is subject to: deny if
    /// any enforced limit or its idempotency rule says deny.
    fn failure_mode(&self) -> FailureMode {
        let idem_deny = self
            .keyed
            .as_ref()
            .is_some_and(|k| self.config.idempotency[k.rule].failure_mode == FailureMode::Deny);
        if idem_deny {
            FailureMode::Deny
        } else {
            self.plan.failure_mode(&self.config)
        }
    }

    /// Redis could not decide: apply the failure mode. `paused` tells whether
    /// the request is waiting on us (callout) or still in a callback.
    fn fail<H: Host>(&mut self, host: &mut H, error: (ErrorKind, &str), paused: bool) -> Action {
        let (kind, why) = error;
        if let Some((i, _)) = self.leasing.take() {
            self.release_lease_claim(host, i);
        }
        let dispatched = matches!(self.phase, Phase::AwaitingRedis { .. });
        self.phase = Phase::Done;
        if !self.short_circuited {
            host.count(Counter::RedisError(kind));
            let was_tripped = self.breaker.tripped();
            if self.breaker.failure(host.now()) {
                log::warn!("redis-guard: circuit breaker open: Redis calls paused");
                host.count(Counter::CircuitOpened);
                if !was_tripped {
                    host.count(Counter::CircuitTripped);
                }
            }
        }
        // One log line per burst of failures (the first since a success);
        // every request is still counted in the stats.
        let first_of_burst = self.breaker.consecutive_failures() <= 1 && !self.short_circuited;
        let log_level = if first_of_burst {
            log::Level::Warn
        } else {
            log::Level::Debug
        };
        if dispatched && self.keyed.is_some() {
            // The script may have run (timeout, reset) and taken our lock:
            // release it (only if ours) so retries are not answered 409.
            self.release(host, true);
        }
        match self.failure_mode() {
            FailureMode::Deny => {
                log::log!(log_level, "redis-guard: request undecided, denying: {why}");
                host.count(Counter::FailureDenied);
                host.send_local(&unavailable(
                    "rate limit or idempotency backend unavailable",
                ));
                Action::Pause
            }
            FailureMode::Local => {
                log::log!(
                    log_level,
                    "redis-guard: request undecided, deciding locally: {why}"
                );
                host.count(Counter::FailureLocal);
                if self.keyed.is_some() {
                    host.count(Counter::IdemUnguarded);
                }
                match self.decide_locally(host) {
                    Some(reply) => {
                        host.send_local(&reply);
                        Action::Pause
                    }
                    None => {
                        if paused {
                            host.resume_request();
                        }
                        Action::Continue
                    }
                }
            }
            FailureMode::Allow => {
                log::log!(log_level, "redis-guard: request undecided, allowing: {why}");
                host.count(Counter::FailureAllowed);
                if self.keyed.is_some() {
                    // Forwarded without the guarantee: say so in a stat.
                    host.count(Counter::IdemUnguarded);
                }
                if paused {
                    host.resume_request();
                }
                Action::Continue
            }
        }
    }

    /// The plan's one check, when it is a leased limit: only then can a
    /// request be admitted without Redis (with more checks, or a shadow one,
    /// Redis must see it).
    fn leased_check(&self) -> Option<usize> {
        match self.plan.checks.as_slice() {
            [only] if self.config.limits[only.limit].lease.is_some() => Some(0),
            _ => None,
        }
    }

    fn lease_spent<H: Host>(&mut self, host: &mut H, i: usize, prefetch: Option<u64>) -> Action {
        if let Some(want) = prefetch {
            self.prefetch(host, i, want);
        }
        host.count(Counter::LeaseSpent);
        host.count(Counter::Allowed(self.plan.checks[i].limit));
        self.phase = Phase::Done;
        Action::Continue
    }

    /// Spends leased tokens (with a background fetch to start when the
    /// batch ran low), or, with `claim`, claims the fetch of a new batch by
    /// this request; `Strict` leaves the request to Redis (nothing to spend,
    /// another worker fetching, or contention).
    fn lease_step<H: Host>(&self, host: &mut H, i: usize, claim: bool) -> Lease {
        let check = &self.plan.checks[i];
        let Some(batch) = self.config.limits[check.limit].lease.map(|l| l.tokens) else {
            return Lease::Strict;
        };
        let slot = lease::Slot::of(&check.key);
        let now_ms = millis(host.now());
        let fetch_for = millis(self.config.redis.timeout).saturating_add(1000);
        for _ in 0..8 {
            let (stored, cas) = host.shared_get(&slot.shared_key);
            let step = slot.step(
                stored.as_deref(),
                check.cost,
                now_ms,
                fetch_for,
                batch,
                claim,
            );
            let (bytes, next) = match step {
                lease::Step::Spend { bytes, prefetch } => (bytes, Lease::Spent(prefetch)),
                lease::Step::Fetch { bytes, want } => (bytes, Lease::Fetch(want)),
                lease::Step::Strict => return Lease::Strict,
            };
            if host.shared_set(&slot.shared_key, &bytes, create_or_swap(cas)) {
                return next;
            }
        }
        Lease::Strict
    }

    /// Starts the background fetch this request's spend claimed. Its reply
    /// goes to [`on_prefetch_reply`], whatever becomes of this stream.
    fn prefetch<H: Host>(&self, host: &mut H, i: usize, want: u64) {
        let Some(check) = self.plan.checks.get(i) else {
            return;
        };
        let Some(lease) = self.config.limits[check.limit].lease else {
            return;
        };
        let Some((keys, argv)) = self.plan.lease_args(&self.config, i, true, want) else {
            return;
        };
        let mut args: Vec<&[u8]> = vec![LEASE.sha1.as_bytes(), b"1"];
        args.extend(keys.iter().map(Vec::as_slice));
        args.extend(argv.iter().map(Vec::as_slice));
        let body = command_body("EVALSHA", &args);
        let note = Prefetch {
            limit_key: check.key.clone(),
            ttl: lease.ttl,
            sent_at: host.now(),
            batch: lease.tokens,
        };
        host.count(Counter::RedisCalls);
        let timeout = self.config.redis.timeout;
        if let Err(e) = host.dispatch_prefetch(&self.config.redis, &body, timeout, note) {
            log::warn!("redis-guard: cannot prefetch a lease: {e}");
            self.release_lease_claim(host, i);
        }
    }

    /// Adds a fetched grant to this Envoy's lease, counted from when the
    /// call left (never later than Redis' own view of it).
    fn store_lease<H: Host>(&self, host: &mut H, i: usize, granted: u64) {
        let Some(check) = self.plan.checks.get(i) else {
            return;
        };
        let Some(lease) = self.config.limits[check.limit].lease else {
            return;
        };
        let slot = lease::Slot::of(&check.key);
        let now_ms = millis(host.now());
        let expires = millis(self.sent_at + lease.ttl);
        for _ in 0..8 {
            let (stored, cas) = host.shared_get(&slot.shared_key);
            let Some(bytes) =
                slot.granted(stored.as_deref(), granted, now_ms, expires, lease.tokens)
            else {
                log::info!(
                    "redis-guard: lease slot taken by another key; {granted} tokens dropped"
                );
                return;
            };
            if host.shared_set(&slot.shared_key, &bytes, create_or_swap(cas)) {
                return;
            }
        }
        log::warn!(
            "redis-guard: lease of `{}` contended; tokens dropped",
            self.config.limits[check.limit].name
        );
    }

    fn release_lease_claim<H: Host>(&self, host: &mut H, i: usize) {
        if let Some(check) = self.plan.checks.get(i) {
            release_claim(host, &check.key);
        }
    }

    /// A 429 for the enforced limits the over-limit cache says cannot admit
    /// this request now; `None` when Redis has to decide.
    fn cached_rejection<H: Host>(&self, host: &H) -> Option<(LocalReply, Vec<usize>)> {
        let now_ms = millis(host.now());
        let mut rejecting = Plan {
            checks: Vec::new(),
            tag: None,
        };
        let mut results = Vec::new();
        for check in &self.plan.checks {
            if self.config.limits[check.limit].shadow {
                continue;
            }
            let slot = Slot::of(&check.key);
            let (stored, _) = host.shared_get(&slot.shared_key);
            if let Some((retry_ms, remaining)) = slot.rejects(stored.as_deref(), check.cost, now_ms)
            {
                results.push(LimitResult {
                    allowed: false,
                    remaining,
                    retry_ms,
                    reset_ms: retry_ms,
                });
                rejecting.checks.push(check.clone());
            }
        }
        if rejecting.checks.is_empty() {
            return None;
        }
        let outcome = Outcome {
            admitted: false,
            results,
        };
        let reply = too_many_requests(&self.config, &rejecting, &outcome);
        Some((reply, rejecting.checks.iter().map(|c| c.limit).collect()))
    }

    /// Records every enforced limit that rejected, until Redis said it could
    /// admit this request's cost again.
    fn remember_rejections<H: Host>(&self, host: &mut H, outcome: &Outcome) {
        let sent_ms = millis(self.sent_at);
        for (check, result) in self.plan.checks.iter().zip(&outcome.results) {
            if result.allowed || result.retry_ms == 0 || self.config.limits[check.limit].shadow {
                continue;
            }
            let slot = Slot::of(&check.key);
            let entry = slot.entry(sent_ms, result.retry_ms, check.cost, result.remaining);
            host.shared_set(&slot.shared_key, &entry.encode(), None);
        }
    }

    /// Spends from this Envoy's local budget of every `local` limit that
    /// applies; `Some(429)` when one of them is empty. Shared data with
    /// compare-and-swap keeps the workers of one Envoy on one budget.
    fn decide_locally<H: Host>(&mut self, host: &mut H) -> Option<LocalReply> {
        let now_ms = u64::try_from(host.now().as_millis()).unwrap_or(u64::MAX);
        for check in &self.plan.checks {
            let limit = &self.config.limits[check.limit];
            if limit.shadow || limit.failure_mode != FailureMode::Local {
                continue;
            }
            let bucket = LocalBucket::for_limit(&limit.algorithm, limit.local_per_mille);
            let key = format!("redis-guard/local/{}", codec::sha256_hex(&check.key));
            let mut taken = None;
            // Bounded: under contention a worker retries a few times, then
            // counts the request as admitted rather than spin.
            for _ in 0..8 {
                let (state, cas) = host.shared_get(&key);
                let t = take(&bucket, state.as_deref(), now_ms, check.cost);
                if host.shared_set(&key, &t.state, create_or_swap(cas)) {
                    taken = Some(t);
                    break;
                }
            }
            match taken {
                Some(t) if !t.allowed => {
                    host.count(Counter::LocalRejected);
                    host.count(Counter::Rejected(check.limit));
                    return Some(too_many_requests_locally(&limit.name, t.retry_ms));
                }
                Some(_) => host.count(Counter::LocalAllowed),
                None => log::warn!("redis-guard: local budget of `{}` contended", limit.name),
            }
        }
        None
    }

    /// The pause after a Webdis 503 is over: send the call again.
    pub fn on_retry_due<H: Host>(&mut self, host: &mut H) {
        if let Phase::RetryPending { eval } = self.phase {
            if let Err((kind, e)) = self.call(host, eval, true) {
                self.fail(host, (kind, &e), true);
            }
        }
    }

    /// A call refused before it ran: send it again after a pause, up to
    /// MAX_PAUSES times within the timeout, or at once, once, if the host
    /// cannot wait; then `exhausted`.
    fn retry_refused<H: Host>(
        &mut self,
        host: &mut H,
        eval: bool,
        retried: bool,
        exhausted: (ErrorKind, &str),
    ) {
        let left = self.deadline.saturating_sub(host.now());
        if self.pauses < MAX_PAUSES && left > RETRY_DELAY && host.retry_later(RETRY_DELAY) {
            host.count(Counter::RedisRetries);
            self.pauses += 1;
            self.phase = Phase::RetryPending { eval };
        } else if !retried {
            host.count(Counter::RedisRetries);
            if let Err((kind, e)) = self.call(host, eval, true) {
                self.fail(host, (kind, &e), true);
            }
        } else {
            self.fail(host, exhausted, true);
        }
    }

    pub fn on_callout_reply<H: Host>(&mut self, host: &mut H, token: u32, reply: CalloutReply) {
        match self.lock {
            Lock::Completing { token: want, .. } if token == want => {
                self.on_complete_reply(host, reply);
                return;
            }
            Lock::Releasing { token: want, .. } if token == want => {
                self.on_release_reply(host, &reply);
                return;
            }
            Lock::Uploading { token: want, .. } if token == want => {
                self.on_upload_reply(host, &reply);
                return;
            }
            _ => {}
        }
        if let Phase::Fetching { token: want } = self.phase {
            if token == want {
                self.on_fetch_reply(host, reply);
            }
            return;
        }
        let Phase::AwaitingRedis {
            token: want,
            eval,
            retried,
        } = self.phase
        else {
            return;
        };
        if token != want {
            return;
        }
        match reply.status {
            Some(200) => {}
            // Webdis' own 503 says the command never reached Redis (e.g. the
            // first call on a pooled connection to a restarted Redis), so it
            // can run again without charging twice. Envoy's 503 (reset after
            // sending) carries no such promise and is not retried.
            // Retried after a pause, up to MAX_PAUSES times within the timeout
            // (Webdis reconnects within tens of ms), or at once, once, if the
            // host cannot wait.
            Some(503) if reply.from_webdis => {
                let why = "webdis answered HTTP 503 until the timeout";
                self.retry_refused(host, eval, retried, (ErrorKind::Http, why));
                return;
            }
            Some(s) => {
                // Envoy answers a callout that ran out of time with its own 504.
                let kind = if s == 504 && !reply.from_webdis {
                    ErrorKind::Timeout
                } else {
                    ErrorKind::Http
                };
                let why = format!("webdis answered HTTP {s}");
                self.fail(host, (kind, &why), true);
                return;
            }
            None => {
                let why = "redis call failed or timed out";
                self.fail(host, (ErrorKind::Timeout, why), true);
                return;
            }
        }
        let parsed = match parse_reply(&reply.body) {
            Ok(r) => r,
            Err(e) => {
                let why = format!("unreadable reply: {e}");
                self.fail(host, (ErrorKind::Reply, &why), true);
                return;
            }
        };
        if let Reply::Error(msg) = &parsed {
            // Scripts vanish when Redis restarts or a cluster node is new; EVAL
            // both runs and caches the script, so this costs one extra trip once.
            if parsed.error_kind() == Some("NOSCRIPT") && !eval {
                host.count(Counter::ScriptReloads);
                if let Err((kind, e)) = self.call(host, true, retried) {
                    self.fail(host, (kind, &e), true);
                }
                return;
            }
            // Redis Cluster refuses these before the script runs (keys split
            // while a slot migrates, no quorum, a node still loading): nothing
            // was charged, and the condition passes in milliseconds.
            if matches!(
                parsed.error_kind(),
                Some("TRYAGAIN" | "CLUSTERDOWN" | "LOADING")
            ) {
                let why = format!("redis refused the call until the timeout: {msg}");
                self.retry_refused(host, eval, retried, (ErrorKind::Redis, &why));
                return;
            }
            let why = format!("redis error: {msg}");
            self.fail(host, (ErrorKind::Redis, &why), true);
            return;
        }
        let parsed_verdict = match self.leasing {
            Some((i, _)) => parse_lease(&parsed).map(|(outcome, granted)| {
                host.count(Counter::LeaseFetched);
                self.store_lease(host, i, granted);
                Verdict::Limits(outcome)
            }),
            None => parse_verdict(&parsed, self.plan.checks.len()),
        };
        let verdict = match parsed_verdict {
            Ok(v) => v,
            // The key completed but its record cannot be read: answering
            // from the failure mode could forward it, and a completed key
            // is never run again. Redis itself answered, so the breaker
            // learns nothing bad.
            Err(e) if completed_reply(&parsed) => {
                self.phase = Phase::Done;
                if self.breaker.success() {
                    host.count(Counter::CircuitClosed);
                }
                log::warn!("redis-guard: unreadable idempotency record: {e}");
                host.count(Counter::RedisError(ErrorKind::Reply));
                host.send_local(&unavailable("stored idempotent response is unreadable"));
                return;
            }
            Err(e) => {
                let why = format!("unexpected script reply: {e}");
                self.fail(host, (ErrorKind::Reply, &why), true);
                return;
            }
        };
        self.phase = Phase::Done;
        if self.breaker.success() {
            log::info!("redis-guard: circuit breaker closed: Redis answers again");
            host.count(Counter::CircuitClosed);
        }
        match verdict {
            Verdict::Limits(outcome) => {
                for (check, result) in self.plan.checks.iter().zip(&outcome.results) {
                    let limit = &self.config.limits[check.limit];
                    match (limit.shadow, result.allowed) {
                        (true, false) => {
                            log::info!("redis-guard: shadow limit `{}` would reject", limit.name);
                            host.count(Counter::ShadowRejected(check.limit));
                        }
                        (_, true) => host.count(Counter::Allowed(check.limit)),
                        (false, false) => host.count(Counter::Rejected(check.limit)),
                    }
                }
                if !outcome.admitted {
                    self.remember_rejections(host, &outcome);
                }
                if outcome.admitted {
                    if self.keyed.is_some() {
                        self.lock = Lock::Held;
                        host.count(Counter::IdemAcquired);
                    }
                    self.response_headers = rate_limit_headers(&self.config, &self.plan, &outcome);
                    host.resume_request();
                } else {
                    host.send_local(&too_many_requests(&self.config, &self.plan, &outcome));
                }
            }
            Verdict::Busy { .. } => {
                host.count(Counter::IdemConflicts);
                host.send_local(&idempotency_conflict());
            }
            Verdict::Mismatch => {
                host.count(Counter::IdemMismatches);
                host.send_local(&idempotency_mismatch());
            }
            Verdict::Replay {
                status,
                headers,
                body,
                object,
            } => match decode_headers(&headers) {
                Ok(stored) => {
                    let mut headers: Vec<(String, String)> = stored
                        .into_iter()
                        .map(|(n, v)| (n, String::from_utf8_lossy(&v).into_owned()))
                        .collect();
                    headers.push(("idempotent-replayed".to_string(), "true".to_string()));
                    match object {
                        None => {
                            host.count(Counter::IdemReplayed);
                            host.send_local(&LocalReply {
                                status,
                                headers,
                                body,
                            });
                        }
                        Some(object) => self.fetch_object(host, status, headers, object),
                    }
                }
                // Never re-execute a completed key: a record we cannot read is
                // an error, not a miss.
                Err(e) => {
                    log::warn!("redis-guard: unreadable idempotency record: {e}");
                    host.count(Counter::RedisError(ErrorKind::Reply));
                    host.send_local(&unavailable("stored idempotent response is unreadable"));
                }
            },
        }
    }

    pub fn on_response_headers<H: Host>(&mut self, host: &mut H, end_of_stream: bool) -> Action {
        for (name, value) in self.response_headers.drain(..) {
            host.add_response_header(&name, &value);
        }
        let Some(keyed) = &self.keyed else {
            return Action::Continue;
        };
        if self.lock != Lock::Held {
            return Action::Continue;
        }
        let rule = &self.config.idempotency[keyed.rule];
        let status = host
            .response_header(":status")
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u32>().ok());
        let expected = host
            .response_header("content-length")
            .and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<usize>().ok());
        let storable = status.filter(|s| rule.stores(*s));
        let mut headers = Vec::new();
        for name in &rule.store_headers {
            for value in host.response_header_values(name) {
                headers.push((name.clone(), value));
            }
        }
        // A replay is a local reply, whose header values must be text: a
        // response that cannot be replayed exactly is not stored.
        let replayable = headers.iter().all(|(_, v)| std::str::from_utf8(v).is_ok());
        if storable.is_some() && expected.is_some_and(|n| n > rule.max_stored_body) {
            // Announced too large: released at once, without copying any of it.
            log::info!(
                "redis-guard: response over maxStoredBodyBytes ({}), not stored",
                rule.max_stored_body
            );
            host.count(Counter::IdemTooLarge);
            self.release_before_end(host, expected, 0);
            return self.hold_if_ended(end_of_stream, 0);
        }
        match storable {
            Some(status) if replayable => {
                // Sized from content-length once (at most the cap, checked
                // above), so the copy is never reallocated.
                self.lock = Lock::Capturing {
                    status,
                    headers,
                    body: Vec::with_capacity(expected.unwrap_or(0)),
                    expected,
                };
                if end_of_stream {
                    return self.complete(host);
                }
                Action::Continue
            }
            _ => {
                // Not storable (5xx, 4xx unless configured, not replayable):
                // a retry must run again, so free the key before the client
                // has the whole response.
                self.release_before_end(host, expected, 0);
                self.hold_if_ended(end_of_stream, 0)
            }
        }
    }

    pub fn on_response_body<H: Host>(
        &mut self,
        host: &mut H,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let max = match (&self.keyed, &self.lock) {
            (Some(k), Lock::Capturing { .. }) => self.config.idempotency[k.rule].max_stored_body,
            (_, Lock::Completing { .. } | Lock::Uploading { .. }) => return Action::Pause,
            (_, Lock::Releasing { .. }) => return self.hold_if_ended(end_of_stream, body_size),
            _ => return Action::Continue,
        };
        let chunk = host.response_body(body_size);
        let mut complete = end_of_stream;
        if let Lock::Capturing { body, expected, .. } = &mut self.lock {
            if body.len() + chunk.len() > max {
                // Over the cap (in Redis, or in the object store when the
                // rule offloads): released like a failure, so a retry runs
                // again; the copy is dropped at once.
                log::info!("redis-guard: response over maxStoredBodyBytes ({max}), not stored");
                host.count(Counter::IdemTooLarge);
                let (expected, seen) = (*expected, body.len());
                self.release_before_end(host, expected, seen);
                return self.hold_if_ended(end_of_stream, chunk.len());
            }
            let needed = body.len() + chunk.len();
            if needed > body.capacity() {
                // Without a content-length: grow by doubling, but never
                // reserve past the cap.
                let target = needed.max(body.capacity().saturating_mul(2)).min(max);
                body.reserve_exact(target - body.len());
            }
            body.extend_from_slice(&chunk);
            complete |= expected.is_some_and(|n| body.len() >= n);
        }
        if complete {
            return self.complete(host);
        }
        Action::Continue
    }

    /// Trailers end a response that had no content-length: the captured body
    /// is complete, and a pending release must land before they go out.
    pub fn on_response_trailers<H: Host>(&mut self, host: &mut H) -> Action {
        match self.lock {
            Lock::Capturing { .. } => self.complete(host),
            Lock::Completing { .. } | Lock::Uploading { .. } => Action::Pause,
            Lock::Releasing { .. } => self.hold_if_ended(true, 0),
            _ => Action::Continue,
        }
    }

    /// While a release is in flight, lets the response stream until the piece
    /// that ends it (end of stream, or content-length reached), which waits.
    fn hold_if_ended(&mut self, end_of_stream: bool, chunk: usize) -> Action {
        let Lock::Releasing {
            expected,
            seen,
            held,
            ..
        } = &mut self.lock
        else {
            return Action::Continue;
        };
        *seen += chunk;
        if end_of_stream || expected.is_some_and(|n| *seen >= n) {
            *held = true;
            return Action::Pause;
        }
        Action::Continue
    }

    /// Stores the captured response (a large body first goes to the object
    /// store); the stream's end waits for the answer.
    fn complete<H: Host>(&mut self, host: &mut H) -> Action {
        let Some(keyed) = &self.keyed else {
            return Action::Continue;
        };
        let above = self.config.idempotency[keyed.rule].offload_above;
        let Lock::Capturing {
            status,
            headers,
            body,
            ..
        } = std::mem::replace(&mut self.lock, Lock::Held)
        else {
            return Action::Continue;
        };
        match (above, &self.config.object_store) {
            (Some(above), Some(_)) if body.len() > above => {
                self.upload(host, status, headers, body)
            }
            _ => self.store_record(host, status, &headers, body, None),
        }
    }

    /// Sends the body to the object store; the record follows once it is
    /// there, so a record never points at an object that was not stored.
    fn upload<H: Host>(
        &mut self,
        host: &mut H,
        status: u32,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    ) -> Action {
        let config = Rc::clone(&self.config);
        let (Some(keyed), Some(store)) = (&self.keyed, &config.object_store) else {
            return Action::Continue;
        };
        let rule = &config.idempotency[keyed.rule];
        let sha256 = codec::sha256_hex(&body);
        // Read after hashing (a large body takes a while): the record is
        // written within the upload's and then the write's deadline from now.
        let now = host.now();
        let expires = offload::expires_at(
            now,
            rule.record_ttl_ms,
            store.timeout + config.redis.timeout,
        );
        let object = ObjectRef {
            key: offload::object_key(
                store,
                &rule.name,
                &keyed.args.key,
                &keyed.args.owner,
                expires,
            ),
            sha256,
            len: body.len(),
        };
        let request = offload::put_headers(store, &object, now);
        match host.dispatch_object(store, &request, Some(&body), store.timeout) {
            Ok(token) => {
                // `body` is dropped here: Envoy has its own copy for the upload.
                self.lock = Lock::Uploading {
                    token,
                    status,
                    headers,
                    object,
                };
                Action::Pause
            }
            Err(e) => {
                log::warn!("redis-guard: cannot upload the response to the object store: {e}");
                host.count(Counter::IdemOffloadFailed);
                self.release_held_end(host)
            }
        }
    }

    fn on_upload_reply<H: Host>(&mut self, host: &mut H, reply: &CalloutReply) {
        let Lock::Uploading {
            status,
            headers,
            object,
            ..
        } = std::mem::replace(&mut self.lock, Lock::Held)
        else {
            return;
        };
        match check_put(reply.status) {
            Ok(()) => {
                if self.store_record(host, status, &headers, Vec::new(), Some(object))
                    == Action::Continue
                {
                    host.resume_response();
                }
            }
            Err(e) => {
                // Nothing to point at: the key is freed so a retry runs again,
                // as after any failed store; the response still goes out.
                log::warn!("redis-guard: response not offloaded ({e}); key released");
                host.count(Counter::IdemOffloadFailed);
                if self.release_held_end(host) == Action::Continue {
                    host.resume_response();
                }
            }
        }
    }

    /// Writes the COMPLETED record: the body itself, or the object's reference.
    fn store_record<H: Host>(
        &mut self,
        host: &mut H,
        status: u32,
        headers: &[(String, Vec<u8>)],
        body: Vec<u8>,
        object: Option<ObjectRef>,
    ) -> Action {
        let Some(keyed) = &self.keyed else {
            return Action::Continue;
        };
        let rule = &self.config.idempotency[keyed.rule];
        let keys = vec![keyed.args.key.clone()];
        // The store gets its own timeout, counted from now, plus 1 ms per KiB:
        // a large body takes longer to cross Envoy, Webdis and Redis.
        let transfer = Duration::from_millis((body.len() / 1024) as u64);
        let mut argv = vec![
            keyed.args.owner.as_bytes().to_vec(),
            status.to_string().into_bytes(),
            encode_headers(headers),
            body,
            rule.record_ttl_ms.to_string().into_bytes(),
        ];
        let offloaded = object.is_some();
        if let Some(object) = object {
            argv.push(object.key.into_bytes());
            argv.push(object.sha256.into_bytes());
            argv.push(object.len.to_string().into_bytes());
        }
        self.deadline = host.now() + self.config.redis.timeout + transfer;
        // EVALSHA like every call: the body is the record, the script's
        // source would only add to every request; a NOSCRIPT costs one EVAL.
        match self.run(host, &IDEM_COMPLETE, false, &keys, &argv) {
            Ok(token) => {
                self.lock = Lock::Completing {
                    token,
                    eval: false,
                    keys,
                    argv,
                    offloaded,
                };
                Action::Pause
            }
            Err((_, e)) => {
                log::warn!("redis-guard: cannot store idempotent response: {e}");
                host.count(Counter::IdemStoreFailed);
                // Try to free the key all the same (it expires by itself otherwise).
                self.release(host, true);
                Action::Continue
            }
        }
    }

    fn on_complete_reply<H: Host>(&mut self, host: &mut H, reply: CalloutReply) {
        let parsed = (reply.status == Some(200))
            .then(|| parse_reply(&reply.body).ok())
            .flatten();
        if parsed.as_ref().and_then(Reply::error_kind) == Some("NOSCRIPT") {
            if let Lock::Completing {
                eval: false,
                keys,
                argv,
                offloaded,
                ..
            } = std::mem::replace(&mut self.lock, Lock::Finished)
            {
                host.count(Counter::ScriptReloads);
                if let Ok(token) = self.run(host, &IDEM_COMPLETE, true, &keys, &argv) {
                    self.lock = Lock::Completing {
                        token,
                        eval: true,
                        keys,
                        argv,
                        offloaded,
                    };
                    return;
                }
                // Could not send: fall through to the failure below, which
                // releases the key (the lock is still ours in Redis).
                self.lock = Lock::Held;
            }
        }
        let answer = parsed.as_ref().and_then(Reply::as_int);
        let offloaded = matches!(
            self.lock,
            Lock::Completing {
                offloaded: true,
                ..
            }
        );
        match answer {
            Some(1) => {
                self.lock = Lock::Finished;
                host.count(Counter::IdemStored);
                if offloaded {
                    host.count(Counter::IdemOffloaded);
                }
                host.resume_response();
            }
            Some(0) => {
                // The lock expired (upstream slower than lockTtlMs) and may be
                // another request's now: leave it; the response still goes out.
                log::warn!("redis-guard: idempotency lock lost before the response; not stored");
                host.count(Counter::IdemStoreFailed);
                self.lock = Lock::Finished;
                host.resume_response();
            }
            _ => {
                // Redis failed: free the key (owner-checked) so a retry is not
                // answered 409 until the lock expires; the response waits for it.
                log::warn!(
                    "redis-guard: idempotent response not stored ({:?})",
                    reply.status
                );
                host.count(Counter::IdemStoreFailed);
                if self.release_held_end(host) == Action::Continue {
                    host.resume_response();
                }
            }
        }
    }

    /// How much of the answer to `token` the host should read into the VM:
    /// an object fetch needs exactly the stored length (a longer answer is
    /// not the object, and is not copied), an upload's answer is a short
    /// status document. Redis replies are read whole: a record cut short
    /// must not look like a failure that forwards a completed key.
    pub fn reply_limit(&self, token: u32) -> usize {
        match (&self.phase, &self.fetch, &self.lock) {
            (Phase::Fetching { token: t }, Some(fetch), _) if *t == token => fetch.object.len,
            (_, _, Lock::Uploading { token: t, .. }) if *t == token => UPLOAD_REPLY_LIMIT,
            _ => usize::MAX,
        }
    }

    /// A replay whose body is in the object store: fetch it, then answer.
    fn fetch_object<H: Host>(
        &mut self,
        host: &mut H,
        status: u32,
        headers: Vec<(String, String)>,
        object: ObjectRef,
    ) {
        let config = Rc::clone(&self.config);
        // The record says the request ran: whatever happens here, it is
        // answered, never forwarded.
        let Some(store) = &config.object_store else {
            log::warn!("redis-guard: record points into an object store, but none is configured");
            host.count(Counter::IdemObjectFetchFailed);
            host.send_local(&stored_response_unavailable());
            return;
        };
        let request = offload::get_headers(store, &object, host.now());
        match host.dispatch_object(store, &request, None, store.timeout) {
            Ok(token) => {
                self.phase = Phase::Fetching { token };
                self.fetch = Some(Fetch {
                    status,
                    headers,
                    object,
                });
            }
            Err(e) => {
                log::warn!("redis-guard: cannot fetch a stored response: {e}");
                host.count(Counter::IdemObjectFetchFailed);
                host.send_local(&stored_response_unavailable());
            }
        }
    }

    fn on_fetch_reply<H: Host>(&mut self, host: &mut H, reply: CalloutReply) {
        self.phase = Phase::Done;
        let Some(fetch) = self.fetch.take() else {
            return;
        };
        match check_fetch(reply.status, reply.body, &fetch.object) {
            Fetched::Body(body) => {
                host.count(Counter::IdemReplayed);
                host.count(Counter::IdemObjectFetched);
                host.send_local(&LocalReply {
                    status: fetch.status,
                    headers: fetch.headers,
                    body,
                });
            }
            Fetched::Missing => self.stored_response_error(
                host,
                &fetch.object,
                "is missing".to_string(),
                (Counter::IdemObjectMissing, stored_response_missing()),
            ),
            Fetched::Corrupt(why) => self.stored_response_error(
                host,
                &fetch.object,
                format!("is corrupt: {why}"),
                (Counter::IdemObjectCorrupt, stored_response_corrupt()),
            ),
            Fetched::Failed(why) => self.stored_response_error(
                host,
                &fetch.object,
                format!("cannot be fetched: {why}"),
                (
                    Counter::IdemObjectFetchFailed,
                    stored_response_unavailable(),
                ),
            ),
        }
    }

    /// A replay that cannot be served: logged, counted, answered (never run).
    fn stored_response_error<H: Host>(
        &self,
        host: &mut H,
        object: &ObjectRef,
        what: String,
        (counter, reply): (Counter, LocalReply),
    ) {
        log::warn!(
            "redis-guard: stored response object `{}` {what}",
            object.key
        );
        host.count(counter);
        host.send_local(&reply);
    }

    /// The response's last piece is being held (its store failed): free the
    /// key first; the piece goes out when the release lands, or at once
    /// (`Continue`) if it could not be sent.
    fn release_held_end<H: Host>(&mut self, host: &mut H) -> Action {
        self.release_before_end(host, None, 0);
        self.hold_if_ended(true, 0)
    }

    /// Sends the release; the response's end waits for it (`hold_if_ended`).
    fn release_before_end<H: Host>(&mut self, host: &mut H, expected: Option<usize>, seen: usize) {
        self.lock = match self.release(host, false) {
            Some(token) => Lock::Releasing {
                token,
                expected,
                seen,
                held: false,
            },
            None => Lock::Finished,
        };
    }

    fn on_release_reply<H: Host>(&mut self, host: &mut H, reply: &CalloutReply) {
        let noscript = reply.status == Some(200)
            && parse_reply(&reply.body)
                .ok()
                .as_ref()
                .and_then(Reply::error_kind)
                == Some("NOSCRIPT");
        if noscript {
            // Redis lost its scripts since: once more as EVAL (it caches it).
            if let Some(token) = self.send_release(host, false, true) {
                if let Lock::Releasing { token: t, .. } = &mut self.lock {
                    *t = token;
                }
                host.count(Counter::ScriptReloads);
                return;
            }
        }
        let held = matches!(self.lock, Lock::Releasing { held: true, .. });
        self.lock = Lock::Finished;
        if held {
            host.resume_response();
        }
    }

    /// Frees the lock (only if still ours) so a retry runs again. `detached`:
    /// the stream may be ending, so the call is issued as the root context.
    fn release<H: Host>(&mut self, host: &mut H, detached: bool) -> Option<u32> {
        self.lock = Lock::Finished;
        self.keyed.as_ref()?;
        host.count(Counter::IdemReleased);
        // EVALSHA when a reply will come back to fall back on after a
        // NOSCRIPT; a detached release gets no reply, so it carries the script.
        self.send_release(host, detached, detached)
    }

    fn send_release<H: Host>(&self, host: &mut H, detached: bool, eval: bool) -> Option<u32> {
        let keyed = self.keyed.as_ref()?;
        let script: &[u8] = if eval {
            IDEM_RELEASE.source.as_bytes()
        } else {
            IDEM_RELEASE.sha1.as_bytes()
        };
        let args: [&[u8]; 4] = [script, b"1", &keyed.args.key, keyed.args.owner.as_bytes()];
        let body = command_body(if eval { "EVAL" } else { "EVALSHA" }, &args);
        host.count(Counter::RedisCalls);
        let sent = if detached {
            host.dispatch_redis_detached(&self.config.redis, &body, self.config.redis.timeout)
        } else {
            host.dispatch_redis(&self.config.redis, &body, self.config.redis.timeout)
        };
        match sent {
            Ok(token) => Some(token),
            Err(e) => {
                log::warn!(
                    "redis-guard: cannot release idempotency lock (it expires by itself): {e}"
                );
                None
            }
        }
    }

    /// The stream is over (done, reset or aborted). A lock still held was
    /// never completed: release it now rather than at its TTL.
    pub fn on_stream_end<H: Host>(&mut self, host: &mut H) {
        // An upload's reply would come to this stream, which is gone: the
        // record will never be written, so the key is freed now.
        if matches!(
            self.lock,
            Lock::Held | Lock::Capturing { .. } | Lock::Uploading { .. }
        ) {
            self.release(host, true);
        }
        if matches!(
            self.phase,
            Phase::AwaitingRedis { .. } | Phase::RetryPending { .. }
        ) {
            // The call's answer will find no one: what it was holding for
            // others (the probe, the lease fetch) must not stay held.
            if self.probe {
                self.breaker.abandon_probe();
            }
            if let Some((i, _)) = self.leasing.take() {
                self.release_lease_claim(host, i);
            }
        }
    }
}

/// The request script said "completed" (verdict 3), whatever else it said.
fn completed_reply(reply: &Reply) -> bool {
    matches!(reply, Reply::Array(Some(items)) if items.first().and_then(Reply::as_int) == Some(3))
}

fn full_path(view: &dyn crate::request::RequestView) -> Vec<u8> {
    view.header(":path").unwrap_or_default()
}

/// What a request on a leased limit does (see [`lease::Step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lease {
    Spent(Option<u64>),
    Fetch(u64),
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

/// The answer to a background lease fetch: its grant joins the Envoy's
/// tokens; whatever else happened, the claim is released so the next spend
/// may try again.
pub fn on_prefetch_reply<H: Host>(host: &mut H, note: &Prefetch, reply: CalloutReply) {
    let granted = (reply.status == Some(200))
        .then(|| parse_reply(&reply.body).ok())
        .flatten()
        .and_then(|r| parse_lease(&r).ok())
        .map(|(_, granted)| granted);
    let Some(granted) = granted else {
        let kind = match reply.status {
            None => ErrorKind::Timeout,
            Some(200) => ErrorKind::Reply,
            Some(504) if !reply.from_webdis => ErrorKind::Timeout,
            Some(_) => ErrorKind::Http,
        };
        host.count(Counter::RedisError(kind));
        release_claim(host, &note.limit_key);
        return;
    };
    host.count(Counter::LeaseFetched);
    let slot = lease::Slot::of(&note.limit_key);
    let now_ms = millis(host.now());
    let expires = millis(note.sent_at + note.ttl);
    for _ in 0..8 {
        let (stored, cas) = host.shared_get(&slot.shared_key);
        let Some(bytes) = slot.granted(stored.as_deref(), granted, now_ms, expires, note.batch)
        else {
            log::info!("redis-guard: lease slot taken by another key; {granted} tokens dropped");
            return;
        };
        if host.shared_set(&slot.shared_key, &bytes, create_or_swap(cas)) {
            return;
        }
    }
    log::warn!("redis-guard: lease slot contended; {granted} tokens dropped");
}

fn release_claim<H: Host>(host: &mut H, limit_key: &[u8]) {
    let slot = lease::Slot::of(limit_key);
    for _ in 0..8 {
        let (stored, cas) = host.shared_get(&slot.shared_key);
        let Some(bytes) = slot.fetch_failed(stored.as_deref()) else {
            return;
        };
        if host.shared_set(&slot.shared_key, &bytes, create_or_swap(cas)) {
            return;
        }
    }
}

/// The compare-and-swap token for writing back what was read: the one read,
/// or, when the key did not exist, one no existing key carries. Envoy checks a
/// token only against a key that exists and writes a missing key whatever
/// the token, so without this two workers that both found the key missing
/// would both "create" it and one write would be lost (a local budget or a
/// lease counted twice). With it, the second creator fails and reads again.
fn create_or_swap(cas: Option<u32>) -> Option<u32> {
    Some(cas.unwrap_or(CREATE_ONLY))
}

/// Envoy hands out tokens from one counter starting at 1: this one is
/// reached only after four billion writes, and then matches one key at most.
const CREATE_ONLY: u32 = u32::MAX;

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RedisTarget;
    use crate::request::RequestView;
    use crate::response::LocalReply;
    use std::collections::HashMap;

    fn test_breaker() -> Rc<Breaker> {
        Rc::new(Breaker::new(1000, Duration::from_millis(1000)))
    }

    #[derive(Default)]
    struct FakeHost {
        headers: HashMap<String, Vec<u8>>,
        dispatched: Vec<String>,
        dispatch_fails: bool,
        sent: Vec<LocalReply>,
        resumed: usize,
        added: Vec<(String, String)>,
        counters: Vec<Counter>,
        clock_ms: u64,
        timeouts: Vec<Duration>,
        detached: Vec<String>,
        request_body: Vec<u8>,
        response: HashMap<String, Vec<u8>>,
        response_chunks: Vec<Vec<u8>>,
        response_resumed: usize,
        tokens: u32,
        shared: HashMap<String, (Vec<u8>, u32)>,
        retries_scheduled: Vec<Duration>,
        can_schedule: bool,
        prefetched: Vec<(String, Prefetch)>,
        /// Object-store calls; tokens from OBJECT_TOKENS.
        objects: Vec<ObjectCall>,
        object_dispatch_fails: bool,
    }

    /// An object-store call's headers and body.
    type ObjectCall = (Vec<(String, String)>, Option<Vec<u8>>);

    const OBJECT_TOKENS: u32 = 10_000;

    impl FakeHost {
        fn get(path: &str) -> FakeHost {
            let mut h = FakeHost::default();
            h.headers.insert(":method".into(), b"GET".to_vec());
            h.headers.insert(":path".into(), path.as_bytes().to_vec());
            h.headers
                .insert(":authority".into(), b"example.com".to_vec());
            h
        }
    }

    impl RequestView for FakeHost {
        fn header(&self, name: &str) -> Option<Vec<u8>> {
            self.headers.get(name).cloned()
        }
        fn client_address(&self) -> Option<String> {
            Some("127.0.0.1:1234".into())
        }
    }

    impl Host for FakeHost {
        fn dispatch_redis(
            &mut self,
            _: &RedisTarget,
            body: &[u8],
            timeout: Duration,
        ) -> Result<u32, String> {
            self.timeouts.push(timeout);
            if self.dispatch_fails {
                return Err("no cluster".into());
            }
            self.dispatched
                .push(String::from_utf8_lossy(body).into_owned());
            Ok(self.dispatched.len() as u32)
        }
        fn dispatch_object(
            &mut self,
            _: &crate::config::ObjectStore,
            headers: &[(String, String)],
            body: Option<&[u8]>,
            timeout: Duration,
        ) -> Result<u32, String> {
            self.timeouts.push(timeout);
            if self.dispatch_fails || self.object_dispatch_fails {
                return Err("no cluster".into());
            }
            self.objects
                .push((headers.to_vec(), body.map(<[u8]>::to_vec)));
            Ok(OBJECT_TOKENS + self.objects.len() as u32)
        }
        fn send_local(&mut self, reply: &LocalReply) {
            self.sent.push(reply.clone());
        }
        fn resume_request(&mut self) {
            self.resumed += 1;
        }
        fn add_response_header(&mut self, name: &str, value: &str) {
            self.added.push((name.into(), value.into()));
        }
        fn count(&mut self, counter: Counter) {
            self.counters.push(counter);
        }
        fn now(&self) -> Duration {
            Duration::from_millis(self.clock_ms)
        }
        fn dispatch_redis_detached(
            &mut self,
            _: &RedisTarget,
            body: &[u8],
            _: Duration,
        ) -> Result<u32, String> {
            self.detached
                .push(String::from_utf8_lossy(body).into_owned());
            Ok(1000 + self.detached.len() as u32)
        }
        fn dispatch_prefetch(
            &mut self,
            _: &RedisTarget,
            body: &[u8],
            _: Duration,
            note: Prefetch,
        ) -> Result<(), String> {
            self.prefetched
                .push((String::from_utf8_lossy(body).into_owned(), note));
            Ok(())
        }
        fn request_body(&mut self, size: usize) -> Vec<u8> {
            self.request_body[..size.min(self.request_body.len())].to_vec()
        }
        fn response_header(&self, name: &str) -> Option<Vec<u8>> {
            self.response.get(name).cloned()
        }
        fn response_header_values(&self, name: &str) -> Vec<Vec<u8>> {
            self.response.get(name).cloned().into_iter().collect()
        }
        fn response_body(&mut self, _size: usize) -> Vec<u8> {
            if self.response_chunks.is_empty() {
                Vec::new()
            } else {
                self.response_chunks.remove(0)
            }
        }
        fn resume_response(&mut self) {
            self.response_resumed += 1;
        }
        fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            match self.shared.get(key) {
                Some((v, cas)) => (Some(v.clone()), Some(*cas)),
                None => (None, None),
            }
        }
        fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
            // As Envoy: a token is checked only against a key that exists.
            let current = self.shared.get(key).map(|(_, c)| *c);
            if let (Some(want), Some(have)) = (cas, current) {
                if want != have {
                    return false;
                }
            }
            let next = current.unwrap_or(0) + 1;
            self.shared.insert(key.to_string(), (value.to_vec(), next));
            true
        }
        fn retry_later(&mut self, delay: Duration) -> bool {
            self.retries_scheduled.push(delay);
            self.can_schedule
        }
        fn unique_token(&mut self) -> String {
            self.tokens += 1;
            format!("owner-{}", self.tokens)
        }
    }

    fn flow(failure: &str) -> Flow {
        let cfg = Config::parse(
            format!(
                r#"{{"redis":{{"cluster":"webdis"}},"failureMode":"{failure}","limits":[
                {{"name":"a","match":{{"pathPrefix":"/api"}},"tokenBucket":{{"capacity":2,"refill":1,"periodMs":1000}}}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        Flow::new(Rc::new(cfg), test_breaker())
    }

    /// A rate-limited GET whose first Redis call (token 1) is in flight.
    fn started(failure: &str) -> (Flow, FakeHost) {
        let mut f = flow(failure);
        let mut h = FakeHost::get("/api/x");
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        (f, h)
    }

    fn ok(body: &[u8]) -> CalloutReply {
        CalloutReply {
            status: Some(200),
            from_webdis: true,
            body: body.to_vec(),
        }
    }

    /// A call that got no answer (timeout, reset, connection refused).
    fn no_answer() -> CalloutReply {
        CalloutReply {
            status: None,
            from_webdis: false,
            body: vec![],
        }
    }

    const ADMIT: &[u8] = b"*5\r\n$1\r\n1\r\n$1\r\n1\r\n$1\r\n1\r\n$1\r\n0\r\n$4\r\n1000\r\n";
    const REJECT: &[u8] = b"*5\r\n$1\r\n0\r\n$1\r\n0\r\n$1\r\n0\r\n$3\r\n400\r\n$3\r\n400\r\n";

    #[test]
    fn unmatched_requests_pass_without_a_redis_call() {
        let mut f = flow("allow");
        let mut h = FakeHost::get("/public");
        assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
        assert!(h.dispatched.is_empty());
    }

    #[test]
    fn admitted_request_resumes_and_gets_headers() {
        let mut f = flow("allow");
        let mut h = FakeHost::get("/api/x");
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.dispatched.len(), 1);
        assert!(h.dispatched[0].starts_with(&format!("EVALSHA/{}/1/rg%3Arl%3A%7B", RATELIMIT.sha1)));
        f.on_callout_reply(&mut h, 1, ok(ADMIT));
        assert_eq!(h.resumed, 1);
        assert!(h.sent.is_empty());
        f.on_response_headers(&mut h, false);
        assert!(h
            .added
            .iter()
            .any(|(n, v)| n == "x-ratelimit-remaining" && v == "1"));
        assert!(h.counters.contains(&Counter::Allowed(0)));
    }

    #[test]
    fn rejected_request_gets_429_and_is_not_resumed() {
        let (mut f, mut h) = started("allow");
        f.on_callout_reply(&mut h, 1, ok(REJECT));
        assert_eq!(h.resumed, 0);
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 429);
        assert!(h.sent[0]
            .headers
            .iter()
            .any(|(n, v)| n == "retry-after" && v == "1"));
        assert!(h.counters.contains(&Counter::Rejected(0)));
    }

    #[test]
    fn noscript_falls_back_to_eval_once() {
        let (mut f, mut h) = started("deny");
        f.on_callout_reply(&mut h, 1, ok(b"-NOSCRIPT No matching script.\r\n"));
        assert_eq!(h.dispatched.len(), 2);
        assert!(h.dispatched[1].starts_with("EVAL/"));
        assert!(h.dispatched[1].contains("%2D%2D%5B%5B%20redis%2Dguard"));
        // A second NOSCRIPT (impossible after EVAL, but never loop) is a failure.
        f.on_callout_reply(&mut h, 2, ok(b"-NOSCRIPT again\r\n"));
        assert_eq!(h.dispatched.len(), 2);
        assert_eq!(h.sent[0].status, 503);
    }

    #[test]
    fn stale_tokens_are_ignored() {
        let (mut f, mut h) = started("allow");
        f.on_callout_reply(&mut h, 99, ok(ADMIT));
        assert_eq!(h.resumed, 0);
        f.on_callout_reply(&mut h, 1, ok(ADMIT));
        assert_eq!(h.resumed, 1);
        f.on_callout_reply(&mut h, 1, ok(ADMIT));
        assert_eq!(h.resumed, 1, "a reply after the decision changes nothing");
    }

    #[test]
    fn failures_follow_the_failure_mode() {
        let bad_replies = [
            no_answer(),
            CalloutReply {
                status: Some(502),
                from_webdis: false,
                body: vec![],
            },
            // Envoy's own 503 (reset after the command may have run): no retry.
            CalloutReply {
                status: Some(503),
                from_webdis: false,
                body: vec![],
            },
            CalloutReply {
                status: Some(403),
                from_webdis: true,
                body: b"forbidden".to_vec(),
            },
            ok(b"-BUSY Redis is busy running a script\r\n"),
            ok(b"{\"EVALSHA\":[1]}"),
            ok(b"*1\r\n$1\r\n1\r\n"),
            ok(b"*5\r\n$1\r\n1\r\n"),
        ];
        for reply in bad_replies {
            let (mut f, mut h) = started("allow");
            f.on_callout_reply(&mut h, 1, reply.clone());
            assert_eq!((h.resumed, h.sent.len()), (1, 0), "allow on {reply:?}");
            assert!(h.counters.contains(&Counter::FailureAllowed));

            let (mut f, mut h) = started("deny");
            f.on_callout_reply(&mut h, 1, reply.clone());
            assert_eq!(h.resumed, 0, "deny on {reply:?}");
            assert_eq!(h.sent.len(), 1);
            assert_eq!(h.sent[0].status, 503);
        }
    }

    #[test]
    fn trailers_end_a_keyed_request_body() {
        let cfg = Config::parse(
            br#"{"redis":{"cluster":"w"},"idempotency":[{"name":"pay","match":{"pathPrefix":"/pay"}}]}"#,
        )
        .unwrap();
        let mut f = Flow::new(Rc::new(cfg), test_breaker());
        let mut h = FakeHost::get("/pay");
        h.headers.insert(":method".into(), b"POST".to_vec());
        h.headers.insert("idempotency-key".into(), b"k1".to_vec());
        h.request_body = b"body".to_vec();
        assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
        assert_eq!(f.on_request_body(&mut h, 4, false), Action::Pause);
        assert!(h.dispatched.is_empty());
        assert_eq!(f.on_request_trailers(&mut h), Action::Pause);
        assert_eq!(h.dispatched.len(), 1);
        assert!(
            h.dispatched[0].contains(&crate::idempotency::fingerprint("POST", b"/pay", b"body"))
        );
    }

    #[test]
    fn an_open_breaker_sends_requests_to_the_failure_mode_without_a_call() {
        let cfg = Config::parse(
            br#"{"redis":{"cluster":"w"},"failureMode":"deny","limits":[
                {"name":"a","tokenBucket":{"capacity":5,"refill":1,"periodMs":1000}}]}"#,
        )
        .unwrap();
        let cfg = Rc::new(cfg);
        let breaker = Rc::new(Breaker::new(2, Duration::from_millis(100)));
        let mut h = FakeHost::get("/");
        for token in 1..=2 {
            let mut f = Flow::new(cfg.clone(), breaker.clone());
            assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
            f.on_callout_reply(&mut h, token, no_answer());
        }
        assert_eq!(count(&h, Counter::CircuitOpened), 1);
        assert_eq!(
            count(&h, Counter::CircuitTripped),
            1,
            "the gauge rises once"
        );
        assert_eq!(count(&h, Counter::RedisError(ErrorKind::Timeout)), 2);
        let calls = h.dispatched.len();
        let mut f = Flow::new(cfg.clone(), breaker.clone());
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.dispatched.len(), calls, "no call while open");
        assert_eq!(h.sent.last().map(|r| r.status), Some(503));
        assert!(h.counters.contains(&Counter::CircuitShortCircuited));
        // After the cool-down one request probes; its success closes the breaker.
        h.clock_ms = 100;
        let mut probe = Flow::new(cfg.clone(), breaker.clone());
        assert_eq!(probe.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.dispatched.len(), calls + 1);
        let mut other = Flow::new(cfg.clone(), breaker.clone());
        other.on_request_headers(&mut h, true);
        assert_eq!(h.dispatched.len(), calls + 1, "one probe at a time");
        probe.on_callout_reply(&mut h, (calls + 1) as u32, ok(ADMIT));
        assert_eq!(count(&h, Counter::CircuitClosed), 1, "the gauge falls once");
        let mut after = Flow::new(cfg, breaker);
        after.on_request_headers(&mut h, true);
        assert_eq!(h.dispatched.len(), calls + 2, "closed again");
        after.on_callout_reply(&mut h, (calls + 2) as u32, ok(ADMIT));
        assert_eq!(count(&h, Counter::CircuitClosed), 1, "closed stays closed");
        // The short-circuited requests were no Redis errors.
        assert_eq!(count(&h, Counter::RedisError(ErrorKind::Timeout)), 2);
    }

    /// One token bucket of 5 on every path.
    fn bucket_of_five(failure: &str) -> Rc<Config> {
        let json = format!(
            r#"{{"redis":{{"cluster":"w"}},"failureMode":"{failure}","limits":[
            {{"name":"a","tokenBucket":{{"capacity":5,"refill":1,"periodMs":1000}}}}]}}"#
        );
        Rc::new(Config::parse(json.as_bytes()).unwrap())
    }

    #[test]
    fn a_probe_whose_client_left_lets_the_next_request_probe() {
        let cfg = bucket_of_five("allow");
        let breaker = Rc::new(Breaker::new(1, Duration::from_millis(100)));
        let mut h = FakeHost::get("/");
        let mut f = Flow::new(cfg.clone(), breaker.clone());
        f.on_request_headers(&mut h, true);
        f.on_callout_reply(&mut h, 1, no_answer());
        h.clock_ms = 100;
        let mut probe = Flow::new(cfg.clone(), breaker.clone());
        assert_eq!(probe.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.dispatched.len(), 2, "the probe calls");
        probe.on_stream_end(&mut h);
        let mut next = Flow::new(cfg, breaker);
        assert_eq!(next.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.dispatched.len(), 3, "the next request probes");
    }

    #[test]
    fn each_failure_is_counted_by_its_kind() {
        let cfg = bucket_of_five("allow");
        let reply = |status: Option<u32>, body: &[u8]| CalloutReply {
            status,
            from_webdis: status.is_some(),
            body: body.to_vec(),
        };
        let cases = [
            (reply(None, b""), ErrorKind::Timeout),
            (reply(Some(500), b""), ErrorKind::Http),
            (
                CalloutReply {
                    status: Some(504),
                    from_webdis: false,
                    body: b"upstream request timeout".to_vec(),
                },
                ErrorKind::Timeout,
            ),
            (
                reply(Some(200), b"-OOM command not allowed\r\n"),
                ErrorKind::Redis,
            ),
            (reply(Some(200), b"?garbage"), ErrorKind::Reply),
            (reply(Some(200), b":7\r\n"), ErrorKind::Reply),
        ];
        for (reply, kind) in cases {
            let mut h = FakeHost::get("/");
            let mut f = Flow::new(cfg.clone(), test_breaker());
            assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
            f.on_callout_reply(&mut h, 1, reply);
            let kinds: Vec<Counter> = h
                .counters
                .iter()
                .copied()
                .filter(|c| matches!(c, Counter::RedisError(_)))
                .collect();
            assert_eq!(kinds, vec![Counter::RedisError(kind)]);
            assert_eq!(count(&h, Counter::FailureAllowed), 1);
        }
        let mut h = FakeHost::get("/");
        h.dispatch_fails = true;
        let mut f = Flow::new(cfg, test_breaker());
        assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
        assert_eq!(count(&h, Counter::RedisError(ErrorKind::Dispatch)), 1);
    }

    #[test]
    fn local_mode_spends_a_per_envoy_budget_when_redis_fails() {
        let cfg = Config::parse(
            br#"{"redis":{"cluster":"w"},"limits":[{"name":"a","failureMode":"local","localFraction":0.5,
                "descriptor":["method"],"tokenBucket":{"capacity":4,"refill":1,"periodMs":60000}}]}"#,
        )
        .unwrap();
        let cfg = Rc::new(cfg);
        let mut h = FakeHost::get("/");
        h.dispatch_fails = true;
        let mut statuses = Vec::new();
        for _ in 0..4 {
            let mut f = Flow::new(cfg.clone(), test_breaker());
            match f.on_request_headers(&mut h, true) {
                Action::Continue => statuses.push(200),
                Action::Pause => statuses.push(h.sent.last().map_or(0, |r| r.status)),
            }
        }
        assert_eq!(statuses, [200, 200, 429, 429], "half of capacity 4");
        assert_eq!(count(&h, Counter::LocalAllowed), 2);
        assert_eq!(count(&h, Counter::LocalRejected), 2);
        let reply = h.sent.last().unwrap();
        assert!(reply
            .headers
            .iter()
            .any(|(n, v)| n == "retry-after" && v == "60"));
        assert_eq!(h.shared.len(), 1, "one budget per descriptor");
    }

    #[test]
    fn limits_and_the_idempotency_record_share_one_hash_tag() {
        let cfg = Config::parse(
            br#"{"redis":{"cluster":"w"},"hashTag":[{"header":"x-tenant"}],
                "limits":[{"name":"a","descriptor":[{"header":"x-tenant"}],
                           "tokenBucket":{"capacity":5,"refill":1,"periodMs":1000}}],
                "idempotency":[{"name":"pay","match":{"pathPrefix":"/pay"},
                                "tenant":[{"header":"x-tenant"}]}]}"#,
        )
        .unwrap();
        let mut f = Flow::new(Rc::new(cfg), test_breaker());
        let mut h = FakeHost::get("/pay");
        h.headers.insert(":method".into(), b"POST".to_vec());
        h.headers.insert("x-tenant".into(), b"acme".to_vec());
        h.headers.insert("idempotency-key".into(), b"k1".to_vec());
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.dispatched.len(), 1, "one round trip for both");
        let call = &h.dispatched[0];
        let tags: Vec<&str> = call
            .split("%7B")
            .skip(1)
            .map(|rest| &rest[..rest.find("%7D").unwrap()])
            .collect();
        assert_eq!(tags.len(), 2, "{call}");
        assert_eq!(tags[0], tags[1], "one slot in Redis Cluster");
    }

    #[test]
    fn a_webdis_503_is_retried_after_a_pause_when_the_host_can_wait() {
        let mut f = flow("deny");
        let mut h = FakeHost::get("/api/x");
        h.can_schedule = true;
        f.on_request_headers(&mut h, true);
        f.on_callout_reply(
            &mut h,
            1,
            CalloutReply {
                status: Some(503),
                from_webdis: true,
                body: vec![],
            },
        );
        assert_eq!(h.retries_scheduled, [RETRY_DELAY]);
        assert_eq!(
            h.dispatched.len(),
            1,
            "nothing sent before the pause is over"
        );
        f.on_retry_due(&mut h);
        assert_eq!(h.dispatched.len(), 2);
        assert_eq!(h.dispatched[0], h.dispatched[1]);
        f.on_callout_reply(&mut h, 2, ok(ADMIT));
        assert_eq!((h.resumed, h.sent.len()), (1, 0));
        f.on_retry_due(&mut h);
        assert_eq!(h.dispatched.len(), 2, "a stale timer changes nothing");
    }

    #[test]
    fn a_webdis_503_is_retried_once_then_fails() {
        let unavailable = || CalloutReply {
            status: Some(503),
            from_webdis: true,
            body: vec![],
        };
        let (mut f, mut h) = started("deny");
        f.on_callout_reply(&mut h, 1, unavailable());
        assert_eq!(h.dispatched.len(), 2);
        assert_eq!(h.dispatched[0], h.dispatched[1], "the same command again");
        f.on_callout_reply(&mut h, 2, ok(ADMIT));
        assert_eq!((h.resumed, h.sent.len()), (1, 0));

        let (mut f, mut h) = started("deny");
        f.on_callout_reply(&mut h, 1, unavailable());
        f.on_callout_reply(&mut h, 2, unavailable());
        assert_eq!(h.dispatched.len(), 2, "one retry only");
        assert_eq!(h.sent[0].status, 503);
    }

    #[test]
    fn a_rejection_is_answered_from_the_over_limit_cache_until_redis_said() {
        let (mut f, mut h) = started("deny");
        h.clock_ms = 10;
        f.on_callout_reply(&mut h, 1, ok(REJECT));
        assert_eq!(h.sent[0].status, 429);
        assert_eq!(h.shared.len(), 1, "one entry for the rejecting key");
        // Until sent + retry_ms - 1 (0 + 400 - 1: Redis' clock is whole ms),
        // every worker answers alone.
        for at in [10, 200, 398] {
            h.clock_ms = at;
            let mut g = flow("deny");
            assert_eq!(g.on_request_headers(&mut h, true), Action::Pause);
            assert_eq!(h.dispatched.len(), 1, "no call at {at} ms");
            let reply = h.sent.last().unwrap();
            assert_eq!(reply.status, 429);
            let retry_after = reply
                .headers
                .iter()
                .find(|(n, _)| n == "retry-after")
                .map(|(_, v)| v.as_str());
            assert_eq!(retry_after, Some("1"));
        }
        assert_eq!(count(&h, Counter::OverLimitCached), 3);
        assert_eq!(count(&h, Counter::Rejected(0)), 4);
        // From T on, Redis decides again.
        h.clock_ms = 399;
        let mut g = flow("deny");
        g.on_request_headers(&mut h, true);
        assert_eq!(h.dispatched.len(), 2);
    }

    #[test]
    fn the_over_limit_cache_leaves_cheaper_keyed_and_shadow_requests_to_redis() {
        let cfg = Rc::new(
            Config::parse(
                br#"{"redis":{"cluster":"w"},"limits":[
                {"name":"a","tokenBucket":{"capacity":5,"refill":1,"periodMs":1000},
                 "costHeader":{"name":"x-cost","max":5}},
                {"name":"s","shadow":true,"tokenBucket":{"capacity":1,"refill":1,"periodMs":1000}}],
                "idempotency":[{"name":"p","match":{"pathPrefix":"/"}}]}"#,
            )
            .unwrap(),
        );
        // Cost 3 rejected until 400 ms; the shadow limit would reject too.
        let two = b"*9\r\n:0\r\n:0\r\n:2\r\n:400\r\n:400\r\n:0\r\n:0\r\n:900\r\n:900\r\n";
        let mut h = FakeHost::get("/x");
        h.headers.insert("x-cost".into(), b"3".to_vec());
        let mut f = Flow::new(cfg.clone(), test_breaker());
        f.on_request_headers(&mut h, true);
        f.on_callout_reply(&mut h, 1, ok(two));
        assert_eq!(h.sent[0].status, 429);
        assert_eq!(
            h.shared.len(),
            1,
            "the shadow limit's verdict is not cached"
        );
        let send = |h: &mut FakeHost, cost: &[u8]| {
            h.headers.insert("x-cost".into(), cost.to_vec());
            let mut g = Flow::new(cfg.clone(), test_breaker());
            g.on_request_headers(h, true);
        };
        send(&mut h, b"3");
        assert_eq!(h.dispatched.len(), 1, "cost 3: cached");
        send(&mut h, b"5");
        assert_eq!(h.dispatched.len(), 1, "cost 5: cached");
        send(&mut h, b"2");
        assert_eq!(h.dispatched.len(), 2, "cost 2 may fit: Redis decides");
        // A keyed POST may be owed a replay: Redis decides.
        let mut k = FakeHost::post("/x", b"key-1");
        k.shared = h.shared.clone();
        k.headers.insert("x-cost".into(), b"3".to_vec());
        let mut g = Flow::new(cfg, test_breaker());
        g.on_request_headers(&mut k, true);
        assert_eq!(k.dispatched.len(), 1);
    }

    /// One token bucket of 100, leased 3 tokens at a time for 500 ms.
    fn leased_config(failure: &str) -> Rc<Config> {
        let json = format!(
            r#"{{"redis":{{"cluster":"w"}},"failureMode":"{failure}","limits":[
            {{"name":"a","tokenBucket":{{"capacity":100,"refill":1,"periodMs":1000}},
             "lease":{{"tokens":3,"ttlMs":500}}}}]}}"#
        );
        Rc::new(Config::parse(json.as_bytes()).unwrap())
    }

    #[test]
    fn a_leased_limit_spends_its_grant_locally_and_fetches_one_at_a_time() {
        let cfg = leased_config("deny");
        let mut h = FakeHost::get("/x");
        let mut first = Flow::new(cfg.clone(), test_breaker());
        assert_eq!(first.on_request_headers(&mut h, true), Action::Pause);
        assert!(h.dispatched[0].starts_with("EVALSHA/"));
        assert!(h.dispatched[0].contains(&LEASE.sha1), "the lease script");
        // While it is out, another worker's request goes the strict way.
        let mut other = Flow::new(cfg.clone(), test_breaker());
        other.on_request_headers(&mut h, true);
        assert!(h.dispatched[1].contains(&RATELIMIT.sha1));
        // Admitted, 3 more tokens granted at t=0: good until 500 ms.
        first.on_callout_reply(
            &mut h,
            1,
            ok(b"*6\r\n:1\r\n:1\r\n:96\r\n:0\r\n:4000\r\n:3\r\n"),
        );
        assert_eq!(h.resumed, 1);
        assert_eq!(count(&h, Counter::LeaseFetched), 1);
        for _ in 0..3 {
            let mut f = Flow::new(cfg.clone(), test_breaker());
            assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
        }
        assert_eq!(h.dispatched.len(), 2, "three requests, no call");
        assert_eq!(count(&h, Counter::LeaseSpent), 3);
        assert_eq!(count(&h, Counter::Allowed(0)), 4);
        // The second spend ran the batch below its low-water mark (2 of 3):
        // it started a background fetch (cost 0) of the 2 that top it up.
        assert_eq!(h.prefetched.len(), 1);
        let (body, note) = h.prefetched[0].clone();
        assert!(body.starts_with(&format!("EVALSHA/{}/1/", LEASE.sha1)));
        assert!(body.ends_with("/100/1/1000/0/2.raw"), "{body}");
        // Nothing to spend while it is out: Redis decides, strictly.
        let mut next = Flow::new(cfg.clone(), test_breaker());
        assert_eq!(next.on_request_headers(&mut h, true), Action::Pause);
        assert!(h.dispatched[2].contains(&RATELIMIT.sha1));
        // The grant lands whatever became of the request that asked.
        on_prefetch_reply(
            &mut h,
            &note,
            ok(b"*6\r\n:1\r\n:1\r\n:92\r\n:0\r\n:8000\r\n:3\r\n"),
        );
        assert_eq!(count(&h, Counter::LeaseFetched), 2);
        let mut spend = Flow::new(cfg.clone(), test_breaker());
        assert_eq!(spend.on_request_headers(&mut h, true), Action::Continue);
        assert_eq!(h.dispatched.len(), 3);
        // A grant lapses with its lease (sent at 0, 500 ms): then this
        // request fetches.
        h.clock_ms = 500;
        let mut late = Flow::new(cfg.clone(), test_breaker());
        assert_eq!(late.on_request_headers(&mut h, true), Action::Pause);
        assert!(h.dispatched[3].contains(&LEASE.sha1));
        // A rejected fetch grants nothing and frees the claim.
        late.on_callout_reply(
            &mut h,
            4,
            ok(b"*6\r\n:0\r\n:0\r\n:0\r\n:700\r\n:700\r\n:0\r\n"),
        );
        assert_eq!(h.sent.last().map(|r| r.status), Some(429));
        h.clock_ms = 1_300;
        let mut after = Flow::new(cfg, test_breaker());
        assert_eq!(after.on_request_headers(&mut h, true), Action::Pause);
        assert!(
            h.dispatched[4].contains(&LEASE.sha1),
            "the claim was released"
        );
    }

    #[test]
    fn leased_tokens_are_spent_even_when_redis_is_known_to_be_empty() {
        let cfg = leased_config("deny");
        let mut h = FakeHost::get("/x");
        let mut first = Flow::new(cfg.clone(), test_breaker());
        first.on_request_headers(&mut h, true);
        first.on_callout_reply(
            &mut h,
            1,
            ok(b"*6\r\n:1\r\n:1\r\n:0\r\n:0\r\n:4000\r\n:2\r\n"),
        );
        // Another worker's strict call learnt the bucket is empty for a while.
        let key = first.plan.checks[0].key.clone();
        let slot = Slot::of(&key);
        h.shared.insert(
            slot.shared_key.clone(),
            (slot.entry(0, 1_000, 1, 0).encode(), 1),
        );
        let statuses: Vec<Action> = (0..3)
            .map(|_| Flow::new(cfg.clone(), test_breaker()).on_request_headers(&mut h, true))
            .collect();
        assert_eq!(
            statuses[..2],
            [Action::Continue, Action::Continue],
            "the 2 held tokens"
        );
        assert_eq!(statuses[2], Action::Pause, "then the cached 429");
        assert_eq!(h.sent.last().map(|r| r.status), Some(429));
        assert_eq!(h.dispatched.len(), 1);
    }

    #[test]
    fn a_worker_that_found_a_key_missing_cannot_overwrite_one_created_meanwhile() {
        let mut h = FakeHost::get("/");
        // Worker A read "missing", then worker B created the key.
        let (stored, cas) = h.shared_get("k");
        assert_eq!((stored, cas), (None, None));
        assert!(h.shared_set("k", b"b", create_or_swap(None)));
        assert!(
            !h.shared_set("k", b"a", create_or_swap(cas)),
            "A must read again"
        );
        let (stored, cas) = h.shared_get("k");
        assert_eq!(stored.as_deref(), Some(&b"b"[..]));
        assert!(h.shared_set("k", b"a", create_or_swap(cas)));
    }

    #[test]
    fn a_failed_background_fetch_frees_the_claim() {
        let note = Prefetch {
            limit_key: b"k".to_vec(),
            ttl: Duration::from_millis(500),
            sent_at: Duration::ZERO,
            batch: 4,
        };
        let slot = lease::Slot::of(b"k");
        let mut h = FakeHost::get("/");
        let claimed = match slot.step(None, 1, 0, 1_000, 4, true) {
            lease::Step::Fetch { bytes, .. } => bytes,
            other => panic!("{other:?}"),
        };
        h.shared.insert(slot.shared_key.clone(), (claimed, 1));
        let stored = || h.shared.get(&slot.shared_key).map(|(v, _)| v.clone());
        assert_eq!(
            slot.step(stored().as_deref(), 1, 10, 1_000, 4, true),
            lease::Step::Strict
        );
        on_prefetch_reply(&mut h, &note, no_answer());
        let stored = h.shared.get(&slot.shared_key).map(|(v, _)| v.clone());
        assert!(matches!(
            slot.step(stored.as_deref(), 1, 10, 1_000, 4, true),
            lease::Step::Fetch { .. }
        ));
        assert_eq!(count(&h, Counter::RedisError(ErrorKind::Timeout)), 1);
        assert_eq!(count(&h, Counter::LeaseFetched), 0);
    }

    #[test]
    fn a_failed_lease_fetch_frees_the_claim() {
        let cfg = leased_config("allow");
        let mut h = FakeHost::get("/x");
        let mut f = Flow::new(cfg.clone(), test_breaker());
        f.on_request_headers(&mut h, true);
        f.on_callout_reply(&mut h, 1, no_answer());
        let mut g = Flow::new(cfg, test_breaker());
        g.on_request_headers(&mut h, true);
        assert!(
            h.dispatched[1].contains(&LEASE.sha1),
            "not left to strict calls"
        );
    }

    #[test]
    fn a_cluster_refusal_before_the_script_ran_is_retried_not_no_answer() {
        for refusal in [
            &b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n"[..],
            b"-CLUSTERDOWN The cluster is down\r\n",
            b"-LOADING Redis is loading the dataset in memory\r\n",
        ] {
            let mut f = flow("deny");
            let mut h = FakeHost::get("/api/x");
            h.can_schedule = true;
            f.on_request_headers(&mut h, true);
            f.on_callout_reply(&mut h, 1, ok(refusal));
            assert_eq!(h.retries_scheduled, [RETRY_DELAY]);
            f.on_retry_due(&mut h);
            assert_eq!(h.dispatched.len(), 2);
            assert_eq!(h.dispatched[0], h.dispatched[1], "the same command again");
            f.on_callout_reply(&mut h, 2, ok(ADMIT));
            assert_eq!((h.resumed, h.sent.len()), (1, 0));
            assert_eq!(count(&h, Counter::RedisRetries), 1);
            assert!(!h
                .counters
                .iter()
                .any(|c| matches!(c, Counter::RedisError(_))));
        }
        // Other error replies are failures at once.
        let (mut f, mut h) = started("deny");
        f.on_callout_reply(&mut h, 1, ok(b"-OOM command not allowed\r\n"));
        assert_eq!(h.dispatched.len(), 1);
        assert_eq!(h.sent[0].status, 503);
        assert_eq!(count(&h, Counter::RedisError(ErrorKind::Redis)), 1);
    }

    #[test]
    fn every_attempt_shares_the_one_timeout() {
        // timeoutMs is 50 (the default): EVALSHA at t=0 gets 50 ms; a
        // NOSCRIPT answer at t=30 leaves the EVAL 20 ms; at t=50 nothing is left.
        let (mut f, mut h) = started("deny");
        h.clock_ms = 30;
        f.on_callout_reply(&mut h, 1, ok(b"-NOSCRIPT No matching script.\r\n"));
        assert_eq!(
            h.timeouts,
            [Duration::from_millis(50), Duration::from_millis(20)]
        );

        let (mut f, mut h) = started("deny");
        h.clock_ms = 50;
        f.on_callout_reply(&mut h, 1, ok(b"-NOSCRIPT No matching script.\r\n"));
        assert_eq!(h.dispatched.len(), 1, "no attempt past the deadline");
        assert_eq!(h.sent[0].status, 503);
    }

    #[test]
    fn dispatch_failure_decides_at_once() {
        let mut f = flow("allow");
        let mut h = FakeHost::get("/api/x");
        h.dispatch_fails = true;
        assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
        assert_eq!(h.resumed, 0, "nothing to resume: the request never paused");

        let mut f = flow("deny");
        let mut h = FakeHost::get("/api/x");
        h.dispatch_fails = true;
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.sent[0].status, 503);
    }

    #[test]
    fn bad_cost_header_is_a_400_before_any_redis_call() {
        let cfg = Config::parse(
            br#"{"redis":{"cluster":"w"},"limits":[{"name":"a","costHeader":{"name":"x-cost","max":3},
                "tokenBucket":{"capacity":5,"refill":1,"periodMs":1000}}]}"#,
        )
        .unwrap();
        let mut f = Flow::new(Rc::new(cfg), test_breaker());
        let mut h = FakeHost::get("/");
        h.headers.insert("x-cost".into(), b"4".to_vec());
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.sent[0].status, 400);
        assert!(h.dispatched.is_empty());
    }

    // ---- Idempotency keys -------------------------------------------------

    const IDEM_CONFIG: &str = r#"{"redis":{"cluster":"webdis"},"idempotency":[{"name":"pay",
        "match":{"pathPrefix":"/pay"},"maxRequestBodyBytes":10,"maxStoredBodyBytes":20,
        "required":true,"failureMode":"FAILURE"}]}"#;

    /// `[1]`: admitted, lock taken (no rate limits apply).
    const IDEM_ADMIT: &[u8] = b"*1\r\n$1\r\n1\r\n";

    fn idem_config(failure: &str) -> Rc<Config> {
        Rc::new(Config::parse(IDEM_CONFIG.replace("FAILURE", failure).as_bytes()).unwrap())
    }

    fn idem_flow(failure: &str) -> Flow {
        Flow::new(idem_config(failure), test_breaker())
    }

    impl FakeHost {
        fn keyed(method: &str, path: &str, key: Option<&[u8]>) -> FakeHost {
            let mut h = FakeHost::get(path);
            h.headers
                .insert(":method".into(), method.as_bytes().to_vec());
            if let Some(key) = key {
                h.headers.insert("idempotency-key".into(), key.to_vec());
            }
            h
        }

        fn post(path: &str, key: &[u8]) -> FakeHost {
            FakeHost::keyed("POST", path, Some(key))
        }

        fn respond(&mut self, headers: &[(&str, &str)]) {
            for (name, value) in headers {
                self.response
                    .insert((*name).to_string(), value.as_bytes().to_vec());
            }
        }
    }

    /// The record key the filter must use for this request.
    fn expected_record_key(cfg: &Config, h: &FakeHost, key: &[u8]) -> Vec<u8> {
        let line = RequestLine::read(h);
        let tag = cfg.hash_tag_for(&line, h);
        record_key(&cfg.key_prefix, &tag, &cfg.idempotency[0], b"", key)
    }

    fn text(body: Vec<u8>) -> String {
        String::from_utf8(body).unwrap()
    }

    /// One argument as it appears in a Webdis command body.
    fn enc(arg: &[u8]) -> String {
        let body = text(command_body("X", &[arg]));
        body["X/".len()..body.len() - ".raw".len()].to_string()
    }

    fn request_call(key: &[u8], owner: &str, fp: &str) -> String {
        text(command_body(
            "EVALSHA",
            &[
                RATELIMIT.sha1.as_bytes(),
                b"1",
                key,
                b"0",
                b"1",
                owner.as_bytes(),
                fp.as_bytes(),
                b"30000",
            ],
        ))
    }

    fn complete_call(key: &[u8], status: &str, headers: &[(&str, &[u8])], body: &[u8]) -> String {
        let headers: Vec<(String, Vec<u8>)> = headers
            .iter()
            .map(|(n, v)| ((*n).to_string(), v.to_vec()))
            .collect();
        text(command_body(
            "EVALSHA",
            &[
                IDEM_COMPLETE.sha1.as_bytes(),
                b"1",
                key,
                b"owner-1",
                status.as_bytes(),
                &encode_headers(&headers),
                body,
                b"86400000",
            ],
        ))
    }

    /// The release a response sends (a reply comes back: EVALSHA).
    fn release_call(key: &[u8]) -> String {
        text(command_body(
            "EVALSHA",
            &[IDEM_RELEASE.sha1.as_bytes(), b"1", key, b"owner-1"],
        ))
    }

    /// The release a stream's end sends as the root (no reply: EVAL).
    fn detached_release_call(key: &[u8]) -> String {
        text(command_body(
            "EVAL",
            &[IDEM_RELEASE.source.as_bytes(), b"1", key, b"owner-1"],
        ))
    }

    /// A RESP array of bulk strings, as Webdis' `.raw` output carries it.
    fn resp(items: &[&[u8]]) -> Vec<u8> {
        let mut out = format!("*{}\r\n", items.len()).into_bytes();
        for item in items {
            out.extend_from_slice(format!("${}\r\n", item.len()).as_bytes());
            out.extend_from_slice(item);
            out.extend_from_slice(b"\r\n");
        }
        out
    }

    /// A keyed POST without a body, admitted: the lock is held. Returns the
    /// record key.
    fn admitted(f: &mut Flow, h: &mut FakeHost, cfg: &Config) -> Vec<u8> {
        let key = expected_record_key(cfg, h, b"abc-123");
        assert_eq!(f.on_request_headers(h, true), Action::Pause);
        assert_eq!(h.dispatched.len(), 1);
        f.on_callout_reply(h, 1, ok(IDEM_ADMIT));
        assert_eq!(h.resumed, 1);
        assert!(h.sent.is_empty());
        assert!(h.counters.contains(&Counter::IdemAcquired));
        key
    }

    /// A keyed POST to /pay (no body) whose decision (token 1) is in flight.
    fn keyed_in_flight(failure: &str) -> (Flow, FakeHost) {
        let mut f = idem_flow(failure);
        let mut h = FakeHost::post("/pay", b"abc-123");
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.dispatched.len(), 1);
        (f, h)
    }

    /// A keyed POST to /pay whose lock is held: the flow, its host, the key.
    fn holding(failure: &str) -> (Flow, FakeHost, Vec<u8>) {
        let cfg = idem_config(failure);
        let mut f = Flow::new(cfg.clone(), test_breaker());
        let mut h = FakeHost::post("/pay", b"abc-123");
        let key = admitted(&mut f, &mut h, &cfg);
        (f, h, key)
    }

    fn count(h: &FakeHost, c: Counter) -> usize {
        h.counters.iter().filter(|&&x| x == c).count()
    }

    /// The last call is the owner's release of `key`, the response's end
    /// waits for it, and goes out once it lands; the client gets the
    /// upstream's response, not a local one.
    #[track_caller]
    fn release_lands(f: &mut Flow, h: &mut FakeHost, key: &[u8]) {
        let token = h.dispatched.len();
        assert_eq!(h.dispatched[token - 1], release_call(key));
        assert_eq!(count(h, Counter::IdemReleased), 1);
        assert_eq!(h.response_resumed, 0, "held until the release lands");
        f.on_callout_reply(h, token as u32, ok(b":1\r\n"));
        assert_eq!(h.response_resumed, 1);
        assert!(h.sent.is_empty());
    }

    #[test]
    fn keyed_post_without_body_dispatches_one_evalsha_with_record_key_and_fingerprint() {
        let cfg = idem_config("allow");
        let mut f = Flow::new(cfg.clone(), test_breaker());
        let mut h = FakeHost::post("/pay/1?x=1", b"abc-123");
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.dispatched.len(), 1);

        let key = expected_record_key(&cfg, &h, b"abc-123");
        let key_text = String::from_utf8(key.clone()).unwrap();
        assert!(key_text.starts_with("rg:idem:{"), "{key_text}");
        assert!(key_text.ends_with("}:pay::7:abc-123"), "{key_text}");
        // The fingerprint covers the query string and the (empty) body.
        let fp = fingerprint("POST", b"/pay/1?x=1", b"");
        assert!(h.dispatched[0].contains(&enc(&key)));
        assert!(h.dispatched[0].contains(&fp));
        assert_eq!(h.dispatched[0], request_call(&key, "owner-1", &fp));
        assert_eq!(count(&h, Counter::RedisCalls), 1);
        assert!(h.sent.is_empty());
        assert_eq!(h.resumed, 0);
    }

    #[test]
    fn keyed_post_with_body_is_decided_once_the_body_is_complete() {
        let cfg = idem_config("allow");
        let mut f = Flow::new(cfg.clone(), test_breaker());
        let mut h = FakeHost::post("/pay/1", b"abc-123");
        h.request_body = b"{\"a\":12}".to_vec();
        assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
        assert!(h.dispatched.is_empty(), "nothing before the body is read");
        assert_eq!(f.on_request_body(&mut h, 3, false), Action::Pause);
        assert_eq!(f.on_request_body(&mut h, 6, false), Action::Pause);
        assert!(h.dispatched.is_empty());
        assert_eq!(f.on_request_body(&mut h, 8, true), Action::Pause);
        assert_eq!(h.dispatched.len(), 1);

        let key = expected_record_key(&cfg, &h, b"abc-123");
        let fp = fingerprint("POST", b"/pay/1", b"{\"a\":12}");
        assert_ne!(fp, fingerprint("POST", b"/pay/1", b""));
        assert_eq!(h.dispatched[0], request_call(&key, "owner-1", &fp));
        // Waiting for Redis: later body callbacks keep the request paused.
        assert_eq!(f.on_request_body(&mut h, 8, true), Action::Pause);
        assert_eq!(h.dispatched.len(), 1);
        f.on_callout_reply(&mut h, 1, ok(IDEM_ADMIT));
        assert_eq!(h.resumed, 1);
    }

    #[test]
    fn a_rule_without_body_fingerprint_decides_on_the_headers() {
        let json = IDEM_CONFIG.replace("FAILURE", "allow").replace(
            r#""name":"pay","#,
            r#""name":"pay","fingerprintBody":false,"#,
        );
        let cfg = Rc::new(Config::parse(json.as_bytes()).unwrap());
        assert!(!cfg.idempotency[0].fingerprint_body);
        let mut f = Flow::new(cfg.clone(), test_breaker());
        let mut h = FakeHost::post("/pay/1", b"abc-123");
        h.request_body = b"{\"a\":12}".to_vec();
        // A body follows, yet the call goes out with the headers.
        assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
        assert_eq!(h.dispatched.len(), 1);
        let key = expected_record_key(&cfg, &h, b"abc-123");
        let fp = fingerprint("POST", b"/pay/1", b"");
        assert_eq!(h.dispatched[0], request_call(&key, "owner-1", &fp));
        // The body waits while Redis decides, then flows untouched.
        assert_eq!(f.on_request_body(&mut h, 8, true), Action::Pause);
        f.on_callout_reply(&mut h, 1, ok(IDEM_ADMIT));
        assert_eq!(h.resumed, 1);
        assert_eq!(f.on_request_body(&mut h, 8, true), Action::Continue);
        assert_eq!(h.dispatched.len(), 1);
    }

    #[test]
    fn keyed_body_over_max_request_body_is_413_without_a_redis_call() {
        // Growing past the cap while buffering.
        let mut f = idem_flow("allow");
        let mut h = FakeHost::post("/pay", b"k1");
        assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
        assert_eq!(f.on_request_body(&mut h, 6, false), Action::Pause);
        assert!(h.sent.is_empty());
        assert_eq!(f.on_request_body(&mut h, 11, false), Action::Pause);
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 413);
        f.on_request_body(&mut h, 12, true);
        assert_eq!(h.sent.len(), 1, "one answer only");
        assert!(h.dispatched.is_empty());

        // Over the cap in the last chunk.
        let mut f = idem_flow("allow");
        let mut h = FakeHost::post("/pay", b"k1");
        f.on_request_headers(&mut h, false);
        assert_eq!(f.on_request_body(&mut h, 11, true), Action::Pause);
        assert_eq!(h.sent[0].status, 413);
        assert!(h.dispatched.is_empty());

        // Exactly the cap is fine.
        let mut f = idem_flow("allow");
        let mut h = FakeHost::post("/pay", b"k1");
        h.request_body = vec![b'x'; 10];
        f.on_request_headers(&mut h, false);
        assert_eq!(f.on_request_body(&mut h, 10, true), Action::Pause);
        assert!(h.sent.is_empty());
        assert_eq!(h.dispatched.len(), 1);
    }

    #[test]
    fn content_length_over_max_request_body_is_413_at_headers() {
        let mut f = idem_flow("allow");
        let mut h = FakeHost::post("/pay", b"k1");
        h.headers.insert("content-length".into(), b"11".to_vec());
        assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 413);
        assert!(h.dispatched.is_empty());

        let mut f = idem_flow("allow");
        let mut h = FakeHost::post("/pay", b"k1");
        h.headers.insert("content-length".into(), b" 10 ".to_vec());
        assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
        assert!(h.sent.is_empty(), "at the cap: read the body");
        assert!(h.dispatched.is_empty());
    }

    #[test]
    fn missing_or_malformed_keys_are_400_and_get_is_not_keyed() {
        // Required and missing.
        let mut f = idem_flow("allow");
        let mut h = FakeHost::keyed("POST", "/pay", None);
        assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 400);
        assert!(String::from_utf8_lossy(&h.sent[0].body).contains("idempotency-key"));
        assert!(h.dispatched.is_empty());

        // Malformed.
        for bad in [&b"a b"[..], b"", b"\"open", &[b'k'; 256]] {
            let mut f = idem_flow("allow");
            let mut h = FakeHost::post("/pay", bad);
            assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
            assert_eq!(h.sent.len(), 1, "{:?}", String::from_utf8_lossy(bad));
            assert_eq!(h.sent[0].status, 400);
            assert!(h.dispatched.is_empty());
        }

        // GET is not keyed, with or without a key (and no limit applies).
        for key in [None, Some(&b"abc"[..])] {
            let mut f = idem_flow("allow");
            let mut h = FakeHost::keyed("GET", "/pay", key);
            assert_eq!(f.on_request_headers(&mut h, false), Action::Continue);
            assert!(h.sent.is_empty());
            assert!(h.dispatched.is_empty());
            assert_eq!(f.on_request_body(&mut h, 0, true), Action::Continue);
            h.respond(&[(":status", "200")]);
            assert_eq!(f.on_response_headers(&mut h, true), Action::Continue);
            f.on_stream_end(&mut h);
            assert!(h.dispatched.is_empty() && h.detached.is_empty());
        }

        // PATCH is keyed like POST; other paths are not.
        let mut f = idem_flow("allow");
        let mut h = FakeHost::keyed("PATCH", "/pay/9", Some(b"k"));
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.dispatched.len(), 1);
        let mut f = idem_flow("allow");
        let mut h = FakeHost::keyed("POST", "/other", None);
        assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
        assert!(h.sent.is_empty() && h.dispatched.is_empty());
    }

    #[test]
    fn busy_key_is_409_with_retry_after_and_not_resumed() {
        let (mut f, mut h) = keyed_in_flight("allow");
        f.on_callout_reply(&mut h, 1, ok(b"*2\r\n$1\r\n2\r\n$4\r\n2900\r\n"));
        assert_eq!(h.resumed, 0);
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 409);
        assert!(h.sent[0]
            .headers
            .iter()
            .any(|(n, v)| n == "retry-after" && v == "1"));
        assert!(h.counters.contains(&Counter::IdemConflicts));
        assert!(!h.counters.contains(&Counter::IdemAcquired));
        f.on_stream_end(&mut h);
        assert!(h.detached.is_empty(), "no lock of ours to release");
        assert_eq!(h.dispatched.len(), 1);
    }

    #[test]
    fn fingerprint_mismatch_is_422_and_not_resumed() {
        let (mut f, mut h) = keyed_in_flight("allow");
        f.on_callout_reply(&mut h, 1, ok(b"*1\r\n$1\r\n4\r\n"));
        assert_eq!(h.resumed, 0);
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 422);
        assert!(h.counters.contains(&Counter::IdemMismatches));
        f.on_stream_end(&mut h);
        assert!(h.detached.is_empty());
    }

    #[test]
    fn completed_key_replays_status_headers_and_exact_body() {
        let (mut f, mut h) = keyed_in_flight("allow");
        let stored = encode_headers(&[
            ("content-type".to_string(), b"application/json".to_vec()),
            ("location".to_string(), b"/pay/7".to_vec()),
        ]);
        let body: &[u8] = b"{\"id\":7}\r\n\x00\xff";
        f.on_callout_reply(&mut h, 1, ok(&resp(&[b"3", b"201", &stored, body])));
        assert_eq!(h.resumed, 0);
        assert_eq!(
            h.sent,
            [LocalReply {
                status: 201,
                headers: vec![
                    ("content-type".to_string(), "application/json".to_string()),
                    ("location".to_string(), "/pay/7".to_string()),
                    ("idempotent-replayed".to_string(), "true".to_string()),
                ],
                body: body.to_vec(),
            }]
        );
        assert!(h.counters.contains(&Counter::IdemReplayed));
        f.on_stream_end(&mut h);
        assert!(h.detached.is_empty());
    }

    #[test]
    fn unreadable_stored_headers_are_503_never_a_rerun() {
        let (mut f, mut h) = keyed_in_flight("allow");
        f.on_callout_reply(&mut h, 1, ok(&resp(&[b"3", b"200", b"9:trunc", b"x"])));
        assert_eq!(h.resumed, 0, "failure mode allow does not apply");
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 503);
    }

    #[test]
    fn admitted_response_is_stored_before_its_last_chunk_goes_out() {
        let (mut f, mut h, key) = holding("allow");
        h.respond(&[
            (":status", "200"),
            ("content-length", "12"),
            ("content-type", "text/plain"),
            ("x-trace", "t1"),
        ]);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        assert_eq!(h.dispatched.len(), 1, "nothing until the body is complete");
        h.response_chunks = vec![b"hello ".to_vec(), b"wor".to_vec(), b"ld!".to_vec()];
        assert_eq!(f.on_response_body(&mut h, 6, false), Action::Continue);
        assert_eq!(f.on_response_body(&mut h, 3, false), Action::Continue);
        assert_eq!(h.dispatched.len(), 1);
        // The chunk completing content-length is held, even without end_of_stream.
        assert_eq!(f.on_response_body(&mut h, 3, false), Action::Pause);
        assert_eq!(h.dispatched.len(), 2);
        assert!(h.dispatched[1].starts_with("EVALSHA/"));
        assert!(h.dispatched[1].contains(&enc(b"hello world!")));
        assert_eq!(
            h.dispatched[1],
            complete_call(
                &key,
                "200",
                &[("content-type", b"text/plain")],
                b"hello world!"
            )
        );
        // Anything after it waits too.
        assert_eq!(f.on_response_body(&mut h, 3, true), Action::Pause);
        assert_eq!(h.response_resumed, 0);

        f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
        assert_eq!(h.response_resumed, 1);
        assert_eq!(count(&h, Counter::IdemStored), 1);
        assert!(!h.counters.contains(&Counter::IdemStoreFailed));
        f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
        assert_eq!(h.response_resumed, 1, "resumed once");
        assert_eq!(count(&h, Counter::IdemStored), 1);
        assert_eq!(f.on_response_body(&mut h, 0, true), Action::Continue);
        f.on_stream_end(&mut h);
        assert!(h.detached.is_empty(), "completed: nothing to release");
        assert_eq!(h.dispatched.len(), 2);
        assert!(!h.counters.contains(&Counter::IdemReleased));
    }

    #[test]
    fn a_lost_lock_still_lets_the_response_out() {
        // `:0`: the lock expired and may be another request's: not touched.
        let cfg = idem_config("deny");
        let mut f = Flow::new(cfg.clone(), test_breaker());
        let mut h = FakeHost::post("/pay", b"abc-123");
        admitted(&mut f, &mut h, &cfg);
        h.respond(&[(":status", "201")]);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        h.response_chunks = vec![b"done".to_vec()];
        assert_eq!(f.on_response_body(&mut h, 4, true), Action::Pause);
        f.on_callout_reply(&mut h, 2, ok(b":0\r\n"));
        assert_eq!(h.response_resumed, 1);
        assert_eq!(count(&h, Counter::IdemStoreFailed), 1);
        assert_eq!(
            h.dispatched.len(),
            2,
            "no release of a lock that is not ours"
        );
        f.on_stream_end(&mut h);
        assert!(h.detached.is_empty());
    }

    #[test]
    fn a_release_meeting_noscript_is_sent_once_more_as_eval() {
        let (mut f, mut h, key) = holding("deny");
        h.respond(&[(":status", "500")]);
        assert_eq!(f.on_response_headers(&mut h, true), Action::Pause);
        assert_eq!(h.dispatched[1], release_call(&key));
        f.on_callout_reply(&mut h, 2, ok(b"-NOSCRIPT No matching script.\r\n"));
        assert_eq!(h.dispatched[2], detached_release_call(&key));
        assert_eq!(h.response_resumed, 0, "held until the release lands");
        f.on_callout_reply(&mut h, 3, ok(b":1\r\n"));
        assert_eq!(h.response_resumed, 1);
        assert_eq!(count(&h, Counter::IdemReleased), 1);
    }

    #[test]
    fn a_store_meeting_noscript_is_sent_once_more_as_eval() {
        let (mut f, mut h, key) = holding("deny");
        h.respond(&[(":status", "201")]);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        h.response_chunks = vec![b"done".to_vec()];
        assert_eq!(f.on_response_body(&mut h, 4, true), Action::Pause);
        assert_eq!(h.dispatched[1], complete_call(&key, "201", &[], b"done"));
        f.on_callout_reply(&mut h, 2, ok(b"-NOSCRIPT No matching script.\r\n"));
        assert_eq!(h.dispatched.len(), 3);
        let eval = complete_call(&key, "201", &[], b"done")
            .replacen("EVALSHA/", "EVAL/", 1)
            .replacen(
                &IDEM_COMPLETE.sha1,
                &enc(IDEM_COMPLETE.source.as_bytes()),
                1,
            );
        assert_eq!(h.dispatched[2], eval);
        assert_eq!(h.response_resumed, 0, "still held");
        f.on_callout_reply(&mut h, 3, ok(b":1\r\n"));
        assert_eq!(h.response_resumed, 1);
        assert_eq!(count(&h, Counter::IdemStored), 1);
        assert_eq!(count(&h, Counter::ScriptReloads), 1);
    }

    #[test]
    fn a_failed_store_releases_the_key_before_the_response_ends() {
        for reply in [ok(b"-ERR oops\r\n"), no_answer()] {
            let cfg = idem_config("deny");
            let mut f = Flow::new(cfg.clone(), test_breaker());
            let mut h = FakeHost::post("/pay", b"abc-123");
            let key = admitted(&mut f, &mut h, &cfg);
            h.respond(&[(":status", "201")]);
            assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
            h.response_chunks = vec![b"done".to_vec()];
            assert_eq!(f.on_response_body(&mut h, 4, true), Action::Pause);
            assert_eq!(h.dispatched.len(), 2);
            assert!(h.dispatched[1].starts_with("EVALSHA/"));
            f.on_callout_reply(&mut h, 2, reply.clone());
            assert_eq!(h.dispatched.len(), 3, "{reply:?}");
            release_lands(&mut f, &mut h, &key);
            assert_eq!(count(&h, Counter::IdemStoreFailed), 1);
            assert!(!h.counters.contains(&Counter::IdemStored));
            f.on_stream_end(&mut h);
            assert!(h.detached.is_empty());
        }
    }

    #[test]
    fn a_response_ending_at_its_headers_is_stored_at_once() {
        let (mut f, mut h, key) = holding("allow");
        h.respond(&[(":status", "204")]);
        assert_eq!(f.on_response_headers(&mut h, true), Action::Pause);
        assert_eq!(h.dispatched[1], complete_call(&key, "204", &[], b""));
        f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
        assert_eq!(h.response_resumed, 1);
        assert!(h.counters.contains(&Counter::IdemStored));
    }

    #[test]
    fn non_storable_status_releases_the_lock_and_continues() {
        let (mut f, mut h, key) = holding("allow");
        h.respond(&[(":status", "503"), ("content-length", "3")]);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        assert_eq!(h.dispatched.len(), 2);
        assert_eq!(h.dispatched[1], release_call(&key));
        assert_eq!(count(&h, Counter::IdemReleased), 1);
        h.response_chunks = vec![b"err".to_vec()];
        // The chunk that ends the response waits for the release.
        assert_eq!(f.on_response_body(&mut h, 3, true), Action::Pause);
        f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
        assert_eq!(h.response_resumed, 1);
        f.on_stream_end(&mut h);
        assert!(h.detached.is_empty(), "released already");
        assert_eq!(h.dispatched.len(), 2);
        assert_eq!(count(&h, Counter::IdemReleased), 1);
    }

    #[test]
    fn response_over_max_stored_body_is_released_not_stored() {
        let (mut f, mut h, key) = holding("allow");
        // No content-length: found out while copying.
        h.respond(&[(":status", "200")]);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        h.response_chunks = vec![vec![b'a'; 15], vec![b'b'; 6], vec![b'c'; 4]];
        assert_eq!(f.on_response_body(&mut h, 15, false), Action::Continue);
        assert_eq!(h.dispatched.len(), 1);
        assert_eq!(f.on_response_body(&mut h, 6, false), Action::Continue);
        assert_eq!(h.dispatched.len(), 2);
        assert_eq!(h.dispatched[1], release_call(&key));
        assert_eq!(count(&h, Counter::IdemTooLarge), 1);
        assert_eq!(count(&h, Counter::IdemReleased), 1);
        assert_eq!(
            f.on_response_body(&mut h, 4, true),
            Action::Pause,
            "held for the release"
        );
        assert_eq!(h.dispatched.len(), 2);
        f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
        assert_eq!(h.response_resumed, 1);
        f.on_stream_end(&mut h);
        assert!(h.detached.is_empty());
        assert!(!h.counters.contains(&Counter::IdemStored));
    }

    #[test]
    fn response_of_exactly_max_stored_body_is_stored() {
        let (mut f, mut h, key) = holding("allow");
        h.respond(&[(":status", "200")]);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        h.response_chunks = vec![vec![b'a'; 20]];
        assert_eq!(f.on_response_body(&mut h, 20, true), Action::Pause);
        assert_eq!(
            h.dispatched[1],
            complete_call(&key, "200", &[], &[b'a'; 20])
        );
        assert!(!h.counters.contains(&Counter::IdemTooLarge));
    }

    #[test]
    fn stream_end_releases_a_held_or_capturing_lock_detached() {
        // Held: the response never started.
        let (mut f, mut h, key) = holding("allow");
        f.on_stream_end(&mut h);
        assert_eq!(h.detached, [detached_release_call(&key)]);
        assert_eq!(h.dispatched.len(), 1, "not through dispatch_redis");
        assert_eq!(count(&h, Counter::IdemReleased), 1);
        f.on_stream_end(&mut h);
        assert_eq!(h.detached.len(), 1, "released once");

        // Capturing: part of the response went out.
        let (mut f, mut h, key) = holding("allow");
        h.respond(&[(":status", "200"), ("content-length", "10")]);
        f.on_response_headers(&mut h, false);
        h.response_chunks = vec![b"12345".to_vec()];
        assert_eq!(f.on_response_body(&mut h, 5, false), Action::Continue);
        f.on_stream_end(&mut h);
        assert_eq!(h.detached, [detached_release_call(&key)]);
        assert_eq!(h.dispatched.len(), 1);
        assert_eq!(count(&h, Counter::IdemReleased), 1);

        // Completing: the COMPLETED record is on its way; a release would race it.
        let (mut f, mut h, _) = holding("allow");
        h.respond(&[(":status", "200")]);
        f.on_response_headers(&mut h, false);
        h.response_chunks = vec![b"12345".to_vec()];
        assert_eq!(f.on_response_body(&mut h, 5, true), Action::Pause);
        f.on_stream_end(&mut h);
        assert!(h.detached.is_empty());
        assert!(!h.counters.contains(&Counter::IdemReleased));
    }

    #[test]
    fn rate_limited_keyed_request_takes_no_lock() {
        let cfg = Rc::new(
            Config::parse(
                br#"{"redis":{"cluster":"webdis"},
                "limits":[{"name":"a","tokenBucket":{"capacity":2,"refill":1,"periodMs":1000}}],
                "idempotency":[{"name":"pay","match":{"pathPrefix":"/pay"}}]}"#,
            )
            .unwrap(),
        );
        let mut f = Flow::new(cfg.clone(), test_breaker());
        let mut h = FakeHost::post("/pay", b"abc-123");
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        // The limit's key first, the record last, as lua/ratelimit.lua expects.
        assert!(h.dispatched[0].starts_with(&format!("EVALSHA/{}/2/rg%3Arl%3A%7B", RATELIMIT.sha1)));
        let key = expected_record_key(&cfg, &h, b"abc-123");
        assert!(h.dispatched[0].contains(&format!("/{}/1/tb/2/1/1000/1/1/1/owner%2D1/", enc(&key))));
        f.on_callout_reply(&mut h, 1, ok(REJECT));
        assert_eq!(h.sent[0].status, 429);
        assert!(!h.counters.contains(&Counter::IdemAcquired));
        h.respond(&[(":status", "429")]);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        f.on_stream_end(&mut h);
        assert_eq!(h.dispatched.len(), 1);
        assert!(h.detached.is_empty());
    }

    #[test]
    fn redis_failure_on_a_keyed_request_follows_the_rule_failure_mode() {
        // allow: forwarded without the guarantee. The timed-out script may
        // have taken the lock: it is released (owner-checked) at once.
        let (mut f, mut h) = keyed_in_flight("allow");
        f.on_callout_reply(&mut h, 1, no_answer());
        assert_eq!(h.resumed, 1);
        assert!(h.sent.is_empty());
        assert_eq!(count(&h, Counter::IdemUnguarded), 1);
        assert!(h.counters.contains(&Counter::FailureAllowed));
        assert_eq!(
            h.detached.len(),
            1,
            "release of a lock the call may have taken"
        );
        h.respond(&[(":status", "200")]);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        h.response_chunks = vec![b"ok".to_vec()];
        assert_eq!(f.on_response_body(&mut h, 2, true), Action::Continue);
        f.on_stream_end(&mut h);
        assert_eq!(h.dispatched.len(), 1);
        assert_eq!(h.detached.len(), 1, "released once");

        // deny: 503, not forwarded; the possible lock is released too.
        let (mut f, mut h) = keyed_in_flight("deny");
        f.on_callout_reply(&mut h, 1, no_answer());
        assert_eq!(h.resumed, 0);
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 503);
        assert!(!h.counters.contains(&Counter::IdemUnguarded));
        f.on_stream_end(&mut h);
        assert_eq!(h.detached.len(), 1);

        // A dispatch that fails after the body was read decides in the callback.
        let mut f = idem_flow("allow");
        let mut h = FakeHost::post("/pay", b"abc-123");
        h.dispatch_fails = true;
        h.request_body = b"{}".to_vec();
        assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
        assert_eq!(f.on_request_body(&mut h, 2, true), Action::Continue);
        assert_eq!(h.resumed, 0, "the callback's Continue forwards it");
        assert_eq!(count(&h, Counter::IdemUnguarded), 1);

        let mut f = idem_flow("deny");
        let mut h = FakeHost::post("/pay", b"abc-123");
        h.dispatch_fails = true;
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.sent[0].status, 503);
    }

    #[test]
    fn a_webdis_503_retry_keeps_the_same_owner() {
        let (mut f, mut h) = keyed_in_flight("deny");
        f.on_callout_reply(
            &mut h,
            1,
            CalloutReply {
                status: Some(503),
                from_webdis: true,
                body: vec![],
            },
        );
        assert_eq!(h.dispatched.len(), 2);
        assert_eq!(h.dispatched[0], h.dispatched[1]);
        assert_eq!(h.tokens, 1, "one owner token per request");
        f.on_callout_reply(&mut h, 2, ok(IDEM_ADMIT));
        assert_eq!(h.resumed, 1);
        assert!(h.counters.contains(&Counter::IdemAcquired));
    }

    // ---- large responses in the object store --------------------------------

    const OFFLOAD_CONFIG: &str = r#"{"redis":{"cluster":"webdis"},
        "objectStore":{"cluster":"s3","authority":"127.0.0.1:9000","bucket":"rg-test",
          "region":"us-east-1","keyPrefix":"t/","timeoutMs":4000,
          "credentials":{"accessKeyId":"AKIDTEST","secretAccessKey":"s3cr3t"}},
        "idempotency":[{"name":"pay","match":{"pathPrefix":"/pay"},
          "maxStoredBodyBytes":64,"offloadAboveBytes":8,"failureMode":"allow"}]}"#;

    /// A keyed POST to /pay, lock held, under OFFLOAD_CONFIG.
    fn offload_holding() -> (Flow, FakeHost, Vec<u8>) {
        let cfg = Rc::new(Config::parse(OFFLOAD_CONFIG.as_bytes()).unwrap());
        let mut f = Flow::new(cfg.clone(), test_breaker());
        let mut h = FakeHost::post("/pay", b"abc-123");
        h.clock_ms = 1_796_232_360_000;
        let key = admitted(&mut f, &mut h, &cfg);
        (f, h, key)
    }

    fn header<'a>(headers: &'a [(String, String)], name: &str) -> &'a str {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .unwrap()
    }

    fn object_reply(status: u32, body: &[u8]) -> CalloutReply {
        CalloutReply {
            status: Some(status),
            from_webdis: false,
            body: body.to_vec(),
        }
    }

    /// Streams `body` (over the 8-byte threshold) as a 201; returns the PUT.
    fn respond_large(
        f: &mut Flow,
        h: &mut FakeHost,
        body: &[u8],
    ) -> (Vec<(String, String)>, Vec<u8>) {
        h.respond(&[(":status", "201"), ("content-type", "text/plain")]);
        assert_eq!(f.on_response_headers(h, false), Action::Continue);
        h.response_chunks = vec![body[..5].to_vec(), body[5..].to_vec()];
        assert_eq!(f.on_response_body(h, 5, false), Action::Continue);
        assert_eq!(f.on_response_body(h, body.len() - 5, true), Action::Pause);
        assert_eq!(
            h.dispatched.len(),
            1,
            "no Redis call before the upload is done"
        );
        assert_eq!(h.objects.len(), 1);
        let (headers, sent) = h.objects[0].clone();
        (headers, sent.unwrap())
    }

    /// A held key whose large 201 is being uploaded (the PUT in flight).
    fn uploading() -> (Flow, FakeHost, Vec<u8>) {
        let (mut f, mut h, key) = offload_holding();
        respond_large(&mut f, &mut h, b"0123456789 a large body");
        (f, h, key)
    }

    #[test]
    fn a_large_response_is_uploaded_then_recorded_by_reference() {
        let (mut f, mut h, key) = offload_holding();
        let body = b"0123456789 a large body";
        let (put, sent) = respond_large(&mut f, &mut h, body);
        assert_eq!(sent, body);
        let sha = codec::sha256_hex(body);
        assert_eq!(header(&put, ":method"), "PUT");
        assert_eq!(header(&put, ":authority"), "127.0.0.1:9000");
        assert_eq!(header(&put, "x-amz-content-sha256"), sha);
        let digest = codec::sha256_hex(&key);
        // Expiry: the proxy's now + recordTtlMs (1 day) + the store's and
        // Redis' timeouts (4 s + 50 ms), rounded up to the second.
        let object_key = format!("t/pay/20261203T172605Z/{digest}-owner-1");
        assert_eq!(header(&put, ":path"), format!("/rg-test/{object_key}"));
        assert!(header(&put, "authorization").starts_with(
            "AWS4-HMAC-SHA256 Credential=AKIDTEST/20261202/us-east-1/s3/aws4_request"
        ));
        assert_eq!(h.timeouts.last(), Some(&Duration::from_secs(4)));
        assert_eq!(h.response_resumed, 0, "the end waits for the upload");
        f.on_callout_reply(&mut h, OBJECT_TOKENS + 1, object_reply(200, b""));
        assert_eq!(h.response_resumed, 0, "and then for the record");
        let record = text(command_body(
            "EVALSHA",
            &[
                IDEM_COMPLETE.sha1.as_bytes(),
                b"1",
                &key,
                b"owner-1",
                b"201",
                &encode_headers(&[("content-type".to_string(), b"text/plain".to_vec())]),
                b"",
                b"86400000",
                object_key.as_bytes(),
                sha.as_bytes(),
                body.len().to_string().as_bytes(),
            ],
        ));
        assert_eq!(h.dispatched[1], record, "the record holds no body");
        f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
        assert_eq!(h.response_resumed, 1);
        assert_eq!(count(&h, Counter::IdemStored), 1);
        assert_eq!(count(&h, Counter::IdemOffloaded), 1);
        f.on_stream_end(&mut h);
        assert!(h.detached.is_empty());
    }

    #[test]
    fn a_response_at_the_threshold_stays_in_redis() {
        let (mut f, mut h, key) = offload_holding();
        h.respond(&[(":status", "201"), ("content-type", "text/plain")]);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        h.response_chunks = vec![b"8 bytes!".to_vec()];
        assert_eq!(f.on_response_body(&mut h, 8, true), Action::Pause);
        assert!(h.objects.is_empty());
        assert_eq!(
            h.dispatched[1],
            complete_call(&key, "201", &[("content-type", b"text/plain")], b"8 bytes!")
        );
        f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
        assert_eq!(count(&h, Counter::IdemOffloaded), 0);
        assert_eq!(count(&h, Counter::IdemStored), 1);
    }

    #[test]
    fn a_failed_upload_releases_the_key_before_the_response_ends() {
        for reply in [
            object_reply(403, b"<Code>SignatureDoesNotMatch</Code>"),
            object_reply(503, b""),
            no_answer(),
        ] {
            let (mut f, mut h, key) = uploading();
            f.on_callout_reply(&mut h, OBJECT_TOKENS + 1, reply.clone());
            assert_eq!(h.dispatched.len(), 2, "no record: {reply:?}");
            release_lands(&mut f, &mut h, &key);
            assert_eq!(count(&h, Counter::IdemOffloadFailed), 1);
            assert_eq!(count(&h, Counter::IdemStored), 0);
        }
    }

    #[test]
    fn a_stream_that_ends_during_the_upload_frees_the_key() {
        let (mut f, mut h, key) = uploading();
        f.on_stream_end(&mut h);
        assert_eq!(h.detached, vec![detached_release_call(&key)]);
    }

    /// A keyed retry whose record says the body is in the object store.
    fn offloaded_replay(body: &[u8]) -> (Flow, FakeHost) {
        let cfg = Rc::new(Config::parse(OFFLOAD_CONFIG.as_bytes()).unwrap());
        let mut f = Flow::new(cfg, test_breaker());
        let mut h = FakeHost::post("/pay", b"abc-123");
        h.clock_ms = 1_796_232_360_000;
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        let stored = encode_headers(&[("content-type".to_string(), b"text/plain".to_vec())]);
        let sha = codec::sha256_hex(body);
        let len = body.len().to_string();
        let record = resp(&[
            b"3",
            b"201",
            &stored,
            b"",
            b"t/pay/20261203T172604Z/d-o",
            sha.as_bytes(),
            len.as_bytes(),
        ]);
        f.on_callout_reply(&mut h, 1, ok(&record));
        assert!(h.sent.is_empty(), "nothing is answered before the fetch");
        assert_eq!(h.objects.len(), 1);
        let (get, body) = &h.objects[0];
        assert_eq!(header(get, ":method"), "GET");
        assert_eq!(header(get, ":path"), "/rg-test/t/pay/20261203T172604Z/d-o");
        assert!(body.is_none());
        (f, h)
    }

    #[test]
    fn an_offloaded_record_is_replayed_from_the_object_store() {
        let body = b"0123456789 a large body";
        let (mut f, mut h) = offloaded_replay(body);
        f.on_callout_reply(&mut h, OBJECT_TOKENS + 1, object_reply(200, body));
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 201);
        assert_eq!(h.sent[0].body, body);
        assert_eq!(
            h.sent[0].headers,
            vec![
                ("content-type".to_string(), "text/plain".to_string()),
                ("idempotent-replayed".to_string(), "true".to_string()),
            ]
        );
        assert_eq!(count(&h, Counter::IdemReplayed), 1);
        assert_eq!(count(&h, Counter::IdemObjectFetched), 1);
        assert_eq!(h.resumed, 0);
    }

    #[test]
    fn a_lost_corrupt_or_unreachable_object_is_an_error_never_a_rerun() {
        let body = b"0123456789 a large body";
        let cases = [
            (
                object_reply(404, b"<Code>NoSuchKey</Code>"),
                502,
                Counter::IdemObjectMissing,
            ),
            (
                object_reply(200, b"0123456789 a LARGE body"),
                502,
                Counter::IdemObjectCorrupt,
            ),
            (
                object_reply(200, b"truncated"),
                502,
                Counter::IdemObjectCorrupt,
            ),
            (
                object_reply(403, b"<Code>SignatureDoesNotMatch</Code>"),
                503,
                Counter::IdemObjectFetchFailed,
            ),
            (no_answer(), 503, Counter::IdemObjectFetchFailed),
        ];
        for (reply, status, counter) in cases {
            let (mut f, mut h) = offloaded_replay(body);
            f.on_callout_reply(&mut h, OBJECT_TOKENS + 1, reply.clone());
            assert_eq!(h.sent.len(), 1, "{reply:?}");
            assert_eq!(h.sent[0].status, status, "{reply:?}");
            assert_eq!(count(&h, counter), 1, "{reply:?}");
            assert_eq!(h.resumed, 0, "never forwarded: {reply:?}");
            assert_eq!(count(&h, Counter::IdemReplayed), 0);
            let doc: serde_json::Value = serde_json::from_slice(&h.sent[0].body).unwrap();
            assert_eq!(doc["status"], status);
            assert!(doc["storedResponse"].is_string());
            assert_eq!(
                h.sent[0]
                    .headers
                    .iter()
                    .any(|(n, v)| n == "retry-after" && v == "1"),
                status == 503
            );
        }
    }

    #[test]
    fn a_response_announced_over_the_cap_is_released_at_its_headers() {
        let (mut f, mut h, key) = holding("allow");
        h.respond(&[(":status", "200"), ("content-length", "21")]);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        assert_eq!(h.dispatched[1], release_call(&key), "nothing copied first");
        assert_eq!(count(&h, Counter::IdemTooLarge), 1);
        h.response_chunks = vec![vec![b'a'; 21]];
        assert_eq!(f.on_response_body(&mut h, 21, true), Action::Pause);
        f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
        assert_eq!(h.response_resumed, 1);
        assert_eq!(count(&h, Counter::IdemStored), 0);
    }

    #[test]
    fn an_upload_that_cannot_be_sent_releases_the_key() {
        let (mut f, mut h, key) = offload_holding();
        h.object_dispatch_fails = true;
        h.respond(&[(":status", "201")]);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        h.response_chunks = vec![b"0123456789 large".to_vec()];
        assert_eq!(f.on_response_body(&mut h, 16, true), Action::Pause);
        assert_eq!(h.dispatched.len(), 2);
        release_lands(&mut f, &mut h, &key);
        assert_eq!(count(&h, Counter::IdemOffloadFailed), 1);
    }

    #[test]
    fn a_record_that_fails_after_the_upload_releases_the_key() {
        let (mut f, mut h, key) = uploading();
        f.on_callout_reply(&mut h, OBJECT_TOKENS + 1, object_reply(200, b""));
        assert!(h.dispatched[1].starts_with("EVALSHA/"));
        f.on_callout_reply(&mut h, 2, ok(b"-OOM no memory\r\n"));
        assert_eq!(h.dispatched.len(), 3);
        release_lands(&mut f, &mut h, &key);
        assert_eq!(count(&h, Counter::IdemStoreFailed), 1);
        assert_eq!(count(&h, Counter::IdemOffloaded), 0);
    }

    #[test]
    fn only_object_replies_are_read_up_to_a_limit() {
        let (f, _, _) = offload_holding();
        assert_eq!(f.reply_limit(2), usize::MAX, "a Redis reply is read whole");
        let (f, _, _) = uploading();
        assert_eq!(f.reply_limit(OBJECT_TOKENS + 1), UPLOAD_REPLY_LIMIT);
        assert_eq!(f.reply_limit(7), usize::MAX);
        let (f, _) = offloaded_replay(b"0123456789 a large body");
        assert_eq!(f.reply_limit(OBJECT_TOKENS + 1), 23, "exactly the object");
        assert_eq!(f.reply_limit(1), usize::MAX);
    }

    #[test]
    fn a_fetch_that_cannot_be_sent_is_a_503_not_a_rerun() {
        let cfg = Rc::new(Config::parse(OFFLOAD_CONFIG.as_bytes()).unwrap());
        let mut f = Flow::new(cfg, test_breaker());
        let mut h = FakeHost::post("/pay", b"abc-123");
        h.object_dispatch_fails = true;
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        let sha = "ab".repeat(32);
        let record = resp(&[b"3", b"201", b"", b"", b"t/pay/x", sha.as_bytes(), b"23"]);
        f.on_callout_reply(&mut h, 1, ok(&record));
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 503);
        assert_eq!(count(&h, Counter::IdemObjectFetchFailed), 1);
        assert_eq!(h.resumed, 0);
    }

    #[test]
    fn a_record_in_an_object_store_this_filter_lacks_is_a_503_not_a_rerun() {
        // The rule once offloaded; this configuration has no objectStore.
        let (mut f, mut h) = keyed_in_flight("allow");
        let sha = "ab".repeat(32);
        let record = resp(&[b"3", b"201", b"", b"", b"t/pay/x", sha.as_bytes(), b"23"]);
        f.on_callout_reply(&mut h, 1, ok(&record));
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 503);
        assert_eq!(count(&h, Counter::IdemObjectFetchFailed), 1);
        assert!(h.objects.is_empty());
        assert_eq!(h.resumed, 0);
    }

    #[test]
    fn an_unreadable_completed_record_is_a_503_even_when_failing_open() {
        for record in [
            // An object reference cut short (no length).
            resp(&[b"3", b"201", b"", b"", b"t/pay/x", b"ab"]),
            // A checksum that is not SHA-256.
            resp(&[b"3", b"201", b"", b"", b"t/pay/x", b"abc", b"23"]),
            // A status out of range.
            resp(&[b"3", b"99", b"", b"body"]),
        ] {
            let (mut f, mut h) = keyed_in_flight("allow");
            f.on_callout_reply(&mut h, 1, ok(&record));
            assert_eq!(h.resumed, 0, "a completed key is never forwarded");
            assert_eq!(h.sent.len(), 1);
            assert_eq!(h.sent[0].status, 503);
            assert_eq!(count(&h, Counter::RedisError(ErrorKind::Reply)), 1);
            assert_eq!(count(&h, Counter::IdemUnguarded), 0);
            assert_eq!(count(&h, Counter::FailureAllowed), 0);
        }
    }
}
