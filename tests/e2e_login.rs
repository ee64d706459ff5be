//! The login brute-force recipe (README, *Recipes*) through two real Envoys:
//! failed logins (the upstream's 401) are counted per account and per client
//! /24, reserved at admission so a burst cannot outrun the count, and the
//! account is blocked once its limit rejects. The test client stands in for
//! the password check: `x-upstream-status: 401` is a wrong password.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use support::probe::poll;
use support::*;

/// envoy/recipes/login.json, as the README gives it: five failed logins per
/// account and fifty per client /24 every 15 minutes; a rejection blocks for
/// 15 minutes.
fn config() -> String {
    filter_config(1000).recipe("login").build()
}

/// A login for `user` on `envoy`: the upstream says 401 for a wrong password.
fn login(agent: &ureq::Agent, envoy: &Envoy, user: &str, right: bool) -> Resp {
    let status = if right { "200" } else { "401" };
    let headers = [
        ("x-login-user", user),
        ("x-upstream-status", status),
        ("x-upstream-delay-ms", "20"),
    ];
    http_with(
        agent,
        "POST",
        &envoy.url("/login"),
        &headers,
        Some(b"password=..."),
    )
}

#[test]
fn a_password_burst_reaches_the_upstream_five_times_then_the_account_is_blocked() {
    let stack = Stack::start(&config(), 2);
    let agent = agent();

    // 50 right passwords in a row, alternating Envoys: each reserve comes
    // back when the 200 is seen, so none is ever limited.
    for i in 0..50 {
        let r = login(&agent, &stack.envoys[i % 2], "bob", true);
        assert_eq!(r.status, 200, "success {i} was limited");
    }
    assert_eq!(stack.upstream.executions_of("/login"), 50);

    // 100 wrong passwords for ann at once, over both Envoys: the first five
    // take the five units before any 401 is back; the rest are rejected
    // (and block the account) without reaching the upstream.
    let jobs: Vec<usize> = (0..100).collect();
    let statuses = run_jobs(
        &jobs,
        32,
        Duration::from_secs(60),
        support::agent,
        |a, i, _| login(a, &stack.envoys[i % 2], "ann", false).status,
    );
    let reached = statuses.iter().filter(|s| **s == 401).count();
    let limited = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!(reached + limited, 100, "only 401 and 429: {statuses:?}");
    assert!(
        reached <= 5,
        "{reached} wrong passwords reached the upstream"
    );
    assert_eq!(stack.upstream.executions_of("/login"), 50 + reached as u64);
    eprintln!("{reached} of 100 wrong passwords reached the upstream");

    // The bucket held five and no failure gives its unit back: exactly five.
    assert_eq!(reached, 5);

    // The failures' settlements found the account exhausted and blocked it
    // (a rejection at admission starts no block: the bucket may hold running
    // requests' reserves). Blocked, even with the right password, even once
    // the bucket is full again (its state deleted, as a refill would leave
    // it): Retry-After is the block's end, not the refill's.
    let mut con = stack.redis.conn();
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg("rg:rl:*failed-logins-per-account*")
        .query(&mut con)
        .unwrap();
    let bucket = keys
        .iter()
        .find(|k| k.ends_with(b"ann"))
        .unwrap_or_else(|| panic!("no bucket for ann among {keys:?}"))
        .clone();
    let block = redis_guard::keys::block_key(&bucket);
    poll(
        "the block, started by a settlement",
        Duration::from_secs(5),
        || {
            let exists: bool = redis::cmd("EXISTS").arg(&block).query(&mut con).unwrap();
            exists.then_some(())
        },
    );
    redis::cmd("DEL")
        .arg(&bucket)
        .query::<()>(&mut con)
        .unwrap();
    for envoy in &stack.envoys {
        let r = login(&agent, envoy, "ann", true);
        assert_eq!(r.status, 429);
        let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
        assert!(retry > 800 && retry <= 900, "Retry-After {retry}");
    }
    let ttl: i64 = redis::cmd("PTTL").arg(&block).query(&mut con).unwrap();
    assert!(ttl > 800_000 && ttl <= 900_000, "block PTTL {ttl}");
    assert_eq!(stack.upstream.executions_of("/login"), 50 + reached as u64);

    // Right passwords sent all at once may outrun the five units their
    // reserves hold while they run (a 429 for the sixth), but they never
    // block the account: only counted failures start a block.
    let jobs: Vec<usize> = (0..12).collect();
    let rushed = run_jobs(
        &jobs,
        12,
        Duration::from_secs(60),
        support::agent,
        |a, i, _| login(a, &stack.envoys[i % 2], "frank", true).status,
    );
    assert!(rushed.iter().all(|s| *s == 200 || *s == 429), "{rushed:?}");
    assert!(
        rushed.iter().filter(|s| **s == 200).count() >= 5,
        "{rushed:?}"
    );
    // Once every settlement has landed (each 200 gave its reserve back:
    // frank's bucket is full again, or gone, as a full bucket may go),
    // none of them started a block.
    // A full bucket holds capacity x period credits (lua/token_bucket.lua),
    // read from the recipe this test runs.
    let recipe: serde_json::Value =
        serde_json::from_str(include_str!("../envoy/recipes/login.json")).unwrap();
    let bucket = &recipe["limits"][0]["tokenBucket"];
    assert_eq!(recipe["limits"][0]["name"], "failed-logins-per-account");
    let full = bucket["capacity"].as_i64().unwrap() * bucket["periodMs"].as_i64().unwrap();
    poll("frank's reserves back", Duration::from_secs(10), || {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("rg:rl:*failed-logins-per-account*frank")
            .query(&mut con)
            .unwrap();
        keys.iter()
            .all(|k| read_bucket(&mut con, k).is_none_or(|(c, _)| c == full))
            .then_some(())
    });
    let frank: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg("rg:bl:*frank")
        .query(&mut con)
        .unwrap();
    assert!(
        frank.is_empty(),
        "right passwords blocked the account: {frank:?}"
    );
    // Their reserves come back as their settlements land.
    poll("frank logs in", Duration::from_secs(5), || {
        (login(&agent, stack.envoy(), "frank", true).status == 200).then_some(())
    });

    // Another account is unaffected (the network limit counted only the
    // failures that reached the upstream, far below its fifty).
    assert_eq!(login(&agent, stack.envoy(), "carol", true).status, 200);
    assert_eq!(login(&agent, stack.envoy(), "carol", false).status, 401);

    // Lifting the block (what `redis-guard reset` does) lets ann in again.
    redis::cmd("DEL").arg(&block).query::<()>(&mut con).unwrap();
    // (An Envoy's over-limit cache may answer for Redis up to a second.)
    let r = poll(
        "ann admitted once unblocked",
        Duration::from_secs(5),
        || {
            let r = login(&agent, stack.envoy(), "ann", true);
            (r.status == 200).then_some(r)
        },
    );
    assert_eq!(r.status, 200);
}
