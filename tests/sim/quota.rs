//! Calendar quotas across clocks: requests decided at Redis' clock (the
//! test clock) near the zones' transitions, their window edges computed by
//! the filter's real calendar core (`Calendar::edges`) at an Envoy clock
//! that strays from Redis' by up to a few hours, through the real
//! lua/ratelimit.lua.
//!
//! Reference, from the book (Calendar quotas): a window starts when the
//! zone's wall clock first reaches the start of its hour or day, and holds
//! every instant until the next such start; at most `amount` units are
//! admitted in it. It is computed here by walking the wall clock in
//! 15-minute steps (every zone's offset since 1970 is a multiple of 15
//! minutes) and keeping the highest unit reached. Checked per request:
//! the edges sent never hold an empty window; a request whose Redis
//! instant lies in the Envoy instant's window or a neighbour is decided
//! (never an error); and no window admits more than its amount.

use std::collections::HashMap;
use std::sync::LazyLock;

use chrono::{DateTime, NaiveDateTime, Offset, TimeDelta, TimeZone, Timelike};
use chrono_tz::Tz;
use proptest::prelude::*;
use redis::{Connection, Value};
use redis_guard::quota::{zone, Calendar, Per};
use redis_guard::scripts::Script;

use crate::engine::{self, Property};
use crate::support::script::{self, Limit, HOUR, MINUTE};

static ONE_AT: LazyLock<Script> = LazyLock::new(|| script::without_expiry(&script::RATELIMIT_AT));

/// Every class of zone: whole-hour DST, 30- and 45-minute offsets, a
/// 30-minute DST (Lord Howe), a 2-hour DST (Troll), midnight gaps (Havana,
/// São Paulo until 2019), a skipped day (Apia, 2011), none (Kolkata).
const ZONES: [&str; 10] = [
    "America/New_York",
    "Europe/Berlin",
    "Asia/Kolkata",
    "Asia/Kathmandu",
    "Pacific/Chatham",
    "Antarctica/Troll",
    "Australia/Lord_Howe",
    "America/Havana",
    "America/Sao_Paulo",
    "Pacific/Apia",
];

const STEP_MS: i64 = 15 * MINUTE;

fn tz(i: usize) -> Tz {
    zone(ZONES[i]).unwrap()
}

fn wall(z: Tz, ms: i64) -> NaiveDateTime {
    let u = DateTime::from_timestamp_millis(ms).unwrap().naive_utc();
    let off = z.offset_from_utc_datetime(&u).fix().local_minus_utc();
    u + TimeDelta::seconds(i64::from(off))
}

/// The instants (ms) where each zone's offset changes, in 2011, 2018 and
/// 2026, plus every local midnight near them is reached by the requests.
static TRANSITIONS: LazyLock<Vec<Vec<i64>>> = LazyLock::new(|| {
    (0..ZONES.len())
        .map(|i| {
            let z = tz(i);
            let mut out = Vec::new();
            for year in [2011, 2018, 2026] {
                let start = chrono::NaiveDate::from_ymd_opt(year, 1, 1)
                    .unwrap()
                    .and_hms_opt(0, 0, 0)
                    .unwrap()
                    .and_utc()
                    .timestamp_millis();
                let offset = |ms: i64| {
                    wall(z, ms) - DateTime::from_timestamp_millis(ms).unwrap().naive_utc()
                };
                let mut prev = offset(start);
                let mut t = start;
                while t < start + 366 * 24 * HOUR {
                    t += STEP_MS;
                    let o = offset(t);
                    if o != prev {
                        out.push(t);
                        prev = o;
                    }
                }
            }
            if out.is_empty() {
                out.push(1_767_225_600_000); // 2026-01-01 UTC: no transition
            }
            out
        })
        .collect()
});

#[derive(Debug, Clone)]
pub struct QuotaRun {
    zone: usize,
    day: bool,
    /// Which transition of the zone the run is near.
    transition: usize,
    start_offset: i64,
    requests: Vec<(i64, i64, i64)>,
}

pub fn schedules() -> impl Strategy<Value = QuotaRun> {
    // (Redis clock step, Envoy clock - Redis clock, cost)
    let request = (
        prop::sample::select(vec![0i64, 1, 999, 10 * MINUTE, 40 * MINUTE, HOUR]),
        prop::sample::select(vec![
            0i64,
            1,
            -1,
            2,
            -2,
            999,
            -999,
            30 * MINUTE,
            -30 * MINUTE,
            59 * MINUTE,
            -59 * MINUTE,
            -HOUR - 1,
            3 * HOUR,
        ]),
        1..4i64,
    );
    (
        0..ZONES.len(),
        any::<bool>(),
        0..64usize,
        prop::sample::select(vec![-3 * HOUR, -HOUR - 1, -1, 0, -30 * MINUTE, -2]),
        prop::collection::vec(request, 1..24),
    )
        .prop_map(|(zone, day, transition, start_offset, requests)| QuotaRun {
            zone,
            day,
            transition,
            start_offset,
            requests,
        })
}

