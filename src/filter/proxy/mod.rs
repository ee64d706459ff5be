//! proxy-wasm glue: the only code that calls the host. Host calls go through
//! `hostcalls` (which return errors) rather than the trait defaults (which
//! unwrap), and every error is logged, not unwrapped. The SDK still panics on
//! statuses it does not expect, so maps that may be absent are not read.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::{Rc, Weak};
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel};

use crate::breaker::Breakers;
use crate::config::{Config, RedisTarget};
use crate::filter::clock::CallbackClock;
use crate::filter::deferred::Deferred;
use crate::filter::flow::Flow;
use crate::filter::handoff::Prefetch;
use crate::filter::in_flight::InFlight;
use crate::filter::stage::batch::{Batcher, Verdict as BatchVerdict, Waiter};
use crate::filter::stage::lease::{give_back, on_prefetch_reply, Held};
use crate::filter::timers::Timers;
use crate::filter::{Action as FlowAction, CalloutReply};
use crate::scripts::{BATCH, LEASE, RATELIMIT};
use crate::webdis::Command;

mod abi;
mod host;
mod metrics;
mod reply;

use host::{callout_headers, ProxyHost};
use metrics::{Metrics, UNDEFINED};
use reply::callout_reply;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    // A panic aborts the VM (panic=abort); at least say why, at critical level.
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("redis-guard panicked: {info}"));
    }));
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root {
            context_id,
            shared: None,
        })
    });
}}

pub(super) struct Shared {
    config: Rc<Config>,
    metrics: Metrics,
    /// One breaker per worker (VM) and group of Redis Cluster slots: what it
    /// learns about a master is shared by that worker's requests of its
    /// slots, and only by them.
    breakers: Rc<Breakers>,
    /// The root context's id: calls that must outlive a stream run as it.
    root_id: u32,
    /// Seeds owner tokens: random per VM (WASI random), then a counter.
    token_seed: std::collections::hash_map::RandomState,
    token_counter: std::cell::Cell<u64>,
    /// Streams waiting for a wake-up (the pause after a Webdis 503, a slot
    /// renewal): (stream, due, flow).
    waiting: RefCell<Timers>,
    /// The flows of the streams that wait, by context id: removed with the
    /// stream's wake-ups when it ends, so a wake-up never keeps a gone
    /// stream's flow allocated.
    wakeable: RefCell<HashMap<u32, FlowRef>>,
    /// Calls the root sent for a stream (on tick): token -> (stream, flow).
    routed: RefCell<HashMap<u32, (u32, FlowRef)>>,
    /// When each call in flight was sent, and its nonce.
    in_flight: RefCell<InFlight>,
    /// Background lease fetches in flight (sent as the root): token -> note.
    prefetches: RefCell<HashMap<u32, Prefetch>>,
    /// Background lease fetches the root sends on its next tick: a call's
    /// reply goes to the context that was running when it was sent, and
    /// only the root outlives the request that asked.
    to_prefetch: RefCell<Vec<(Command, Duration, Prefetch)>>,
    /// The lease slots this worker filled: its tick gives their unspent
    /// tokens back.
    leases: RefCell<Held>,
    /// This worker's batches of decisions (None: batching is off). Its calls
    /// are the root's, so a client that leaves cancels none of them.
    batcher: RefCell<Option<Batcher<Stream>>>,
    /// This worker's wake-up queue, registered by its root under a name of
    /// its own: every worker's VM has root context id 1, so a shared name
    /// would let the last worker to register take every wake-up.
    batch_queue: Option<u32>,
    /// A wake-up is queued and not yet handled: members join without
    /// queueing another.
    wake_pending: std::cell::Cell<bool>,
    /// Calls this worker's streams left to the root (slot releases,
    /// settlements), and those in flight.
    deferred: RefCell<Deferred>,
    /// The root's tick is on: setting its period again would re-arm the
    /// timer (Envoy re-creates it), so streams that end more often than
    /// once a millisecond would keep the tick from ever firing.
    ticking: std::cell::Cell<bool>,
    /// The tick runs at [`LEASE_TICK`]: only watched lease slots wait for
    /// it.
    slow: std::cell::Cell<bool>,
}

/// A batch member as the worker knows it: its stream's context and flow.
#[derive(Clone)]
pub(super) struct Stream {
    context_id: u32,
    flow: FlowRef,
}

