//! The `redis-guard` CLI (src/cli/) against what it is for: a real Redis
//! after real traffic through a real Envoy. `inspect` must agree with the
//! headers the filter returned, `reset` must give the budget back, `forget`
//! must let a key run again, and `check` must say exactly what the filter's
//! parser says about every fixture.
//!
//! Built with the `cli` feature (Cargo.toml's [[test]] requires it; `make
//! test` passes it), which also builds the binary this runs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use redis_guard::config::Config;
use serde_json::Value;
use support::cluster::ClusterStack;
use support::*;

/// 2^40 ms: a window no run crosses the edge of (aligned to the epoch).
const LONG_WINDOW_MS: u64 = 1 << 40;

fn cli() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_redis-guard"));
    // The parser reads fromEnvironment credentials from the environment:
    // none here, as for a CI job without secrets.
    cmd.env_clear();
    cmd
}

/// Runs the CLI (bounded: it has a 2 s Redis timeout of its own).
fn run(args: &[&str]) -> Output {
    let out = cli().args(args).output().unwrap();
    eprintln!(
        "redis-guard {}: {}\n{}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn code(out: &Output) -> i32 {
    out.status.code().unwrap()
}

fn json_of(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// The filter's configuration as a file the CLI reads.
fn config_file(dir: &Scratch, json: &str) -> PathBuf {
    let path = dir.0.join("filter.json");
    std::fs::write(&path, json).unwrap();
    path
}

/// `inspect --json` of one limit for user `user`.
fn inspect(config: &Path, url: &str, limit: &str, user: &str) -> Value {
    let out = run(&[
        "--json",
        "inspect",
        "--config",
        config.to_str().unwrap(),
        "--limit",
        limit,
        "--value",
        &format!("x-user={user}"),
        "--redis",
        url,
    ]);
    assert_eq!(code(&out), 0, "inspect {limit}");
    json_of(&out)
}

/// `reset --yes` of the `tb` limit for `user`: its JSON report.
fn reset_tb(config: &Path, url: &str, user: &str) -> Value {
    let out = run(&[
        "reset",
        "--config",
        config.to_str().unwrap(),
        "--limit",
        "tb",
        "--value",
        &format!("x-user={user}"),
        "--redis",
        url,
        "--yes",
        "--json",
    ]);
    assert_eq!(code(&out), 0, "reset tb for {user}");
    json_of(&out)
}

fn header_u64(resp: &Resp, name: &str) -> u64 {
    resp.header(name)
        .unwrap_or_else(|| panic!("no {name}: {resp:?}"))
        .parse()
        .unwrap()
}

/// One limit of each kind on its own path, keyed by x-user; budgets that
/// no refill or window edge changes during a run.
fn every_kind_config() -> String {
    filter_config(3000)
        .limits(&format!(
            r#"[{{"name":"tb","match":{{"pathPrefix":"/tb/"}},"descriptor":[{{"header":"x-user"}}],
                 "tokenBucket":{{"capacity":5,"refill":1,"periodMs":3600000}}}},
               {{"name":"sw","match":{{"pathPrefix":"/sw/"}},"descriptor":[{{"header":"x-user"}}],
                 "slidingWindow":{{"limit":5,"windowMs":3600000}}}},
               {{"name":"gcra","match":{{"pathPrefix":"/gcra/"}},"descriptor":[{{"header":"x-user"}}],
                 "gcra":{{"rate":1,"periodMs":3600000,"burst":5}}}},
               {{"name":"fw","match":{{"pathPrefix":"/fw/"}},"descriptor":[{{"header":"x-user"}}],
                 "fixedWindow":{{"limit":5,"windowMs":{LONG_WINDOW_MS}}}}},
               {{"name":"swc","match":{{"pathPrefix":"/swc/"}},"descriptor":[{{"header":"x-user"}}],
                 "slidingWindowCounter":{{"limit":5,"windowMs":{LONG_WINDOW_MS}}}}},
               {{"name":"cc","match":{{"pathPrefix":"/cc/"}},"descriptor":[{{"header":"x-user"}}],
                 "concurrency":{{"max":3}}}}]"#
        ))
        .idempotency(
            r#"[{"name":"pay","match":{"pathPrefix":"/pay"},"tenant":[{"header":"x-user"}]}]"#,
        )
        .build()
}

