//! The request path where Envoy is less kind than a plain fake: retries
//! after refusals on the host's timer, compare-and-swap races lost between
//! read and write, calls the root cannot take, response headers repeated
//! or not text.

use super::*;

/// A rate-limited GET on a host that can pause (as Envoy's root tick can),
/// whose first call is in flight; the Redis timeout is 300 ms.
fn pausable() -> (Flow, FakeHost) {
    let cfg = Config::parse(
        br#"{"redis":{"batch":{"enabled":false},"cluster":"webdis","timeoutMs":300},"failureMode":"deny","limits":[
        {"name":"a","match":{"pathPrefix":"/api"},"tokenBucket":{"capacity":2,"refill":1,"periodMs":1000}}]}"#,
    )
    .unwrap();
    let mut f = Flow::new(Rc::new(cfg), test_breaker());
    let mut h = FakeHost::get("/api/x");
    h.can_schedule = true;
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    (f, h)
}

#[test]
fn retries_run_out_after_the_last_pause_and_the_failure_mode_answers() {
    let (mut f, mut h) = pausable();
    for pause in 1..=3 {
        f.on_callout_reply(&mut h, pause, refused());
        assert_eq!(h.wakes.len(), pause as usize);
        assert_eq!(h.dispatched.len(), pause as usize, "sent only when due");
        h.clock_ms += 25;
        f.on_wake(&mut h);
        assert_eq!(h.dispatched.len(), pause as usize + 1);
    }
    // The fourth refusal: the pauses are spent and the single immediate
    // retry was taken by the first paused one, so the request is decided.
    f.on_callout_reply(&mut h, 4, refused());
    assert_eq!(h.dispatched.len(), 4, "1 + MAX_PAUSES calls at most");
    assert!(h.dispatched.iter().all(|d| *d == h.dispatched[0]));
    assert_eq!(count(&h, Counter::RedisRetries), 3);
    assert_eq!(count(&h, Counter::RedisError(ErrorKind::Http)), 1);
    assert_eq!(count(&h, Counter::FailureDenied), 1);
    assert_eq!(h.sent.iter().map(|r| r.status).collect::<Vec<_>>(), [503]);
    assert_eq!(h.resumed, 0);
}

#[test]
fn no_pause_is_taken_when_the_deadline_is_nearer_than_the_pause() {
    let (mut f, mut h) = pausable();
    // 280 of 300 ms spent: 20 ms left, less than the 25 ms pause.
    h.clock_ms = 280;
    f.on_callout_reply(&mut h, 1, refused());
    assert!(h.wakes.is_empty(), "the host was not asked");
    assert_eq!(h.dispatched.len(), 2, "one immediate retry instead");
    assert_eq!(
        h.timeouts,
        [Duration::from_millis(300), Duration::from_millis(20)]
    );
    f.on_callout_reply(&mut h, 2, refused());
    assert_eq!(h.dispatched.len(), 2);
    assert_eq!(count(&h, Counter::RedisRetries), 1);
    assert_eq!(h.sent.last().map(|r| r.status), Some(503));
}

#[test]
fn the_attempt_after_a_pause_gets_what_is_left_of_the_timeout() {
    let (mut f, mut h) = pausable();
    h.clock_ms = 100;
    f.on_callout_reply(&mut h, 1, refused());
    h.clock_ms = 126;
    f.on_wake(&mut h);
    assert_eq!(
        h.timeouts,
        [Duration::from_millis(300), Duration::from_millis(174)]
    );
    f.on_callout_reply(&mut h, 2, ok(ADMIT));
    assert_eq!((h.resumed, h.sent.len()), (1, 0));
}

#[test]
fn a_pause_that_outlives_the_deadline_is_a_timeout_without_another_call() {
    let (mut f, mut h) = pausable();
    f.on_callout_reply(&mut h, 1, refused());
    // The host's timer fired late: nothing is left of the 300 ms.
    h.clock_ms = 300;
    f.on_wake(&mut h);
    assert_eq!(h.dispatched.len(), 1);
    assert_eq!(count(&h, Counter::RedisError(ErrorKind::Timeout)), 1);
    assert_eq!(h.sent.last().map(|r| r.status), Some(503));
}

