//! The host calls an admitted request makes, per scenario of `make bench`:
//! each is a crossing out of the wasm VM (BENCHMARKS.md, "host calls per
//! request"). The fake host counts what the filter asks; each ask is weighed
//! by the ABI calls `proxy::host` makes for it.
//!
//! `cargo test --lib host_calls -- --nocapture` prints the breakdown.

use std::cell::RefCell;
use std::collections::BTreeMap;

use super::*;
use crate::config::{ObjectStore, RedisTarget};
use crate::filter::call::Failure;
use crate::filter::clock::CallbackClock;
use crate::filter::deferred;
use crate::filter::handoff::Member;
use crate::filter::stage::batch::Verdict;
use crate::filter::Histogram;
use crate::request::RequestView;
use crate::webdis::{parse_reply, Command};

/// The fake host, counting: (what the filter asked, ABI calls it costs).
struct Counting<'a> {
    host: &'a mut FakeHost,
    limit_names: Vec<String>,
    calls: RefCell<BTreeMap<&'static str, usize>>,
    /// The clock as `ProxyHost` keeps it for one callback.
    clock: CallbackClock,
}

impl<'a> Counting<'a> {
    fn new(host: &'a mut FakeHost, cfg: &Config) -> Counting<'a> {
        Counting {
            host,
            limit_names: cfg.limits.iter().map(|l| l.name.clone()).collect(),
            calls: RefCell::new(BTreeMap::new()),
            clock: CallbackClock::new(None),
        }
    }

    /// Envoy calls the filter again: a new `ProxyHost`, a new clock.
    fn callback(&mut self) {
        self.clock = CallbackClock::new(None);
    }

    fn read_clock(&self) -> Duration {
        self.note("get_current_time", 1);
        self.host.now()
    }

    fn clock(&self) -> Duration {
        self.clock.now(|| self.read_clock())
    }

    /// What `proxy::Http::on_http_call_response` does before the flow sees
    /// a Webdis reply: the clock (the call's latency, recorded), `:status`,
    /// `server` and the body.
    fn callout_reply(&mut self) {
        self.callback();
        self.clock();
        self.note("record_metric", 1);
        self.note("get_header_map_value (callout)", 2);
        self.note("get_buffer_bytes", 1);
    }

    fn note(&self, what: &'static str, abi_calls: usize) {
        *self.calls.borrow_mut().entry(what).or_default() += abi_calls;
    }

    /// The root hands a batch member its verdict: it switches to the
    /// member's context, whose host shares the batch's clock (read once per
    /// batch by the root).
    fn batch_verdict(&mut self) {
        self.clock = CallbackClock::new(Some(self.host.now()));
        self.note("set_effective_context", 1);
    }

    /// What `Shared::tick` makes when the root's tick is off (none when on).
    fn tick_root(&self) {
        self.note("set_tick_period, set_effective_context x2 (tick off)", 3);
    }

    /// Envoy stats a counter event moves: one `increment_metric` each.
    fn stats(&self, counter: Counter) -> usize {
        counter
            .stats(|i| self.limit_names.get(i).cloned().unwrap_or_default())
            .len()
    }

    fn total(&self) -> usize {
        self.calls.borrow().values().sum()
    }
}

impl RequestView for Counting<'_> {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.note("get_header_map_value (request)", 1);
        self.host.header(name)
    }
    fn client_address(&self) -> Option<String> {
        self.note("get_property", 1);
        self.host.client_address()
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.note("get_property", 1);
        self.host.property(path)
    }
}

