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
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};

use crate::breaker::Breaker;
use crate::config::{Config, ObjectStore, RedisTarget};
use crate::filter::flow::{self, Action as FlowAction, CalloutReply, Flow, Prefetch};
use crate::filter::{Counter, ErrorKind, Host};
use crate::request::RequestView;
use crate::response::LocalReply;

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

/// Envoy stat ids, defined once per configuration. Envoy shows them under
/// `wasmcustom.`; names carry the limit or error kind as a dotted segment that
/// `stats_tags` in envoy.yaml turn into Prometheus labels.
#[derive(Default)]
struct Metrics {
    per_limit: Vec<[u32; 4]>,
    redis_calls: u32,
    script_reloads: u32,
    redis_retries: u32,
    redis_errors: u32,
    errors_by_kind: [u32; ErrorKind::ALL.len()],
    failure_allowed: u32,
    failure_denied: u32,
    idem: [u32; 15],
    circuit_opened: u32,
    circuit_closed: u32,
    circuit_short_circuited: u32,
    over_limit_cached: u32,
    lease_spent: u32,
    lease_fetched: u32,
    /// Gauge: workers of this Envoy whose breaker is open (or probing).
    circuit_open_workers: u32,
    local: [u32; 3],
    /// Histogram of callout round trips, in microseconds (loopback calls
    /// take well under a millisecond, which a ms histogram would show as 0).
    callout_latency_us: u32,
}

fn define(kind: MetricType, name: &str) -> u32 {
    match hostcalls::define_metric(kind, name) {
        Ok(id) => id,
        Err(e) => {
            log::warn!("redis-guard: cannot define metric {name}: {e:?}");
            u32::MAX
        }
    }
}

fn counter(name: &str) -> u32 {
    define(MetricType::Counter, name)
}

impl Metrics {
    fn define(config: &Config) -> Metrics {
        let per_limit = config
            .limits
            .iter()
            .map(|l| {
                let base = format!("redis_guard.ratelimit.{}", l.name);
                [
                    counter(&format!("{base}.checked")),
                    counter(&format!("{base}.allowed")),
                    counter(&format!("{base}.rejected")),
                    counter(&format!("{base}.shadow_rejected")),
                ]
            })
            .collect();
        Metrics {
            per_limit,
            redis_calls: counter("redis_guard.redis.calls"),
            script_reloads: counter("redis_guard.redis.script_reloads"),
            redis_retries: counter("redis_guard.redis.retries"),
            redis_errors: counter("redis_guard.redis.errors"),
            errors_by_kind: ErrorKind::ALL
                .map(|k| counter(&format!("redis_guard.redis.errors_by_kind.{}", k.name()))),
            failure_allowed: counter("redis_guard.failure_mode.allowed"),
            failure_denied: counter("redis_guard.failure_mode.denied"),
            idem: [
                "acquired",
                "replayed",
                "conflicted",
                "mismatched",
                "released",
                "stored",
                "store_failed",
                "too_large",
                "unguarded",
                "offloaded",
                "offload_failed",
                "object_fetched",
                "object_missing",
                "object_corrupt",
                "object_fetch_failed",
            ]
            .map(|n| counter(&format!("redis_guard.idempotency.{n}"))),
            circuit_opened: counter("redis_guard.circuit.opened"),
            circuit_closed: counter("redis_guard.circuit.closed"),
            over_limit_cached: counter("redis_guard.overlimit_cache.rejected"),
            lease_spent: counter("redis_guard.lease.spent"),
            lease_fetched: counter("redis_guard.lease.fetches"),
            circuit_open_workers: define(MetricType::Gauge, "redis_guard.circuit.open_workers"),
            callout_latency_us: define(
                MetricType::Histogram,
                "redis_guard.redis.callout_latency_us",
            ),
            circuit_short_circuited: counter("redis_guard.circuit.short_circuited"),
            local: [
                counter("redis_guard.failure_mode.local"),
                counter("redis_guard.local.allowed"),
                counter("redis_guard.local.rejected"),
            ],
        }
    }

