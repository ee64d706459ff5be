//! Promises the README makes that no other suite shows, each through real
//! Envoys, Webdis and Redis: the object-store key kept out of Envoy's
//! `/config_dump`, the retry the default `timeoutMs` leaves room for, and
//! usage settlements sent again when Webdis refuses them before they run.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis_guard::scripts::{RATELIMIT, SETTLE};
use serde_json::{json, Value};
use support::probe::{poll, poll_eq, WebdisRefusingFirst, ENVOY_TIMER_GRANULARITY};
use support::s3::S3;
use support::*;

/// Loads the filter's scripts into Redis, so no call below meets NOSCRIPT
/// and each request's calls are exactly the ones a test counts.
fn load_scripts(redis: &Redis) {
    let mut con = redis.conn();
    for script in [&*RATELIMIT, &*SETTLE] {
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(&script.source)
            .query(&mut con)
            .unwrap();
        assert_eq!(sha, script.sha1);
    }
}

// ---------------------------------------------------------------------------
// The object-store key

#[test]
fn the_object_store_key_from_the_environment_signs_and_never_appears_in_the_config_dump() {
    let s3 = S3::start();
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let cfg = filter_config(3000)
        .object_store(&format!(
            r#"{{"cluster":"objectstore","authority":"127.0.0.1:{port}",
              "bucket":"{bucket}","region":"us-east-1","keyPrefix":"idem/","timeoutMs":10000,
              "credentials":{{"fromEnvironment":true}}}}"#,
            port = s3.port,
            bucket = s3.bucket,
        ))
        .idempotency(
            r#"[{"name":"pay","match":{"pathPrefix":"/pay"},
              "maxStoredBodyBytes":16777216,"offloadAboveBytes":1024}]"#,
        )
        .build();
    let e = Envoy::start_full(
        &cfg,
        webdis.port,
        upstream.port,
        Some(s3.port),
        &[
            ("AWS_ACCESS_KEY_ID", &s3.access_key_id),
            ("AWS_SECRET_ACCESS_KEY", &s3.secret_access_key),
        ],
        |yaml| yaml,
    );
    // A body over the threshold goes to the object store, signed with the
    // key from the environment, and its retry is replayed from there.
    let pay = || {
        http(
            "POST",
            &e.url("/pay"),
            &[
                ("idempotency-key", "k-1"),
                ("x-upstream-pad-bytes", "100000"),
            ],
            Some(b"{}"),
        )
    };
    let first = pay();
    assert_eq!(first.status, 200);
    assert!(first.body.len() > 100_000);
    let again = pay();
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(s3.keys().len(), 1, "one object");
    assert_eq!(e.counter("redis_guard.idempotency.offloaded"), 1);
    assert_eq!(e.counter("redis_guard.idempotency.object_fetched"), 1);
    assert_eq!(upstream.executed(), 1);
    // The dump holds the configuration as given: `fromEnvironment`, not
    // the key.
    let dump = get(
        &format!("http://127.0.0.1:{}/config_dump", e.admin_port),
        &[],
    );
    let dump = String::from_utf8_lossy(&dump.body);
    assert!(dump.contains("fromEnvironment"), "the filter's config");
    assert!(!dump.contains(&s3.secret_access_key), "the secret key");
    assert!(!dump.contains(&s3.access_key_id), "the key id");
}

// ---------------------------------------------------------------------------
// The default timeout

/// One sliding window, Redis reached with the default `timeoutMs`; denied
/// when Redis cannot decide.
const DEFAULT_TIMEOUT: &str = r#"{"redis":{"cluster":"webdis"},"failureMode":"deny",
  "limits":[{"name":"w","descriptor":[{"literal":"x"}],"slidingWindow":{"limit":100,"windowMs":60000}}]}"#;

