//! proxy-wasm glue: the only code that calls the host. Host calls go through
//! `hostcalls` (which return errors) rather than the trait defaults (which
//! unwrap), and every error is logged, not unwrapped. The SDK still panics on
//! statuses it does not expect, so maps that may be absent are not read.
//!
//! The files follow the ABI's callbacks: [`root`] the root context (the
//! configuration, the tick), [`http`] the HTTP context (a stream's
//! callbacks), [`callouts`] every callout's reply; [`host`] is the filter's
//! `Host` over host calls, [`reply`] reads a reply, [`metrics`] defines the
//! stats, [`abi`] the calls the SDK would panic on. This file starts the VM
//! and holds what the root and its streams share ([`Shared`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::{Rc, Weak};
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::RootContext;
use proxy_wasm::types::LogLevel;

use crate::breaker::Breakers;
use crate::config::Config;
use crate::filter::deferred::Deferred;
use crate::filter::flow::Flow;
use crate::filter::handoff::Prefetch;
use crate::filter::in_flight::InFlight;
use crate::filter::stage::batch::{Batcher, Waiter};
use crate::filter::stage::lease::Held;
use crate::filter::timers::Timers;
use crate::scripts::{BATCH, LEASE, RATELIMIT};
use crate::webdis::Command;

mod abi;
mod callouts;
mod host;
mod http;
mod metrics;
mod reply;
mod root;

use metrics::{Metrics, UNDEFINED};
use root::Root;

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
    /// one back (the scripts whose replies decide requests: the book, Running
    /// it: When things fail), and that nonce; `None`s for any other command. The
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