    /// The (metric, increment) pairs a counter event moves.
    fn updates(&self, c: Counter) -> [Option<(u32, i64)>; 2] {
        match c {
            Counter::RedisError(kind) => {
                let i = ErrorKind::ALL.iter().position(|k| *k == kind);
                [
                    Some((self.redis_errors, 1)),
                    i.map(|i| (self.errors_by_kind[i], 1)),
                ]
            }
            Counter::CircuitTripped => [Some((self.circuit_open_workers, 1)), None],
            Counter::CircuitClosed => [
                Some((self.circuit_closed, 1)),
                Some((self.circuit_open_workers, -1)),
            ],
            other => [self.id(other).map(|id| (id, 1)), None],
        }
    }

    fn id(&self, c: Counter) -> Option<u32> {
        let limit = |i: usize, k: usize| self.per_limit.get(i).map(|ids| ids[k]);
        match c {
            Counter::Checked(i) => limit(i, 0),
            Counter::Allowed(i) => limit(i, 1),
            Counter::Rejected(i) => limit(i, 2),
            Counter::ShadowRejected(i) => limit(i, 3),
            Counter::RedisCalls => Some(self.redis_calls),
            Counter::ScriptReloads => Some(self.script_reloads),
            Counter::RedisRetries => Some(self.redis_retries),
            Counter::FailureAllowed => Some(self.failure_allowed),
            Counter::FailureDenied => Some(self.failure_denied),
            Counter::IdemAcquired => Some(self.idem[0]),
            Counter::IdemReplayed => Some(self.idem[1]),
            Counter::IdemConflicts => Some(self.idem[2]),
            Counter::IdemMismatches => Some(self.idem[3]),
            Counter::IdemReleased => Some(self.idem[4]),
            Counter::IdemStored => Some(self.idem[5]),
            Counter::IdemStoreFailed => Some(self.idem[6]),
            Counter::IdemTooLarge => Some(self.idem[7]),
            Counter::IdemUnguarded => Some(self.idem[8]),
            Counter::IdemOffloaded => Some(self.idem[9]),
            Counter::IdemOffloadFailed => Some(self.idem[10]),
            Counter::IdemObjectFetched => Some(self.idem[11]),
            Counter::IdemObjectMissing => Some(self.idem[12]),
            Counter::IdemObjectCorrupt => Some(self.idem[13]),
            Counter::IdemObjectFetchFailed => Some(self.idem[14]),
            Counter::CircuitOpened => Some(self.circuit_opened),
            Counter::CircuitShortCircuited => Some(self.circuit_short_circuited),
            Counter::OverLimitCached => Some(self.over_limit_cached),
            Counter::LeaseSpent => Some(self.lease_spent),
            Counter::LeaseFetched => Some(self.lease_fetched),
            Counter::RedisError(_) | Counter::CircuitTripped | Counter::CircuitClosed => None,
            Counter::FailureLocal => Some(self.local[0]),
            Counter::LocalAllowed => Some(self.local[1]),
            Counter::LocalRejected => Some(self.local[2]),
        }
    }
}

struct Shared {
    config: Rc<Config>,
    metrics: Metrics,
    /// One breaker per worker (VM): what it learns about Redis is shared by
    /// that worker's requests.
    breaker: Rc<Breaker>,
    /// The root context's id: calls that must outlive a stream run as it.
    root_id: u32,
    /// Seeds owner tokens: random per VM (WASI random), then a counter.
    token_seed: std::collections::hash_map::RandomState,
    token_counter: std::cell::Cell<u64>,
    /// Streams waiting out the pause after a Webdis 503: (stream, due, flow).
    waiting: RefCell<Vec<(u32, Duration, FlowRef)>>,
    /// Calls the root sent for a stream (on tick): token -> (stream, flow).
    routed: RefCell<HashMap<u32, (u32, FlowRef)>>,
    /// When each call in flight was sent, for the latency histogram.
    sent_at: RefCell<HashMap<u32, Duration>>,
    /// Background lease fetches in flight (sent as the root): token -> note.
    prefetches: RefCell<HashMap<u32, Prefetch>>,
    /// Background lease fetches the root sends on its next tick: a call's
    /// reply goes to the context that was running when it was sent, and
    /// only the root outlives the request that asked.
    to_prefetch: RefCell<Vec<(Vec<u8>, Duration, Prefetch)>>,
}

