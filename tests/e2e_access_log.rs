//! The access log through a real Envoy (envoy/envoy.yaml's JSON access log
//! on stdout): every kind of answer the filter gives has its own response
//! code details, and every request it acted on carries its record
//! (`%FILTER_STATE(wasm.redis_guard:PLAIN)%`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::{Duration, Instant};

use serde_json::Value;
use support::s3::S3;
use support::*;

/// Two per x-user on /api; an idempotency rule on /pay (tenant x-tenant);
/// fail closed.
fn config() -> String {
    filter_config(1000)
        .limits(
            r#"[{"name":"per-user","match":{"pathPrefix":"/api"},"descriptor":[{"header":"x-user"}],
                 "tokenBucket":{"capacity":2,"refill":1,"periodMs":3600000}}]"#,
        )
        .idempotency(
            r#"[{"name":"pay","match":{"pathPrefix":"/pay"},"tenant":[{"header":"x-tenant"}]}]"#,
        )
        .build()
}

/// The filter's record in a line (a JSON string in the JSON line).
fn record(line: &Value) -> Value {
    serde_json::from_str(line["redis_guard"].as_str().unwrap()).unwrap()
}

fn pay(e: &Envoy, key: &str, body: &[u8]) -> Resp {
    let h = [("idempotency-key", key), ("x-tenant", "acme")];
    http("POST", &e.url("/pay/x"), &h, Some(body))
}

