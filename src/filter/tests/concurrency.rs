use super::*;
use crate::config::RedisTarget;
use crate::filter::deferred::{Deferred, MAX_KEYS};
use crate::filter::stage::concurrency::RELEASE;
use crate::scripts::{CC_RELEASE, CC_RENEW};

/// A concurrency limit of 2 slots leased for 3 s on /api, a token bucket on
/// /both beside it.
fn cc_flow(failure: &str) -> Flow {
    let cfg = Config::parse(
        format!(
            r#"{{"redis":{{"batch":{{"enabled":false}},"cluster":"webdis"}},"failureMode":"{failure}","limits":[
            {{"name":"slots","match":{{"pathPrefix":"/api"}},"concurrency":{{"max":2,"leaseMs":3000}}}}]}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    Flow::new(Rc::new(cfg), test_breaker())
}

/// A request under the limit whose decision (token 1) is in flight.
fn cc_started(failure: &str) -> (Flow, FakeHost) {
    let mut f = cc_flow(failure);
    let mut h = FakeHost::get("/api/x");
    h.can_schedule = true;
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    (f, h)
}

/// `[1, allowed, remaining, retry, reset]` for the one limit.
const CC_ADMIT: &[u8] = b"*5\r\n$1\r\n1\r\n$1\r\n1\r\n$1\r\n1\r\n$1\r\n0\r\n$1\r\n0\r\n";
const CC_REJECT: &[u8] = b"*5\r\n$1\r\n0\r\n$1\r\n0\r\n$1\r\n0\r\n$4\r\n1000\r\n$1\r\n0\r\n";

/// The slot id the filter derives from the fake host's first token
/// ("owner-1": its hex digits).
const SLOT: &str = "e1";

#[test]
fn the_decision_takes_the_slot_under_the_requests_own_slot_id() {
    let (_, h) = cc_started("allow");
    assert_eq!(h.dispatched.len(), 1);
    let call = &h.dispatched[0];
    assert!(
        call.starts_with(&format!("EVALSHA/{}/1/", RATELIMIT.sha1)),
        "{call}"
    );
    // max, lease, slot id, cost, enforced; no idempotency flag.
    assert!(
        call.ends_with(&format!("/1/cc/2/3000/{SLOT}/1/1.raw")),
        "{call}"
    );
}

#[test]
fn an_admitted_request_whose_client_leaves_keeps_its_slot_until_its_lease_ends() {
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    assert_eq!(h.resumed, 1);
    // Renewed every quarter of the lease.
    assert_eq!(h.wakes, [Duration::from_millis(750)]);
    // The client leaves before the response is whole: the upstream may
    // still work on the request, so the slot is not given back (its lease
    // ends it) and no renewal follows.
    f.on_stream_end(&mut h);
    assert!(h.slot_releases.is_empty() && h.detached.is_empty());
    assert_eq!(count(&h, Counter::SlotsReleased), 0);
    assert_eq!(count(&h, Counter::SlotsAbandoned), 1);
    h.clock_ms = 750;
    f.on_wake(&mut h);
    assert_eq!(h.dispatched.len(), 1, "no renewal after the stream ended");
    f.on_stream_end(&mut h);
    assert_eq!(count(&h, Counter::SlotsAbandoned), 1, "once only");
}

/// The whole response arrives while no call can be sent from the stream:
/// its slots go back through the worker.
fn respond_whole_without_a_call(f: &mut Flow, h: &mut FakeHost) {
    h.dispatch_fails = true;
    h.respond(&[(":status", "200"), ("content-length", "0")]);
    assert_eq!(f.on_response_headers(h, true), Action::Continue);
}

#[test]
fn a_response_whose_release_cannot_be_sent_gives_the_slot_back_through_the_worker() {
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    assert!(h.slot_releases.is_empty());
    respond_whole_without_a_call(&mut f, &mut h);
    // Handed to the worker, under the request's hash tag.
    assert_eq!(h.slot_releases.len(), 1);
    let (tag, keys, argv) = &h.slot_releases[0];
    assert_eq!(tag, "e3b0c44298fc1c14");
    assert_eq!(keys.len(), 1);
    assert!(keys[0].contains(":slots:cc:"), "{keys:?}");
    assert_eq!(argv, &[SLOT, "1"]);
    assert_eq!(count(&h, Counter::SlotsReleased), 1);
    assert!(h.detached.is_empty());
    // Once only.
    f.on_stream_end(&mut h);
    assert_eq!(h.slot_releases.len(), 1);
    assert_eq!(count(&h, Counter::SlotsAbandoned), 0);
}

