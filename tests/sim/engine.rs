//! The simulation's runner: seeded schedules, a fresh keyspace per schedule,
//! the first violation shrunk to a short schedule and printed with the seed
//! that replays it.
//!
//! Schedules come from proptest strategies (a well-kept generator with
//! shrinking, already the project's property-testing crate), run by a
//! `TestRunner` seeded from the property's own seed, so a run is the same
//! on every machine: `SIM_SEED` replays another seed, `SIM_CASES` sets the
//! schedules per property (`make test`: the default; `make sim`: many more).

use std::cell::{Cell, RefCell};
use std::fmt::Debug;
use std::time::{Duration, Instant};

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use redis::Connection;

/// Schedules per property when `SIM_CASES` is not set.
pub const DEFAULT_CASES: u32 = 10_000;

/// Shrinking stops after this many tries: a violation found is reported
/// either way, shrunk as far as it got.
const SHRINK_ITERS: u32 = 20_000;

/// One property's run.
pub struct Property {
    pub name: &'static str,
    /// Its seed in `make test` (`SIM_SEED` overrides every property's).
    pub seed: u64,
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

/// Schedules per property for this run.
pub fn cases() -> u32 {
    env_u64("SIM_CASES")
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(DEFAULT_CASES)
}

/// The fresh state a schedule starts from: every key of the last one gone
/// (the scripts are cached, so nothing is loaded again).
pub fn fresh(con: &mut Connection) {
    redis::cmd("FLUSHDB")
        .query::<()>(con)
        .unwrap_or_else(|e| panic!("FLUSHDB: {e}"));
}

/// Loads `scripts` once (FLUSHDB keeps them): every call is then an
/// EVALSHA, as the filter sends it, not the whole source each time.
pub fn load(con: &mut Connection, scripts: &[&redis_guard::scripts::Script]) {
    for s in scripts {
        crate::support::script::load(con, s);
    }
}

/// What a run found: schedules run, and the first violation (shrunk).
pub struct Outcome<S> {
    pub ran: u32,
    pub took: Duration,
    pub violation: Option<(String, S)>,
}

/// Runs `cases` schedules drawn from `strategy` through `check`, which
/// returns `Err(what was violated)`; the first violation is shrunk.
pub fn explore<S, G>(
    prop: &Property,
    cases: u32,
    strategy: G,
    mut check: impl FnMut(&S) -> Result<(), String>,
) -> Outcome<S>
where
    S: Clone + Debug,
    G: Strategy<Value = S>,
{
    let seed = env_u64("SIM_SEED").unwrap_or(prop.seed);
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    // The property's name goes into the seed too: one SIM_SEED gives every
    // property a stream of its own.
    let name = prop.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    bytes[8..16].copy_from_slice(&name.to_le_bytes());
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: SHRINK_ITERS,
        max_global_rejects: cases.saturating_mul(4),
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes));
    let started = Instant::now();
    // The runner takes an `Fn`: the check (which holds the connection)
    // and the count live in cells.
    let ran = Cell::new(0u32);
    let check = RefCell::new(&mut check);
    let result = runner.run(&strategy, |s| {
        ran.set(ran.get() + 1);
        (check.borrow_mut())(&s).map_err(TestCaseError::fail)
    });
    let ran = ran.get();
    let violation = match result {
        Ok(()) => None,
        Err(TestError::Fail(why, minimal)) => Some((why.to_string(), minimal)),
        Err(TestError::Abort(why)) => panic!("{}: the run stopped: {why}", prop.name),
    };
    Outcome {
        ran,
        took: started.elapsed(),
        violation,
    }
}

/// [`explore`], then fails the test with the seed and the shrunk schedule
/// on a violation.
pub fn holds<S, G>(prop: &Property, strategy: G, check: impl FnMut(&S) -> Result<(), String>)
where
    S: Clone + Debug,
    G: Strategy<Value = S>,
{
    let seed = env_u64("SIM_SEED").unwrap_or(prop.seed);
    let n = cases();
    let out = explore(prop, n, strategy, check);
    eprintln!(
        "sim {}: seed {seed:#x}, {} schedule runs (shrinking included) in {:.1} s",
        prop.name,
        out.ran,
        out.took.as_secs_f64()
    );
    if let Some((why, schedule)) = out.violation {
        panic!(
            "sim {}: VIOLATION (seed {seed:#x}; replay: SIM_SEED={seed:#x} SIM_CASES={n} \
             cargo test --test sim {})\n  {why}\n  shrunk schedule: {schedule:#?}",
            prop.name, prop.name
        );
    }
}