#[test]
fn every_answer_has_its_details_and_every_decision_its_record() {
    let mut stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    let alice = [("x-user", "alice")];
    let codes: Vec<u16> = (0..4)
        .map(|_| get(&e.url("/api/a"), &alice).status)
        .collect();
    assert_eq!(codes, [200, 200, 429, 429]);
    assert_eq!(pay(e, "k1", b"one").status, 200);
    assert_eq!(
        pay(e, "k1", b"one").header("idempotent-replayed"),
        Some("true")
    );
    assert_eq!(pay(e, "k1", b"two").status, 422);
    assert_eq!(pay(e, "", b"one").status, 400);
    let log = e.access_log(8);
    let details: Vec<&str> = log
        .iter()
        .map(|l| l["response_code_details"].as_str().unwrap())
        .collect();

    // Admitted: the limit, its units left and its key, hashed.
    for (i, left) in [(0, 1), (1, 0)] {
        assert_eq!(details[i], "via_upstream");
        let r = record(&log[i]);
        assert_eq!(r["verdict"], "admitted");
        assert_eq!(r["limit"], "per-user");
        assert_eq!(r["remaining"], left);
        let key = r["key"].as_str().unwrap();
        assert_eq!(key.len(), 16);
        assert!(!key.contains("alice"), "the value is not logged: {key}");
    }
    // Rejected by Redis, then (within its hold) by the over-limit cache.
    assert_eq!(details[2], "redis_guard_rate_limited");
    assert_eq!(record(&log[2])["verdict"], "rejected");
    assert_eq!(record(&log[2])["remaining"], 0);
    let cached = e.counter("redis_guard.overlimit_cache.rejected");
    let (want_details, want_verdict) = if cached == 1 {
        ("redis_guard_rate_limited_cached", "cached_rejection")
    } else {
        ("redis_guard_rate_limited", "rejected")
    };
    assert_eq!(
        (details[3], record(&log[3])["verdict"].as_str().unwrap()),
        (want_details, want_verdict)
    );

    // Idempotency: executed and stored, replayed, used with another body, a bad key.
    assert_eq!(record(&log[4])["idempotency"], "stored");
    assert_eq!(details[5], "redis_guard_idempotent_replay");
    assert_eq!(record(&log[5])["verdict"], "replayed");
    assert_eq!(details[6], "redis_guard_idempotency_mismatch");
    assert_eq!(record(&log[6])["verdict"], "mismatch");
    assert_eq!(details[7], "redis_guard_bad_request");
    assert_eq!(record(&log[7])["verdict"], "refused");

    // A conflict: the first attempt still runs.
    let url = e.url("/pay/slow");
    let first = std::thread::spawn(move || {
        let h = [
            ("idempotency-key", "k2"),
            ("x-tenant", "acme"),
            ("x-upstream-delay-ms", "1500"),
        ];
        http("POST", &url, &h, Some(b"x")).status
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while stack.upstream.in_flight("/pay/slow") != 1 {
        assert!(Instant::now() < deadline, "the first attempt never ran");
        std::thread::sleep(Duration::from_millis(10));
    }
    let h = [("idempotency-key", "k2"), ("x-tenant", "acme")];
    assert_eq!(
        http("POST", &e.url("/pay/slow"), &h, Some(b"x")).status,
        409
    );
    assert_eq!(first.join().unwrap(), 200);
    let log = e.access_log(10);
    let conflict = log
        .iter()
        .find(|l| l["response_code"] == 409)
        .expect("the 409's line");
    assert_eq!(
        conflict["response_code_details"],
        "redis_guard_idempotency_conflict"
    );
    assert_eq!(record(conflict)["verdict"], "conflict");

    // Redis gone: the failure mode answers, and says so.
    let url = e.url("/api/a");
    stack.redis.stop();
    let e = stack.envoy();
    assert_eq!(get(&url, &[("x-user", "bob")]).status, 503);
    let log = e.access_log(11);
    assert_eq!(
        log[10]["response_code_details"],
        "redis_guard_failure_mode_denied"
    );
    assert_eq!(record(&log[10])["verdict"], "failure_denied");
    // A request no limit or rule applies to leaves no record.
    assert_eq!(get(&e.url("/public"), &[]).status, 200);
    let log = e.access_log(12);
    assert_eq!(log[11]["redis_guard"], Value::Null);
}

#[test]
fn a_plain_key_is_logged_only_when_the_configuration_asks() {
    let cfg = filter_config(1000)
        .limits(
            r#"[{"name":"per-user","descriptor":[{"header":"x-user"}],
                 "tokenBucket":{"capacity":2,"refill":1,"periodMs":3600000}}]"#,
        )
        .field("accessLog", r#"{"key":"plain"}"#)
        .build();
    let stack = Stack::start(&cfg, 1);
    let e = stack.envoy();
    assert_eq!(get(&e.url("/x"), &[("x-user", "alice")]).status, 200);
    let log = e.access_log(1);
    let key = record(&log[0])["key"].as_str().unwrap().to_string();
    assert!(
        key.starts_with("rg:rl:") && key.ends_with(":alice"),
        "{key}"
    );
}

// ---------------------------------------------------------------------------
// Every other answer's details, each on the line of the request that caused it

/// envoy.yaml's access log with one field more, `test_id` (the request's
/// `x-test-id`), so each request's own line is found whatever the order
/// the workers wrote them in (Envoy makes its own `x-request-id`).
fn with_test_id(yaml: String) -> String {
    let field = "                  request_id: \"%REQ(X-REQUEST-ID)%\"\n";
    assert_eq!(yaml.matches(field).count(), 1, "envoy.yaml's request_id");
    yaml.replace(
        field,
        &format!("{field}                  test_id: \"%REQ(X-TEST-ID)%\"\n"),
    )
}

/// The access-log line of the request sent with `x-test-id: id` (bounded
/// wait: Envoy flushes its log every 100 ms in the tests).
fn line_of(e: &Envoy, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found: Vec<Value> = e
            .log()
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|l| l["test_id"] == id)
            .collect();
        assert!(found.len() <= 1, "{id}: {found:?}");
        if let Some(line) = found.into_iter().next() {
            return line;
        }
        assert!(Instant::now() < deadline, "no access-log line for {id}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The request's status, and its line's status, details and verdict.
fn logged(e: &Envoy, id: &str, status: u16) -> (u64, String, Value) {
    let line = line_of(e, id);
    assert_eq!(line["response_code"], status, "{id}: {line}");
    let details = line["response_code_details"].as_str().unwrap().to_string();
    let verdict = match line["redis_guard"].as_str() {
        Some(_) => record(&line)["verdict"].clone(),
        None => Value::Null,
    };
    (line["response_code"].as_u64().unwrap(), details, verdict)
}

#[test]
fn a_deny_rule_a_body_too_large_and_the_local_budget_log_their_details() {
    let cfg = filter_config(1000)
        .field(
            "deny",
            r#"[{"name":"revoked","match":{"headers":[{"name":"x-api-key","oneOf":["k-leaked"]}]}}]"#,
        )
        .limits(
            r#"[{"name":"api","match":{"pathPrefix":"/local"},"descriptor":[{"literal":"all"}],
                 "failureMode":"local","localFraction":0.1,
                 "slidingWindow":{"limit":10,"windowMs":60000}}]"#,
        )
        .idempotency(
            r#"[{"name":"pay","match":{"pathPrefix":"/pay"},"tenant":[{"header":"x-tenant"}],
                 "maxRequestBodyBytes":16}]"#,
        )
        .build();
    let mut stack = Stack::start_edited(&cfg, 1, with_test_id);
    let url = |path: &str| stack.envoy().url(path);

    let denied = get(
        &url("/any"),
        &[("x-api-key", "k-leaked"), ("x-test-id", "deny")],
    );
    assert_eq!(denied.status, 403);
    let h = [
        ("idempotency-key", "k1"),
        ("x-tenant", "acme"),
        ("x-test-id", "large"),
    ];
    let large = http("POST", &url("/pay/x"), &h, Some(&[b'x'; 17]));
    assert_eq!(large.status, 413);
    assert_eq!(stack.upstream.executed(), 0, "neither was forwarded");

    // Redis gone: the local budget (a tenth of 10, for the Envoy's workers
    // together) admits one, then refuses.
    let (local_ok, local_refused) = (url("/local"), url("/local"));
    stack.redis.stop();
    assert_eq!(get(&local_ok, &[("x-test-id", "local-1")]).status, 200);
    let refused = get(&local_refused, &[("x-test-id", "local-2")]);
    assert_eq!(refused.status, 429);

    let e = stack.envoy();
    assert_eq!(
        logged(e, "deny", 403),
        (403, "redis_guard_denied".into(), "denied".into())
    );
    assert_eq!(
        logged(e, "large", 413),
        (
            413,
            "redis_guard_request_too_large".into(),
            "refused".into()
        )
    );
    // Both decided by the failure mode: the first forwarded, the second
    // refused by the local budget.
    assert_eq!(
        logged(e, "local-1", 200),
        (200, "via_upstream".into(), "failure_local".into())
    );
    assert_eq!(
        logged(e, "local-2", 429),
        (
            429,
            "redis_guard_rate_limited_locally".into(),
            "failure_local".into()
        )
    );
}

