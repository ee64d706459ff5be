//! Usage-based limits end to end: real Envoys, Webdis, Redis, and the demo
//! upstream answering as an OpenAI-compatible or Anthropic-style API with
//! token counts the test chooses. A request takes its reserve at admission;
//! when its stream is over the worker settles the difference to what the
//! response said, so the balance in Redis is exactly the sum of the costs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use support::probe::poll_eq;
use support::*;

/// One token in the buckets: they refill one token an hour, so nothing
/// comes back while a test runs.
const PERIOD: i64 = 3_600_000;

/// 100 tokens per x-user on /v1/chat (OpenAI usage: prompt + completion)
/// and on /v1/messages (Anthropic: input + output), reserving 10, charging
/// 60 when no usage arrives; 1000 on /v1/completions, reserving the request
/// body's `max_tokens` and charged by an x-usage-tokens header or trailer,
/// or else the usage's total; an idempotency rule on /v1/chat.
fn config() -> String {
    filter_config(1000)
        .limits(
            r#"[{"name":"openai","match":{"pathPrefix":"/v1/chat"},"descriptor":[{"header":"x-user"}],
                 "tokenBucket":{"capacity":100,"refill":1,"periodMs":3600000},
                 "usage":{"reserve":10,"fallback":60,
                          "json":[{"pointer":"/usage/prompt_tokens"},{"pointer":"/usage/completion_tokens"}]}},
                {"name":"anthropic","match":{"pathPrefix":"/v1/messages"},"descriptor":[{"header":"x-user"}],
                 "tokenBucket":{"capacity":100,"refill":1,"periodMs":3600000},
                 "usage":{"reserve":10,
                          "json":[{"pointer":"/message/usage/input_tokens"},{"pointer":"/usage/output_tokens"}]}},
                {"name":"reserved","match":{"pathPrefix":"/v1/completions"},"descriptor":[{"header":"x-user"}],
                 "tokenBucket":{"capacity":1000,"refill":1,"periodMs":3600000},
                 "usage":{"reserveFrom":[{"pointer":"/max_tokens"}],"header":"x-usage-tokens",
                          "json":[{"pointer":"/usage/total_tokens"}]}},
                {"name":"reserved-small","match":{"pathPrefix":"/v1/small"},"descriptor":[{"header":"x-user"}],
                 "tokenBucket":{"capacity":1000,"refill":1,"periodMs":3600000},
                 "usage":{"reserveFrom":[{"pointer":"/max_tokens"}],"maxBodyBytes":4096,
                          "json":[{"pointer":"/usage/total_tokens"}]}}]"#,
        )
        .idempotency(r#"[{"name":"chat","match":{"pathPrefix":"/v1/chat"}}]"#)
        .build()
}

/// The tokens left in the bucket of `limit` for `user` (negative: debt).
fn tokens(con: &mut redis::Connection, limit: &str, user: &str) -> Option<i64> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*:{limit}:tb2.*:{}:{user}", user.len()))
        .query(con)
        .unwrap();
    let key = keys.first()?;
    let (credits, _) = read_bucket(con, key)?;
    Some(credits.div_euclid(PERIOD))
}

