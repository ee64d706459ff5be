//! A stored override's anchor day: the script names it when the edges were
//! computed for another day, the request goes again once with edges for
//! it, and the Envoy remembers it for the customer's next requests.

use std::collections::HashMap;

use super::*;
use crate::quota::{Calendar, Per};

const CONFIG: &str = r#"{"redis":{"batch":{"enabled":false},"cluster":"webdis"},"failureMode":"deny","limits":[
    {"name":"plan","descriptor":[{"header":"x-key"}],
     "quota":{"amount":100,"per":"month","timeZone":"UTC","anchorDay":1},
     "overrides":{"redis":true}}]}"#;

/// 2027-06-20T00:00Z.
const NOW: u64 = 1_813_449_600_000;

fn flow() -> Flow {
    Flow::new(
        Rc::new(Config::parse(CONFIG.as_bytes()).unwrap()),
        test_breaker(),
    )
}

fn host(key: &[u8], shared: &HashMap<String, (Vec<u8>, u32)>) -> FakeHost {
    let mut h = FakeHost::get("/").with("x-key", key);
    h.clock_ms = NOW;
    h.shared = shared.clone();
    h
}

/// The percent-decoded call.
fn decoded(call: &str) -> String {
    let b = call.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            out.push(u8::from_str_radix(&call[i + 1..i + 3], 16).unwrap());
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

/// The quota argument a call for anchor `sent` carries.
fn arg(sent: u8) -> String {
    let c = Calendar {
        per: Per::Month,
        zone: chrono_tz::Tz::UTC,
        anchor: sent,
    };
    let [a, b, x, d] = c.edges(NOW as i64).unwrap();
    format!("/cq+o/100/0/{a},{b},{x},{d}@{sent},1,31/1/1")
}

fn anchors_reply(day: &[u8]) -> CalloutReply {
    ok(&resp(&[b"5", b"1", day]))
}

fn admit() -> CalloutReply {
    ok(&resp(&[b"1", b"1", b"99", b"0", b"1000"]))
}

#[test]
fn a_stored_anchor_sends_the_request_again_once_and_is_remembered() {
    let mut shared = HashMap::new();
    let mut f = flow();
    let mut h = host(b"acme", &shared);
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert!(
        decoded(&h.dispatched[0]).contains(&arg(1)),
        "{}",
        h.dispatched[0]
    );
    // The stored override puts acme on the 15th: nothing was decided.
    f.on_callout_reply(&mut h, 1, anchors_reply(b"15"));
    assert_eq!(h.dispatched.len(), 2);
    assert!(
        decoded(&h.dispatched[1]).contains(&arg(15)),
        "{}",
        h.dispatched[1]
    );
    assert!(h.sent.is_empty());
    assert_eq!(h.resumed, 0);
    f.on_callout_reply(&mut h, 2, admit());
    assert_eq!(h.resumed, 1);
    shared = h.shared.clone();

    // Acme's next request is sent for the 15th at once; another customer's
    // for the configured day.
    let mut f = flow();
    let mut h = host(b"acme", &shared);
    f.on_request_headers(&mut h, true);
    assert!(decoded(&h.dispatched[0]).contains(&arg(15)));
    f.on_callout_reply(&mut h, 1, admit());
    assert_eq!((h.dispatched.len(), h.resumed), (1, 1));
    let mut f = flow();
    let mut o = host(b"zeta", &shared);
    f.on_request_headers(&mut o, true);
    assert!(decoded(&o.dispatched[0]).contains(&arg(1)));

    // The override deleted: the script names the configured day, which the
    // Envoy remembers as none.
    let mut f = flow();
    let mut h = host(b"acme", &shared);
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, anchors_reply(b"1"));
    assert!(decoded(&h.dispatched[1]).contains(&arg(1)));
    let (_, stored) = h
        .shared
        .iter()
        .find(|(k, _)| k.starts_with("redis-guard/anchor/"))
        .unwrap();
    assert_eq!(stored.0.len(), 17);
    assert_eq!(stored.0[16], 0);
    let mut f = flow();
    let mut h2 = host(b"acme", &h.shared);
    f.on_request_headers(&mut h2, true);
    assert!(decoded(&h2.dispatched[0]).contains(&arg(1)));
}

#[test]
fn a_second_anchor_reply_is_not_chased_the_failure_mode_decides() {
    let mut f = flow();
    let mut h = host(b"acme", &HashMap::new());
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, anchors_reply(b"15"));
    f.on_callout_reply(&mut h, 2, anchors_reply(b"20"));
    assert_eq!(h.dispatched.len(), 2, "not sent a third time");
    assert_eq!(h.sent.len(), 1, "denied by the failure mode");
    assert_eq!(count(&h, Counter::RedisError(ErrorKind::Reply)), 1);
    // A reply naming a check the request does not have is no verdict.
    let mut f = flow();
    let mut h = host(b"acme", &HashMap::new());
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, ok(&resp(&[b"5", b"2", b"15"])));
    assert_eq!((h.dispatched.len(), h.sent.len()), (1, 1));
    assert!(!h
        .shared
        .keys()
        .any(|k| k.starts_with("redis-guard/anchor/")));
}

#[test]
fn a_batched_member_with_another_anchor_joins_the_batch_again() {
    use crate::filter::stage::batch::Verdict;
    use crate::webdis::parse_reply;
    let cfg = Rc::new(
        Config::parse(
            CONFIG
                .replace(r#""batch":{"enabled":false},"#, "")
                .as_bytes(),
        )
        .unwrap(),
    );
    let mut f = Flow::new(cfg, test_breaker());
    let mut h = host(b"acme", &HashMap::new());
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!((h.dispatched.len(), h.batched.len()), (0, 1));
    let edges =
        |h: &FakeHost, j: usize| String::from_utf8_lossy(&h.batched[j].args.1[4]).into_owned();
    assert!(arg(1).contains(&edges(&h, 0)));
    f.on_batch_verdict(
        &mut h,
        Verdict::Ran(parse_reply(&resp(&[b"5", b"1", b"15"])).unwrap()),
    );
    assert_eq!(h.batched.len(), 2, "the member goes again, in a batch");
    assert!(arg(15).contains(&edges(&h, 1)), "{}", edges(&h, 1));
    f.on_batch_verdict(
        &mut h,
        Verdict::Ran(parse_reply(&resp(&[b"1", b"1", b"99", b"0", b"1000"])).unwrap()),
    );
    assert_eq!((h.resumed, h.sent.len()), (1, 0));
}
