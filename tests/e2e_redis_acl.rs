//! The least-privilege Redis user (envoy/redis.acl) with real processes:
//! Webdis connects as Redis' default user, which may run EVAL/EVALSHA and,
//! inside scripts, only the commands lua/*.lua call, on `rg:` keys only.
//! The filter decides through it as before; someone holding the Webdis
//! credentials and the Redis password cannot reach other data or
//! administrative commands, in a script or outside one.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeSet;

use support::*;

struct Restricted {
    redis: Redis,
    webdis: Webdis,
    upstream: Upstream,
}

impl Restricted {
    fn start() -> Restricted {
        let redis = Redis::start_restricted();
        let webdis = Webdis::start_with_redis_auth(redis.port, Some(REDIS_PASSWORD));
        webdis.wait_until_redis_answers();
        Restricted {
            redis,
            webdis,
            upstream: Upstream::start(),
        }
    }

    /// A command sent to Webdis with its credentials, as one who stole them:
    /// (HTTP status, Redis' raw reply).
    fn webdis(&self, command: &str) -> (u16, String) {
        let r = self.webdis.post(format!("{command}.raw").as_bytes());
        (r.status, String::from_utf8_lossy(&r.body).into_owned())
    }
}

fn config(prefix: &str) -> String {
    filter_config(3000)
        .field("keyPrefix", &format!("\"{prefix}\""))
        .limits(
            r#"[{"name":"per-user","descriptor":[{"header":"x-user"}],
                "tokenBucket":{"capacity":3,"refill":1,"periodMs":3600000}},
               {"name":"slots","match":{"pathPrefix":"/slow"},"concurrency":{"max":5}},
               {"name":"gcra","match":{"pathPrefix":"/gcra"},"gcra":{"rate":2,"periodMs":3600000,"burst":2}},
               {"name":"window","match":{"pathPrefix":"/window"},"slidingWindow":{"limit":2,"windowMs":3600000}}]"#,
        )
        .idempotency(r#"[{"name":"pay","match":{"pathPrefix":"/pay"}}]"#)
        .build()
}

#[test]
fn the_filter_decides_through_the_restricted_user_as_before() {
    let s = Restricted::start();
    let e = Envoy::start(&config("rg"), s.webdis.port, s.upstream.port);
    let user = [("x-user", "alice")];
    let statuses: Vec<u16> = (0..4).map(|_| get(&e.url("/a"), &user).status).collect();
    assert_eq!(statuses, [200, 200, 200, 429], "the budget, exact");
    for path in ["/gcra", "/window"] {
        let st: Vec<u16> = (0..3).map(|_| get(&e.url(path), &user).status).collect();
        assert_eq!(st[2], 429, "{path}: {st:?}");
    }
    assert_eq!(
        get(&e.url("/slow"), &user).status,
        429,
        "alice's budget is spent"
    );
    assert_eq!(get(&e.url("/slow"), &[("x-user", "bob")]).status, 200);
    let pay = |body: &[u8]| {
        http(
            "POST",
            &e.url("/pay"),
            &[("idempotency-key", "k1"), ("x-user", "carol")],
            Some(body),
        )
    };
    let first = pay(b"{}");
    assert_eq!(first.status, 200);
    let retry = pay(b"{}");
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(pay(b"{\"other\":1}").status, 422);
    assert_eq!(e.counter("redis_guard.redis.errors"), 0);
    // Every key it wrote is under the prefix the user is limited to.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query(&mut s.redis.conn())
        .unwrap();
    assert!(!keys.is_empty());
    assert!(keys.iter().all(|k| k.starts_with("rg:")), "{keys:?}");
}

