//! Calendar quotas: a window that is a month, week, day or hour of a time
//! zone's wall clock, its edges computed from the zone's rules. Pure logic
//! (no host); the filter, the CLI and the tests share it.
//!
//! A window starts when the zone's wall clock reaches the start of its unit
//! (a month's anchor day, a week's anchor weekday, a day, an hour) at
//! 00:00 (the hour: :00). A start that the clock skips (a daylight-saving
//! gap at midnight, Samoa's missing 2011-12-30) is the first instant after
//! the gap; one it shows twice (a fall-back hour) is the first of the two.
//! So a day lasts 23, 24 or 25 hours, a month 28 to 31 days, and a skipped
//! wall-clock hour has no window. A repeated hour lengthens the window it
//! falls in: the hour before the fall-back lasts until the clock first
//! shows the next one, two hours where the clock falls back one, three at
//! Antarctica/Troll, whose clock falls back two (its 02:00 window holds
//! 02:00 +02, then 01:00 and 02:00 +00). A month's anchor day past the
//! month's end (the 31st in February) falls on its last day.
//!
//! Why the filter sends edges and the script picks one (lua/quota.lua):
//! Redis' TIME is the clock every decision reads, and Lua has no time-zone
//! rules. The filter computes, at its own clock, the edges of the window
//! around it and of one window on each side ([`Calendar::edges`]); the
//! script picks the window that holds Redis' TIME. The renewal thus
//! happens when Redis' clock crosses the edge, the same instant for every
//! Envoy, however far their clocks stray within a window; a proxy whose
//! clock is off by more than that gets an error reply (the failure mode
//! decides), never a count in the wrong window.

use chrono::{
    DateTime, Datelike, LocalResult, NaiveDate, NaiveDateTime, Offset, TimeDelta, TimeZone,
    Timelike,
};
use chrono_tz::Tz;

/// The calendar unit of a quota's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Per {
    Hour,
    Day,
    Week,
    Month,
}

impl Per {
    pub fn parse(s: &str) -> Option<Per> {
        match s {
            "hour" => Some(Per::Hour),
            "day" => Some(Per::Day),
            "week" => Some(Per::Week),
            "month" => Some(Per::Month),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Per::Hour => "hour",
            Per::Day => "day",
            Per::Week => "week",
            Per::Month => "month",
        }
    }

    /// The anchors the unit takes: a month's day (1-31), a week's ISO
    /// weekday (1 = Monday); a day and an hour start at midnight and :00.
    pub fn anchors(self) -> Option<std::ops::RangeInclusive<u8>> {
        match self {
            Per::Month => Some(1..=31),
            Per::Week => Some(1..=7),
            Per::Day | Per::Hour => None,
        }
    }

    /// The nominal length in ms (a 30-day month): what a policy header says
    /// before a window is known.
    pub fn nominal_ms(self) -> u64 {
        match self {
            Per::Hour => 3_600_000,
            Per::Day => 86_400_000,
            Per::Week => 604_800_000,
            Per::Month => 2_592_000_000,
        }
    }
}

/// A quota's calendar: its unit, zone and anchor (1 for a day or an hour).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Calendar {
    pub per: Per,
    pub zone: Tz,
    pub anchor: u8,
}

/// One window, [start, end) in ms since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub start_ms: i64,
    pub end_ms: i64,
}

/// The IANA tz database release compiled into this build (chrono-tz's, pinned
/// in Cargo.toml). A window's edges come from its rules: two builds with
/// different releases compute different windows for a zone whose rules
/// changed between them, and count one customer's window under two keys
/// (`<state key>:<start>`). So operators can check it: `redis-guard
/// --version`, the filter's startup log line, and the stat
/// `redis_guard.tzdb.<release>` (src/filter/counter.rs).
pub const TZDB_RELEASE: &str = chrono_tz::IANA_TZDB_VERSION;

/// Instants a quota is computed for: 1970 to about year 6400. Outside, no
/// window (the filter's clock or Redis' is broken).
const MAX_MS: i64 = 1 << 47;
/// More than any UTC offset a zone has had (+14:00, -12:00, LMT's +15:13).
const SPAN_MS: i64 = 26 * 3_600_000;
/// 1970-01-01 was a Thursday (ISO weekday 4).
const EPOCH_WEEKDAY: i64 = 4;
/// Empty units [`Calendar::edges`] steps over to find a neighbour: more
/// than any run of skipped units the database holds (a skipped day is 24
/// hours: Samoa 2011, Kwajalein 1993).
const MAX_SKIPPED: usize = 48;

/// A zone by its IANA name (`Europe/Berlin`, `UTC`), from the database
/// compiled into the filter.
pub fn zone(name: &str) -> Option<Tz> {
    name.parse::<Tz>().ok()
}

fn epoch() -> NaiveDate {
    NaiveDate::default()
}

fn utc(ms: i64) -> Option<NaiveDateTime> {
    DateTime::from_timestamp_millis(ms).map(|d| d.naive_utc())
}

