//! Unit tests of the request path, one file per feature, all against the
//! fake host in [`super::testing`].
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod access_log;
mod batch;
mod concurrency;
mod counted;
mod delivered;
mod envoy_like;
mod give_back;
mod grpc;
mod host_calls;
mod idempotency;
mod offload;
mod overrides;
mod quota;
mod ratelimit;
mod refusals;
mod usage;

pub(super) use std::rc::Rc;
pub(super) use std::time::Duration;

pub(super) use crate::breaker::Breakers;
/// The hash tag of a request without hashTag parts (the static default).
pub(super) const TAG: &str = "e3b0c44298fc1c14";
pub(super) use crate::codec;
pub(super) use crate::config::Config;
pub(super) use crate::filter::cas::create_or_swap;
pub(super) use crate::filter::flow::Flow;
pub(super) use crate::filter::handoff::Prefetch;
pub(super) use crate::filter::retry::RETRY_DELAY;
pub(super) use crate::filter::stage::idempotency::upload::UPLOAD_REPLY_LIMIT;
pub(super) use crate::filter::stage::lease::on_prefetch_reply;
pub(super) use crate::filter::testing::*;
pub(super) use crate::filter::{Action, CalloutReply, Counter, ErrorKind, Host};
pub(super) use crate::idempotency::{encode_headers, fingerprint, record_key};
pub(super) use crate::lease;
pub(super) use crate::overlimit::Slot;
pub(super) use crate::ratelimit::Plan;
pub(super) use crate::request::RequestLine;
pub(super) use crate::response::LocalReply;
pub(super) use crate::scripts::{IDEM_COMPLETE, IDEM_RELEASE, LEASE, RATELIMIT};
pub(super) use crate::webdis::command_body;

pub(super) fn flow(failure: &str) -> Flow {
    let cfg = Config::parse(
        format!(
            r#"{{"redis":{{"batch":{{"enabled":false}},"cluster":"webdis"}},"failureMode":"{failure}","limits":[
            {{"name":"a","match":{{"pathPrefix":"/api"}},"tokenBucket":{{"capacity":2,"refill":1,"periodMs":1000}}}}]}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    Flow::new(Rc::new(cfg), test_breaker())
}

/// A rate-limited GET whose first Redis call (token 1) is in flight.
pub(super) fn started(failure: &str) -> (Flow, FakeHost) {
    let mut f = flow(failure);
    let mut h = FakeHost::get("/api/x");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    (f, h)
}

pub(super) const ADMIT: &[u8] = b"*5\r\n$1\r\n1\r\n$1\r\n1\r\n$1\r\n1\r\n$1\r\n0\r\n$4\r\n1000\r\n";
pub(super) const REJECT: &[u8] =
    b"*5\r\n$1\r\n0\r\n$1\r\n0\r\n$1\r\n0\r\n$3\r\n400\r\n$3\r\n400\r\n";

// ---- Idempotency keys -------------------------------------------------

pub(super) const IDEM_CONFIG: &str = r#"{"redis":{"batch":{"enabled":false},"cluster":"webdis"},"idempotency":[{"name":"pay",
    "match":{"pathPrefix":"/pay"},"maxRequestBodyBytes":10,"maxStoredBodyBytes":20,
    "required":true,"failureMode":"FAILURE"}]}"#;

/// `[1]`: admitted, lock taken (no rate limits apply).
pub(super) const IDEM_ADMIT: &[u8] = b"*1\r\n$1\r\n1\r\n";

pub(super) fn idem_config(failure: &str) -> Rc<Config> {
    Rc::new(Config::parse(IDEM_CONFIG.replace("FAILURE", failure).as_bytes()).unwrap())
}

pub(super) fn idem_flow(failure: &str) -> Flow {
    Flow::new(idem_config(failure), test_breaker())
}

/// The record key the filter must use for this request.
pub(super) fn expected_record_key(cfg: &Config, h: &FakeHost, key: &[u8]) -> Vec<u8> {
    let line = RequestLine::read(h);
    let tag = cfg.hash_tag_for(&line, h);
    record_key(&cfg.key_prefix, &tag, &cfg.idempotency[0], b"", key)
}

pub(super) fn text(body: Vec<u8>) -> String {
    String::from_utf8(body).unwrap()
}

/// One argument as it appears in a Webdis command body.
pub(super) fn enc(arg: &[u8]) -> String {
    let body = text(command_body("X", &[arg]));
    body["X/".len()..body.len() - ".raw".len()].to_string()
}