/// Calls in flight tracked for latency before stale entries are swept: a
/// stream that ends first cancels its call, and no reply removes the entry.
const SENT_AT_SWEEP: usize = 4096;

impl Shared {
    fn note_sent(&self, token: u32, now: Duration) {
        if let Ok(mut sent) = self.sent_at.try_borrow_mut() {
            if sent.len() >= SENT_AT_SWEEP {
                // No call outlives the longest timeout the config allows.
                sent.retain(|_, at| now.saturating_sub(*at) < Duration::from_secs(120));
                // Still full (many live calls, or resets faster than the
                // sweep ages them out): start over and lose a few samples,
                // rather than scan the table on every call.
                if sent.len() >= SENT_AT_SWEEP / 2 {
                    sent.clear();
                }
            }
            sent.insert(token, now);
        }
    }

    fn note_reply(&self, token: u32) {
        let at = self
            .sent_at
            .try_borrow_mut()
            .ok()
            .and_then(|mut sent| sent.remove(&token));
        if let Some(at) = at {
            let us = u64::try_from(host_now().saturating_sub(at).as_micros()).unwrap_or(u64::MAX);
            if self.metrics.callout_latency_us != u32::MAX {
                let _ = hostcalls::record_metric(self.metrics.callout_latency_us, us);
            }
        }
    }
}

/// The proxy's clock (deadlines, retry pauses, local buckets).
fn host_now() -> Duration {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .unwrap_or_default()
}

/// A stream's flow as the root holds it: gone when the stream is.
type FlowRef = Weak<RefCell<Flow>>;

/// How often the root looks at `waiting` while something waits.
/// Short: a background lease fetch waits for the next tick to be sent.
const TICK: Duration = Duration::from_millis(1);

struct Root {
    context_id: u32,
    shared: Option<Rc<Shared>>,
}

impl Root {
    fn host_for<'a>(shared: &'a Shared, context_id: u32, me: Weak<RefCell<Flow>>) -> ProxyHost<'a> {
        ProxyHost {
            shared: Some(shared),
            context_id,
            me,
            via_root: true,
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
        shared.note_reply(token_id);
        let prefetch = shared
            .prefetches
            .try_borrow_mut()
            .ok()
            .and_then(|mut p| p.remove(&token_id));
        if let Some(note) = prefetch {
            if let Ok(mut routed) = shared.routed.try_borrow_mut() {
                routed.remove(&token_id);
            }
            // A lease reply: read whole.
            let reply = callout_reply(num_headers, body_size, usize::MAX);
            let mut host = Root::host_for(&shared, self.context_id, Weak::new());
            flow::on_prefetch_reply(&mut host, &note, reply);
            return;
        }
        let entry = shared
            .routed
            .try_borrow_mut()
            .ok()
            .and_then(|mut r| r.remove(&token_id));
        let Some((context_id, weak)) = entry else {
            return;
        };
        let Some(rc) = weak.upgrade() else {
            return; // the stream is gone
        };
        if hostcalls::set_effective_context(context_id).is_err() {
            return;
        }
        let borrowed = rc.try_borrow_mut();
        if let Ok(mut flow) = borrowed {
            let reply = callout_reply(num_headers, body_size, flow.reply_limit(token_id));
            let mut host = Root::host_for(&shared, context_id, Rc::downgrade(&rc));
            flow.on_callout_reply(&mut host, token_id, reply);
        };
    }
}

