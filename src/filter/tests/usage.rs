use super::*;
use crate::scripts::SETTLE;

/// A token bucket of 1000 units on /llm charged by the response's usage
/// (prompt × 1 + completion × 4, or the x-usage header), reserving 10.
fn usage_flow() -> Flow {
    let cfg = Config::parse(
        br#"{"redis":{"batch":{"enabled":false},"cluster":"webdis"},"limits":[
        {"name":"tokens","match":{"pathPrefix":"/llm"},
         "tokenBucket":{"capacity":1000,"refill":10,"periodMs":1000},
         "usage":{"header":"x-usage","reserve":10,"fallback":50,"maxBodyBytes":256,
                  "json":[{"pointer":"/usage/prompt_tokens"},
                          {"pointer":"/usage/completion_tokens","weight":4}]}}]}"#,
    )
    .unwrap();
    Flow::new(Rc::new(cfg), test_breaker())
}

/// `[1, allowed, remaining, retry, reset]`.
const ADMIT_ONE: &[u8] = b"*5\r\n$1\r\n1\r\n$1\r\n1\r\n$3\r\n990\r\n$1\r\n0\r\n$4\r\n1000\r\n";

/// An admitted request under the limit, its response started with `headers`.
fn answered(headers: &[(&str, &str)]) -> (Flow, FakeHost) {
    let mut f = usage_flow();
    let mut h = FakeHost::get("/llm/chat");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    // The reserve is the request's cost in its decision.
    assert!(
        h.dispatched[0].ends_with("/1/tb/1000/10/1000/10/1.raw"),
        "{}",
        h.dispatched[0]
    );
    f.on_callout_reply(&mut h, 1, ok(ADMIT_ONE));
    assert_eq!(h.resumed, 1);
    h.respond(headers);
    f.on_response_headers(&mut h, false);
    (f, h)
}

/// Streams `body` in pieces of `piece` bytes, the last with end of stream.
fn stream(f: &mut Flow, h: &mut FakeHost, body: &[u8], piece: usize) {
    let chunks: Vec<&[u8]> = body.chunks(piece).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        h.response_chunks.push(chunk.to_vec());
        f.on_response_body(h, chunk.len(), i + 1 == chunks.len());
    }
}

/// The settlement handed to the worker: its KEYS count and its ARGV.
fn settlement(h: &FakeHost) -> (usize, Vec<String>) {
    assert_eq!(h.slot_releases.len(), 1, "one settlement");
    assert_eq!(h.deferred_scripts, std::slice::from_ref(&SETTLE.sha1));
    (h.slot_releases[0].1.len(), h.slot_releases[0].2.clone())
}

#[test]
fn a_json_response_is_charged_its_stated_usage_less_the_reserve() {
    let body = br#"{"usage":{"prompt_tokens":12,"completion_tokens":30}}"#;
    let len = body.len().to_string();
    let (mut f, mut h) = answered(&[(":status", "200"), ("content-length", &len)]);
    stream(&mut f, &mut h, body, 7);
    assert!(
        h.slot_releases.is_empty(),
        "settled when the stream is over"
    );
    f.on_stream_end(&mut h);
    // 12 + 4 × 30 = 132, of which 10 were reserved.
    assert_eq!(
        settlement(&h),
        (
            1,
            // Kind, numbers, the difference, the decision's age (the fake
            // clock did not move), no block.
            vec!["tb", "1000", "10", "1000", "122", "0", "0"]
                .into_iter()
                .map(String::from)
                .collect()
        )
    );
    assert_eq!(h.counted_n, [(Counter::UsageCharged, 122)]);
    f.on_stream_end(&mut h);
    assert_eq!(h.slot_releases.len(), 1, "once");
}

