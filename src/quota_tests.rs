use chrono::{NaiveDate, Offset, TimeZone};

use super::*;

const H: i64 = 3_600_000;
const D: i64 = 24 * H;

fn cal(per: Per, zone: &str, anchor: u8) -> Calendar {
    Calendar {
        per,
        zone: super::zone(zone).unwrap(),
        anchor,
    }
}

/// ms of a UTC date-time.
fn at(y: i32, mo: u32, d: u32, h: u32, mi: u32) -> i64 {
    NaiveDate::from_ymd_opt(y, mo, d)
        .unwrap()
        .and_hms_opt(h, mi, 0)
        .unwrap()
        .and_utc()
        .timestamp_millis()
}

fn offset_s(c: &Calendar, ms: i64) -> i32 {
    c.zone
        .offset_from_utc_datetime(&utc(ms).unwrap())
        .fix()
        .local_minus_utc()
}

#[test]
fn a_month_in_berlin_renews_at_local_midnight_of_the_first_and_not_a_ms_before() {
    let c = cal(Per::Month, "Europe/Berlin", 1);
    // 2027-02-01 00:00 CET is 2027-01-31 23:00 UTC.
    let renewal = at(2027, 1, 31, 23, 0);
    let before = c.window(renewal - 1).unwrap();
    assert_eq!(before.start_ms, at(2026, 12, 31, 23, 0));
    assert_eq!(before.end_ms, renewal);
    let after = c.window(renewal).unwrap();
    assert_eq!(after.start_ms, renewal);
    // March starts in CET too (DST begins on the 28th).
    assert_eq!(after.end_ms, at(2027, 2, 28, 23, 0));
    assert_eq!(
        c.edges(renewal - 1).unwrap(),
        [
            at(2026, 11, 30, 23, 0),
            before.start_ms,
            renewal,
            after.end_ms
        ]
    );
    assert_eq!(
        crate::ratelimit::edges_arg(c.edges(renewal)),
        format!(
            "{},{},{},{}",
            before.start_ms,
            renewal,
            after.end_ms,
            at(2027, 3, 31, 22, 0)
        )
        .into_bytes()
    );
}

#[test]
fn an_anchor_on_the_31st_falls_on_each_shorter_months_last_day_leap_day_included() {
    let c = cal(Per::Month, "Europe/Berlin", 31);
    // 2028 is a leap year: the window after 2028-01-31 starts on 02-29.
    let w = c.window(at(2028, 2, 15, 12, 0)).unwrap();
    assert_eq!(w.start_ms, at(2028, 1, 30, 23, 0));
    assert_eq!(w.end_ms, at(2028, 2, 28, 23, 0));
    let leap = c.window(w.end_ms).unwrap();
    // 02-29 00:00 CET to 03-31 00:00 CEST (DST began on 03-26).
    assert_eq!(leap.end_ms, at(2028, 3, 30, 22, 0));
    // 30-day months: the 30th; the next 31-day month: the 31st again.
    let april = c.window(leap.end_ms).unwrap();
    assert_eq!(april.end_ms, at(2028, 4, 29, 22, 0));
    assert_eq!(
        c.window(april.end_ms).unwrap().end_ms,
        at(2028, 5, 30, 22, 0)
    );
    // Not a leap year: the 28th.
    let c29 = cal(Per::Month, "UTC", 29);
    assert_eq!(
        c29.window(at(2027, 2, 28, 0, 0)).unwrap(),
        Window {
            start_ms: at(2027, 2, 28, 0, 0),
            end_ms: at(2027, 3, 29, 0, 0)
        }
    );
    assert_eq!(
        c29.window(at(2027, 2, 27, 23, 59)).unwrap().start_ms,
        at(2027, 1, 29, 0, 0)
    );
}