/// Waits (bounded) until the bucket holds `want` tokens: the settlement is
/// sent by the worker as the stream ends, and lands a moment later.
fn settles_to(con: &mut redis::Connection, limit: &str, user: &str, want: i64) {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let now = tokens(con, limit, user);
        if now == Some(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{limit}/{user}: {now:?} tokens, want {want}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn llm(e: &Envoy, path: &str, user: &str, kind: &str, tokens: &str) -> Resp {
    http(
        "POST",
        &e.url(path),
        &[
            ("x-user", user),
            ("x-upstream-llm", kind),
            ("x-upstream-tokens", tokens),
        ],
        Some(b"{}"),
    )
}

#[test]
fn the_balance_is_exactly_what_the_responses_said_and_a_debt_rejects_what_follows() {
    let stack = Stack::start(&config(), 2);
    let mut con = stack.redis.conn();
    let (a, b) = (&stack.envoys[0], &stack.envoys[1]);
    // JSON on one Envoy, SSE on the other: 30 then 10 tokens.
    let r = llm(a, "/v1/chat/completions", "u1", "openai-json", "10,20");
    assert_eq!(r.status, 200);
    // The headers show the state at admission: the reserve taken.
    assert_eq!(r.header("x-ratelimit-remaining"), Some("90"));
    settles_to(&mut con, "openai", "u1", 70);
    let r = llm(b, "/v1/chat/completions", "u1", "openai-sse", "4,6");
    assert_eq!(r.status, 200);
    assert!(String::from_utf8_lossy(&r.body).ends_with("data: [DONE]\n\n"));
    settles_to(&mut con, "openai", "u1", 60);
    // A completion that costs more than is left is admitted (the reserve
    // fits) and leaves a debt of 40.
    assert_eq!(
        llm(a, "/v1/chat/completions", "u1", "openai-json", "50,50").status,
        200
    );
    settles_to(&mut con, "openai", "u1", -40);
    // Twice on one Envoy: the second 429 is Redis' too, since the over-limit
    // cache never answers for a usage-based limit (a settlement can move
    // the balance at any time).
    let calls = a.counter("redis_guard.redis.calls");
    for e in [a, a, b] {
        let r = llm(e, "/v1/chat/completions", "u1", "openai-json", "1,1");
        assert_eq!(r.status, 429, "in debt");
        assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    }
    assert_eq!(a.counter("redis_guard.redis.calls") - calls, 2);
    assert_eq!(stack.counter("redis_guard.overlimit_cache.rejected"), 0);
    // Anthropic's stream: 25 input tokens in message_start, 40 output
    // tokens as the last running total.
    assert_eq!(
        llm(b, "/v1/messages", "u1", "anthropic-sse", "25,40").status,
        200
    );
    settles_to(&mut con, "anthropic", "u1", 35);
    let charged = stack.counter("redis_guard.usage.charged_units");
    assert_eq!(charged, 20 + 90 + 55);
    let refunded = stack.counter("redis_guard.usage.refunded_units");
    assert_eq!(refunded, 0, "the 10-token answer cost exactly its reserve");
    let fallback = stack.counter("redis_guard.usage.fallback");
    assert_eq!(fallback, 0);
}

#[test]
fn a_client_that_leaves_mid_stream_is_charged_the_fallback() {
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    let mut con = stack.redis.conn();
    let mut s = TcpStream::connect(("127.0.0.1", e.port)).unwrap();
    let req = raw_request_bytes(
        "POST",
        "/v1/chat/completions",
        "content-length: 2\r\n",
        &[
            ("x-user", b"u2"),
            ("x-upstream-llm", b"openai-sse"),
            ("x-upstream-tokens", b"1,1"),
            ("x-upstream-body-pause-ms", b"3000"),
        ],
        b"{}",
    );
    s.write_all(&req).unwrap();
    // The first events arrive; the usage would come 3 s later.
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("lo\"") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed early");
        got.extend_from_slice(&buf[..n]);
    }
    drop(s);
    // 60 charged (the fallback), not the 2 the stream would have said.
    settles_to(&mut con, "openai", "u2", 40);
    assert_eq!(e.counter("redis_guard.usage.fallback"), 1);
}

#[test]
fn a_replayed_request_charges_nothing() {
    let stack = Stack::start(&config(), 2);
    let mut con = stack.redis.conn();
    let headers = |e: &Envoy| {
        http(
            "POST",
            &e.url("/v1/chat/completions"),
            &[
                ("x-user", "u3"),
                ("idempotency-key", "k-1"),
                ("x-upstream-llm", "openai-json"),
                ("x-upstream-tokens", "20,20"),
            ],
            Some(b"{}"),
        )
    };
    let first = headers(&stack.envoys[0]);
    assert_eq!(first.status, 200);
    settles_to(&mut con, "openai", "u3", 60);
    let e = &stack.envoys[1];
    let calls = e.counter("redis_guard.redis.calls");
    let again = headers(e);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    // A settlement would be sent as the stream ends: once Envoy has ended
    // it, the replay's one call is all there was, and nothing was settled.
    poll_eq(
        "the replay's stream ended",
        0,
        Duration::from_secs(10),
        || admin_stat(e.admin_port, "http.ingress.downstream_rq_active"),
    );
    assert_eq!(e.counter("redis_guard.redis.calls") - calls, 1);
    for settled in ["charged_units", "refunded_units", "fallback", "lost"] {
        let n = e.counter(&format!("redis_guard.usage.{settled}"));
        assert_eq!(n, 0, "usage.{settled}");
    }
    assert_eq!(tokens(&mut con, "openai", "u3"), Some(60));
    assert_eq!(stack.upstream.executions_of("/v1/chat/completions"), 1);
}

#[test]
fn redis_down_at_settlement_is_counted_and_the_stream_still_completes() {
    let mut stack = Stack::start(&config(), 1);
    let url = stack.envoys[0].url("/v1/messages");
    let done = std::thread::scope(|s| {
        let streaming = s.spawn(move || {
            http(
                "POST",
                &url,
                &[
                    ("x-user", "u4"),
                    ("x-upstream-llm", "anthropic-sse"),
                    // 60 tokens: 50 more than the reserve to settle.
                    ("x-upstream-tokens", "30,30"),
                    ("x-upstream-body-pause-ms", "1500"),
                ],
                Some(b"{}"),
            )
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        while stack.upstream.in_flight("/v1/messages") == 0 {
            assert!(Instant::now() < deadline, "never admitted");
            std::thread::sleep(Duration::from_millis(10));
        }
        stack.redis.stop();
        streaming.join().unwrap()
    });
    assert_eq!(
        done.status, 200,
        "the response is not held by its settlement"
    );
    let e = &stack.envoys[0];
    let deadline = Instant::now() + Duration::from_secs(5);
    while e.counter("redis_guard.usage.lost") != 1 {
        assert!(
            Instant::now() < deadline,
            "the lost settlement was never counted"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Still serving: the next request takes the failure mode (deny).
    let r = llm(e, "/v1/messages", "u4", "anthropic-sse", "1,1");
    assert_eq!(r.status, 503);
}

/// A completion on /v1/completions asking for `max_tokens` (none: `{}`).
fn completion(e: &Envoy, user: &str, max_tokens: Option<u64>, extra: &[(&str, &str)]) -> Resp {
    let body = match max_tokens {
        Some(n) => format!(r#"{{"model":"m","max_tokens":{n}}}"#),
        None => "{}".to_string(),
    };
    let mut headers = vec![("x-user", user), ("content-type", "application/json")];
    headers.extend_from_slice(extra);
    http(
        "POST",
        &e.url("/v1/completions"),
        &headers,
        Some(body.as_bytes()),
    )
}

#[test]
fn a_request_reserves_its_max_tokens_so_concurrent_requests_see_them_taken_until_it_settles() {
    let stack = Stack::start(&config(), 2);
    let mut con = stack.redis.conn();
    let (a, b) = (&stack.envoys[0], &stack.envoys[1]);
    std::thread::scope(|scope| {
        // A long completion on one Envoy: 800 reserved while it streams.
        let long = scope.spawn(|| {
            completion(
                a,
                "u5",
                Some(800),
                &[
                    ("x-upstream-llm", "openai-sse"),
                    ("x-upstream-tokens", "100,100"),
                    // Long enough for every step below to happen while it streams.
                    ("x-upstream-body-pause-ms", "4000"),
                ],
            )
        });
        settles_to(&mut con, "reserved", "u5", 200);
        // On the other Envoy meanwhile: 300 does not fit, 200 does (and
        // costs 50 + 50).
        let r = completion(b, "u5", Some(300), &[("x-upstream-llm", "openai-json")]);
        assert_eq!(r.status, 429);
        assert_eq!(r.header("x-ratelimit-remaining"), Some("200"));
        let r = completion(
            b,
            "u5",
            Some(200),
            &[
                ("x-upstream-llm", "openai-json"),
                ("x-upstream-tokens", "50,50"),
            ],
        );
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
        settles_to(&mut con, "reserved", "u5", 100);
        // Everything above ran while the long one streamed (its 800 still
        // reserved); if not, say so rather than fail on a balance.
        assert_eq!(
            stack.upstream.in_flight("/v1/completions"),
            1,
            "the long completion ended before the steps it must overlap"
        );
        // The long one used 200 of its 800.
        assert_eq!(long.join().unwrap().status, 200);
    });
    settles_to(&mut con, "reserved", "u5", 700);
    // A body that names no max_tokens reserves the fixed 1.
    let r = completion(
        a,
        "u5",
        None,
        &[
            ("x-upstream-llm", "openai-json"),
            ("x-upstream-tokens", "1,1"),
        ],
    );
    assert_eq!(r.header("x-ratelimit-remaining"), Some("699"));
    settles_to(&mut con, "reserved", "u5", 698);
    assert_eq!(stack.counter("redis_guard.usage.reserve_unread"), 1);
    assert_eq!(stack.counter("redis_guard.usage.refunded_units"), 100 + 600);
    assert_eq!(stack.counter("redis_guard.usage.charged_units"), 1);
    assert_eq!(stack.counter("redis_guard.usage.fallback"), 0);
}

#[test]
fn a_usage_count_sent_as_a_trailer_after_the_body_is_charged() {
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    let mut con = stack.redis.conn();
    // A plain JSON answer (no usage in it), chunked, its cost in a trailer.
    let r = completion(
        e,
        "u6",
        Some(100),
        &[("x-upstream-trailers", r#"[["x-usage-tokens","250"]]"#)],
    );
    assert_eq!(r.status, 200);
    assert!(String::from_utf8_lossy(&r.body).contains("\"execution\""));
    settles_to(&mut con, "reserved", "u6", 750);
    assert_eq!(stack.counter("redis_guard.usage.charged_units"), 150);
    assert_eq!(stack.counter("redis_guard.usage.fallback"), 0);
    // Without the trailer, the same answer states no usage: the fallback,
    // which is what it reserved, so the balance does not move.
    let r = completion(e, "u6", Some(100), &[]);
    assert_eq!(r.status, 200);
    // Counted as the stream ends, a moment after the client has it all.
    let deadline = Instant::now() + Duration::from_secs(3);
    while stack.counter("redis_guard.usage.fallback") == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(stack.counter("redis_guard.usage.fallback"), 1);
    assert_eq!(tokens(&mut con, "reserved", "u6"), Some(650));
}

#[test]
fn a_request_body_over_the_reservations_bound_is_decided_there_with_the_fixed_reserve() {
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    // 20 KB of prompt before max_tokens: the bound (4 KiB) passes first.
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":"{}"}}],"max_tokens":500}}"#,
        "x".repeat(20_000)
    );
    let r = http(
        "POST",
        &e.url("/v1/small"),
        &[("x-user", "u7"), ("content-type", "application/json")],
        Some(body.as_bytes()),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-remaining"),
        Some("999"),
        "the fixed 1"
    );
    assert_eq!(stack.counter("redis_guard.usage.reserve_unread"), 1);
    // The whole body reached the upstream.
    let echoed: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(echoed["bodyBytes"], body.len());
}

#[test]
fn a_debt_past_what_redis_holds_exactly_is_clamped_at_2_to_the_52_credits() {
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    let mut con = stack.redis.conn();
    // 10^12 tokens at one token an hour: 3.6 * 10^18 credits of debt, past
    // the 2^53 a double holds exactly. The bucket keeps 2^52 of it.
    let r = llm(
        e,
        "/v1/chat/completions",
        "u8",
        "openai-json",
        "1000000000000,0",
    );
    assert_eq!(r.status, 200);
    let clamped = -(1_i64 << 52);
    settles_to(&mut con, "openai", "u8", clamped.div_euclid(PERIOD));
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:openai:tb2.*:2:u8")
        .query(&mut con)
        .unwrap();
    let (credits, _) = read_bucket(&mut con, &keys[0]).unwrap();
    assert_eq!(credits, clamped, "exactly 2^52 credits of debt");
    // Still a bucket that decides: in debt, so the next request is refused.
    let r = llm(e, "/v1/chat/completions", "u8", "openai-json", "1,1");
    assert_eq!(r.status, 429);
    assert_eq!(e.counter("redis_guard.usage.lost"), 0);
    assert_eq!(e.counter("redis_guard.redis.errors"), 0);
}