#[test]
fn without_a_worker_to_take_it_the_stream_sends_its_release_whole_as_the_root() {
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    h.no_worker = true;
    respond_whole_without_a_call(&mut f, &mut h);
    assert_eq!(h.detached.len(), 1);
    // EVAL: nobody reads its answer to fall back on after a NOSCRIPT.
    let release = &h.detached[0];
    assert!(release.starts_with("EVAL/"), "{release}");
    assert!(
        release.contains(&escaped(&CC_RELEASE.source[..40])),
        "{release}"
    );
    assert!(release.ends_with(&format!("/{SLOT}/1.raw")), "{release}");
    assert_eq!(count(&h, Counter::SlotsReleased), 1);
}

/// Text as Webdis' path encoding writes it.
fn escaped(s: &str) -> String {
    let body = String::from_utf8(command_body("X", &[s.as_bytes()])).unwrap();
    body.trim_start_matches("X/")
        .trim_end_matches(".raw")
        .to_string()
}

#[test]
fn a_rejected_request_holds_nothing_and_its_429_is_never_cached() {
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, ok(CC_REJECT));
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 429);
    assert!(has_header(&h.sent[0].headers, "retry-after", "1"));
    // Capacity comes back when a request ends: no time-out could say when.
    assert!(
        h.shared.is_empty(),
        "over-limit cache written: {:?}",
        h.shared.keys()
    );
    f.on_stream_end(&mut h);
    assert!(h.slot_releases.is_empty() && h.detached.is_empty());
    assert!(h.wakes.is_empty());
}

#[test]
fn a_running_request_renews_its_lease_when_due_and_only_then() {
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    // A wake-up before the renewal is due (another reason) sends nothing.
    h.clock_ms = 749;
    f.on_wake(&mut h);
    assert_eq!(h.dispatched.len(), 1);
    h.clock_ms = 750;
    f.on_wake(&mut h);
    assert_eq!(h.dispatched.len(), 2);
    let renew = &h.dispatched[1];
    assert!(
        renew.starts_with(&format!("EVALSHA/{}/1/", CC_RENEW.sha1)),
        "{renew}"
    );
    assert!(renew.ends_with(&format!("/{SLOT}/3000/1.raw")), "{renew}");
    assert_eq!(h.wakes.len(), 2);
    // Still out at the next due time: no second renewal on top of it.
    h.clock_ms = 1500;
    f.on_wake(&mut h);
    assert_eq!(h.dispatched.len(), 2);
    f.on_callout_reply(&mut h, 2, ok(&resp(&[b"1"])));
    assert_eq!(count(&h, Counter::SlotsRenewed), 1);
    assert_eq!(count(&h, Counter::SlotsLost), 0);
    h.clock_ms = 2250;
    f.on_wake(&mut h);
    assert_eq!(h.dispatched.len(), 3);
    // The slot still held is given back when the response is whole.
    f.on_callout_reply(&mut h, 3, ok(&resp(&[b"1"])));
    respond_whole_without_a_call(&mut f, &mut h);
    assert_eq!(h.slot_releases.len(), 1);
}

#[test]
fn a_slot_found_gone_at_its_renewal_is_counted_lost_and_neither_renewed_nor_released() {
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    h.clock_ms = 750;
    f.on_wake(&mut h);
    f.on_callout_reply(&mut h, 2, ok(&resp(&[b"0"])));
    assert_eq!(count(&h, Counter::SlotsLost), 1);
    h.clock_ms = 1500;
    f.on_wake(&mut h);
    assert_eq!(h.dispatched.len(), 2, "nothing left to renew");
    f.on_stream_end(&mut h);
    assert!(h.slot_releases.is_empty(), "nothing left to give back");
}

#[test]
fn a_renewal_after_redis_lost_its_scripts_goes_again_as_eval() {
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    h.clock_ms = 750;
    f.on_wake(&mut h);
    f.on_callout_reply(&mut h, 2, ok(b"-NOSCRIPT No matching script.\r\n"));
    assert_eq!(h.dispatched.len(), 3);
    assert!(h.dispatched[2].starts_with("EVAL/"));
    f.on_callout_reply(&mut h, 3, ok(&resp(&[b"1"])));
    assert_eq!(count(&h, Counter::SlotsRenewed), 1);
}