#[test]
fn days_across_both_daylight_saving_changes_last_23_and_25_hours() {
    let c = cal(Per::Day, "Europe/Berlin", 1);
    let spring = c.window(at(2027, 3, 28, 12, 0)).unwrap();
    assert_eq!(spring.start_ms, at(2027, 3, 27, 23, 0));
    assert_eq!(spring.end_ms - spring.start_ms, 23 * H);
    let autumn = c.window(at(2027, 10, 31, 12, 0)).unwrap();
    assert_eq!(autumn.start_ms, at(2027, 10, 30, 22, 0));
    assert_eq!(autumn.end_ms - autumn.start_ms, 25 * H);
    let ny = cal(Per::Day, "America/New_York", 1);
    assert_eq!(
        ny.window(at(2027, 3, 14, 12, 0)).unwrap().end_ms,
        at(2027, 3, 15, 4, 0)
    );
    let w = ny.window(at(2027, 11, 7, 12, 0)).unwrap();
    assert_eq!(
        (w.start_ms, w.end_ms),
        (at(2027, 11, 7, 4, 0), at(2027, 11, 8, 5, 0))
    );
}

#[test]
fn a_repeated_hour_lengthens_its_window_and_a_skipped_one_has_none() {
    let c = cal(Per::Hour, "Europe/Berlin", 1);
    // 2027-10-31: 03:00 CEST becomes 02:00 CET at 01:00 UTC.
    let w = c.window(at(2027, 10, 31, 1, 30)).unwrap();
    assert_eq!(
        (w.start_ms, w.end_ms),
        (at(2027, 10, 31, 0, 0), at(2027, 10, 31, 2, 0))
    );
    // 2027-03-28: 02:00 CET becomes 03:00 CEST at 01:00 UTC: the 01:00
    // window ends there and the 03:00 one starts, the 02:00 one is empty.
    let w = c.window(at(2027, 3, 28, 0, 59)).unwrap();
    assert_eq!(
        (w.start_ms, w.end_ms),
        (at(2027, 3, 28, 0, 0), at(2027, 3, 28, 1, 0))
    );
    // The neighbour after it is the 03:00 window, not the empty 02:00 one:
    // edges never send an empty window (a Redis clock just past the gap
    // must find a window that holds it).
    let e = c.edges(at(2027, 3, 28, 0, 30)).unwrap();
    assert_eq!(
        e,
        [
            at(2027, 3, 27, 23, 0),
            at(2027, 3, 28, 0, 0),
            at(2027, 3, 28, 1, 0),
            at(2027, 3, 28, 2, 0)
        ]
    );
    // And the neighbour before the 03:00 window is the 01:00 one.
    assert_eq!(
        c.edges(at(2027, 3, 28, 1, 0)).unwrap(),
        [
            at(2027, 3, 28, 0, 0),
            at(2027, 3, 28, 1, 0),
            at(2027, 3, 28, 2, 0),
            at(2027, 3, 28, 3, 0)
        ]
    );
    // New York, the Envoy's clock 1 ms before the gap (02:00 EST is 03:00
    // EDT at 07:00 UTC): the window after 01:00 EST is 03:00 EDT's.
    let ny = cal(Per::Hour, "America/New_York", 1);
    assert_eq!(
        ny.edges(at(2027, 3, 14, 7, 0) - 1).unwrap(),
        [
            at(2027, 3, 14, 5, 0),
            at(2027, 3, 14, 6, 0),
            at(2027, 3, 14, 7, 0),
            at(2027, 3, 14, 8, 0)
        ]
    );
    // Antarctica/Troll moves its clock by two hours (+00 to +02 at 01:00
    // UTC on the last Sunday of March, back at 01:00 UTC on the last of
    // October): 01:00 and 02:00 are both skipped in spring, and in autumn
    // the 02:00 window holds its own hour and the repeated 01:00 and 02:00:
    // one window of three hours.
    let troll = cal(Per::Hour, "Antarctica/Troll", 1);
    assert_eq!(
        troll.edges(at(2027, 3, 28, 1, 0) - 1).unwrap(),
        [
            at(2027, 3, 27, 23, 0),
            at(2027, 3, 28, 0, 0),
            at(2027, 3, 28, 1, 0),
            at(2027, 3, 28, 2, 0)
        ]
    );
    assert_eq!(
        troll.edges(at(2027, 3, 28, 1, 0)).unwrap(),
        [
            at(2027, 3, 28, 0, 0),
            at(2027, 3, 28, 1, 0),
            at(2027, 3, 28, 2, 0),
            at(2027, 3, 28, 3, 0)
        ]
    );
    let w = troll.window(at(2027, 10, 31, 1, 30)).unwrap();
    assert_eq!(
        (w.start_ms, w.end_ms),
        (at(2027, 10, 31, 0, 0), at(2027, 10, 31, 3, 0))
    );
    assert_eq!(
        troll.format(w.start_ms).unwrap(),
        "2027-10-31T02:00:00+02:00 Antarctica/Troll"
    );
    // Half-hour zones: hours on the zone's clock, not on UTC's.
    let k = cal(Per::Hour, "Asia/Kolkata", 1);
    assert_eq!(
        k.window(at(2027, 1, 1, 0, 10)).unwrap().start_ms,
        at(2026, 12, 31, 23, 30)
    );
}