/// Envoy's own 503 for a callout, with its local reply's text.
fn envoy_503(text: &str) -> CalloutReply {
    CalloutReply {
        status: Some(503),
        from_webdis: false,
        body: text.as_bytes().to_vec(),
    }
}

#[test]
fn a_call_envoy_never_sent_is_sent_again_and_a_reset_after_sending_is_not() {
    let before = "upstream connect error or disconnect/reset before headers. reset reason: ";
    let never_sent = [
        format!("{before}remote connection failure, transport failure reason: delayed connect error: Connection refused"),
        format!("{before}connection timeout"),
        format!("{before}overflow"),
        "no healthy upstream".to_string(),
    ];
    for text in &never_sent {
        let (mut f, mut h) = pausable();
        f.on_callout_reply(&mut h, 1, envoy_503(text));
        assert_eq!(h.wakes.len(), 1, "paused to send again: {text}");
        h.clock_ms += 25;
        f.on_wake(&mut h);
        assert_eq!(h.dispatched.len(), 2, "{text}");
        f.on_callout_reply(&mut h, 2, ok(ADMIT));
        assert_eq!((h.resumed, h.sent.len()), (1, 0), "{text}");
        assert_eq!(count(&h, Counter::RedisRetries), 1);
    }
    let maybe_ran = [
        format!("{before}connection termination"),
        format!("{before}remote reset"),
        format!("{before}local reset"),
        // Not Envoy's wording: the filter does not guess.
        "remote connection failure".to_string(),
        format!("{before}remote connection failures"),
    ];
    for text in &maybe_ran {
        let (mut f, mut h) = pausable();
        f.on_callout_reply(&mut h, 1, envoy_503(text));
        assert!(h.wakes.is_empty(), "not sent again: {text}");
        assert_eq!(h.dispatched.len(), 1, "{text}");
        assert_eq!(h.sent.last().map(|r| r.status), Some(503), "deny: {text}");
        assert_eq!(count(&h, Counter::RedisRetries), 0);
    }
}

fn local_config() -> Rc<Config> {
    Rc::new(
        Config::parse(
            br#"{"redis":{"batch":{"enabled":false},"cluster":"w"},"limits":[{"name":"a","failureMode":"local","localFraction":0.5,
            "descriptor":["method"],"tokenBucket":{"capacity":4,"refill":1,"periodMs":60000}}]}"#,
        )
        .unwrap(),
    )
}

#[test]
fn a_local_budget_write_that_loses_a_race_reads_again_and_spends_once() {
    let cfg = local_config();
    let mut h = FakeHost::get("/");
    h.dispatch_fails = true;
    h.lose_races = 1;
    let mut f = Flow::new(cfg.clone(), test_breaker());
    assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
    assert_eq!(h.lose_races, 0, "the race was lost once");
    assert_eq!(count(&h, Counter::LocalAllowed), 1);
    // One token of the two was spent, not two: the next takes the last.
    let mut g = Flow::new(cfg.clone(), test_breaker());
    assert_eq!(g.on_request_headers(&mut h, true), Action::Continue);
    let mut k = Flow::new(cfg, test_breaker());
    assert_eq!(k.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.sent.last().map(|r| r.status), Some(429));
}

#[test]
fn a_local_budget_that_stays_contended_admits_rather_than_spin() {
    let mut h = FakeHost::get("/");
    h.dispatch_fails = true;
    h.lose_races = 100;
    let mut f = Flow::new(local_config(), test_breaker());
    assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
    assert_eq!(h.lose_races, 100 - 8, "eight attempts, then it gives up");
    assert_eq!(count(&h, Counter::FailureLocal), 1);
    assert_eq!(count(&h, Counter::LocalAllowed), 0);
    assert_eq!(count(&h, Counter::LocalRejected), 0);
    assert!(h.sent.is_empty());
}

/// A leased limit whose first request fetched 3 tokens at t=0.
fn leased_with_tokens() -> (Rc<Config>, FakeHost) {
    let cfg = Rc::new(
        Config::parse(
            br#"{"redis":{"batch":{"enabled":false},"cluster":"w"},"failureMode":"deny","limits":[
            {"name":"a","tokenBucket":{"capacity":100,"refill":1,"periodMs":1000},
             "lease":{"tokens":3,"ttlMs":500}}]}"#,
        )
        .unwrap(),
    );
    let mut h = FakeHost::get("/x");
    let mut first = Flow::new(cfg.clone(), test_breaker());
    first.on_request_headers(&mut h, true);
    first.on_callout_reply(
        &mut h,
        1,
        ok(b"*9\r\n:1\r\n:1\r\n:96\r\n:0\r\n:4000\r\n:3\r\n:1000\r\n:96000\r\n:0\r\n"),
    );
    assert_eq!(count(&h, Counter::LeaseFetched), 1);
    (cfg, h)
}

