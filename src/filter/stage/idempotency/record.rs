//! Idempotency record: the lock a request took, the copy of its response,
//! and the COMPLETED record written before the response's last piece goes
//! out, so a retry sent after the client saw the whole response is always a
//! replay; or the lock released, so a retry runs again.

use std::time::Duration;

use crate::config::Config;
use crate::filter::call::{Answer, Budget, ScriptCall};
use crate::filter::deferred::Kind;
use crate::filter::owner::{Calls, Owner};
use crate::filter::{Action, CalloutReply, Counter, ErrorKind, Host};
use crate::idempotency::{append_trailers, encode_headers};
use crate::offload::ObjectRef;
use crate::scripts::{IDEM_COMPLETE, IDEM_RELEASE};

use super::intake::Keyed;

/// The idempotency lock of this request, once it has one.
#[derive(Debug)]
pub(super) enum Lock {
    None,
    /// Taken; the response has not started.
    Held,
    /// A storable response is streaming; the copy so far. `expected` is its
    /// content-length: the chunk that completes it is the one to hold, since
    /// the client has the whole response as soon as that chunk is out.
    Capturing {
        status: u32,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
        expected: Option<usize>,
    },
    /// The body is being uploaded to the object store; the last chunk waits
    /// for it and then for the record. The body itself is not kept: Envoy
    /// holds the upload's copy.
    Uploading {
        status: u32,
        headers: Vec<(String, Vec<u8>)>,
        object: ObjectRef,
    },
    /// The COMPLETED record is on its way; the last chunk waits for it.
    Completing {
        call: ScriptCall,
        offloaded: bool,
    },
    /// The lock is being released (the response will not be stored); the
    /// response streams, but the piece that ends it waits for the release so
    /// a retry after it never meets our lock. `seen` counts body bytes
    /// against `expected` (content-length); `held` once that piece waits.
    Releasing {
        call: ScriptCall,
        expected: Option<usize>,
        seen: usize,
        held: bool,
    },
    /// Completed, released, or left to expire: nothing more to do.
    Finished,
}

#[derive(Debug)]
pub struct Record {
    pub(super) keyed: Option<Keyed>,
    pub(super) lock: Lock,
    /// What became of the key, for the access log: the first of stored,
    /// store_failed, released, abandoned.
    pub(super) outcome: Option<&'static str>,
    /// The response is gRPC's (as Envoy tells one), not merely the answer
    /// to a gRPC request.
    grpc_response: bool,
}

impl Default for Record {
    fn default() -> Record {
        Record {
            keyed: None,
            lock: Lock::None,
            outcome: None,
            grpc_response: false,
        }
    }
}

impl Record {
    /// The request carries a key: its lock may be taken by the decision.
    pub fn arm(&mut self, keyed: Keyed) {
        self.keyed = Some(keyed);
    }

