use super::*;

#[test]
fn keyed_post_without_body_dispatches_one_evalsha_with_record_key_and_fingerprint() {
    let cfg = idem_config("allow");
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::post("/pay/1?x=1", b"abc-123");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 1);

    let key = expected_record_key(&cfg, &h, b"abc-123");
    let key_text = String::from_utf8(key.clone()).unwrap();
    assert!(key_text.starts_with("rg:idem:{"), "{key_text}");
    assert!(key_text.ends_with("}:pay::7:abc-123"), "{key_text}");
    // The fingerprint covers the query string and the (empty) body.
    let fp = fingerprint("POST", b"/pay/1?x=1", b"");
    assert!(h.dispatched[0].contains(&enc(&key)));
    assert!(h.dispatched[0].contains(&fp));
    assert_eq!(h.dispatched[0], request_call(&key, "owner-1", &fp));
    assert_eq!(count(&h, Counter::RedisCalls), 1);
    assert!(h.sent.is_empty());
    assert_eq!(h.resumed, 0);
}

#[test]
fn keyed_post_with_body_is_decided_once_the_body_is_complete() {
    let cfg = idem_config("allow");
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::post("/pay/1", b"abc-123");
    h.request_body = b"{\"a\":12}".to_vec();
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert!(h.dispatched.is_empty(), "nothing before the body is read");
    assert_eq!(f.on_request_body(&mut h, 3, false), Action::Pause);
    assert_eq!(f.on_request_body(&mut h, 6, false), Action::Pause);
    assert!(h.dispatched.is_empty());
    assert_eq!(f.on_request_body(&mut h, 8, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 1);

    let key = expected_record_key(&cfg, &h, b"abc-123");
    let fp = fingerprint("POST", b"/pay/1", b"{\"a\":12}");
    assert_ne!(fp, fingerprint("POST", b"/pay/1", b""));
    assert_eq!(h.dispatched[0], request_call(&key, "owner-1", &fp));
    // Waiting for Redis: later body callbacks keep the request paused.
    assert_eq!(f.on_request_body(&mut h, 8, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 1);
    f.on_callout_reply(&mut h, 1, ok(IDEM_ADMIT));
    assert_eq!(h.resumed, 1);
}

#[test]
fn a_rule_without_body_fingerprint_decides_on_the_headers() {
    let json = IDEM_CONFIG.replace("FAILURE", "allow").replace(
        r#""name":"pay","#,
        r#""name":"pay","fingerprintBody":false,"#,
    );
    let cfg = Rc::new(Config::parse(json.as_bytes()).unwrap());
    assert!(!cfg.idempotency[0].fingerprint_body);
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::post("/pay/1", b"abc-123");
    h.request_body = b"{\"a\":12}".to_vec();
    // A body follows, yet the call goes out with the headers.
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert_eq!(h.dispatched.len(), 1);
    let key = expected_record_key(&cfg, &h, b"abc-123");
    let fp = fingerprint("POST", b"/pay/1", b"");
    assert_eq!(h.dispatched[0], request_call(&key, "owner-1", &fp));
    // The body waits while Redis decides, then flows untouched.
    assert_eq!(f.on_request_body(&mut h, 8, true), Action::Pause);
    f.on_callout_reply(&mut h, 1, ok(IDEM_ADMIT));
    assert_eq!(h.resumed, 1);
    assert_eq!(f.on_request_body(&mut h, 8, true), Action::Continue);
    assert_eq!(h.dispatched.len(), 1);
}

#[test]
fn keyed_body_over_max_request_body_is_413_without_a_redis_call() {
    // Growing past the cap while buffering.
    let mut f = idem_flow("allow");
    let mut h = FakeHost::post("/pay", b"k1");
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert_eq!(f.on_request_body(&mut h, 6, false), Action::Pause);
    assert!(h.sent.is_empty());
    assert_eq!(f.on_request_body(&mut h, 11, false), Action::Pause);
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 413);
    f.on_request_body(&mut h, 12, true);
    assert_eq!(h.sent.len(), 1, "one answer only");
    assert!(h.dispatched.is_empty());

    // Over the cap in the last chunk.
    let mut f = idem_flow("allow");
    let mut h = FakeHost::post("/pay", b"k1");
    f.on_request_headers(&mut h, false);
    assert_eq!(f.on_request_body(&mut h, 11, true), Action::Pause);
    assert_eq!(h.sent[0].status, 413);
    assert!(h.dispatched.is_empty());

    // Exactly the cap is fine.
    let mut f = idem_flow("allow");
    let mut h = FakeHost::post("/pay", b"k1");
    h.request_body = vec![b'x'; 10];
    f.on_request_headers(&mut h, false);
    assert_eq!(f.on_request_body(&mut h, 10, true), Action::Pause);
    assert!(h.sent.is_empty());
    assert_eq!(h.dispatched.len(), 1);
}

#[test]
fn content_length_over_max_request_body_is_413_at_headers() {
    let mut f = idem_flow("allow");
    let mut h = FakeHost::post("/pay", b"k1");
    h.request
        .headers
        .insert("content-length".into(), b"11".to_vec());
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 413);
    assert!(h.dispatched.is_empty());

    let mut f = idem_flow("allow");
    let mut h = FakeHost::post("/pay", b"k1");
    h.request
        .headers
        .insert("content-length".into(), b" 10 ".to_vec());
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert!(h.sent.is_empty(), "at the cap: read the body");
    assert!(h.dispatched.is_empty());
}