#[test]
fn a_streamed_response_is_read_event_by_event_and_a_small_cost_is_refunded() {
    let body = b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n\
data: {\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n";
    let (mut f, mut h) = answered(&[
        (":status", "200"),
        ("content-type", "text/event-stream; charset=utf-8"),
    ]);
    stream(&mut f, &mut h, body, 5);
    f.on_stream_end(&mut h);
    // 2 + 4 × 1 = 6 of the 10 reserved: 4 back.
    assert_eq!(settlement(&h).1[4], "-4");
    assert_eq!(h.counted_n, [(Counter::UsageRefunded, 4)]);
}

#[test]
fn a_usage_header_states_the_cost_at_once() {
    let (mut f, mut h) = answered(&[(":status", "200"), ("x-usage", "10")]);
    stream(&mut f, &mut h, b"not json", 100);
    f.on_stream_end(&mut h);
    assert!(
        h.slot_releases.is_empty(),
        "the reserve was the cost: nothing to settle"
    );
    assert!(h.counted_n.is_empty() && count(&h, Counter::UsageFallback) == 0);
    let (mut f, mut h) = answered(&[(":status", "200"), ("x-usage", "500")]);
    f.on_stream_end(&mut h);
    assert_eq!(settlement(&h).1[4], "490");
}

#[test]
fn a_response_without_usage_cut_short_or_too_large_is_charged_the_fallback() {
    // (response headers, body, whether the stream ended)
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [u8], bool);
    let cases: [Case; 3] = [
        // No usage in a whole JSON body.
        (&[(":status", "502")], b"{\"error\":\"upstream\"}", true),
        // The client left mid-stream: the usage event never came.
        (
            &[(":status", "200"), ("content-type", "text/event-stream")],
            b"data: {\"usage\":{\"prompt_tokens\":2}}\n\ndata: {\"cho",
            false,
        ),
        // Over maxBodyBytes (256).
        (&[(":status", "200")], &[b' '; 300], true),
    ];
    for (headers, body, ended) in cases {
        let (mut f, mut h) = answered(headers);
        h.response_chunks.push(body.to_vec());
        f.on_response_body(&mut h, body.len(), ended);
        f.on_stream_end(&mut h);
        assert_eq!(count(&h, Counter::UsageFallback), 1, "{body:?}");
        // The fallback (50) less the reserve (10).
        assert_eq!(settlement(&h).1[4], "40", "{body:?}");
    }
}

#[test]
fn a_rejected_request_owes_nothing() {
    let mut f = usage_flow();
    let mut h = FakeHost::get("/llm/chat");
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, ok(REJECT));
    assert_eq!(h.sent[0].status, 429);
    f.on_stream_end(&mut h);
    assert!(h.slot_releases.is_empty() && h.counted_n.is_empty());
}

#[test]
fn a_settlement_the_worker_cannot_take_is_counted_lost() {
    let (mut f, mut h) = answered(&[(":status", "200"), ("x-usage", "20")]);
    h.no_worker = true;
    f.on_stream_end(&mut h);
    assert!(
        h.counted_n.contains(&(Counter::UsageLost, 1)),
        "{:?}",
        h.counted_n
    );
}

/// `usage_flow` whose limit reserves what the request body's `max_tokens`
/// names, times 4 (as completion tokens are weighed), with the config's
/// fallback left out (so it is the reservation).
fn reserving_flow() -> Flow {
    let cfg = Config::parse(
        br#"{"redis":{"batch":{"enabled":false},"cluster":"webdis"},"limits":[
        {"name":"tokens","match":{"pathPrefix":"/llm"},
         "tokenBucket":{"capacity":1000,"refill":10,"periodMs":1000},
         "usage":{"header":"x-usage","reserve":10,"maxBodyBytes":64,
                  "reserveFrom":[{"pointer":"/max_tokens","weight":4}],
                  "json":[{"pointer":"/usage/total_tokens"}]}}]}"#,
    )
    .unwrap();
    Flow::new(Rc::new(cfg), test_breaker())
}

/// The cost the request's decision carries for the token bucket (the ARGV
/// after its kind and three numbers).
fn decided_cost(h: &FakeHost) -> String {
    assert_eq!(h.dispatched.len(), 1, "one decision");
    let parts: Vec<&str> = h.dispatched[0].split('/').collect();
    let at = parts
        .windows(4)
        .position(|w| w == ["tb", "1000", "10", "1000"])
        .unwrap_or_else(|| panic!("no token bucket in {}", h.dispatched[0]));
    parts[at + 4].trim_end_matches(".raw").to_string()
}

#[test]
fn a_reservation_named_by_the_request_body_is_the_decisions_cost_and_the_fallback() {
    let mut f = reserving_flow();
    let mut h = FakeHost::get("/llm/chat").with(":method", b"POST");
    h.request_body = br#"{"model":"m","max_tokens":150}"#.to_vec();
    // The decision waits for the whole body.
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert_eq!(f.on_request_body(&mut h, 10, false), Action::Pause);
    assert!(h.dispatched.is_empty());
    let len = h.request_body.len();
    assert_eq!(f.on_request_body(&mut h, len, true), Action::Pause);
    assert_eq!(decided_cost(&h), "600", "150 × 4");
    assert_eq!(count(&h, Counter::UsageReserveUnread), 0);
    f.on_callout_reply(&mut h, 1, ok(ADMIT_ONE));
    assert_eq!(h.resumed, 1);
    // A later body callback flows on.
    assert_eq!(f.on_request_body(&mut h, len, true), Action::Continue);
    // The client leaves before any usage: the fallback is the reservation,
    // so nothing moves.
    h.respond(&[(":status", "200"), ("content-type", "text/event-stream")]);
    f.on_response_headers(&mut h, false);
    f.on_stream_end(&mut h);
    assert_eq!(count(&h, Counter::UsageFallback), 1);
    assert!(h.slot_releases.is_empty(), "{:?}", h.slot_releases);
}

