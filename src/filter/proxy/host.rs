//! The [`Host`] over proxy-wasm calls, for the current stream.

use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType};

use crate::config::{ObjectStore, RedisTarget};
use crate::filter::call::Failure;
use crate::filter::clock::CallbackClock;
use crate::filter::handoff::{Member, Prefetch};
use crate::filter::{Counter, ErrorKind, Histogram, Host};
use crate::request::RequestView;
use crate::response::LocalReply;
use crate::webdis::Command;

use super::abi;
use super::metrics::UNDEFINED;
use super::{host_now, FlowRef, Shared, Stream};

pub(super) struct ProxyHost<'a> {
    pub shared: Option<&'a Shared>,
    pub context_id: u32,
    /// This stream's flow, for callbacks the root delivers later.
    pub me: FlowRef,
    /// Calls are being sent from the root's tick: route their replies.
    pub via_root: bool,
    /// The clock, read once per callback (see [`CallbackClock`]).
    pub clock: CallbackClock,
    /// The stream ended (`Flow::ended`): Envoy may still hand its context a
    /// reply until it deletes it, but the stream itself is gone, so nothing
    /// resumes it, answers it or edits its headers or body any more.
    pub ended: bool,
}

pub(super) fn callout_headers<'a>(
    target: &'a RedisTarget,
    command: &'a Command,
) -> Vec<(&'a str, &'a str)> {
    let (method, path) = command.method_path();
    let mut headers = vec![
        (":method", method),
        (":path", path),
        (":authority", target.authority.as_str()),
        ("content-type", "text/plain"),
    ];
    if let Some(auth) = &target.auth {
        headers.push(("authorization", auth.0.as_str()));
    }
    headers
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

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }
}