#[test]
fn missing_or_malformed_keys_are_400_and_get_is_not_keyed() {
    // Required and missing.
    let mut f = idem_flow("allow");
    let mut h = FakeHost::keyed("POST", "/pay", None);
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 400);
    assert!(String::from_utf8_lossy(&h.sent[0].body).contains("idempotency-key"));
    assert!(h.dispatched.is_empty());

    // Malformed.
    for bad in [&b"a b"[..], b"", b"\"open", &[b'k'; 256]] {
        let mut f = idem_flow("allow");
        let mut h = FakeHost::post("/pay", bad);
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
        assert_eq!(h.sent.len(), 1, "{:?}", String::from_utf8_lossy(bad));
        assert_eq!(h.sent[0].status, 400);
        assert!(h.dispatched.is_empty());
    }

    // GET is not keyed, with or without a key (and no limit applies).
    for key in [None, Some(&b"abc"[..])] {
        let mut f = idem_flow("allow");
        let mut h = FakeHost::keyed("GET", "/pay", key);
        assert_eq!(f.on_request_headers(&mut h, false), Action::Continue);
        assert!(h.sent.is_empty());
        assert!(h.dispatched.is_empty());
        assert_eq!(f.on_request_body(&mut h, 0, true), Action::Continue);
        h.respond(&[(":status", "200")]);
        assert_eq!(f.on_response_headers(&mut h, true), Action::Continue);
        f.on_stream_end(&mut h);
        assert!(h.dispatched.is_empty() && h.detached.is_empty());
    }

    // PATCH is keyed like POST; other paths are not.
    let mut f = idem_flow("allow");
    let mut h = FakeHost::keyed("PATCH", "/pay/9", Some(b"k"));
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 1);
    let mut f = idem_flow("allow");
    let mut h = FakeHost::keyed("POST", "/other", None);
    assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
    assert!(h.sent.is_empty() && h.dispatched.is_empty());
}

#[test]
fn busy_key_is_409_with_retry_after_and_not_resumed() {
    let (mut f, mut h) = keyed_in_flight("allow");
    f.on_callout_reply(&mut h, 1, ok(b"*2\r\n$1\r\n2\r\n$4\r\n2900\r\n"));
    assert_eq!(h.resumed, 0);
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 409);
    assert!(has_header(&h.sent[0].headers, "retry-after", "1"));
    assert!(h.counters.contains(&Counter::IdemConflicts));
    assert!(!h.counters.contains(&Counter::IdemAcquired));
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty(), "no lock of ours to release");
    assert_eq!(h.dispatched.len(), 1);
}

