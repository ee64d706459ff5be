//! Idempotency answers other than "go ahead": the key is busy (409), used
//! with another request (422), or completed, whose stored response is
//! replayed, from Redis or, for a large body, from the object store. A
//! completed key is never run again: whatever fails here is answered.

use crate::config::Config;
use crate::filter::owner::{Calls, Owner};
use crate::filter::Action;
use crate::filter::{CalloutReply, Counter, ErrorKind, Host};
use crate::idempotency::{decode_response_fields, ResponseFields};
use crate::offload::{self, check_fetch, Fetched, ObjectRef};
use crate::response::{
    idempotency_conflict, idempotency_mismatch, stored_response_corrupt, stored_response_missing,
    stored_response_unavailable, unavailable, LocalReply,
};

/// Where a gRPC replay goes: a route to a cluster that answers any request
/// with a non-empty body and the [`REPLAY_MARK`] header (envoy/envoy.yaml,
/// docs/src/using/grpc.md). A gRPC client needs its messages and then trailers, and
/// Envoy answers a gRPC request from a filter with trailers only; so the
/// replay is sent there, and its answer is rewritten into the stored one.
/// Should the route be missing, the request reaches the upstream on a path
/// no service has, and is answered UNAVAILABLE: it is never run again.
pub const REPLAY_PATH: &str = "/redis-guard/replay";
/// The header the replay route's answers carry.
pub const REPLAY_MARK: &str = "x-redis-guard-replay";
/// Where Envoy keeps a rewritten request's path.
const ORIGINAL_PATH: &str = "x-envoy-original-path";

/// A replay waiting for its body from the object store.
#[derive(Debug, Clone)]
struct Fetch {
    status: u32,
    fields: ResponseFields,
    object: ObjectRef,
}

/// A gRPC replay sent to the replay route: what its answer becomes.
#[derive(Debug, Clone)]
struct Routed {
    status: u32,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    trailers: Vec<(String, Vec<u8>)>,
}

#[derive(Debug, Default)]
pub struct Replay {
    fetch: Option<Fetch>,
    routed: Option<Routed>,
    /// What the client got, for the access log: known only once the body
    /// is fetched or the replay route has answered, not when Redis says
    /// "completed".
    outcome: Option<&'static str>,
}