    /// What became of the key so far (for the access log): `executed` once
    /// the lock is taken, then how it ended.
    pub fn outcome(&self) -> Option<&'static str> {
        self.outcome
            .or_else(|| (!matches!(self.lock, Lock::None)).then_some("executed"))
    }

    /// The decision admitted the request and took its lock.
    pub fn acquired<H: Host>(&mut self, host: &mut H) {
        if self.keyed.is_some() {
            self.lock = Lock::Held;
            host.count(Counter::IdemAcquired);
        }
    }

    pub fn on_response_headers<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
        end_of_stream: bool,
    ) -> Action {
        let Some(keyed) = &self.keyed else {
            return Action::Continue;
        };
        if !matches!(self.lock, Lock::Held) {
            return Action::Continue;
        }
        let rule = &config.idempotency[keyed.rule];
        let status = host
            .response_header(":status")
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u32>().ok());
        // Envoy's own test (`isGrpcResponseHeaders`): a trailers-only
        // answer has a grpc-status; any other is a 200 of a gRPC
        // content-type. Anything else answering a gRPC request (an upstream
        // that is not gRPC, a proxy's error page) is an HTTP response, kept
        // or freed by its HTTP status and complete at its content-length.
        self.grpc_response = keyed.grpc
            && if end_of_stream {
                host.response_header("grpc-status").is_some()
            } else {
                status == Some(200)
                    && host
                        .response_header("content-type")
                        .is_some_and(|ct| crate::grpc::is_grpc(&ct))
            };
        let (storable, expected, headers) = if self.grpc_response {
            // A gRPC call's outcome is its grpc-status: in the headers of a
            // trailers-only answer, or else in the trailers still to come.
            // Its length is known at its trailers only; one that ends
            // without them is judged by its HTTP status.
            let storable = if end_of_stream {
                host.response_header("grpc-status")
                    .and_then(|code| crate::grpc::parse_status(&code))
                    .filter(|code| rule.stores_grpc(*code))
                    .and(status)
            } else {
                status
            };
            (storable, None, grpc_metadata(host.response_headers()))
        } else {
            let expected = host
                .response_header("content-length")
                .and_then(|v| crate::response::content_length(&v));
            let mut headers = Vec::new();
            for name in &rule.store_headers {
                for value in host.response_header_values(name) {
                    headers.push((name.clone(), value));
                }
            }
            (status.filter(|s| rule.stores(*s)), expected, headers)
        };
        // A replay is a local reply, whose header values must be text: a
        // response that cannot be replayed exactly is not stored.
        let replayable = headers.iter().all(|(_, v)| std::str::from_utf8(v).is_ok());
        if storable.is_some() && expected.is_some_and(|n| n > rule.max_stored_body) {
            // Announced too large: released at once, without copying any of it.
            log::info!(
                "redis-guard: response over maxStoredBodyBytes ({}), not stored",
                rule.max_stored_body
            );
            host.count(Counter::IdemTooLarge);
            self.release_before_end(host, config, calls, expected, 0);
            return self.hold_if_ended(end_of_stream, 0);
        }
        match storable {
            Some(status) if replayable => {
                // Sized from content-length once (at most the cap, checked
                // above), so the copy is never reallocated.
                self.lock = Lock::Capturing {
                    status,
                    headers,
                    body: Vec::with_capacity(expected.unwrap_or(0)),
                    expected,
                };
                if end_of_stream {
                    return self.complete(host, config, calls);
                }
                Action::Continue
            }
            _ => {
                // Not storable (5xx, 4xx unless configured, not replayable):
                // a retry must run again, so free the key before the client
                // has the whole response.
                self.release_before_end(host, config, calls, expected, 0);
                self.hold_if_ended(end_of_stream, 0)
            }
        }
    }

    pub fn on_response_body<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let max = match (&self.keyed, &self.lock) {
            (Some(k), Lock::Capturing { .. }) => config.idempotency[k.rule].max_stored_body,
            (_, Lock::Completing { .. } | Lock::Uploading { .. }) => return Action::Pause,
            (_, Lock::Releasing { .. }) => return self.hold_if_ended(end_of_stream, body_size),
            _ => return Action::Continue,
        };
        let chunk = host.response_body(body_size);
        if self.grpc_response && end_of_stream && !self.stores_by_http_status(config) {
            // A gRPC call that ends without trailers has no grpc-status: it
            // is complete, so its HTTP status decides.
            log::info!(
                "redis-guard: gRPC response without trailers or storable status, not stored"
            );
            return self.release_held_end(host, config, calls);
        }
        let mut complete = end_of_stream;
        if let Lock::Capturing { body, expected, .. } = &mut self.lock {
            if body.len() + chunk.len() > max {
                // Over the cap (in Redis, or in the object store when the
                // rule offloads): released like a failure, so a retry runs
                // again; the copy is dropped at once.
                log::info!("redis-guard: response over maxStoredBodyBytes ({max}), not stored");
                host.count(Counter::IdemTooLarge);
                let (expected, seen) = (*expected, body.len());
                self.release_before_end(host, config, calls, expected, seen);
                return self.hold_if_ended(end_of_stream, chunk.len());
            }
            let needed = body.len() + chunk.len();
            if needed > body.capacity() {
                // Without a content-length: grow by doubling, but never
                // reserve past the cap.
                let target = needed.max(body.capacity().saturating_mul(2)).min(max);
                body.reserve_exact(target - body.len());
            }
            body.extend_from_slice(&chunk);
            complete |= expected.is_some_and(|n| body.len() >= n);
        }
        if complete {
            return self.complete(host, config, calls);
        }
        Action::Continue
    }

    /// Trailers end a response that had no content-length: the captured body
    /// is complete, and a pending release must land before they go out.
    pub fn on_response_trailers<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
    ) -> Action {
        let grpc = self.keyed.as_ref().map(|k| (self.grpc_response, k.rule));
        let by_http = self.stores_by_http_status(config);
        match &mut self.lock {
            Lock::Capturing { headers, .. } => {
                if let Some((true, rule)) = grpc {
                    let storable = match host.response_trailer("grpc-status") {
                        Some(code) => crate::grpc::parse_status(&code)
                            .is_some_and(|c| config.idempotency[rule].stores_grpc(c)),
                        // Trailers without a status: the HTTP status decides.
                        None => by_http,
                    };
                    if !storable {
                        // Failed: free the key before the trailers tell the
                        // client, so its retry runs again.
                        return self.release_held_end(host, config, calls);
                    }
                    append_trailers(headers, host.response_trailers());
                }
                self.complete(host, config, calls)
            }
            Lock::Completing { .. } | Lock::Uploading { .. } => Action::Pause,
            Lock::Releasing { .. } => self.hold_if_ended(true, 0),
            _ => Action::Continue,
        }
    }

    /// The captured response's HTTP status is one its rule stores.
    fn stores_by_http_status(&self, config: &Config) -> bool {
        match (&self.keyed, &self.lock) {
            (Some(keyed), Lock::Capturing { status, .. }) => {
                config.idempotency[keyed.rule].stores(*status)
            }
            _ => false,
        }
    }

    /// While a release is in flight, lets the response stream until the piece
    /// that ends it (end of stream, or content-length reached), which waits.
    fn hold_if_ended(&mut self, end_of_stream: bool, chunk: usize) -> Action {
        let Lock::Releasing {
            expected,
            seen,
            held,
            ..
        } = &mut self.lock
        else {
            return Action::Continue;
        };
        *seen = seen.saturating_add(chunk);
        if end_of_stream || expected.is_some_and(|n| *seen >= n) {
            *held = true;
            return Action::Pause;
        }
        Action::Continue
    }

    /// Stores the captured response (a large body first goes to the object
    /// store); the stream's end waits for the answer.
    fn complete<H: Host>(&mut self, host: &mut H, config: &Config, calls: &mut Calls) -> Action {
        let Some(keyed) = &self.keyed else {
            return Action::Continue;
        };
        let above = config.idempotency[keyed.rule].offload_above;
        let Lock::Capturing {
            status,
            headers,
            body,
            ..
        } = std::mem::replace(&mut self.lock, Lock::Held)
        else {
            return Action::Continue;
        };
        match (above, &config.object_store) {
            (Some(above), Some(_)) if body.len() > above => {
                self.upload(host, config, calls, status, headers, body)
            }
            _ => self.store_record(host, config, calls, status, &headers, body, None),
        }
    }

    /// Writes the COMPLETED record: the body itself, or the object's reference.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn store_record<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
        status: u32,
        headers: &[(String, Vec<u8>)],
        body: Vec<u8>,
        object: Option<ObjectRef>,
    ) -> Action {
        let Some(keyed) = &self.keyed else {
            return Action::Continue;
        };
        let rule = &config.idempotency[keyed.rule];
        let keys = vec![keyed.args.key.clone()];
        // The store gets its own timeout, counted from now, plus 1 ms per KiB:
        // a large body takes longer to cross Envoy, Webdis and Redis.
        let transfer = Duration::from_millis((body.len() / 1024) as u64);
        let mut argv = vec![
            keyed.args.owner.as_bytes().to_vec(),
            status.to_string().into_bytes(),
            encode_headers(headers),
            body,
            rule.record_ttl_ms.to_string().into_bytes(),
        ];
        let offloaded = object.is_some();
        if let Some(object) = object {
            argv.push(object.key.into_bytes());
            argv.push(object.sha256.into_bytes());
            argv.push(object.len.to_string().into_bytes());
        }
        let deadline = host.now() + config.redis.timeout + transfer;
        // EVALSHA like every call: the body is the record, the script's
        // source would only add to every request; a NOSCRIPT costs one EVAL.
        let call = ScriptCall::new(&IDEM_COMPLETE, (keys, argv), Budget::Until(deadline));
        match call.send(host, &config.redis) {
            Ok(token) => {
                calls.expect(token, Owner::Record);
                self.lock = Lock::Completing { call, offloaded };
                Action::Pause
            }
            Err((_, e)) => {
                // Kept as the root's until it lands: the lock stays ours
                // meanwhile, so a retry waits (409) and is then replayed.
                if self.deliver(host, config, Delivered::Store, call.into_args()) {
                    self.lock = Lock::Finished;
                    return Action::Continue;
                }
                log::warn!("redis-guard: cannot store idempotent response: {e}");
                host.count(Counter::IdemStoreFailed);
                self.outcome.get_or_insert("store_failed");
                // Try to free the key all the same (it expires by itself otherwise).
                self.release(host, config, true);
                Action::Continue
            }
        }
    }

    /// Hands a completion or a release to the worker's root, which sends
    /// it until it lands or the lock's TTL has passed (both are
    /// owner-checked: sent twice, the second finds the record done or not
    /// ours and changes nothing). `false`: no worker took it.
    fn deliver<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        what: Delivered,
        args: crate::ratelimit::ScriptArgs,
    ) -> bool {
        let Some(keyed) = &self.keyed else {
            return false;
        };
        let ttl = Duration::from_millis(config.idempotency[keyed.rule].lock_ttl_ms);
        let kind = match what {
            Delivered::Store => Kind {
                script: &IDEM_COMPLETE,
                per_key: 0,
                what: "the store of an idempotent response",
                lost: Some(Counter::IdemStoreFailed),
                resend_for: Some(ttl),
            },
            Delivered::Release => Kind {
                script: &IDEM_RELEASE,
                per_key: 1,
                what: "the release of an idempotency lock",
                lost: None,
                resend_for: Some(ttl),
            },
        };
        let tag = crate::lease::tag_of(&keyed.args.key);
        match host.defer(kind, &tag, args, Duration::ZERO) {
            Ok(()) => {
                log::info!(
                    "redis-guard: {} failed; its worker sends it again",
                    kind.what
                );
                true
            }
            Err(_) => false,
        }
    }

    /// The answer to the record's write, or to the lock's release.
    pub fn on_reply<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
        reply: &CalloutReply,
    ) {
        match &mut self.lock {
            Lock::Completing { call, offloaded } => {
                let offloaded = *offloaded;
                match call.answer(host, &config.redis, reply) {
                    Answer::Resent(token) => calls.expect(token, Owner::Record),
                    Answer::Ran(answer) => match answer.as_int() {
                        Some(1) => {
                            self.lock = Lock::Finished;
                            host.count(Counter::IdemStored);
                            self.outcome.get_or_insert("stored");
                            if offloaded {
                                host.count(Counter::IdemOffloaded);
                            }
                            host.resume_response();
                        }
                        Some(0) => {
                            // The lock expired (upstream slower than
                            // lockTtlMs) and may be another request's now:
                            // leave it; the response still goes out.
                            log::warn!(
                                "redis-guard: idempotency lock lost before the response; not stored"
                            );
                            host.count(Counter::IdemStoreFailed);
                            self.outcome.get_or_insert("store_failed");
                            self.lock = Lock::Finished;
                            host.resume_response();
                        }
                        _ => self.store_failed(host, config, calls, reply.status),
                    },
                    Answer::Failed((ErrorKind::Redis, _)) => {
                        // Redis ran it and said no: sent again, it would
                        // say the same. Free the key.
                        self.store_failed(host, config, calls, reply.status)
                    }
                    Answer::Refused(_) | Answer::Failed(_) => {
                        // Refused, or its outcome unknown: the root sends it
                        // until it lands; the response goes out now.
                        let Lock::Completing { call, .. } =
                            std::mem::replace(&mut self.lock, Lock::Finished)
                        else {
                            return;
                        };
                        if self.deliver(host, config, Delivered::Store, call.into_args()) {
                            host.resume_response();
                        } else {
                            self.store_failed(host, config, calls, reply.status);
                        }
                    }
                }
            }
            Lock::Releasing { call, held, .. } => {
                let held = *held;
                let failed = match call.answer(host, &config.redis, reply) {
                    Answer::Resent(token) => {
                        // Redis lost its scripts since: once more as EVAL.
                        calls.expect(token, Owner::Record);
                        return;
                    }
                    Answer::Ran(_) | Answer::Failed((ErrorKind::Redis, _)) => false,
                    Answer::Refused(_) | Answer::Failed(_) => true,
                };
                let Lock::Releasing { call, .. } =
                    std::mem::replace(&mut self.lock, Lock::Finished)
                else {
                    return;
                };
                if failed {
                    // Still ours, maybe: the root frees it once Redis answers.
                    self.deliver(host, config, Delivered::Release, call.into_args());
                }
                if held {
                    host.resume_response();
                }
            }
            _ => {}
        }
    }

    /// Redis failed to store: free the key (owner-checked) so a retry is not
    /// answered 409 until the lock expires; the response waits for it.
    fn store_failed<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
        status: Option<u32>,
    ) {
        log::warn!("redis-guard: idempotent response not stored ({status:?})");
        host.count(Counter::IdemStoreFailed);
        self.outcome.get_or_insert("store_failed");
        if self.release_held_end(host, config, calls) == Action::Continue {
            host.resume_response();
        }
    }

    /// The response's last piece is being held (its store failed): free the
    /// key first; the piece goes out when the release lands, or at once
    /// (`Continue`) if it could not be sent.
    pub(super) fn release_held_end<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
    ) -> Action {
        self.release_before_end(host, config, calls, None, 0);
        self.hold_if_ended(true, 0)
    }

    /// Sends the release; the response's end waits for it (`hold_if_ended`).
    fn release_before_end<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        calls: &mut Calls,
        expected: Option<usize>,
        seen: usize,
    ) {
        self.lock = match self.release_call(host, config, false) {
            Some((token, call)) => {
                calls.expect(token, Owner::Record);
                Lock::Releasing {
                    call,
                    expected,
                    seen,
                    held: false,
                }
            }
            None => Lock::Finished,
        };
    }

    /// Frees the lock (only if still ours) so a retry runs again, from the
    /// root context: the stream may be ending, and nobody reads the reply.
    pub fn release<H: Host>(&mut self, host: &mut H, config: &Config, detached: bool) {
        self.release_call(host, config, detached);
    }

    fn release_call<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        detached: bool,
    ) -> Option<(u32, ScriptCall)> {
        self.lock = Lock::Finished;
        let keyed = self.keyed.as_ref()?;
        host.count(Counter::IdemReleased);
        self.outcome.get_or_insert("released");
        let args = (
            vec![keyed.args.key.clone()],
            vec![keyed.args.owner.as_bytes().to_vec()],
        );
        // A release nobody waits for is the root's to deliver: sent until it
        // lands or the lock's TTL passes (the fault that lost the acquire's
        // answer would lose a lone release too).
        if detached && self.deliver(host, config, Delivered::Release, args.clone()) {
            return None;
        }
        let call = ScriptCall::new(&IDEM_RELEASE, args, Budget::Each(config.redis.timeout));
        // EVALSHA when a reply will come back to fall back on after a
        // NOSCRIPT; a detached release gets no reply, so it carries the script.
        let sent = if detached {
            call.clone()
                .with_source()
                .send_detached(host, &config.redis)
        } else {
            call.send(host, &config.redis)
        };
        match sent {
            Ok(token) => Some((token, call)),
            Err(_)
                if !detached
                    && self.deliver(host, config, Delivered::Release, call.into_args()) =>
            {
                None
            }
            Err((_, e)) => {
                log::warn!(
                    "redis-guard: cannot release idempotency lock (it expires by itself): {e}"
                );
                None
            }
        }
    }

    /// The stream is over (done, reset or aborted). A lock still held here
    /// belongs to a request that was forwarded and whose response the
    /// client never had whole: the upstream may be running it, or may have
    /// run it (an upload's record will never be written either). Released,
    /// a retry would run beside it; so the lock stays until its outcome is
    /// known (never, here) or `lockTtlMs` passes, and retries meanwhile get
    /// 409. A request whose decision was still out never reached the
    /// upstream, and holds nothing here.
    pub fn on_stream_end<H: Host>(&mut self, host: &mut H) {
        if matches!(
            self.lock,
            Lock::Held | Lock::Capturing { .. } | Lock::Uploading { .. }
        ) {
            log::info!(
                "redis-guard: keyed request forwarded but its response not completed: lock kept until lockTtlMs"
            );
            host.count(Counter::IdemAbandoned);
            self.outcome.get_or_insert("abandoned");
            self.lock = Lock::Finished;
        }
    }
}

/// A call after the decision that the root delivers.
#[derive(Debug, Clone, Copy)]
enum Delivered {
    Store,
    Release,
}

/// What a gRPC response's headers carry that a replay must carry too: all
/// of them but those the transport or Envoy write for each response.
fn grpc_metadata(headers: Vec<(String, Vec<u8>)>) -> Vec<(String, Vec<u8>)> {
    const PER_RESPONSE: [&str; 7] = [
        "content-length",
        "date",
        "server",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "x-envoy-upstream-service-time",
    ];
    headers
        .into_iter()
        .filter(|(n, _)| !n.starts_with(':') && !PER_RESPONSE.contains(&n.as_str()))
        .collect()
}