impl ProxyHost<'_> {
    /// Makes the worker's root tick (see `Shared::tick`).
    fn tick_root(&self, shared: &Shared) -> Result<(), String> {
        shared.tick(self.context_id)
    }

    /// This callback's time: the host's clock, read at its first use.
    pub(super) fn clock(&self) -> Duration {
        self.clock.now(host_now)
    }

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
        self.clock()
    }

    fn dispatch_redis(
        &mut self,
        target: &RedisTarget,
        command: &Command,
        timeout: Duration,
    ) -> Result<u32, String> {
        // The scripts whose replies decide requests carry a nonce their
        // reply gives back (the book, Running it: When things fail: Webdis may write
        // another connection's late reply to this one).
        let (with, nonce) = self.shared.map_or((None, None), |s| s.with_nonce(command));
        let command = with.as_ref().unwrap_or(command);
        let token = hostcalls::dispatch_http_call(
            &target.cluster,
            callout_headers(target, command),
            Some(&command.body),
            vec![],
            timeout,
        )
        .map_err(|e| format!("dispatch to cluster `{}` refused: {e:?}", target.cluster))?;
        if let Some(shared) = self.shared {
            let now = self.clock.renew(host_now);
            shared.note_sent(token, now, timeout, nonce);
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
        command: &Command,
        timeout: Duration,
    ) -> Result<u32, String> {
        // A stream that is going away must not own the call: issue it as the
        // root context. Its reply finds no stream and is dropped, which is
        // fine: the release is owner-checked and the lock expires regardless.
        let Some(root) = self.shared.map(|s| s.root_id) else {
            return Err("not configured".to_string());
        };
        hostcalls::set_effective_context(root).map_err(|e| format!("{e:?}"))?;
        let sent = self.dispatch_redis(target, command, timeout);
        let _ = hostcalls::set_effective_context(self.context_id);
        sent
    }

    fn dispatch_prefetch(
        &mut self,
        _target: &RedisTarget,
        command: &Command,
        timeout: Duration,
        note: Prefetch,
    ) -> Result<(), String> {
        let Some(shared) = self.shared else {
            return Err("not configured".to_string());
        };
        // The root sends it on its next tick; queued only once a tick is
        // sure to come.
        self.tick_root(shared)?;
        shared
            .to_prefetch
            .try_borrow_mut()
            .map_err(|_| "prefetch queue busy".to_string())?
            .push((command.clone(), timeout, note));
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

    fn response_trailer(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpResponseTrailers, name)
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
        if self.ended {
            return;
        }
        if let Err(e) = hostcalls::resume_http_response() {
            log::warn!("redis-guard: cannot resume response: {e:?}");
        }
    }

    fn wake_later(&mut self, delay: Duration) -> bool {
        let Some(shared) = self.shared else {
            return false;
        };
        let Ok(mut waiting) = shared.waiting.try_borrow_mut() else {
            return false;
        };
        waiting.push(self.now() + delay, self.context_id);
        drop(waiting);
        if let Ok(mut flows) = shared.wakeable.try_borrow_mut() {
            flows.insert(self.context_id, self.me.clone());
        }
        self.tick_root(shared).is_ok()
    }

    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        hostcalls::set_shared_data(key, Some(value), cas).is_ok()
    }

    fn observe(&mut self, histogram: Histogram, value: u64) {
        if let Some(id) = self.shared.and_then(|s| s.metrics.histogram(histogram)) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    fn set_filter_state(&mut self, name: &str, value: &[u8]) {
        if let Err(e) = hostcalls::set_property(vec![name], Some(value)) {
            log::debug!("redis-guard: cannot set filter state {name}: {e:?}");
        }
    }

    fn join_batch(&mut self, _target: &RedisTarget, member: Member) -> Result<(), Failure> {
        let refused = |why: &str| (ErrorKind::Dispatch, why.to_string());
        let Some(shared) = self.shared else {
            return Err(refused("not configured"));
        };
        let (Some(queue), Ok(mut batcher)) = (shared.batch_queue, shared.batcher.try_borrow_mut())
        else {
            return Err(refused("batching unavailable"));
        };
        let Some(batcher) = batcher.as_mut() else {
            return Err(refused("batching is off"));
        };
        let me = Stream {
            context_id: self.context_id,
            flow: self.me.clone(),
        };
        if batcher.join(me, member) {
            wake(shared, queue, self.context_id);
        }
        Ok(())
    }

    fn batch_alone(&mut self, tag: &str) -> bool {
        let Some(shared) = self.shared else {
            return false;
        };
        let Ok(mut batcher) = shared.batcher.try_borrow_mut() else {
            return false;
        };
        match batcher.as_mut() {
            // Batching is on but this worker could not register its wake-up
            // queue: every request sends its own call.
            None => true,
            // A wake-up already queued means requests wait for the root's
            // flush: this one joins them rather than pass them.
            Some(b) => !shared.wake_pending.get() && b.try_alone(tag),
        }
    }

    fn batch_release(&mut self, tag: &str) {
        let Some(shared) = self.shared else {
            return;
        };
        let (Some(queue), Ok(mut batcher)) = (shared.batch_queue, shared.batcher.try_borrow_mut())
        else {
            log::warn!("redis-guard: cannot free the batch group of a lone call");
            return;
        };
        if batcher.as_mut().is_some_and(|b| b.release(tag)) {
            drop(batcher);
            wake(shared, queue, self.context_id);
        }
    }

    fn defer(
        &mut self,
        kind: crate::filter::deferred::Kind,
        tag: &str,
        args: crate::ratelimit::ScriptArgs,
        after: Duration,
    ) -> Result<(), String> {
        let Some(shared) = self.shared else {
            return Err("not configured".to_string());
        };
        // The root sends it on a tick; queued only once a tick is sure to
        // come.
        self.tick_root(shared)?;
        shared
            .deferred
            .try_borrow_mut()
            .map_err(|_| "deferred-call queue busy".to_string())?
            .add(kind, tag, args, self.clock() + after);
        Ok(())
    }

    fn lease_held(&mut self, slot: &crate::lease::Slot, limit_key: &[u8], limit: usize) {
        let Some(shared) = self.shared else {
            return;
        };
        // Watched on the root's tick: only once a tick is sure to come.
        if let Err(e) = shared.tick_slow(self.context_id) {
            log::warn!("redis-guard: no tick; leased tokens are not given back: {e}");
            return;
        }
        if let Ok(mut held) = shared.leases.try_borrow_mut() {
            held.add(slot, limit_key, limit);
        }
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

    fn send_reply(&mut self, reply: &LocalReply) {
        if self.ended {
            return;
        }
        let headers: Vec<(&str, &[u8])> = reply
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes()))
            .collect();
        let grpc = reply
            .grpc_status
            .and_then(|s| i32::try_from(s).ok())
            .unwrap_or(-1);
        if let Err(e) =
            abi::send_local_response(reply.status, reply.details, &headers, &reply.body, grpc)
        {
            log::warn!("redis-guard: cannot send local reply: {e:?}");
        }
    }

    fn response_headers(&self) -> Vec<(String, Vec<u8>)> {
        hostcalls::get_map_bytes(MapType::HttpResponseHeaders).unwrap_or_default()
    }

    fn response_trailers(&self) -> Vec<(String, Vec<u8>)> {
        hostcalls::get_map_bytes(MapType::HttpResponseTrailers).unwrap_or_default()
    }

    fn set_request_header(&mut self, name: &str, value: Option<&[u8]>) {
        if self.ended {
            return;
        }
        if let Err(e) = abi::set_value(MapType::HttpRequestHeaders, name, value) {
            log::warn!("redis-guard: cannot set request header {name}: {e:?}");
        }
    }

    fn set_response_headers(&mut self, headers: &[(String, Vec<u8>)]) {
        if self.ended {
            return;
        }
        let pairs: Vec<(&str, &[u8])> = headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()))
            .collect();
        if let Err(e) = abi::set_map(MapType::HttpResponseHeaders, &pairs) {
            log::warn!("redis-guard: cannot set the response headers: {e:?}");
        }
    }

    fn set_response_body(&mut self, size: usize, body: &[u8]) {
        if self.ended {
            return;
        }
        if let Err(e) = abi::set_buffer(BufferType::HttpResponseBody, size, body) {
            log::warn!("redis-guard: cannot set the response body: {e:?}");
        }
    }

    fn add_response_trailer(&mut self, name: &str, value: &[u8]) {
        if self.ended {
            return;
        }
        if let Err(e) = abi::add_value(MapType::HttpResponseTrailers, name, value) {
            log::warn!("redis-guard: cannot add response trailer {name}: {e:?}");
        }
    }

    fn resume_request(&mut self) {
        if self.ended {
            return;
        }
        if let Err(e) = hostcalls::resume_http_request() {
            log::warn!("redis-guard: cannot resume request: {e:?}");
        }
    }

    fn add_response_header(&mut self, name: &str, value: &str) {
        if self.ended {
            return;
        }
        if let Err(e) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value) {
            log::warn!("redis-guard: cannot add response header {name}: {e:?}");
        }
    }

    fn count(&mut self, counter: Counter) {
        let Some(shared) = self.shared else {
            return;
        };
        for &(id, by) in shared.metrics.updates(counter) {
            if id != UNDEFINED {
                let _ = hostcalls::increment_metric(id, by);
            }
        }
    }

    fn count_n(&mut self, counter: Counter, n: u64) {
        let Some(shared) = self.shared else {
            return;
        };
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        for &(id, by) in shared.metrics.updates(counter) {
            if id != UNDEFINED {
                let _ = hostcalls::increment_metric(id, by.saturating_mul(n));
            }
        }
    }
}

/// Wakes the worker's root to send what queued. The root sends every batch:
/// a reply goes to the context that was running when its call left, and only
/// the root outlives every member. One wake-up per flush: the root drains
/// what queued by then.
fn wake(shared: &Shared, queue: u32, me: u32) {
    if shared.wake_pending.replace(true) {
        return;
    }
    if let Err(e) = hostcalls::enqueue_shared_queue(queue, Some(b"w")) {
        // The root's tick flushes instead, a millisecond later.
        shared.wake_pending.set(false);
        log::warn!("redis-guard: cannot wake the worker for a batch: {e:?}");
        let _ = shared.tick(me);
    }
}
