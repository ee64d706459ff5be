//! The host-facing layer. [`flow`] drives one request through the stages
//! ([`stage`]) over the small [`Host`] trait; every script call goes through
//! [`call`], every shared-data update through [`cas`]. [`proxy`] (wasm only)
//! implements the trait with proxy-wasm calls, so everything above it is
//! tested natively against the one fake host in [`testing`].

pub mod call;
pub mod cas;
pub mod clock;
pub mod counter;
pub mod deferred;
pub mod first_failure;
pub mod flow;
pub mod handoff;
pub mod in_flight;
pub mod owner;
#[cfg(target_arch = "wasm32")]
pub mod proxy;
pub mod retry;
pub mod stage;
#[cfg(test)]
pub mod testing;
#[cfg(test)]
mod tests;
pub mod timers;

use std::time::Duration;

use crate::config::{ObjectStore, RedisTarget};
use crate::request::RequestView;
use crate::response::LocalReply;
use crate::webdis::Command;

pub use counter::{Counter, ErrorKind, Histogram};

/// What the host should do after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

/// The answer of a callout, as the host saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalloutReply {
    /// The HTTP status of the answer; `None` when the call failed (timeout,
    /// connection refused, reset).
    pub status: Option<u32>,
    /// The answer came from Webdis itself (its `server` header), not from
    /// Envoy on its behalf.
    pub from_webdis: bool,
    pub body: Vec<u8>,
}

impl CalloutReply {
    /// A call that got no answer (timeout, reset, connection refused).
    pub fn none() -> CalloutReply {
        CalloutReply {
            status: None,
            from_webdis: false,
            body: Vec::new(),
        }
    }
}