/// `envoys` Envoys running [`every_kind_config`], that config as a file for
/// the CLI (in the returned scratch directory), and the admin's Redis URL.
fn every_kind_stack(tag: &str, envoys: usize) -> (Stack, Scratch, PathBuf, String) {
    let stack = Stack::start(&every_kind_config(), envoys);
    let dir = Scratch::new(tag);
    let config = config_file(&dir, &every_kind_config());
    let url = stack.redis.admin_url();
    (stack, dir, config, url)
}

/// Every key with its serialized value (DUMP) and absolute expiry
/// (PEXPIRETIME, -1 for none).
fn snapshot(con: &mut redis::Connection) -> BTreeMap<Vec<u8>, (Vec<u8>, i64)> {
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("*").query(con).unwrap();
    keys.into_iter()
        .map(|key| {
            let value: Vec<u8> = redis::cmd("DUMP").arg(&key).query(con).unwrap();
            let at: i64 = redis::cmd("PEXPIRETIME").arg(&key).query(con).unwrap();
            (key, (value, at))
        })
        .collect()
}

/// `reset_ms` read now is at most the header's reset (whole seconds, rounded
/// up, when the response left) and less only by the time since: a few
/// seconds on a slow machine.
fn assert_reset_agrees(kind: &str, header_s: u64, reset_ms: u64) {
    let header_ms = header_s * 1000;
    assert!(
        reset_ms <= header_ms && header_ms - reset_ms < 6000,
        "{kind}: inspect's reset {reset_ms} ms against the header's {header_s} s"
    );
}

