//! Calendar quotas (`quota`): an amount per month, week, day or hour of a
//! time zone's wall clock (src/quota.rs computes the windows).

use schemars::JsonSchema;
use serde::Deserialize;

use super::algorithm::Algorithm;
use super::bounds::MAX_COUNTER_LIMIT;
use super::ConfigError;
use crate::quota::{zone, Calendar, Per};

/// At most `amount` units per calendar window: a month from the anchor day,
/// a week from the anchor weekday, a day or an hour, on the wall clock of
/// `timeZone` (23- and 25-hour days, 28- to 31-day months). A new window
/// starts from zero when Redis' clock reaches its start.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Quota")]
pub(super) struct RawQuota {
    /// Units allowed per window.
    #[schemars(range(min = 1, max = 1125899906842624_u64))]
    amount: u64,
    /// The window: "month", "week", "day" or "hour".
    #[schemars(regex(pattern = r"^(month|week|day|hour)$"))]
    per: String,
    /// An IANA time zone name (`Europe/Berlin`, `America/New_York`, `UTC`).
    time_zone: String,
    /// month: the day a window starts (1-31; past a month's end, its last
    /// day; default 1). week: the ISO weekday (1 Monday to 7 Sunday;
    /// default 1). Not for day or hour.
    #[serde(default)]
    #[schemars(range(min = 1, max = 31))]
    #[schemars(default = "super::defaults::one")]
    anchor_day: Option<u8>,
}

pub(super) fn compile_quota(raw: &RawQuota, at: &str) -> Result<Algorithm, ConfigError> {
    let at = format!("{at}.quota");
    if raw.amount == 0 || raw.amount > MAX_COUNTER_LIMIT {
        return Err(ConfigError::new(
            format!("{at}.amount"),
            "must be between 1 and 2^50 (1125899906842624)",
        ));
    }
    let per = Per::parse(&raw.per).ok_or_else(|| {
        ConfigError::new(
            format!("{at}.per"),
            "must be \"month\", \"week\", \"day\" or \"hour\"",
        )
    })?;
    let zone = zone(&raw.time_zone).ok_or_else(|| {
        ConfigError::new(
            format!("{at}.timeZone"),
            "is not a time zone the filter knows: an IANA name such as `Europe/Berlin` or `UTC`",
        )
    })?;
    let anchor = match (per.anchors(), raw.anchor_day) {
        (_, None) => 1,
        (Some(range), Some(day)) if range.contains(&day) => day,
        (Some(range), Some(_)) => {
            return Err(ConfigError::new(
                format!("{at}.anchorDay"),
                format!(
                    "must be between {} and {} for a {}",
                    range.start(),
                    range.end(),
                    per.name()
                ),
            ))
        }
        (None, Some(_)) => {
            return Err(ConfigError::new(
                format!("{at}.anchorDay"),
                format!(
                    "a {} starts at midnight or on the hour: remove it",
                    per.name()
                ),
            ))
        }
    };
    Ok(Algorithm::Quota {
        amount: raw.amount,
        calendar: Calendar { per, zone, anchor },
    })
}
