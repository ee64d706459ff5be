use super::*;

#[test]
fn unmatched_requests_pass_without_a_redis_call() {
    let mut f = flow("allow");
    let mut h = FakeHost::get("/public");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
    assert!(h.dispatched.is_empty());
}

#[test]
fn admitted_request_resumes_and_gets_headers() {
    let mut f = flow("allow");
    let mut h = FakeHost::get("/api/x");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 1);
    assert!(h.dispatched[0].starts_with(&format!("EVALSHA/{}/1/rg%3Arl%3A%7B", RATELIMIT.sha1)));
    f.on_callout_reply(&mut h, 1, ok(ADMIT));
    assert_eq!(h.resumed, 1);
    assert!(h.sent.is_empty());
    f.on_response_headers(&mut h, false);
    assert!(has_header(&h.added, "x-ratelimit-remaining", "1"));
    assert!(h.counters.contains(&Counter::Allowed(0)));
}

#[test]
fn rejected_request_gets_429_and_is_not_resumed() {
    let (mut f, mut h) = started("allow");
    f.on_callout_reply(&mut h, 1, ok(REJECT));
    assert_eq!(h.resumed, 0);
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 429);
    assert!(has_header(&h.sent[0].headers, "retry-after", "1"));
    assert!(h.counters.contains(&Counter::Rejected(0)));
}

#[test]
fn noscript_falls_back_to_eval_once() {
    let (mut f, mut h) = started("deny");
    f.on_callout_reply(&mut h, 1, ok(b"-NOSCRIPT No matching script.\r\n"));
    assert_eq!(h.dispatched.len(), 2);
    assert!(h.dispatched[1].starts_with("EVAL/"));
    assert!(h.dispatched[1].contains("%2D%2D%5B%5B%20redis%2Dguard"));
    // A second NOSCRIPT (impossible after EVAL, but never loop) is a failure.
    f.on_callout_reply(&mut h, 2, ok(b"-NOSCRIPT again\r\n"));
    assert_eq!(h.dispatched.len(), 2);
    assert_eq!(h.sent[0].status, 503);
}

#[test]
fn stale_tokens_are_ignored() {
    let (mut f, mut h) = started("allow");
    f.on_callout_reply(&mut h, 99, ok(ADMIT));
    assert_eq!(h.resumed, 0);
    f.on_callout_reply(&mut h, 1, ok(ADMIT));
    assert_eq!(h.resumed, 1);
    f.on_callout_reply(&mut h, 1, ok(ADMIT));
    assert_eq!(h.resumed, 1, "a reply after the decision changes nothing");
}

#[test]
fn failures_follow_the_failure_mode() {
    let bad_replies = [
        no_answer(),
        CalloutReply {
            status: Some(502),
            from_webdis: false,
            body: vec![],
        },
        // Envoy's own 503 (reset after the command may have run): no retry.
        CalloutReply {
            status: Some(503),
            from_webdis: false,
            body: vec![],
        },
        CalloutReply {
            status: Some(403),
            from_webdis: true,
            body: b"forbidden".to_vec(),
        },
        ok(b"-BUSY Redis is busy running a script\r\n"),
        ok(b"{\"EVALSHA\":[1]}"),
        ok(b"*1\r\n$1\r\n1\r\n"),
        ok(b"*5\r\n$1\r\n1\r\n"),
    ];
    for reply in bad_replies {
        let (mut f, mut h) = started("allow");
        f.on_callout_reply(&mut h, 1, reply.clone());
        assert_eq!((h.resumed, h.sent.len()), (1, 0), "allow on {reply:?}");
        assert!(h.counters.contains(&Counter::FailureAllowed));

        let (mut f, mut h) = started("deny");
        f.on_callout_reply(&mut h, 1, reply.clone());
        assert_eq!(h.resumed, 0, "deny on {reply:?}");
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 503);
    }
}

#[test]
fn trailers_end_a_keyed_request_body() {
    let cfg = Config::parse(
        br#"{"redis":{"batch":{"enabled":false},"cluster":"w"},"idempotency":[{"name":"pay","match":{"pathPrefix":"/pay"}}]}"#,
    )
    .unwrap();
    let mut f = Flow::new(Rc::new(cfg), test_breaker());
    let mut h = FakeHost::post("/pay", b"k1");
    h.request_body = b"body".to_vec();
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert_eq!(f.on_request_body(&mut h, 4, false), Action::Pause);
    assert!(h.dispatched.is_empty());
    assert_eq!(f.on_request_trailers(&mut h), Action::Pause);
    assert_eq!(h.dispatched.len(), 1);
    assert!(h.dispatched[0].contains(&crate::idempotency::fingerprint("POST", b"/pay", b"body")));
}

