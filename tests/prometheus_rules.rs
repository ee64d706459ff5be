//! The alert rules (envoy/prometheus/alerts.yaml) as Prometheus' own tool
//! reads them: `promtool check rules` accepts the file and `promtool test
//! rules` passes its unit tests (alerts_test.yaml), and every rule has at
//! least one case where it fires and one where it does not. A missing
//! promtool fails (Debian's `prometheus` package, in the Makefile's
//! APT_PACKAGES), never skips. tests/e2e_prometheus.rs runs the same rules
//! in a real Prometheus.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use support::*;

fn dir() -> PathBuf {
    root().join("envoy/prometheus")
}

fn promtool() -> PathBuf {
    let p = PathBuf::from("/usr/bin/promtool");
    assert!(
        p.exists(),
        "promtool not found at {}: run `make apt-deps` (Debian's prometheus package; \
         sudo apt-get install prometheus)",
        p.display()
    );
    p
}

/// Runs promtool with `args` in envoy/prometheus, bounded; returns its
/// output, failing the test with it unless promtool succeeded.
fn run_promtool(args: &[&str]) -> String {
    let scratch = Scratch::new("promtool");
    let (status, out) = run_to_exit(
        "promtool",
        Command::new(promtool()).args(args).current_dir(dir()),
        &scratch.0.join("promtool.log"),
        Duration::from_secs(60),
    );
    assert!(status.success(), "promtool {args:?} failed:\n{out}");
    out
}

fn yaml(name: &str) -> serde_yaml_ng::Value {
    let text = std::fs::read_to_string(dir().join(name)).unwrap();
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Every alerting rule of alerts.yaml, by name.
fn alerts() -> BTreeMap<String, serde_yaml_ng::Value> {
    let mut out = BTreeMap::new();
    for group in yaml("alerts.yaml")["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            let name = rule["alert"].as_str().expect("only alerting rules");
            assert!(
                out.insert(name.to_string(), rule.clone()).is_none(),
                "{name} twice"
            );
        }
    }
    out
}

#[test]
fn promtool_accepts_the_rules() {
    let out = run_promtool(&["check", "rules", "alerts.yaml"]);
    let want = format!("SUCCESS: {} rules found", alerts().len());
    assert!(out.contains(&want), "{out}");
}

#[test]
fn promtool_unit_tests_pass() {
    let out = run_promtool(&["test", "rules", "alerts_test.yaml"]);
    assert!(out.contains("SUCCESS"), "{out}");
    assert!(!out.contains("FAILED"), "{out}");
}

#[test]
fn every_rule_has_a_firing_and_a_quiet_case() {
    let alerts = alerts();
    assert_eq!(
        alerts.keys().map(String::as_str).collect::<Vec<_>>(),
        [
            "RedisGuardCalloutLatencyNearTimeout",
            "RedisGuardCircuitOpen",
            "RedisGuardIdempotencyStoreFailed",
            "RedisGuardOverLimitRatioHigh",
            "RedisGuardRedisUnreachable",
            "RedisGuardUsageSettlementsLost",
        ]
    );
    // (firing cases, quiet cases) per rule.
    let mut cases: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let tests = yaml("alerts_test.yaml");
    assert_eq!(tests["rule_files"][0].as_str(), Some("alerts.yaml"));
    for test in tests["tests"].as_sequence().unwrap() {
        for case in test["alert_rule_test"].as_sequence().unwrap() {
            let name = case["alertname"].as_str().unwrap();
            assert!(alerts.contains_key(name), "a test of no rule: {name}");
            let fired = !case["exp_alerts"].as_sequence().unwrap().is_empty();
            let entry = cases.entry(name.to_string()).or_default();
            if fired {
                entry.0 += 1;
            } else {
                entry.1 += 1;
            }
        }
    }
    for name in alerts.keys() {
        let (firing, quiet) = cases.get(name).copied().unwrap_or_default();
        assert!(
            firing >= 1 && quiet >= 1,
            "{name}: {firing} firing and {quiet} quiet cases"
        );
    }
}

#[test]
fn every_rule_has_a_severity_a_summary_and_a_runbook() {
    for (name, rule) in alerts() {
        let severity = rule["labels"]["severity"].as_str();
        assert!(
            matches!(severity, Some("critical" | "warning")),
            "{name}: severity {severity:?}"
        );
        let annotation = |a: &str| rule["annotations"][a].as_str().unwrap_or("").to_string();
        assert!(!annotation("summary").is_empty(), "{name}: no summary");
        assert!(
            annotation("description").contains("Runbook:"),
            "{name}: no runbook in its description"
        );
        // Prometheus naming: CamelCase, the project's prefix.
        assert!(name.starts_with("RedisGuard"), "{name}");
        assert!(name.chars().all(|c| c.is_ascii_alphanumeric()), "{name}");
    }
}