/// The zone's wall clock at `ms`.
fn wall(zone: Tz, ms: i64) -> Option<NaiveDateTime> {
    let u = utc(ms)?;
    let off = zone.offset_from_utc_datetime(&u).fix().local_minus_utc();
    u.checked_add_signed(TimeDelta::try_seconds(i64::from(off))?)
}

fn days_in_month(y: i32, m: u32) -> Option<u32> {
    let (ny, nm) = if m == 12 {
        (y.checked_add(1)?, 1)
    } else {
        (y, m + 1)
    };
    let next = NaiveDate::from_ymd_opt(ny, nm, 1)?;
    let first = NaiveDate::from_ymd_opt(y, m, 1)?;
    u32::try_from((next - first).num_days()).ok()
}

impl Calendar {
    /// The first day of the anchor weekday on or after the epoch.
    fn week_shift(&self) -> i64 {
        (i64::from(self.anchor) - EPOCH_WEEKDAY).rem_euclid(7)
    }

    /// The unit whose wall-clock span holds `l` (its own month, week, day
    /// or hour, before the anchor day is considered: [`Calendar::window`]
    /// walks from there).
    fn unit_of(&self, l: NaiveDateTime) -> i64 {
        let days = (l.date() - epoch()).num_days();
        match self.per {
            Per::Month => i64::from(l.year()) * 12 + i64::from(l.month0()),
            Per::Week => (days - self.week_shift()).div_euclid(7),
            Per::Day => days,
            Per::Hour => days * 24 + i64::from(l.hour()),
        }
    }

    /// The wall-clock time unit `u` starts at.
    fn unit_start(&self, u: i64) -> Option<NaiveDateTime> {
        let day = |d: i64| epoch().checked_add_signed(TimeDelta::try_days(d)?);
        let date = match self.per {
            Per::Month => {
                let y = i32::try_from(u.div_euclid(12)).ok()?;
                let m = u32::try_from(u.rem_euclid(12)).ok()? + 1;
                let d = u32::from(self.anchor).min(days_in_month(y, m)?);
                NaiveDate::from_ymd_opt(y, m, d)?
            }
            Per::Week => day(u.checked_mul(7)?.checked_add(self.week_shift())?)?,
            Per::Day => day(u)?,
            Per::Hour => {
                let h = u32::try_from(u.rem_euclid(24)).ok()?;
                return day(u.div_euclid(24))?.and_hms_opt(h, 0, 0);
            }
        };
        date.and_hms_opt(0, 0, 0)
    }

    /// The instant the wall clock reaches `l`: the first of two when it
    /// shows `l` twice, the end of the gap when it skips it.
    fn instant(&self, l: NaiveDateTime) -> Option<i64> {
        match self.zone.from_local_datetime(&l) {
            LocalResult::Single(d) => Some(d.timestamp_millis()),
            LocalResult::Ambiguous(a, b) => Some(a.timestamp_millis().min(b.timestamp_millis())),
            LocalResult::None => {
                // The first instant whose wall clock is at or past `l`: a
                // binary search between instants whose clocks are before
                // and after it (no zone's offset reaches SPAN_MS).
                let at = l.and_utc().timestamp_millis();
                let (mut lo, mut hi) = (at.checked_sub(SPAN_MS)?, at.checked_add(SPAN_MS)?);
                while hi - lo > 1 {
                    let mid = lo + (hi - lo) / 2;
                    if wall(self.zone, mid)? >= l {
                        hi = mid;
                    } else {
                        lo = mid;
                    }
                }
                Some(hi)
            }
        }
    }

    fn start(&self, u: i64) -> Option<i64> {
        self.instant(self.unit_start(u)?)
    }

    /// The window holding `now_ms`, with its unit.
    fn unit_at(&self, now_ms: i64) -> Option<(i64, Window)> {
        if !(0..MAX_MS).contains(&now_ms) {
            return None;
        }
        let mut u = self.unit_of(wall(self.zone, now_ms)?);
        // A few steps at most: the wall clock's unit is the window's, or
        // the one before (before a month's anchor day, in a gap) or after
        // (a repeated hour).
        for _ in 0..8 {
            let start = self.start(u)?;
            if start > now_ms {
                u = u.checked_sub(1)?;
                continue;
            }
            let end = self.start(u.checked_add(1)?)?;
            if end <= now_ms {
                u = u.checked_add(1)?;
                continue;
            }
            return Some((
                u,
                Window {
                    start_ms: start,
                    end_ms: end,
                },
            ));
        }
        None
    }

    /// The window holding `now_ms` (ms since the epoch).
    pub fn window(&self, now_ms: i64) -> Option<Window> {
        self.unit_at(now_ms).map(|(_, w)| w)
    }

