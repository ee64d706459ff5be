//! The root context, one per worker (VM): it reads the configuration,
//! creates each stream's context, and on its tick sends what the streams
//! left to it (batches, deferred calls, leased tokens given back,
//! background lease fetches) and wakes the streams whose pause is over.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::{Rc, Weak};
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType};

use crate::breaker::Breakers;
use crate::config::{Config, RedisTarget};
use crate::filter::clock::CallbackClock;
use crate::filter::deferred::Deferred;
use crate::filter::flow::Flow;
use crate::filter::in_flight::InFlight;
use crate::filter::stage::batch::{Batcher, Verdict as BatchVerdict};
use crate::filter::stage::lease::{give_back, on_prefetch_reply, Held};
use crate::filter::timers::Timers;
use crate::filter::CalloutReply;

use super::host::{callout_headers, ProxyHost};
use super::http::Http;
use super::metrics::{Metrics, UNDEFINED};
use super::{host_now, FlowRef, Shared, Stream, LEASE_TICK};

pub(super) struct Root {
    pub(super) context_id: u32,
    pub(super) shared: Option<Rc<Shared>>,
}

impl Root {
    pub(super) fn host_for<'a>(
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
            ended: false,
        }
    }
}

impl Root {
    /// Runs `f` on a stream's flow as that stream (the root delivers replies
    /// and timers to streams); nothing if the stream is gone. The caller
    /// switches back to the root.
    pub(super) fn as_stream(
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
            host.ended = flow.ended();
            f(&mut flow, &mut host);
        };
    }
}

impl Root {
    /// Runs `f` on this worker's batcher as the root, then hands the
    /// verdicts it produced to their streams and switches back to the root.
    pub(super) fn with_batcher(
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
            ended: false,
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