impl Waiter for Stream {
    fn gone(&self) -> bool {
        self.flow.strong_count() == 0
    }
}

impl Shared {
    /// Turns the root's tick on, unless it is on; `me` is the context
    /// running now (the period is the root's to set).
    pub(super) fn tick(&self, me: u32) -> Result<(), String> {
        if self.ticking.get() && !self.slow.get() {
            return Ok(());
        }
        self.set_tick(me, TICK)
    }

    /// Turns the root's tick on at [`LEASE_TICK`] at least (any tick that
    /// runs will do): for watched lease slots, which need no millisecond.
    pub(super) fn tick_slow(&self, me: u32) -> Result<(), String> {
        if self.ticking.get() {
            return Ok(());
        }
        self.set_tick(me, LEASE_TICK)
    }

    fn set_tick(&self, me: u32, period: Duration) -> Result<(), String> {
        let _ = hostcalls::set_effective_context(self.root_id);
        let set = hostcalls::set_tick_period(period);
        let _ = hostcalls::set_effective_context(me);
        set.map_err(|e| format!("{e:?}"))?;
        self.ticking.set(true);
        self.slow.set(period == LEASE_TICK);
        Ok(())
    }

    /// Call `token` left at `now`: kept for its latency and its reply's
    /// nonce.
    fn note_sent(&self, token: u32, now: Duration, timeout: Duration, nonce: Option<String>) {
        if let Ok(mut in_flight) = self.in_flight.try_borrow_mut() {
            in_flight.sent(token, now, timeout, nonce);
        }
    }

    /// Records the call's latency (answered at `now`); returns the nonce
    /// its reply must carry.
    fn note_reply(&self, token: u32, now: Duration) -> Option<String> {
        let (latency, nonce) = self
            .in_flight
            .try_borrow_mut()
            .map_or((None, None), |mut f| f.answered(token, now));
        if let Some(latency) = latency {
            let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
            if self.metrics.callout_latency_us != UNDEFINED {
                let _ = hostcalls::record_metric(self.metrics.callout_latency_us, us);
            }
        }
        nonce
    }

    /// `command` with a fresh nonce first in its ARGV if its script gives
    /// one back (the scripts whose replies decide requests: README, When
    /// things fail), and that nonce; `None`s for any other command. The
    /// nonce is unique per worker (a counter) and distinct between workers
    /// and Envoys (this VM's random seed).
    fn with_nonce(&self, command: &Command) -> (Option<Command>, Option<String>) {
        use std::hash::BuildHasher;
        let echoing = [
            RATELIMIT.sha1.as_str(),
            BATCH.sha1.as_str(),
            LEASE.sha1.as_str(),
        ];
        let Some(at) = crate::webdis::nonce_at(command, &echoing) else {
            return (None, None);
        };
        let n = self.token_counter.get().wrapping_add(1);
        self.token_counter.set(n);
        // 16 hex digits, as `{:016x}` wrote them (without the formatter).
        let nonce = crate::codec::hex(&self.token_seed.hash_one((n, "nonce")).to_be_bytes());
        (
            Some(crate::webdis::insert_nonce(command, at, &nonce)),
            Some(nonce),
        )
    }
}

/// Removes a call's entry from one of the root's tables (none while the
/// table is being read elsewhere: the entry is then left to its sweep).
fn take<V>(table: &RefCell<HashMap<u32, V>>, token: u32) -> Option<V> {
    table.try_borrow_mut().ok()?.remove(&token)
}

/// The proxy's clock (deadlines, retry pauses, local buckets).
pub(super) fn host_now() -> Duration {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .unwrap_or_default()
}

/// A stream's flow as the root holds it: gone when the stream is.
pub(super) type FlowRef = Weak<RefCell<Flow>>;

/// How often the root looks at `waiting` while something waits.
/// Short: a background lease fetch waits for the next tick to be sent.
pub(super) const TICK: Duration = Duration::from_millis(1);

/// The tick while only watched lease slots wait for it: a millisecond tick
/// for the minutes a lease lasts would wake every worker a thousand times a
/// second for nothing.
pub(super) const LEASE_TICK: Duration =
    Duration::from_millis(crate::filter::stage::lease::CHECK_MS);