#[test]
fn inspect_agrees_with_the_headers_the_filter_returned_for_each_limit_kind() {
    let (stack, _dir, config, url) = every_kind_stack("cli-inspect", 1);
    let e = stack.envoy();
    // Every inspection below leaves every key's value and expiry exactly as
    // it found them, and creates none.
    let mut con = stack.redis.conn();
    let mut look = |kind: &str, user: &str| -> Value {
        let before = snapshot(&mut con);
        let shown = inspect(&config, &url, kind, user);
        assert_eq!(
            snapshot(&mut con),
            before,
            "inspect {kind} for {user} wrote"
        );
        shown
    };
    for kind in ["tb", "sw", "gcra", "fw", "swc"] {
        // Before any request the limit is whole, and inspecting it spends nothing.
        let fresh = look(kind, "alice");
        assert_eq!(fresh["remaining"], 5, "{kind}");
        assert_eq!(fresh["allowed"], true, "{kind}");
        assert_eq!(fresh["state"]["type"], "none", "{kind}");
        let mut last = None;
        for _ in 0..3 {
            let resp = get(&e.url(&format!("/{kind}/")), &[("x-user", "alice")]);
            assert_eq!(resp.status, 200, "{kind}");
            last = Some(resp);
        }
        let last = last.unwrap();
        let state = look(kind, "alice");
        assert_eq!(
            state["remaining"].as_u64().unwrap(),
            header_u64(&last, "x-ratelimit-remaining"),
            "{kind}: {state}"
        );
        assert_eq!(state["remaining"], 2, "{kind}");
        assert_reset_agrees(
            kind,
            header_u64(&last, "x-ratelimit-reset"),
            state["resetMs"].as_u64().unwrap(),
        );
        assert_eq!(state["allowed"], true);
        assert_eq!(state["retryMs"], 0);
        assert!(
            state["state"]["pttlMs"].as_i64().unwrap() > 0,
            "{kind}: a TTL"
        );
        assert!(
            state["key"]
                .as_str()
                .unwrap()
                .contains(&format!(":{kind}:")),
            "{kind}: {state}"
        );
        // Inspecting twice changed nothing: the same remaining units.
        assert_eq!(look(kind, "alice")["remaining"], 2);
        // Another user's key is another key, untouched.
        assert_eq!(look(kind, "bob")["remaining"], 5);
    }
    // The state as Redis holds it: the token bucket's string, shown as its
    // credits (a token is 3600000 of them: 2 tokens and some refill left)
    // and the ms of its last update, on Redis' clock; the sliding window's
    // 3 members.
    let tb = look("tb", "alice");
    assert_eq!(tb["state"]["type"], "string");
    let field = |name: &str| -> i64 {
        let entries = tb["state"]["entries"].as_array().unwrap();
        let e = entries.iter().find(|e| e[0] == name).unwrap();
        e[1].as_str().unwrap().parse().unwrap()
    };
    assert_eq!(field("c") / 3_600_000, 2, "{tb}");
    assert!(field("t") <= tb["redisTimeMs"].as_i64().unwrap(), "{tb}");
    let sw = look("sw", "alice");
    assert_eq!(
        (sw["state"]["type"].clone(), sw["state"]["members"].clone()),
        ("zset".into(), 3.into())
    );

    // Exhausted: the next request would be rejected, retry as its 429 said.
    for _ in 0..2 {
        assert_eq!(get(&e.url("/tb/"), &[("x-user", "alice")]).status, 200);
    }
    let rejected = get(&e.url("/tb/"), &[("x-user", "alice")]);
    assert_eq!(rejected.status, 429);
    let state = look("tb", "alice");
    assert_eq!(
        (state["allowed"].clone(), state["remaining"].clone()),
        (false.into(), 0.into())
    );
    let retry_ms = state["retryMs"].as_u64().unwrap();
    assert_reset_agrees("tb retry", header_u64(&rejected, "retry-after"), retry_ms);
    assert_eq!(state["resetMs"], state["retryMs"], "as the 429 reports it");

    // Concurrency: a slot held while a request runs, back when it ends.
    std::thread::scope(|s| {
        let slow = s.spawn(|| {
            get(
                &e.url("/cc/"),
                &[("x-user", "alice"), ("x-upstream-delay-ms", "3000")],
            )
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let during = loop {
            let state = inspect(&config, &url, "cc", "alice");
            if state["remaining"] == 2 || std::time::Instant::now() > deadline {
                break state;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let slow = slow.join().unwrap();
        assert_eq!(slow.status, 200);
        assert_eq!(
            during["remaining"].as_u64(),
            Some(header_u64(&slow, "x-ratelimit-remaining"))
        );
        assert_eq!(during["state"]["members"], 1, "{during}");
        assert_eq!(
            during["resetMs"], 0,
            "capacity comes back with requests, not time"
        );
    });
    let after = inspect(&config, &url, "cc", "alice");
    assert_eq!(after["remaining"], 3, "the slot is back: {after}");

    // The text form says the same.
    let out = run(&[
        "inspect",
        "--config",
        config.to_str().unwrap(),
        "--limit",
        "sw",
        "--value",
        "x-user=alice",
        "--redis",
        &url,
    ]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("remaining:  2\n"), "{text}");
    assert!(text.contains("zset (3 members"), "{text}");
    assert_eq!(stack.counter("redis_guard.redis.errors"), 0);
}

#[test]
fn reset_restores_the_budget_only_when_confirmed() {
    // Two Envoys: the first exhausts each budget (and caches its
    // rejections, overlimit.rs), the second, which never saw a 429, shows
    // what the reset gave back, with no wait for the first's cache.
    let (stack, _dir, config, url) = every_kind_stack("cli-reset", 2);
    let (e, fresh) = (&stack.envoys[0], &stack.envoys[1]);
    for kind in ["tb", "sw", "gcra", "fw", "swc"] {
        let path = format!("/{kind}/");
        let statuses: Vec<u16> = (0..6)
            .map(|_| get(&e.url(&path), &[("x-user", "carol")]).status)
            .collect();
        assert_eq!(statuses, [200, 200, 200, 200, 200, 429], "{kind}");
        let args = |yes: bool| {
            let mut a = vec![
                "reset".to_string(),
                "--config".into(),
                config.to_str().unwrap().into(),
                "--limit".into(),
                kind.into(),
                "--value".into(),
                "x-user=carol".into(),
                "--redis".into(),
                url.clone(),
            ];
            if yes {
                a.push("--yes".into());
            }
            a
        };
        let refused = cli().args(args(false)).output().unwrap();
        assert_eq!(code(&refused), 6, "{kind}: refused without --yes");
        assert!(String::from_utf8_lossy(&refused.stderr).contains("without --yes"));
        assert_eq!(
            inspect(&config, &url, kind, "carol")["remaining"],
            0,
            "{kind}: nothing deleted"
        );
        let done = cli().args(args(true)).output().unwrap();
        assert_eq!(code(&done), 0, "{kind}");
        assert!(String::from_utf8_lossy(&done.stdout).contains("deleted"));
        assert_eq!(
            inspect(&config, &url, kind, "carol")["remaining"],
            5,
            "{kind}"
        );
    }
    // Every kind admits its whole budget again, exactly.
    for kind in ["tb", "sw", "gcra", "fw", "swc"] {
        let path = format!("/{kind}/");
        let statuses: Vec<u16> = (0..6)
            .map(|_| get(&fresh.url(&path), &[("x-user", "carol")]).status)
            .collect();
        assert_eq!(
            statuses,
            [200, 200, 200, 200, 200, 429],
            "{kind}: the whole budget back"
        );
    }
    // A reset of a limit with no state says so.
    assert_eq!(reset_tb(&config, &url, "nobody")["deleted"], false);

    // A bucket an older filter spent (a hash under `tb.`, which the scripts
    // read for a bucket without its string during a rolling upgrade):
    // inspect shows it, and the reset deletes it too.
    let state_key = inspect(&config, &url, "tb", "dave")["key"]
        .as_str()
        .unwrap()
        .to_string();
    let older = redis_guard::keys::older_bucket_key(state_key.as_bytes()).unwrap();
    let older = String::from_utf8(older).unwrap();
    let mut con = stack.redis.conn();
    let now = support::redis_now_ms(&mut con);
    support::write_older_bucket(&mut con, &older, 0, now);
    let spent = inspect(&config, &url, "tb", "dave");
    assert_eq!(
        (spent["remaining"].clone(), spent["state"]["type"].clone()),
        (0.into(), "hash".into()),
        "{spent}"
    );
    assert_eq!(reset_tb(&config, &url, "dave")["deleted"], true);
    assert!(!support::key_exists(&mut con, &older));
    assert_eq!(inspect(&config, &url, "tb", "dave")["remaining"], 5);
}

#[test]
fn reset_restarts_a_leased_buckets_give_back_record_so_tokens_leased_before_never_return() {
    // A bucket of 40 that leases (lua/lease.lua) and gives back
    // (lua/lease_return.lua), driven by the scripts as an Envoy sends them,
    // on the key the CLI names.
    let redis = Redis::start();
    let dir = Scratch::new("cli-reset-lease");
    let json = filter_config(3000)
        .limits(
            r#"[{"name":"tb","descriptor":[{"header":"x-user"}],
                 "tokenBucket":{"capacity":40,"refill":1,"periodMs":3600000},
                 "lease":{"tokens":10,"ttlMs":60000}}]"#,
        )
        .build();
    let config = config_file(&dir, &json);
    let url = redis.admin_url();
    let key = inspect(&config, &url, "tb", "erin")["key"]
        .as_str()
        .unwrap()
        .to_string();
    let b = support::script::bucket(40, 1, 3_600_000);
    let mut con = redis.conn();
    // One request admitted and 9 tokens leased (a quarter of the 39 left):
    // 30 stay in Redis.
    let (reply, tuple) =
        support::script::split_lease(support::script::eval_lease(&mut con, &key, b, 1, 10));
    assert_eq!((reply[0], reply[5]), (1, 9), "{reply:?}");
    let ret = redis_guard::keys::give_back_key(key.as_bytes());
    assert!(key_exists(&mut con, std::str::from_utf8(&ret).unwrap()));
    assert_eq!(reset_tb(&config, &url, "erin")["deleted"], true);
    // The fresh bucket: a strict request of 20 leaves 20.
    let strict = support::script::request(&mut con, &[b.limit(&key, 20)], None);
    let support::script::Reply::Decided(d) = strict else {
        panic!("{strict:?}")
    };
    assert_eq!((d.admitted, d.limits[0].remaining), (true, 20));
    // The Envoy gives back the 9 it leased before the reset: none may
    // come back into the fresh bucket, which stays at 20, as a bucket that
    // never leased would.
    let back: Vec<i64> = support::script::eval(&redis_guard::scripts::LEASE_RETURN)
        .arg(1)
        .arg(&key)
        .arg(&[40, 1, 3_600_000, 9][..])
        .arg(&tuple[..])
        .query(&mut con)
        .unwrap();
    assert_eq!(back, [0]);
    assert_eq!(inspect(&config, &url, "tb", "erin")["remaining"], 20);
    // The reset restarted the record after its ms (count 0, the layout
    // mark, a start past the grant's instant), with the record's TTL; the
    // give-back refused wrote nothing to it. A deleted record would be
    // started afresh by a grant in the reset's own ms, which an older tuple
    // of that ms would pass (lua/lease_return.lua's header).
    let record: Vec<u8> = redis::cmd("GET").arg(&ret).query(&mut con).unwrap();
    let f = |i: usize| f64::from_le_bytes(record[i * 8..i * 8 + 8].try_into().unwrap());
    assert_eq!((record.len(), f(0), f(1)), (24, 0.0, -2.0));
    assert!(
        f(2) > tuple[0] as f64,
        "start {} after the grant at {}",
        f(2),
        tuple[0]
    );
    let ttl = key_pttl(&mut con, std::str::from_utf8(&ret).unwrap());
    assert!(600_000 < ttl && ttl <= 660_000, "{ttl}");
}

#[test]
fn forget_lets_a_completed_key_run_again_and_refuses_one_in_progress_unless_forced() {
    let (stack, _dir, config, url) = every_kind_stack("cli-forget", 1);
    let e = stack.envoy();
    let idem = |sub: &str, key: &str, extra: &[&str]| {
        let mut args = vec![
            "--json",
            "idempotency",
            sub,
            "--config",
            config.to_str().unwrap(),
            "--rule",
            "pay",
            "--value",
            "x-user=dave",
            "--key",
            key,
            "--redis",
            &url,
        ];
        args.extend_from_slice(extra);
        run(&args)
    };
    let pay = |key: &str, delay: &str| {
        http(
            "POST",
            &e.url("/pay"),
            &[
                ("x-user", "dave"),
                ("idempotency-key", key),
                ("x-upstream-delay-ms", delay),
            ],
            Some(b"amount=5"),
        )
    };
    let absent = idem("show", "k-1", &[]);
    assert_eq!(code(&absent), 0);
    assert_eq!(json_of(&absent)["state"], "absent");

    let first = pay("k-1", "0");
    assert_eq!(first.status, 200);
    assert_eq!(pay("k-1", "0").body, first.body, "a replay");
    assert_eq!(stack.upstream.executions_of("/pay"), 1);

    let shown = json_of(&idem("show", "k-1", &[]));
    assert_eq!(shown["state"], "completed");
    assert_eq!(shown["status"], 200);
    assert_eq!(shown["bodyBytes"].as_u64(), Some(first.body.len() as u64));
    let ttl = shown["pttlMs"].as_i64().unwrap();
    assert!(ttl > 0 && ttl <= 86_400_000, "the record's TTL: {ttl}");
    assert_eq!(shown["object"], Value::Null);

    let forgot = idem("forget", "k-1", &[]);
    assert_eq!(code(&forgot), 0);
    assert_eq!(json_of(&forgot)["forgotten"], true);
    assert_eq!(pay("k-1", "0").status, 200);
    assert_eq!(stack.upstream.executions_of("/pay"), 2, "the key ran again");
    assert_eq!(pay("k-1", "0").status, 200);
    assert_eq!(
        stack.upstream.executions_of("/pay"),
        2,
        "and is stored again"
    );

    // In progress: refused without --force, forgotten with it.
    std::thread::scope(|s| {
        let slow = s.spawn(|| pay("k-2", "3000"));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let shown = json_of(&idem("show", "k-2", &[]));
            if shown["state"] == "in progress" {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "never in progress");
            std::thread::sleep(Duration::from_millis(100));
        }
        let refused = idem("forget", "k-2", &[]);
        assert_eq!(code(&refused), 6);
        assert_eq!(json_of(&refused)["error"]["kind"], "refused");
        assert_eq!(json_of(&idem("show", "k-2", &[]))["state"], "in progress");
        let forced = idem("forget", "k-2", &["--force"]);
        assert_eq!(code(&forced), 0);
        assert_eq!(json_of(&forced)["forgotten"], true);
        assert_eq!(slow.join().unwrap().status, 200);
    });
    // The forced forget left nothing for the running request to complete:
    // its owner's completion found no lock, and no record was written.
    assert_eq!(json_of(&idem("show", "k-2", &[]))["state"], "absent");
    assert_eq!(
        stack.upstream.executions_of("/pay"),
        3,
        "k-1 twice, k-2 once"
    );
    // So a retry of k-2 runs again, once, and is stored this time.
    let retry = pay("k-2", "0");
    assert_eq!(retry.status, 200);
    assert_eq!(retry.header("idempotent-replayed"), None);
    assert_eq!(stack.upstream.executions_of("/pay"), 4, "k-2 ran again");
    let replay = pay("k-2", "0");
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, retry.body);
    assert_eq!(stack.upstream.executions_of("/pay"), 4);
}

