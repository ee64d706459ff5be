//! What the usage-based and in-flight tests share: a key's tokens as Redis
//! counts them, a completion streamed as OpenAI or Anthropic stream them,
//! and a request its client holds in flight for as long as the test wants.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::probe::poll_eq;
use super::{http, raw_request_bytes, Resp, Stack};

/// The units counted in every window of limit `limit` for descriptor value
/// `value` (a quota's windows, summed).
pub fn tokens_in_windows(con: &mut redis::Connection, limit: &str, value: &str) -> i64 {
    let windows: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*:{limit}:*:{value}:*"))
        .query(con)
        .unwrap();
    windows
        .iter()
        .map(|w| {
            let v: Option<String> = redis::cmd("GET").arg(w).query(con).unwrap();
            v.map_or(0, |v| v.parse::<i64>().unwrap())
        })
        .sum()
}

/// A completion streamed for `x-api-key: key` through Envoy `n % 2`:
/// OpenAI's chunks on even `n`, Anthropic's events on odd, `prompt` and
/// `completion` tokens in its usage.
pub fn streamed(stack: &Stack, n: usize, key: &str, prompt: u64, completion: u64) -> Resp {
    let (path, kind) = if n % 2 == 0 {
        ("/v1/chat/completions", "openai-sse")
    } else {
        ("/v1/messages", "anthropic-sse")
    };
    let tokens = format!("{prompt},{completion}");
    let r = http(
        "POST",
        &stack.envoys[n % 2].url(path),
        &[
            ("x-api-key", key),
            ("x-upstream-llm", kind),
            ("x-upstream-tokens", &tokens),
        ],
        Some(b"{}"),
    );
    if r.status == 200 {
        assert_eq!(r.header("content-type"), Some("text/event-stream"));
    }
    r
}

/// A POST to `path` on Envoy `n % 2` that its client holds in flight: its
/// headers and the first byte of its 2-byte body sent, so a limit decided at
/// the headers has admitted it (waited for by `admitted`, an Envoy counter
/// that moves by one) and it stays in flight until [`finish`] sends the last
/// byte. No timer bounds the hold: Envoy's route timeout starts only once
/// the request is whole.
pub fn held_by_client(
    stack: &Stack,
    n: usize,
    path: &str,
    headers: &[(&str, &[u8])],
    admitted: &str,
) -> TcpStream {
    let before = stack.counter(admitted);
    let mut s = TcpStream::connect(("127.0.0.1", stack.envoys[n % 2].port)).unwrap();
    let fixed = "content-length: 2\r\nconnection: close\r\n";
    s.write_all(&raw_request_bytes("POST", path, fixed, headers, b"{"))
        .unwrap();
    poll_eq(
        "the held request's admission",
        before + 1,
        Duration::from_secs(10),
        || stack.counter(admitted),
    );
    s
}

/// A held request's last byte: it goes upstream; its whole response.
pub fn finish(mut s: TcpStream) -> String {
    s.write_all(b"}").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    text
}
