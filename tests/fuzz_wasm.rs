//! The fuzzer (envoy/cost_gate/fuzz.py, `make fuzz`; the book: Inside it →
//! Reliability): the release filter under the cost gate's wasmtime host,
//! driven by seeded cases (configurations from the schema, arbitrary
//! requests, responses, Webdis replies and orders of callbacks) and checked
//! at every callback (no trap, no panic, no ABI call on a gone context, fuel
//! within its bound, decisions a reference would make).
//!
//! make test runs every regression trace of envoy/cost_gate/fuzz_corpus/
//! and FUZZ_CASES (default 2000) cases of the fixed run seed 1, on two
//! processes; `make fuzz` runs more, from a fresh seed. A missing wasm,
//! Python or wasmtime fails, never skips. Deterministic: the same build
//! runs the same cases.

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

fn fuzz(args: &[&str]) -> (Output, String) {
    let out = Command::new(python())
        .arg(root().join("envoy/cost_gate/fuzz.py"))
        .arg("--wasm")
        .arg(wasm_path())
        .args(args)
        .output()
        .expect("run envoy/cost_gate/fuzz.py");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

/// Every trace in the corpus (each a finding, shrunk, of a defect since
/// fixed) replays with every step still applying, and finds nothing.
#[test]
fn every_corpus_trace_replays_whole_and_clean() {
    let corpus = root().join("envoy/cost_gate/fuzz_corpus");
    let mut names: Vec<String> = std::fs::read_dir(&corpus)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        .collect();
    names.sort();
    assert!(names.len() >= 3, "the corpus: {names:?}");
    let (out, text) = fuzz(&["--corpus"]);
    println!("{text}");
    assert_eq!(out.status.code(), Some(0), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), names.len() + 1, "{text}");
    for (name, line) in names.iter().zip(&lines) {
        let (head, tail) = line.split_once(": ").unwrap();
        assert_eq!(head, name, "{text}");
        let steps = tail
            .strip_suffix(" steps, clean")
            .unwrap_or_else(|| panic!("{line}"));
        let (ran, of) = steps.split_once(" of ").unwrap();
        assert_eq!(ran, of, "every step of {name} still applies: {line}");
    }
    assert_eq!(
        lines[names.len()],
        format!("fuzz: {} replayed, 0 with findings", names.len())
    );
}

/// FUZZ_CASES cases (default 2000) of run seed 1 on two processes: none
/// finds anything. A failure prints each finding's case and the command
/// that replays it.
#[test]
fn seeded_cases_find_nothing() {
    let cases = std::env::var("FUZZ_CASES").unwrap_or_else(|_| "2000".to_string());
    let (out, text) = fuzz(&["--cases", &cases, "--seed", "1", "--jobs", "2"]);
    println!("{text}");
    assert_eq!(out.status.code(), Some(0), "{text}");
    let summary = text.lines().last().unwrap();
    assert!(
        summary.starts_with(&format!("fuzz: seed 1: {cases} cases (")),
        "{summary}"
    );
    assert!(summary.ends_with("; 0 finding(s)"), "{summary}");
}

/// The fuzzer can fail: with the fuel bound's fixed part at 1,000
/// instructions, the root context's creation (about 1,200) breaks it in
/// the first case, which exits 1 and says how to replay the case.
#[test]
fn a_finding_fails_the_run_and_says_how_to_replay_it() {
    let (out, text) = fuzz(&["--cases", "1", "--seed", "1", "--fuel-base", "1000"]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0].starts_with(
            "FINDING case 1:1: proxy_on_context_create(1) burnt 1,212 fuel on 0 bytes \
             (bound 1,000 + 120 a byte)"
        ),
        "{text}"
    );
    assert!(
        lines[1].starts_with(
            "  replay: .venv/bin/python envoy/cost_gate/fuzz.py --replay 1:1 --fuel-base 1000  \
             (trace: "
        ),
        "{text}"
    );
    assert!(lines[2].ends_with("; 1 finding(s): 1:1"), "{text}");
}