impl RootContext for Root {
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
                    "redis-guard: configured {} limit(s), redis cluster `{}`",
                    config.limits.len(),
                    config.redis.cluster
                );
                // A new configuration brings new breakers: an open old one
                // no longer counts in the gauge.
                if let Some(old) = &self.shared {
                    if old.breaker.tripped() && old.metrics.circuit_open_workers != u32::MAX {
                        let _ = hostcalls::increment_metric(old.metrics.circuit_open_workers, -1);
                    }
                }
                let metrics = Metrics::define(&config);
                let breaker = Rc::new(Breaker::new(
                    config.redis.breaker_failures,
                    config.redis.breaker_cool_down,
                ));
                self.shared = Some(Rc::new(Shared {
                    config: Rc::new(config),
                    metrics,
                    breaker,
                    root_id: self.context_id,
                    token_seed: std::collections::hash_map::RandomState::new(),
                    token_counter: std::cell::Cell::new(0),
                    waiting: RefCell::new(Vec::new()),
                    routed: RefCell::new(HashMap::new()),
                    sent_at: RefCell::new(HashMap::new()),
                    prefetches: RefCell::new(HashMap::new()),
                    to_prefetch: RefCell::new(Vec::new()),
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
                    Rc::clone(&s.breaker),
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
        let prefetches: Vec<_> = match shared.to_prefetch.try_borrow_mut() {
            Ok(mut queued) => queued.drain(..).collect(),
            Err(_) => Vec::new(),
        };
        for (body, timeout, note) in prefetches {
            let target = &shared.config.redis;
            match hostcalls::dispatch_http_call(
                &target.cluster,
                callout_headers(target),
                Some(&body),
                vec![],
                timeout,
            ) {
                Ok(token) => {
                    shared.note_sent(token, now);
                    if let Ok(mut inflight) = shared.prefetches.try_borrow_mut() {
                        inflight.insert(token, note);
                    }
                }
                Err(e) => {
                    log::warn!("redis-guard: cannot prefetch a lease: {e:?}");
                    let mut host = Root::host_for(&shared, self.context_id, Weak::new());
                    let failed = CalloutReply {
                        status: None,
                        from_webdis: false,
                        body: Vec::new(),
                    };
                    flow::on_prefetch_reply(&mut host, &note, failed);
                }
            }
        }
        let due: Vec<(u32, FlowRef)> = match shared.waiting.try_borrow_mut() {
            Ok(mut waiting) => {
                let (due, later): (Vec<_>, Vec<_>) =
                    waiting.drain(..).partition(|(_, at, _)| *at <= now);
                *waiting = later;
                if waiting.is_empty() {
                    let _ = hostcalls::set_tick_period(Duration::ZERO);
                }
                due.into_iter().map(|(ctx, _, w)| (ctx, w)).collect()
            }
            Err(_) => return,
        };
        for (context_id, weak) in due {
            let Some(rc) = weak.upgrade() else {
                continue; // the stream is gone
            };
            if hostcalls::set_effective_context(context_id).is_err() {
                continue;
            }
            let borrowed = rc.try_borrow_mut();
            if let Ok(mut flow) = borrowed {
                let mut host = Root::host_for(&shared, context_id, Rc::downgrade(&rc));
                flow.on_retry_due(&mut host);
            };
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

/// The [`Host`] over proxy-wasm calls, for the current stream.
struct ProxyHost<'a> {
    shared: Option<&'a Shared>,
    context_id: u32,
    /// This stream's flow, for callbacks the root delivers later.
    me: Weak<RefCell<Flow>>,
    /// Calls are being sent from the root's tick: route their replies.
    via_root: bool,
}

fn callout_headers(target: &RedisTarget) -> Vec<(&str, &str)> {
    vec![
        (":method", "POST"),
        (":path", "/"),
        (":authority", &target.authority),
        ("content-type", "text/plain"),
    ]
}

impl RequestView for ProxyHost<'_> {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn client_address(&self) -> Option<String> {
        let raw = hostcalls::get_property(vec!["source", "address"]).ok()??;
        String::from_utf8(raw).ok()
    }
}

impl ProxyHost<'_> {
    fn route_reply(&self, token: u32) {
        if self.via_root {
            // Sent while the root runs: the SDK hands the reply to the root,
            // which passes it on to this stream's flow.
            if let Some(Ok(mut routed)) = self.shared.map(|s| s.routed.try_borrow_mut()) {
                routed.insert(token, (self.context_id, self.me.clone()));
            }
        }
    }
}