impl Replay {
    /// The access-log verdict of a replay this stage answered, if any.
    pub fn verdict(&self) -> Option<&'static str> {
        self.outcome
    }

    /// Answers a replay that cannot be served.
    fn fail<H: Host>(&mut self, host: &mut H, reply: &LocalReply) {
        self.outcome = Some("replay_failed");
        host.send_local(reply);
    }

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
    pub fn unreadable<H: Host>(&mut self, host: &mut H, why: &str) {
        log::warn!("redis-guard: unreadable idempotency record: {why}");
        host.count(Counter::RedisError(ErrorKind::Reply));
        self.fail(
            host,
            &unavailable("stored idempotent response is unreadable")
                .with_details("redis_guard_stored_response_unreadable"),
        );
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
        let fields = match decode_response_fields(&headers) {
            Ok(fields) => fields,
            // Never re-execute a completed key: a record we cannot read is
            // an error, not a miss.
            Err(e) => return self.unreadable(host, &e),
        };
        let Some(object) = object else {
            return self.answer(host, status, fields, body);
        };
        // The record says the request ran: whatever happens here, it is
        // answered, never forwarded.
        let Some(store) = &config.object_store else {
            log::warn!("redis-guard: record points into an object store, but none is configured");
            host.count(Counter::IdemObjectFetchFailed);
            return self.fail(host, &stored_response_unavailable());
        };
        let request = offload::get_headers(store, &object, host.now());
        match host.dispatch_object(store, &request, None, store.timeout) {
            Ok(token) => {
                calls.expect(token, Owner::Replay);
                self.fetch = Some(Fetch {
                    status,
                    fields,
                    object,
                });
            }
            Err(e) => {
                log::warn!("redis-guard: cannot fetch a stored response: {e}");
                host.count(Counter::IdemObjectFetchFailed);
                self.fail(host, &stored_response_unavailable());
            }
        }
    }

    /// A replay waits for its body from the object store: the request is
    /// answered when it comes, and must not go on meanwhile.
    pub fn fetching(&self) -> bool {
        self.fetch.is_some()
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
                host.count(Counter::IdemObjectFetched);
                return self.answer(host, fetch.status, fetch.fields, body);
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
        self.fail(host, &reply);
    }

    /// Answers with the stored response: a local reply, or for a gRPC
    /// call whose answer had messages or trailers, through the replay route.
    fn answer<H: Host>(
        &mut self,
        host: &mut H,
        status: u32,
        fields: ResponseFields,
        body: Vec<u8>,
    ) {
        let (headers, trailers) = fields;
        let grpc = host
            .header("content-type")
            .is_some_and(|ct| crate::grpc::is_grpc(&ct));
        let trailers_only = headers.iter().any(|(n, _)| n == "grpc-status");
        if grpc && !(trailers_only && trailers.is_empty() && body.is_empty()) {
            // Envoy's convention for a rewritten path, so the access log
            // (`%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%`) shows the method called.
            if host.header(ORIGINAL_PATH).is_none() {
                let path = host.header(":path").unwrap_or_default();
                host.set_request_header(ORIGINAL_PATH, Some(&path));
            }
            host.set_request_header(":path", Some(REPLAY_PATH.as_bytes()));
            host.set_request_header("content-type", Some(b"application/octet-stream"));
            self.routed = Some(Routed {
                status,
                headers,
                body,
                trailers,
            });
            host.resume_request();
            return;
        }
        host.count(Counter::IdemReplayed);
        self.outcome = Some("replayed");
        let text = |v: Vec<u8>| String::from_utf8_lossy(&v).into_owned();
        if grpc {
            // Stored trailers-only (an error status with no message): Envoy
            // writes it again from the status and message.
            let code = headers
                .iter()
                .find(|(n, _)| n == "grpc-status")
                .and_then(|(_, v)| crate::grpc::parse_status(v));
            let message = headers
                .iter()
                .find(|(n, _)| n == "grpc-message")
                .map(|(_, v)| crate::grpc::decode_message(v))
                .unwrap_or_default();
            let mut rest: Vec<(String, String)> = headers
                .into_iter()
                .filter(|(n, _)| {
                    !matches!(n.as_str(), "grpc-status" | "grpc-message" | "content-type")
                })
                .map(|(n, v)| (n, text(v)))
                .collect();
            rest.push(("idempotent-replayed".to_string(), "true".to_string()));
            host.send_reply(&LocalReply {
                status,
                headers: rest,
                body: message.into_bytes(),
                grpc_status: code,
                retry_ms: None,
                details: REPLAYED,
            });
            return;
        }
        let mut headers: Vec<(String, String)> =
            headers.into_iter().map(|(n, v)| (n, text(v))).collect();
        headers.push(("idempotent-replayed".to_string(), "true".to_string()));
        host.send_local(&LocalReply {
            status,
            headers,
            body,
            details: REPLAYED,
            ..LocalReply::default()
        });
    }

    /// The replay route's answer: its headers become the stored ones.
    /// `None` for any other response (not this stage's).
    pub fn on_response_headers<H: Host>(
        &mut self,
        host: &mut H,
        end_of_stream: bool,
    ) -> Option<Action> {
        let routed = self.routed.as_ref()?;
        let marked = host.response_header(REPLAY_MARK).is_some();
        if !marked || end_of_stream {
            // Not the replay route's answer: the route is missing (the
            // request went to the upstream on a path it has no method for),
            // or it answered without a body to put the stored one in.
            log::warn!(
                "redis-guard: gRPC replay needs the replay route ({REPLAY_PATH} with a body and {REPLAY_MARK}); see docs/src/using/grpc.md#grpc-services"
            );
            self.routed = None;
            self.outcome = Some("replay_failed");
            // As gRPC, whatever the content-type says now (this stage
            // rewrote it; Envoy knows the call is gRPC from its start).
            host.send_reply(&crate::response::grpc_reply(&unavailable_without_route(
                "the stored response for this idempotency key cannot be replayed here (no replay route); the request was executed and is not run again",
            )));
            return Some(Action::Pause);
        }
        let mut headers = vec![(
            ":status".to_string(),
            routed.status.to_string().into_bytes(),
        )];
        headers.extend(routed.headers.iter().cloned());
        headers.push(("idempotent-replayed".to_string(), b"true".to_vec()));
        host.set_response_headers(&headers);
        host.count(Counter::IdemReplayed);
        self.outcome = Some("replayed");
        Some(Action::Continue)
    }

    /// Its body: held whole, then replaced by the stored messages, and the
    /// stored trailers added at its end.
    pub fn on_response_body<H: Host>(
        &mut self,
        host: &mut H,
        body_size: usize,
        end_of_stream: bool,
    ) -> Option<Action> {
        let routed = self.routed.as_ref()?;
        if !end_of_stream {
            return Some(Action::Pause);
        }
        host.set_response_body(body_size, &routed.body);
        for (name, value) in &routed.trailers {
            host.add_response_trailer(name, value);
        }
        self.routed = None;
        Some(Action::Continue)
    }
}

/// The response code details of a replayed answer.
const REPLAYED: &str = "redis_guard_idempotent_replay";

/// 503: a gRPC replay owed, but no replay route to send it through.
fn unavailable_without_route(detail: &str) -> LocalReply {
    unavailable(detail).with_details("redis_guard_replay_route_missing")
}
