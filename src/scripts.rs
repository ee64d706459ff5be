//! The Lua scripts, embedded at build time, with the SHA-1 that EVALSHA names
//! them by.

use std::sync::LazyLock;

use sha1::{Digest, Sha1};

use crate::codec::hex;

#[derive(Debug)]
pub struct Script {
    pub source: String,
    pub sha1: String,
}

impl Script {
    fn new(source: String) -> Script {
        let sha1 = hex(&Sha1::digest(source.as_bytes()));
        Script { source, sha1 }
    }
}

/// Where lua/ratelimit.lua takes the algorithm files.
const ALGORITHMS: &str = "-- @@ALGORITHMS@@\n";

/// Inserts `parts` at the marker line of `main` (at its end if it has none;
/// a unit test keeps the marker in place).
fn compose(main: &str, parts: &[&str]) -> String {
    let (head, tail) = main.split_once(ALGORITHMS).unwrap_or((main, ""));
    let mut out = String::with_capacity(main.len() + parts.iter().map(|p| p.len()).sum::<usize>());
    out.push_str(head);
    for part in parts {
        out.push_str(part);
    }
    out.push_str(tail);
    out
}

/// A request's idempotency lock and every rate limit in one atomic call: the
/// driver and clock from lua/ratelimit.lua, with both algorithms and the
/// idempotency record joined in.
pub static RATELIMIT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(compose(
        include_str!("../lua/ratelimit.lua"),
        &[
            include_str!("../lua/token_bucket.lua"),
            include_str!("../lua/sliding_window.lua"),
            include_str!("../lua/idempotency.lua"),
            include_str!("../lua/decide.lua"),
        ],
    ))
});

/// Requests of one worker decided in one call, one after another, each as
/// its own RATELIMIT call would be (lua/batch.lua around the same parts).
pub static BATCH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(compose(
        include_str!("../lua/batch.lua"),
        &[
            include_str!("../lua/token_bucket.lua"),
            include_str!("../lua/sliding_window.lua"),
            include_str!("../lua/idempotency.lua"),
            include_str!("../lua/decide.lua"),
        ],
    ))
});

/// One request admitted against a token bucket plus a batch of tokens leased
/// to the calling Envoy (lua/lease.lua with the token bucket joined in).
pub static LEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(compose(
        include_str!("../lua/lease.lua"),
        &[include_str!("../lua/token_bucket.lua")],
    ))
});

/// IN_PROGRESS -> COMPLETED for the lock's owner.
pub static IDEM_COMPLETE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/idempotency_complete.lua").to_string()));

/// IN_PROGRESS -> released for the lock's owner.
pub static IDEM_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/idempotency_release.lua").to_string()));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha1_is_forty_hex_digits_of_the_source() {
        assert_eq!(RATELIMIT.sha1.len(), 40);
        assert!(RATELIMIT.source.starts_with("--[[ redis-guard"));
        // The well-known SHA-1 of the empty script, as Redis computes it.
        assert_eq!(
            Script::new(String::new()).sha1,
            "da39a3ee5e6b4b0d3255bfef95601890afd80709"
        );
    }

    #[test]
    fn both_algorithms_are_joined_in_before_the_driver() {
        assert!(include_str!("../lua/ratelimit.lua").contains(ALGORITHMS));
        let src = &RATELIMIT.source;
        let tb = src.find("local function tb_check").unwrap();
        let sw = src.find("local function sw_check").unwrap();
        let idem = src.find("local function idem_check").unwrap();
        let driver = src.find("local results = {}").unwrap();
        let clock = src.find("redis.call('TIME')").unwrap();
        assert!(clock < tb && tb < sw && sw < idem && idem < driver);
        assert!(!src.contains(ALGORITHMS));
    }
}
