//! A panic in the filter, in a real Envoy. The release build aborts its VM on
//! a panic (panic=abort) after one critical log line; what Envoy does next
//! with that worker's requests is the plugin's `failure_policy`: closed (the
//! default, and envoy/envoy.yaml's) answers them 503, open lets them through
//! without the filter. The other worker's VM keeps running.
//!
//! A test build (cargo feature `panic-trigger`, built here into
//! target/panic-trigger/) panics on a request carrying `TRIGGER`; the release
//! build has no such path.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use support::probe::*;
use support::*;

const TRIGGER: &str = "x-redis-guard-test-panic";

const CONFIG: &str = r#"{"redis":{"cluster":"webdis","timeoutMs":2000},"failureMode":"deny",
    "limits":[{"name":"all","slidingWindow":{"limit":1000,"windowMs":60000}}]}"#;

/// The filter built with the trigger, in a target directory of its own (a
/// no-op for cargo when `make test` built it already). Built once per run.
fn trigger_wasm() -> &'static PathBuf {
    static WASM: OnceLock<PathBuf> = OnceLock::new();
    WASM.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let dir = root().join("target/panic-trigger");
        let status = Command::new(cargo)
            .args(["build", "--release", "--lib", "--target", "wasm32-wasip1"])
            .args(["--features", "panic-trigger", "--target-dir"])
            .arg(&dir)
            .current_dir(root())
            .status()
            .unwrap();
        assert!(status.success(), "building the panic-trigger filter failed");
        dir.join("wasm32-wasip1/release/redis_guard.wasm")
    })
}

/// Redis, Webdis, the upstream and an Envoy running the trigger build, with
/// `edit` applied to its envoy.yaml.
fn start(edit: impl FnOnce(String) -> String) -> (Redis, Webdis, Upstream, Envoy) {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let release = wasm_path().display().to_string();
    let envoy = Envoy::start_edited(CONFIG, webdis.port, upstream.port, |yaml| {
        assert!(yaml.contains(&release));
        edit(yaml.replace(&release, &trigger_wasm().display().to_string()))
    });
    (redis, webdis, upstream, envoy)
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// The panicking request gets 503 from Envoy; the critical line is logged.
fn panic_on(conn: &mut RawConn, envoy: &Envoy) {
    let r = conn.send("GET", "/x", &[(TRIGGER, b"1")], b"");
    assert_eq!((r.status, r.body.len()), (503, 0), "{r:?}");
    let line = poll("the panic logged", Duration::from_secs(5), || {
        envoy
            .log()
            .lines()
            .find(|l| l.contains("redis-guard panicked"))
            .map(String::from)
    });
    assert!(line.contains("[critical]"), "{line}");
    assert!(envoy.log().contains(&format!("asked to by {TRIGGER}")));
}

fn fields(r: &RawResp) -> Vec<String> {
    let text: Vec<(String, String)> = r
        .headers
        .iter()
        .map(|(n, v)| (n.clone(), String::from_utf8_lossy(v).to_string()))
        .collect();
    rate_limit_fields(&text)
}

#[test]
fn the_release_build_has_no_panic_trigger_and_the_test_build_has_one() {
    let release = std::fs::read(wasm_path()).unwrap();
    assert!(
        !contains(&release, TRIGGER),
        "the release filter has the trigger"
    );
    let test_build = std::fs::read(trigger_wasm()).unwrap();
    assert!(contains(&test_build, TRIGGER));
}

#[test]
fn a_panic_logs_at_critical_level_and_that_workers_vm_then_fails_closed() {
    let (_redis, _webdis, upstream, mut envoy) = start(|yaml| yaml);
    // One kept-alive connection: every request on it goes to one worker.
    let mut conn = RawConn::open(envoy.port);
    let before = conn.send("GET", "/x", &[], b"");
    assert_eq!(before.status, 200);
    assert!(!fields(&before).is_empty(), "the filter decided it");
    let calls = envoy.counter("redis_guard.redis.calls");
    panic_on(&mut conn, &envoy);
    // That worker's VM is gone: Envoy answers its requests 503 itself, the
    // filter no longer runs (no Redis call) and nothing reaches the upstream.
    for _ in 0..5 {
        let r = conn.send("GET", "/x", &[], b"");
        assert_eq!((r.status, r.body.len()), (503, 0), "{r:?}");
    }
    assert_eq!(upstream.executed(), 1);
    assert_eq!(envoy.counter("redis_guard.redis.calls"), calls);
    // The other worker's VM still serves: new connections land on either
    // worker (the kernel spreads them), so one soon reaches it.
    let served = poll(
        "a request decided by the other worker",
        Duration::from_secs(30),
        || {
            let r = raw_request(envoy.port, "GET", "/x", &[], b"");
            (r.status == 200).then_some(r)
        },
    );
    assert!(!fields(&served).is_empty());
    assert!(envoy.alive(), "Envoy itself keeps running");
}

#[test]
fn with_failure_policy_open_that_workers_requests_pass_without_the_filter() {
    let policy = "failure_policy: FAIL_OPEN";
    let (_redis, _webdis, upstream, envoy) = start(|yaml| {
        let anchor = "allow_on_headers_stop_iteration: true";
        assert!(yaml.contains(anchor));
        yaml.replace(anchor, &format!("{anchor}\n                {policy}"))
    });
    let mut conn = RawConn::open(envoy.port);
    assert!(!fields(&conn.send("GET", "/x", &[], b"")).is_empty());
    let calls = envoy.counter("redis_guard.redis.calls");
    panic_on(&mut conn, &envoy);
    for _ in 0..5 {
        let r = conn.send("GET", "/x", &[], b"");
        assert_eq!(r.status, 200);
        assert_eq!(fields(&r), Vec::<String>::new(), "not limited any more");
    }
    assert_eq!(upstream.executed(), 1 + 5);
    assert_eq!(envoy.counter("redis_guard.redis.calls"), calls);
}
