//! Calendar quotas: the clock their windows are computed at. The filter
//! sends each quota the edges of the window around its own clock and of one
//! window on each side; the script picks the one that holds Redis' TIME
//! (src/quota.rs, lua/quota.lua), so the renewal follows Redis' clock.
//!
//! A customer's stored override may move its windows to another anchor day;
//! the script reads it in the call the edges go in, so it referees: edges
//! sent for another day than the override's are decided on by nobody, and
//! the reply names the day. This stage remembers it in the Envoy's shared
//! data (src/quota.rs `AnchorSlot`) and sends the request again, once, with
//! edges for it; the customer's later requests are sent with them at once.

use crate::config::{Algorithm, Config};
use crate::filter::Host;
use crate::quota::AnchorSlot;
use crate::ratelimit::{Check, Plan};

/// What a request's quotas did about anchors.
#[derive(Debug, Default)]
pub struct QuotaStage {
    /// The request went again after an anchor reply: a second one (the
    /// override changed in between) is not chased.
    resent: bool,
}

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

/// A quota whose windows a stored override may move: it takes stored
/// overrides and its unit takes an anchor (a month, a week).
fn movable(config: &Config, check: &Check) -> bool {
    config.limits.get(check.limit).is_some_and(|l| {
        l.overrides.redis
            && matches!(l.algorithm, Algorithm::Quota { calendar, .. } if calendar.per.anchors().is_some())
    })
}

impl QuotaStage {
    /// Gives each quota of `plan` its window edges at the proxy's clock, on
    /// the anchor day this Envoy remembers for its key; a plan without a
    /// quota reads no clock.
    pub fn on_request<H: Host>(&mut self, host: &H, config: &Config, plan: &mut Plan) {
        let quota = |c: &Check| {
            config
                .limits
                .get(c.limit)
                .is_some_and(|l| matches!(l.algorithm, Algorithm::Quota { .. }))
        };
        if !plan.checks.iter().any(quota) {
            return;
        }
        for check in &mut plan.checks {
            if movable(config, check) {
                let slot = AnchorSlot::of_digest(check.digest());
                let (stored, _) = host.shared_get(&slot.shared_key);
                check.remembered = slot.read(stored.as_deref());
            }
        }
        plan.set_clock(config, now_ms(host));
    }

    /// The script decided nothing: the quotas `moved` (check, anchor day)
    /// are on another day than their edges. Remembers each for its key (a
    /// plain write: any worker's newer answer is as good as ours; the
    /// default day is remembered as none) and computes the edges again.
    /// False when the request already went again: it is not sent a third
    /// time.
    pub fn on_anchors<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        plan: &mut Plan,
        moved: &[(usize, u8)],
    ) -> bool {
        if self.resent {
            return false;
        }
        self.resent = true;
        for (i, anchor) in moved {
            let Some(check) = plan.checks.get_mut(*i) else {
                return false;
            };
            if !movable(config, check) {
                return false;
            }
            let default = check.anchoring.map_or(*anchor, |a| a.default);
            let slot = AnchorSlot::of_digest(check.digest());
            let remembered = if *anchor == default { 0 } else { *anchor };
            host.shared_set(&slot.shared_key, &slot.entry(remembered), None);
            check.remembered = Some(*anchor);
        }
        plan.set_clock(config, now_ms(host));
        true
    }
}
