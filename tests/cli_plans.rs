//! A customer's plan (`redis-guard override set`) is configuration, not
//! state: it lasts until `unset`, unless the operator asks for an expiry
//! (`--expires DAYS`, or `--ttl-days` as scripts written before it say);
//! `list --count` says how many there are, which is what bounds their
//! memory. Against a real redis-server; built with the `cli` feature.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::process::Command;

use serde_json::Value;
use support::*;

const DAY_MS: i64 = 86_400_000;

fn config(dir: &Scratch) -> std::path::PathBuf {
    let path = dir.0.join("filter.json");
    let json = filter_config(2000)
        .field(
            "limits",
            r#"[{"name":"per-key","descriptor":[{"header":"x-api-key"}],
                 "tokenBucket":{"capacity":5,"refill":5,"periodMs":3600000},
                 "overrides":{"redis":true}}]"#,
        )
        .build();
    std::fs::write(&path, json).unwrap();
    path
}

/// `redis-guard --json override <args>`: its exit code and JSON.
fn over(config: &std::path::Path, url: &str, args: &[&str]) -> (i32, Value) {
    let mut all = vec!["--json", "override"];
    all.extend_from_slice(&args[..1]);
    all.extend(["--config", config.to_str().unwrap(), "--redis", url]);
    all.extend_from_slice(&args[1..]);
    let out = Command::new(env!("CARGO_BIN_EXE_redis-guard"))
        .env_clear()
        .args(&all)
        .output()
        .unwrap();
    let json = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap(), json)
}

fn key_of(shown: &Value) -> String {
    shown["key"].as_str().unwrap().to_string()
}

#[test]
fn a_plan_lasts_until_unset_unless_an_expiry_is_asked_for_and_list_counts_them() {
    let redis = Redis::start();
    let dir = Scratch::new("cli-plans");
    let config = config(&dir);
    let url = redis.admin_url();
    let mut con = redis.conn();
    let acme = ["--limit", "per-key", "--value", "x-api-key=acme"];
    let set = |who: &[&str], more: &[&str]| {
        let args = [
            &["set"][..],
            who,
            &["--capacity", "20", "--refill", "20"],
            more,
        ]
        .concat();
        over(&config, &url, &args)
    };

    // No expiry asked for: no TTL at all, and show says so.
    let (code, out) = set(&acme, &[]);
    assert_eq!((code, out["ttlMs"].clone()), (0, Value::from(-1)));
    let (_, shown) = over(&config, &url, &[&["show"][..], &acme].concat());
    let key = key_of(&shown);
    assert_eq!(key_pttl(&mut con, &key), -1);
    assert_eq!(shown["ttlMs"], -1);
    assert_eq!(shown["override"]["capacity"], 20);

    // An expiry asked for: that many days, to the ms the SET gave.
    let (code, out) = set(&acme, &["--expires", "30"]);
    assert_eq!((code, out["ttlMs"].clone()), (0, Value::from(30 * DAY_MS)));
    let ttl = key_pttl(&mut con, &key);
    assert!(30 * DAY_MS - 60_000 < ttl && ttl <= 30 * DAY_MS, "{ttl}");
    // The older flag says the same.
    set(&acme, &["--ttl-days", "2"]);
    let ttl = key_pttl(&mut con, &key);
    assert!(2 * DAY_MS - 60_000 < ttl && ttl <= 2 * DAY_MS, "{ttl}");
    // Set again without one: the plan lasts again (the TTL is gone).
    set(&acme, &[]);
    assert_eq!(key_pttl(&mut con, &key), -1);
    // Zero days is no expiry to ask for: refused, nothing changed.
    assert_eq!(set(&acme, &["--expires", "0"]).0, 4);
    assert_eq!(key_pttl(&mut con, &key), -1);

    // A plan stored a year ago by an older CLI (a TTL of 365 days, now
    // nearly run out) still reads as valid; setting it again makes it last.
    redis::cmd("PEXPIRE")
        .arg(&key)
        .arg(1_000)
        .query::<()>(&mut con)
        .unwrap();
    set(&acme, &[]);
    assert_eq!(key_pttl(&mut con, &key), -1);

    // Counted: three customers with a plan, one unset.
    for who in ["globex", "initech"] {
        let value = format!("x-api-key={who}");
        assert_eq!(set(&["--limit", "per-key", "--value", &value], &[]).0, 0);
    }
    let count = |con_url: &str| {
        over(&config, con_url, &["list", "--limit", "per-key", "--count"]).1["count"].clone()
    };
    assert_eq!(count(&url), 3);
    over(&config, &url, &[&["unset"][..], &acme].concat());
    assert_eq!(count(&url), 2);
    let (_, listed) = over(&config, &url, &["list", "--limit", "per-key"]);
    assert_eq!(listed["overrides"].as_array().unwrap().len(), 2);
}
