//! `redis-guard doctor` against real stacks (Redis, Webdis, Envoy), each
//! wired wrong on purpose the way a copied configuration goes wrong: a
//! `redis.cluster` Envoy does not have, Webdis' credentials filter left out
//! of the cluster, credentials Webdis does not admit, no filter at all; and
//! a healthy one. With `failureMode: allow` every broken stack still
//! answers 200, which is why the doctor exists: each case asserts its exact
//! findings and exit code, and the filter's one error line at its first
//! failed call.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::process::Command;

use serde_json::Value;
use support::*;

/// The doctor's JSON and exit code for the Envoy whose admin is `admin_port`.
fn doctor(admin_port: u16, extra: &[&str]) -> (i32, Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_redis-guard"))
        .args(["--json", "doctor", "--admin"])
        .arg(format!("127.0.0.1:{admin_port}"))
        .args(extra)
        .output()
        .unwrap();
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap(), json)
}

/// The findings as (id, level, message) and each fix, in order.
fn findings(report: &Value) -> Vec<(String, String, String, Option<String>)> {
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["id"].as_str().unwrap().to_string(),
                f["level"].as_str().unwrap().to_string(),
                f["message"].as_str().unwrap().to_string(),
                f["fix"].as_str().map(String::from),
            )
        })
        .collect()
}

