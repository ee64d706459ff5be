//! Hostile clients against a real Envoy running the filter: huge and numerous
//! headers, bodies that stop mid-stream, pipelined requests.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use support::probe::poll;
use support::*;

fn config() -> String {
    filter_config(3000)
        .limits(
            r#"[{"name":"per-user","descriptor":[{"header":"x-user"}],
             "tokenBucket":{"capacity":2,"refill":1,"periodMs":3600000}}]"#,
        )
        .idempotency(r#"[{"name":"pay","match":{"pathPrefix":"/pay"}}]"#)
        .build()
}

fn keys(stack: &Stack, pattern: &str) -> Vec<Vec<u8>> {
    redis::cmd("KEYS")
        .arg(pattern)
        .query(&mut stack.redis.conn())
        .unwrap()
}

#[test]
fn a_32_kib_descriptor_value_is_limited_under_a_small_key() {
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    let huge = "u".repeat(32 * 1024);
    let statuses: Vec<u16> = (0..3)
        .map(|_| get(&e.url("/x"), &[("x-user", &huge)]).status)
        .collect();
    assert_eq!(statuses, [200, 200, 429]);
    let k = keys(&stack, "rg:rl:*");
    assert_eq!(k.len(), 1);
    assert!(
        k[0].len() < 140,
        "the value is stored as its digest, not verbatim"
    );
}

#[test]
fn ninety_headers_do_not_disturb_the_decision() {
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    // Envoy itself refuses more than 100 headers (431) before any filter runs.
    let names: Vec<String> = (0..90).map(|i| format!("x-noise-{i}")).collect();
    let mut headers: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "v")).collect();
    headers.push(("x-user", "many"));
    let statuses: Vec<u16> = (0..3).map(|_| get(&e.url("/x"), &headers).status).collect();
    assert_eq!(statuses, [200, 200, 429]);
}

#[test]
fn a_keyed_body_that_stops_mid_stream_takes_no_lock() {
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    let stat = |name: &str| admin_stat(e.admin_port, &format!("http.ingress.{name}"));
    {
        let mut s = TcpStream::connect(("127.0.0.1", e.port)).unwrap();
        s.write_all(
            b"POST /pay/cut HTTP/1.1\r\nhost: x\r\nidempotency-key: k-cut\r\ncontent-length: 100\r\n\r\n0123456789",
        )
        .unwrap();
        // Envoy has the headers (the filter has seen the key) before the
        // client goes.
        poll("the request reaches Envoy", Duration::from_secs(5), || {
            (stat("downstream_rq_total") >= 1).then_some(())
        });
    } // closed with 90 bytes missing
    poll(
        "Envoy sees the client leave",
        Duration::from_secs(5),
        || (stat("downstream_cx_destroy_remote_active_rq") >= 1).then_some(()),
    );
    assert!(
        keys(&stack, "rg:idem:*").is_empty(),
        "no body, no decision, no lock"
    );
    let r = http(
        "POST",
        &e.url("/pay/cut"),
        &[("idempotency-key", "k-cut")],
        Some(&[b'x'; 100]),
    );
    assert_eq!((r.status, r.header("idempotent-replayed")), (200, None));
    assert_eq!(
        stack.upstream.executed(),
        1,
        "the cut request never reached the upstream"
    );
}

#[test]
fn pipelined_retries_on_one_connection_execute_once() {
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    let one = b"POST /pay/pipe HTTP/1.1\r\nhost: x\r\nidempotency-key: k-pipe\r\ncontent-length: 3\r\n\r\nabc";
    let mut s = TcpStream::connect(("127.0.0.1", e.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut all = Vec::new();
    for _ in 0..3 {
        all.extend_from_slice(one);
    }
    s.write_all(&all).unwrap();
    // Read until three responses have arrived (bounded by the read timeout).
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while buf.windows(12).filter(|w| w == b"HTTP/1.1 200").count() < 3 {
        let n = s.read(&mut chunk).unwrap();
        assert!(
            n > 0,
            "connection closed early: {}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    assert_eq!(text.matches("idempotent-replayed: true").count(), 2);
    assert_eq!(stack.upstream.executed(), 1);
}

#[test]
fn a_client_that_leaves_after_the_upstream_answered_frees_the_key() {
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    {
        let mut s = TcpStream::connect(("127.0.0.1", e.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(
            b"POST /pay/late HTTP/1.1\r\nhost: x\r\nidempotency-key: k-late\r\n\
              x-upstream-pad-bytes: 2000\r\nx-upstream-body-pause-ms: 1000\r\ncontent-length: 1\r\n\r\nx",
        )
        .unwrap();
        // Wait for the status line and the first half of the body, then leave.
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        while !String::from_utf8_lossy(&got).contains("execution") {
            let n = s.read(&mut chunk).unwrap();
            assert!(n > 0);
            got.extend_from_slice(&chunk[..n]);
        }
        assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
    }
    // The stream is reset mid-response: the lock must go now, not at its TTL.
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while !keys(&stack, "rg:idem:*").is_empty() {
        assert!(std::time::Instant::now() < deadline, "lock still held");
        std::thread::sleep(Duration::from_millis(50));
    }
    let retry = http(
        "POST",
        &e.url("/pay/late"),
        &[("idempotency-key", "k-late")],
        Some(b"x"),
    );
    assert_eq!(
        (retry.status, retry.header("idempotent-replayed")),
        (200, None)
    );
}

#[test]
fn concurrent_http2_streams_on_one_connection_execute_once() {
    // h2load (Debian nghttp2-client) opens one h2c connection and runs all
    // 20 requests on it at once: 20 concurrent streams with one key.
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    let body = Scratch::new("h2body");
    let body_file = body.0.join("body");
    std::fs::write(&body_file, b"same").unwrap();
    let out = std::process::Command::new("h2load")
        .args(["-n", "20", "-c", "1", "-m", "20"])
        .args([
            "-H",
            "idempotency-key: k-h2",
            "-H",
            "x-upstream-delay-ms: 300",
        ])
        .arg("-d")
        .arg(&body_file)
        .arg(e.url("/pay/h2"))
        .output()
        .expect("h2load not found: make test installs nghttp2-client");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains("20 done, 1 succeeded, 19 failed, 0 errored"),
        "one 200, 19 answered otherwise, none broken: {text}"
    );
    assert!(
        text.contains("status codes: 1 2xx, 0 3xx, 19 4xx, 0 5xx"),
        "{text}"
    );
    assert_eq!(stack.upstream.executed(), 1);
    assert_eq!(e.counter("redis_guard.idempotency.conflicted"), 19);
}