impl Host for ProxyHost<'_> {
    fn now(&self) -> Duration {
        host_now()
    }

    fn dispatch_redis(
        &mut self,
        target: &RedisTarget,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, String> {
        let token = hostcalls::dispatch_http_call(
            &target.cluster,
            callout_headers(target),
            Some(body),
            vec![],
            timeout,
        )
        .map_err(|e| format!("dispatch to cluster `{}` refused: {e:?}", target.cluster))?;
        if let Some(shared) = self.shared {
            shared.note_sent(token, host_now());
        }
        self.route_reply(token);
        Ok(token)
    }

    fn dispatch_object(
        &mut self,
        store: &ObjectStore,
        headers: &[(String, String)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, String> {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        // Not timed: the latency histogram is about Redis calls.
        let token =
            hostcalls::dispatch_http_call(&store.cluster, headers, body, vec![], timeout)
                .map_err(|e| format!("dispatch to cluster `{}` refused: {e:?}", store.cluster))?;
        self.route_reply(token);
        Ok(token)
    }

    fn dispatch_redis_detached(
        &mut self,
        target: &RedisTarget,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, String> {
        // A stream that is going away must not own the call: issue it as the
        // root context. Its reply finds no stream and is dropped, which is
        // fine: the release is owner-checked and the lock expires regardless.
        let Some(root) = self.shared.map(|s| s.root_id) else {
            return Err("not configured".to_string());
        };
        hostcalls::set_effective_context(root).map_err(|e| format!("{e:?}"))?;
        let sent = self.dispatch_redis(target, body, timeout);
        let _ = hostcalls::set_effective_context(self.context_id);
        sent
    }

    fn dispatch_prefetch(
        &mut self,
        _target: &RedisTarget,
        body: &[u8],
        timeout: Duration,
        note: Prefetch,
    ) -> Result<(), String> {
        let Some(shared) = self.shared else {
            return Err("not configured".to_string());
        };
        // The root sends it on its next tick (the period it owns); queued
        // only once a tick is sure to come.
        let _ = hostcalls::set_effective_context(shared.root_id);
        let ticking = hostcalls::set_tick_period(TICK);
        let _ = hostcalls::set_effective_context(self.context_id);
        ticking.map_err(|e| format!("{e:?}"))?;
        shared
            .to_prefetch
            .try_borrow_mut()
            .map_err(|_| "prefetch queue busy".to_string())?
            .push((body.to_vec(), timeout, note));
        Ok(())
    }

    fn request_body(&mut self, size: usize) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
            .ok()
            .flatten()
    }

    fn response_header_values(&self, name: &str) -> Vec<Vec<u8>> {
        hostcalls::get_map_bytes(MapType::HttpResponseHeaders)
            .map(|all| {
                all.into_iter()
                    .filter(|(n, _)| n.eq_ignore_ascii_case(name))
                    .map(|(_, v)| v)
                    .collect()
            })
            .unwrap_or_default()
    }

    fn response_body(&mut self, size: usize) -> Vec<u8> {
        if size == 0 {
            return Vec::new();
        }
        hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size)
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    fn resume_response(&mut self) {
        if let Err(e) = hostcalls::resume_http_response() {
            log::warn!("redis-guard: cannot resume response: {e:?}");
        }
    }

    fn retry_later(&mut self, delay: Duration) -> bool {
        let Some(shared) = self.shared else {
            return false;
        };
        let Ok(mut waiting) = shared.waiting.try_borrow_mut() else {
            return false;
        };
        waiting.push((self.context_id, self.now() + delay, self.me.clone()));
        drop(waiting);
        // The tick runs on the root context, which owns the period.
        let _ = hostcalls::set_effective_context(shared.root_id);
        let ok = hostcalls::set_tick_period(TICK).is_ok();
        let _ = hostcalls::set_effective_context(self.context_id);
        ok
    }

    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        hostcalls::set_shared_data(key, Some(value), cas).is_ok()
    }

    fn unique_token(&mut self) -> String {
        use std::hash::BuildHasher;
        let Some(shared) = self.shared else {
            return String::new();
        };
        let n = shared.token_counter.get().wrapping_add(1);
        shared.token_counter.set(n);
        let nanos = self.now().as_nanos();
        let a = shared.token_seed.hash_one((n, nanos, self.context_id));
        let b = shared.token_seed.hash_one((nanos, n, 0x9e37_79b9_u32));
        format!("{a:016x}{b:016x}")
    }

    fn send_local(&mut self, reply: &LocalReply) {
        let headers: Vec<(&str, &str)> = reply
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        if let Err(e) = hostcalls::send_http_response(reply.status, headers, Some(&reply.body)) {
            log::warn!("redis-guard: cannot send local reply: {e:?}");
        }
    }

    fn resume_request(&mut self) {
        if let Err(e) = hostcalls::resume_http_request() {
            log::warn!("redis-guard: cannot resume request: {e:?}");
        }
    }

    fn add_response_header(&mut self, name: &str, value: &str) {
        if let Err(e) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value) {
            log::warn!("redis-guard: cannot add response header {name}: {e:?}");
        }
    }

    fn count(&mut self, counter: Counter) {
        let Some(shared) = self.shared else {
            return;
        };
        for (id, by) in shared.metrics.updates(counter).into_iter().flatten() {
            if id != u32::MAX {
                let _ = hostcalls::increment_metric(id, by);
            }
        }
    }
}