#[test]
fn a_lease_spend_that_stays_contended_leaves_the_request_to_redis() {
    let (cfg, mut h) = leased_with_tokens();
    h.lose_races = 100;
    let mut f = Flow::new(cfg, test_breaker());
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 2);
    assert!(
        h.dispatched[1].contains(&RATELIMIT.sha1),
        "strict: neither spent nor fetched"
    );
    assert_eq!(count(&h, Counter::LeaseSpent), 0);
}

#[test]
fn a_prefetch_the_root_cannot_take_frees_its_claim() {
    let (cfg, mut h) = leased_with_tokens();
    h.prefetch_fails = true;
    // The second spend runs the batch low: its background fetch is refused.
    for _ in 0..2 {
        let mut f = Flow::new(cfg.clone(), test_breaker());
        assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
    }
    assert!(h.prefetched.is_empty());
    assert_eq!(count(&h, Counter::LeaseSpent), 2);
    // The claim is free: the last token is spent, then the next request
    // fetches itself (it would go strict while a fetch were claimed).
    let mut last = Flow::new(cfg.clone(), test_breaker());
    assert_eq!(last.on_request_headers(&mut h, true), Action::Continue);
    let mut next = Flow::new(cfg, test_breaker());
    assert_eq!(next.on_request_headers(&mut h, true), Action::Pause);
    assert!(h.dispatched.last().unwrap().contains(&LEASE.sha1));
}

#[test]
fn a_release_the_root_cannot_send_is_left_to_the_lock_ttl() {
    // The decision's call left and never came back: the script may hold
    // the lock, and the root's release of it cannot be sent.
    let (mut f, mut h) = keyed_in_flight("allow");
    h.detached_fails = true;
    f.on_callout_reply(&mut h, 1, no_answer());
    assert!(h.detached.is_empty());
    assert_eq!(count(&h, Counter::IdemReleased), 1, "counted as tried");
    assert_eq!(h.dispatched.len(), 1, "not sent from the stream instead");
}

/// A keyed POST whose rule stores `link` and `content-type`, admitted.
fn holding_links() -> (Flow, FakeHost, Vec<u8>) {
    let json = IDEM_CONFIG.replace("FAILURE", "allow").replace(
        r#""required":true"#,
        r#""required":true,"storeHeaders":["link","content-type"]"#,
    );
    let cfg = Rc::new(Config::parse(json.as_bytes()).unwrap());
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::post("/pay", b"abc-123");
    let key = admitted(&mut f, &mut h, &cfg);
    (f, h, key)
}

#[test]
fn every_value_of_a_repeated_response_header_is_stored_in_order() {
    let (mut f, mut h, key) = holding_links();
    h.respond(&[
        (":status", "201"),
        ("link", "</a>; rel=a"),
        ("content-type", "text/plain"),
        ("link", "</b>; rel=b"),
    ]);
    assert_eq!(f.on_response_headers(&mut h, true), Action::Pause);
    assert_eq!(
        h.dispatched.last().unwrap(),
        &complete_call(
            &key,
            "201",
            &[
                ("link", b"</a>; rel=a"),
                ("link", b"</b>; rel=b"),
                ("content-type", b"text/plain"),
            ],
            b"",
        )
    );
}

#[test]
fn a_stored_header_value_that_is_not_text_frees_the_key_instead() {
    let (mut f, mut h, key) = holding_links();
    h.response = vec![
        (":status".to_string(), b"200".to_vec()),
        ("link".to_string(), b"</\xff>".to_vec()),
    ];
    assert_eq!(f.on_response_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched.last().unwrap(), &release_call(&key));
    assert_eq!(count(&h, Counter::IdemReleased), 1);
    assert_eq!(count(&h, Counter::IdemStored), 0);
    release_lands(&mut f, &mut h, &key);
}