#[test]
fn an_open_breaker_sends_requests_to_the_failure_mode_without_a_call() {
    let cfg = Config::parse(
        br#"{"redis":{"batch":{"enabled":false},"cluster":"w"},"failureMode":"deny","limits":[
            {"name":"a","tokenBucket":{"capacity":5,"refill":1,"periodMs":1000}}]}"#,
    )
    .unwrap();
    let cfg = Rc::new(cfg);
    let breaker = Rc::new(Breakers::new(2, Duration::from_millis(100)));
    let mut h = FakeHost::get("/");
    for token in 1..=2 {
        let mut f = Flow::new(cfg.clone(), breaker.clone());
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        f.on_callout_reply(&mut h, token, no_answer());
    }
    assert_eq!(count(&h, Counter::CircuitOpened), 1);
    assert_eq!(
        count(&h, Counter::CircuitTripped),
        1,
        "the gauge rises once"
    );
    assert_eq!(count(&h, Counter::RedisError(ErrorKind::Timeout)), 2);
    let calls = h.dispatched.len();
    let mut f = Flow::new(cfg.clone(), breaker.clone());
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched.len(), calls, "no call while open");
    assert_eq!(h.sent.last().map(|r| r.status), Some(503));
    assert!(h.counters.contains(&Counter::CircuitShortCircuited));
    // After the cool-down one request probes; its success closes the breaker.
    h.clock_ms = 100;
    let mut probe = Flow::new(cfg.clone(), breaker.clone());
    assert_eq!(probe.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched.len(), calls + 1);
    let mut other = Flow::new(cfg.clone(), breaker.clone());
    other.on_request_headers(&mut h, true);
    assert_eq!(h.dispatched.len(), calls + 1, "one probe at a time");
    probe.on_callout_reply(&mut h, (calls + 1) as u32, ok(ADMIT));
    assert_eq!(count(&h, Counter::CircuitClosed), 1, "the gauge falls once");
    let mut after = Flow::new(cfg, breaker);
    after.on_request_headers(&mut h, true);
    assert_eq!(h.dispatched.len(), calls + 2, "closed again");
    after.on_callout_reply(&mut h, (calls + 2) as u32, ok(ADMIT));
    assert_eq!(count(&h, Counter::CircuitClosed), 1, "closed stays closed");
    // The short-circuited requests were no Redis errors.
    assert_eq!(count(&h, Counter::RedisError(ErrorKind::Timeout)), 2);
}

#[test]
fn an_open_breaker_short_circuits_only_its_own_slot_groups_tenants() {
    let cfg = Rc::new(
        Config::parse(
            br#"{"redis":{"batch":{"enabled":false},"cluster":"w"},"failureMode":"deny",
                "hashTag":[{"header":"x-tenant"}],"limits":[
                {"name":"a","descriptor":[{"header":"x-tenant"}],"tokenBucket":{"capacity":5,"refill":1,"periodMs":1000}}]}"#,
        )
        .unwrap(),
    );
    // Two tenants whose hash tags fall in different slot groups.
    let group = |t: &str| Breakers::group(&crate::keys::hash_tag_of([t]));
    let (a, b) = (
        "t1",
        ["t2", "t3", "t4", "t5"]
            .into_iter()
            .find(|t| group(t) != group("t1"))
            .unwrap(),
    );
    let breakers = Rc::new(Breakers::new(2, Duration::from_millis(100)));
    let mut h = FakeHost::get("/").with("x-tenant", a.as_bytes());
    trip_breaker(&cfg, &breakers, &mut h, 2);
    // The other tenant's slots are another master's, maybe: it still calls.
    let mut h = FakeHost::get("/").with("x-tenant", b.as_bytes());
    let mut f = Flow::new(cfg, breakers.clone());
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 1, "b's group is closed");
    assert_eq!(breakers.tripped(), 1);
}

