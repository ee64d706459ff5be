//! The one fake host every unit test of the filter runs against. It does
//! what Envoy does where a test must see it: callout tokens, shared data
//! with compare-and-swap (and races lost on demand), refused dispatches,
//! repeated and non-UTF-8 response headers, a clock the test moves.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use crate::breaker::Breakers;
use crate::config::RedisTarget;
use crate::filter::call::Failure;
use crate::filter::handoff::{Member, Prefetch};
use crate::filter::{CalloutReply, Counter, Histogram, Host};
use crate::request::fake::FakeRequest;
use crate::request::RequestView;
use crate::response::LocalReply;
use crate::webdis::Command;

pub fn test_breaker() -> Rc<Breakers> {
    Rc::new(Breakers::new(1000, Duration::from_millis(1000)))
}

/// The request part is the pure modules' [`FakeRequest`]; the rest is what
/// the filter asks of Envoy, recorded for the test to read.
#[derive(Default)]
pub struct FakeHost {
    pub request: FakeRequest,
    pub dispatched: Vec<String>,
    pub dispatch_fails: bool,
    pub sent: Vec<LocalReply>,
    pub resumed: usize,
    pub added: Vec<(String, String)>,
    pub counters: Vec<Counter>,
    pub clock_ms: u64,
    pub timeouts: Vec<Duration>,
    pub detached: Vec<String>,
    pub request_body: Vec<u8>,
    /// Response headers in order, repeated names and non-UTF-8 values
    /// included, as Envoy's header map holds them.
    pub response: Vec<(String, Vec<u8>)>,
    pub response_chunks: Vec<Vec<u8>>,
    /// Response trailers, once the response has them.
    pub response_trailers: Vec<(String, Vec<u8>)>,
    pub response_resumed: usize,
    pub tokens: u32,
    pub shared: HashMap<String, (Vec<u8>, u32)>,
    pub wakes: Vec<Duration>,
    pub can_schedule: bool,
    pub prefetched: Vec<(String, Prefetch)>,
    /// Object-store calls; tokens from OBJECT_TOKENS.
    pub objects: Vec<ObjectCall>,
    pub object_dispatch_fails: bool,
    /// Envoy refuses calls issued as the root context (a stream going away).
    pub detached_fails: bool,
    /// The root cannot take a background lease fetch (no tick).
    pub prefetch_fails: bool,
    /// This many compare-and-swap writes lose their race: another worker
    /// writes the key between this one's read and write.
    pub lose_races: usize,
    /// Members handed to the worker's batch, in order.
    pub batched: Vec<Member>,
    /// The batch refuses members at once with this failure.
    pub batch_fails: Option<Failure>,
    /// The worker has no call of the request's hash tag out: a batchable
    /// request sends its own call at once (tags recorded in `alone`).
    pub quiet_worker: bool,
    pub alone: Vec<String>,
    /// Tags whose lone call ended.
    pub released: Vec<String>,
    pub observed: Vec<(Histogram, u64)>,
    /// Calls handed to the worker (slot releases, settlements): (tag, KEYS,
    /// ARGV as text).
    pub slot_releases: Vec<(String, Vec<String>, Vec<String>)>,
    /// How long after its handing over each of those is due.
    pub release_delays: Vec<Duration>,
    /// `count_n` calls, in order.
    pub counted_n: Vec<(Counter, u64)>,
    /// The script of each of those (by SHA-1).
    pub deferred_scripts: Vec<String>,
    /// The worker takes no releases (the stream sends its own).
    pub no_worker: bool,
    /// Bodies the filter put in place of the response's.
    pub replaced_bodies: Vec<Vec<u8>>,
    /// Trailers the filter added to the response.
    pub added_trailers: Vec<(String, Vec<u8>)>,
    /// Filter state set, in order (name, value).
    pub filter_state: Vec<(String, Vec<u8>)>,
    /// The lease slots this worker watches ([`Host::lease_held`]).
    pub held: crate::filter::stage::lease::Held,
}