#[test]
fn fingerprint_mismatch_is_422_and_not_resumed() {
    let (mut f, mut h) = keyed_in_flight("allow");
    f.on_callout_reply(&mut h, 1, ok(b"*1\r\n$1\r\n4\r\n"));
    assert_eq!(h.resumed, 0);
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 422);
    assert!(h.counters.contains(&Counter::IdemMismatches));
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty());
}

#[test]
fn completed_key_replays_status_headers_and_exact_body() {
    let (mut f, mut h) = keyed_in_flight("allow");
    let stored = encode_headers(&[
        ("content-type".to_string(), b"application/json".to_vec()),
        ("location".to_string(), b"/pay/7".to_vec()),
    ]);
    let body: &[u8] = b"{\"id\":7}\r\n\x00\xff";
    f.on_callout_reply(&mut h, 1, ok(&resp(&[b"3", b"201", &stored, body])));
    assert_eq!(h.resumed, 0);
    assert_eq!(
        h.sent,
        [LocalReply {
            status: 201,
            headers: vec![
                ("content-type".to_string(), "application/json".to_string()),
                ("location".to_string(), "/pay/7".to_string()),
                ("idempotent-replayed".to_string(), "true".to_string()),
            ],
            body: body.to_vec(),
            details: "redis_guard_idempotent_replay",
            ..LocalReply::default()
        }]
    );
    assert!(h.counters.contains(&Counter::IdemReplayed));
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty());
}

#[test]
fn unreadable_stored_headers_are_503_never_a_rerun() {
    let (mut f, mut h) = keyed_in_flight("allow");
    f.on_callout_reply(&mut h, 1, ok(&resp(&[b"3", b"200", b"9:trunc", b"x"])));
    assert_eq!(h.resumed, 0, "failure mode allow does not apply");
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 503);
}

#[test]
fn admitted_response_is_stored_before_its_last_chunk_goes_out() {
    let (mut f, mut h, key) = holding("allow");
    h.respond(&[
        (":status", "200"),
        ("content-length", "12"),
        ("content-type", "text/plain"),
        ("x-trace", "t1"),
    ]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    assert_eq!(h.dispatched.len(), 1, "nothing until the body is complete");
    h.response_chunks = vec![b"hello ".to_vec(), b"wor".to_vec(), b"ld!".to_vec()];
    assert_eq!(f.on_response_body(&mut h, 6, false), Action::Continue);
    assert_eq!(f.on_response_body(&mut h, 3, false), Action::Continue);
    assert_eq!(h.dispatched.len(), 1);
    // The chunk completing content-length is held, even without end_of_stream.
    assert_eq!(f.on_response_body(&mut h, 3, false), Action::Pause);
    assert_eq!(h.dispatched.len(), 2);
    assert!(h.dispatched[1].starts_with("EVALSHA/"));
    assert!(h.dispatched[1].contains(&enc(b"hello world!")));
    assert_eq!(
        h.dispatched[1],
        complete_call(
            &key,
            "200",
            &[("content-type", b"text/plain")],
            b"hello world!"
        )
    );
    // Anything after it waits too.
    assert_eq!(f.on_response_body(&mut h, 3, true), Action::Pause);
    assert_eq!(h.response_resumed, 0);

    f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1);
    assert_eq!(count(&h, Counter::IdemStored), 1);
    assert!(!h.counters.contains(&Counter::IdemStoreFailed));
    f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1, "resumed once");
    assert_eq!(count(&h, Counter::IdemStored), 1);
    assert_eq!(f.on_response_body(&mut h, 0, true), Action::Continue);
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty(), "completed: nothing to release");
    assert_eq!(h.dispatched.len(), 2);
    assert!(!h.counters.contains(&Counter::IdemReleased));
}

