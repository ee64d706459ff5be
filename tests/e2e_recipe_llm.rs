//! The book's LLM gateway recipe (docs/src/using/recipes.md, envoy/recipes/
//! llm.json and its plans file llm-plans.jsonl) through two real Envoys,
//! Redis and Webdis: a daily token budget and a number of requests in
//! flight per API key, the free tier configured and the paid tiers stored
//! as plans by `redis-guard plans import`; completions streamed as OpenAI
//! and Anthropic stream them, each charged its real usage when its stream
//! ends; a key upgraded mid-day by importing the billing system's file
//! again. Built with the `cli` feature (its binary is driven here).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::probe::poll_eq;
use support::*;

/// The recipe as the book quotes it; its day in Tokyo when UTC's midnight
/// is near, so no window renews while the test runs (a run takes well
/// under an hour).
fn recipe() -> String {
    let config = filter_config(1000).recipe("llm").build();
    let hour = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        / 3600
        % 24;
    if (1..23).contains(&hour) {
        return config;
    }
    let moved = config.replace(r#""timeZone":"UTC""#, r#""timeZone":"Asia/Tokyo""#);
    assert_ne!(moved, config, "the recipe's day is UTC's");
    moved
}

/// `redis-guard --json plans <args> --config .. --redis ..`: its exit code
/// and what it printed.
fn plans(stack: &Stack, config: &Path, args: &[&str]) -> (i32, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_redis-guard"))
        .env_clear()
        .arg("--json")
        .arg("plans")
        .args(args)
        .args(["--config", config.to_str().unwrap()])
        .args(["--redis", &stack.redis.admin_url()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let json = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "plans {}: not JSON ({e}): {stdout}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap(), json)
}

/// The tokens counted in `key`'s daily windows.
fn spent(con: &mut redis::Connection, key: &str) -> i64 {
    llm::tokens_in_windows(con, "daily-tokens", key)
}

/// A completion for `key` held in flight by its client, 7 + 3 tokens when
/// it runs.
fn held(stack: &Stack, n: usize, key: &str) -> TcpStream {
    let headers: [(&str, &[u8]); 3] = [
        ("x-api-key", key.as_bytes()),
        ("x-upstream-llm", b"anthropic-sse"),
        ("x-upstream-tokens", b"7,3"),
    ];
    let admitted = "redis_guard.ratelimit.in-flight.allowed";
    llm::held_by_client(stack, n, "/v1/messages", &headers, admitted)
}

/// The held completion's last byte: it runs upstream, and its stream ends.
fn finish(s: TcpStream) {
    let text = llm::finish(s);
    assert!(text.contains("event: message_stop"), "{text}");
}

/// `RateLimit` says `left` daily tokens remain (the `X-RateLimit-*` fields
/// name the in-flight limit then: the one with the least left).
fn assert_tokens_left(r: &Resp, left: u64) {
    let state = r.header("ratelimit").unwrap_or_default();
    assert!(
        state.starts_with(&format!("\"daily-tokens\";r={left};t=")),
        "{state}"
    );
}

#[test]
fn each_key_spends_its_own_tiers_daily_tokens_exactly_and_an_upgrade_mid_day_applies_at_once() {
    let config = recipe();
    let stack = Stack::start(&config, 2);
    let dir = Scratch::new("llm-recipe");
    let config_path = dir.0.join("filter.json");
    std::fs::write(&config_path, &config).unwrap();
    let mut con = stack.redis.conn();

    // The billing system's plans: the pro and enterprise keys (four lines,
    // as the book quotes them).
    let file = root().join("envoy/recipes/llm-plans.jsonl");
    let book = std::fs::read_to_string(root().join("docs/src/using/recipes.md")).unwrap();
    assert!(book.contains(std::fs::read_to_string(&file).unwrap().trim_end()));
    let (code, report) = plans(&stack, &config_path, &["import", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["added"], 4, "{report}");

    // The free key: 10,000 tokens a day, four completions of 2,500 each
    // (prompt + completion, both APIs, both Envoys) spend it to the token.
    let policy = |q: u64, m: u64| format!("\"daily-tokens\";q={q};w=86400, \"in-flight\";q={m}");
    for n in 0..4 {
        let r = llm::streamed(&stack, n, "key-free-1", 1000, 1500);
        assert_eq!(r.status, 200, "completion {n}");
        assert_eq!(
            r.header("ratelimit-policy"),
            Some(policy(10_000, 1).as_str())
        );
        poll_eq(
            "the free key's settlement",
            2500 * (n as i64 + 1),
            Duration::from_secs(5),
            || spent(&mut con, "key-free-1"),
        );
    }
    let r = llm::streamed(&stack, 0, "key-free-1", 1, 1);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ratelimit-limit"), Some("10000"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));

    // The pro key: its plan of 200,000, stated in its headers.
    let r = llm::streamed(&stack, 1, "key-pro-1", 40_000, 60_000);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("ratelimit-policy"),
        Some(policy(200_000, 4).as_str())
    );
    assert_tokens_left(&r, 199_999);
    poll_eq(
        "the pro key's settlement",
        100_000,
        Duration::from_secs(5),
        || spent(&mut con, "key-pro-1"),
    );

    // Mid-day the free key buys pro: the billing system adds its two lines
    // and imports the whole file again. `diff` says what will change
    // (exit 1: differs), the import writes those two only, and the next
    // request is decided under 200,000 with the 10,000 spent kept.
    let upgraded = dir.0.join("plans.jsonl");
    let mut text = std::fs::read_to_string(&file).unwrap();
    text.push_str(
        "{\"limit\":\"daily-tokens\",\"values\":{\"x-api-key\":\"key-free-1\"},\"quota\":200000}\n\
         {\"limit\":\"in-flight\",\"values\":{\"x-api-key\":\"key-free-1\"},\"quota\":4}\n",
    );
    std::fs::write(&upgraded, text).unwrap();
    let (code, diff) = plans(&stack, &config_path, &["diff", upgraded.to_str().unwrap()]);
    assert_eq!(code, 1, "{diff}");
    assert_eq!(diff["added"], 2, "{diff}");
    assert_eq!(diff["unchanged"], 4, "{diff}");
    let (code, report) = plans(
        &stack,
        &config_path,
        &["import", upgraded.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{report}");
    assert_eq!(
        (&report["added"], &report["unchanged"]),
        (&2.into(), &4.into())
    );
    let r = llm::streamed(&stack, 0, "key-free-1", 1000, 1500);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("ratelimit-policy"),
        Some(policy(200_000, 4).as_str())
    );
    assert_tokens_left(&r, 189_999);
    poll_eq(
        "the upgraded key's settlement",
        12_500,
        Duration::from_secs(5),
        || spent(&mut con, "key-free-1"),
    );

    // In flight: a free key holds one, the upgraded key four; the next is
    // refused on either Envoy, stating the key's own maximum, and costs no
    // token.
    let free = held(&stack, 0, "key-free-2");
    for e in 0..2 {
        let r = llm::streamed(&stack, e, "key-free-2", 1, 1);
        assert_eq!(r.status, 429);
        assert_eq!(
            r.header("ratelimit-policy"),
            Some(policy(10_000, 1).as_str())
        );
        assert_eq!(r.header("x-ratelimit-limit"), Some("1"));
    }
    let upgraded: Vec<TcpStream> = (0..4).map(|i| held(&stack, i, "key-free-1")).collect();
    for e in 0..2 {
        let r = llm::streamed(&stack, e, "key-free-1", 1, 1);
        assert_eq!(r.status, 429);
        assert_eq!(
            r.header("ratelimit-policy"),
            Some(policy(200_000, 4).as_str())
        );
        assert_eq!(r.header("x-ratelimit-limit"), Some("4"));
    }
    // When the held streams end, each is charged its 10 tokens: nothing for
    // the refused ones, the budgets exact to the token.
    for s in upgraded.into_iter().chain([free]) {
        finish(s);
    }
    poll_eq(
        "the held completions' settlements",
        (12_500 + 40, 10),
        Duration::from_secs(10),
        || (spent(&mut con, "key-free-1"), spent(&mut con, "key-free-2")),
    );
    assert_eq!(spent(&mut con, "key-pro-1"), 100_000);
    assert_eq!(spent(&mut con, "key-ent-1"), 0);
    assert_eq!(stack.counter("redis_guard.usage.fallback"), 0);

    // The plans as stored, exported: the upgraded file's six lines.
    let out = Command::new(env!("CARGO_BIN_EXE_redis-guard"))
        .env_clear()
        .args(["plans", "export", "--config", config_path.to_str().unwrap()])
        .args(["--redis", &stack.redis.admin_url()])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 6);
}
