//! `redis-guard plans import|diff|export`: a billing system's whole set of
//! customers' plans applied at once, idempotently, checked line by line
//! before anything is written; what an import would change; what is
//! stored, in the canonical form an import reads back byte for byte.
//! Against a real redis-server; built with the `cli` feature.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde_json::Value;
use support::*;

/// Two limits that take plans (a token bucket per key; a monthly quota
/// whose requests may cost up to 50) and one that takes none.
fn config(dir: &Scratch) -> PathBuf {
    let path = dir.0.join("filter.json");
    let json = filter_config(2000)
        .field("hashTag", r#"[{"header":"x-api-key"}]"#)
        .field(
            "limits",
            r#"[{"name":"per-key","descriptor":[{"header":"x-api-key"}],
                 "tokenBucket":{"capacity":5,"refill":5,"periodMs":3600000},
                 "overrides":{"redis":true}},
                {"name":"monthly","descriptor":[{"header":"x-api-key"}],
                 "quota":{"amount":1000,"per":"month","timeZone":"UTC"},
                 "costHeader":{"name":"x-cost","max":50},
                 "overrides":{"redis":true}},
                {"name":"plain","descriptor":[{"header":"x-api-key"}],
                 "fixedWindow":{"limit":10,"windowMs":60000}}]"#,
        )
        .build();
    std::fs::write(&path, json).unwrap();
    path
}

/// What one run of the CLI gave.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", self.stdout, self.stderr))
    }
}

/// `redis-guard [--json] plans <args> --config .. --redis ..`.
fn plans(config: &Path, redis: &Redis, json: bool, args: &[&str]) -> Run {
    plans_on(
        config,
        &["--redis".to_string(), redis.admin_url()],
        json,
        args,
    )
}

/// As [`plans`], with these Redis arguments (a cluster's seeds).
fn plans_on(config: &Path, redis: &[String], json: bool, args: &[&str]) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_redis-guard"));
    cmd.env_clear();
    if json {
        cmd.arg("--json");
    }
    let out = cmd
        .arg("plans")
        .args(args)
        .args(["--config", config.to_str().unwrap()])
        .args(redis)
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap(),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

fn bucket(who: &str, capacity: u64, refill: u64) -> String {
    format!(
        r#"{{"limit":"per-key","values":{{"x-api-key":"{who}"}},"capacity":{capacity},"refill":{refill}}}"#
    )
}

fn quota(who: &str, amount: u64, anchor: u8) -> String {
    format!(
        r#"{{"limit":"monthly","values":{{"x-api-key":"{who}"}},"quota":{amount},"anchorDay":{anchor}}}"#
    )
}

/// 10,000 plans of both limits, in the canonical form (sorted by limit,
/// then by line): 7,000 buckets by tier and 3,000 quotas by billing day.
fn ten_thousand() -> Vec<String> {
    let tiers = [(100, 10), (1000, 100), (10_000, 1000)];
    let mut lines: Vec<String> = (0..7000)
        .map(|i| {
            let (c, r) = tiers[i % 3];
            bucket(&format!("cust-{i:05}"), c, r)
        })
        .chain((0..3000).map(|i| {
            quota(
                &format!("cust-{i:05}"),
                50_000 + i as u64,
                1 + (i % 28) as u8,
            )
        }))
        .collect();
    lines.sort();
    lines
}

