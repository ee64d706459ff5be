//! The shipped Webdis configuration (envoy/webdis.json, rendered as the demo,
//! compose and every other test render it) in front of a real Redis: without
//! its HTTP Basic credentials it answers every command with 403, EVAL
//! included; with them, every command Redis knows but EVAL and EVALSHA; a
//! refused command never reaches Redis. And the filter with wrong
//! credentials: the failure mode, counted as `auth`, the secret in no log.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::*;

/// Sends one command to Webdis as the filter does (POSTed, raw output) and
/// as a URL path (GET), with the credentials the filter has, and returns
/// both statuses.
fn statuses(webdis: &Webdis, command: &str) -> (u16, u16) {
    let base = format!("http://127.0.0.1:{}/", webdis.port);
    let body = format!("{command}.raw");
    let auth = webdis_authorization();
    let headers = [("authorization", auth.as_str())];
    let posted = http("POST", &base, &headers, Some(body.as_bytes())).status;
    let path = get(&format!("{base}{command}.raw"), &headers).status;
    (posted, path)
}

#[test]
fn the_shipped_webdis_acl_refuses_every_command_but_eval_and_evalsha() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let mut con = redis.conn();
    // State a refused command would change if it ran.
    redis::cmd("SET")
        .arg("canary")
        .arg("kept")
        .query::<()>(&mut con)
        .unwrap();
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg("return 7")
        .query(&mut con)
        .unwrap();
    let policy = || -> Vec<String> {
        redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query(&mut redis.conn())
            .unwrap()
    };
    let policy_before = policy();

    // Every command this Redis has, bare (a command that ran would answer
    // an error reply with 200 at worst), plus ones with arguments that would
    // change the state above.
    let mut commands: Vec<String> = redis::cmd("COMMAND").arg("LIST").query(&mut con).unwrap();
    assert!(commands.len() > 200, "{commands:?}");
    commands.sort();
    commands.extend(
        [
            "SET/canary/changed",
            "DEL/canary",
            "FLUSHALL",
            "KEYS/*",
            "CONFIG/SET/maxmemory-policy/allkeys-lru",
            "SCRIPT/FLUSH",
            "get/canary",
            "Set/canary/changed",
        ]
        .map(String::from),
    );
    let mut answered = Vec::new();
    for command in &commands {
        match statuses(&webdis, command) {
            (403, 403) => {}
            other => answered.push(format!("{command}: {other:?}")),
        }
    }
    assert_eq!(answered, ["eval: (200, 200)", "evalsha: (200, 200)"]);

    // Nothing refused reached Redis.
    let canary: Option<String> = redis::cmd("GET").arg("canary").query(&mut con).unwrap();
    assert_eq!(canary.as_deref(), Some("kept"));
    let exists: Vec<i64> = redis::cmd("SCRIPT")
        .arg("EXISTS")
        .arg(&sha)
        .query(&mut con)
        .unwrap();
    assert_eq!(exists, [1]);
    assert_eq!(policy(), policy_before);

    // The two allowed ones run, in any letter case, as the filter sends them.
    for body in [
        "EVAL/return%207/0.raw".to_string(),
        "eval/return%207/0.raw".to_string(),
        format!("EVALSHA/{sha}/0.raw"),
        format!("EvalSha/{sha}/0.raw"),
    ] {
        let r = webdis.post(body.as_bytes());
        assert_eq!(
            (r.status, r.body.as_slice()),
            (200, &b":7\r\n"[..]),
            "{body}"
        );
    }
}

#[test]
fn without_its_credentials_webdis_runs_nothing_not_even_eval() {
    use base64::Engine;
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let base = format!("http://127.0.0.1:{}/", webdis.port);
    let basic = |pair: &str| {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(pair)
        )
    };
    let wrong = [
        None,
        Some(basic(&format!("{WEBDIS_USERNAME}:not-the-password"))),
        Some(basic(&format!("someone:{WEBDIS_PASSWORD}"))),
        Some(basic(WEBDIS_PASSWORD)),
        Some(format!("Bearer {WEBDIS_PASSWORD}")),
    ];
    // A script that would write a key if it ran.
    let body = "EVAL/redis.call('SET',KEYS[1],'owned')/1/rg%3Acanary.raw";
    for auth in &wrong {
        let headers: Vec<(&str, &str)> =
            auth.iter().map(|a| ("authorization", a.as_str())).collect();
        let posted = http("POST", &base, &headers, Some(body.as_bytes())).status;
        let path = get(&format!("{base}{body}"), &headers).status;
        assert_eq!((posted, path), (403, 403), "{auth:?}");
    }
    let mut con = redis.conn();
    let n: i64 = redis::cmd("DBSIZE").query(&mut con).unwrap();
    assert_eq!(n, 0, "nothing ran");
    // The right ones run it.
    let r = webdis.post(body.as_bytes());
    assert_eq!(r.status, 200);
    let v: String = redis::cmd("GET").arg("rg:canary").query(&mut con).unwrap();
    assert_eq!(v, "owned");
}