#[test]
fn a_lost_lock_still_lets_the_response_out() {
    // `:0`: the lock expired and may be another request's: not touched.
    let cfg = idem_config("deny");
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::post("/pay", b"abc-123");
    admitted(&mut f, &mut h, &cfg);
    h.respond(&[(":status", "201")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    h.response_chunks = vec![b"done".to_vec()];
    assert_eq!(f.on_response_body(&mut h, 4, true), Action::Pause);
    f.on_callout_reply(&mut h, 2, ok(b":0\r\n"));
    assert_eq!(h.response_resumed, 1);
    assert_eq!(count(&h, Counter::IdemStoreFailed), 1);
    assert_eq!(
        h.dispatched.len(),
        2,
        "no release of a lock that is not ours"
    );
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty());
}

#[test]
fn a_release_meeting_noscript_is_sent_once_more_as_eval() {
    let (mut f, mut h, key) = holding("deny");
    h.respond(&[(":status", "500")]);
    assert_eq!(f.on_response_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched[1], release_call(&key));
    f.on_callout_reply(&mut h, 2, ok(b"-NOSCRIPT No matching script.\r\n"));
    assert_eq!(h.dispatched[2], detached_release_call(&key));
    assert_eq!(h.response_resumed, 0, "held until the release lands");
    f.on_callout_reply(&mut h, 3, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1);
    assert_eq!(count(&h, Counter::IdemReleased), 1);
}

#[test]
fn a_store_meeting_noscript_is_sent_once_more_as_eval() {
    let (mut f, mut h, key) = holding("deny");
    h.respond(&[(":status", "201")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    h.response_chunks = vec![b"done".to_vec()];
    assert_eq!(f.on_response_body(&mut h, 4, true), Action::Pause);
    assert_eq!(h.dispatched[1], complete_call(&key, "201", &[], b"done"));
    f.on_callout_reply(&mut h, 2, ok(b"-NOSCRIPT No matching script.\r\n"));
    assert_eq!(h.dispatched.len(), 3);
    let eval = complete_call(&key, "201", &[], b"done")
        .replacen("EVALSHA/", "EVAL/", 1)
        .replacen(
            &IDEM_COMPLETE.sha1,
            &enc(IDEM_COMPLETE.source.as_bytes()),
            1,
        );
    assert_eq!(h.dispatched[2], eval);
    assert_eq!(h.response_resumed, 0, "still held");
    f.on_callout_reply(&mut h, 3, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1);
    assert_eq!(count(&h, Counter::IdemStored), 1);
    assert_eq!(count(&h, Counter::ScriptReloads), 1);
}

#[test]
fn a_store_redis_answers_with_an_error_releases_the_key_before_the_response_ends() {
    // Redis ran the script and said no: sent again it would say the same.
    let cfg = idem_config("deny");
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::post("/pay", b"abc-123");
    let key = admitted(&mut f, &mut h, &cfg);
    h.respond(&[(":status", "201")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    h.response_chunks = vec![b"done".to_vec()];
    assert_eq!(f.on_response_body(&mut h, 4, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 2);
    assert!(h.dispatched[1].starts_with("EVALSHA/"));
    f.on_callout_reply(&mut h, 2, ok(b"-ERR oops\r\n"));
    assert_eq!(h.dispatched.len(), 3);
    release_lands(&mut f, &mut h, &key);
    assert_eq!(count(&h, Counter::IdemStoreFailed), 1);
    assert!(!h.counters.contains(&Counter::IdemStored));
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty());
    assert!(h.deferred_scripts.is_empty());
}

#[test]
fn a_store_whose_outcome_is_unknown_or_refused_is_the_roots_to_deliver_and_the_key_stays_locked() {
    // No answer (a timeout, Redis stopped, Webdis gone): the store may not
    // have run. Released, a retry would run the request again; so the
    // worker's root sends the same completion until it lands (owner-checked:
    // twice changes nothing) and the response goes out at once. The same
    // for a refusal before the script wrote: a primary a failover demoted
    // answers READONLY until Webdis reaches the new one (make soak found
    // such a store given up and its key run again).
    let readonly = ok(b"-READONLY You can't write against a read only replica.\r\n");
    for reply in [no_answer(), readonly] {
        let cfg = idem_config("deny");
        let mut f = Flow::new(cfg.clone(), test_breaker());
        let mut h = FakeHost::post("/pay", b"abc-123");
        let key = admitted(&mut f, &mut h, &cfg);
        h.respond(&[(":status", "201")]);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        h.response_chunks = vec![b"done".to_vec()];
        assert_eq!(f.on_response_body(&mut h, 4, true), Action::Pause);
        f.on_callout_reply(&mut h, 2, reply);
        assert_eq!(h.dispatched.len(), 2, "no release");
        assert_eq!(
            h.deferred_scripts,
            std::slice::from_ref(&IDEM_COMPLETE.sha1)
        );
        let (_, keys, argv) = &h.slot_releases[0];
        assert_eq!(keys, &[String::from_utf8_lossy(&key).into_owned()]);
        assert_eq!((argv[1].as_str(), argv[3].as_str()), ("201", "done"));
        assert_eq!(h.response_resumed, 1);
        assert!(!h.counters.contains(&Counter::IdemReleased));
        assert!(!h.counters.contains(&Counter::IdemStoreFailed));
        f.on_stream_end(&mut h);
        assert!(h.detached.is_empty());
    }
}

#[test]
fn a_response_ending_at_its_headers_is_stored_at_once() {
    let (mut f, mut h, key) = holding("allow");
    h.respond(&[(":status", "204")]);
    assert_eq!(f.on_response_headers(&mut h, true), Action::Pause);
    assert_eq!(h.dispatched[1], complete_call(&key, "204", &[], b""));
    f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1);
    assert!(h.counters.contains(&Counter::IdemStored));
}

#[test]
fn non_storable_status_releases_the_lock_and_continues() {
    let (mut f, mut h, key) = holding("allow");
    h.respond(&[(":status", "503"), ("content-length", "3")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    assert_eq!(h.dispatched.len(), 2);
    assert_eq!(h.dispatched[1], release_call(&key));
    assert_eq!(count(&h, Counter::IdemReleased), 1);
    h.response_chunks = vec![b"err".to_vec()];
    // The chunk that ends the response waits for the release.
    assert_eq!(f.on_response_body(&mut h, 3, true), Action::Pause);
    f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1);
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty(), "released already");
    assert_eq!(h.dispatched.len(), 2);
    assert_eq!(count(&h, Counter::IdemReleased), 1);
}

#[test]
fn response_over_max_stored_body_is_released_not_stored() {
    let (mut f, mut h, key) = holding("allow");
    // No content-length: found out while copying.
    h.respond(&[(":status", "200")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    h.response_chunks = vec![vec![b'a'; 15], vec![b'b'; 6], vec![b'c'; 4]];
    assert_eq!(f.on_response_body(&mut h, 15, false), Action::Continue);
    assert_eq!(h.dispatched.len(), 1);
    assert_eq!(f.on_response_body(&mut h, 6, false), Action::Continue);
    assert_eq!(h.dispatched.len(), 2);
    assert_eq!(h.dispatched[1], release_call(&key));
    assert_eq!(count(&h, Counter::IdemTooLarge), 1);
    assert_eq!(count(&h, Counter::IdemReleased), 1);
    assert_eq!(
        f.on_response_body(&mut h, 4, true),
        Action::Pause,
        "held for the release"
    );
    assert_eq!(h.dispatched.len(), 2);
    f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1);
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty());
    assert!(!h.counters.contains(&Counter::IdemStored));
}

#[test]
fn response_of_exactly_max_stored_body_is_stored() {
    let (mut f, mut h, key) = holding("allow");
    h.respond(&[(":status", "200")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    h.response_chunks = vec![vec![b'a'; 20]];
    assert_eq!(f.on_response_body(&mut h, 20, true), Action::Pause);
    assert_eq!(
        h.dispatched[1],
        complete_call(&key, "200", &[], &[b'a'; 20])
    );
    assert!(!h.counters.contains(&Counter::IdemTooLarge));
}

#[test]
fn a_client_that_leaves_after_its_request_was_forwarded_leaves_the_lock_to_its_ttl() {
    // Held: forwarded, the response not started; the upstream may be
    // running it, so a retry must meet the lock (409), not run beside it.
    let (mut f, mut h, _) = holding("allow");
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty());
    assert_eq!(h.dispatched.len(), 1, "no release through dispatch_redis");
    assert_eq!(count(&h, Counter::IdemReleased), 0);
    assert_eq!(count(&h, Counter::IdemAbandoned), 1);
    f.on_stream_end(&mut h);
    assert_eq!(count(&h, Counter::IdemAbandoned), 1, "counted once");

    // Capturing: part of the response went out; the upstream ran it.
    let (mut f, mut h, _) = holding("allow");
    h.respond(&[(":status", "200"), ("content-length", "10")]);
    f.on_response_headers(&mut h, false);
    h.response_chunks = vec![b"12345".to_vec()];
    assert_eq!(f.on_response_body(&mut h, 5, false), Action::Continue);
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty());
    assert_eq!(h.dispatched.len(), 1);
    assert_eq!(count(&h, Counter::IdemReleased), 0);
    assert_eq!(count(&h, Counter::IdemAbandoned), 1);

    // Completing: the COMPLETED record is on its way; a release would race it.
    let (mut f, mut h, _) = holding("allow");
    h.respond(&[(":status", "200")]);
    f.on_response_headers(&mut h, false);
    h.response_chunks = vec![b"12345".to_vec()];
    assert_eq!(f.on_response_body(&mut h, 5, true), Action::Pause);
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty());
    assert!(!h.counters.contains(&Counter::IdemReleased));
    assert!(!h.counters.contains(&Counter::IdemAbandoned));
}

#[test]
fn rate_limited_keyed_request_takes_no_lock() {
    let cfg = Rc::new(
        Config::parse(
            br#"{"redis":{"batch":{"enabled":false},"cluster":"webdis"},
            "limits":[{"name":"a","tokenBucket":{"capacity":2,"refill":1,"periodMs":1000}}],
            "idempotency":[{"name":"pay","match":{"pathPrefix":"/pay"}}]}"#,
        )
        .unwrap(),
    );
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::post("/pay", b"abc-123");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    // The limit's key first, the record last, as lua/ratelimit.lua expects.
    assert!(h.dispatched[0].starts_with(&format!("EVALSHA/{}/2/rg%3Arl%3A%7B", RATELIMIT.sha1)));
    let key = expected_record_key(&cfg, &h, b"abc-123");
    assert!(h.dispatched[0].contains(&format!("/{}/1/tb/2/1/1000/1/1/1/owner%2D1/", enc(&key))));
    f.on_callout_reply(&mut h, 1, ok(REJECT));
    assert_eq!(h.sent[0].status, 429);
    assert!(!h.counters.contains(&Counter::IdemAcquired));
    h.respond(&[(":status", "429")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    f.on_stream_end(&mut h);
    assert_eq!(h.dispatched.len(), 1);
    assert!(h.detached.is_empty());
}

#[test]
fn redis_failure_on_a_keyed_request_follows_the_rule_failure_mode() {
    // allow: forwarded without the guarantee. The timed-out script may
    // have taken the lock: it is released (owner-checked) at once.
    let (mut f, mut h) = keyed_in_flight("allow");
    f.on_callout_reply(&mut h, 1, no_answer());
    assert_eq!(h.resumed, 1);
    assert!(h.sent.is_empty());
    assert_eq!(count(&h, Counter::IdemUnguarded), 1);
    assert!(h.counters.contains(&Counter::FailureAllowed));
    // The release of a lock the call may have taken: the root's to
    // deliver (the fault that lost the answer would lose a lone release).
    assert_eq!(h.deferred_scripts, std::slice::from_ref(&IDEM_RELEASE.sha1));
    assert!(h.detached.is_empty());
    h.respond(&[(":status", "200")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    h.response_chunks = vec![b"ok".to_vec()];
    assert_eq!(f.on_response_body(&mut h, 2, true), Action::Continue);
    f.on_stream_end(&mut h);
    assert_eq!(h.dispatched.len(), 1);
    assert_eq!(h.deferred_scripts.len(), 1, "released once");

    // deny: 503, not forwarded; the possible lock is released too.
    let (mut f, mut h) = keyed_in_flight("deny");
    f.on_callout_reply(&mut h, 1, no_answer());
    assert_eq!(h.resumed, 0);
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 503);
    assert!(!h.counters.contains(&Counter::IdemUnguarded));
    f.on_stream_end(&mut h);
    assert_eq!(h.deferred_scripts, std::slice::from_ref(&IDEM_RELEASE.sha1));

    // A dispatch that fails after the body was read decides in the callback.
    let mut f = idem_flow("allow");
    let mut h = FakeHost::post("/pay", b"abc-123");
    h.dispatch_fails = true;
    h.request_body = b"{}".to_vec();
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert_eq!(f.on_request_body(&mut h, 2, true), Action::Continue);
    assert_eq!(h.resumed, 0, "the callback's Continue forwards it");
    assert_eq!(count(&h, Counter::IdemUnguarded), 1);

    let mut f = idem_flow("deny");
    let mut h = FakeHost::post("/pay", b"abc-123");
    h.dispatch_fails = true;
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.sent[0].status, 503);
}

#[test]
fn a_webdis_503_retry_keeps_the_same_owner() {
    let (mut f, mut h) = keyed_in_flight("deny");
    f.on_callout_reply(&mut h, 1, refused());
    assert_eq!(h.dispatched.len(), 2);
    assert_eq!(h.dispatched[0], h.dispatched[1]);
    assert_eq!(h.tokens, 1, "one owner token per request");
    f.on_callout_reply(&mut h, 2, ok(IDEM_ADMIT));
    assert_eq!(h.resumed, 1);
    assert!(h.counters.contains(&Counter::IdemAcquired));
}

#[test]
fn a_keyed_request_meets_the_breaker_of_its_own_tenants_slot_group() {
    // No limit applies to /pay: the call's keys are the idempotency
    // record's, under the tenant's hash tag. Its failures must open that
    // tenant's group only (they once opened group 0, every tenant's keyed
    // requests' breaker: a dead master stopped the others' payments).
    let json = IDEM_CONFIG
        .replace("FAILURE", "deny")
        .replace(
            r#""idempotency":"#,
            r#""hashTag":[{"header":"x-tenant"}],"idempotency":"#,
        )
        .replace(
            r#""name":"pay","#,
            r#""name":"pay","tenant":[{"header":"x-tenant"}],"#,
        );
    let cfg = Rc::new(Config::parse(json.as_bytes()).unwrap());
    let group = |t: &str| Breakers::group(&crate::keys::hash_tag_of([t]));
    let a = "t1";
    let b = ["t2", "t3", "t4", "t5", "t6"]
        .into_iter()
        .find(|t| group(t) != group(a) && group(t) != 0)
        .unwrap();
    let breakers = Rc::new(Breakers::new(2, Duration::from_millis(100)));
    let keyed =
        |tenant: &str, key: &[u8]| FakeHost::post("/pay", key).with("x-tenant", tenant.as_bytes());
    let mut h = keyed(a, b"k1");
    trip_breaker(&cfg, &breakers, &mut h, 2);
    assert_eq!(count(&h, Counter::CircuitShortCircuited), 1);
    let mut h = keyed(b, b"k2");
    let mut f = Flow::new(cfg, breakers.clone());
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(
        h.dispatched.len(),
        1,
        "b's group is closed: b's payment calls"
    );
    assert_eq!(breakers.tripped(), 1);
    assert!(!breakers
        .for_tag(Some(&crate::keys::hash_tag_of([b])))
        .tripped());
    assert!(breakers
        .for_tag(Some(&crate::keys::hash_tag_of([a])))
        .tripped());
}