fn levels(report: &Value) -> Vec<(String, String)> {
    findings(report)
        .into_iter()
        .map(|(id, level, _, _)| (id, level))
        .collect()
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

/// The finding `id` (the first of that id).
fn finding(report: &Value, id: &str) -> (String, String, Option<String>) {
    findings(report)
        .into_iter()
        .find(|(i, _, _, _)| i == id)
        .map(|(_, level, message, fix)| (level, message, fix))
        .unwrap_or_else(|| panic!("no finding `{id}` in {report:#}"))
}

/// One limit on every request keyed by `x-user`, two per hour: the third
/// request of a user is rejected (never refilled while a test runs).
fn config(cluster: &str, credentials: Option<&str>) -> String {
    let credentials = credentials.map_or(String::new(), |c| format!(r#","credentials":{c}"#));
    format!(
        r#"{{"redis":{{"cluster":"{cluster}","timeoutMs":2000{credentials}}},"failureMode":"allow",
            "limits":[{{"name":"per-user","descriptor":[{{"header":"x-user"}}],
                        "tokenBucket":{{"capacity":2,"refill":1,"periodMs":3600000}}}}]}}"#
    )
}

/// Redis, Webdis, the upstream and one Envoy of one worker (each worker
/// logs its own first failure: one worker, one line), `edit` applied to
/// its envoy.yaml.
struct OneEnvoy {
    envoy: Envoy,
    _upstream: Upstream,
    _webdis: Webdis,
    redis: Redis,
}

fn start(filter_config: &str, edit: impl FnOnce(String) -> String) -> OneEnvoy {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let envoy =
        Envoy::start_edited_with_workers(filter_config, webdis.port, upstream.port, 1, edit);
    OneEnvoy {
        envoy,
        _upstream: upstream,
        _webdis: webdis,
        redis,
    }
}

/// `n` requests as `user`, each answered `status`.
fn send(envoy: &Envoy, user: &str, statuses: &[u16]) {
    for (i, want) in statuses.iter().enumerate() {
        let got = get(&envoy.url("/api/orders"), &[("x-user", user)]).status;
        assert_eq!(got, *want, "request {i} as {user}");
    }
}

/// The filter's first-failure lines in Envoy's log.
fn first_failure_lines(envoy: &Envoy) -> Vec<String> {
    envoy
        .log()
        .lines()
        .filter(|l| l.contains("redis-guard: first failed Redis call since start"))
        .map(|l| {
            let at = l.find("redis-guard: first").unwrap();
            l[at..].to_string()
        })
        .collect()
}

/// Envoy's webdis cluster with its upstream header_mutation filter (the
/// one that adds Webdis' Authorization header) cut out, as a snippet copied
/// without it has it.
fn without_credentials_filter(yaml: String) -> String {
    let from = yaml
        .find("        http_filters:\n        - name: envoy.filters.http.header_mutation")
        .expect("the webdis cluster's upstream filters");
    let end_marker = "UpstreamCodec\n";
    let to = from + yaml[from..].find(end_marker).unwrap() + end_marker.len();
    let cut = format!("{}{}", &yaml[..from], &yaml[to..]);
    assert!(!cut.contains("%ENVIRONMENT(REDIS_GUARD_WEBDIS_AUTHORIZATION)%"));
    cut
}

#[test]
fn a_healthy_stack_is_healthy_and_names_the_limit_that_fired() {
    let stack = start(&config("webdis", None), |y| y);
    let e = &stack.envoy;
    send(e, "alice", &[200, 200, 429]);
    let url = e.url("/api/orders");
    let (code, report) = doctor(
        e.admin_port,
        &[
            "--request",
            &url,
            "--header",
            "x-user: bob",
            "--redis",
            &stack.redis.admin_url(),
        ],
    );
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(
        levels(&report),
        pairs(&[
            ("filter", "ok"),
            ("cluster", "ok"),
            ("credentials", "ok"),
            ("decisions", "ok"),
            ("limits", "note"),
            ("redis", "ok"),
        ])
    );
    assert_eq!(
        finding(&report, "filter").1,
        "the filter is loaded: redis.cluster `webdis`, timeoutMs 2000, 1 limit(s), 0 idempotency rule(s)"
    );
    assert_eq!(
        finding(&report, "credentials").1,
        "calls carry Webdis credentials from redis.credentials"
    );
    assert_eq!(
        finding(&report, "decisions").1,
        format!("the request to {url} (answered 200): Redis decided 1 request(s) (1 admitted and 0 rejected by limits); the failure mode answered 0")
    );
    assert_eq!(
        finding(&report, "limits").1,
        "limits that fired since Envoy started: per-user rejected 1 of 4"
    );
    assert!(
        finding(&report, "redis")
            .1
            .starts_with("Redis answers, and holds the decision script of this version"),
        "{report:#}"
    );
    assert_eq!(report["problems"], 0);
    assert_eq!(report["request"]["calls"], 1);
    assert_eq!(first_failure_lines(e), Vec::<String>::new());
}

#[test]
fn a_redis_cluster_envoy_does_not_have_is_found_and_logged_once() {
    let stack = start(&config("webdis-typo", None), |y| y);
    let e = &stack.envoy;
    // The failure mode (allow) answers: nothing looks wrong to a client.
    send(e, "alice", &[200, 200, 200]);
    let (code, report) = doctor(e.admin_port, &[]);
    assert_eq!(code, 7, "{report:#}");
    assert_eq!(
        levels(&report),
        pairs(&[
            ("filter", "ok"),
            ("cluster", "problem"),
            ("errors", "problem"),
            ("decisions", "problem"),
            ("limits", "note"),
        ])
    );
    let (_, message, fix) = finding(&report, "cluster");
    assert_eq!(message, "redis.cluster is `webdis-typo`, and Envoy has no cluster of that name: every call is refused before it leaves Envoy");
    let fix = fix.unwrap();
    assert!(
        fix.starts_with("set redis.cluster to the Envoy cluster in front of Webdis")
            && fix.contains("objectstore, redis_guard_replay, upstream, webdis"),
        "{fix}"
    );
    let (_, message, fix) = finding(&report, "errors");
    assert_eq!(message, "since Envoy started: 3 failed Redis call(s) of kind `dispatch`: Envoy refused to send them (a cluster `webdis-typo` missing, or out of capacity)");
    assert_eq!(
        fix.unwrap(),
        "redis.cluster must name the Envoy cluster in front of Webdis (now `webdis-typo`)"
    );
    assert_eq!(
        finding(&report, "decisions").1,
        "since Envoy started: no request decided by Redis; the failure mode answered 3 (failure mode allow)"
    );
    assert_eq!(report["problems"], 3);
    // One line, at the first failure, however many requests failed.
    let lines = first_failure_lines(e);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(
        lines[0].starts_with("redis-guard: first failed Redis call since start (dispatch): dispatch to cluster `webdis-typo` refused")
            && lines[0].contains("Fix: redis.cluster is `webdis-typo`: Envoy must have a cluster of exactly that name"),
        "{}",
        lines[0]
    );
    // The text form: each problem, then its fix.
    let out = Command::new(env!("CARGO_BIN_EXE_redis-guard"))
        .args(["doctor", "--admin"])
        .arg(format!("http://127.0.0.1:{}/", e.admin_port))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7));
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[0],
        format!(
            "redis-guard doctor: Envoy admin http://127.0.0.1:{}",
            e.admin_port
        )
    );
    assert!(
        lines[1].starts_with("ok       the filter is loaded"),
        "{text}"
    );
    assert!(
        lines[2].starts_with("problem  redis.cluster is `webdis-typo`")
            && lines[3].starts_with("         fix: set redis.cluster"),
        "{text}"
    );
    assert_eq!(*lines.last().unwrap(), "3 problem(s) found");
}

