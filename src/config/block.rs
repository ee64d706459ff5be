//! Blocking: once a limit rejects a key, the key stays refused for a while,
//! whatever the limit's refill says (a locked account after failed logins).

use schemars::JsonSchema;
use serde::Deserialize;

use super::algorithm::Algorithm;
use super::ConfigError;

/// Shortest and longest block: a second up to 30 days.
pub const BLOCK_MS: std::ops::RangeInclusive<u64> = 1_000..=2_592_000_000;

/// Once the limit rejects a key, refuse the key for `durationMs` (429 with
/// Retry-After at the block's end), checked and started in the same script
/// call that decides the request.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Block")]
pub(super) struct RawBlock {
    /// How long the key stays refused after a rejection (ms, 1000 to 2592000000).
    #[schemars(range(min = 1000, max = 2592000000_u64))]
    duration_ms: u64,
}

/// The block in ms, checked against what the limit is.
pub(super) fn compile_block(
    raw: RawBlock,
    at: &str,
    algorithm: &Algorithm,
    shadow: bool,
    leased: bool,
) -> Result<u64, ConfigError> {
    if !BLOCK_MS.contains(&raw.duration_ms) {
        return Err(ConfigError::new(
            format!("{at}.durationMs"),
            "must be between 1000 (a second) and 2592000000 (30 days)",
        ));
    }
    let why = if matches!(algorithm, Algorithm::Concurrency { .. }) {
        Some("a concurrency limit is full only while requests run: block with a rate limit")
    } else if shadow {
        Some("a shadow limit never rejects: it has nothing to block")
    } else if leased {
        Some("cannot go with `lease`: leased tokens are spent without Redis, where the block lives")
    } else {
        None
    };
    match why {
        Some(why) => Err(ConfigError::new(at, why)),
        None => Ok(raw.duration_ms),
    }
}
