//! Per-value overrides as the filter sends them: `+o` asks the script for a
//! stored one; one the request carries sets the numbers the call sends and
//! the quota the headers state; one that is no quota is counted and the
//! configured numbers go.

use super::*;

fn flow() -> Flow {
    let cfg = Config::parse(
        br#"{"redis":{"batch":{"enabled":false},"cluster":"webdis"},"limits":[
        {"name":"api","descriptor":[{"header":"x-key"}],
         "tokenBucket":{"capacity":100,"refill":10,"periodMs":60000},
         "overrides":{"redis":true,"request":{"header":"x-quota"}}}]}"#,
    )
    .unwrap();
    Flow::new(Rc::new(cfg), test_breaker())
}

/// `[1, allowed, remaining, retry, reset]`, no stored override applied.
const ADMIT: &[u8] = b"*5\r\n$1\r\n1\r\n$1\r\n1\r\n$1\r\n9\r\n$1\r\n0\r\n$4\r\n6000\r\n";

/// One request carrying `quota` (or none): the call's limit values and the
/// X-RateLimit-Limit its admitted response states.
fn decided(quota: Option<&[u8]>) -> (String, Option<String>, usize) {
    let mut f = flow();
    let mut h = FakeHost::get("/").with("x-key", b"acme");
    if let Some(q) = quota {
        h = h.with("x-quota", q);
    }
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    let path = h.dispatched[0].clone();
    let values = path
        .split('/')
        .skip(5)
        .take(3)
        .collect::<Vec<_>>()
        .join("/");
    f.on_callout_reply(&mut h, 1, ok(ADMIT));
    h.respond(&[(":status", "200")]);
    f.on_response_headers(&mut h, true);
    let limit = h
        .added
        .iter()
        .find(|(n, _)| n == "x-ratelimit-limit")
        .map(|(_, v)| v.clone());
    (values, limit, count(&h, Counter::OverrideInvalid(0)))
}

#[test]
fn a_carried_override_sets_the_numbers_the_call_sends_and_the_headers_state() {
    // The configured numbers, with Redis' lookup asked for (`+o`).
    assert_eq!(
        decided(None),
        ("tb%2Bo/100/10".into(), Some("100".into()), 0)
    );
    // A whole number is a bucket's capacity and refill alike.
    assert_eq!(
        decided(Some(b"5000")),
        ("tb%2Bo/5000/5000".into(), Some("5000".into()), 0)
    );
    assert_eq!(
        decided(Some(b"tb 50 5")),
        ("tb%2Bo/50/5".into(), Some("50".into()), 0)
    );
}

#[test]
fn a_carried_value_that_is_no_quota_is_counted_and_the_configured_numbers_go() {
    for bad in [
        &b"-1"[..],
        b"0",
        b"99999999999999999999999",
        b"fw 5",
        b"lots",
    ] {
        assert_eq!(
            decided(Some(bad)),
            ("tb%2Bo/100/10".into(), Some("100".into()), 1),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
}
