//! gRPC end to end: a real gRPC service and client (grpcio, envoy/grpc_peer.py)
//! over HTTP/2 through a real Envoy running the filter, with real Webdis and
//! Redis. The client's own view is asserted: its status codes, its decoded
//! messages, its metadata, the RetryInfo its runtime parses.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use support::*;

fn python() -> std::path::PathBuf {
    root().join(".venv/bin/python")
}

/// envoy/grpc_peer.py serving demo.Orders on a free port.
struct Service {
    port: u16,
    _proc: Proc,
}

impl Service {
    fn start() -> Service {
        let port = free_port();
        let proc = Proc::spawn(
            "grpc service",
            Command::new(python())
                .arg(root().join("envoy/grpc_peer.py"))
                .args(["serve", "--port", &port.to_string()])
                .stdout(Stdio::null()),
        );
        wait_for_port(port, "grpc service", Duration::from_secs(20));
        Service { port, _proc: proc }
    }

    /// How many times `method` ran (asked of the service itself).
    fn executions(&self, method: &str) -> u64 {
        let out = calls(self.port, &[json!({"method": "Stats"})], false);
        let counts: Value = serde_json::from_slice(&unhex(&out[0]["messages"][0])).unwrap();
        counts[method].as_u64().unwrap_or(0)
    }
}

fn unhex(v: &Value) -> Vec<u8> {
    let s = v.as_str().unwrap();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Runs the gRPC client on these calls (bounded to 60 s) and returns one
/// result per call (see envoy/grpc_peer.py).
fn calls(port: u16, specs: &[Value], parallel: bool) -> Vec<Value> {
    let mut cmd = Command::new(python());
    cmd.arg(root().join("envoy/grpc_peer.py")).args([
        "call",
        "--target",
        &format!("127.0.0.1:{port}"),
    ]);
    if parallel {
        cmd.arg("--parallel");
    }
    cmd.arg(serde_json::to_string(specs).unwrap());
    let dir = Scratch::new("grpc-client");
    let log = dir.0.join("client.log");
    let (status, out) = run_to_exit("grpc client", &mut cmd, &log, Duration::from_secs(60));
    assert!(status.success(), "grpc client failed: {out}");
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with('['))
        .unwrap_or_else(|| panic!("no result: {out}"));
    serde_json::from_str(line).unwrap()
}

fn call(port: u16, spec: Value) -> Value {
    calls(port, &[spec], false).remove(0)
}

/// The rendered envoy.yaml with its `grpc_upstream` cluster sent to `port`.
fn grpc_upstream_at(port: u16) -> impl Fn(String) -> String {
    move |yaml: String| {
        let mut doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&yaml).unwrap();
        let clusters = doc["static_resources"]["clusters"]
            .as_sequence_mut()
            .unwrap();
        let cluster = clusters
            .iter_mut()
            .find(|c| c["name"] == "grpc_upstream")
            .unwrap();
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            ["socket_address"]["port_value"] = port.into();
        serde_yaml_ng::to_string(&doc).unwrap()
    }
}

struct Grpc {
    stack: Stack,
    service: Service,
}

impl Grpc {
    fn start(filter_config: &str, envoys: usize) -> Grpc {
        let service = Service::start();
        let stack = Stack::start_edited(filter_config, envoys, grpc_upstream_at(service.port));
        Grpc { stack, service }
    }

    fn port(&self, i: usize) -> u16 {
        self.stack.envoys[i].port
    }
}

/// Create calls with `x-limited` are limited to 2 a minute (keyed on the
/// method); Create calls with an idempotency-key are keyed per tenant.
fn config(failure_mode: &str) -> String {
    filter_config(3000)
        .failure_mode(failure_mode)
        .limits(
            r#"[{"name":"per-method","match":{"headers":[{"name":"x-limited","present":true}]},
                "descriptor":["grpcService","grpcMethod"],
                "tokenBucket":{"capacity":2,"refill":2,"periodMs":60000}}]"#,
        )
        .idempotency(
            r#"[{"name":"orders","match":{"pathPrefix":"/demo.Orders/"},
                "tenant":[{"header":"x-tenant"}]}]"#,
        )
        .build()
}

fn keyed(method: &str, data: &str, key: &str) -> Value {
    json!({"method": method, "data": data,
           "metadata": {"idempotency-key": key, "x-tenant": "t1"}})
}

fn meta<'a>(result: &'a Value, part: &str, name: &str) -> Option<&'a str> {
    result[part]
        .as_array()
        .unwrap()
        .iter()
        .find(|kv| kv[0] == name)
        .and_then(|kv| kv[1].as_str())
}

/// Metadata as a client compares two answers: without what is written per
/// response (the replay marker, Envoy's timing, date and server).
fn comparable(result: &Value, part: &str) -> Vec<Value> {
    result[part]
        .as_array()
        .unwrap()
        .iter()
        .filter(|kv| {
            !matches!(
                kv[0].as_str().unwrap(),
                "idempotent-replayed" | "x-envoy-upstream-service-time" | "date" | "server"
            )
        })
        .cloned()
        .collect()
}