pub(super) fn request_call(key: &[u8], owner: &str, fp: &str) -> String {
    text(command_body(
        "EVALSHA",
        &[
            RATELIMIT.sha1.as_bytes(),
            b"1",
            key,
            b"0",
            b"1",
            owner.as_bytes(),
            fp.as_bytes(),
            b"30000",
        ],
    ))
}

pub(super) fn complete_call(
    key: &[u8],
    status: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
) -> String {
    let headers: Vec<(String, Vec<u8>)> = headers
        .iter()
        .map(|(n, v)| ((*n).to_string(), v.to_vec()))
        .collect();
    text(command_body(
        "EVALSHA",
        &[
            IDEM_COMPLETE.sha1.as_bytes(),
            b"1",
            key,
            b"owner-1",
            status.as_bytes(),
            &encode_headers(&headers),
            body,
            b"86400000",
        ],
    ))
}

/// The release a response sends (a reply comes back: EVALSHA).
pub(super) fn release_call(key: &[u8]) -> String {
    text(command_body(
        "EVALSHA",
        &[IDEM_RELEASE.sha1.as_bytes(), b"1", key, b"owner-1"],
    ))
}

/// The release a stream's end sends as the root (no reply: EVAL).
pub(super) fn detached_release_call(key: &[u8]) -> String {
    text(command_body(
        "EVAL",
        &[IDEM_RELEASE.source.as_bytes(), b"1", key, b"owner-1"],
    ))
}

/// A keyed POST without a body, admitted: the lock is held. Returns the
/// record key.
pub(super) fn admitted(f: &mut Flow, h: &mut FakeHost, cfg: &Config) -> Vec<u8> {
    let key = expected_record_key(cfg, h, b"abc-123");
    assert_eq!(f.on_request_headers(h, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 1);
    f.on_callout_reply(h, 1, ok(IDEM_ADMIT));
    assert_eq!(h.resumed, 1);
    assert!(h.sent.is_empty());
    assert!(h.counters.contains(&Counter::IdemAcquired));
    key
}

/// A keyed POST to /pay (no body) whose decision (token 1) is in flight.
pub(super) fn keyed_in_flight(failure: &str) -> (Flow, FakeHost) {
    let mut f = idem_flow(failure);
    let mut h = FakeHost::post("/pay", b"abc-123");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 1);
    (f, h)
}

/// A keyed POST to /pay whose lock is held: the flow, its host, the key.
pub(super) fn holding(failure: &str) -> (Flow, FakeHost, Vec<u8>) {
    let cfg = idem_config(failure);
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::post("/pay", b"abc-123");
    let key = admitted(&mut f, &mut h, &cfg);
    (f, h, key)
}

/// The last call is the owner's release of `key`, the response's end
/// waits for it, and goes out once it lands; the client gets the
/// upstream's response, not a local one.
#[track_caller]
pub(super) fn release_lands(f: &mut Flow, h: &mut FakeHost, key: &[u8]) {
    let token = h.dispatched.len();
    assert_eq!(h.dispatched[token - 1], release_call(key));
    assert_eq!(count(h, Counter::IdemReleased), 1);
    assert_eq!(h.response_resumed, 0, "held until the release lands");
    f.on_callout_reply(h, token as u32, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1);
    assert!(h.sent.is_empty());
}

/// Fails `failures` calls of `h`'s request, so that its slot group's breaker
/// (of that many failures) opens, then checks the next such request is
/// short-circuited: it makes no call.
pub(super) fn trip_breaker(
    cfg: &Rc<Config>,
    breakers: &Rc<Breakers>,
    h: &mut FakeHost,
    failures: u32,
) {
    for _ in 0..failures {
        let mut f = Flow::new(cfg.clone(), breakers.clone());
        assert_eq!(f.on_request_headers(h, true), Action::Pause, "a call");
        // The fake host's token for a call is its place among the calls.
        let token = u32::try_from(h.dispatched.len()).unwrap();
        f.on_callout_reply(h, token, no_answer());
    }
    assert_eq!(count(h, Counter::CircuitOpened), 1);
    let calls = h.dispatched.len();
    let mut f = Flow::new(cfg.clone(), breakers.clone());
    f.on_request_headers(h, true);
    assert_eq!(h.dispatched.len(), calls, "its group is open: no call");
}
