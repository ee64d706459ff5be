//! The configurations the book tells a newcomer to start from, run as they
//! are written: envoy/examples/minimal.yaml (Getting started) with a real
//! Redis and Webdis, only its three port numbers moved to free ones. Its
//! limit answers as the page says, and `redis-guard doctor` finds it
//! healthy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::process::Command;

use support::*;

/// The example with its ports (admin 9901, listener 10000, Webdis 7379)
/// replaced, each asserted to be there exactly once: nothing else changes.
fn minimal(admin: u16, listener: u16, webdis: u16) -> String {
    let mut text = std::fs::read_to_string(root().join("envoy/examples/minimal.yaml")).unwrap();
    for (from, to) in [(9901, admin), (10000, listener), (7379, webdis)] {
        let shipped = format!("port_value: {from} }}");
        assert_eq!(text.matches(&shipped).count(), 1, "{shipped}");
        text = text.replace(&shipped, &format!("port_value: {to} }}"));
    }
    text
}

/// The port of the first `port_value` after `after` in a rendered envoy.yaml.
fn port_after(yaml: &str, after: &str) -> u16 {
    let at = yaml.find(after).unwrap();
    let rest = &yaml[at..];
    let v = &rest[rest.find("port_value: ").unwrap() + "port_value: ".len()..];
    v[..v.find(|c: char| !c.is_ascii_digit()).unwrap()]
        .parse()
        .unwrap()
}

#[test]
fn the_getting_started_example_limits_as_the_book_says_and_is_healthy() {
    // The file names the filter by its path from the repository's root,
    // where the tests run Envoy: the one `make build` writes, current.
    assert_eq!(
        wasm_path(),
        root().join("target/wasm32-wasip1/release/redis_guard.wasm")
    );
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let auth = webdis_authorization();
    // The harness picks free ports and renders its envoy.yaml with them;
    // the example replaces that file whole, on the same ports.
    let envoy = Envoy::start_full(
        "{}",
        webdis.port,
        webdis.port,
        None,
        &[("REDIS_GUARD_WEBDIS_AUTHORIZATION", auth.as_str())],
        |rendered| {
            let admin = port_after(&rendered, "admin:");
            let listener = port_after(&rendered, "listeners:");
            minimal(admin, listener, webdis.port)
        },
    );
    let url = envoy.url("/api/orders");
    for i in 1..=5 {
        let r = get(&url, &[("x-user", "alice")]);
        assert_eq!(r.status, 200, "request {i}");
        assert_eq!(r.body, b"hello\n");
        assert_eq!(
            r.header("x-ratelimit-remaining"),
            Some((5 - i).to_string().as_str())
        );
    }
    let r = get(&url, &[("x-user", "alice")]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("12"));
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"per-user-burst\";q=5;w=60")
    );
    assert_eq!(get(&url, &[("x-user", "bob")]).status, 200);
    // Outside /api/ no limit applies.
    let other = get(&envoy.url("/health"), &[("x-user", "alice")]);
    assert_eq!(
        (other.status, other.header("x-ratelimit-remaining")),
        (200, None)
    );
    assert_eq!(envoy.counter("redis_guard.redis.errors"), 0);

    let out = Command::new(env!("CARGO_BIN_EXE_redis-guard"))
        .args(["doctor", "--admin"])
        .arg(format!("127.0.0.1:{}", envoy.admin_port))
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains(
            "note     limits that fired since Envoy started: per-user-burst rejected 1 of 7\n"
        ),
        "{text}"
    );
    assert!(text.ends_with("no problem found\n"), "{text}");
}