impl Http {
    /// Runs `f` on the flow with a host for this stream.
    fn with_flow<R>(
        &mut self,
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
        };
        match rc.try_borrow_mut() {
            Ok(mut flow) => f(&mut flow, &mut host),
            Err(_) => default,
        }
    }
}

/// Reads the current callout's answer (headers may be absent on failure).
fn callout_reply(num_headers: usize, body_size: usize, max_body: usize) -> CalloutReply {
    // A failed call (reset, timeout) arrives with no headers, and reading
    // a missing map makes the SDK panic: do not read what is not there.
    if num_headers == 0 {
        return CalloutReply {
            status: None,
            from_webdis: false,
            body: Vec::new(),
        };
    }
    // Bytes, not strings: the SDK unwraps a failed UTF-8 conversion.
    let header = |name: &str| {
        hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, name)
            .ok()
            .flatten()
    };
    let status = header(":status").and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u32>().ok());
    let from_webdis = header("server").is_some_and(|s| s.eq_ignore_ascii_case(b"webdis"));
    let body = if body_size == 0 {
        Vec::new()
    } else if body_size > max_body {
        // Larger than the call can legitimately answer (an object fetch
        // longer than the stored object): not copied into the VM; the flow
        // sees a body that does not match what it expects.
        log::warn!("redis-guard: callout reply of {body_size} bytes not read (limit {max_body})");
        Vec::new()
    } else {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default()
    };
    CalloutReply {
        status,
        from_webdis,
        body,
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
        if let Some(shared) = self.shared.as_deref() {
            shared.note_reply(token_id);
        }
        self.with_flow((), |flow, host| {
            let reply = callout_reply(num_headers, body_size, flow.reply_limit(token_id));
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
    }
}

/// Test builds only (`--features panic-trigger`, tests/e2e_panic.rs): a
/// request carrying this header panics, to show what a panic does in Envoy.
#[cfg(feature = "panic-trigger")]
#[allow(clippy::panic)]
fn panic_if_asked() {
    if let Ok(Some(_)) =
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, "x-redis-guard-test-panic")
    {
        panic!("asked to by x-redis-guard-test-panic");
    }
}