#[test]
fn a_skipped_midnight_starts_the_day_when_the_gap_ends() {
    // Samoa skipped 2011-12-30 whole: the 29th's window ends when the 31st's
    // starts, and no window holds the 30th.
    let apia = cal(Per::Day, "Pacific/Apia", 1);
    let w = apia.window(at(2011, 12, 30, 9, 0)).unwrap();
    assert_eq!(w.end_ms, at(2011, 12, 30, 10, 0));
    let next = apia.window(w.end_ms).unwrap();
    assert_eq!(next.end_ms - next.start_ms, D);
    assert_eq!(
        apia.format(next.start_ms).unwrap(),
        "2011-12-31T00:00:00+14:00 Pacific/Apia"
    );
    // The neighbour after the 29th is the 31st; by the hour, the one after
    // 23:00 on the 29th is 00:00 on the 31st, 24 empty hours later.
    assert_eq!(apia.edges(w.end_ms - 1).unwrap()[3], next.end_ms);
    let hours = cal(Per::Hour, "Pacific/Apia", 1);
    assert_eq!(
        hours.edges(w.end_ms - 1).unwrap(),
        [w.end_ms - 2 * H, w.end_ms - H, w.end_ms, w.end_ms + H]
    );
    assert_eq!(
        hours.edges(w.end_ms).unwrap(),
        [w.end_ms - H, w.end_ms, w.end_ms + H, w.end_ms + 2 * H]
    );
    // Chile starts daylight saving at midnight: that day starts at 01:00,
    // the instant the offset changes, and lasts 23 hours.
    let scl = cal(Per::Day, "America/Santiago", 1);
    let mut found = 0;
    let mut t = at(2026, 8, 1, 12, 0);
    while t < at(2026, 10, 1, 0, 0) {
        let w = scl.window(t).unwrap();
        if w.end_ms - w.start_ms == 23 * H {
            found += 1;
            assert_ne!(offset_s(&scl, w.start_ms - 1), offset_s(&scl, w.start_ms));
            assert!(scl.format(w.start_ms).unwrap().contains("T01:00:00-03:00"));
        }
        t = w.end_ms;
    }
    assert_eq!(found, 1);
}