/// One token bucket of 5 on every path.
fn bucket_of_five(failure: &str) -> Rc<Config> {
    let json = format!(
        r#"{{"redis":{{"batch":{{"enabled":false}},"cluster":"w"}},"failureMode":"{failure}","limits":[
        {{"name":"a","tokenBucket":{{"capacity":5,"refill":1,"periodMs":1000}}}}]}}"#
    );
    Rc::new(Config::parse(json.as_bytes()).unwrap())
}

#[test]
fn a_probe_whose_client_left_lets_the_next_request_probe() {
    let cfg = bucket_of_five("allow");
    let breaker = Rc::new(Breakers::new(1, Duration::from_millis(100)));
    let mut h = FakeHost::get("/");
    let mut f = Flow::new(cfg.clone(), breaker.clone());
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, no_answer());
    h.clock_ms = 100;
    let mut probe = Flow::new(cfg.clone(), breaker.clone());
    assert_eq!(probe.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 2, "the probe calls");
    probe.on_stream_end(&mut h);
    let mut next = Flow::new(cfg, breaker);
    assert_eq!(next.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 3, "the next request probes");
}

#[test]
fn each_failure_is_counted_by_its_kind() {
    let cfg = bucket_of_five("allow");
    let reply = |status: Option<u32>, body: &[u8]| CalloutReply {
        status,
        from_webdis: status.is_some(),
        body: body.to_vec(),
    };
    let cases = [
        (reply(None, b""), ErrorKind::Timeout),
        (reply(Some(500), b""), ErrorKind::Http),
        (
            CalloutReply {
                status: Some(504),
                from_webdis: false,
                body: b"upstream request timeout".to_vec(),
            },
            ErrorKind::Timeout,
        ),
        (
            reply(Some(200), b"-OOM command not allowed\r\n"),
            ErrorKind::Redis,
        ),
        (reply(Some(200), b"?garbage"), ErrorKind::Reply),
        (reply(Some(200), b":7\r\n"), ErrorKind::Reply),
    ];
    for (reply, kind) in cases {
        let mut h = FakeHost::get("/");
        let mut f = Flow::new(cfg.clone(), test_breaker());
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        f.on_callout_reply(&mut h, 1, reply);
        let kinds: Vec<Counter> = h
            .counters
            .iter()
            .copied()
            .filter(|c| matches!(c, Counter::RedisError(_)))
            .collect();
        assert_eq!(kinds, vec![Counter::RedisError(kind)]);
        assert_eq!(count(&h, Counter::FailureAllowed), 1);
    }
    let mut h = FakeHost::get("/");
    h.dispatch_fails = true;
    let mut f = Flow::new(cfg, test_breaker());
    assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
    assert_eq!(count(&h, Counter::RedisError(ErrorKind::Dispatch)), 1);
}

#[test]
fn local_mode_spends_a_per_envoy_budget_when_redis_fails() {
    let cfg = Config::parse(
        br#"{"redis":{"batch":{"enabled":false},"cluster":"w"},"limits":[{"name":"a","failureMode":"local","localFraction":0.5,
            "descriptor":["method"],"tokenBucket":{"capacity":4,"refill":1,"periodMs":60000}}]}"#,
    )
    .unwrap();
    let cfg = Rc::new(cfg);
    let mut h = FakeHost::get("/");
    h.dispatch_fails = true;
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let mut f = Flow::new(cfg.clone(), test_breaker());
        match f.on_request_headers(&mut h, true) {
            Action::Continue => statuses.push(200),
            Action::Pause => statuses.push(h.sent.last().map_or(0, |r| r.status)),
        }
    }
    assert_eq!(statuses, [200, 200, 429, 429], "half of capacity 4");
    assert_eq!(count(&h, Counter::LocalAllowed), 2);
    assert_eq!(count(&h, Counter::LocalRejected), 2);
    let reply = h.sent.last().unwrap();
    assert!(has_header(&reply.headers, "retry-after", "60"));
    assert_eq!(h.shared.len(), 1, "one budget per descriptor");
}

