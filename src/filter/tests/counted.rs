//! Response-counted limits (`usage.countStatuses`): a request takes its
//! reserve at admission and gets it back unless its response's status counts.

use super::*;

/// Five failed logins per user: only 401 and gRPC UNAUTHENTICATED count.
fn login_flow() -> Flow {
    let cfg = Config::parse(
        br#"{"redis":{"batch":{"enabled":false},"cluster":"webdis"},"limits":[
        {"name":"failed-logins","match":{"pathPrefix":"/login"},"descriptor":[{"header":"x-user"}],
         "fixedWindow":{"limit":5,"windowMs":900000},
         "usage":{"countStatuses":["401","UNAUTHENTICATED"]}}]}"#,
    )
    .unwrap();
    Flow::new(Rc::new(cfg), test_breaker())
}

/// `[1, allowed, remaining, retry, reset]`.
const ADMIT: &[u8] = b"*5\r\n$1\r\n1\r\n$1\r\n1\r\n$1\r\n4\r\n$1\r\n0\r\n$6\r\n900000\r\n";

/// An admitted login whose response starts with `headers`.
fn answered(headers: &[(&str, &str)]) -> (Flow, FakeHost) {
    let mut f = login_flow();
    let mut h = FakeHost::get("/login").with("x-user", b"ann");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert!(
        h.dispatched[0].contains("/fw/5/900000/0/1/1"),
        "{}",
        h.dispatched[0]
    );
    f.on_callout_reply(&mut h, 1, ok(ADMIT));
    assert_eq!(h.resumed, 1);
    h.respond(headers);
    f.on_response_headers(&mut h, false);
    (f, h)
}

/// The units the settlement moves, or None when nothing was settled.
fn settled(h: &FakeHost) -> Option<String> {
    assert!(h.slot_releases.len() <= 1);
    h.slot_releases.first().map(|s| s.2[4].clone())
}

#[test]
fn a_counted_status_keeps_the_reserve_and_any_other_gives_it_back() {
    let (mut f, mut h) = answered(&[(":status", "401"), ("content-length", "0")]);
    f.on_stream_end(&mut h);
    assert_eq!(settled(&h), None, "a failed login keeps its unit");
    for status in ["200", "403", "500"] {
        let (mut f, mut h) = answered(&[(":status", status), ("content-length", "0")]);
        f.on_stream_end(&mut h);
        assert_eq!(settled(&h).as_deref(), Some("-1"), "{status}");
        assert_eq!(h.counted_n, [(Counter::UsageRefunded, 1)]);
    }
}

#[test]
fn a_response_that_never_came_counts_as_its_reserve() {
    let mut f = login_flow();
    let mut h = FakeHost::get("/login").with("x-user", b"ann");
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, ok(ADMIT));
    f.on_stream_end(&mut h);
    assert_eq!(settled(&h), None);
    assert_eq!(count(&h, Counter::UsageFallback), 1);
}

#[test]
fn a_grpc_response_is_judged_by_its_grpc_status_wherever_it_comes() {
    let grpc = [(":status", "200"), ("content-type", "application/grpc")];
    // Trailers-only: the status is among the headers.
    let mut only = grpc.to_vec();
    only.push(("grpc-status", "16"));
    let (mut f, mut h) = answered(&only);
    f.on_stream_end(&mut h);
    assert_eq!(settled(&h), None, "UNAUTHENTICATED counts");
    // In the trailers: OK gives the unit back, UNAUTHENTICATED keeps it.
    for (code, want) in [("0", Some("-1")), ("16", None)] {
        let (mut f, mut h) = answered(&grpc);
        h.response_trailers = vec![("grpc-status".to_string(), code.as_bytes().to_vec())];
        f.on_response_trailers(&mut h);
        f.on_stream_end(&mut h);
        assert_eq!(settled(&h).as_deref(), want, "grpc-status {code}");
    }
    // No grpc-status at all, the response complete: its HTTP status decides.
    let mut framed = grpc.to_vec();
    framed.push(("content-length", "0"));
    let (mut f, mut h) = answered(&framed);
    f.on_response_body(&mut h, 0, true);
    f.on_stream_end(&mut h);
    assert_eq!(settled(&h).as_deref(), Some("-1"), "200 does not count");
}

#[test]
fn a_blocking_counted_limit_lets_its_settlement_start_the_block() {
    let cfg = Config::parse(
        br#"{"redis":{"batch":{"enabled":false},"cluster":"webdis"},"limits":[
        {"name":"failed-logins","match":{"pathPrefix":"/login"},"descriptor":[{"header":"x-user"}],
         "fixedWindow":{"limit":5,"windowMs":900000},
         "usage":{"countStatuses":["401"]},"block":{"durationMs":60000}}]}"#,
    )
    .unwrap();
    let run = |status: &str| {
        let mut f = Flow::new(Rc::new(cfg.clone()), test_breaker());
        let mut h = FakeHost::get("/login").with("x-user", b"ann");
        f.on_request_headers(&mut h, true);
        // A rejection at admission never starts this block (the bucket may
        // hold running requests' reserves): the enforce value is negated.
        assert!(
            h.dispatched[0].contains("/fw/5/900000/0/1/%2D60000"),
            "{}",
            h.dispatched[0]
        );
        f.on_callout_reply(&mut h, 1, ok(ADMIT));
        h.respond(&[(":status", status), ("content-length", "0")]);
        f.on_response_headers(&mut h, true);
        f.on_stream_end(&mut h);
        h.slot_releases
            .first()
            .map(|s| (s.2[4].clone(), s.2[6].clone()))
    };
    // A counted failure sends its settlement (nothing moves) with the block:
    // the script starts it if the limit is now exhausted.
    assert_eq!(run("401"), Some(("0".into(), "60000".into())));
    // A refund never starts one.
    assert_eq!(run("200"), Some(("-1".into(), "0".into())));
}

#[test]
fn count_statuses_is_alone_and_every_entry_names_a_status() {
    let err = |usage: &str| {
        Config::parse(
            format!(
                r#"{{"redis":{{"cluster":"w"}},"limits":[{{"name":"l","fixedWindow":{{"limit":5,"windowMs":1000}},"usage":{usage}}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap_err()
    };
    let e = err(r#"{"countStatuses":["401"],"header":"x-cost"}"#);
    assert_eq!(e.field, "limits[0].usage.countStatuses");
    let e = err(r#"{"countStatuses":["401","6xx"]}"#);
    assert_eq!(e.field, "limits[0].usage.countStatuses[1]");
    let e = err(r#"{}"#);
    assert!(e.reason.contains("countStatuses"), "{e:?}");
}