impl Host for Counting<'_> {
    fn dispatch_redis(&mut self, t: &RedisTarget, c: &Command, d: Duration) -> Result<u32, String> {
        // The dispatch, and the clock afresh for its latency and nonce
        // deadline.
        self.note("dispatch_http_call", 1);
        self.clock.renew(|| self.read_clock());
        self.host.dispatch_redis(t, c, d)
    }
    fn now(&self) -> Duration {
        self.clock()
    }
    fn dispatch_redis_detached(
        &mut self,
        t: &RedisTarget,
        c: &Command,
        d: Duration,
    ) -> Result<u32, String> {
        self.note("dispatch_http_call", 1);
        self.note("set_effective_context", 2);
        self.clock.renew(|| self.read_clock());
        self.host.dispatch_redis_detached(t, c, d)
    }
    fn request_body(&mut self, size: usize) -> Vec<u8> {
        self.note("get_buffer_bytes", 1);
        self.host.request_body(size)
    }
    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        self.note("get_header_map_value (response)", 1);
        self.host.response_header(name)
    }
    fn response_header_values(&self, name: &str) -> Vec<Vec<u8>> {
        self.note("get_header_map_pairs", 1);
        self.host.response_header_values(name)
    }
    fn response_trailer(&self, name: &str) -> Option<Vec<u8>> {
        self.note("get_header_map_value (response)", 1);
        self.host.response_trailer(name)
    }
    fn response_body(&mut self, size: usize) -> Vec<u8> {
        self.note("get_buffer_bytes", 1);
        self.host.response_body(size)
    }
    fn response_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.note("get_header_map_pairs", 1);
        self.host.response_headers()
    }
    fn response_trailers(&self) -> Vec<(String, Vec<u8>)> {
        self.note("get_header_map_pairs", 1);
        self.host.response_trailers()
    }
    fn set_request_header(&mut self, name: &str, value: Option<&[u8]>) {
        self.note("replace_header_map_value", 1);
        self.host.set_request_header(name, value);
    }
    fn set_response_headers(&mut self, headers: &[(String, Vec<u8>)]) {
        self.note("set_header_map_pairs", 1);
        self.host.set_response_headers(headers);
    }
    fn set_response_body(&mut self, size: usize, body: &[u8]) {
        self.note("set_buffer_bytes", 1);
        self.host.set_response_body(size, body);
    }
    fn add_response_trailer(&mut self, name: &str, value: &[u8]) {
        self.note("add_header_map_value", 1);
        self.host.add_response_trailer(name, value);
    }
    fn resume_response(&mut self) {
        self.note("continue_stream", 1);
        self.host.resume_response();
    }
    fn dispatch_prefetch(
        &mut self,
        t: &RedisTarget,
        c: &Command,
        d: Duration,
        note: Prefetch,
    ) -> Result<(), String> {
        self.tick_root();
        self.host.dispatch_prefetch(t, c, d, note)
    }
    fn dispatch_object(
        &mut self,
        s: &ObjectStore,
        h: &[(String, String)],
        b: Option<&[u8]>,
        d: Duration,
    ) -> Result<u32, String> {
        self.note("dispatch_http_call", 1);
        self.host.dispatch_object(s, h, b, d)
    }
    fn wake_later(&mut self, delay: Duration) -> bool {
        self.clock();
        self.tick_root();
        self.host.wake_later(delay)
    }
    fn unique_token(&mut self) -> String {
        self.clock();
        self.host.unique_token()
    }
    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.note("get_shared_data", 1);
        self.host.shared_get(key)
    }
    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        self.note("set_shared_data", 1);
        self.host.shared_set(key, value, cas)
    }
    fn send_reply(&mut self, reply: &LocalReply) {
        self.note("send_local_response", 1);
        self.host.send_reply(reply);
    }
    fn resume_request(&mut self) {
        self.note("continue_stream", 1);
        self.host.resume_request();
    }
    fn add_response_header(&mut self, name: &str, value: &str) {
        self.note("add_header_map_value", 1);
        self.host.add_response_header(name, value);
    }
    fn count(&mut self, counter: Counter) {
        self.note("increment_metric", self.stats(counter));
        self.host.count(counter);
    }
    fn count_n(&mut self, counter: Counter, n: u64) {
        self.note("increment_metric", self.stats(counter));
        self.host.count_n(counter, n);
    }
    fn observe(&mut self, histogram: Histogram, value: u64) {
        self.note("record_metric", 1);
        self.host.observe(histogram, value);
    }
    fn set_filter_state(&mut self, name: &str, value: &[u8]) {
        self.note("set_property", 1);
        self.host.set_filter_state(name, value);
    }
    fn join_batch(&mut self, t: &RedisTarget, member: Member) -> Result<(), Failure> {
        // The wake-up of the root, when none is pending: at most one.
        self.note("enqueue_shared_queue (at most)", 1);
        self.host.join_batch(t, member)
    }
    fn batch_alone(&mut self, tag: &str) -> bool {
        self.host.batch_alone(tag)
    }
    fn defer(
        &mut self,
        kind: deferred::Kind,
        tag: &str,
        args: crate::ratelimit::ScriptArgs,
        after: Duration,
    ) -> Result<(), String> {
        self.tick_root();
        self.clock();
        self.host.defer(kind, tag, args, after)
    }
    fn lease_held(&mut self, slot: &crate::lease::Slot, limit_key: &[u8], limit: usize) {
        self.tick_root();
        self.host.lease_held(slot, limit_key, limit)
    }
    fn batch_release(&mut self, tag: &str) {
        // Wakes the root when requests queued behind the lone call.
        self.note("enqueue_shared_queue (at most)", 1);
        self.host.batch_release(tag);
    }
}