#[test]
fn the_filter_with_wrong_credentials_takes_its_failure_mode_counted_as_auth() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let secret = "NEVER-LOG-THIS-PASSWORD";
    let limits = r#"[{"name":"all","tokenBucket":{"capacity":100,"refill":1,"periodMs":1000}}]"#;
    let config = |mode: &str, credentials: &str| {
        format!(
            r#"{{"redis":{{"cluster":"webdis","timeoutMs":2000,"credentials":{credentials}}},
                "failureMode":"{mode}","limits":{limits}}}"#
        )
    };
    let wrong = format!(r#"{{"username":"{WEBDIS_USERNAME}","password":"{secret}"}}"#);
    let deny = Envoy::start(&config("deny", &wrong), webdis.port, upstream.port);
    for _ in 0..3 {
        assert_eq!(get(&deny.url("/x"), &[]).status, 503);
    }
    assert_eq!(deny.counter("redis_guard.redis.errors_by_kind.auth"), 3);
    assert_eq!(deny.counter("redis_guard.redis.errors_by_kind.http"), 0);
    let allow = Envoy::start(&config("allow", "null"), webdis.port, upstream.port);
    assert_eq!(get(&allow.url("/x"), &[]).status, 200, "allow: forwarded");
    assert_eq!(allow.counter("redis_guard.redis.errors_by_kind.auth"), 1);
    assert_eq!(upstream.executed(), 1);
    use base64::Engine;
    let encoded =
        base64::engine::general_purpose::STANDARD.encode(format!("{WEBDIS_USERNAME}:{secret}"));
    let log = deny.log();
    assert!(log.contains("redis.credentials"), "one clear line: {log}");
    assert!(
        !log.contains(secret) && !log.contains(&encoded),
        "a secret at info level"
    );
    // At debug level Envoy itself prints every header of every request it
    // sends, the callout's Authorization too (envoyproxy/envoy#9652: no
    // redaction); the filter's own lines never carry it.
    deny.set_log_level("debug");
    assert_eq!(get(&deny.url("/x"), &[]).status, 503);
    let log = deny.log();
    let filter_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("[wasm]") && (l.contains(secret) || l.contains(&encoded)))
        .collect();
    assert!(filter_lines.is_empty(), "{filter_lines:#?}");
    for line in log.lines().filter(|l| l.contains(&encoded)) {
        assert_eq!(
            line.trim(),
            format!("'authorization', 'Basic {encoded}'"),
            "only Envoy's header dump"
        );
    }
    assert!(
        !log.contains(secret),
        "the password itself is never written"
    );
}

#[test]
fn credentials_added_by_envoys_webdis_cluster_decide_and_never_reach_the_debug_log() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    // The filter sends no credentials; envoy.yaml's webdis cluster adds the
    // header from Envoy's environment, as the demo and compose run it.
    let config = |mode: &str| {
        format!(
            r#"{{"redis":{{"cluster":"webdis","timeoutMs":2000,"credentials":null}},
                "failureMode":"{mode}","limits":[{{"name":"all","descriptor":[{{"header":"x-user"}}],
                "tokenBucket":{{"capacity":3,"refill":1,"periodMs":3600000}}}}]}}"#
        )
    };
    let authorization = webdis_authorization();
    let right = Envoy::start_full(
        &config("deny"),
        webdis.port,
        upstream.port,
        None,
        &[("REDIS_GUARD_WEBDIS_AUTHORIZATION", &authorization)],
        |y| y,
    );
    use base64::Engine;
    let wrong_secret = "NEVER-LOG-THIS-ONE-EITHER";
    let wrong_basic = base64::engine::general_purpose::STANDARD
        .encode(format!("{WEBDIS_USERNAME}:{wrong_secret}"));
    let wrong = Envoy::start_full(
        &config("deny"),
        webdis.port,
        upstream.port,
        None,
        &[(
            "REDIS_GUARD_WEBDIS_AUTHORIZATION",
            &format!("Basic {wrong_basic}"),
        )],
        |y| y,
    );
    for e in [&right, &wrong] {
        e.set_log_level("debug");
    }
    let statuses: Vec<u16> = (0..4)
        .map(|_| get(&right.url("/x"), &[("x-user", "a")]).status)
        .collect();
    assert_eq!(statuses, [200, 200, 200, 429], "decided by Redis, exactly");
    assert_eq!(right.counter("redis_guard.redis.errors"), 0);
    assert_eq!(get(&wrong.url("/x"), &[("x-user", "a")]).status, 503);
    assert_eq!(wrong.counter("redis_guard.redis.errors_by_kind.auth"), 1);
    // Envoy's debug log dumps each callout's headers (the router's), which
    // here carry no credentials: the header is added after that dump.
    let encoded = authorization.trim_start_matches("Basic ");
    let log = right.log();
    assert!(
        log.contains("router decoding headers"),
        "a debug log: {log}"
    );
    assert!(
        !log.contains(encoded) && !log.contains(WEBDIS_PASSWORD),
        "a secret in the debug log"
    );
    let log = wrong.log();
    assert!(log.contains("redis.credentials"), "the one clear line");
    assert!(!log.contains(&wrong_basic) && !log.contains(wrong_secret));
    // Nor does the config dump hold it: only the placeholder.
    let dump = get(
        &format!("http://127.0.0.1:{}/config_dump", right.admin_port),
        &[],
    );
    let dump = String::from_utf8_lossy(&dump.body);
    assert!(dump.contains("%ENVIRONMENT(REDIS_GUARD_WEBDIS_AUTHORIZATION)%"));
    assert!(!dump.contains(encoded) && !dump.contains(WEBDIS_PASSWORD));
}
