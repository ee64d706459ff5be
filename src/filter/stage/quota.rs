//! Calendar quotas: the clock their windows are computed at. The filter
//! sends each quota the edges of the window around its own clock and of one
//! window on each side; the script picks the one that holds Redis' TIME
//! (src/quota.rs, lua/quota.lua), so the renewal follows Redis' clock.

use crate::config::Config;
use crate::filter::Host;
use crate::ratelimit::Plan;

/// Test builds only (feature `test-clock`, tests/e2e_quota.rs): the
/// proxy's clock for quota windows, in ms since the epoch, taken from this
/// request header, as the scripts of that build take Redis' from a key. The
/// release build has no such path.
#[cfg(feature = "test-clock")]
pub const TEST_NOW: &str = "x-redis-guard-test-now";

/// The proxy's clock in ms since the epoch (saturating: a clock past year
/// 292 million is no window's).
fn now_ms<H: Host>(host: &H) -> i64 {
    #[cfg(feature = "test-clock")]
    if let Some(ms) = host
        .header(TEST_NOW)
        .and_then(|v| String::from_utf8(v).ok())
        .and_then(|v| v.parse::<i64>().ok())
    {
        return ms;
    }
    i64::try_from(host.now().as_millis()).unwrap_or(i64::MAX)
}

/// Gives each quota of `plan` its window edges at the proxy's clock; a plan
/// without a quota reads no clock.
pub fn on_request<H: Host>(host: &H, config: &Config, plan: &mut Plan) {
    let quota = |c: &crate::ratelimit::Check| {
        config
            .limits
            .get(c.limit)
            .is_some_and(|l| matches!(l.algorithm, crate::config::Algorithm::Quota { .. }))
    };
    if plan.checks.iter().any(quota) {
        plan.set_clock(config, now_ms(host));
    }
}