#[test]
fn a_reservation_above_the_quota_is_the_quota_and_is_settled_from_there() {
    let mut f = reserving_flow();
    let mut h = FakeHost::get("/llm/chat").with(":method", b"POST");
    h.request_body = br#"{"max_tokens":100000}"#.to_vec();
    f.on_request_headers(&mut h, false);
    let len = h.request_body.len();
    f.on_request_body(&mut h, len, true);
    assert_eq!(decided_cost(&h), "1000", "the bucket's capacity");
    f.on_callout_reply(&mut h, 1, ok(ADMIT_ONE));
    h.respond(&[(":status", "200"), ("x-usage", "1300")]);
    f.on_response_headers(&mut h, true);
    f.on_stream_end(&mut h);
    assert_eq!(settlement(&h).1[4], "300");
}

#[test]
fn a_request_body_without_the_field_too_large_or_absent_reserves_the_fixed_amount() {
    // (body, whether it ends with the headers, the body callback that
    // decides: size and end of stream)
    type Case<'a> = (&'a [u8], bool, Option<(usize, bool)>);
    let over = [b' '; 65];
    let cases: [Case; 4] = [
        (br#"{"messages":[]}"#, false, Some((15, true))),
        (b"max_tokens=150", false, Some((14, true))),
        // Over maxBodyBytes (64): decided at once, before the body ends.
        (&over, false, Some((65, false))),
        // No body at all: decided with the headers.
        (b"", true, None),
    ];
    for (body, headers_end, decides) in cases {
        let mut f = reserving_flow();
        let mut h = FakeHost::get("/llm/chat").with(":method", b"POST");
        h.request_body = body.to_vec();
        let action = f.on_request_headers(&mut h, headers_end);
        assert_eq!(action, Action::Pause);
        if let Some((size, end)) = decides {
            assert!(h.dispatched.is_empty(), "{body:?}");
            assert_eq!(f.on_request_body(&mut h, size, end), Action::Pause);
        }
        assert_eq!(decided_cost(&h), "10", "{body:?}");
        assert_eq!(count(&h, Counter::UsageReserveUnread), 1, "{body:?}");
    }
}

#[test]
fn a_usage_trailer_states_the_cost_when_the_headers_do_not() {
    let (mut f, mut h) = answered(&[(":status", "200"), ("content-type", "application/grpc")]);
    h.response_chunks.push(b"\0\0\0\0\x02hi".to_vec());
    f.on_response_body(&mut h, 7, false);
    h.response_trailers = vec![
        ("grpc-status".into(), b"0".to_vec()),
        ("x-usage".into(), b"250".to_vec()),
    ];
    f.on_response_trailers(&mut h);
    f.on_stream_end(&mut h);
    assert_eq!(count(&h, Counter::UsageFallback), 0);
    // 250 of the 10 reserved.
    assert_eq!(settlement(&h).1[4], "240");
}

/// A limit reserving the body's `max_tokens` (reading up to `usage_max`
/// bytes) beside an idempotency rule on the same path (`intake_max`).
fn keyed_reserving_flow(usage_max: usize, intake_max: usize) -> Flow {
    let cfg = format!(
        r#"{{"redis":{{"batch":{{"enabled":false}},"cluster":"webdis"}},"limits":[
        {{"name":"tokens","match":{{"pathPrefix":"/llm"}},
         "tokenBucket":{{"capacity":1000,"refill":10,"periodMs":1000}},
         "usage":{{"reserve":10,"maxBodyBytes":{usage_max},
                  "reserveFrom":[{{"pointer":"/max_tokens"}}],
                  "json":[{{"pointer":"/usage/total_tokens"}}]}}}}],
         "idempotency":[{{"name":"chat","match":{{"pathPrefix":"/llm"}},"maxRequestBodyBytes":{intake_max}}}]}}"#
    );
    Flow::new(
        Rc::new(Config::parse(cfg.as_bytes()).unwrap()),
        test_breaker(),
    )
}

