//! Per-value overrides: a limit that takes them reads, in the same script
//! call, an override stored in Redis for the request's key (`redis-guard
//! override set`), whose numbers replace the configured ones.

use schemars::JsonSchema;
use serde::Deserialize;

use super::algorithm::Algorithm;
use super::parts::{compile_part, Part, RawPart};
use super::ConfigError;

/// Where a limit's overrides come from.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Overrides")]
pub(super) struct RawOverrides {
    /// Look up an override for the request's descriptor values in Redis
    /// (one key per value, beside the limit's state, same hash tag), in the
    /// same call that decides the request: a token bucket's capacity and
    /// refill, a window's limit, a quota's amount, a concurrency limit's
    /// maximum; for a usage-based limit, its settlement after the response
    /// reads it too; a leased bucket's key with a stored plan is decided
    /// strictly under it, with no tokens leased. Set with `redis-guard
    /// override set`.
    #[serde(default)]
    redis: bool,
    /// A part whose value overrides the limit for this request (a claim, a
    /// metadata value a trusted ext_authz wrote, a header a trusted filter
    /// sets): a whole number (a bucket's capacity and refill, a window's
    /// limit) or an override's text (`tb 10000 10000`). One stored in Redis
    /// wins over it.
    #[serde(default)]
    request: Option<RawPart>,
}

/// A limit's overrides: looked up in Redis, carried by the request, or both.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Overrides {
    pub redis: bool,
    pub request: Option<Part>,
}

/// Where the limit's overrides come from, checked against what it is.
pub(super) fn compile_overrides(
    raw: RawOverrides,
    at: &str,
    algorithm: &Algorithm,
    leased: bool,
) -> Result<Overrides, ConfigError> {
    let request = match raw.request {
        Some(p) => Some(compile_part(p, &format!("{at}.request"))?),
        None => None,
    };
    if !raw.redis && request.is_none() {
        return Err(ConfigError::new(
            at,
            "set `redis`, `request` or both: where the overrides come from",
        ));
    }
    let why = match algorithm {
        Algorithm::Gcra { .. } => Some(
            "a GCRA limit's state is kept in units of its rate, which an override would change: its stored arrival time would mean another backlog under another customer's rate, and the key does not say which rate wrote it; use a token bucket",
        ),
        // A plan stored in Redis is read by the grant itself (lua/lease.lua
        // grants nothing to a key that has one); a carried one never
        // reaches Redis, so leased tokens would be spent under it.
        _ if leased && request.is_some() => Some(
            "cannot go with `lease`: leased tokens are spent without Redis under the numbers of the grant, which a carried override would change per request; store the plans in Redis (`redis`), whose keys lua/lease.lua decides strictly under their plan",
        ),
        _ => None,
    };
    let field = if raw.redis && !(leased && request.is_some()) {
        "redis"
    } else {
        "request"
    };
    match why {
        Some(why) => Err(ConfigError::new(format!("{at}.{field}"), why)),
        None => Ok(Overrides {
            redis: raw.redis,
            request,
        }),
    }
}