/// A keyed POST to /pay/order whose upstream answers `bytes` bytes.
fn keyed(e: &Envoy, key: &str, bytes: usize, id: &str) -> Resp {
    let n = bytes.to_string();
    let h = [
        ("idempotency-key", key),
        ("x-tenant", "acme"),
        ("x-upstream-binary-bytes", &n),
        ("x-test-id", id),
    ];
    http("POST", &e.url("/pay/order"), &h, Some(b"{\"amount\":10}"))
}

#[test]
fn a_completed_key_whose_response_cannot_be_served_logs_why() {
    const THRESHOLD: usize = 64 << 10;
    let mut s3 = S3::start();
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let cfg = filter_config(3000)
        .object_store(&format!(
            r#"{{"cluster":"objectstore","authority":"127.0.0.1:{port}",
              "bucket":"{bucket}","region":"us-east-1","keyPrefix":"idem/","timeoutMs":10000,
              "credentials":{{"accessKeyId":"{id}","secretAccessKey":"{secret}"}}}}"#,
            port = s3.port,
            bucket = s3.bucket,
            id = s3.access_key_id,
            secret = s3.secret_access_key,
        ))
        .idempotency(&format!(
            r#"[{{"name":"pay","match":{{"pathPrefix":"/pay"}},"tenant":[{{"header":"x-tenant"}}],
              "maxStoredBodyBytes":16777216,"offloadAboveBytes":{THRESHOLD}}}]"#
        ))
        .build();
    let e = Envoy::start_full(
        &cfg,
        webdis.port,
        upstream.port,
        Some(s3.port),
        &[],
        with_test_id,
    );
    let mut con = redis.conn();
    let records = |con: &mut redis::Connection| -> Vec<String> {
        redis::cmd("KEYS").arg("rg:idem:*").query(con).unwrap()
    };

    // A large response in the object store, replayed from it, then
    // altered there (same length, one byte flipped), then deleted.
    let first = keyed(&e, "order-1", 512 << 10, "run-1");
    assert_eq!(first.status, 200);
    let replayed = keyed(&e, "order-1", 512 << 10, "replayed");
    assert_eq!(replayed.body, first.body);
    let (object, _) = s3.keys().pop().unwrap();
    let mut altered = first.body.clone();
    altered[1000] ^= 0x01;
    s3.put(&object, &altered);
    assert_eq!(keyed(&e, "order-1", 512 << 10, "corrupt").status, 502);
    s3.delete(&object);
    assert_eq!(keyed(&e, "order-1", 512 << 10, "missing").status, 502);

    // Small responses in Redis, each record then made unreadable: its
    // stored headers (a length longer than what follows), its status (no
    // HTTP status).
    for (key, field, value) in [("order-2", "h", "99:x"), ("order-4", "st", "700")] {
        let before = records(&mut con);
        assert_eq!(keyed(&e, key, 100, &format!("run-{key}")).status, 200);
        let added: Vec<String> = records(&mut con)
            .into_iter()
            .filter(|k| !before.contains(k))
            .collect();
        assert_eq!(added.len(), 1, "{added:?}");
        redis::cmd("HSET")
            .arg(&added[0])
            .arg(field)
            .arg(value)
            .query::<()>(&mut con)
            .unwrap();
        let r = keyed(&e, key, 100, &format!("unreadable-{field}"));
        assert_eq!(r.status, 503, "{key}");
    }

    // Another large one, then the object store gone.
    assert_eq!(keyed(&e, "order-3", 512 << 10, "run-3").status, 200);
    s3.stop();
    assert_eq!(keyed(&e, "order-3", 512 << 10, "unavailable").status, 503);
    assert_eq!(upstream.executed(), 4, "no completed key ran again");

    // The verdict is what the client got: known once the body came back
    // from the store (or did not), not when Redis said "completed".
    assert_eq!(
        logged(&e, "replayed", 200),
        (
            200,
            "redis_guard_idempotent_replay".into(),
            "replayed".into()
        )
    );
    for (id, status, details) in [
        ("corrupt", 502, "redis_guard_stored_response_corrupt"),
        ("missing", 502, "redis_guard_stored_response_missing"),
        (
            "unreadable-h",
            503,
            "redis_guard_stored_response_unreadable",
        ),
        (
            "unreadable-st",
            503,
            "redis_guard_stored_response_unreadable",
        ),
        (
            "unavailable",
            503,
            "redis_guard_stored_response_unavailable",
        ),
    ] {
        assert_eq!(
            logged(&e, id, status),
            (u64::from(status), details.into(), "replay_failed".into()),
            "{id}"
        );
    }
}