#[test]
fn the_default_timeout_leaves_one_retry_so_one_refusal_costs_no_request_and_two_do() {
    let upstream = Upstream::start();
    // Refused once, as while Webdis reconnects to a restarted Redis: sent
    // again (after the first pause, or at once if that no longer fits)
    // and decided. Both calls and the pause share 50 ms: a machine that
    // stalls past them times the call out (counted as a timeout, never as
    // a refusal), which says nothing of the retry's room, so that attempt
    // is run again on fresh servers (at most three attempts).
    let mut attempt = 0;
    let (_redis, webdis, once, e, r) = loop {
        attempt += 1;
        let redis = Redis::start();
        load_scripts(&redis);
        let webdis = Webdis::start(redis.port);
        let once = WebdisRefusingFirst::start(webdis.port, 1);
        let e = Envoy::start(DEFAULT_TIMEOUT, once.port, upstream.port);
        let r = get(&e.url("/a"), &[]);
        let timed_out = e.counter("redis_guard.redis.errors_by_kind.timeout");
        if r.status == 503 && timed_out > 0 && attempt < 3 {
            eprintln!("attempt {attempt}: the 50 ms ran out on this machine; again");
            continue;
        }
        break (redis, webdis, once, e, r);
    };
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-remaining"), Some("99"));
    assert_eq!(once.calls(), 2, "refused, then decided");
    assert_eq!(e.counter("redis_guard.redis.retries"), 1);
    assert_eq!(e.counter("redis_guard.redis.errors"), 0);
    // Refused twice: the second pause (50 ms) cannot fit in the default
    // timeout, and the one retry is spent: the failure mode (deny).
    let twice = WebdisRefusingFirst::start(webdis.port, 2);
    let e = Envoy::start(DEFAULT_TIMEOUT, twice.port, upstream.port);
    let r = get(&e.url("/a"), &[]);
    assert_eq!(r.status, 503);
    assert_eq!(twice.calls(), 2, "refused twice, nothing more");
    assert_eq!(e.counter("redis_guard.redis.retries"), 1);
    assert_eq!(e.counter("redis_guard.failure_mode.denied"), 1);
    assert_eq!(upstream.executed(), 1);
}

// ---------------------------------------------------------------------------
// Settlements refused before they run

/// A stand-in in front of Webdis that refuses the calls whose index (from
/// 0, in arrival order) `refuse` names, as Webdis does without a Redis
/// connection (503, `server: Webdis`: the command never ran), and passes
/// the rest on; it notes when each call arrived and when it answered it.
struct Refusing {
    port: u16,
    exchanges: Arc<Mutex<Vec<Exchange>>>,
}

/// One call the stand-in took: when it arrived, and when the stand-in had
/// written its answer (its refusal, or Webdis' reply) back to Envoy.
#[derive(Debug, Clone, Copy)]
struct Exchange {
    arrived: Instant,
    answered: Option<Instant>,
}

impl Refusing {
    fn start(webdis_port: u16, refuse: fn(usize) -> bool) -> Refusing {
        let port = free_port();
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let exchanges: Arc<Mutex<Vec<Exchange>>> = Arc::default();
        let seen = Arc::clone(&exchanges);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let seen = Arc::clone(&seen);
                std::thread::spawn(move || Refusing::serve(conn, webdis_port, refuse, &seen));
            }
        });
        Refusing { port, exchanges }
    }

    fn serve(conn: TcpStream, webdis: u16, refuse: fn(usize) -> bool, seen: &Mutex<Vec<Exchange>>) {
        let mut out = conn.try_clone().unwrap();
        let mut from_envoy = std::io::BufReader::new(conn);
        let mut to_webdis: Option<(TcpStream, std::io::BufReader<TcpStream>)> = None;
        while let Some(request) = support::probe::read_message(&mut from_envoy) {
            let index = {
                let mut seen = seen.lock().unwrap();
                seen.push(Exchange {
                    arrived: Instant::now(),
                    answered: None,
                });
                seen.len() - 1
            };
            if refuse(index) {
                let refusal = "HTTP/1.1 503 Service Unavailable\r\n\
                               Server: Webdis\r\nContent-Length: 0\r\n\r\n";
                out.write_all(refusal.as_bytes()).unwrap();
            } else {
                let (w, r) = to_webdis.get_or_insert_with(|| {
                    let s = TcpStream::connect(("127.0.0.1", webdis)).unwrap();
                    (s.try_clone().unwrap(), std::io::BufReader::new(s))
                });
                w.write_all(&request).unwrap();
                let reply = support::probe::read_message(r).expect("webdis closed the connection");
                out.write_all(&reply).unwrap();
            }
            seen.lock().unwrap()[index].answered = Some(Instant::now());
        }
    }

    fn exchanges(&self) -> Vec<Exchange> {
        self.exchanges.lock().unwrap().clone()
    }
}

/// 100 tokens per x-user, reserving 10 and charged what the OpenAI-style
/// answer says; a token back an hour.
fn usage_config() -> String {
    filter_config(2000)
        .limits(
            r#"[{"name":"openai","match":{"pathPrefix":"/v1/chat"},"descriptor":[{"header":"x-user"}],
                 "tokenBucket":{"capacity":100,"refill":1,"periodMs":3600000},
                 "usage":{"reserve":10,
                          "json":[{"pointer":"/usage/prompt_tokens"},{"pointer":"/usage/completion_tokens"}]}}]"#,
        )
        .build()
}