    /// The window holding `now_ms` and the calendar's windows just before
    /// and after it, as their four edges (increasing), which the script
    /// picks from by Redis' TIME. A neighbour is the nearest window that
    /// is not empty: a unit the clock skips (a spring-forward hour, two at
    /// Antarctica/Troll, Samoa's 24 of 2011-12-30) starts and ends at one
    /// instant, and an empty window sent as the neighbour would leave a
    /// Redis clock just past the edge no window to count in (an error
    /// reply for a request whose edges an Envoy computed in the last
    /// milliseconds before the gap).
    pub fn edges(&self, now_ms: i64) -> Option<[i64; 4]> {
        let (u, w) = self.unit_at(now_ms)?;
        // The unit before (after) the window, stepped over while empty.
        let mut before = u.checked_sub(1)?;
        let mut first = self.start(before)?;
        let mut after = u.checked_add(2)?;
        let mut last = self.start(after)?;
        for _ in 0..MAX_SKIPPED {
            if first < w.start_ms && last > w.end_ms {
                return Some([first, w.start_ms, w.end_ms, last]);
            }
            if first >= w.start_ms {
                before = before.checked_sub(1)?;
                first = self.start(before)?;
            }
            if last <= w.end_ms {
                after = after.checked_add(1)?;
                last = self.start(after)?;
            }
        }
        None
    }

    /// `ms` on the zone's wall clock, with its offset and the zone's name:
    /// `2027-02-01T00:00:00+01:00 Europe/Berlin` (how the CLI shows a
    /// renewal).
    pub fn format(&self, ms: i64) -> Option<String> {
        let u = utc(ms)?;
        let off = self
            .zone
            .offset_from_utc_datetime(&u)
            .fix()
            .local_minus_utc();
        let l = wall(self.zone, ms)?;
        let sign = if off < 0 { '-' } else { '+' };
        let a = off.unsigned_abs();
        Some(format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}{sign}{:02}:{:02} {}",
            l.year(),
            l.month(),
            l.day(),
            l.hour(),
            l.minute(),
            l.second(),
            a / 3600,
            a % 3600 / 60,
            self.zone.name()
        ))
    }
}

/// Which anchor day a quota's windows were computed for, sent with its
/// edges (`<edges>@<sent>,<default>,<max>`, lua/quota.lua): the script
/// reads the customer's stored override in the same call and, when the
/// anchor it sets (else `default`, the request's or the configuration's)
/// is not `sent`, decides nothing and names the right one. The filter
/// cannot read the stored override before it computes the windows, so the
/// script referees: a changed or deleted override is caught there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Anchoring {
    /// The anchor the edges were computed for.
    pub sent: u8,
    /// The anchor without a stored one: carried by the request, else
    /// configured (the precedence the amount follows).
    pub default: u8,
    /// The largest anchor the unit takes (31 a month, 7 a week): a stored
    /// one past it is an invalid override, ignored.
    pub max: u8,
}

impl Anchoring {
    /// The anchoring of a calendar whose windows take an anchor (a month
    /// or a week), for `default` and a stored anchor this Envoy remembers
    /// (out of range: not used).
    pub fn of(per: Per, default: u8, remembered: Option<u8>) -> Option<Anchoring> {
        let range = per.anchors()?;
        let sent = remembered.filter(|a| range.contains(a)).unwrap_or(default);
        Some(Anchoring {
            sent,
            default,
            max: *range.end(),
        })
    }

    /// What follows the edges in the script's argument.
    pub fn suffix(&self) -> String {
        format!("@{},{},{}", self.sent, self.default, self.max)
    }
}

/// Entries of an Envoy's anchor table (shared data: no expiry, no deletion,
/// so a fixed table indexed by the key's digest, as the over-limit cache's).
pub const ANCHOR_SLOTS: u32 = 4096;

/// Where one quota key's remembered anchor lives in an Envoy's shared data:
/// a stored override's anchor day, learnt from a script's mismatch reply,
/// so that the customer's next request is sent with the right windows.
/// A collision only evicts (one more mismatch); the digest in the entry
/// keeps another key's anchor from being used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnchorSlot {
    pub shared_key: String,
    digest: [u8; 16],
}

impl AnchorSlot {
    /// The slot of the key whose SHA-256 is `full`.
    pub fn of_digest(full: &[u8; 32]) -> AnchorSlot {
        let (shared_key, digest) =
            crate::keys::shared_slot_of("redis-guard/anchor", ANCHOR_SLOTS, full);
        AnchorSlot { shared_key, digest }
    }

    /// The entry remembering `anchor` (0: none, the default applies).
    pub fn entry(&self, anchor: u8) -> Vec<u8> {
        let mut out = Vec::with_capacity(17);
        out.extend_from_slice(&self.digest);
        out.push(anchor);
        out
    }

    /// The anchor the stored bytes remember for this key, if any.
    pub fn read(&self, stored: Option<&[u8]>) -> Option<u8> {
        match stored? {
            [digest @ .., anchor] if digest == self.digest && *anchor > 0 => Some(*anchor),
            _ => None,
        }
    }
}

#[cfg(test)]
#[path = "quota_tests.rs"]
mod tests;
