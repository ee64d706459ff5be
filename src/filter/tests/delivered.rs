//! The root's delivery of idempotent calls after the decision
//! ([`Deferred`] with `resend_for`): sent again after any failure, with a
//! growing pause, until one lands or the lock's TTL has passed; never
//! joined with another; counted lost only when the TTL is over.

use super::*;
use crate::config::RedisTarget;
use crate::filter::deferred::{Deferred, Kind};
use crate::scripts::IDEM_COMPLETE;

const TTL: Duration = Duration::from_millis(2_000);

fn store_kind() -> Kind {
    Kind {
        script: &IDEM_COMPLETE,
        per_key: 0,
        what: "the store of an idempotent response",
        lost: Some(Counter::IdemStoreFailed),
        resend_for: Some(TTL),
    }
}

fn target() -> RedisTarget {
    Config::parse(br#"{"redis":{"cluster":"webdis"}}"#)
        .unwrap()
        .redis
}

fn completion(key: &str, body: &str) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let argv = ["owner-1", "201", "", body, "86400000"];
    (
        vec![key.as_bytes().to_vec()],
        argv.iter().map(|a| a.as_bytes().to_vec()).collect(),
    )
}

#[test]
fn a_delivered_call_goes_again_after_each_failure_with_growing_pauses_until_it_lands() {
    let mut d = Deferred::default();
    let mut h = FakeHost::get("/");
    d.add(
        store_kind(),
        "t",
        completion("{t}k", "done"),
        Duration::ZERO,
    );
    d.flush(&mut h, &target());
    assert_eq!(h.dispatched.len(), 1);
    // Unknown outcome, then refused: each time again, after 25 then 50 ms.
    let mut pauses = Vec::new();
    for (token, reply) in [(1u32, no_answer()), (2, ok(b"-LOADING loading\r\n"))] {
        d.on_reply(&mut h, &target(), token, &reply);
        let sent = h.dispatched.len();
        let waited = h.clock_ms;
        while h.dispatched.len() == sent {
            assert!(d.pending(), "queued again");
            h.clock_ms += 1;
            d.flush(&mut h, &target());
        }
        pauses.push(h.clock_ms - waited);
    }
    assert_eq!(pauses, [25, 50]);
    assert_eq!(h.dispatched[2], h.dispatched[0], "the same call, whole");
    d.on_reply(&mut h, &target(), 3, &ok(b":1\r\n"));
    assert!(!d.pending() && !d.owns(3));
    assert!(h.counted_n.is_empty(), "nothing lost");
}

#[test]
fn a_delivered_call_is_let_go_once_the_lock_has_expired_and_counted_lost() {
    let mut d = Deferred::default();
    let mut h = FakeHost::get("/");
    d.add(
        store_kind(),
        "t",
        completion("{t}k", "done"),
        Duration::ZERO,
    );
    d.flush(&mut h, &target());
    let mut token = 1u32;
    // Every send fails; the pauses grow to a second; past the TTL it stops.
    while h.clock_ms <= TTL.as_millis() as u64 + 1_000 {
        if d.owns(token) {
            d.on_reply(&mut h, &target(), token, &no_answer());
            token += 1;
        }
        h.clock_ms += 5;
        d.flush(&mut h, &target());
    }
    let sends = h.dispatched.len();
    // 25, 50, 100, 200, 400, 800, 1000 ms: 8 sends before 2 s passed.
    assert_eq!(sends, 8, "{:?}", h.dispatched.len());
    assert!(!d.pending() && !d.owns(token));
    assert_eq!(h.counted_n, [(Counter::IdemStoreFailed, 1)]);
}

#[test]
fn delivered_calls_of_one_tag_are_never_joined() {
    let mut d = Deferred::default();
    let mut h = FakeHost::get("/");
    d.add(store_kind(), "t", completion("{t}a", "one"), Duration::ZERO);
    d.add(store_kind(), "t", completion("{t}b", "two"), Duration::ZERO);
    d.flush(&mut h, &target());
    assert_eq!(h.dispatched.len(), 2);
    for call in &h.dispatched {
        assert!(
            call.starts_with(&format!("EVALSHA/{}/1/", IDEM_COMPLETE.sha1)),
            "{call}"
        );
    }
}