/// envoy.yaml without its replay route, and with gRPC calls sent to the
/// demo upstream (it answers any POST 200) instead of its gRPC cluster.
fn no_replay_route(yaml: String) -> String {
    let yaml = with_test_id(yaml);
    let routes = [
        "              - match: { path: \"/redis-guard/replay\" }\n                route: { cluster: redis_guard_replay, timeout: 5s }\n",
        "              - match: { prefix: \"/\", grpc: {} }\n                route: { cluster: grpc_upstream, timeout: 10s }\n",
    ];
    routes.iter().fold(yaml, |yaml, route| {
        assert_eq!(yaml.matches(route).count(), 1, "{route}");
        yaml.replace(route, "")
    })
}

#[test]
fn a_grpc_replay_without_the_replay_route_logs_why() {
    let cfg = filter_config(2000)
        .idempotency(
            r#"[{"name":"calls","match":{"pathPrefix":"/shop."},"tenant":[{"header":"x-tenant"}]}]"#,
        )
        .build();
    let stack = Stack::start_edited(&cfg, 1, no_replay_route);
    let e = stack.envoy();
    let call = |id: &str| {
        let h = [
            ("content-type", "application/grpc"),
            ("idempotency-key", "k-1"),
            ("x-tenant", "acme"),
            ("x-test-id", id),
        ];
        http(
            "POST",
            &e.url("/shop.v1.Orders/Create"),
            &h,
            Some(b"\0\0\0\0\0"),
        )
    };
    assert_eq!(call("run").status, 200);
    // The retry is owed the stored messages: with no route to replay them
    // through, it is answered UNAVAILABLE, and never run again.
    let retry = call("retry");
    assert_eq!(
        (retry.status, retry.header("grpc-status")),
        (200, Some("14")),
        "{retry:?}"
    );
    assert_eq!(stack.upstream.executions_of("/shop.v1.Orders/Create"), 1);
    // Its line: the path the client called (not the replay route's), the
    // details and the 200 that carries a gRPC error. No grpc_status: the
    // filter gave the request a non-gRPC content-type for the replay route,
    // and Envoy logs a status only for a gRPC request (measured and
    // explained in docs/src/running/access-log.md).
    let line = line_of(e, "retry");
    assert_eq!(
        (
            &line["path"],
            &line["response_code"],
            &line["response_code_details"],
            &line["grpc_status"],
        ),
        (
            &Value::from("/shop.v1.Orders/Create"),
            &Value::from(200),
            &Value::from("redis_guard_replay_route_missing"),
            &Value::Null,
        ),
        "{line}"
    );
    assert_eq!(record(&line)["verdict"], "replay_failed", "{line}");
}