#[test]
fn weeks_start_on_the_anchor_weekday() {
    // 2027-01-06 is a Wednesday.
    let mon = cal(Per::Week, "UTC", 1);
    let w = mon.window(at(2027, 1, 6, 12, 0)).unwrap();
    assert_eq!(
        (w.start_ms, w.end_ms),
        (at(2027, 1, 4, 0, 0), at(2027, 1, 11, 0, 0))
    );
    let sun = cal(Per::Week, "America/New_York", 7);
    let w = sun.window(at(2027, 1, 6, 12, 0)).unwrap();
    assert_eq!(w.start_ms, at(2027, 1, 3, 5, 0));
    let wed = cal(Per::Week, "UTC", 3);
    assert_eq!(
        wed.window(at(2027, 1, 6, 0, 0)).unwrap().start_ms,
        at(2027, 1, 6, 0, 0)
    );
    assert_eq!(
        wed.window(at(2027, 1, 6, 0, 0) - 1).unwrap().start_ms,
        at(2026, 12, 30, 0, 0)
    );
}

#[test]
fn instants_outside_the_range_have_no_window() {
    let c = cal(Per::Day, "UTC", 1);
    assert_eq!(c.window(-1), None);
    assert_eq!(c.window(MAX_MS), None);
    assert_eq!(c.edges(i64::MAX), None);
    assert!(c.window(MAX_MS - 30 * D).is_some());
    assert_eq!(zone("Mars/Olympus"), None);
    assert_eq!(Per::parse("year"), None);
}

/// Every window, walked edge to edge over years in zones with every kind
/// of rule: it holds its own first and last ms, the next starts at its
/// end, its start is the unit's wall-clock start (or a gap's end), and its
/// length is the unit's within the zone's shifts.
#[test]
fn windows_tile_time_with_calendar_starts_in_many_zones() {
    let zones = [
        "UTC",
        "Europe/Berlin",
        "America/New_York",
        "America/Santiago",
        "Australia/Lord_Howe",
        "Asia/Kolkata",
        "Pacific/Chatham",
        "America/St_Johns",
        "Pacific/Apia",
        "Asia/Tehran",
        "Antarctica/Troll",
    ];
    let mut windows = 0u64;
    for z in zones {
        for (per, anchors, from, to) in [
            (
                Per::Hour,
                &[1u8][..],
                at(2026, 1, 1, 0, 0),
                at(2028, 1, 1, 0, 0),
            ),
            (
                Per::Day,
                &[1][..],
                at(2020, 1, 1, 0, 0),
                at(2030, 1, 1, 0, 0),
            ),
            (
                Per::Week,
                &[1, 4, 7][..],
                at(2020, 1, 1, 0, 0),
                at(2030, 1, 1, 0, 0),
            ),
            (
                Per::Month,
                &[1, 15, 28, 29, 30, 31][..],
                at(2000, 1, 1, 0, 0),
                at(2040, 1, 1, 0, 0),
            ),
        ] {
            for &anchor in anchors {
                let c = cal(per, z, anchor);
                let mut w = c.window(from).unwrap();
                assert!(w.start_ms <= from && from < w.end_ms);
                while w.start_ms < to {
                    windows += 1;
                    assert_eq!(c.window(w.start_ms), Some(w), "{z} {per:?} {anchor}");
                    assert_eq!(c.window(w.end_ms - 1), Some(w));
                    let mid = w.start_ms + (w.end_ms - w.start_ms) / 3;
                    assert_eq!(c.window(mid), Some(w));
                    // The neighbours are the windows before and after,
                    // never an empty one.
                    let e = c.edges(mid).unwrap();
                    assert_eq!((e[1], e[2]), (w.start_ms, w.end_ms));
                    assert_eq!(c.window(e[0]).map(|p| p.end_ms), Some(e[1]));
                    assert_eq!(c.window(e[2]).map(|n| n.end_ms), Some(e[3]));
                    let len = w.end_ms - w.start_ms;
                    let (lo, hi) = match per {
                        // Chatham's clock skips 02:45-03:45: a 45- and a
                        // 15-minute hour; Troll's falls back two hours.
                        Per::Hour => (H / 4, 3 * H),
                        Per::Day => (22 * H, 26 * H),
                        Per::Week => (7 * D - 2 * H, 7 * D + 2 * H),
                        Per::Month => (28 * D - 2 * H, 31 * D + 2 * H),
                    };
                    assert!((lo..=hi).contains(&len), "{z} {per:?} {anchor}: {len} ms");
                    // The wall clock at the start is the unit's start, or
                    // the start is where the offset changed (a gap).
                    let shown = c.format(w.start_ms).unwrap();
                    let gap = offset_s(&c, w.start_ms - 1) != offset_s(&c, w.start_ms);
                    let time = if per == Per::Hour {
                        ":00:00"
                    } else {
                        "T00:00:00"
                    };
                    assert!(shown.contains(time) || gap, "{shown}");
                    if per == Per::Month && !gap {
                        let day: u8 = shown[8..10].parse().unwrap();
                        assert!(day == anchor || (day >= 28 && day < anchor), "{shown}");
                    }
                    let next = c.window(w.end_ms).unwrap();
                    assert_eq!(next.start_ms, w.end_ms);
                    w = next;
                }
            }
        }
    }
    assert!(windows > 150_000, "{windows}");
}