#[test]
fn limits_and_the_idempotency_record_share_one_hash_tag() {
    let cfg = Config::parse(
        br#"{"redis":{"batch":{"enabled":false},"cluster":"w"},"hashTag":[{"header":"x-tenant"}],
            "limits":[{"name":"a","descriptor":[{"header":"x-tenant"}],
                       "tokenBucket":{"capacity":5,"refill":1,"periodMs":1000}}],
            "idempotency":[{"name":"pay","match":{"pathPrefix":"/pay"},
                            "tenant":[{"header":"x-tenant"}]}]}"#,
    )
    .unwrap();
    let mut f = Flow::new(Rc::new(cfg), test_breaker());
    let mut h = FakeHost::post("/pay", b"k1").with("x-tenant", b"acme");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 1, "one round trip for both");
    let call = &h.dispatched[0];
    let tags: Vec<&str> = call
        .split("%7B")
        .skip(1)
        .map(|rest| &rest[..rest.find("%7D").unwrap()])
        .collect();
    assert_eq!(tags.len(), 2, "{call}");
    assert_eq!(tags[0], tags[1], "one slot in Redis Cluster");
}

#[test]
fn a_webdis_503_is_retried_after_a_pause_when_the_host_can_wait() {
    let mut f = flow("deny");
    let mut h = FakeHost::get("/api/x");
    h.can_schedule = true;
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, refused());
    assert_eq!(h.wakes, [RETRY_DELAY]);
    assert_eq!(
        h.dispatched.len(),
        1,
        "nothing sent before the pause is over"
    );
    f.on_wake(&mut h);
    assert_eq!(h.dispatched.len(), 2);
    assert_eq!(h.dispatched[0], h.dispatched[1]);
    f.on_callout_reply(&mut h, 2, ok(ADMIT));
    assert_eq!((h.resumed, h.sent.len()), (1, 0));
    f.on_wake(&mut h);
    assert_eq!(h.dispatched.len(), 2, "a stale timer changes nothing");
}

#[test]
fn a_webdis_503_is_retried_once_then_fails() {
    let (mut f, mut h) = started("deny");
    f.on_callout_reply(&mut h, 1, refused());
    assert_eq!(h.dispatched.len(), 2);
    assert_eq!(h.dispatched[0], h.dispatched[1], "the same command again");
    f.on_callout_reply(&mut h, 2, ok(ADMIT));
    assert_eq!((h.resumed, h.sent.len()), (1, 0));

    let (mut f, mut h) = started("deny");
    f.on_callout_reply(&mut h, 1, refused());
    f.on_callout_reply(&mut h, 2, refused());
    assert_eq!(h.dispatched.len(), 2, "one retry only");
    assert_eq!(h.sent[0].status, 503);
}

#[test]
fn a_rejection_is_answered_from_the_over_limit_cache_until_redis_said() {
    let (mut f, mut h) = started("deny");
    h.clock_ms = 10;
    f.on_callout_reply(&mut h, 1, ok(REJECT));
    assert_eq!(h.sent[0].status, 429);
    assert_eq!(h.shared.len(), 1, "one entry for the rejecting key");
    // Until sent + retry_ms - 1 (0 + 400 - 1: Redis' clock is whole ms),
    // every worker answers alone.
    for at in [10, 200, 398] {
        h.clock_ms = at;
        let mut g = flow("deny");
        assert_eq!(g.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.dispatched.len(), 1, "no call at {at} ms");
        let reply = h.sent.last().unwrap();
        assert_eq!(reply.status, 429);
        let retry_after = reply
            .headers
            .iter()
            .find(|(n, _)| n == "retry-after")
            .map(|(_, v)| v.as_str());
        assert_eq!(retry_after, Some("1"));
    }
    assert_eq!(count(&h, Counter::OverLimitCached), 3);
    assert_eq!(count(&h, Counter::Rejected(0)), 4);
    // From T on, Redis decides again.
    h.clock_ms = 399;
    let mut g = flow("deny");
    g.on_request_headers(&mut h, true);
    assert_eq!(h.dispatched.len(), 2);
}