struct Root {
    context_id: u32,
    shared: Option<Rc<Shared>>,
}

impl Root {
    fn host_for<'a>(
        shared: &'a Shared,
        context_id: u32,
        me: Weak<RefCell<Flow>>,
        clock: Option<Duration>,
    ) -> ProxyHost<'a> {
        ProxyHost {
            shared: Some(shared),
            context_id,
            me,
            via_root: true,
            clock: CallbackClock::new(clock),
        }
    }
}

impl Root {
    /// Runs `f` on a stream's flow as that stream (the root delivers replies
    /// and timers to streams); nothing if the stream is gone. The caller
    /// switches back to the root.
    fn as_stream(
        shared: &Shared,
        (context_id, clock): (u32, Option<Duration>),
        weak: &FlowRef,
        f: impl FnOnce(&mut Flow, &mut ProxyHost<'_>),
    ) {
        let Some(rc) = weak.upgrade() else {
            return;
        };
        if hostcalls::set_effective_context(context_id).is_err() {
            return;
        }
        let borrowed = rc.try_borrow_mut();
        if let Ok(mut flow) = borrowed {
            let mut host = Root::host_for(shared, context_id, Rc::downgrade(&rc), clock);
            f(&mut flow, &mut host);
        };
    }
}

impl Root {
    /// A reply to one of this worker's batch calls: each member's verdict
    /// goes to its own stream (a stream that left is skipped). The reply is
    /// read first, as the root: switching context drops the callout's
    /// buffers. False if `token` is not a batch call.
    fn on_batch_reply(
        shared: &Shared,
        root_id: u32,
        token: u32,
        (num_headers, body_size): (usize, usize),
        (nonce, now): (Option<&str>, Duration),
    ) -> bool {
        let owned = shared
            .batcher
            .try_borrow()
            .is_ok_and(|b| b.as_ref().is_some_and(|b| b.owns(token)));
        if !owned {
            return false;
        }
        let reply = callout_reply(num_headers, body_size, usize::MAX, nonce);
        Root::with_batcher(shared, (root_id, Some(now)), |b, host, target| {
            b.on_reply(host, target, token, &reply)
        });
        true
    }

    /// Runs `f` on this worker's batcher as the root, then hands the
    /// verdicts it produced to their streams and switches back to the root.
    fn with_batcher(
        shared: &Shared,
        (root_id, clock): (u32, Option<Duration>),
        f: impl FnOnce(
            &mut Batcher<Stream>,
            &mut ProxyHost<'_>,
            &RedisTarget,
        ) -> Vec<(Stream, BatchVerdict)>,
    ) {
        let mut host = ProxyHost {
            shared: Some(shared),
            context_id: root_id,
            me: Weak::new(),
            via_root: false,
            clock: CallbackClock::new(clock),
        };
        // The members' hosts share the batcher's clock: one read for all.
        let clock = Some(host.clock());
        let verdicts = match shared.batcher.try_borrow_mut() {
            Ok(mut batcher) => match batcher.as_mut() {
                Some(b) => f(b, &mut host, &shared.config.redis),
                None => Vec::new(),
            },
            Err(_) => Vec::new(),
        };
        for (stream, verdict) in verdicts {
            Root::as_stream(
                shared,
                (stream.context_id, clock),
                &stream.flow,
                |flow, host| flow.on_batch_verdict(host, verdict),
            );
        }
        let _ = hostcalls::set_effective_context(root_id);
    }
}

/// Registers this worker's batch wake-up queue under a random name.
fn register_queue(seed: &std::collections::hash_map::RandomState) -> Option<u32> {
    use std::hash::BuildHasher;
    let name = format!("redis-guard/batch/{:016x}", seed.hash_one(host_now()));
    match hostcalls::register_shared_queue(&name) {
        Ok(id) => Some(id),
        Err(e) => {
            log::warn!("redis-guard: no shared queue ({e:?}); this worker decides without batches");
            None
        }
    }
}

impl Context for Root {
    /// Replies to calls the root sent for a stream during a tick.
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(shared) = self.shared.clone() else {
            return;
        };
        let now = host_now();
        let nonce = shared.note_reply(token_id, now);
        let nonce = nonce.as_deref();
        if Root::on_batch_reply(
            &shared,
            self.context_id,
            token_id,
            (num_headers, body_size),
            (nonce, now),
        ) {
            return;
        }
        if shared.deferred.try_borrow().is_ok_and(|r| r.owns(token_id)) {
            // Nobody waits on these: the answer matters only for a NOSCRIPT
            // (sent again as EVAL), a refusal (sent again) and the log.
            let reply = callout_reply(num_headers, body_size, usize::MAX, nonce);
            let mut host = Root::host_for(&shared, self.context_id, Weak::new(), Some(now));
            host.via_root = false;
            if let Ok(mut deferred) = shared.deferred.try_borrow_mut() {
                deferred.on_reply(&mut host, &shared.config.redis, token_id, &reply);
                // A refused call queued again waits for a tick: make sure one
                // comes (the root's own context is the current one here).
                if deferred.pending() {
                    let _ = shared.tick(self.context_id);
                }
            }
            return;
        }
        let prefetch = take(&shared.prefetches, token_id);
        if let Some(note) = prefetch {
            if let Ok(mut routed) = shared.routed.try_borrow_mut() {
                routed.remove(&token_id);
            }
            // A lease reply: read whole.
            let reply = callout_reply(num_headers, body_size, usize::MAX, nonce);
            let mut host = Root::host_for(&shared, self.context_id, Weak::new(), Some(now));
            on_prefetch_reply(&mut host, &note, reply);
            return;
        }
        let entry = take(&shared.routed, token_id);
        let Some((context_id, weak)) = entry else {
            return;
        };
        Root::as_stream(&shared, (context_id, Some(now)), &weak, |flow, host| {
            let reply = callout_reply(num_headers, body_size, flow.reply_limit(token_id), nonce);
            flow.on_callout_reply(host, token_id, reply);
        });
    }
}