/// Tokens left in `user`'s bucket (negative: debt), or `None` before any.
fn tokens(redis: &Redis, user: &str) -> Option<i64> {
    let mut con = redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*:openai:tb2.*:{}:{user}", user.len()))
        .query(&mut con)
        .unwrap();
    let (credits, _) = read_bucket(&mut con, keys.first()?)?;
    Some(credits.div_euclid(3_600_000))
}

/// A chat completion whose answer says it used `tokens` ("prompt,completion").
fn chat(e: &Envoy, user: &str, tokens: &str) -> u16 {
    http(
        "POST",
        &e.url("/v1/chat/completions"),
        &[
            ("x-user", user),
            ("x-upstream-llm", "openai-json"),
            ("x-upstream-tokens", tokens),
        ],
        Some(b"{}"),
    )
    .status
}

/// The settlement's sends after each refusal (`calls`: the decision, then
/// the settlement's sends) against the pauses: each follows its refusal by
/// the pause, not less (but for Envoy's timer granularity) and not much
/// more. "Much" is measured in the same run: `reaction`, the time Envoy took
/// with no pause from the decision's answer to the settlement's first send
/// (the request forwarded, the upstream's answer, the response, the stream's
/// end, the worker's next tick). A resend does less around its pause (it
/// reads a refusal and sends on a tick), so it may be late by four such
/// reactions (at least four timer granularities, 80 ms): room for a machine
/// slower for a moment than it was during the reaction, not for a pause
/// that is a different schedule (a resend 10 times later, or on a slow
/// timer, fails; a schedule of twice the pauses fails the 100 ms one).
fn assert_resent_on_schedule(calls: &[Exchange], pauses: &[u64]) {
    let answered = |c: &Exchange| c.answered.expect("every call answered");
    let reaction = calls[1].arrived - answered(&calls[0]);
    let slack = 4 * reaction.max(ENVOY_TIMER_GRANULARITY);
    let gaps: Vec<Duration> = calls[1..]
        .windows(2)
        .map(|w| w[1].arrived - answered(&w[0]))
        .collect();
    eprintln!(
        "reaction {reaction:?} (slack {slack:?}); sent again after {gaps:?}, pauses {pauses:?} ms"
    );
    assert_eq!(gaps.len(), pauses.len());
    for (gap, pause) in gaps.iter().zip(pauses) {
        let pause = Duration::from_millis(*pause);
        assert!(
            *gap + ENVOY_TIMER_GRANULARITY >= pause && *gap <= pause + slack,
            "sent again {gap:?} after a refusal, not after {pause:?} (within {slack:?})"
        );
    }
}

#[test]
fn a_settlement_webdis_refuses_is_sent_again_after_25_then_50_ms_and_runs_once() {
    let redis = Redis::start();
    load_scripts(&redis);
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    // Call 0 is the decision; calls 1 and 2, the settlement and its first
    // retry, are refused; call 3 runs it.
    let refusing = Refusing::start(webdis.port, |i| i == 1 || i == 2);
    let e = Envoy::start(&usage_config(), refusing.port, upstream.port);
    assert_eq!(chat(&e, "u1", "30,20"), 200);
    // Reserved 10, used 50: 40 more charged, once.
    poll_eq(
        "the settlement ran",
        Some(50),
        Duration::from_secs(10),
        || tokens(&redis, "u1"),
    );
    let calls = refusing.exchanges();
    assert_eq!(calls.len(), 4, "decision, two refusals, the settlement");
    assert_resent_on_schedule(&calls, &[25, 50]);
    // The worker's retries, not a request's: redis.retries stays.
    assert_eq!(e.counter("redis_guard.redis.retries"), 0);
    assert_eq!(e.counter("redis_guard.usage.charged_units"), 40);
    assert_eq!(e.counter("redis_guard.usage.lost"), 0);
}

#[test]
fn a_settlement_refused_four_times_is_counted_lost_and_charges_nothing_more() {
    let redis = Redis::start();
    load_scripts(&redis);
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    // The decision runs; the settlement and all three retries are refused.
    let refusing = Refusing::start(webdis.port, |i| (1..=4).contains(&i));
    let e = Envoy::start(&usage_config(), refusing.port, upstream.port);
    assert_eq!(chat(&e, "u2", "30,20"), 200);
    poll("the settlement given up", Duration::from_secs(10), || {
        (e.counter("redis_guard.usage.lost") == 1).then_some(())
    });
    let calls = refusing.exchanges();
    assert_eq!(calls.len(), 5, "decision, the settlement, three retries");
    assert_resent_on_schedule(&calls, &[25, 50, 100]);
    assert_eq!(e.counter("redis_guard.redis.retries"), 0);
    // Only the reserve was taken: the 40 units the answer charged beyond
    // it (counted as charged: what the responses said) never reached Redis.
    assert_eq!(tokens(&redis, "u2"), Some(90));
    assert_eq!(e.counter("redis_guard.usage.charged_units"), 40);
}