#[test]
fn webdis_credentials_left_out_of_the_cluster_are_found() {
    // No redis.credentials, and the cluster's header_mutation cut out: the
    // calls reach Webdis without an Authorization header.
    let stack = start(&config("webdis", Some("null")), without_credentials_filter);
    let e = &stack.envoy;
    let (code, report) = doctor(e.admin_port, &[]);
    assert_eq!(code, 0, "nothing failed yet: a warning only: {report:#}");
    assert_eq!(
        levels(&report),
        pairs(&[
            ("filter", "ok"),
            ("cluster", "ok"),
            ("credentials", "warning"),
            ("calls", "note"),
            ("limits", "note"),
        ])
    );
    assert_eq!(
        finding(&report, "credentials").1,
        "calls carry no credentials: no redis.credentials, and the cluster `webdis` adds no Authorization header; a Webdis with http_basic_auth (envoy/webdis.json ships one) refuses them"
    );
    // One request through the doctor: refused by Webdis, taken by the
    // failure mode.
    let url = e.url("/api/orders");
    let (code, report) = doctor(
        e.admin_port,
        &["--request", &url, "--header", "x-user: alice"],
    );
    assert_eq!(code, 7, "{report:#}");
    assert_eq!(
        levels(&report),
        pairs(&[
            ("filter", "ok"),
            ("cluster", "ok"),
            ("credentials", "warning"),
            ("errors", "problem"),
            ("decisions", "problem"),
            ("limits", "note"),
        ])
    );
    let (_, message, fix) = finding(&report, "errors");
    assert_eq!(
        message,
        format!("the request to {url} (answered 200): 1 failed Redis call(s) of kind `auth`: Webdis refused them for their credentials (HTTP 401/403 on the cluster `webdis`: 1): none sent, or not the ones it admits")
    );
    assert!(fix.unwrap().starts_with(
        "copy the header_mutation upstream filter of envoy/envoy.yaml's `webdis` cluster"
    ),);
    let lines = first_failure_lines(e);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(
        lines[0].starts_with("redis-guard: first failed Redis call since start (auth): webdis refused the call (HTTP 403)"),
        "{}",
        lines[0]
    );
}

#[test]
fn credentials_webdis_does_not_admit_are_found() {
    let wrong = format!(r#"{{"username":"{WEBDIS_USERNAME}","password":"not-the-password"}}"#);
    let stack = start(&config("webdis", Some(&wrong)), |y| y);
    let e = &stack.envoy;
    send(e, "alice", &[200, 200]);
    let (code, report) = doctor(e.admin_port, &[]);
    assert_eq!(code, 7, "{report:#}");
    assert_eq!(
        levels(&report),
        pairs(&[
            ("filter", "ok"),
            ("cluster", "ok"),
            ("credentials", "ok"),
            ("errors", "problem"),
            ("decisions", "problem"),
            ("limits", "note"),
        ])
    );
    let (_, message, fix) = finding(&report, "errors");
    assert_eq!(message, "since Envoy started: 2 failed Redis call(s) of kind `auth`: Webdis refused the credentials in redis.credentials (HTTP 401/403 on the cluster `webdis`: 2)");
    assert_eq!(
        fix.unwrap(),
        "set redis.credentials to the user and password Webdis' http_basic_auth admits (envoy/webdis.json)"
    );
    let text = serde_json::to_string(&report).unwrap();
    assert!(!text.contains("not-the-password"), "no secret printed");
    assert_eq!(first_failure_lines(e).len(), 1);
}

#[test]
fn an_envoy_without_the_filter_and_an_address_without_an_envoy() {
    let stack = start(&config("webdis", None), |yaml| {
        let from = yaml
            .find("          - name: envoy.filters.http.wasm")
            .unwrap();
        let to = yaml
            .find("          - name: envoy.filters.http.router")
            .unwrap();
        format!("{}{}", &yaml[..from], &yaml[to..])
    });
    let (code, report) = doctor(stack.envoy.admin_port, &[]);
    assert_eq!(code, 7, "{report:#}");
    assert_eq!(levels(&report), pairs(&[("filter", "problem")]));
    let (_, message, fix) = finding(&report, "filter");
    assert_eq!(
        message,
        "no redis-guard filter in this Envoy: neither its configuration nor its stats"
    );
    assert!(fix.unwrap().contains("envoy/examples/minimal.yaml"));

    let nobody = free_port();
    let out = Command::new(env!("CARGO_BIN_EXE_redis-guard"))
        .args(["--json", "doctor", "--admin"])
        .arg(format!("127.0.0.1:{nobody}"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(8));
    let error: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(error["error"]["kind"], "admin");
    assert_eq!(error["error"]["exitCode"], 8);
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with(&format!(
                "Envoy's admin at http://127.0.0.1:{nobody} does not answer as one"
            )),
        "{error}"
    );
}