fn write(dir: &Scratch, name: &str, lines: &[String]) -> PathBuf {
    let path = dir.0.join(name);
    std::fs::write(
        &path,
        lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
    path
}

fn dbsize(redis: &Redis) -> i64 {
    redis::cmd("DBSIZE").query(&mut redis.conn()).unwrap()
}

fn counts(report: &Value) -> [u64; 4] {
    ["added", "changed", "unchanged", "removed"].map(|k| report[k].as_u64().unwrap())
}

fn reset_stats(redis: &Redis) {
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query::<()>(&mut redis.conn())
        .unwrap();
}

#[test]
fn ten_thousand_plans_import_once_then_nothing_differs_and_export_gives_the_file_back() {
    let redis = Redis::start();
    let dir = Scratch::new("cli-bulk-plans");
    let config = config(&dir);
    let lines = ten_thousand();
    let file = write(&dir, "plans.jsonl", &lines);
    let path = file.to_str().unwrap();

    // Before: everything would be added.
    let diff = plans(&config, &redis, true, &["diff", path]);
    assert_eq!(diff.code, 1, "{}", diff.stderr);
    assert_eq!(counts(&diff.json()), [10_000, 0, 0, 0]);
    assert_eq!(dbsize(&redis), 0, "diff writes nothing");

    // Applied: 10,000 plans in 20 MSETs of 500.
    reset_stats(&redis);
    let start = Instant::now();
    let import = plans(&config, &redis, true, &["import", path]);
    let took = start.elapsed();
    eprintln!(
        "plans import of 10,000 plans (2 limits, one Redis on loopback, debug build): {took:?}"
    );
    assert_eq!(import.code, 0, "{}", import.stderr);
    let report = import.json();
    assert_eq!(counts(&report), [10_000, 0, 0, 0]);
    assert_eq!(report["writeRoundTrips"], 20);
    assert_eq!(dbsize(&redis), 10_000);
    let mut con = redis.conn();
    assert_eq!(command_calls(&mut con, "mset"), 20);
    assert_eq!(
        command_calls(&mut con, "set") + command_calls(&mut con, "del"),
        0
    );
    // Each is the plan `override set` would have stored, with no TTL.
    let shown = cli_json_on(
        env!("CARGO_BIN_EXE_redis-guard"),
        &redis,
        &config,
        &[
            "override",
            "show",
            "--limit",
            "monthly",
            "--value",
            "x-api-key=cust-00029",
        ],
    );
    assert_eq!(
        shown["override"],
        serde_json::json!({"quota": 50_029, "anchorDay": 2})
    );
    assert_eq!(shown["ttlMs"], -1);

    // Again: nothing changes, nothing is written; diff says nothing differs.
    reset_stats(&redis);
    let again = plans(&config, &redis, true, &["import", path]);
    assert_eq!(counts(&again.json()), [0, 0, 10_000, 0]);
    assert_eq!(again.json()["writeRoundTrips"], 0);
    assert_eq!(command_calls(&mut con, "mset"), 0);
    let diff = plans(&config, &redis, false, &["diff", path]);
    assert_eq!(diff.code, 0, "{}{}", diff.stdout, diff.stderr);
    assert!(
        diff.stdout.ends_with("nothing differs\n"),
        "{}",
        diff.stdout
    );

    // Export: the file, byte for byte.
    let export = plans(&config, &redis, false, &["export"]);
    assert_eq!(export.code, 0, "{}", export.stderr);
    assert!(
        export.stdout == std::fs::read_to_string(&file).unwrap(),
        "export differs from the file"
    );
    let only = plans(&config, &redis, false, &["export", "--limit", "monthly"]);
    assert_eq!(only.stdout.lines().count(), 3000);

    // One plan changed in the file, one added: diff shows both, exit 1;
    // the import writes those two only.
    let mut edited = lines.clone();
    let at = edited
        .iter()
        .position(|l| *l == bucket("cust-00042", 100, 10))
        .unwrap();
    edited[at] = bucket("cust-00042", 250, 25);
    edited.push(quota("cust-99999", 60, 15));
    edited.sort();
    let edited_file = write(&dir, "edited.jsonl", &edited);
    let edited_path = edited_file.to_str().unwrap();
    let diff = plans(&config, &redis, false, &["diff", edited_path]);
    assert_eq!(diff.code, 1);
    let changed: Vec<&str> = diff
        .stdout
        .lines()
        .filter(|l| l.starts_with(['+', '~', '-']))
        .collect();
    assert_eq!(
        changed,
        [
            format!("+ {}", quota("cust-99999", 60, 15)),
            format!(
                "~ {} (was {{\"capacity\":100,\"refill\":10}})",
                bucket("cust-00042", 250, 25)
            ),
        ]
    );
    reset_stats(&redis);
    let import = plans(&config, &redis, true, &["import", edited_path]);
    assert_eq!(counts(&import.json()), [1, 1, 9_999, 0]);
    assert_eq!(command_calls(&mut con, "mset"), 1);
    assert_eq!(dbsize(&redis), 10_001);
    assert_eq!(
        plans(&config, &redis, false, &["diff", edited_path]).code,
        0
    );

    // --prune: plans of the file's limits that the file lacks are removed
    // (after the writes); without it they stay.
    let pruned: Vec<String> = edited
        .iter()
        .filter(|l| !l.contains("\"cust-00007\"") && !l.contains("\"cust-06999\""))
        .cloned()
        .collect();
    assert_eq!(pruned.len(), 10_001 - 3);
    let pruned_file = write(&dir, "pruned.jsonl", &pruned);
    let pruned_path = pruned_file.to_str().unwrap();
    assert_eq!(
        counts(&plans(&config, &redis, true, &["diff", pruned_path]).json()),
        [0, 0, 9_998, 0]
    );
    let diff = plans(&config, &redis, true, &["diff", pruned_path, "--prune"]);
    assert_eq!((diff.code, counts(&diff.json())), (1, [0, 0, 9_998, 3]));
    let import = plans(&config, &redis, true, &["import", pruned_path, "--prune"]);
    assert_eq!(counts(&import.json()), [0, 0, 9_998, 3]);
    assert_eq!(import.json()["writeRoundTrips"], 1);
    assert_eq!(dbsize(&redis), 9_998);
    let export = plans(&config, &redis, false, &["export"]);
    assert!(
        export.stdout == std::fs::read_to_string(&pruned_file).unwrap(),
        "export after --prune"
    );
    // --prune --limit: only that limit's plans are judged by the file.
    let buckets_only: Vec<String> = pruned
        .iter()
        .filter(|l| l.contains("per-key"))
        .cloned()
        .collect();
    let file = write(&dir, "buckets.jsonl", &buckets_only);
    let scoped = plans(
        &config,
        &redis,
        true,
        &[
            "diff",
            file.to_str().unwrap(),
            "--prune",
            "--limit",
            "per-key",
        ],
    );
    assert_eq!((scoped.code, counts(&scoped.json())), (0, [0, 0, 6_998, 0]));
    // A line of a limit outside --limit is refused.
    let refused = plans(
        &config,
        &redis,
        false,
        &["diff", pruned_path, "--limit", "per-key"],
    );
    assert_eq!(refused.code, 4);
    assert!(
        refused
            .stderr
            .contains("line 1: limit `monthly` is not one of --limit"),
        "{}",
        refused.stderr
    );
}

#[test]
fn a_malformed_line_stops_the_import_before_anything_is_written() {
    let redis = Redis::start();
    let dir = Scratch::new("cli-bulk-plans-bad");
    let config = config(&dir);
    // A plan stored before: a refused import leaves it as it was.
    let mut con = redis.conn();
    let first = vec![bucket("cust-00000", 7, 7)];
    let path = write(&dir, "first.jsonl", &first);
    assert_eq!(
        plans(&config, &redis, false, &["import", path.to_str().unwrap()]).code,
        0
    );
    let stored = || -> Vec<(String, String)> {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query(&mut redis.conn())
            .unwrap();
        keys.into_iter()
            .map(|k| {
                let v: String = redis::cmd("GET").arg(&k).query(&mut redis.conn()).unwrap();
                (k, v)
            })
            .collect()
    };
    let before = stored();
    assert_eq!(before.len(), 1);
    assert_eq!(before[0].1, "tb 7 7");

    let cases: [(&str, &str); 9] = [
        (
            r#"{"limit":"nope","values":{"x-api-key":"a"},"quota":5}"#,
            "no limit named `nope`",
        ),
        (
            r#"{"limit":"plain","values":{"x-api-key":"a"},"quota":5}"#,
            "limit `plain` takes no overrides",
        ),
        (
            r#"{"limit":"monthly","values":{"x-api-key":"a"},"quota":49}"#,
            "49 leaves no room for a request of cost 50",
        ),
        (
            r#"{"limit":"monthly","values":{"x-api-key":"a"},"quota":50,"anchorDay":32}"#,
            "out of bounds",
        ),
        (
            r#"{"limit":"per-key","values":{"x-api-key":"a"},"quota":50}"#,
            "a token bucket's override is a capacity and a refill",
        ),
        (
            r#"{"limit":"per-key","values":{"x-user":"a"},"capacity":5,"refill":5}"#,
            "--value x-user",
        ),
        (
            r#"{"limit":"per-key","values":{"x-api-key":"a"},"capacity":5,"refill":5"#,
            "not a plan's JSON object",
        ),
        (
            r#"{"limit":"per-key","key":"rg:ov:{x}:per-key:1:a","capacity":5,"refill":5}"#,
            "is not an override key of limit `per-key`",
        ),
        (
            &bucket("cust-00000", 5, 5),
            "the same plan's key as line 3001",
        ),
    ];
    for (bad, why) in cases {
        let mut lines = ten_thousand();
        lines[6999] = bad.to_string();
        let file = write(&dir, "bad.jsonl", &lines);
        reset_stats(&redis);
        for verb in ["import", "diff"] {
            let run = plans(&config, &redis, false, &[verb, file.to_str().unwrap()]);
            assert_eq!(run.code, 4, "{verb} {bad}: {}{}", run.stdout, run.stderr);
            assert!(
                run.stderr.contains("bad.jsonl line 7000: ") && run.stderr.contains(why),
                "{verb} {bad}: {}",
                run.stderr
            );
            assert!(
                run.stderr.trim_end().ends_with("nothing was written"),
                "{}",
                run.stderr
            );
            assert_eq!(run.stdout, "");
        }
        // Not a read, not a write: Redis was not even asked.
        assert_eq!(
            command_calls(&mut con, "mget") + command_calls(&mut con, "mset"),
            0,
            "{bad}"
        );
        assert_eq!(stored(), before, "{bad}");
    }

    // Every bad line is counted, the first named with its reason.
    let mut lines = ten_thousand();
    for at in [6999, 7999, 8999] {
        lines[at] = r#"{"limit":"nope","quota":5}"#.to_string();
    }
    let file = write(&dir, "bad.jsonl", &lines);
    let run = plans(&config, &redis, true, &["import", file.to_str().unwrap()]);
    assert_eq!(run.code, 4);
    assert_eq!(run.json()["error"]["kind"], "selection");
    assert!(
        run.stderr.contains("line 7000: no limit named `nope`"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr
            .contains("2 more bad line(s): 8000, 9000; nothing was written"),
        "{}",
        run.stderr
    );
    assert_eq!(stored(), before);
}

#[test]
fn csv_and_long_values_round_trip_through_the_canonical_form() {
    let redis = Redis::start();
    let dir = Scratch::new("cli-bulk-plans-csv");
    let config = config(&dir);
    // A value past 128 bytes is in the key only as its digest: its plan is
    // exported by its key, which an import takes as well.
    let long = "k".repeat(200);
    let csv = format!(
        "limit,x-api-key,capacity,refill,quota,anchorDay\n\
         per-key,acme,100,10,,\n\
         monthly,acme,,,5000,15\n\
         monthly,\"glo,bex\",,,60,\n\
         per-key,{long},9,9,,\n"
    );
    let file = dir.0.join("plans.csv");
    std::fs::write(&file, csv).unwrap();
    let import = plans(&config, &redis, true, &["import", file.to_str().unwrap()]);
    assert_eq!(import.code, 0, "{}", import.stderr);
    assert_eq!(counts(&import.json()), [4, 0, 0, 0]);

    let shown = cli_json_on(
        env!("CARGO_BIN_EXE_redis-guard"),
        &redis,
        &config,
        &[
            "override",
            "show",
            "--limit",
            "per-key",
            "--value",
            &format!("x-api-key={long}"),
        ],
    );
    let long_key = shown["key"].as_str().unwrap();
    assert!(long_key.contains(":per-key:#"), "{long_key}");
    let expected = [
        r#"{"limit":"monthly","values":{"x-api-key":"acme"},"quota":5000,"anchorDay":15}"#
            .to_string(),
        r#"{"limit":"monthly","values":{"x-api-key":"glo,bex"},"quota":60}"#.to_string(),
        format!(r#"{{"limit":"per-key","key":"{long_key}","capacity":9,"refill":9}}"#),
        bucket("acme", 100, 10),
    ];
    let export = plans(&config, &redis, false, &["export"]);
    assert_eq!(
        export.stdout,
        expected
            .iter()
            .map(|l| format!("{l}\n"))
            .collect::<String>()
    );

    // The export imported into an empty Redis, exported again: the same bytes.
    let other = Redis::start();
    let exported = dir.0.join("exported.jsonl");
    std::fs::write(&exported, &export.stdout).unwrap();
    let import = plans(
        &config,
        &other,
        true,
        &["import", exported.to_str().unwrap()],
    );
    assert_eq!(counts(&import.json()), [4, 0, 0, 0]);
    assert_eq!(
        plans(&config, &other, false, &["export"]).stdout,
        export.stdout
    );
    // And the CSV against it: nothing differs.
    assert_eq!(
        plans(&config, &other, false, &["diff", file.to_str().unwrap()]).code,
        0
    );

    // A stored plan the filter ignores is left out of the export (named on
    // stderr), and an import replaces it.
    let acme = cli_json_on(
        env!("CARGO_BIN_EXE_redis-guard"),
        &redis,
        &config,
        &[
            "override",
            "show",
            "--limit",
            "per-key",
            "--value",
            "x-api-key=acme",
        ],
    );
    let key = acme["key"].as_str().unwrap();
    redis::cmd("SET")
        .arg(key)
        .arg("garbage")
        .query::<()>(&mut redis.conn())
        .unwrap();
    let export = plans(&config, &redis, false, &["export", "--limit", "per-key"]);
    assert_eq!(export.stdout, format!("{}\n", expected[2]));
    assert!(
        export.stderr.contains("`garbage`): the filter ignores it"),
        "{}",
        export.stderr
    );
    let import = plans(&config, &redis, false, &["import", file.to_str().unwrap()]);
    assert!(
        import.stdout.starts_with(&format!(
            "~ {} (was `garbage`, which the filter ignores)\n",
            bucket("acme", 100, 10)
        )),
        "{}",
        import.stdout
    );

    // Export of a limit that takes no plans, or of none: a selection error.
    assert_eq!(
        plans(&config, &redis, false, &["export", "--limit", "plain"]).code,
        4
    );
    assert_eq!(
        plans(&config, &redis, false, &["export", "--limit", "nope"]).code,
        4
    );
}

#[test]
fn against_a_redis_cluster_each_plan_lands_on_its_slots_master_and_exports_per_master() {
    let cluster = support::cluster::RedisCluster::start();
    let dir = Scratch::new("cli-bulk-plans-cluster");
    let config = config(&dir);
    // Figures differ per customer, so a value read back for another key
    // (MGET's answers split across masters and put together) would show.
    let mut lines: Vec<String> = (0..1200)
        .map(|i| bucket(&format!("cust-{i:05}"), 100 + i, 10))
        .collect();
    lines.sort();
    let file = write(&dir, "plans.jsonl", &lines);
    let path = file.to_str().unwrap();
    let url = |port: &u16| format!("redis://admin:{REDIS_ADMIN_PASSWORD}@127.0.0.1:{port}/");
    let mut seeds = vec!["--cluster".to_string()];
    for port in &cluster.ports {
        seeds.extend(["--redis".to_string(), url(port)]);
    }

    // One node without --cluster holds only some slots: refused, nothing written.
    let one = ["--redis".to_string(), url(&cluster.ports[0])];
    let refused = plans_on(&config, &one, false, &["import", path]);
    assert_eq!(refused.code, 4, "{}", refused.stderr);
    assert!(
        refused.stderr.contains("add --cluster"),
        "{}",
        refused.stderr
    );
    assert!(cluster.keys_by_node("rg:ov:*").is_empty());

    let import = plans_on(&config, &seeds, true, &["import", path]);
    assert_eq!(import.code, 0, "{}", import.stderr);
    assert_eq!(counts(&import.json()), [1200, 0, 0, 0]);
    // Each key on the master owning its slot, and every master holds some.
    let by_node = cluster.keys_by_node("rg:ov:*");
    assert_eq!(by_node.values().map(Vec::len).sum::<usize>(), 1200);
    assert_eq!(by_node.len(), 3);

    let again = plans_on(&config, &seeds, true, &["import", path]);
    assert_eq!(counts(&again.json()), [0, 0, 1200, 0]);
    assert_eq!(plans_on(&config, &seeds, false, &["diff", path]).code, 0);

    // Export scans one server: per master, the parts make the file.
    let mut exported: Vec<String> = Vec::new();
    for port in &cluster.ports {
        let run = plans_on(
            &config,
            &["--redis".to_string(), url(port)],
            false,
            &["export"],
        );
        assert_eq!(run.code, 0, "{}", run.stderr);
        exported.extend(run.stdout.lines().map(str::to_string));
    }
    exported.sort();
    assert_eq!(exported, lines);
    let refused = plans_on(&config, &seeds, false, &["export"]);
    assert_eq!(refused.code, 4, "{}", refused.stderr);
    let refused = plans_on(&config, &seeds, false, &["import", path, "--prune"]);
    assert_eq!(refused.code, 4, "{}", refused.stderr);
}