#[test]
fn the_over_limit_cache_leaves_cheaper_keyed_and_shadow_requests_to_redis() {
    let cfg = Rc::new(
        Config::parse(
            br#"{"redis":{"batch":{"enabled":false},"cluster":"w"},"limits":[
            {"name":"a","tokenBucket":{"capacity":5,"refill":1,"periodMs":1000},
             "costHeader":{"name":"x-cost","max":5}},
            {"name":"s","shadow":true,"tokenBucket":{"capacity":1,"refill":1,"periodMs":1000}}],
            "idempotency":[{"name":"p","match":{"pathPrefix":"/"}}]}"#,
        )
        .unwrap(),
    );
    // Cost 3 rejected until 400 ms; the shadow limit would reject too.
    let two = b"*9\r\n:0\r\n:0\r\n:2\r\n:400\r\n:400\r\n:0\r\n:0\r\n:900\r\n:900\r\n";
    let mut h = FakeHost::get("/x");
    h.request.headers.insert("x-cost".into(), b"3".to_vec());
    let mut f = Flow::new(cfg.clone(), test_breaker());
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, ok(two));
    assert_eq!(h.sent[0].status, 429);
    assert_eq!(
        h.shared.len(),
        1,
        "the shadow limit's verdict is not cached"
    );
    let send = |h: &mut FakeHost, cost: &[u8]| {
        h.request.headers.insert("x-cost".into(), cost.to_vec());
        let mut g = Flow::new(cfg.clone(), test_breaker());
        g.on_request_headers(h, true);
    };
    send(&mut h, b"3");
    assert_eq!(h.dispatched.len(), 1, "cost 3: cached");
    send(&mut h, b"5");
    assert_eq!(h.dispatched.len(), 1, "cost 5: cached");
    send(&mut h, b"2");
    assert_eq!(h.dispatched.len(), 2, "cost 2 may fit: Redis decides");
    // A keyed POST may be owed a replay: Redis decides.
    let mut k = FakeHost::post("/x", b"key-1");
    k.shared = h.shared.clone();
    k.request.headers.insert("x-cost".into(), b"3".to_vec());
    let mut g = Flow::new(cfg, test_breaker());
    g.on_request_headers(&mut k, true);
    assert_eq!(k.dispatched.len(), 1);
}

/// One token bucket of 100, leased 3 tokens at a time for 500 ms.
fn leased_config(failure: &str) -> Rc<Config> {
    let json = format!(
        r#"{{"redis":{{"batch":{{"enabled":false}},"cluster":"w"}},"failureMode":"{failure}","limits":[
        {{"name":"a","tokenBucket":{{"capacity":100,"refill":1,"periodMs":1000}},
         "lease":{{"tokens":3,"ttlMs":500}}}}]}}"#
    );
    Rc::new(Config::parse(json.as_bytes()).unwrap())
}

#[test]
fn a_leased_limit_spends_its_grant_locally_and_fetches_one_at_a_time() {
    let cfg = leased_config("deny");
    let mut h = FakeHost::get("/x");
    let mut first = Flow::new(cfg.clone(), test_breaker());
    assert_eq!(first.on_request_headers(&mut h, true), Action::Pause);
    assert!(h.dispatched[0].starts_with("EVALSHA/"));
    assert!(h.dispatched[0].contains(&LEASE.sha1), "the lease script");
    // While it is out, another worker's request goes the strict way.
    let mut other = Flow::new(cfg.clone(), test_breaker());
    other.on_request_headers(&mut h, true);
    assert!(h.dispatched[1].contains(&RATELIMIT.sha1));
    // Admitted, 3 more tokens granted at t=0: good until 500 ms.
    first.on_callout_reply(
        &mut h,
        1,
        ok(b"*9\r\n:1\r\n:1\r\n:96\r\n:0\r\n:4000\r\n:3\r\n:1000\r\n:96000\r\n:0\r\n"),
    );
    assert_eq!(h.resumed, 1);
    assert_eq!(count(&h, Counter::LeaseFetched), 1);
    for _ in 0..3 {
        let mut f = Flow::new(cfg.clone(), test_breaker());
        assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
    }
    assert_eq!(h.dispatched.len(), 2, "three requests, no call");
    assert_eq!(count(&h, Counter::LeaseSpent), 3);
    assert_eq!(count(&h, Counter::Allowed(0)), 4);
    // The second spend ran the batch below its low-water mark (2 of 3):
    // it started a background fetch (cost 0) of the 2 that top it up.
    assert_eq!(h.prefetched.len(), 1);
    let (body, note) = h.prefetched[0].clone();
    assert!(body.starts_with(&format!("EVALSHA/{}/1/", LEASE.sha1)));
    assert!(body.ends_with("/100/1/1000/0/2.raw"), "{body}");
    // Nothing to spend while it is out: Redis decides, strictly.
    let mut next = Flow::new(cfg.clone(), test_breaker());
    assert_eq!(next.on_request_headers(&mut h, true), Action::Pause);
    assert!(h.dispatched[2].contains(&RATELIMIT.sha1));
    // The grant lands whatever became of the request that asked.
    on_prefetch_reply(
        &mut h,
        &note,
        ok(b"*9\r\n:1\r\n:1\r\n:92\r\n:0\r\n:8000\r\n:3\r\n:1000\r\n:96000\r\n:0\r\n"),
    );
    assert_eq!(count(&h, Counter::LeaseFetched), 2);
    let mut spend = Flow::new(cfg.clone(), test_breaker());
    assert_eq!(spend.on_request_headers(&mut h, true), Action::Continue);
    assert_eq!(h.dispatched.len(), 3);
    // A grant lapses with its lease (sent at 0, 500 ms): then this
    // request fetches.
    h.clock_ms = 500;
    let mut late = Flow::new(cfg.clone(), test_breaker());
    assert_eq!(late.on_request_headers(&mut h, true), Action::Pause);
    assert!(h.dispatched[3].contains(&LEASE.sha1));
    // A rejected fetch grants nothing and frees the claim.
    late.on_callout_reply(
        &mut h,
        4,
        ok(b"*9\r\n:0\r\n:0\r\n:0\r\n:700\r\n:700\r\n:0\r\n:0\r\n:0\r\n:0\r\n"),
    );
    assert_eq!(h.sent.last().map(|r| r.status), Some(429));
    h.clock_ms = 1_300;
    let mut after = Flow::new(cfg, test_breaker());
    assert_eq!(after.on_request_headers(&mut h, true), Action::Pause);
    assert!(
        h.dispatched[4].contains(&LEASE.sha1),
        "the claim was released"
    );
}

