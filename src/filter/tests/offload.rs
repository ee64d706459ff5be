use super::*;

// ---- large responses in the object store --------------------------------

const OFFLOAD_CONFIG: &str = r#"{"redis":{"batch":{"enabled":false},"cluster":"webdis"},
    "objectStore":{"cluster":"s3","authority":"127.0.0.1:9000","bucket":"rg-test",
      "region":"us-east-1","keyPrefix":"t/","timeoutMs":4000,
      "credentials":{"accessKeyId":"AKIDTEST","secretAccessKey":"s3cr3t"}},
    "idempotency":[{"name":"pay","match":{"pathPrefix":"/pay"},
      "maxStoredBodyBytes":64,"offloadAboveBytes":8,"failureMode":"allow"}]}"#;

/// A keyed POST to /pay, lock held, under OFFLOAD_CONFIG.
fn offload_holding() -> (Flow, FakeHost, Vec<u8>) {
    let cfg = Rc::new(Config::parse(OFFLOAD_CONFIG.as_bytes()).unwrap());
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::post("/pay", b"abc-123");
    h.clock_ms = 1_796_232_360_000;
    let key = admitted(&mut f, &mut h, &cfg);
    (f, h, key)
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> &'a str {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
        .unwrap()
}

fn object_reply(status: u32, body: &[u8]) -> CalloutReply {
    CalloutReply {
        status: Some(status),
        from_webdis: false,
        body: body.to_vec(),
    }
}

/// Streams `body` (over the 8-byte threshold) as a 201; returns the PUT.
fn respond_large(f: &mut Flow, h: &mut FakeHost, body: &[u8]) -> (Vec<(String, String)>, Vec<u8>) {
    h.respond(&[(":status", "201"), ("content-type", "text/plain")]);
    assert_eq!(f.on_response_headers(h, false), Action::Continue);
    h.response_chunks = vec![body[..5].to_vec(), body[5..].to_vec()];
    assert_eq!(f.on_response_body(h, 5, false), Action::Continue);
    assert_eq!(f.on_response_body(h, body.len() - 5, true), Action::Pause);
    assert_eq!(
        h.dispatched.len(),
        1,
        "no Redis call before the upload is done"
    );
    assert_eq!(h.objects.len(), 1);
    let (headers, sent) = h.objects[0].clone();
    (headers, sent.unwrap())
}

/// A held key whose large 201 is being uploaded (the PUT in flight).
fn uploading() -> (Flow, FakeHost, Vec<u8>) {
    let (mut f, mut h, key) = offload_holding();
    respond_large(&mut f, &mut h, b"0123456789 a large body");
    (f, h, key)
}

#[test]
fn a_large_response_is_uploaded_then_recorded_by_reference() {
    let (mut f, mut h, key) = offload_holding();
    let body = b"0123456789 a large body";
    let (put, sent) = respond_large(&mut f, &mut h, body);
    assert_eq!(sent, body);
    let sha = codec::sha256_hex(body);
    assert_eq!(header(&put, ":method"), "PUT");
    assert_eq!(header(&put, ":authority"), "127.0.0.1:9000");
    assert_eq!(header(&put, "x-amz-content-sha256"), sha);
    let digest = codec::sha256_hex(&key);
    // Expiry: the proxy's now + recordTtlMs (1 day) + the store's and
    // Redis' timeouts (4 s + 50 ms), rounded up to the second.
    let object_key = format!("t/pay/20261203T172605Z/{digest}-owner-1");
    assert_eq!(header(&put, ":path"), format!("/rg-test/{object_key}"));
    assert!(header(&put, "authorization")
        .starts_with("AWS4-HMAC-SHA256 Credential=AKIDTEST/20261202/us-east-1/s3/aws4_request"));
    assert_eq!(h.timeouts.last(), Some(&Duration::from_secs(4)));
    assert_eq!(h.response_resumed, 0, "the end waits for the upload");
    f.on_callout_reply(&mut h, OBJECT_TOKENS + 1, object_reply(200, b""));
    assert_eq!(h.response_resumed, 0, "and then for the record");
    let record = text(command_body(
        "EVALSHA",
        &[
            IDEM_COMPLETE.sha1.as_bytes(),
            b"1",
            &key,
            b"owner-1",
            b"201",
            &encode_headers(&[("content-type".to_string(), b"text/plain".to_vec())]),
            b"",
            b"86400000",
            object_key.as_bytes(),
            sha.as_bytes(),
            body.len().to_string().as_bytes(),
        ],
    ));
    assert_eq!(h.dispatched[1], record, "the record holds no body");
    f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1);
    assert_eq!(count(&h, Counter::IdemStored), 1);
    assert_eq!(count(&h, Counter::IdemOffloaded), 1);
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty());
}