/// `make bench`'s filter: one token bucket per `x-user` (envoy/bench.py).
fn bench_config(extra: &str, batch: bool) -> Rc<Config> {
    let batch = if batch {
        ""
    } else {
        r#""batch":{"enabled":false},"#
    };
    let json = format!(
        r#"{{"redis":{{{batch}"cluster":"webdis","timeoutMs":500}},"keyPrefix":"rg",
        "failureMode":"deny","limits":[{{"name":"bench-tb","descriptor":[{{"header":"x-user"}}],
        "tokenBucket":{{"capacity":1000000000,"refill":1000000000,"periodMs":1000}}{extra}}}]}}"#
    );
    Rc::new(Config::parse(json.as_bytes()).unwrap())
}

fn bench_request(user: bool) -> FakeHost {
    let h = FakeHost::get("/bench");
    if user {
        h.with("x-user", b"u1")
    } else {
        h
    }
}

/// The calls of one request's whole life (an upstream 200 with a body),
/// `decide` standing for whatever answers its decision.
fn one_request(
    cfg: &Rc<Config>,
    h: &mut FakeHost,
    decide: impl FnOnce(&mut Flow, &mut Counting<'_>),
) -> BTreeMap<&'static str, usize> {
    let mut c = Counting::new(h, cfg);
    let mut f = Flow::new(cfg.clone(), test_breaker());
    f.on_request_headers(&mut c, true);
    c.callback();
    decide(&mut f, &mut c);
    c.host.response = vec![
        (":status".into(), b"200".to_vec()),
        ("content-length".into(), b"2".to_vec()),
    ];
    c.host.response_chunks = vec![b"ok".to_vec()];
    c.callback();
    f.on_response_headers(&mut c, false);
    c.callback();
    f.on_response_body(&mut c, 2, true);
    c.callback();
    f.on_stream_end(&mut c);
    assert_eq!(c.host.sent.len(), 0, "admitted");
    let total = c.total();
    let mut calls = c.calls.into_inner();
    calls.insert("= total", total);
    calls
}

fn show(scenario: &str, calls: &BTreeMap<&'static str, usize>) {
    println!("{scenario}:");
    for (what, n) in calls {
        println!("  {n:>2} {what}");
    }
}

#[test]
fn an_admitted_request_makes_these_host_calls_in_each_bench_scenario() {
    // (x): the limit does not apply (no x-user).
    let cfg = bench_config("", false);
    let mut h = bench_request(false);
    let x = one_request(&cfg, &mut h, |_, _| ());
    assert_eq!(h.dispatched.len(), 0, "(x) calls nothing");
    show("(x) nothing applies", &x);
    // (b): one call of its own.
    let mut h = bench_request(true);
    let b = one_request(&cfg, &mut h, |f, c| {
        c.callout_reply();
        f.on_callout_reply(c, 1, ok(ADMIT));
    });
    assert_eq!((h.dispatched.len(), h.resumed), (1, 1));
    show("(b) strict, 1 call", &b);
    // (f): a member of its worker's batch.
    let cfg = bench_config("", true);
    let mut h = bench_request(true);
    let f = one_request(&cfg, &mut h, |f, c| {
        c.batch_verdict();
        f.on_batch_verdict(c, Verdict::Ran(parse_reply(ADMIT).unwrap()));
    });
    assert_eq!((h.dispatched.len(), h.batched.len(), h.resumed), (0, 1, 1));
    show("(f) batched", &f);
    // (e): spent from a lease another request fetched.
    let cfg = bench_config(r#","lease":{"tokens":100,"ttlMs":1000}"#, false);
    let mut h = bench_request(true);
    let mut first = Flow::new(cfg.clone(), test_breaker());
    first.on_request_headers(&mut h, true);
    first.on_callout_reply(
        &mut h,
        1,
        ok(b"*9\r\n:1\r\n:1\r\n:999999899\r\n:0\r\n:1000\r\n:100\r\n:1000\r\n:96000\r\n:0\r\n"),
    );
    let e = one_request(&cfg, &mut h, |_, _| ());
    assert_eq!((h.dispatched.len(), count(&h, Counter::LeaseSpent)), (1, 1));
    show("(e) lease", &e);
    // The clock is read once per callback, and afresh as a call leaves
    // (its latency): (b) in its request's callback, at its dispatch and at
    // its reply. Before, every reading was a call: (b) made 7, (f) 4.
    let clock: Vec<usize> = [&b, &f, &e].iter().map(|m| m["get_current_time"]).collect();
    assert_eq!(clock, [3, 1, 1], "(b), (f), (e)");
    let totals: Vec<usize> = [&x, &b, &f, &e].iter().map(|m| m["= total"]).collect();
    assert_eq!(totals, [1, 20, 14, 8], "(x), (b), (f), (e)");
}
