//! The Lua scripts, embedded at build time, with the SHA-1 that EVALSHA names
//! them by.

use std::sync::LazyLock;

use sha1::{Digest, Sha1};

use crate::keys::hex;

#[derive(Debug)]
pub struct Script {
    pub source: &'static str,
    pub sha1: String,
}

impl Script {
    fn new(source: &'static str) -> Script {
        Script {
            source,
            sha1: hex(&Sha1::digest(source.as_bytes())),
        }
    }
}

pub static RATELIMIT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/ratelimit.lua")));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha1_is_forty_hex_digits_of_the_source() {
        assert_eq!(RATELIMIT.sha1.len(), 40);
        assert!(RATELIMIT.source.starts_with("--[[ redis-guard"));
        // The well-known SHA-1 of the empty script, as Redis computes it.
        assert_eq!(
            Script::new("").sha1,
            "da39a3ee5e6b4b0d3255bfef95601890afd80709"
        );
    }
}
