//! The access-log record: one filter-state value per request the filter
//! acted on, written as its stream ends.

use super::*;

/// The record the stream left, parsed.
fn record(h: &FakeHost) -> serde_json::Value {
    assert_eq!(h.filter_state.len(), 1, "one write per request");
    let (name, value) = &h.filter_state[0];
    assert_eq!(name, "redis_guard");
    serde_json::from_slice(value).unwrap()
}

#[test]
fn an_admitted_request_logs_its_verdict_limit_remaining_and_a_hashed_key() {
    let mut f = flow("allow");
    let mut h = FakeHost::get("/api/x");
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, ok(ADMIT));
    assert!(h.filter_state.is_empty(), "written once, at the end");
    f.on_stream_end(&mut h);
    let r = record(&h);
    assert_eq!(r["verdict"], "admitted");
    assert_eq!(r["limit"], "a");
    assert_eq!(r["remaining"], 1);
    assert_eq!(r["key"].as_str().unwrap().len(), 16);
    assert!(r.get("idempotency").is_none());
}

#[test]
fn a_rejection_and_a_failure_mode_answer_say_so() {
    let (mut f, mut h) = started("allow");
    f.on_callout_reply(&mut h, 1, ok(REJECT));
    f.on_stream_end(&mut h);
    assert_eq!(record(&h)["verdict"], "rejected");
    assert_eq!(record(&h)["remaining"], 0);

    let (mut f, mut h) = started("deny");
    f.on_callout_reply(&mut h, 1, no_answer());
    f.on_stream_end(&mut h);
    assert_eq!(record(&h)["verdict"], "failure_denied");
    assert_eq!(h.sent[0].details, "redis_guard_failure_mode_denied");
}

#[test]
fn a_request_no_limit_applies_to_leaves_nothing() {
    let mut f = flow("allow");
    let mut h = FakeHost::get("/public");
    f.on_request_headers(&mut h, true);
    f.on_stream_end(&mut h);
    assert!(h.filter_state.is_empty());
}

#[test]
fn a_keyed_request_logs_what_became_of_its_key() {
    // Stored.
    let (mut f, mut h, _) = holding("allow");
    h.respond(&[(":status", "200")]);
    f.on_response_headers(&mut h, false);
    h.response_chunks = vec![b"done".to_vec()];
    f.on_response_body(&mut h, 4, true);
    f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
    f.on_stream_end(&mut h);
    assert_eq!(record(&h)["idempotency"], "stored");

    // Released: the response is not one the rule stores.
    let (mut f, mut h, _) = holding("allow");
    h.respond(&[(":status", "500")]);
    f.on_response_headers(&mut h, true);
    f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
    f.on_stream_end(&mut h);
    assert_eq!(record(&h)["idempotency"], "released");

    // Abandoned: the client left while the upstream worked.
    let (mut f, mut h, _) = holding("allow");
    f.on_stream_end(&mut h);
    assert_eq!(record(&h)["idempotency"], "abandoned");

    // A conflict.
    let (mut f, mut h) = keyed_in_flight("allow");
    f.on_callout_reply(&mut h, 1, ok(b"*2\r\n$1\r\n2\r\n$4\r\n2900\r\n"));
    f.on_stream_end(&mut h);
    assert_eq!(record(&h)["verdict"], "conflict");
    assert_eq!(h.sent[0].details, "redis_guard_idempotency_conflict");
}

#[test]
fn the_record_can_be_turned_off() {
    let cfg = Rc::new(
        Config::parse(
            br#"{"redis":{"batch":{"enabled":false},"cluster":"webdis"},"accessLog":{"enabled":false},
                "limits":[{"name":"a","match":{"pathPrefix":"/api"},"tokenBucket":{"capacity":2,"refill":1,"periodMs":1000}}]}"#,
        )
        .unwrap(),
    );
    let mut f = Flow::new(cfg, test_breaker());
    let mut h = FakeHost::get("/api/x");
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, ok(ADMIT));
    f.on_stream_end(&mut h);
    assert!(h.filter_state.is_empty());
}
