//! Hostile clients against a real Envoy running the filter: huge and numerous
//! headers, bodies that stop mid-stream, pipelined requests.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use support::probe::{poll, poll_eq};
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
            "x-upstream-delay-ms: 2000",
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

/// Redis, Webdis, the upstream and one Envoy with one worker: every request
/// meets the same VM, so a request that stopped it would stop the next.
fn one_worker_stack(edit: impl FnOnce(String) -> String) -> (Redis, Webdis, Upstream, Envoy) {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let e = Envoy::start_edited_with_workers(&config(), webdis.port, upstream.port, 1, edit);
    (redis, webdis, upstream, e)
}

#[test]
fn a_grpc_frame_declaring_four_gib_is_refused_and_the_worker_serves_on() {
    // 00 ff ff ff fb: one message of 2^32 - 5 bytes. On wasm32, 5 + len
    // wrapped to 0 and the frame count never advanced: the worker spun
    // forever and answered nothing more.
    let (_redis, _webdis, upstream, e) = one_worker_stack(|y| y);
    let body = b"\x00\xff\xff\xff\xfb";
    let h = [
        ("content-type", "application/grpc"),
        ("idempotency-key", "k-frame"),
    ];
    let r = http("POST", &e.url("/pay/demo.Orders/Create"), &h, Some(body));
    assert_eq!(r.status, 200, "a trailers-only gRPC answer");
    assert_eq!(r.header("grpc-status"), Some("3"), "INVALID_ARGUMENT");
    // The same over HTTP/2 (curl, prior knowledge), as the report sent it.
    let dir = Scratch::new("grpc-frame");
    std::fs::write(dir.0.join("body"), body).unwrap();
    let out = std::process::Command::new("curl")
        .args([
            "-s",
            "--http2-prior-knowledge",
            "--max-time",
            "10",
            "-D",
            "-",
            "-o",
        ])
        .arg(dir.0.join("out"))
        .args([
            "-H",
            "content-type: application/grpc",
            "-H",
            "idempotency-key: k-frame2",
        ])
        .arg("--data-binary")
        .arg(format!("@{}", dir.0.join("body").display()))
        .arg(e.url("/pay/demo.Orders/Create"))
        .output()
        .expect("curl not found: make test installs it");
    let head = String::from_utf8_lossy(&out.stdout).to_ascii_lowercase();
    assert!(head.contains("grpc-status: 3"), "{head}");
    // The worker still answers.
    assert_eq!(get(&e.url("/x"), &[("x-user", "after")]).status, 200);
    assert_eq!(upstream.executed(), 1, "only the plain request ran");
}

#[test]
fn a_content_type_envoy_does_not_take_for_grpc_is_stored_and_replayed_as_http() {
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    for (i, ct) in ["application/grpc;charset=utf-8", "Application/GRPC"]
        .iter()
        .enumerate()
    {
        let key = format!("k-ct-{i}");
        let path = format!("/pay/ct{i}");
        let h = [("content-type", *ct), ("idempotency-key", key.as_str())];
        let first = http("PATCH", &e.url(&path), &h, Some(b"{}"));
        assert_eq!(
            (first.status, first.header("idempotent-replayed")),
            (200, None)
        );
        let retry = http("PATCH", &e.url(&path), &h, Some(b"{}"));
        assert_eq!(retry.header("idempotent-replayed"), Some("true"), "{ct}");
        assert_eq!(retry.body, first.body);
        assert_eq!(stack.upstream.executions_of(&path), 1, "{ct}");
    }
}

#[test]
fn a_grpc_call_answered_without_a_grpc_status_is_kept_by_its_http_status() {
    // Every path to the HTTP upstream, gRPC or not: it answers a complete
    // JSON 200 without trailers, so no grpc-status ever comes.
    let route = "- match: { prefix: \"/\", grpc: {} }";
    let (_redis, _webdis, upstream, e) = one_worker_stack(|y| {
        assert!(y.contains(route));
        y.replace(route, "- match: { prefix: \"/never-grpc\", grpc: {} }")
    });
    let h = [
        ("content-type", "application/grpc"),
        ("idempotency-key", "k-nostatus"),
    ];
    let body = b"\0\0\0\0\x02ok";
    let first = http("POST", &e.url("/pay/a.S/M"), &h, Some(body));
    assert_eq!(
        (first.status, first.header("idempotent-replayed")),
        (200, None)
    );
    assert_eq!(first.header("grpc-status"), None);
    let retry = http("POST", &e.url("/pay/a.S/M"), &h, Some(body));
    assert_eq!(
        retry.header("idempotent-replayed"),
        Some("true"),
        "{retry:?}"
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.executions_of("/pay/a.S/M"), 1);
    assert_eq!(e.counter("redis_guard.idempotency.released"), 0);
}

#[test]
fn a_max_tokens_too_large_or_written_as_a_float_reserves_what_it_asks_within_the_quota() {
    // 1000 tokens per x-user, reserved from the body's max_tokens. While
    // a first request runs upstream, its reservation is what the bucket
    // lacks: all of it for a number past 64 bits (it once reserved the
    // fixed 50), exactly what it says for 1000.0 and 1e3.
    let cfg = filter_config(3000)
        .limits(
            r#"[{"name":"llm","match":{"pathPrefix":"/v1"},"descriptor":[{"header":"x-user"}],
                 "tokenBucket":{"capacity":1000,"refill":1,"periodMs":3600000},
                 "usage":{"reserve":50,"reserveFrom":[{"pointer":"/max_tokens"}],
                          "json":[{"pointer":"/usage/total_tokens"}]}}]"#,
        )
        .build();
    let stack = Stack::start(&cfg, 1);
    let e = stack.envoy();
    let mut con = stack.redis.conn();
    for (user, max_tokens, reserved) in [
        ("huge", "18446744073709551616", 1000),
        ("wide", "1000000000000000000000000000000", 1000),
        ("float", "1000.0", 1000),
        ("exp", "1e3", 1000),
        ("frac", "99.5", 100),
    ] {
        let body = format!("{{\"max_tokens\":{max_tokens}}}");
        let url = e.url("/v1/chat");
        let running = std::thread::spawn(move || {
            let h = [("x-user", user), ("x-upstream-delay-ms", "1500")];
            http("POST", &url, &h, Some(body.as_bytes())).status
        });
        poll_eq(user, 1, Duration::from_secs(5), || {
            stack.upstream.in_flight("/v1/chat")
        });
        let key: Vec<String> = redis::cmd("KEYS")
            .arg(format!("*:llm:tb2.*:{}:{user}", user.len()))
            .query(&mut con)
            .unwrap();
        let (credits, _) = read_bucket(&mut con, &key[0]).unwrap();
        assert_eq!(
            1000 - credits.div_euclid(3_600_000),
            reserved,
            "{user}: {max_tokens}"
        );
        if reserved == 1000 {
            let next = http(
                "POST",
                &e.url("/v1/chat"),
                &[("x-user", user)],
                Some(b"{\"max_tokens\":1}"),
            );
            assert_eq!(next.status, 429, "{user}: nothing left while it runs");
        }
        assert_eq!(running.join().unwrap(), 200);
    }
}