#[test]
fn a_renewal_is_shown_on_the_zones_clock() {
    let c = cal(Per::Month, "Europe/Berlin", 1);
    assert_eq!(
        c.format(at(2027, 1, 31, 23, 0)).unwrap(),
        "2027-02-01T00:00:00+01:00 Europe/Berlin"
    );
    let k = cal(Per::Day, "America/St_Johns", 1);
    assert_eq!(
        k.format(at(2027, 1, 1, 3, 30)).unwrap(),
        "2027-01-01T00:00:00-03:30 America/St_Johns"
    );
}

#[test]
fn an_anchoring_sends_the_remembered_anchor_within_the_units_range() {
    assert_eq!(
        Anchoring::of(Per::Month, 1, Some(15)),
        Some(Anchoring {
            sent: 15,
            default: 1,
            max: 31
        })
    );
    assert_eq!(Anchoring::of(Per::Month, 3, None).unwrap().sent, 3);
    // A week's anchor is a weekday: a remembered 15 is no week's.
    assert_eq!(
        Anchoring::of(Per::Week, 2, Some(15)),
        Some(Anchoring {
            sent: 2,
            default: 2,
            max: 7
        })
    );
    assert_eq!(Anchoring::of(Per::Day, 1, Some(3)), None);
    assert_eq!(Anchoring::of(Per::Hour, 1, None), None);
    assert_eq!(
        Anchoring::of(Per::Month, 1, Some(31)).unwrap().suffix(),
        "@31,1,31"
    );
}

#[test]
fn an_anchor_slot_answers_only_for_its_own_key() {
    use sha2::Digest;
    let full = |k: &[u8]| -> [u8; 32] { sha2::Sha256::digest(k).into() };
    let a = AnchorSlot::of_digest(&full(b"rg:rl:{t}:plan:cq:acme"));
    let b = AnchorSlot::of_digest(&full(b"rg:rl:{t}:plan:cq:zeta"));
    assert!(a.shared_key.starts_with("redis-guard/anchor/"));
    let entry = a.entry(15);
    assert_eq!(entry.len(), 17);
    assert_eq!(a.read(Some(&entry)), Some(15));
    assert_eq!(b.read(Some(&entry)), None, "another key's entry");
    assert_eq!(a.read(Some(&a.entry(0))), None, "forgotten");
    assert_eq!(a.read(None), None);
    assert_eq!(a.read(Some(&entry[..16])), None, "cut short");
    assert_eq!(a.read(Some(b"")), None);
}

#[test]
fn the_tz_database_release_is_the_one_the_book_names() {
    // chrono-tz 0.10.4's. A bump changes the windows of every zone whose
    // rules changed: the book's calendar-quotas page names the release
    // and what mixing two does.
    assert_eq!(TZDB_RELEASE, "2025b");
}