#[test]
fn leased_tokens_are_spent_even_when_redis_is_known_to_be_empty() {
    let cfg = leased_config("deny");
    let mut h = FakeHost::get("/x");
    let mut first = Flow::new(cfg.clone(), test_breaker());
    first.on_request_headers(&mut h, true);
    first.on_callout_reply(
        &mut h,
        1,
        ok(b"*9\r\n:1\r\n:1\r\n:0\r\n:0\r\n:4000\r\n:2\r\n:1000\r\n:96000\r\n:0\r\n"),
    );
    // Another worker's strict call learnt the bucket is empty for a while.
    let plan = Plan::build(&cfg, &RequestLine::read(&h), &h).unwrap();
    let key = plan.checks[0].key.clone();
    let slot = Slot::of(&key);
    h.shared.insert(
        slot.shared_key.clone(),
        (slot.entry(0, 1_000, 1, 0).encode(), 1),
    );
    let statuses: Vec<Action> = (0..3)
        .map(|_| Flow::new(cfg.clone(), test_breaker()).on_request_headers(&mut h, true))
        .collect();
    assert_eq!(
        statuses[..2],
        [Action::Continue, Action::Continue],
        "the 2 held tokens"
    );
    assert_eq!(statuses[2], Action::Pause, "then the cached 429");
    assert_eq!(h.sent.last().map(|r| r.status), Some(429));
    assert_eq!(h.dispatched.len(), 1);
}

#[test]
fn a_worker_that_found_a_key_missing_cannot_overwrite_one_created_meanwhile() {
    let mut h = FakeHost::get("/");
    // Worker A read "missing", then worker B created the key.
    let (stored, cas) = h.shared_get("k");
    assert_eq!((stored, cas), (None, None));
    assert!(h.shared_set("k", b"b", create_or_swap(None)));
    assert!(
        !h.shared_set("k", b"a", create_or_swap(cas)),
        "A must read again"
    );
    let (stored, cas) = h.shared_get("k");
    assert_eq!(stored.as_deref(), Some(&b"b"[..]));
    assert!(h.shared_set("k", b"a", create_or_swap(cas)));
}

#[test]
fn a_failed_background_fetch_frees_the_claim() {
    let note = Prefetch {
        limit_key: b"k".to_vec(),
        limit: 0,
        ttl: Duration::from_millis(500),
        sent_at: Duration::ZERO,
        batch: 4,
    };
    let slot = lease::Slot::of(b"k");
    let mut h = FakeHost::get("/");
    let claimed = match slot.step(None, 1, 0, 1_000, 4, true) {
        lease::Step::Fetch { bytes, .. } => bytes,
        other => panic!("{other:?}"),
    };
    h.shared.insert(slot.shared_key.clone(), (claimed, 1));
    let stored = || h.shared.get(&slot.shared_key).map(|(v, _)| v.clone());
    assert_eq!(
        slot.step(stored().as_deref(), 1, 10, 1_000, 4, true),
        lease::Step::Strict
    );
    on_prefetch_reply(&mut h, &note, no_answer());
    let stored = h.shared.get(&slot.shared_key).map(|(v, _)| v.clone());
    assert!(matches!(
        slot.step(stored.as_deref(), 1, 10, 1_000, 4, true),
        lease::Step::Fetch { .. }
    ));
    assert_eq!(count(&h, Counter::RedisError(ErrorKind::Timeout)), 1);
    assert_eq!(count(&h, Counter::LeaseFetched), 0);
}