#[test]
fn a_failed_renewal_keeps_the_slot_for_the_next_one() {
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    h.clock_ms = 750;
    f.on_wake(&mut h);
    f.on_callout_reply(&mut h, 2, no_answer());
    h.clock_ms = 1500;
    f.on_wake(&mut h);
    assert_eq!(h.dispatched.len(), 3, "renewed again");
    f.on_callout_reply(&mut h, 3, ok(&resp(&[b"1"])));
    respond_whole_without_a_call(&mut f, &mut h);
    assert_eq!(h.slot_releases.len(), 1);
}

#[test]
fn a_decision_that_may_have_run_gives_back_what_it_may_have_taken() {
    // Timed out: the script may have taken the slot; the request goes on
    // (failure mode allow) and its end releases the slot all the same.
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, no_answer());
    assert_eq!(h.resumed, 1);
    assert!(
        h.wakes.is_empty(),
        "a slot not known to be held is not renewed"
    );
    // Not at the response's end, and without a hold: Redis just failed.
    h.respond(&[(":status", "200")]);
    assert_eq!(f.on_response_headers(&mut h, true), Action::Continue);
    assert_eq!(h.dispatched.len(), 1);
    f.on_stream_end(&mut h);
    assert_eq!(h.slot_releases.len(), 1);
    assert_eq!(h.slot_releases[0].2, [SLOT, "1"]);
    // Only once the timed-out call can no longer run (timeoutMs, 50 ms,
    // and a margin): a release sent first would find nothing, and the late
    // script would take a slot nobody gives back.
    assert_eq!(h.release_delays, [Duration::from_millis(150)]);
}

#[test]
fn a_shadow_concurrency_limit_releases_without_holding_the_response() {
    let cfg = Config::parse(
        br#"{"redis":{"batch":{"enabled":false},"cluster":"webdis"},"limits":[
        {"name":"slots","shadow":true,"concurrency":{"max":2,"leaseMs":3000}}]}"#,
    )
    .unwrap();
    let mut f = Flow::new(Rc::new(cfg), test_breaker());
    let mut h = FakeHost::get("/api/x");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    h.respond(&[(":status", "204")]);
    // A shadow limit never rejects: nobody's next request waits on it.
    assert_eq!(f.on_response_headers(&mut h, true), Action::Continue);
    assert_eq!(h.dispatched.len(), 2, "released all the same");
}