/// Whole milliseconds of a host time (the shared-data records' unit).
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// What the filter needs from the proxy for one request.
pub trait Host: RequestView {
    /// Sends one Webdis request to the Redis cluster with this timeout;
    /// returns the callout token.
    fn dispatch_redis(
        &mut self,
        target: &RedisTarget,
        command: &Command,
        timeout: Duration,
    ) -> Result<u32, String>;
    /// A monotonic-enough clock for the request's Redis deadline.
    fn now(&self) -> Duration;
    /// Like `dispatch_redis`, for a call that must outlive this stream (the
    /// reply is not delivered).
    fn dispatch_redis_detached(
        &mut self,
        target: &RedisTarget,
        command: &Command,
        timeout: Duration,
    ) -> Result<u32, String>;
    /// The buffered request body (`size` bytes).
    fn request_body(&mut self, size: usize) -> Vec<u8>;
    fn response_header(&self, name: &str) -> Option<Vec<u8>>;
    /// Every value of a response header, in order (repeated headers).
    fn response_header_values(&self, name: &str) -> Vec<Vec<u8>>;
    /// A response trailer (read in `on_response_trailers`).
    fn response_trailer(&self, name: &str) -> Option<Vec<u8>>;
    /// The current response body chunk (`size` bytes).
    fn response_body(&mut self, size: usize) -> Vec<u8>;
    /// Every response header (pseudo-headers included), in order.
    fn response_headers(&self) -> Vec<(String, Vec<u8>)>;
    /// Every response trailer (read in `on_response_trailers`).
    fn response_trailers(&self) -> Vec<(String, Vec<u8>)>;
    /// Replaces (`Some`) or removes a request header before it goes
    /// upstream (Envoy then routes the request again).
    fn set_request_header(&mut self, name: &str, value: Option<&[u8]>);
    /// Replaces all the response's headers.
    fn set_response_headers(&mut self, headers: &[(String, Vec<u8>)]);
    /// Replaces the buffered response body (`size` bytes) with `body`.
    fn set_response_body(&mut self, size: usize, body: &[u8]);
    /// Adds a trailer to the response (at its last body piece, Envoy
    /// creates the trailers).
    fn add_response_trailer(&mut self, name: &str, value: &[u8]);
    fn resume_response(&mut self);
    /// Sends a background lease fetch for this Envoy, soon, from the root
    /// context (so it outlives the stream); the host hands its reply (or its
    /// failure) to [`stage::lease::on_prefetch_reply`] with `note`.
    fn dispatch_prefetch(
        &mut self,
        target: &RedisTarget,
        command: &Command,
        timeout: Duration,
        note: handoff::Prefetch,
    ) -> Result<(), String>;
    /// Sends one request to the object store's cluster (`headers` include
    /// the pseudo-headers); the reply comes to `Flow::on_callout_reply` like
    /// a Redis call's. Its body is read only up to `Flow::reply_limit`.
    fn dispatch_object(
        &mut self,
        store: &ObjectStore,
        headers: &[(String, String)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, String>;
    /// Calls `Flow::on_wake` after `delay` (a retry pause, a lease renewal);
    /// false if the host cannot.
    fn wake_later(&mut self, delay: Duration) -> bool;
    /// A token no other request of any Envoy will produce (lock owner).
    fn unique_token(&mut self) -> String;
    /// Shared data of this Envoy (all workers): value and its CAS token.
    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes if the CAS token still matches the key's (`None`: always; a
    /// missing key is written whatever the token, as Envoy does); false on a
    /// lost race.
    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> bool;
    /// Sends `reply` as it is (`grpc_status`: as Envoy's trailers-only
    /// answer to a gRPC request).
    fn send_reply(&mut self, reply: &LocalReply);
    /// Answers the request from the filter: a gRPC request gets the reply
    /// as its client reads it ([`crate::response::grpc_reply`]).
    fn send_local(&mut self, reply: &LocalReply) {
        let grpc = self
            .header("content-type")
            .is_some_and(|ct| crate::grpc::is_grpc(&ct));
        if grpc {
            self.send_reply(&crate::response::grpc_reply(reply));
        } else {
            self.send_reply(reply);
        }
    }
    fn resume_request(&mut self);
    fn add_response_header(&mut self, name: &str, value: &str);
    fn count(&mut self, counter: Counter);
    /// Counts `n` at once (units, not events).
    fn count_n(&mut self, counter: Counter, n: u64);
    fn observe(&mut self, histogram: Histogram, value: u64);
    /// Sets this request's filter state `wasm.<name>` (Envoy prefixes it),
    /// which an access log prints with `%FILTER_STATE(wasm.<name>:PLAIN)%`.
    fn set_filter_state(&mut self, name: &str, value: &[u8]);
    /// Adds this request's decision to its worker's next batch call (see
    /// [`stage::batch`]); its verdict comes to `Flow::on_batch_verdict`.
    /// `Err`: it failed at once (its call could not be sent).
    fn join_batch(
        &mut self,
        target: &RedisTarget,
        member: handoff::Member,
    ) -> Result<(), call::Failure>;
    /// True if a request of hash tag `tag` may send its own call now: its
    /// worker has no call of that tag out and none queued. Its call then
    /// holds the group's place until [`Host::batch_release`], so requests
    /// arriving meanwhile queue behind it.
    fn batch_alone(&mut self, tag: &str) -> bool;
    /// Hands a call to the stream's worker, whose root sends it (with the
    /// others of its script and hash tag) on its first tick `after` from now
    /// ([`deferred::Deferred`]). `Err`: no worker took it.
    fn defer(
        &mut self,
        kind: deferred::Kind,
        tag: &str,
        args: crate::ratelimit::ScriptArgs,
        after: Duration,
    ) -> Result<(), String>;
    /// This worker received a grant for `limit_key` (limit `limit`): its
    /// root watches the slot and gives back the unspent tokens
    /// ([`stage::lease::give_back`]).
    fn lease_held(&mut self, slot: &crate::lease::Slot, limit_key: &[u8], limit: usize);
    /// The call [`Host::batch_alone`] allowed is over (answered, failed, or
    /// its stream gone): requests that queued behind it may leave.
    fn batch_release(&mut self, tag: &str);
}