#[test]
fn a_failed_lease_fetch_frees_the_claim() {
    let cfg = leased_config("allow");
    let mut h = FakeHost::get("/x");
    let mut f = Flow::new(cfg.clone(), test_breaker());
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, no_answer());
    let mut g = Flow::new(cfg, test_breaker());
    g.on_request_headers(&mut h, true);
    assert!(
        h.dispatched[1].contains(&LEASE.sha1),
        "not left to strict calls"
    );
}

#[test]
fn every_attempt_shares_the_one_timeout() {
    // timeoutMs is 50 (the default): EVALSHA at t=0 gets 50 ms; a
    // NOSCRIPT answer at t=30 leaves the EVAL 20 ms; at t=50 nothing is left.
    let (mut f, mut h) = started("deny");
    h.clock_ms = 30;
    f.on_callout_reply(&mut h, 1, ok(b"-NOSCRIPT No matching script.\r\n"));
    assert_eq!(
        h.timeouts,
        [Duration::from_millis(50), Duration::from_millis(20)]
    );

    let (mut f, mut h) = started("deny");
    h.clock_ms = 50;
    f.on_callout_reply(&mut h, 1, ok(b"-NOSCRIPT No matching script.\r\n"));
    assert_eq!(h.dispatched.len(), 1, "no attempt past the deadline");
    assert_eq!(h.sent[0].status, 503);
}

#[test]
fn dispatch_failure_decides_at_once() {
    let mut f = flow("allow");
    let mut h = FakeHost::get("/api/x");
    h.dispatch_fails = true;
    assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
    assert_eq!(h.resumed, 0, "nothing to resume: the request never paused");

    let mut f = flow("deny");
    let mut h = FakeHost::get("/api/x");
    h.dispatch_fails = true;
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.sent[0].status, 503);
}

#[test]
fn bad_cost_header_is_a_400_before_any_redis_call() {
    let cfg = Config::parse(
        br#"{"redis":{"batch":{"enabled":false},"cluster":"w"},"limits":[{"name":"a","costHeader":{"name":"x-cost","max":3},
            "tokenBucket":{"capacity":5,"refill":1,"periodMs":1000}}]}"#,
    )
    .unwrap();
    let mut f = Flow::new(Rc::new(cfg), test_breaker());
    let mut h = FakeHost::get("/");
    h.request.headers.insert("x-cost".into(), b"4".to_vec());
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.sent[0].status, 400);
    assert!(h.dispatched.is_empty());
}

/// A request nothing applies to (no limit, no idempotency key) leaves its
/// flow inert, which its context then lets go: the response's callbacks and
/// the stream's end, run on it anyway, ask the host nothing. A request a
/// limit or a key applies to is not inert.
#[test]
fn a_request_nothing_applies_to_leaves_an_inert_flow_whose_response_asks_nothing() {
    let mut f = flow("allow");
    let mut h = FakeHost::get("/public");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
    assert!(f.inert());
    h.respond(&[(":status", "200"), ("content-length", "2")]);
    h.response_chunks = vec![b"ok".to_vec()];
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    assert_eq!(f.on_response_body(&mut h, 2, true), Action::Continue);
    f.on_stream_end(&mut h);
    assert!(h.dispatched.is_empty() && h.sent.is_empty() && h.added.is_empty());
    assert!(h.counters.is_empty() && h.counted_n.is_empty() && h.filter_state.is_empty());
    assert!(h.slot_releases.is_empty() && h.batched.is_empty() && h.shared.is_empty());

    let mut f = flow("allow");
    let mut h = FakeHost::get("/api/x");
    f.on_request_headers(&mut h, true);
    assert!(!f.inert(), "a limit applies");

    let mut f = idem_flow("allow");
    let mut h = FakeHost::post("/pay", b"k1");
    f.on_request_headers(&mut h, false);
    assert!(!f.inert(), "a key applies");
}