#[test]
fn a_keyed_request_releases_beside_its_record_and_never_resumes_the_response_itself() {
    let cfg = Config::parse(
        br#"{"redis":{"batch":{"enabled":false},"cluster":"webdis"},
        "limits":[{"name":"slots","concurrency":{"max":2,"leaseMs":3000}}],
        "idempotency":[{"name":"pay","match":{"pathPrefix":"/pay"}}]}"#,
    )
    .unwrap();
    let mut f = Flow::new(Rc::new(cfg), test_breaker());
    let mut h = FakeHost::post("/pay", b"k1");
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    h.request_body = b"{}".to_vec();
    assert_eq!(f.on_request_body(&mut h, 2, true), Action::Pause);
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    assert_eq!(h.resumed, 1);
    h.respond(&[(":status", "200"), ("content-length", "0")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    // The end: the record holds it for COMPLETED; the release leaves too.
    assert_eq!(f.on_response_body(&mut h, 0, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 3);
    assert!(h.dispatched.iter().any(|d| d.contains(&CC_RELEASE.sha1)));
    // Tokens are dispatch positions from 1: the decision was 1.
    let release = 2 + h.dispatched[1..]
        .iter()
        .position(|d| d.contains(&CC_RELEASE.sha1))
        .unwrap() as u32;
    // The release answers first: the record still holds the piece.
    f.on_callout_reply(&mut h, release, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 0);
    let record = if release == 2 { 3 } else { 2 };
    f.on_callout_reply(&mut h, record, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1);
}

#[test]
fn a_release_due_later_waits_for_its_tick_and_a_refused_one_goes_again_after_a_pause() {
    let mut r = Deferred::default();
    let mut h = FakeHost::get("/");
    r.add(
        RELEASE,
        "{a}",
        args(&["{a}k"], "s1"),
        Duration::from_millis(150),
    );
    r.flush(&mut h, &target());
    assert!(h.dispatched.is_empty() && r.pending());
    h.clock_ms = 150;
    r.flush(&mut h, &target());
    assert_eq!(h.dispatched.len(), 1);
    assert!(!r.pending());
    // Webdis' own 503: it never ran, so it is safe to send again.
    r.on_reply(&mut h, &target(), 1, &refused());
    assert!(r.pending());
    h.clock_ms = 174;
    r.flush(&mut h, &target());
    assert_eq!(
        h.dispatched.len(),
        1,
        "after the decision's first pause (25 ms)"
    );
    h.clock_ms = 175;
    r.flush(&mut h, &target());
    assert_eq!(h.dispatched.len(), 2);
    assert_eq!(h.dispatched[1], h.dispatched[0]);
    // Refused every time: four sends in all, then left to the lease.
    for (token, at) in [(2, 225), (3, 325)] {
        r.on_reply(&mut h, &target(), token, &refused());
        h.clock_ms = at;
        r.flush(&mut h, &target());
    }
    assert_eq!(h.dispatched.len(), 4);
    r.on_reply(&mut h, &target(), 4, &refused());
    assert!(!r.pending());
}

#[test]
fn a_decision_that_never_left_took_nothing_to_give_back() {
    let mut f = cc_flow("allow");
    let mut h = FakeHost::get("/api/x");
    h.dispatch_fails = true;
    assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
    f.on_stream_end(&mut h);
    assert!(h.slot_releases.is_empty() && h.detached.is_empty());
}

#[test]
fn a_client_gone_before_the_decision_answered_gives_back_the_slot_it_may_get() {
    let (mut f, mut h) = cc_started("deny");
    f.on_stream_end(&mut h);
    assert_eq!(h.slot_releases.len(), 1);
    // The late answer finds nothing to resume and nothing to renew.
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    assert!(h.wakes.is_empty());
}

#[test]
fn a_release_the_host_refuses_is_left_to_the_lease() {
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    h.no_worker = true;
    h.detached_fails = true;
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty());
    assert_eq!(count(&h, Counter::SlotsReleased), 0);
}

fn target() -> RedisTarget {
    Config::parse(br#"{"redis":{"cluster":"webdis"}}"#)
        .unwrap()
        .redis
}

fn args(keys: &[&str], slot: &str) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let k = keys.iter().map(|k| k.as_bytes().to_vec()).collect();
    let a = keys
        .iter()
        .flat_map(|_| [slot.as_bytes().to_vec(), b"1".to_vec()])
        .collect();
    (k, a)
}

#[test]
fn the_worker_sends_the_releases_of_one_tag_as_one_call() {
    let mut r = Deferred::default();
    let mut h = FakeHost::get("/");
    r.add(
        RELEASE,
        "{a}",
        args(&["{a}k1", "{a}k2"], "s1"),
        Duration::ZERO,
    );
    r.add(RELEASE, "{a}", args(&["{a}k1"], "s2"), Duration::ZERO);
    r.add(RELEASE, "{b}", args(&["{b}k"], "s3"), Duration::ZERO);
    assert!(r.pending());
    r.flush(&mut h, &target());
    assert!(!r.pending());
    assert_eq!(h.dispatched.len(), 2, "one call per tag");
    let a = h
        .dispatched
        .iter()
        .find(|d| d.contains("s1"))
        .unwrap()
        .clone();
    assert!(
        a.starts_with(&format!("EVALSHA/{}/3/", CC_RELEASE.sha1)),
        "{a}"
    );
    assert!(a.ends_with("/s1/1/s1/1/s2/1.raw"), "{a}");
    // Nothing left to send on the next tick.
    r.flush(&mut h, &target());
    assert_eq!(h.dispatched.len(), 2);
}

#[test]
fn a_release_call_carries_at_most_max_release_keys() {
    let mut r = Deferred::default();
    let mut h = FakeHost::get("/");
    for i in 0..MAX_KEYS + 1 {
        r.add(
            RELEASE,
            "{a}",
            args(&["{a}k"], &format!("{i:x}")),
            Duration::ZERO,
        );
    }
    r.flush(&mut h, &target());
    assert_eq!(h.dispatched.len(), 2);
    assert!(h.dispatched[0].starts_with(&format!("EVALSHA/{}/{MAX_KEYS}/", CC_RELEASE.sha1)));
    assert!(h.dispatched[1].starts_with(&format!("EVALSHA/{}/1/", CC_RELEASE.sha1)));
    // The last slot alone, with its cost: keys and values split alike.
    assert!(h.dispatched[1].ends_with(&format!("/{:x}/1.raw", MAX_KEYS)));
}

#[test]
fn a_release_after_redis_lost_its_scripts_goes_again_as_eval_and_a_failure_is_let_go() {
    let mut r = Deferred::default();
    let mut h = FakeHost::get("/");
    r.add(RELEASE, "{a}", args(&["{a}k"], "s1"), Duration::ZERO);
    r.flush(&mut h, &target());
    assert!(r.owns(1) && !r.owns(2));
    r.on_reply(
        &mut h,
        &target(),
        1,
        &ok(b"-NOSCRIPT No matching script.\r\n"),
    );
    assert_eq!(h.dispatched.len(), 2);
    assert!(h.dispatched[1].starts_with("EVAL/"));
    assert!(r.owns(2) && !r.owns(1));
    r.on_reply(&mut h, &target(), 2, &no_answer());
    assert!(!r.owns(2));
    assert_eq!(h.dispatched.len(), 2, "the lease ends what a failure left");
}

#[test]
fn the_responses_last_piece_waits_for_the_release_so_a_next_request_finds_the_slot_free() {
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    h.respond(&[(":status", "200"), ("content-length", "4")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    assert_eq!(h.dispatched.len(), 1, "nothing sent before the end");
    // All of the content-length is here: the client would stop reading.
    assert_eq!(f.on_response_body(&mut h, 4, false), Action::Pause);
    assert_eq!(h.dispatched.len(), 2);
    // Envoy hands over the rest (the end of stream) while it is held: it
    // waits too.
    assert_eq!(f.on_response_body(&mut h, 4, true), Action::Pause);
    let release = &h.dispatched[1];
    assert!(
        release.starts_with(&format!("EVALSHA/{}/1/", CC_RELEASE.sha1)),
        "{release}"
    );
    assert!(release.ends_with(&format!("/{SLOT}/1.raw")), "{release}");
    assert_eq!(h.response_resumed, 0);
    // Redis lost its scripts: once more as EVAL, the piece still waiting.
    f.on_callout_reply(&mut h, 2, ok(b"-NOSCRIPT No matching script.\r\n"));
    assert!(h.dispatched[2].starts_with("EVAL/"));
    assert_eq!(h.response_resumed, 0);
    f.on_callout_reply(&mut h, 3, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1);
    assert_eq!(count(&h, Counter::SlotsReleased), 1);
    // Given back already: the stream's end adds nothing, and no renewal
    // follows.
    f.on_stream_end(&mut h);
    assert!(h.slot_releases.is_empty() && h.detached.is_empty());
    h.clock_ms = 5000;
    f.on_wake(&mut h);
    assert_eq!(h.dispatched.len(), 3);
    assert_eq!(count(&h, Counter::SlotsReleased), 1);
}

#[test]
fn a_response_ending_with_its_headers_releases_there() {
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    h.respond(&[(":status", "204")]);
    assert_eq!(f.on_response_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 2);
    f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1);
}

#[test]
fn a_release_that_fails_at_the_responses_end_lets_the_piece_go_and_the_worker_tries_again() {
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    h.respond(&[(":status", "200")]);
    f.on_response_headers(&mut h, false);
    assert_eq!(f.on_response_body(&mut h, 0, true), Action::Pause);
    f.on_callout_reply(&mut h, 2, no_answer());
    assert_eq!(h.response_resumed, 1);
    assert_eq!(h.slot_releases.len(), 1);
    assert_eq!(h.slot_releases[0].2, [SLOT, "1"]);
    f.on_stream_end(&mut h);
    assert_eq!(h.slot_releases.len(), 1, "once");
    assert_eq!(count(&h, Counter::SlotsReleased), 1);
}

#[test]
fn a_client_gone_while_the_release_is_out_has_the_worker_release_again() {
    let (mut f, mut h) = cc_started("allow");
    f.on_callout_reply(&mut h, 1, ok(CC_ADMIT));
    h.respond(&[(":status", "200")]);
    f.on_response_headers(&mut h, false);
    f.on_response_body(&mut h, 0, true);
    // Envoy cancels a gone stream's calls: the release may never land.
    f.on_stream_end(&mut h);
    assert_eq!(h.slot_releases.len(), 1);
    f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 0, "nothing left to resume");
}