#[test]
fn check_accepts_every_good_fixture_and_rejects_every_bad_one_with_the_parsers_message() {
    let fixtures = root().join("tests/fixtures/config");
    let mut good = 0;
    for entry in std::fs::read_dir(fixtures.join("good")).unwrap() {
        let path = entry.unwrap().path();
        let config = Config::parse_with_env(&std::fs::read(&path).unwrap(), &|_| None).unwrap();
        let out = run(&["--json", "check", path.to_str().unwrap()]);
        assert_eq!(code(&out), 0, "{}", path.display());
        let summary = json_of(&out);
        assert_eq!(summary["valid"], true);
        assert_eq!(
            summary["limits"].as_array().unwrap().len(),
            config.limits.len()
        );
        assert_eq!(
            summary["idempotency"].as_array().unwrap().len(),
            config.idempotency.len()
        );
        for (limit, shown) in config
            .limits
            .iter()
            .zip(summary["limits"].as_array().unwrap())
        {
            assert_eq!(shown["name"], limit.name.as_str());
            assert!(shown["keyPattern"]
                .as_str()
                .unwrap()
                .contains(&limit.key_infix));
        }
        good += 1;
    }
    let mut bad = 0;
    for entry in std::fs::read_dir(fixtures.join("bad")).unwrap() {
        let path = entry.unwrap().path();
        let error = Config::parse_with_env(&std::fs::read(&path).unwrap(), &|_| None)
            .expect_err(&path.display().to_string());
        let out = run(&["check", path.to_str().unwrap()]);
        assert_eq!(code(&out), 3, "{}", path.display());
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            format!("redis-guard: {error}\n"),
            "{}",
            path.display()
        );
        assert!(out.stdout.is_empty());
        bad += 1;
    }
    assert!(good >= 8 && bad >= 200, "{good} good, {bad} bad fixtures");

    // The demo's configuration reads its Webdis credentials from the
    // environment: named when they are missing, assumed with --assume-env.
    let demo = root().join("envoy/filter.json");
    let out = run(&["check", demo.to_str().unwrap()]);
    assert_eq!(code(&out), 3);
    assert!(String::from_utf8_lossy(&out.stderr).contains("AWS_ACCESS_KEY_ID is not set"));
    let out = run(&["check", "--assume-env", demo.to_str().unwrap()]);
    assert_eq!(code(&out), 0);
    assert!(String::from_utf8_lossy(&out.stdout).contains(": valid\n"));
}