/// An object-store call's headers and body.
pub type ObjectCall = (Vec<(String, String)>, Option<Vec<u8>>);

pub const OBJECT_TOKENS: u32 = 10_000;

impl FakeHost {
    pub fn get(path: &str) -> FakeHost {
        FakeHost {
            request: FakeRequest::new("GET", path)
                .with(":authority", b"example.com")
                .addr("127.0.0.1:1234"),
            ..FakeHost::default()
        }
    }

    /// Sets a request header.
    pub fn with(mut self, name: &str, value: &[u8]) -> FakeHost {
        self.request
            .headers
            .insert(name.to_string(), value.to_vec());
        self
    }
}

impl RequestView for FakeHost {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.request.header(name)
    }
    fn client_address(&self) -> Option<String> {
        self.request.client_address()
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.request.property(path)
    }
}

/// A Webdis request as the tests read it: a POST's body, or a PUT's path
/// (without its leading `/`) then `<` and its body.
fn shown(command: &Command) -> String {
    match &command.put {
        None => String::from_utf8_lossy(&command.body).into_owned(),
        Some(path) => format!(
            "{}<{}",
            path.trim_start_matches('/'),
            String::from_utf8_lossy(&command.body)
        ),
    }
}

impl Host for FakeHost {
    fn dispatch_redis(
        &mut self,
        _: &RedisTarget,
        command: &Command,
        timeout: Duration,
    ) -> Result<u32, String> {
        self.timeouts.push(timeout);
        if self.dispatch_fails {
            return Err("no cluster".into());
        }
        self.dispatched.push(shown(command));
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
    fn send_reply(&mut self, reply: &LocalReply) {
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
    fn count_n(&mut self, counter: Counter, n: u64) {
        self.counted_n.push((counter, n));
    }
    fn now(&self) -> Duration {
        Duration::from_millis(self.clock_ms)
    }
    fn dispatch_redis_detached(
        &mut self,
        _: &RedisTarget,
        command: &Command,
        _: Duration,
    ) -> Result<u32, String> {
        if self.detached_fails {
            return Err("root context gone".into());
        }
        self.detached.push(shown(command));
        Ok(1000 + self.detached.len() as u32)
    }
    fn dispatch_prefetch(
        &mut self,
        _: &RedisTarget,
        command: &Command,
        _: Duration,
        note: Prefetch,
    ) -> Result<(), String> {
        if self.prefetch_fails {
            return Err("no tick".into());
        }
        self.prefetched.push((shown(command), note));
        Ok(())
    }
    fn request_body(&mut self, size: usize) -> Vec<u8> {
        self.request_body[..size.min(self.request_body.len())].to_vec()
    }
    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        self.response_header_values(name).into_iter().next()
    }
    fn response_header_values(&self, name: &str) -> Vec<Vec<u8>> {
        self.response
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
            .collect()
    }
    fn response_trailer(&self, name: &str) -> Option<Vec<u8>> {
        self.response_trailers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
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
    fn response_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.response.clone()
    }
    fn response_trailers(&self) -> Vec<(String, Vec<u8>)> {
        self.response_trailers.clone()
    }
    fn set_request_header(&mut self, name: &str, value: Option<&[u8]>) {
        match value {
            Some(v) => {
                self.request.headers.insert(name.to_string(), v.to_vec());
            }
            None => {
                self.request.headers.remove(name);
            }
        }
    }
    fn set_response_headers(&mut self, headers: &[(String, Vec<u8>)]) {
        self.response = headers.to_vec();
    }
    fn set_response_body(&mut self, _size: usize, body: &[u8]) {
        self.replaced_bodies.push(body.to_vec());
    }
    fn add_response_trailer(&mut self, name: &str, value: &[u8]) {
        self.added_trailers.push((name.to_string(), value.to_vec()));
    }
    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.shared.get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }
    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        if self.lose_races > 0 && cas.is_some() {
            // Another worker wrote in between: the key now exists (or
            // moved on), so this write's token no longer matches.
            self.lose_races -= 1;
            let entry = self
                .shared
                .entry(key.to_string())
                .or_insert((Vec::new(), 0));
            entry.1 += 1;
            return false;
        }
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
    fn wake_later(&mut self, delay: Duration) -> bool {
        self.wakes.push(delay);
        self.can_schedule
    }
    fn observe(&mut self, histogram: Histogram, value: u64) {
        self.observed.push((histogram, value));
    }
    fn set_filter_state(&mut self, name: &str, value: &[u8]) {
        self.filter_state.push((name.to_string(), value.to_vec()));
    }
    fn join_batch(&mut self, _: &RedisTarget, member: Member) -> Result<(), Failure> {
        if let Some(failure) = &self.batch_fails {
            return Err(failure.clone());
        }
        self.batched.push(member);
        Ok(())
    }
    fn batch_alone(&mut self, tag: &str) -> bool {
        if self.quiet_worker {
            self.alone.push(tag.to_string());
        }
        self.quiet_worker
    }
    fn batch_release(&mut self, tag: &str) {
        self.released.push(tag.to_string());
    }
    fn defer(
        &mut self,
        kind: crate::filter::deferred::Kind,
        tag: &str,
        (keys, argv): crate::ratelimit::ScriptArgs,
        after: Duration,
    ) -> Result<(), String> {
        if self.no_worker {
            return Err("no worker".into());
        }
        let text = |v: Vec<Vec<u8>>| {
            v.into_iter()
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .collect()
        };
        self.slot_releases
            .push((tag.to_string(), text(keys), text(argv)));
        self.release_delays.push(after);
        self.deferred_scripts.push(kind.script.sha1.clone());
        Ok(())
    }
    fn lease_held(&mut self, slot: &crate::lease::Slot, limit_key: &[u8], limit: usize) {
        self.held.add(slot, limit_key, limit);
    }
    fn unique_token(&mut self) -> String {
        self.tokens += 1;
        format!("owner-{}", self.tokens)
    }
}