#[test]
fn with_the_webdis_credentials_nothing_outside_the_scripts_reach_runs() {
    let s = Restricted::start();
    let mut admin = s.redis.conn();
    redis::cmd("SET")
        .arg("other:canary")
        .arg("kept")
        .query::<()>(&mut admin)
        .unwrap();
    redis::cmd("SET")
        .arg("rg:x")
        .arg("1")
        .query::<()>(&mut admin)
        .unwrap();
    let refused = [
        // A key outside the prefix, written from a script.
        "EVAL/redis.call('SET','other:canary','owned')/0",
        "EVAL/redis.call('SET',KEYS[1],'owned')/1/other%3Acanary",
        // Administration and enumeration, from a script.
        "EVAL/return redis.call('CONFIG','GET','requirepass')/0",
        "EVAL/return redis.call('KEYS','*')/0",
        "EVAL/return redis.call('FLUSHALL')/0",
        "EVAL/return redis.call('SCAN','0')/0",
        "EVAL/return redis.call('ACL','LIST')/0",
        "EVAL/return redis.call('GET','other:canary')/0",
    ];
    for command in refused {
        let (status, reply) = s.webdis(command);
        assert_eq!(status, 200, "{command}: Webdis passes EVAL on");
        // NOPERM, or from inside a script an ERR saying the same (CONFIG
        // and ACL are refused to every script whatever the user).
        assert!(server::refused_by_acl(&reply), "{command}: {reply}");
    }
    // Not EVAL: Webdis' own ACL refuses them before Redis sees them.
    for command in ["FLUSHALL", "KEYS/*", "CONFIG/GET/requirepass"] {
        assert_eq!(s.webdis(command).0, 403, "{command}");
    }
    // Straight to Redis with the password Webdis uses: the same user.
    let mut direct = redis::Client::open(format!(
        "redis://default:{REDIS_PASSWORD}@127.0.0.1:{}/",
        s.redis.port
    ))
    .unwrap()
    .get_connection()
    .unwrap();
    for cmd in [
        redis::cmd("FLUSHALL"),
        redis::cmd("KEYS").arg("*").clone(),
        redis::cmd("CONFIG").arg("GET").arg("*").clone(),
        redis::cmd("GET").arg("other:canary").clone(),
        redis::cmd("SET").arg("other:new").arg("1").clone(),
    ] {
        let e = cmd.query::<redis::Value>(&mut direct).expect_err("refused");
        assert!(e.to_string().contains("NOPERM"), "{e}");
    }
    // Under the prefix it may do what the scripts do (a stolen password
    // still reaches the limiter's own keys: README "Threat model").
    let x: String = redis::cmd("GET").arg("rg:x").query(&mut direct).unwrap();
    assert_eq!(x, "1");
    // Nothing changed.
    let canary: String = redis::cmd("GET")
        .arg("other:canary")
        .query(&mut admin)
        .unwrap();
    assert_eq!(canary, "kept");
    let keys: BTreeSet<String> = redis::cmd("KEYS").arg("*").query(&mut admin).unwrap();
    assert_eq!(
        keys,
        BTreeSet::from(["other:canary".to_string(), "rg:x".to_string()])
    );
    // What the user is for still runs.
    let (status, reply) = s.webdis("EVAL/return redis.call('GET',KEYS[1])/1/rg%3Ax");
    assert_eq!((status, reply.as_str()), (200, "$1\r\n1\r\n"));
}

#[test]
fn a_filter_writing_outside_the_users_keys_takes_its_failure_mode_counted_as_auth() {
    let s = Restricted::start();
    let e = Envoy::start(&config("elsewhere"), s.webdis.port, s.upstream.port);
    assert_eq!(get(&e.url("/a"), &[("x-user", "alice")]).status, 503);
    assert_eq!(e.counter("redis_guard.redis.errors_by_kind.auth"), 1);
    assert!(e
        .log()
        .contains("the Redis user Webdis connects as may not do this"));
    let n: i64 = redis::cmd("DBSIZE").query(&mut s.redis.conn()).unwrap();
    assert_eq!(n, 0);
}

#[test]
fn a_command_the_user_may_not_run_inside_a_script_takes_its_failure_mode_counted_as_auth() {
    let s = Restricted::start();
    // The user loses TIME, which every script calls: EVAL is admitted and
    // the server refuses the command inside the script, in its own words.
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("-time")
        .query(&mut s.redis.conn())
        .unwrap();
    let e = Envoy::start(&config("rg"), s.webdis.port, s.upstream.port);
    assert_eq!(get(&e.url("/a"), &[("x-user", "alice")]).status, 503);
    let log = e.log();
    assert_eq!(
        (
            e.counter("redis_guard.redis.errors_by_kind.auth"),
            e.counter("redis_guard.redis.errors_by_kind.redis")
        ),
        (1, 0),
        "{log}"
    );
    assert!(log.contains("the Redis user Webdis connects as may not do this"));
}

#[test]
fn the_acl_allows_exactly_the_commands_the_scripts_call() {
    let acl = std::fs::read_to_string(root().join("envoy/redis.acl")).unwrap();
    let default = acl
        .lines()
        .find(|l| l.starts_with("user default "))
        .unwrap();
    let allowed: BTreeSet<String> = default
        .split_whitespace()
        .filter_map(|w| w.strip_prefix('+'))
        .map(str::to_uppercase)
        .collect();
    // PEXPIREAT: how Redis writes a script's PEXPIRE to its append-only
    // file, which it checks against this user's ACL when it loads it again.
    let mut called: BTreeSet<String> = ["EVAL", "EVALSHA", "PEXPIREAT"].map(String::from).into();
    let call = regex::Regex::new(r"redis\.p?call\('([A-Za-z]+)'").unwrap();
    // Every way a script can reach redis.call or redis.pcall, literal
    // command or not (a call, a reference passed on, an index by string).
    let site = regex::Regex::new(r#"redis\s*(\.\s*|\[\s*['"])p?call\b"#).unwrap();
    let computed = "redis.call(cmd, k) local f = redis['pcall'] redis.pcall('GET', k)";
    assert_eq!(
        (
            call.find_iter(computed).count(),
            site.find_iter(computed).count()
        ),
        (1, 3),
        "the patterns tell a computed command name from a literal one"
    );
    let mut sites = 0;
    for entry in std::fs::read_dir(root().join("lua")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let literal = call.captures_iter(&text).count();
        let all = site.find_iter(&text).count();
        assert_eq!(
            literal,
            all,
            "{}: a call site without a literal command name",
            path.display()
        );
        sites += all;
        for c in call.captures_iter(&text) {
            called.insert(c[1].to_uppercase());
        }
    }
    assert!(sites > 0, "no call site found: the pattern is wrong");
    assert_eq!(allowed, called, "envoy/redis.acl against lua/*.lua");
    assert!(default.contains(" -@all ") && default.contains(" ~{{KEY_PREFIX}}:* "));
}