#[test]
fn errors_name_what_is_wrong_with_their_documented_exit_codes() {
    let dir = Scratch::new("cli-errors");
    let config = config_file(&dir, &every_kind_config());
    let config = config.to_str().unwrap();
    let nothing = format!("redis://127.0.0.1:{}/", free_port());
    let cases: &[(&[&str], i32, &str)] = &[
        (
            &[
                "inspect", "--config", config, "--limit", "nope", "--value", "x-user=a",
            ],
            4,
            "no limit named `nope` (the configuration has: tb, sw, gcra, fw, swc, cc)",
        ),
        (
            &["inspect", "--config", config, "--limit", "tb"],
            4,
            "needs a value for each of: x-user (missing: --value x-user=...)",
        ),
        (
            &[
                "inspect", "--config", config, "--limit", "tb", "--value", "x-usr=a",
            ],
            4,
            "--value x-usr: no part of this selection is named so (it needs: x-user)",
        ),
        (
            &[
                "inspect", "--config", config, "--limit", "tb", "--value", "x-user=a", "--cost",
                "6",
            ],
            4,
            "--cost must be between 1 and 5",
        ),
        (
            &[
                "inspect", "--config", config, "--limit", "tb", "--value", "x-user=a", "--redis",
                &nothing,
            ],
            5,
            "cannot reach Redis at redis://127.0.0.1:",
        ),
        (
            &[
                "inspect",
                "--config",
                "/nonexistent/filter.json",
                "--limit",
                "tb",
            ],
            3,
            "cannot read /nonexistent/filter.json",
        ),
        (
            &[
                "idempotency",
                "show",
                "--config",
                config,
                "--rule",
                "pay",
                "--value",
                "x-user=a",
                "--key",
                "bad key\u{7f}",
            ],
            4,
            "invalid key",
        ),
        (
            &[
                "idempotency",
                "show",
                "--config",
                config,
                "--rule",
                "refund",
                "--key",
                "k",
            ],
            4,
            "no idempotency rule named `refund` (the configuration has: pay)",
        ),
        (&["inspect", "--config", config], 2, "--limit"),
    ];
    for (args, want, message) in cases {
        let out = run(args);
        assert_eq!(code(&out), *want, "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    // With --json, the error is a document too.
    let out = run(&[
        "--json", "inspect", "--config", config, "--limit", "tb", "--value", "x-user=a", "--redis",
        &nothing,
    ]);
    assert_eq!(json_of(&out)["error"]["kind"], "redis");
    assert_eq!(json_of(&out)["error"]["exitCode"], 5);
    // A live Redis refusing the credentials is a Redis error too (5), and
    // the URL's password is never printed.
    let redis = Redis::start();
    let wrong = redis
        .admin_url()
        .replace(REDIS_ADMIN_PASSWORD, "s3cret-wrong");
    let out = run(&[
        "--json", "inspect", "--config", config, "--limit", "tb", "--value", "x-user=a", "--redis",
        &wrong,
    ]);
    assert_eq!(code(&out), 5, "{out:?}");
    assert_eq!(json_of(&out)["error"]["kind"], "redis");
    let printed = format!("{out:?}");
    assert!(!printed.contains("s3cret-wrong"), "{printed}");
}

#[test]
fn the_cli_reads_and_resets_a_limit_over_a_redis_cluster() {
    let cfg = filter_config(3000)
        .hash_tag(r#"[{"header":"x-user"}]"#)
        .limits(
            r#"[{"name":"tb","descriptor":[{"header":"x-user"}],
                 "tokenBucket":{"capacity":4,"refill":1,"periodMs":3600000}}]"#,
        )
        .build();
    let stack = ClusterStack::start(&cfg);
    let dir = Scratch::new("cli-cluster");
    let config = config_file(&dir, &cfg);
    let seeds: Vec<String> = stack
        .cluster
        .ports
        .iter()
        // The nodes' admin (tests/support/cluster.rs): their default user
        // may run the scripts' commands only.
        .map(|p| format!("redis://admin:{REDIS_ADMIN_PASSWORD}@127.0.0.1:{p}/"))
        .collect();
    // Users on every master, so the keys spread over the slots.
    let users: Vec<String> = (0..6).map(|i| format!("user-{i}")).collect();
    for user in &users {
        for _ in 0..3 {
            let r = get(&stack.envoys[0].url("/"), &[("x-user", user)]);
            assert_eq!(r.status, 200);
        }
    }
    let cluster_args = |cmd: &str, user: &str| {
        let mut a = vec![
            "--json".to_string(),
            cmd.to_string(),
            "--config".into(),
            config.to_str().unwrap().into(),
            "--limit".into(),
            "tb".into(),
            "--value".into(),
            format!("x-user={user}"),
            "--cluster".into(),
        ];
        for s in &seeds {
            a.push("--redis".into());
            a.push(s.clone());
        }
        a
    };
    for user in &users {
        let out = cli().args(cluster_args("inspect", user)).output().unwrap();
        assert_eq!(code(&out), 0, "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(json_of(&out)["remaining"], 1, "{user}");
    }
    let mut reset = cluster_args("reset", "user-0");
    reset.push("--yes".into());
    let out = cli().args(&reset).output().unwrap();
    assert_eq!(code(&out), 0, "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(json_of(&out)["deleted"], true);
    let out = cli()
        .args(cluster_args("inspect", "user-0"))
        .output()
        .unwrap();
    assert_eq!(json_of(&out)["remaining"], 4);
    let out = cli()
        .args(cluster_args("inspect", "user-1"))
        .output()
        .unwrap();
    assert_eq!(json_of(&out)["remaining"], 1, "another user untouched");
}

#[test]
fn the_version_names_the_tz_database_release_compiled_in() {
    let out = run(&["--version"]);
    assert_eq!(code(&out), 0);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!(
            "redis-guard {} (tz database 2025b)\n",
            env!("CARGO_PKG_VERSION")
        )
    );
}

#[test]
fn the_wasm_build_has_none_of_the_clis_dependencies() {
    let tree = |args: &[&str]| {
        let out = Command::new("cargo")
            .current_dir(root())
            .args(["tree", "--offline", "-e", "normal", "--prefix", "none"])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let crates = |text: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| l.split_whitespace().next())
            .map(str::to_string)
            .collect()
    };
    let wasm = crates(&tree(&["--target", "wasm32-wasip1"]));
    let native = crates(&tree(&["--features", "cli"]));
    for dep in ["redis", "clap", "ureq"] {
        assert!(
            native.iter().any(|c| c == dep),
            "the cli feature brings {dep}"
        );
        assert!(!wasm.iter().any(|c| c == dep), "{dep} in the wasm build");
    }
}

#[test]
fn an_override_sets_a_quotas_anchor_day_within_its_unit_and_show_reads_it_back() {
    let redis = Redis::start();
    let dir = Scratch::new("cli-anchor");
    let config = config_file(
        &dir,
        &filter_config(2000)
            .field(
                "limits",
                r#"[{"name":"month","descriptor":[{"header":"x-user"}],
                     "quota":{"amount":10,"per":"month","timeZone":"Europe/Berlin"},"overrides":{"redis":true}},
                    {"name":"week","descriptor":[{"header":"x-user"}],
                     "quota":{"amount":10,"per":"week","timeZone":"UTC"},"overrides":{"redis":true}},
                    {"name":"day","descriptor":[{"header":"x-user"}],
                     "quota":{"amount":10,"per":"day","timeZone":"UTC"},"overrides":{"redis":true}},
                    {"name":"tb","descriptor":[{"header":"x-user"}],
                     "tokenBucket":{"capacity":5,"refill":1,"periodMs":1000},"overrides":{"redis":true}}]"#,
            )
            .build(),
    );
    let url = redis.admin_url();
    let base = |limit: &'static str| {
        vec![
            "--json".to_string(),
            "override".into(),
            "set".into(),
            "--config".into(),
            config.to_str().unwrap().into(),
            "--redis".into(),
            url.clone(),
            "--limit".into(),
            limit.into(),
            "--value".into(),
            "x-user=acme".into(),
        ]
    };
    let set = |limit: &'static str, more: &[&str]| {
        let mut args = base(limit);
        args.extend(more.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run(&args)
    };
    let out = set("month", &["--quota", "500", "--anchor-day", "31"]);
    assert_eq!(code(&out), 0);
    assert_eq!(
        json_of(&out)["override"],
        serde_json::json!({"quota": 500, "anchorDay": 31})
    );
    let mut con = redis.conn();
    let stored: Vec<(String, String)> = ["month", "week"]
        .iter()
        .filter_map(|l| {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("rg:ov:*:{l}:*"))
                .query(&mut con)
                .unwrap();
            keys.first().map(|k| {
                let v: String = redis::cmd("GET").arg(k).query(&mut con).unwrap();
                (l.to_string(), v)
            })
        })
        .collect();
    assert_eq!(stored, [("month".to_string(), "cq 500 31".to_string())]);
    let show = run(&[
        "--json",
        "override",
        "show",
        "--config",
        config.to_str().unwrap(),
        "--redis",
        &url,
        "--limit",
        "month",
        "--value",
        "x-user=acme",
    ]);
    assert_eq!(
        (
            json_of(&show)["valid"].clone(),
            json_of(&show)["override"].clone()
        ),
        (
            serde_json::json!(true),
            serde_json::json!({"quota": 500, "anchorDay": 31})
        )
    );
    assert_eq!(
        code(&set("week", &["--quota", "5", "--anchor-day", "7"])),
        0
    );
    // Out of the unit's days, a unit without anchors, or no quota at all:
    // refused (exit 4), nothing stored.
    for (limit, more) in [
        ("month", &["--quota", "5", "--anchor-day", "32"][..]),
        ("month", &["--quota", "5", "--anchor-day", "0"][..]),
        ("week", &["--quota", "5", "--anchor-day", "8"][..]),
        ("day", &["--quota", "5", "--anchor-day", "1"][..]),
        (
            "tb",
            &["--capacity", "5", "--refill", "1", "--anchor-day", "1"][..],
        ),
    ] {
        let out = set(limit, more);
        assert_eq!(code(&out), 4, "{limit} {more:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("anchor day") || err.contains("out of bounds"),
            "{limit} {more:?}: {err}"
        );
    }
    let keys: Vec<String> = redis::cmd("KEYS").arg("rg:ov:*").query(&mut con).unwrap();
    assert_eq!(keys.len(), 2, "{keys:?}");
}
