//! The callouts' replies (`on_http_call_response`), to both contexts: the
//! root's (a batch, a deferred call, a background lease fetch, or a call it
//! sent for a stream on its tick) and a stream's own; each reply goes to
//! the one that waits for it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Weak;
use std::time::Duration;

use proxy_wasm::traits::Context;

use crate::filter::stage::lease::on_prefetch_reply;

use super::http::Http;
use super::reply::callout_reply;
use super::root::Root;
use super::{host_now, Shared};

/// Removes a call's entry from one of the root's tables (none while the
/// table is being read elsewhere: the entry is then left to its sweep).
fn take<V>(table: &RefCell<HashMap<u32, V>>, token: u32) -> Option<V> {
    table.try_borrow_mut().ok()?.remove(&token)
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