#[test]
fn a_response_at_the_threshold_stays_in_redis() {
    let (mut f, mut h, key) = offload_holding();
    h.respond(&[(":status", "201"), ("content-type", "text/plain")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    h.response_chunks = vec![b"8 bytes!".to_vec()];
    assert_eq!(f.on_response_body(&mut h, 8, true), Action::Pause);
    assert!(h.objects.is_empty());
    assert_eq!(
        h.dispatched[1],
        complete_call(&key, "201", &[("content-type", b"text/plain")], b"8 bytes!")
    );
    f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
    assert_eq!(count(&h, Counter::IdemOffloaded), 0);
    assert_eq!(count(&h, Counter::IdemStored), 1);
}

#[test]
fn a_failed_upload_releases_the_key_before_the_response_ends() {
    for reply in [
        object_reply(403, b"<Code>SignatureDoesNotMatch</Code>"),
        object_reply(503, b""),
        no_answer(),
    ] {
        let (mut f, mut h, key) = uploading();
        f.on_callout_reply(&mut h, OBJECT_TOKENS + 1, reply.clone());
        assert_eq!(h.dispatched.len(), 2, "no record: {reply:?}");
        release_lands(&mut f, &mut h, &key);
        assert_eq!(count(&h, Counter::IdemOffloadFailed), 1);
        assert_eq!(count(&h, Counter::IdemStored), 0);
    }
}

#[test]
fn a_stream_that_ends_during_the_upload_leaves_the_key_to_its_lock_ttl() {
    // The upstream ran the request; its record will never be written (the
    // upload's answer would come to a gone stream). Freed, the key would
    // let a retry run it again at once.
    let (mut f, mut h, _) = uploading();
    f.on_stream_end(&mut h);
    assert!(h.detached.is_empty());
    assert_eq!(count(&h, Counter::IdemAbandoned), 1);
    assert_eq!(count(&h, Counter::IdemReleased), 0);
}

/// A keyed retry whose record says the body is in the object store.
fn offloaded_replay(body: &[u8]) -> (Flow, FakeHost) {
    let cfg = Rc::new(Config::parse(OFFLOAD_CONFIG.as_bytes()).unwrap());
    let mut f = Flow::new(cfg, test_breaker());
    let mut h = FakeHost::post("/pay", b"abc-123");
    h.clock_ms = 1_796_232_360_000;
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    let stored = encode_headers(&[("content-type".to_string(), b"text/plain".to_vec())]);
    let sha = codec::sha256_hex(body);
    let len = body.len().to_string();
    let record = resp(&[
        b"3",
        b"201",
        &stored,
        b"",
        b"t/pay/20261203T172604Z/d-o",
        sha.as_bytes(),
        len.as_bytes(),
    ]);
    f.on_callout_reply(&mut h, 1, ok(&record));
    assert!(h.sent.is_empty(), "nothing is answered before the fetch");
    assert_eq!(h.objects.len(), 1);
    let (get, body) = &h.objects[0];
    assert_eq!(header(get, ":method"), "GET");
    assert_eq!(header(get, ":path"), "/rg-test/t/pay/20261203T172604Z/d-o");
    assert!(body.is_none());
    (f, h)
}

#[test]
fn an_offloaded_record_is_replayed_from_the_object_store() {
    let body = b"0123456789 a large body";
    let (mut f, mut h) = offloaded_replay(body);
    f.on_callout_reply(&mut h, OBJECT_TOKENS + 1, object_reply(200, body));
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 201);
    assert_eq!(h.sent[0].body, body);
    assert_eq!(
        h.sent[0].headers,
        vec![
            ("content-type".to_string(), "text/plain".to_string()),
            ("idempotent-replayed".to_string(), "true".to_string()),
        ]
    );
    assert_eq!(count(&h, Counter::IdemReplayed), 1);
    assert_eq!(count(&h, Counter::IdemObjectFetched), 1);
    assert_eq!(h.resumed, 0);
}

/// The fuzzer's finding (envoy/cost_gate/fuzz_corpus/
/// replay-fetch-lets-body-through.json): a rule that does not fingerprint
/// the body decides at the headers, so the body streams on while the
/// replay's body is fetched; a piece of it answered Continue would make
/// Envoy send the stopped request upstream, running a completed key again.
#[test]
fn a_body_piece_during_a_replays_fetch_is_held() {
    let config = OFFLOAD_CONFIG.replace(
        r#""name":"pay","#,
        r#""name":"pay","fingerprintBody":false,"#,
    );
    let cfg = Rc::new(Config::parse(config.as_bytes()).unwrap());
    let mut f = Flow::new(cfg, test_breaker());
    let mut h = FakeHost::post("/pay", b"abc-123");
    h.clock_ms = 1_796_232_360_000;
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert_eq!(h.dispatched.len(), 1, "decided at the headers");
    let body = b"0123456789 a large body";
    let stored = encode_headers(&[("content-type".to_string(), b"text/plain".to_vec())]);
    let sha = codec::sha256_hex(body);
    let len = body.len().to_string();
    let record = resp(&[
        b"3",
        b"201",
        &stored,
        b"",
        b"t/pay/20261203T172604Z/d-o",
        sha.as_bytes(),
        len.as_bytes(),
    ]);
    f.on_callout_reply(&mut h, 1, ok(&record));
    assert_eq!(h.objects.len(), 1, "the fetch is out");
    assert_eq!(f.on_request_body(&mut h, 3, false), Action::Pause);
    assert_eq!(f.on_request_body(&mut h, 4, true), Action::Pause);
    f.on_callout_reply(&mut h, OBJECT_TOKENS + 1, object_reply(200, body));
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 201);
    assert_eq!(h.sent[0].body, body);
    assert_eq!(h.resumed, 0, "never forwarded");
}

