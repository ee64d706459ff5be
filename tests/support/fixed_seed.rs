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
