//! gRPC over the fake host: the filter's answers as gRPC statuses, a call's
//! outcome read from its trailers, and replays through the replay route.

use super::*;
use crate::filter::stage::idempotency::replay::{REPLAY_MARK, REPLAY_PATH};
use crate::idempotency::encode_response_fields;
use crate::request::RequestView;

fn grpc_post(key: &[u8]) -> FakeHost {
    FakeHost::post("/pay", key).with("content-type", b"application/grpc")
}

fn pairs(p: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    p.iter()
        .map(|(n, v)| ((*n).to_string(), v.to_vec()))
        .collect()
}

/// A keyed gRPC call whose lock is held, its response headers passed.
fn grpc_holding() -> (Flow, FakeHost, Vec<u8>) {
    let cfg = idem_config("allow");
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = grpc_post(b"abc-123");
    let key = admitted(&mut f, &mut h, &cfg);
    h.respond(&[
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("x-order-id", "7"),
        ("date", "Thu, 03 Dec 2026 10:00:00 GMT"),
    ]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    h.response_chunks = vec![b"\0\0\0\0\x02ok".to_vec()];
    assert_eq!(f.on_response_body(&mut h, 7, false), Action::Continue);
    (f, h, key)
}

#[test]
fn the_filters_answers_reach_a_grpc_client_as_grpc_statuses() {
    let mut f = idem_flow("allow");
    let mut h = grpc_post(b"abc-123");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    f.on_callout_reply(&mut h, 1, ok(b"*2\r\n$1\r\n2\r\n$4\r\n2900\r\n"));
    assert_eq!(h.sent.len(), 1);
    let busy = &h.sent[0];
    assert_eq!(busy.grpc_status, Some(crate::grpc::ABORTED));
    assert_eq!(
        busy.body,
        b"a request with this idempotency key is being processed"
    );
    assert!(has_header(&busy.headers, "retry-after", "1"));
    assert!(busy.headers.iter().all(|(n, _)| n != "content-type"));

    // A bad key, before any call.
    let mut f = idem_flow("allow");
    let mut h = grpc_post(b"");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.sent[0].grpc_status, Some(crate::grpc::INVALID_ARGUMENT));
    assert!(h.dispatched.is_empty());
}

#[test]
fn a_keyed_call_sending_a_second_message_is_refused_before_any_call() {
    let mut f = idem_flow("allow");
    let mut h = grpc_post(b"abc-123");
    h.request_body = b"\0\0\0\0\x01a\0\0".to_vec();
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert_eq!(f.on_request_body(&mut h, 6, false), Action::Pause);
    assert!(h.sent.is_empty(), "one whole message: wait for the end");
    assert_eq!(f.on_request_body(&mut h, 8, false), Action::Pause);
    assert_eq!(h.sent.len(), 1, "refused as the second message starts");
    assert_eq!(h.sent[0].grpc_status, Some(crate::grpc::INVALID_ARGUMENT));
    assert!(h.dispatched.is_empty());

    // One message and the end: decided.
    let mut f = idem_flow("allow");
    let mut h = grpc_post(b"abc-123");
    h.request_body = b"\0\0\0\0\x01a".to_vec();
    f.on_request_headers(&mut h, false);
    assert_eq!(f.on_request_body(&mut h, 6, true), Action::Pause);
    assert!(h.sent.is_empty());
    assert_eq!(h.dispatched.len(), 1);
}

#[test]
fn a_call_ending_ok_is_stored_with_its_metadata_and_trailers() {
    let (mut f, mut h, key) = grpc_holding();
    assert_eq!(h.dispatched.len(), 1, "not stored before the trailers");
    h.response_trailers = pairs(&[("grpc-status", b"0"), ("x-sig-bin", b"AP8")]);
    assert_eq!(f.on_response_trailers(&mut h), Action::Pause);
    let fields = encode_response_fields(
        &pairs(&[("content-type", b"application/grpc"), ("x-order-id", b"7")]),
        &pairs(&[("grpc-status", b"0"), ("x-sig-bin", b"AP8")]),
    );
    let want = text(command_body(
        "EVALSHA",
        &[
            IDEM_COMPLETE.sha1.as_bytes(),
            b"1",
            &key,
            b"owner-1",
            b"200",
            &fields,
            b"\0\0\0\0\x02ok",
            b"86400000",
        ],
    ));
    assert_eq!(h.dispatched[1], want);
    f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1);
    assert_eq!(count(&h, Counter::IdemStored), 1);
}