#[test]
fn a_lost_corrupt_or_unreachable_object_is_an_error_never_a_rerun() {
    let body = b"0123456789 a large body";
    let cases = [
        (
            object_reply(404, b"<Code>NoSuchKey</Code>"),
            502,
            Counter::IdemObjectMissing,
        ),
        (
            object_reply(200, b"0123456789 a LARGE body"),
            502,
            Counter::IdemObjectCorrupt,
        ),
        (
            object_reply(200, b"truncated"),
            502,
            Counter::IdemObjectCorrupt,
        ),
        (
            object_reply(403, b"<Code>SignatureDoesNotMatch</Code>"),
            503,
            Counter::IdemObjectFetchFailed,
        ),
        (no_answer(), 503, Counter::IdemObjectFetchFailed),
    ];
    for (reply, status, counter) in cases {
        let (mut f, mut h) = offloaded_replay(body);
        f.on_callout_reply(&mut h, OBJECT_TOKENS + 1, reply.clone());
        assert_eq!(h.sent.len(), 1, "{reply:?}");
        assert_eq!(h.sent[0].status, status, "{reply:?}");
        assert_eq!(count(&h, counter), 1, "{reply:?}");
        assert_eq!(h.resumed, 0, "never forwarded: {reply:?}");
        assert_eq!(count(&h, Counter::IdemReplayed), 0);
        let doc: serde_json::Value = serde_json::from_slice(&h.sent[0].body).unwrap();
        assert_eq!(doc["status"], status);
        assert!(doc["storedResponse"].is_string());
        assert_eq!(
            has_header(&h.sent[0].headers, "retry-after", "1"),
            status == 503
        );
    }
}

