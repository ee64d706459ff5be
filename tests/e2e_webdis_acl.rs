//! The shipped Webdis configuration (envoy/webdis.json, rendered as the demo,
//! compose and every other test render it) in front of a real Redis: its ACL
//! answers every command Redis knows with 403, except EVAL and EVALSHA, and a
//! refused command never reaches Redis.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::*;

/// Sends one command to Webdis as the filter does (POSTed, raw output) and
/// as a URL path (GET), and returns both statuses.
fn statuses(webdis: &Webdis, command: &str) -> (u16, u16) {
    let base = format!("http://127.0.0.1:{}/", webdis.port);
    let body = format!("{command}.raw");
    let posted = http("POST", &base, &[], Some(body.as_bytes())).status;
    let path = get(&format!("{base}{command}.raw"), &[]).status;
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
    let base = format!("http://127.0.0.1:{}/", webdis.port);
    for body in [
        "EVAL/return%207/0.raw".to_string(),
        "eval/return%207/0.raw".to_string(),
        format!("EVALSHA/{sha}/0.raw"),
        format!("EvalSha/{sha}/0.raw"),
    ] {
        let r = http("POST", &base, &[], Some(body.as_bytes()));
        assert_eq!(
            (r.status, r.body.as_slice()),
            (200, &b":7\r\n"[..]),
            "{body}"
        );
    }
}
