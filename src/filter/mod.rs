//! The host-facing layer. [`flow`] drives one request through the rate-limit
//! decision over the small [`Host`] trait; [`proxy`] (wasm only) implements
//! that trait with proxy-wasm calls, so everything above it is tested natively.

pub mod flow;
#[cfg(target_arch = "wasm32")]
pub mod proxy;

use std::time::Duration;

use crate::config::{ObjectStore, RedisTarget};
use crate::request::RequestView;
use crate::response::LocalReply;

/// Counters the filter reports; the host maps them to Envoy stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Counter {
    /// Requests a limit applied to (index into `Config::limits`).
    Checked(usize),
    Allowed(usize),
    Rejected(usize),
    /// A shadow limit that would have rejected.
    ShadowRejected(usize),
    RedisCalls,
    /// EVALSHA found no script and the filter fell back to EVAL.
    ScriptReloads,
    /// A call repeated after Webdis answered 503 (command not executed).
    RedisRetries,
    /// A Redis decision that failed, by why (the total is their sum).
    RedisError(ErrorKind),
    FailureAllowed,
    FailureDenied,
    /// Idempotency: lock taken and request forwarded.
    IdemAcquired,
    /// Answered from a COMPLETED record.
    IdemReplayed,
    /// 409: another request holds the key.
    IdemConflicts,
    /// 422: the key was used with another request.
    IdemMismatches,
    /// Lock released so a retry runs again (failure, non-storable, too large).
    IdemReleased,
    /// COMPLETED record written.
    IdemStored,
    /// The COMPLETED record could not be written (lock lost, Redis failed).
    IdemStoreFailed,
    /// Response over maxStoredBodyBytes: not stored, lock released.
    IdemTooLarge,
    /// Forwarded without the guarantee because Redis failed (failure mode allow).
    IdemUnguarded,
    /// Redis failed and the request was decided by the local budget.
    FailureLocal,
    LocalAllowed,
    LocalRejected,
    /// The circuit breaker opened after consecutive failures (or a failed probe).
    CircuitOpened,
    /// This worker's breaker went from closed to open (the open gauge rises).
    CircuitTripped,
    /// A probe succeeded and closed this worker's breaker (the gauge falls).
    CircuitClosed,
    /// A request sent to its failure mode by the open breaker, without a call.
    CircuitShortCircuited,
    /// 429 answered from the over-limit cache, without a call.
    OverLimitCached,
    /// A request admitted by spending leased tokens, without a call.
    LeaseSpent,
    /// A call that fetched a token lease.
    LeaseFetched,
    /// A response body uploaded to the object store and its record stored.
    IdemOffloaded,
    /// The upload failed (refused, unreachable, timed out): the lock was
    /// released like a failed request's.
    IdemOffloadFailed,
    /// A replay served from the object store (checksum verified).
    IdemObjectFetched,
    /// A replay whose object is gone from the store: 502, never re-executed.
    IdemObjectMissing,
    /// A replay whose object does not match the record's checksum: 502.
    IdemObjectCorrupt,
    /// A replay whose object could not be fetched (refused, unreachable,
    /// timed out): 503 with Retry-After, never re-executed.
    IdemObjectFetchFailed,
}

/// Why a Redis call did not decide a request: one stat each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// No reply within the deadline, or the connection was reset.
    Timeout,
    /// The host refused to send the call (unknown cluster, no capacity).
    Dispatch,
    /// Webdis or Envoy answered with an HTTP error status.
    Http,
    /// Redis answered with an error (OOM, CROSSSLOT, script error).
    Redis,
    /// A reply the filter cannot read (gateway or script mismatch, corrupt record).
    Reply,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 5] = [
        ErrorKind::Timeout,
        ErrorKind::Dispatch,
        ErrorKind::Http,
        ErrorKind::Redis,
        ErrorKind::Reply,
    ];

    /// The stat name's last segment.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Timeout => "timeout",
            ErrorKind::Dispatch => "dispatch",
            ErrorKind::Http => "http",
            ErrorKind::Redis => "redis",
            ErrorKind::Reply => "reply",
        }
    }
}

/// What the filter needs from the proxy for one request.
pub trait Host: RequestView {
    /// Sends one Webdis command body to the Redis cluster with this timeout;
    /// returns the callout token.
    fn dispatch_redis(
        &mut self,
        target: &RedisTarget,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, String>;
    /// A monotonic-enough clock for the request's Redis deadline.
    fn now(&self) -> Duration;
    /// Like `dispatch_redis`, for a call that must outlive this stream (the
    /// reply is not delivered).
    fn dispatch_redis_detached(
        &mut self,
        target: &RedisTarget,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, String>;
    /// The buffered request body (`size` bytes).
    fn request_body(&mut self, size: usize) -> Vec<u8>;
    fn response_header(&self, name: &str) -> Option<Vec<u8>>;
    /// Every value of a response header, in order (repeated headers).
    fn response_header_values(&self, name: &str) -> Vec<Vec<u8>>;
    /// The current response body chunk (`size` bytes).
    fn response_body(&mut self, size: usize) -> Vec<u8>;
    fn resume_response(&mut self);
    /// Sends a background lease fetch for this Envoy, soon, from the root
    /// context (so it outlives the stream); the host hands its reply (or its
    /// failure) to [`flow::on_prefetch_reply`] with `note`.
    fn dispatch_prefetch(
        &mut self,
        target: &RedisTarget,
        body: &[u8],
        timeout: Duration,
        note: flow::Prefetch,
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
    /// Calls `Flow::on_retry_due` after `delay`; false if the host cannot.
    fn retry_later(&mut self, delay: Duration) -> bool;
    /// A token no other request of any Envoy will produce (lock owner).
    fn unique_token(&mut self) -> String;
    /// Shared data of this Envoy (all workers): value and its CAS token.
    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes if the CAS token still matches the key's (`None`: always; a
    /// missing key is written whatever the token, as Envoy does); false on a
    /// lost race.
    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> bool;
    fn send_local(&mut self, reply: &LocalReply);
    fn resume_request(&mut self);
    fn add_response_header(&mut self, name: &str, value: &str);
    fn count(&mut self, counter: Counter);
}
