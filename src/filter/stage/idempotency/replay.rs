//! Idempotency answers other than "go ahead": the key is busy (409), used
//! with another request (422), or completed, whose stored response is
//! replayed, from Redis or, for a large body, from the object store. A
//! completed key is never run again: whatever fails here is answered.

use crate::config::Config;
use crate::filter::flow::{Calls, Owner};
use crate::filter::{CalloutReply, Counter, ErrorKind, Host};
use crate::idempotency::decode_headers;
use crate::offload::{self, check_fetch, Fetched, ObjectRef};
use crate::response::{
    idempotency_conflict, idempotency_mismatch, stored_response_corrupt, stored_response_missing,
    stored_response_unavailable, unavailable, LocalReply,
};

/// A replay waiting for its body from the object store.
#[derive(Debug, Clone)]
struct Fetch {
    status: u32,
    headers: Vec<(String, String)>,
    object: ObjectRef,
}

#[derive(Debug, Default)]
pub struct Replay {
    fetch: Option<Fetch>,
}

impl Replay {
    /// 409: another request holds the key.
    pub fn busy<H: Host>(&self, host: &mut H) {
        host.count(Counter::IdemConflicts);
        host.send_local(&idempotency_conflict());
    }

    /// 422: the key was used with another request.
    pub fn mismatch<H: Host>(&self, host: &mut H) {
        host.count(Counter::IdemMismatches);
        host.send_local(&idempotency_mismatch());
    }

    /// A record that says the key completed, but cannot be read: answering
    /// from the failure mode could forward it, and a completed key is never
    /// run again.
    pub fn unreadable<H: Host>(&self, host: &mut H, why: &str) {
        log::warn!("redis-guard: unreadable idempotency record: {why}");
        host.count(Counter::RedisError(ErrorKind::Reply));
        host.send_local(&unavailable("stored idempotent response is unreadable"));
    }

    /// Answers with the stored response (fetching its body first when it
    /// lives in the object store).
    pub fn replay<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
        (status, headers, body, object): (u32, Vec<u8>, Vec<u8>, Option<ObjectRef>),
    ) {
        let stored = match decode_headers(&headers) {
            Ok(stored) => stored,
            // Never re-execute a completed key: a record we cannot read is
            // an error, not a miss.
            Err(e) => return self.unreadable(host, &e),
        };
        let mut headers: Vec<(String, String)> = stored
            .into_iter()
            .map(|(n, v)| (n, String::from_utf8_lossy(&v).into_owned()))
            .collect();
        headers.push(("idempotent-replayed".to_string(), "true".to_string()));
        let Some(object) = object else {
            host.count(Counter::IdemReplayed);
            host.send_local(&LocalReply {
                status,
                headers,
                body,
            });
            return;
        };
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
                calls.expect(token, Owner::Replay);
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

    /// How much of the fetch's answer to read: exactly the stored length (a
    /// longer answer is not the object, and is not copied).
    pub fn reply_limit(&self) -> usize {
        self.fetch.as_ref().map_or(0, |f| f.object.len)
    }

    pub fn on_reply<H: Host>(&mut self, host: &mut H, reply: CalloutReply) {
        let Some(fetch) = self.fetch.take() else {
            return;
        };
        let (what, counter, reply) = match check_fetch(reply.status, reply.body, &fetch.object) {
            Fetched::Body(body) => {
                host.count(Counter::IdemReplayed);
                host.count(Counter::IdemObjectFetched);
                host.send_local(&LocalReply {
                    status: fetch.status,
                    headers: fetch.headers,
                    body,
                });
                return;
            }
            Fetched::Missing => (
                "is missing".to_string(),
                Counter::IdemObjectMissing,
                stored_response_missing(),
            ),
            Fetched::Corrupt(why) => (
                format!("is corrupt: {why}"),
                Counter::IdemObjectCorrupt,
                stored_response_corrupt(),
            ),
            Fetched::Failed(why) => (
                format!("cannot be fetched: {why}"),
                Counter::IdemObjectFetchFailed,
                stored_response_unavailable(),
            ),
        };
        log::warn!(
            "redis-guard: stored response object `{}` {what}",
            fetch.object.key
        );
        host.count(counter);
        host.send_local(&reply);
    }
}