impl RootContext for Root {
    /// A stream queued a decision: send what every group has room for.
    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(shared) = self.shared.clone() else {
            return;
        };
        if shared.batch_queue != Some(queue_id) {
            return;
        }
        while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
        shared.wake_pending.set(false);
        Root::with_batcher(&shared, (self.context_id, None), |b, host, target| {
            b.flush(host, target)
        });
    }

    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(Some(raw)) => raw,
            Ok(None) => {
                log::error!("redis-guard: no plugin configuration given");
                return false;
            }
            Err(e) => {
                log::error!("redis-guard: cannot read plugin configuration: {e:?}");
                return false;
            }
        };
        match Config::parse(&raw) {
            Ok(config) => {
                log::info!(
                    "redis-guard: configured {} limit(s), redis cluster `{}`, tz database {}",
                    config.limits.len(),
                    config.redis.cluster,
                    crate::quota::TZDB_RELEASE
                );
                // A new configuration brings new breakers: an open old one
                // no longer counts in the gauge.
                if let Some(old) = &self.shared {
                    let open = i64::try_from(old.breakers.tripped()).unwrap_or(0);
                    if open > 0 && old.metrics.circuit_open_workers != UNDEFINED {
                        let _ =
                            hostcalls::increment_metric(old.metrics.circuit_open_workers, -open);
                    }
                }
                let metrics = Metrics::define(&config);
                let breakers = Rc::new(Breakers::new(
                    config.redis.breaker_failures,
                    config.redis.breaker_cool_down,
                ));
                let token_seed = std::collections::hash_map::RandomState::new();
                let batch_queue = config.redis.batch.and_then(|_| register_queue(&token_seed));
                let batcher = config
                    .redis
                    .batch
                    .filter(|_| batch_queue.is_some())
                    .map(|b| Batcher::new(b, Rc::clone(&breakers)));
                self.shared = Some(Rc::new(Shared {
                    config: Rc::new(config),
                    metrics,
                    breakers,
                    root_id: self.context_id,
                    token_seed,
                    token_counter: std::cell::Cell::new(0),
                    waiting: RefCell::new(Timers::default()),
                    wakeable: RefCell::new(HashMap::new()),
                    routed: RefCell::new(HashMap::new()),
                    in_flight: RefCell::new(InFlight::default()),
                    prefetches: RefCell::new(HashMap::new()),
                    to_prefetch: RefCell::new(Vec::new()),
                    leases: RefCell::new(Held::default()),
                    batch_queue,
                    wake_pending: std::cell::Cell::new(false),
                    batcher: RefCell::new(batcher),
                    deferred: RefCell::new(Deferred::default()),
                    ticking: std::cell::Cell::new(false),
                    slow: std::cell::Cell::new(false),
                }));
                true
            }
            Err(e) => {
                log::error!("redis-guard: {e}");
                false
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK panics on None; a context without configuration passes traffic.
        Some(Box::new(Http {
            context_id,
            flow: self.shared.as_ref().map(|s| {
                Rc::new(RefCell::new(Flow::new(
                    Rc::clone(&s.config),
                    Rc::clone(&s.breakers),
                )))
            }),
            shared: self.shared.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn on_tick(&mut self) {
        let Some(shared) = self.shared.clone() else {
            return;
        };
        let now = host_now();
        Root::with_batcher(&shared, (self.context_id, Some(now)), |b, host, target| {
            b.on_tick(host, target)
        });
        // Leased tokens due back join the deferred calls sent just below.
        if let Ok(mut held) = shared.leases.try_borrow_mut() {
            if !held.is_empty() {
                let mut host = Root::host_for(&shared, self.context_id, Weak::new(), Some(now));
                host.via_root = false;
                give_back(&mut host, &shared.config, &mut held, shared.slow.get());
            }
        }
        if let Ok(mut deferred) = shared.deferred.try_borrow_mut() {
            if deferred.pending() {
                let mut host = Root::host_for(&shared, self.context_id, Weak::new(), Some(now));
                host.via_root = false;
                deferred.flush(&mut host, &shared.config.redis);
            }
        }
        let prefetches: Vec<_> = match shared.to_prefetch.try_borrow_mut() {
            Ok(mut queued) => queued.drain(..).collect(),
            Err(_) => Vec::new(),
        };
        for (command, timeout, note) in prefetches {
            let target = &shared.config.redis;
            let (with, nonce) = shared.with_nonce(&command);
            let command = with.unwrap_or(command);
            match hostcalls::dispatch_http_call(
                &target.cluster,
                callout_headers(target, &command),
                Some(&command.body),
                vec![],
                timeout,
            ) {
                Ok(token) => {
                    // Read afresh as the call leaves, as every call's is
                    // (clock.rs): `now` is the tick's start, before the
                    // batches and deferred calls above went out.
                    shared.note_sent(token, host_now(), timeout, nonce);
                    if let Ok(mut inflight) = shared.prefetches.try_borrow_mut() {
                        inflight.insert(token, note);
                    }
                }
                Err(e) => {
                    log::warn!("redis-guard: cannot prefetch a lease: {e:?}");
                    let mut host = Root::host_for(&shared, self.context_id, Weak::new(), Some(now));
                    let failed = CalloutReply {
                        status: None,
                        from_webdis: false,
                        body: Vec::new(),
                    };
                    on_prefetch_reply(&mut host, &note, failed);
                }
            }
        }
        let due: Vec<(u32, FlowRef)> = match shared.waiting.try_borrow_mut() {
            Ok(mut waiting) => {
                let due = waiting.take_due(now);
                // The tick stops only when nothing waits for it: no stream's
                // pause, no batch sent back after a refusal (whose due time
                // is not one of `waiting`'s), no queue whose wake-up failed,
                // no release due later.
                let batches_wait = shared
                    .batcher
                    .try_borrow()
                    .map_or(true, |b| b.as_ref().is_some_and(Batcher::needs_tick));
                let deferred_wait = shared.deferred.try_borrow().map_or(true, |d| d.pending());
                let leases_wait = shared.leases.try_borrow().map_or(true, |h| !h.is_empty());
                // Only watched lease slots wait: a slower tick will do.
                let period = if leases_wait {
                    LEASE_TICK
                } else {
                    Duration::ZERO
                };
                // Already at the lease tick with only leases waiting: keep it.
                let settled = leases_wait && shared.slow.get();
                if waiting.is_empty()
                    && !batches_wait
                    && !deferred_wait
                    && !settled
                    && hostcalls::set_tick_period(period).is_ok()
                {
                    shared.ticking.set(leases_wait);
                    shared.slow.set(leases_wait);
                }
                let flows = shared.wakeable.try_borrow().ok();
                due.into_iter()
                    .filter_map(|ctx| Some((ctx, flows.as_ref()?.get(&ctx)?.clone())))
                    .collect()
            }
            Err(_) => return,
        };
        for (context_id, weak) in due {
            Root::as_stream(&shared, (context_id, Some(now)), &weak, |flow, host| {
                flow.on_wake(host)
            });
        }
        let _ = hostcalls::set_effective_context(self.context_id);
    }
}

struct Http {
    context_id: u32,
    /// Shared with the root, which resumes the flow after a retry pause.
    flow: Option<Rc<RefCell<Flow>>>,
    shared: Option<Rc<Shared>>,
}

impl Drop for Http {
    fn drop(&mut self) {
        self.forget_wake_ups();
    }
}

impl Http {
    /// The stream is over: nothing wakes it any more.
    fn forget_wake_ups(&self) {
        let Some(shared) = self.shared.as_deref() else {
            return;
        };
        // Most streams never wait: an empty table is not hashed into (this
        // runs at on_log and again as the context goes).
        if let Ok(mut waiting) = shared.waiting.try_borrow_mut() {
            if !waiting.is_empty() {
                waiting.cancel(self.context_id);
            }
        }
        if let Ok(mut flows) = shared.wakeable.try_borrow_mut() {
            if !flows.is_empty() {
                flows.remove(&self.context_id);
            }
        }
    }

    /// Runs `f` on the flow with a host for this stream.
    fn with_flow<R>(
        &mut self,
        default: R,
        f: impl FnOnce(&mut Flow, &mut ProxyHost<'_>) -> R,
    ) -> R {
        self.with_flow_at(None, default, f)
    }

    /// [`Http::with_flow`] with the callback's clock, when it was read.
    fn with_flow_at<R>(
        &mut self,
        clock: Option<Duration>,
        default: R,
        f: impl FnOnce(&mut Flow, &mut ProxyHost<'_>) -> R,
    ) -> R {
        let Some(rc) = self.flow.as_ref() else {
            return default;
        };
        let mut host = ProxyHost {
            shared: self.shared.as_deref(),
            context_id: self.context_id,
            me: Rc::downgrade(rc),
            via_root: false,
            clock: CallbackClock::new(clock),
        };
        match rc.try_borrow_mut() {
            Ok(mut flow) => f(&mut flow, &mut host),
            Err(_) => default,
        }
    }
}

fn action(a: FlowAction) -> Action {
    match a {
        FlowAction::Continue => Action::Continue,
        FlowAction::Pause => Action::Pause,
    }
}

impl Context for Http {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let now = host_now();
        let nonce = self
            .shared
            .as_deref()
            .and_then(|s| s.note_reply(token_id, now));
        self.with_flow_at(Some(now), (), |flow, host| {
            let reply = callout_reply(
                num_headers,
                body_size,
                flow.reply_limit(token_id),
                nonce.as_deref(),
            );
            flow.on_callout_reply(host, token_id, reply)
        });
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        #[cfg(feature = "panic-trigger")]
        panic_if_asked();
        self.with_flow(Action::Continue, |flow, host| {
            action(flow.on_request_headers(host, end_of_stream))
        })
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.with_flow(Action::Continue, |flow, host| {
            action(flow.on_request_body(host, body_size, end_of_stream))
        })
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.with_flow(Action::Continue, |flow, host| {
            action(flow.on_request_trailers(host))
        })
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.with_flow(Action::Continue, |flow, host| {
            action(flow.on_response_headers(host, end_of_stream))
        })
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.with_flow(Action::Continue, |flow, host| {
            action(flow.on_response_trailers(host))
        })
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.with_flow(Action::Continue, |flow, host| {
            action(flow.on_response_body(host, body_size, end_of_stream))
        })
    }

    fn on_log(&mut self) {
        self.with_flow((), |flow, host| flow.on_stream_end(host));
        self.forget_wake_ups();
    }
}

/// Test builds only (`--features panic-trigger`, tests/e2e_panic.rs): a
/// request carrying this header panics, to show what a panic does in Envoy.
#[cfg(feature = "panic-trigger")]
#[allow(clippy::panic)]
fn panic_if_asked() {
    if let Ok(Some(_)) = hostcalls::get_map_value_bytes(
        proxy_wasm::types::MapType::HttpRequestHeaders,
        "x-redis-guard-test-panic",
    ) {
        panic!("asked to by x-redis-guard-test-panic");
    }
}