#[test]
fn a_limited_call_gets_resource_exhausted_with_a_retry_info_the_client_parses() {
    let g = Grpc::start(&config("deny"), 1);
    let spec = json!({"method": "Create", "data": "a", "metadata": {"x-limited": "1"}});
    let out = calls(g.port(0), &[spec.clone(), spec.clone(), spec], false);
    assert_eq!(out[0]["code"], 0, "{out:?}");
    assert_eq!(out[1]["code"], 0, "{out:?}");
    let limited = &out[2];
    assert_eq!(limited["code"], 8, "RESOURCE_EXHAUSTED: {limited}");
    assert_eq!(limited["details"], "rate limit `per-method` exceeded");
    let retry = &limited["retry"];
    assert_eq!(retry["code"], 8);
    let ms = retry["ms"].as_u64().unwrap();
    // One token comes back every 30 s; the wait is that, less the moments
    // since the two calls before it spent the bucket.
    assert!((20_000..=30_000).contains(&ms), "retry delay {ms} ms");
    // The rate-limit fields are the response's metadata.
    assert_eq!(meta(limited, "trailing", "x-ratelimit-limit"), Some("2"));
    assert_eq!(
        meta(limited, "trailing", "x-ratelimit-remaining"),
        Some("0")
    );
    let retry_after: u64 = meta(limited, "trailing", "retry-after")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(retry_after, ms.div_ceil(1000));
    assert_eq!(
        g.service.executions("Create"),
        2,
        "the limited call never ran"
    );
    assert_eq!(
        g.stack.counter("redis_guard.ratelimit.per-method.rejected"),
        1
    );
}

#[test]
fn calls_are_answered_unavailable_when_redis_is_down_under_deny() {
    let mut g = Grpc::start(&config("deny"), 1);
    g.stack.redis.stop();
    let out = call(
        g.port(0),
        json!({"method": "Create", "data": "a", "metadata": {"x-limited": "1"}}),
    );
    assert_eq!(out["code"], 14, "UNAVAILABLE: {out}");
    assert_eq!(
        out["details"],
        "rate limit or idempotency backend unavailable"
    );
    assert_eq!(g.service.executions("Create"), 0);
}

#[test]
fn a_keyed_call_runs_once_and_its_retry_replays_its_message_and_metadata_exactly() {
    let g = Grpc::start(&config("deny"), 1);
    let out = calls(
        g.port(0),
        &[
            keyed("Create", "book", "k-1"),
            keyed("Create", "book", "k-1"),
        ],
        false,
    );
    let (first, retry) = (&out[0], &out[1]);
    assert_eq!(first["code"], 0, "{first}");
    assert_eq!(unhex(&first["messages"][0]), b"order 1 for book");
    assert_eq!(retry["code"], 0, "{retry}");
    assert_eq!(
        retry["messages"], first["messages"],
        "the same decoded message"
    );
    assert_eq!(comparable(retry, "trailing"), comparable(first, "trailing"));
    assert_eq!(comparable(retry, "initial"), comparable(first, "initial"));
    assert_eq!(meta(first, "initial", "x-order-id"), Some("1"));
    assert_eq!(
        meta(retry, "trailing", "x-sig-bin"),
        Some("00ff01"),
        "binary metadata kept"
    );
    assert_eq!(meta(retry, "initial", "idempotent-replayed"), Some("true"));
    assert_eq!(g.service.executions("Create"), 1, "run once");
    assert_eq!(g.stack.counter("redis_guard.idempotency.replayed"), 1);
    assert_eq!(g.stack.counter("redis_guard.idempotency.stored"), 1);
    // The retry's access-log line shows the method the client called, not
    // the replay route it went through. Its grpc_status stays empty: the
    // route needs a non-gRPC content-type, and Envoy logs a status only for
    // a gRPC request (docs/src/running/access-log.md, measured there).
    let log = access_log(&g.stack.envoys[0], 2);
    let seen: Vec<(&Value, &Value, &str)> = log
        .iter()
        .map(|l| {
            let verdict = l["redis_guard"].as_str().unwrap();
            (&l["path"], &l["grpc_status"], verdict)
        })
        .collect();
    assert_eq!(
        seen,
        [
            (
                &json!("/demo.Orders/Create"),
                &json!(0),
                r#"{"idempotency":"stored","verdict":"admitted"}"#
            ),
            (
                &json!("/demo.Orders/Create"),
                &Value::Null,
                r#"{"verdict":"replayed"}"#
            ),
        ],
        "{log:?}"
    );
}

/// An Envoy's JSON access-log lines, exactly `n` of them.
fn access_log(e: &Envoy, n: usize) -> Vec<Value> {
    let got = e.access_log(n);
    assert_eq!(got.len(), n, "{got:?}");
    got
}