/// The reference windows around `[from, to]`: their starts, ascending.
fn reference_starts(z: Tz, day: bool, from: i64, to: i64) -> Vec<i64> {
    let unit = |ms: i64| {
        let w = wall(z, ms);
        if day {
            w.date().and_hms_opt(0, 0, 0).unwrap()
        } else {
            w.date().and_hms_opt(w.hour(), 0, 0).unwrap()
        }
    };
    // Aligned to the 15-minute grid, from well before (a day and more).
    let mut t = (from - 30 * HOUR).div_euclid(STEP_MS) * STEP_MS;
    let mut high = unit(t);
    let mut starts = Vec::new();
    while t <= to + 30 * HOUR {
        t += STEP_MS;
        let u = unit(t);
        if u > high {
            high = u;
            starts.push(t);
        }
    }
    starts
}

/// Index of the window holding `ms` in `starts`.
fn window_of(starts: &[i64], ms: i64) -> usize {
    starts.partition_point(|s| *s <= ms)
}

fn decide(con: &mut Connection, limit: &Limit) -> Result<bool, String> {
    match script::with_limits(script::evalsha(&ONE_AT), std::slice::from_ref(limit), None)
        .query::<Value>(con)
    {
        Err(e) => Err(e.to_string()),
        Ok(Value::Array(items)) => Ok(matches!(items.first(), Some(Value::Int(1)))),
        Ok(other) => Err(format!("{other:?}")),
    }
}

pub fn load(con: &mut Connection) {
    engine::load(con, &[&ONE_AT]);
}

pub fn run(con: &mut Connection, r: &QuotaRun) -> Result<(), String> {
    engine::fresh(con);
    let z = tz(r.zone);
    let ts = &TRANSITIONS[r.zone];
    let mut now = ts[r.transition % ts.len()] + r.start_offset;
    let cal = Calendar {
        per: if r.day { Per::Day } else { Per::Hour },
        zone: z,
        anchor: 1,
    };
    let span: i64 = r.requests.iter().map(|q| q.0).sum();
    let starts = reference_starts(z, r.day, now - 4 * HOUR, now + span + 4 * HOUR);
    let amount = 5;
    let mut admitted: HashMap<usize, i64> = HashMap::new();
    for (i, (dt, skew, cost)) in r.requests.iter().enumerate() {
        now += dt;
        script::set_clock(con, now);
        let envoy = now + skew;
        let Some(edges) = cal.edges(envoy) else {
            return Err(format!(
                "request {i}: no edges at the Envoy's clock {envoy}"
            ));
        };
        if edges.windows(2).any(|w| w[0] >= w[1]) {
            return Err(format!(
                "request {i}: the edges {edges:?} computed at {envoy} ({} in {}) hold an \
                 empty window",
                wall(z, envoy),
                ZONES[r.zone]
            ));
        }
        let limit = Limit {
            key: "t:{q}:cq".to_string(),
            alg: "cq",
            a: amount,
            b: 0,
            c: format!("{},{},{},{}", edges[0], edges[1], edges[2], edges[3]),
            cost: *cost,
            enforce: true,
            block: 0,
        };
        let (mine, theirs) = (window_of(&starts, envoy), window_of(&starts, now));
        match decide(con, &limit) {
            Err(e) if mine.abs_diff(theirs) <= 1 => {
                return Err(format!(
                    "request {i}: Redis at {} ({}) is in the Envoy's window or a neighbour \
                     (Envoy at {}), yet the call failed: {e} (edges {edges:?})",
                    now,
                    wall(z, now),
                    wall(z, envoy)
                ));
            }
            Err(_) => {}
            Ok(false) => {}
            Ok(true) => {
                let n = admitted.entry(theirs).or_default();
                *n += cost;
                if *n > amount {
                    let from = starts.get(theirs.wrapping_sub(1)).copied().unwrap_or(0);
                    return Err(format!(
                        "request {i}: {n} units admitted in the window from {} ({}) of {} \
                         with an amount of {amount}",
                        from,
                        wall(z, from),
                        ZONES[r.zone]
                    ));
                }
            }
        }
    }
    Ok(())
}

pub const PROPERTY: Property = Property {
    name: "a_calendar_quota_admits_its_amount_per_window_on_any_clock",
    seed: 0xCA1E_0DA5,
};