// ---------------------------------------------------------------------------
// The gRPC replay route

/// Sends gRPC calls to the demo upstream (it answers any POST 200), not to
/// envoy.yaml's HTTP/2 gRPC cluster; the replay route stays.
fn grpc_to_the_demo_upstream(yaml: String) -> String {
    let grpc_route = "              - match: { prefix: \"/\", grpc: {} }\n                route: { cluster: grpc_upstream, timeout: 10s }\n";
    assert_eq!(yaml.matches(grpc_route).count(), 1);
    assert_eq!(yaml.matches("path: \"/redis-guard/replay\"").count(), 1);
    yaml.replace(grpc_route, "")
}

#[test]
fn a_client_can_neither_fetch_a_stored_call_through_the_replay_route_nor_forge_a_replay() {
    // Every path is keyed, the replay route's included, per x-tenant.
    let cfg = filter_config(2000)
        .idempotency(
            r#"[{"name":"calls","match":{"pathPrefix":"/"},"tenant":[{"header":"x-tenant"}]}]"#,
        )
        .build();
    let stack = Stack::start_edited(&cfg, 1, grpc_to_the_demo_upstream);
    let e = stack.envoy();
    let call = |path: &str, key: &str, extra: &[(&str, &str)]| {
        let mut headers = vec![
            ("content-type", "application/grpc"),
            ("idempotency-key", key),
            ("x-tenant", "acme"),
        ];
        headers.extend_from_slice(extra);
        http("POST", &e.url(path), &headers, Some(b"\0\0\0\0\0"))
    };
    let create = "/shop.v1.Orders/Create";
    // A keyed call runs once; its retry goes through the replay route and
    // gets the stored answer.
    let first = call(create, "k-1", &[]);
    assert_eq!(first.status, 200);
    let retry = call(create, "k-1", &[]);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(stack.upstream.executed(), 1);
    // The same key and tenant sent to the replay route itself is another
    // request under that key (its path differs): refused in gRPC's form
    // (FAILED_PRECONDITION), nothing fetched.
    let fetch = call(
        "/redis-guard/replay",
        "k-1",
        &[("x-redis-guard-replay", "1")],
    );
    assert_eq!(
        (fetch.status, fetch.header("grpc-status")),
        (200, Some("9")),
        "{fetch:?}"
    );
    assert!(fetch.body.is_empty());
    assert_eq!(fetch.header("idempotent-replayed"), None);
    // Unkeyed, the route answers its dummy and nothing else.
    let dummy = http("POST", &e.url("/redis-guard/replay"), &[], Some(b"x"));
    assert_eq!(
        (
            dummy.status,
            dummy.body.len(),
            dummy.header("x-redis-guard-replay")
        ),
        (200, 1, Some("1")),
        "the route's one-byte dummy"
    );
    assert_eq!(dummy.header("idempotent-replayed"), None);
    assert_eq!(stack.upstream.executed(), 1, "nothing reached the service");
    // The mark in a request, or in an upstream's answer, makes nothing a
    // replay: a new key runs, and its answer is the upstream's.
    let marked = call(
        create,
        "k-2",
        &[
            ("x-redis-guard-replay", "1"),
            ("x-upstream-headers", r#"[["x-redis-guard-replay","1"]]"#),
        ],
    );
    assert_eq!(marked.status, 200);
    assert_eq!(marked.header("idempotent-replayed"), None);
    assert_eq!(stack.upstream.executed(), 2, "k-2 ran");
    assert_eq!(
        e.counter("redis_guard.idempotency.replayed"),
        1,
        "k-1's retry only"
    );
}

// ---------------------------------------------------------------------------
// gRPC statuses as a real client sees them (grpcio, as tests/e2e_grpc.rs runs
// it: envoy/grpc_peer.py serving demo.Orders, and its client)

fn python() -> std::path::PathBuf {
    root().join(".venv/bin/python")
}

/// The demo.Orders service on a free port.
fn grpc_service() -> (u16, Proc) {
    let port = free_port();
    let proc = Proc::spawn(
        "grpc service",
        std::process::Command::new(python())
            .arg(root().join("envoy/grpc_peer.py"))
            .args(["serve", "--port", &port.to_string()])
            .stdout(std::process::Stdio::null()),
    );
    wait_for_port(port, "grpc service", Duration::from_secs(20));
    (port, proc)
}

/// One unary call by grpc_peer.py's client through `port`: its code,
/// details, messages, metadata and the RetryInfo its runtime decoded.
fn grpc_call(port: u16, spec: &Value) -> Value {
    let mut cmd = std::process::Command::new(python());
    cmd.arg(root().join("envoy/grpc_peer.py"))
        .args(["call", "--target", &format!("127.0.0.1:{port}")])
        .arg(json!([spec]).to_string());
    let dir = Scratch::new("grpc-client");
    let log = dir.0.join("client.log");
    let (status, out) = run_to_exit("grpc client", &mut cmd, &log, Duration::from_secs(60));
    assert!(status.success(), "grpc client failed: {out}");
    let line = out.lines().rev().find(|l| l.starts_with('[')).unwrap();
    serde_json::from_str::<Value>(line).unwrap()[0].clone()
}

/// How many times the service ran `method`, asked of the service itself.
fn grpc_executions(service: u16, method: &str) -> u64 {
    let stats = grpc_call(service, &json!({"method": "Stats"}));
    let hex = stats["messages"][0].as_str().unwrap();
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    serde_json::from_slice::<Value>(&bytes).unwrap()[method]
        .as_u64()
        .unwrap_or(0)
}

/// envoy.yaml with its `grpc_upstream` cluster sent to `port`.
fn grpc_upstream_at(port: u16) -> impl FnOnce(String) -> String {
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

#[test]
fn a_lost_stored_call_is_data_loss_and_an_oversized_keyed_call_resource_exhausted_without_retry_info(
) {
    let s3 = S3::start();
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let (service, _service) = grpc_service();
    let cfg = filter_config(3000)
        .object_store(&format!(
            r#"{{"cluster":"objectstore","authority":"127.0.0.1:{port}",
              "bucket":"{bucket}","region":"us-east-1","keyPrefix":"idem/","timeoutMs":10000,
              "credentials":{{"fromEnvironment":true}}}}"#,
            port = s3.port,
            bucket = s3.bucket,
        ))
        .idempotency(
            r#"[{"name":"orders","match":{"pathPrefix":"/demo.Orders/"},
              "tenant":[{"header":"x-tenant"}],"maxRequestBodyBytes":64}]"#,
        )
        .build();
    let e = Envoy::start_full(
        &cfg,
        webdis.port,
        upstream.port,
        Some(s3.port),
        &[
            ("AWS_ACCESS_KEY_ID", &s3.access_key_id),
            ("AWS_SECRET_ACCESS_KEY", &s3.secret_access_key),
        ],
        grpc_upstream_at(service),
    );
    let keyed = |data: &str, key: &str| {
        json!({"method": "Create", "data": data,
               "metadata": {"idempotency-key": key, "x-tenant": "t1"}})
    };
    assert_eq!(grpc_call(e.port, &keyed("book", "k-1"))["code"], 0);
    // Its record now says its answer is in the object store, where there
    // is no such object: lost (as when a lifecycle rule removed it).
    let mut con = redis.conn();
    let records: Vec<String> = redis::cmd("KEYS").arg("rg:idem:*").query(&mut con).unwrap();
    assert_eq!(records.len(), 1);
    redis::cmd("HSET")
        .arg(&records[0])
        .arg(&[
            "b",
            "",
            "ok",
            "idem/lost",
            "oc",
            &"0".repeat(64),
            "ol",
            "16",
        ])
        .query::<()>(&mut con)
        .unwrap();
    let lost = grpc_call(e.port, &keyed("book", "k-1"));
    assert_eq!(lost["code"], 15, "DATA_LOSS: {lost}");
    assert!(
        lost["details"]
            .as_str()
            .unwrap()
            .contains("missing from the object store"),
        "{lost}"
    );
    assert_eq!(lost["retry"], Value::Null, "no RetryInfo: {lost}");
    // A keyed call over maxRequestBodyBytes: RESOURCE_EXHAUSTED, and no
    // RetryInfo (waiting would not help), before anything ran.
    let big = grpc_call(e.port, &keyed(&"x".repeat(100), "k-2"));
    assert_eq!(big["code"], 8, "RESOURCE_EXHAUSTED: {big}");
    assert_eq!(
        big["details"],
        "requests with an idempotency key may carry at most 64 bytes"
    );
    assert_eq!(big["retry"], Value::Null, "no RetryInfo: {big}");
    assert_eq!(grpc_executions(service, "Create"), 1, "only k-1 ran");
}
