//! Property-test settings for CI: a fixed seed and case count (so a run is
//! repeatable), each overridable from the environment (PROPTEST_CASES,
//! PROPTEST_RNG_SEED), and no regression files written into the tree.

use proptest::test_runner::{Config as ProptestConfig, RngSeed};

/// `cases` and `seed` unless the environment says otherwise; each shrink
/// step replays a case, so shrinking is bounded by `max_shrink_iters`.
pub fn config(cases: u32, seed: u64, max_shrink_iters: u32) -> ProptestConfig {
    // `default()` reads the PROPTEST_* environment variables.
    let base = ProptestConfig::default();
    let env_set = |name: &str| std::env::var_os(name).is_some();
    ProptestConfig {
        cases: if env_set("PROPTEST_CASES") {
            base.cases
        } else {
            cases
        },
        rng_seed: if env_set("PROPTEST_RNG_SEED") {
            base.rng_seed
        } else {
            RngSeed::Fixed(seed)
        },
        failure_persistence: None,
        max_shrink_iters,
        ..base
    }
}

/// A new seed every run, so that each run tries other cases, printed (the
/// output of a failing test is shown) so that a failure can be replayed:
/// `PROPTEST_RNG_SEED=<seed>`, which wins when set.
#[allow(dead_code)] // not every test binary that includes this file draws fresh seeds
pub fn fresh_seed() -> u64 {
    let seed = match std::env::var("PROPTEST_RNG_SEED") {
        Ok(seed) => seed.parse().expect("PROPTEST_RNG_SEED is a u64"),
        Err(_) => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            t.as_secs() ^ (u64::from(t.subsec_nanos()) << 32)
        }
    };
    eprintln!("replay with PROPTEST_RNG_SEED={seed}");
    seed
}