pub fn ok(body: &[u8]) -> CalloutReply {
    CalloutReply {
        status: Some(200),
        from_webdis: true,
        body: body.to_vec(),
    }
}

/// A call that got no answer (timeout, reset, connection refused).
pub fn no_answer() -> CalloutReply {
    CalloutReply {
        status: None,
        from_webdis: false,
        body: vec![],
    }
}

impl FakeHost {
    pub fn keyed(method: &str, path: &str, key: Option<&[u8]>) -> FakeHost {
        let h = FakeHost::get(path).with(":method", method.as_bytes());
        match key {
            Some(key) => h.with("idempotency-key", key),
            None => h,
        }
    }

    pub fn post(path: &str, key: &[u8]) -> FakeHost {
        FakeHost::keyed("POST", path, Some(key))
    }

    pub fn respond(&mut self, headers: &[(&str, &str)]) {
        for (name, value) in headers {
            self.response
                .push(((*name).to_string(), value.as_bytes().to_vec()));
        }
    }
}

/// Webdis' own 503: the command never reached Redis (it may be retried).
pub fn refused() -> CalloutReply {
    CalloutReply {
        status: Some(503),
        from_webdis: true,
        body: vec![],
    }
}

/// Whether `headers` hold `name: value` (a local reply's, or those added to
/// a response).
pub fn has_header(headers: &[(String, String)], name: &str, value: &str) -> bool {
    headers.iter().any(|(n, v)| n == name && v == value)
}

/// A RESP array of bulk strings, as Webdis' `.raw` output carries it.
pub fn resp(items: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", items.len()).into_bytes();
    for item in items {
        out.extend_from_slice(format!("${}\r\n", item.len()).as_bytes());
        out.extend_from_slice(item);
        out.extend_from_slice(b"\r\n");
    }
    out
}

pub fn count(h: &FakeHost, c: Counter) -> usize {
    h.counters.iter().filter(|&&x| x == c).count()
}