#[test]
fn a_call_ending_internal_frees_its_key_before_its_trailers_go_out() {
    let (mut f, mut h, key) = grpc_holding();
    h.response_trailers = pairs(&[("grpc-status", b"13"), ("grpc-message", b"boom")]);
    assert_eq!(f.on_response_trailers(&mut h), Action::Pause);
    release_lands(&mut f, &mut h, &key);
    assert_eq!(count(&h, Counter::IdemStored), 0);

    // A trailers-only NOT_FOUND is an answer about the request: stored.
    let cfg = idem_config("allow");
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = grpc_post(b"abc-123");
    admitted(&mut f, &mut h, &cfg);
    h.respond(&[(":status", "200"), ("grpc-status", "5")]);
    assert_eq!(f.on_response_headers(&mut h, true), Action::Pause);
    assert!(h.dispatched[1].contains(&enc(b"grpc-status")));
    assert!(h.dispatched[1].starts_with("EVALSHA/"));
}

#[test]
fn a_complete_answer_without_a_grpc_status_is_judged_by_its_http_status() {
    // The body ends without trailers: complete, and a 200 its rule stores.
    let (mut f, mut h, _) = grpc_holding();
    h.response_chunks = vec![b"\0\0\0\0\x02ok".to_vec()];
    assert_eq!(f.on_response_body(&mut h, 7, true), Action::Pause);
    assert!(h.dispatched[1].starts_with(&format!("EVALSHA/{}/", IDEM_COMPLETE.sha1)));
    assert_eq!(count(&h, Counter::IdemReleased), 0);

    // Trailers without a grpc-status: the same.
    let (mut f, mut h, _) = grpc_holding();
    h.response_trailers = pairs(&[("x-sig", b"1")]);
    assert_eq!(f.on_response_trailers(&mut h), Action::Pause);
    assert!(h.dispatched[1].starts_with(&format!("EVALSHA/{}/", IDEM_COMPLETE.sha1)));

    // A whole 500 from an upstream that is not gRPC: released, by its status.
    let cfg = idem_config("allow");
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = grpc_post(b"abc-123");
    let key = admitted(&mut f, &mut h, &cfg);
    h.respond(&[(":status", "500")]);
    assert_eq!(f.on_response_headers(&mut h, true), Action::Pause);
    release_lands(&mut f, &mut h, &key);

    // A whole 201 without a status: stored.
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = grpc_post(b"abc-123");
    admitted(&mut f, &mut h, &cfg);
    h.respond(&[(":status", "201"), ("content-type", "application/json")]);
    assert_eq!(f.on_response_headers(&mut h, true), Action::Pause);
    assert!(h.dispatched[1].starts_with(&format!("EVALSHA/{}/", IDEM_COMPLETE.sha1)));
}

/// A completed record of a gRPC call: status 200, its headers and
/// trailers, one message.
fn completed_grpc_record() -> Vec<u8> {
    let fields = encode_response_fields(
        &pairs(&[("content-type", b"application/grpc"), ("x-order-id", b"7")]),
        &pairs(&[("grpc-status", b"0"), ("x-trace", b"t7")]),
    );
    resp(&[b"3", b"200", &fields, b"\0\0\0\0\x02ok"])
}

#[test]
fn a_retry_goes_to_the_replay_route_whose_answer_becomes_the_stored_one() {
    let (mut f, mut h) = (idem_flow("allow"), grpc_post(b"abc-123"));
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    f.on_callout_reply(&mut h, 1, ok(&completed_grpc_record()));
    assert!(
        h.sent.is_empty(),
        "no local reply: it could not carry trailers"
    );
    assert_eq!(h.resumed, 1);
    assert_eq!(h.header(":path").unwrap(), REPLAY_PATH.as_bytes());
    assert_eq!(
        h.header("content-type").unwrap(),
        b"application/octet-stream"
    );

    h.respond(&[
        (":status", "200"),
        ("content-length", "1"),
        (REPLAY_MARK, "1"),
    ]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    assert_eq!(
        h.response,
        pairs(&[
            (":status", b"200"),
            ("content-type", b"application/grpc"),
            ("x-order-id", b"7"),
            ("idempotent-replayed", b"true"),
        ])
    );
    assert_eq!(count(&h, Counter::IdemReplayed), 1);
    assert_eq!(f.on_response_body(&mut h, 1, false), Action::Pause);
    assert_eq!(f.on_response_body(&mut h, 1, true), Action::Continue);
    assert_eq!(h.replaced_bodies, [b"\0\0\0\0\x02ok".to_vec()]);
    assert_eq!(
        h.added_trailers,
        pairs(&[("grpc-status", b"0"), ("x-trace", b"t7")])
    );
    f.on_stream_end(&mut h);
    assert_eq!(h.dispatched.len(), 1, "nothing to release: it never ran");
}

#[test]
fn without_the_replay_route_a_retry_is_unavailable_and_never_run_again() {
    let (mut f, mut h) = (idem_flow("allow"), grpc_post(b"abc-123"));
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, ok(&completed_grpc_record()));
    // The upstream answered the replay path itself (no such method).
    h.respond(&[(":status", "200"), ("grpc-status", "12")]);
    assert_eq!(f.on_response_headers(&mut h, true), Action::Pause);
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].grpc_status, Some(crate::grpc::UNAVAILABLE));
    assert_eq!(count(&h, Counter::IdemReplayed), 0);
}