#[test]
fn with_an_idempotency_key_the_decision_waits_for_both_readers_and_starts_once() {
    // The reservation's bound passes first (fixed reserve), the intake's
    // only at the end: one decision, after both.
    let mut f = keyed_reserving_flow(64, 128);
    let mut h = FakeHost::post("/llm/chat", b"key-1");
    h.request_body = [
        br#"{"max_tokens":50,"pad":""#.as_slice(),
        &[b'x'; 60],
        b"\"}",
    ]
    .concat();
    let len = h.request_body.len();
    assert!(len > 64 && len <= 128, "{len}");
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert_eq!(f.on_request_body(&mut h, 65, false), Action::Pause);
    assert!(h.dispatched.is_empty(), "the intake still reads");
    assert_eq!(count(&h, Counter::UsageReserveUnread), 1);
    assert_eq!(f.on_request_body(&mut h, len, true), Action::Pause);
    assert_eq!(decided_cost(&h), "10");
    assert_eq!(f.on_request_body(&mut h, len, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 1, "once");
    // Both read to the end: the reservation the body names.
    let mut f = keyed_reserving_flow(64, 128);
    let mut h = FakeHost::post("/llm/chat", b"key-2");
    h.request_body = br#"{"max_tokens":50}"#.to_vec();
    let len = h.request_body.len();
    f.on_request_headers(&mut h, false);
    assert_eq!(f.on_request_body(&mut h, len, true), Action::Pause);
    assert_eq!(decided_cost(&h), "50");
}

#[test]
fn a_request_answered_413_while_its_reservation_is_read_never_starts_a_decision() {
    // The reservation may read more (256) than the intake allows (128).
    let mut f = keyed_reserving_flow(256, 128);
    let mut h = FakeHost::post("/llm/chat", b"key-3");
    h.request_body = vec![b' '; 200];
    f.on_request_headers(&mut h, false);
    // Over the intake's bound, within the reservation's: 413, while the
    // reservation was still being read.
    f.on_request_body(&mut h, 200, false);
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 413);
    // Whatever Envoy hands over after that starts nothing.
    f.on_request_body(&mut h, 200, true);
    f.on_request_trailers(&mut h);
    assert!(h.dispatched.is_empty(), "{:?}", h.dispatched);
    assert_eq!(h.sent.len(), 1);
}

#[test]
fn request_trailers_end_the_body_a_reservation_is_read_from() {
    let mut f = reserving_flow();
    let mut h = FakeHost::get("/llm/chat").with(":method", b"POST");
    h.request_body = br#"{"max_tokens":20}"#.to_vec();
    f.on_request_headers(&mut h, false);
    assert_eq!(f.on_request_body(&mut h, 17, false), Action::Pause);
    assert!(h.dispatched.is_empty());
    assert_eq!(f.on_request_trailers(&mut h), Action::Pause);
    assert_eq!(decided_cost(&h), "80", "20 × 4");
}

/// Two requests' settlements, of one hash tag, as a worker's root joins
/// them in one call of lua/settle.lua.
fn joined_settlements() -> (
    crate::filter::deferred::Deferred,
    FakeHost,
    crate::config::RedisTarget,
) {
    use crate::filter::stage::usage::SETTLE_CALL;
    let mut d = crate::filter::deferred::Deferred::default();
    let mut h = FakeHost::get("/");
    let target = Config::parse(br#"{"redis":{"cluster":"webdis"}}"#)
        .unwrap()
        .redis;
    let settlement = |key: &str, alg: &str, c: &str| {
        (
            vec![key.as_bytes().to_vec()],
            [alg, "100", "10", c, "5", "0", "0"]
                .iter()
                .map(|v| v.as_bytes().to_vec())
                .collect::<Vec<_>>(),
        )
    };
    d.add(
        SETTLE_CALL,
        "{t}",
        settlement("{t}a", "tb", "1000"),
        Duration::ZERO,
    );
    d.add(
        SETTLE_CALL,
        "{t}",
        settlement("{t}q", "cq", "1,2,3,4"),
        Duration::ZERO,
    );
    d.flush(&mut h, &target);
    assert_eq!(h.dispatched.len(), 1, "one call for the tag");
    (d, h, target)
}

#[test]
fn a_settlement_the_script_marks_failed_is_counted_lost_and_the_others_are_not() {
    let (mut d, mut h, target) = joined_settlements();
    // As Webdis hands lua/settle.lua's reply over: the first settled (90
    // left), the second marked (its edges no longer hold Redis' clock).
    let why = "ERR redis-guard settle: limit 2: no window of its edges holds Redis' clock";
    let body = format!("*2\r\n$2\r\n90\r\n${}\r\n{why}\r\n", why.len());
    d.on_reply(&mut h, &target, 1, &ok(body.as_bytes()));
    assert_eq!(h.counted_n, [(Counter::UsageLost, 1)]);
    // Every one settled: nothing counted.
    let (mut d, mut h, target) = joined_settlements();
    d.on_reply(
        &mut h,
        &target,
        1,
        &ok(b"*2\r\n$2\r\n90\r\n$10\r\n2147483648\r\n"),
    );
    assert_eq!(h.counted_n, []);
}