#[test]
fn a_response_announced_over_the_cap_is_released_at_its_headers() {
    let (mut f, mut h, key) = holding("allow");
    h.respond(&[(":status", "200"), ("content-length", "21")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    assert_eq!(h.dispatched[1], release_call(&key), "nothing copied first");
    assert_eq!(count(&h, Counter::IdemTooLarge), 1);
    h.response_chunks = vec![vec![b'a'; 21]];
    assert_eq!(f.on_response_body(&mut h, 21, true), Action::Pause);
    f.on_callout_reply(&mut h, 2, ok(b":1\r\n"));
    assert_eq!(h.response_resumed, 1);
    assert_eq!(count(&h, Counter::IdemStored), 0);
}

#[test]
fn an_upload_that_cannot_be_sent_releases_the_key() {
    let (mut f, mut h, key) = offload_holding();
    h.object_dispatch_fails = true;
    h.respond(&[(":status", "201")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    h.response_chunks = vec![b"0123456789 large".to_vec()];
    assert_eq!(f.on_response_body(&mut h, 16, true), Action::Pause);
    assert_eq!(h.dispatched.len(), 2);
    release_lands(&mut f, &mut h, &key);
    assert_eq!(count(&h, Counter::IdemOffloadFailed), 1);
}

#[test]
fn a_record_that_fails_after_the_upload_releases_the_key() {
    let (mut f, mut h, key) = uploading();
    f.on_callout_reply(&mut h, OBJECT_TOKENS + 1, object_reply(200, b""));
    assert!(h.dispatched[1].starts_with("EVALSHA/"));
    f.on_callout_reply(&mut h, 2, ok(b"-OOM no memory\r\n"));
    assert_eq!(h.dispatched.len(), 3);
    release_lands(&mut f, &mut h, &key);
    assert_eq!(count(&h, Counter::IdemStoreFailed), 1);
    assert_eq!(count(&h, Counter::IdemOffloaded), 0);
}

#[test]
fn a_record_whose_outcome_is_unknown_after_the_upload_is_the_roots_to_deliver() {
    // No answer: the object is stored, the record maybe not; the root
    // sends it until it lands, the key stays locked.
    let (mut f, mut h, _key) = uploading();
    f.on_callout_reply(&mut h, OBJECT_TOKENS + 1, object_reply(200, b""));
    f.on_callout_reply(&mut h, 2, no_answer());
    assert_eq!(h.dispatched.len(), 2, "no release");
    assert_eq!(
        h.deferred_scripts,
        std::slice::from_ref(&IDEM_COMPLETE.sha1)
    );
    assert_eq!(h.response_resumed, 1);
    assert_eq!(count(&h, Counter::IdemStoreFailed), 0);
}

#[test]
fn only_object_replies_are_read_up_to_a_limit() {
    let (f, _, _) = offload_holding();
    assert_eq!(f.reply_limit(2), usize::MAX, "a Redis reply is read whole");
    let (f, _, _) = uploading();
    assert_eq!(f.reply_limit(OBJECT_TOKENS + 1), UPLOAD_REPLY_LIMIT);
    assert_eq!(f.reply_limit(7), usize::MAX);
    let (f, _) = offloaded_replay(b"0123456789 a large body");
    assert_eq!(f.reply_limit(OBJECT_TOKENS + 1), 23, "exactly the object");
    assert_eq!(f.reply_limit(1), usize::MAX);
}

#[test]
fn a_fetch_that_cannot_be_sent_is_a_503_not_a_rerun() {
    let cfg = Rc::new(Config::parse(OFFLOAD_CONFIG.as_bytes()).unwrap());
    let mut f = Flow::new(cfg, test_breaker());
    let mut h = FakeHost::post("/pay", b"abc-123");
    h.object_dispatch_fails = true;
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    let sha = "ab".repeat(32);
    let record = resp(&[b"3", b"201", b"", b"", b"t/pay/x", sha.as_bytes(), b"23"]);
    f.on_callout_reply(&mut h, 1, ok(&record));
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 503);
    assert_eq!(count(&h, Counter::IdemObjectFetchFailed), 1);
    assert_eq!(h.resumed, 0);
}

#[test]
fn a_record_in_an_object_store_this_filter_lacks_is_a_503_not_a_rerun() {
    // The rule once offloaded; this configuration has no objectStore.
    let (mut f, mut h) = keyed_in_flight("allow");
    let sha = "ab".repeat(32);
    let record = resp(&[b"3", b"201", b"", b"", b"t/pay/x", sha.as_bytes(), b"23"]);
    f.on_callout_reply(&mut h, 1, ok(&record));
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.sent[0].status, 503);
    assert_eq!(count(&h, Counter::IdemObjectFetchFailed), 1);
    assert!(h.objects.is_empty());
    assert_eq!(h.resumed, 0);
}

#[test]
fn an_unreadable_completed_record_is_a_503_even_when_failing_open() {
    for record in [
        // An object reference cut short (no length).
        resp(&[b"3", b"201", b"", b"", b"t/pay/x", b"ab"]),
        // A checksum that is not SHA-256.
        resp(&[b"3", b"201", b"", b"", b"t/pay/x", b"abc", b"23"]),
        // A status out of range.
        resp(&[b"3", b"99", b"", b"body"]),
    ] {
        let (mut f, mut h) = keyed_in_flight("allow");
        f.on_callout_reply(&mut h, 1, ok(&record));
        assert_eq!(h.resumed, 0, "a completed key is never forwarded");
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 503);
        assert_eq!(count(&h, Counter::RedisError(ErrorKind::Reply)), 1);
        assert_eq!(count(&h, Counter::IdemUnguarded), 0);
        assert_eq!(count(&h, Counter::FailureAllowed), 0);
    }
}
