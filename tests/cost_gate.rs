//! The cost gate (envoy/cost_gate/, `make cost-gate`): the release filter
//! run under wasmtime with a recording proxy-wasm host, per request of each
//! bench scenario in steady state, must make no more ABI calls of any name
//! and burn no more fuel than envoy/cost_gate/budgets.json allows. Fuel and
//! calls are deterministic for a build (virtual clock, seeded randomness),
//! so the same figures come out on every machine; no time is measured.
//!
//! `cargo test --test cost_gate -- --nocapture` prints the figures;
//! `REDIS_GUARD_WRITE_BUDGETS=1 .venv/bin/python envoy/cost_gate/run.py`
//! writes them as the new budgets. A missing wasm, Python or wasmtime fails,
//! never skips.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::PathBuf;
use std::process::{Command, Output};

use support::*;

fn python() -> PathBuf {
    let p = root().join(".venv/bin/python");
    assert!(
        p.exists(),
        "{} not found: run `make wasi-dep` (the venv with the pinned wasmtime)",
        p.display()
    );
    p
}

fn gate(args: &[&str]) -> Output {
    let wasm = wasm_path();
    Command::new(python())
        .arg(root().join("envoy/cost_gate/run.py"))
        .arg("--wasm")
        .arg(&wasm)
        .args(args)
        // The gate's own report, never budgets rewritten by a test run.
        .env_remove("REDIS_GUARD_WRITE_BUDGETS")
        .output()
        .expect("run envoy/cost_gate/run.py")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Every hot path, each a scenario: the bench's (x), (b), (f), (e), (c) and
/// the paths issue 56 named, each checked to decide as it should (its
/// verdict, its local reply, the stats it moves) before it is measured.
const SCENARIOS: [&str; 17] = [
    "x",
    "b",
    "b.nolog",
    "f",
    "f.nolog",
    "e",
    "e.nolog",
    "c",
    "y",
    "t",
    "t.carried",
    "p",
    "d",
    "d.cached",
    "e.watch",
    "e.return",
    "c.replay",
];

#[test]
fn every_hot_path_stays_within_its_host_call_and_fuel_budget() {
    let out = gate(&["--report"]);
    let (stdout, stderr) = text(&out);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "the cost gate failed (exit {:?}):\n{stderr}\n{stdout}",
        out.status.code()
    );
    for id in SCENARIOS {
        assert!(
            stdout.contains(&format!("\n({id}) ")) || stdout.starts_with(&format!("({id}) ")),
            "({id}) ran: {stdout}"
        );
    }
    assert!(
        stdout.contains(&format!("{} scenarios within budget", SCENARIOS.len())),
        "every scenario ran: {stdout}"
    );
}

/// A scenario cannot pass on another path than its own: without the plan
/// it stores in Redis first, (t)'s decisions are made under the configured
/// bucket, and the gate fails saying so instead of measuring them.
#[test]
fn a_scenario_that_no_longer_takes_its_path_fails_the_gate() {
    for (id, stat) in [
        (
            "t",
            "ratelimit.bench-ov.override_applied rose by 0 in a round, expected 1",
        ),
        (
            "y",
            "ratelimit.bench-quota.override_applied rose by 0 in a round, expected 8",
        ),
    ] {
        let out = gate(&["--scenarios", id, "--drop-stored"]);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "({id}):\n{stderr}\n{stdout}");
        assert!(
            stderr.contains(&format!("({id}) stat {stat}")),
            "({id}): {stderr}"
        );
    }
}

/// The gate itself can fail: (b) measured against budgets that allow it
/// one call less and less fuel than it burns fails, naming the call and by
/// how much it grew.
#[test]
fn a_scenario_over_its_budget_fails_the_gate_and_says_what_grew() {
    let budgets = root().join("envoy/cost_gate/budgets.json");
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&budgets).unwrap()).unwrap();
    let b = &mut doc["scenarios"]["b"];
    let calls = b["calls"]["proxy_http_call"].as_u64().unwrap();
    assert_eq!(calls, 1, "(b) sends one call a request");
    b["calls"]["proxy_http_call"] = 0.into();
    let fuel = b["fuel"].as_u64().unwrap();
    b["fuel"] = (fuel / 2).into();
    b["fuel_ceiling"] = (fuel / 2).into();
    let scratch = Scratch::new("cost-gate");
    let lowered = scratch.0.join("budgets.json");
    std::fs::write(&lowered, serde_json::to_string(&doc).unwrap()).unwrap();
    let out = gate(&["--scenarios", "b", "--budgets", lowered.to_str().unwrap()]);
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(1),
        "over budget fails:\n{stderr}\n{stdout}"
    );
    assert!(
        stderr.contains("(b) proxy_http_call: 0 -> 1 per request (+1;"),
        "{stderr}"
    );
    assert!(stderr.contains("(b) fuel: "), "{stderr}");
    assert!(
        !stderr.contains("proxy_get_header_map_value"),
        "only what grew: {stderr}"
    );
}