#[test]
fn a_call_that_fails_internal_frees_its_key_and_its_retry_runs_again() {
    let g = Grpc::start(&config("deny"), 1);
    let out = calls(
        g.port(0),
        &[
            keyed("Create", "fail-1", "k-2"),
            keyed("Create", "fail-1", "k-2"),
        ],
        false,
    );
    for r in &out {
        assert_eq!(r["code"], 13, "INTERNAL, from the service: {r}");
        assert_eq!(r["details"], "boom");
    }
    assert_eq!(g.service.executions("Create"), 2, "the retry ran");
    assert_eq!(g.stack.counter("redis_guard.idempotency.stored"), 0);
    assert_eq!(g.stack.counter("redis_guard.idempotency.released"), 2);
}

#[test]
fn a_not_found_answer_is_stored_and_replayed_trailers_only() {
    let g = Grpc::start(&config("deny"), 1);
    let out = calls(
        g.port(0),
        &[
            keyed("Create", "missing-7", "k-3"),
            keyed("Create", "missing-7", "k-3"),
        ],
        false,
    );
    for r in &out {
        assert_eq!(r["code"], 5, "NOT_FOUND: {r}");
        assert_eq!(r["details"], "no such order");
        assert_eq!(r["messages"], json!([]));
    }
    assert_eq!(
        meta(&out[1], "trailing", "idempotent-replayed"),
        Some("true")
    );
    assert_eq!(g.service.executions("Create"), 1);
}

#[test]
fn a_key_reused_with_another_message_fails_its_precondition() {
    let g = Grpc::start(&config("deny"), 1);
    let out = calls(
        g.port(0),
        &[keyed("Create", "one", "k-4"), keyed("Create", "two", "k-4")],
        false,
    );
    assert_eq!(out[0]["code"], 0);
    assert_eq!(out[1]["code"], 9, "FAILED_PRECONDITION: {}", out[1]);
    assert!(out[1]["details"]
        .as_str()
        .unwrap()
        .contains("different request"));
    assert_eq!(g.service.executions("Create"), 1);
}

#[test]
fn concurrent_duplicates_on_two_envoys_run_once_and_the_other_is_aborted() {
    let g = Grpc::start(&config("deny"), 2);
    let mut specs = Vec::new();
    for i in 0..2 {
        let mut s = keyed("Create", "slow-1", "k-5");
        s["target"] = json!(format!("127.0.0.1:{}", g.port(i)));
        specs.push(s);
    }
    let out = calls(g.port(0), &specs, true);
    let mut codes: Vec<u64> = out.iter().map(|r| r["code"].as_u64().unwrap()).collect();
    codes.sort();
    assert_eq!(codes, [0, 10], "one ran, one ABORTED: {out:?}");
    let aborted = out.iter().find(|r| r["code"] == 10).unwrap();
    assert_eq!(meta(aborted, "trailing", "retry-after"), Some("1"));
    assert_eq!(g.service.executions("Create"), 1, "exactly one execution");
    // Once it is done, a retry on either Envoy replays it.
    let again = call(g.port(1), keyed("Create", "slow-1", "k-5"));
    assert_eq!(again["code"], 0);
    assert_eq!(unhex(&again["messages"][0]), b"order 1 for slow-1");
    assert_eq!(g.service.executions("Create"), 1);
}

#[test]
fn a_client_stream_with_a_key_is_refused_before_it_runs() {
    let g = Grpc::start(&config("deny"), 1);
    let out = call(
        g.port(0),
        json!({"method": "Upload", "kind": "client_stream", "messages": ["a", "b"],
               "metadata": {"idempotency-key": "k-6", "x-tenant": "t1"}}),
    );
    assert_eq!(out["code"], 3, "INVALID_ARGUMENT: {out}");
    assert!(
        out["details"]
            .as_str()
            .unwrap()
            .contains("unary gRPC calls"),
        "{out}"
    );
    assert_eq!(g.service.executions("Upload"), 0);
    // Without a key it is an ordinary stream.
    let plain = call(
        g.port(0),
        json!({"method": "Upload", "kind": "client_stream", "messages": ["a", "b"]}),
    );
    assert_eq!(plain["code"], 0);
    assert_eq!(unhex(&plain["messages"][0]), b"2 messages");
}

#[test]
fn a_server_stream_with_a_key_is_replayed_whole() {
    let g = Grpc::start(&config("deny"), 1);
    let spec = json!({"method": "Watch", "kind": "server_stream", "data": "w",
                      "metadata": {"idempotency-key": "k-7", "x-tenant": "t1"}});
    let out = calls(g.port(0), &[spec.clone(), spec], false);
    assert_eq!(out[0]["messages"].as_array().unwrap().len(), 3, "{out:?}");
    assert_eq!(out[1]["code"], 0);
    assert_eq!(out[1]["messages"], out[0]["messages"]);
    assert_eq!(g.service.executions("Watch"), 1);
}
