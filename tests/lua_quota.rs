//! Calendar quotas ("cq", lua/quota.lua) against a real redis-server at a
//! test clock (`support::script::RATELIMIT_AT`: the production script with
//! its TIME preamble swapped for a read of a clock key). The window edges
//! are the filter's own (`redis_guard::quota::Calendar::edges` at a proxy
//! clock): the script picks the window that holds Redis' clock, counts in a
//! key that carries the window's start, and keeps it until a margin after
//! the window's end.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use redis::Connection;
use redis_guard::quota::{zone, Calendar, Per};
use support::script::{
    self, admits, at, batch_at, one, rejects, Limit, HOUR, MINUTE, RATELIMIT_AT, SECOND,
};
use support::{assert_expires_in, key_exists as exists, redis_now_ms, set_key};

/// TTL past a window's end (lua/quota.lua CQ_MARGIN_MS).
const MARGIN_MS: i64 = 60_000;
const DAY: i64 = 24 * HOUR;

fn cal(per: Per, z: &str, anchor: u8) -> Calendar {
    Calendar {
        per,
        zone: zone(z).unwrap(),
        anchor,
    }
}

/// ms of a UTC date-time.
fn utc(y: i32, mo: u32, d: u32, h: u32) -> i64 {
    chrono::NaiveDate::from_ymd_opt(y, mo, d)
        .unwrap()
        .and_hms_opt(h, 0, 0)
        .unwrap()
        .and_utc()
        .timestamp_millis()
}

/// A quota limit of `amount` whose edges the filter computed at `proxy_ms`.
fn cq(key: &str, amount: i64, c: &Calendar, proxy_ms: i64) -> Limit {
    let [a, b, x, d] = c.edges(proxy_ms).unwrap();
    Limit {
        key: key.to_string(),
        alg: "cq",
        a: amount,
        b: 0,
        c: format!("{a},{b},{x},{d}"),
        cost: 1,
        enforce: true,
        block: 0,
    }
}

fn get(con: &mut Connection, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query(con).unwrap()
}

/// Spends the whole of a window at `now` and checks that it is spent.
fn spend(con: &mut Connection, now: i64, l: &Limit, amount: i64, left_ms: i64) {
    assert_eq!(one(con, now, &l.clone().cost(amount)), admits(0, left_ms));
    assert_eq!(one(con, now, l), rejects(0, left_ms));
}

#[test]
fn a_month_renews_at_local_midnight_on_redis_clock_and_not_a_ms_before() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = cal(Per::Month, "Europe/Berlin", 1);
    // 2027-02-01 00:00 CET.
    let renewal = utc(2027, 1, 31, 23);
    let jan = utc(2026, 12, 31, 23);
    // The proxy's clock is 10 minutes behind Redis' across the edge: its
    // edges still hold the window Redis is in.
    let l = cq("t:{k}:cq:m", 5, &c, renewal - 10 * MINUTE);
    let t0 = redis_now_ms(&mut con);
    spend(&mut con, renewal - 3 * SECOND, &l, 5, 3 * SECOND);
    assert_eq!(
        get(&mut con, &format!("t:{{k}}:cq:m:{jan}")),
        Some("5".into())
    );
    assert_expires_in(
        &mut con,
        &format!("t:{{k}}:cq:m:{jan}"),
        3 * SECOND + MARGIN_MS,
        t0,
    );
    assert_eq!(one(&mut con, renewal - 1, &l), rejects(0, 1));
    // At the renewal: a new key, counted from zero, until March 1 (CET).
    let feb_len = utc(2027, 2, 28, 23) - renewal;
    let t0 = redis_now_ms(&mut con);
    assert_eq!(one(&mut con, renewal, &l), admits(4, feb_len));
    let key = format!("t:{{k}}:cq:m:{renewal}");
    assert_eq!(get(&mut con, &key), Some("1".into()));
    assert_expires_in(&mut con, &key, feb_len + MARGIN_MS, t0);
    // The old window's count is untouched.
    assert_eq!(
        get(&mut con, &format!("t:{{k}}:cq:m:{jan}")),
        Some("5".into())
    );
}

#[test]
fn a_billing_anchor_on_the_31st_renews_on_a_leap_day() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = cal(Per::Month, "America/New_York", 31);
    // 2028-02-29 00:00 EST is 05:00 UTC; the next renewal is 2028-03-31
    // 00:00 EDT (04:00 UTC).
    let leap = utc(2028, 2, 29, 5);
    let l = cq("t:{k}:cq:b", 3, &c, leap + HOUR);
    spend(&mut con, leap - 1, &l, 3, 1);
    assert_eq!(
        one(&mut con, leap, &l),
        admits(2, utc(2028, 3, 31, 4) - leap)
    );
    assert!(exists(&mut con, &format!("t:{{k}}:cq:b:{leap}")));
}

#[test]
fn days_renew_across_both_daylight_saving_changes() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = cal(Per::Day, "Europe/Berlin", 1);
    // 2027-03-28 lasts 23 hours (from 03-27 23:00 UTC), 2027-10-31 25.
    for (start, len) in [
        (utc(2027, 3, 27, 23), 23 * HOUR),
        (utc(2027, 10, 30, 22), 25 * HOUR),
    ] {
        let l = cq(&format!("t:{{k}}:cq:d{start}"), 2, &c, start + HOUR);
        assert_eq!(one(&mut con, start, &l.clone().cost(2)), admits(0, len));
        assert_eq!(one(&mut con, start + len - 1, &l), rejects(0, 1));
        assert_eq!(one(&mut con, start + len, &l), admits(1, DAY));
    }
}

#[test]
fn edges_that_hold_no_window_for_redis_clock_are_an_error_that_writes_nothing() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = cal(Per::Day, "UTC", 1);
    let now = utc(2027, 6, 1, 12);
    // A proxy two days behind: its edges end a day before Redis' clock.
    let l = cq("t:{k}:cq:skew", 5, &c, now - 2 * DAY);
    let bad = |con: &mut Connection, l: &Limit| {
        script::set_clock(con, now);
        let r: redis::RedisResult<redis::Value> =
            script::with_limits(script::eval(&RATELIMIT_AT), std::slice::from_ref(l), None)
                .query(con);
        format!("{:?}", r.unwrap_err())
    };
    let why = bad(&mut con, &l);
    assert!(
        why.contains("no window of its edges holds Redis' clock"),
        "{why}"
    );
    for edges in ["", "1,2,3", "3,2,1,0", "1.5,2,3,4", "x,1,2,3", "1,2,3,4,5"] {
        let mut l = l.clone();
        l.c = edges.to_string();
        let why = bad(&mut con, &l);
        assert!(
            why.contains("redis-guard ratelimit: limit 1"),
            "{edges:?}: {why}"
        );
    }
    let keys: Vec<String> = redis::cmd("KEYS").arg("t:*").query(&mut con).unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

#[test]
fn an_override_changes_the_amount_mid_window_and_keeps_the_use() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = cal(Per::Month, "UTC", 1);
    let start = utc(2027, 6, 1, 0);
    let end = utc(2027, 7, 1, 0);
    let key = "rg:rl:{t}:plan:cq.month.UTC:acme";
    let mut l = cq(key, 3, &c, start);
    l.alg = "cq+o";
    spend(&mut con, start + DAY, &l, 3, end - start - DAY);
    // The customer's plan grows to 5: two more, the three spent still count
    // (verdict 1 + 2: an override decided).
    set_key(&mut con, "rg:ov:{t}:plan:acme", "cq 5");
    script::set_clock(&mut con, start + 2 * DAY);
    let v: redis::Value =
        script::with_limits(script::eval(&RATELIMIT_AT), std::slice::from_ref(&l), None)
            .query(&mut con)
            .unwrap();
    let left = (end - start - 2 * DAY).to_string();
    assert_eq!(
        v,
        redis::Value::Array(vec![
            redis::Value::Int(1),
            redis::Value::Int(3),
            redis::Value::Int(1),
            redis::Value::Int(0),
            redis::Value::BulkString(left.into_bytes()),
            // The plan that decided it: its amount, and 0.
            redis::Value::Int(5),
            redis::Value::Int(0),
        ])
    );
    assert_eq!(get(&mut con, &format!("{key}:{start}")), Some("4".into()));
}

#[test]
fn a_batch_decides_a_quota_as_calls_one_by_one_and_shadow_reports_only() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = cal(Per::Hour, "Asia/Kolkata", 1);
    // Kolkata's hours start at :30 UTC.
    let now = utc(2027, 1, 1, 0) + 40 * MINUTE;
    let l = cq("t:{k}:cq:h", 2, &c, now);
    let ds = batch_at(
        &mut con,
        now,
        &[vec![l.clone()], vec![l.clone()], vec![l.clone()]],
    );
    let left = 50 * MINUTE;
    let got: Vec<_> = ds.iter().map(|d| (d.admitted, d.limits[0])).collect();
    assert_eq!(
        got,
        [
            (true, admits(1, left)),
            (true, admits(0, left)),
            (false, rejects(0, left))
        ]
    );
    let start = utc(2027, 1, 1, 0) + 30 * MINUTE;
    assert_eq!(
        get(&mut con, &format!("t:{{k}}:cq:h:{start}")),
        Some("2".into())
    );
    // A shadow quota that would reject lets the request through, uncharged.
    let d = at(&mut con, now, &[l.shadow()]);
    assert!(d.admitted);
    assert_eq!(d.limits[0], rejects(0, left));
    assert_eq!(
        get(&mut con, &format!("t:{{k}}:cq:h:{start}")),
        Some("2".into())
    );
}

/// lua/settle.lua at the test clock.
static SETTLE_AT: std::sync::LazyLock<redis_guard::scripts::Script> =
    std::sync::LazyLock::new(|| script::with_test_clock(&redis_guard::scripts::SETTLE));

/// Settles `delta` units of `l`, `age` ms after its decision, at `now`: the
/// units left.
fn settle(con: &mut Connection, now: i64, l: &Limit, delta: i64, age: i64) -> i64 {
    script::set_clock(con, now);
    let left: Vec<redis::Value> = script::eval(&SETTLE_AT)
        .arg(1)
        .arg(&l.key)
        .arg(l.alg)
        .arg(l.a)
        .arg(l.b)
        .arg(&l.c)
        .arg(delta)
        .arg(age)
        .arg(0)
        .query(con)
        .unwrap();
    match &left[0] {
        redis::Value::Int(n) => *n,
        other => panic!("{other:?}"),
    }
}

#[test]
fn usage_settles_into_the_window_that_holds_redis_clock_and_refunds_only_its_own() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = cal(Per::Day, "Europe/Berlin", 1);
    let start = utc(2027, 10, 30, 22);
    let end = start + 25 * HOUR;
    let l = cq("t:{k}:cq:u", 100, &c, start + HOUR);
    let key = format!("t:{{k}}:cq:u:{start}");
    // Reserved 10, used 25: 15 more, in the window's key.
    assert_eq!(
        one(&mut con, start + HOUR, &l.clone().cost(10)),
        admits(90, 24 * HOUR)
    );
    assert_eq!(settle(&mut con, start + 2 * HOUR, &l, 15, HOUR), 75);
    assert_eq!(get(&mut con, &key), Some("25".into()));
    // Debt: a use past the amount leaves the count above it (negative left)
    // and the window refuses until its end.
    assert_eq!(settle(&mut con, start + 2 * HOUR, &l, 90, 0), -15);
    assert_eq!(
        one(&mut con, start + 3 * HOUR, &l),
        rejects(0, end - start - 3 * HOUR)
    );
    // A refund never takes the count below zero.
    assert_eq!(settle(&mut con, start + 3 * HOUR, &l, -200, HOUR), 100);
    assert_eq!(get(&mut con, &key), Some("0".into()));
    // A reserve taken before the renewal is not refunded into the next
    // window (its count was never there).
    assert_eq!(one(&mut con, end - 1, &l.clone().cost(30)), admits(70, 1));
    let next = cq("t:{k}:cq:u", 100, &c, end);
    assert_eq!(
        one(&mut con, end, &next.clone().cost(5)),
        admits(95, 24 * HOUR)
    );
    assert_eq!(settle(&mut con, end + 10, &next, -30, 11), 95);
    assert_eq!(
        get(&mut con, &format!("t:{{k}}:cq:u:{end}")),
        Some("5".into())
    );
}

/// A month quota that takes stored overrides, its edges computed at
/// `proxy_ms` for anchor day `sent`, `default` applying without a stored
/// one (`@<sent>,<default>,<max>`, lua/quota.lua).
fn moved(key: &str, amount: i64, c: &Calendar, proxy_ms: i64, sent: u8, default: u8) -> Limit {
    let on = Calendar { anchor: sent, ..*c };
    let max = *c.per.anchors().unwrap().end();
    let mut l = cq(key, amount, &on, proxy_ms);
    l.alg = "cq+o";
    l.c = format!("{}@{sent},{default},{max}", l.c);
    l
}

/// One request's raw reply at `now`.
fn raw(con: &mut Connection, now: i64, limits: &[Limit]) -> redis::Value {
    script::set_clock(con, now);
    script::with_limits(script::eval(&RATELIMIT_AT), limits, None)
        .query(con)
        .unwrap()
}

/// A reply's integers as lua/wire.lua hands them over (2^31 and more as
/// decimal strings).
fn ints(v: &[i64]) -> redis::Value {
    let item = |n: i64| {
        if n >= 1 << 31 {
            redis::Value::BulkString(n.to_string().into_bytes())
        } else {
            redis::Value::Int(n)
        }
    };
    redis::Value::Array(v.iter().map(|n| item(*n)).collect())
}

fn keys_under(con: &mut Connection, pattern: &str) -> Vec<String> {
    let mut keys: Vec<String> = redis::cmd("KEYS").arg(pattern).query(con).unwrap();
    keys.sort();
    keys
}

#[test]
fn edges_for_another_day_than_a_stored_anchor_are_named_and_nothing_is_written() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = cal(Per::Month, "UTC", 1);
    let now = utc(2027, 6, 20, 0);
    let key = "rg:rl:{t}:plan:cq.month.UTC:acme";
    set_key(&mut con, "rg:ov:{t}:plan:acme", "cq 50 15");
    // Sent for the configured 1st beside a token bucket: verdict 5 names
    // limit 2 and the 15th; neither limit is charged, no window key made.
    let bucket = script::tb("rg:rl:{t}:burst:tb:acme", 5, 1, SECOND);
    let l = moved(key, 100, &c, now, 1, 1);
    assert_eq!(
        raw(&mut con, now, &[bucket.clone(), l.clone()]),
        ints(&[5, 2, 15])
    );
    assert_eq!(keys_under(&mut con, "rg:rl:*"), Vec::<String>::new());
    // Sent for the 15th: decided in the window from June 15 (the stored
    // amount, verdict 1 + 2), to July 15.
    let on15 = moved(key, 100, &c, now, 15, 1);
    let from = utc(2027, 6, 15, 0);
    let to = utc(2027, 7, 15, 0);
    // After the verdict, the plan that decided it: its amount, and 0.
    assert_eq!(
        raw(&mut con, now, std::slice::from_ref(&on15)),
        ints(&[1, 3, 49, 0, to - now, 50, 0])
    );
    assert_eq!(get(&mut con, &format!("{key}:{from}")), Some("1".into()));
    // 1 ms before the 15th's renewal it is still June's window; at it, a
    // new key. Edges computed on the proxy's clock a day before hold both.
    let late = moved(key, 100, &c, to - DAY, 15, 1);
    assert_eq!(
        raw(&mut con, to - 1, std::slice::from_ref(&late)),
        ints(&[1, 3, 48, 0, 1, 50, 0])
    );
    assert_eq!(
        raw(&mut con, to, std::slice::from_ref(&late)),
        ints(&[1, 3, 49, 0, utc(2027, 8, 15, 0) - to, 50, 0])
    );
    assert_eq!(get(&mut con, &format!("{key}:{to}")), Some("1".into()));
    // The override deleted: edges for the 15th are sent back for the 1st.
    redis::cmd("DEL")
        .arg("rg:ov:{t}:plan:acme")
        .query::<()>(&mut con)
        .unwrap();
    let before = keys_under(&mut con, "rg:rl:*");
    assert_eq!(
        raw(&mut con, to + 1, std::slice::from_ref(&late)),
        ints(&[5, 1, 1])
    );
    assert_eq!(keys_under(&mut con, "rg:rl:*"), before);
    assert_eq!(get(&mut con, &format!("{key}:{to}")), Some("1".into()));
}

#[test]
fn a_stored_anchor_comes_before_the_requests_and_a_stored_amount_alone_keeps_it() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = cal(Per::Month, "UTC", 1);
    let now = utc(2027, 6, 20, 0);
    let key = "rg:rl:{t}:plan:cq.month.UTC:acme";
    // The request carries the 10th (its default): a stored 15th wins.
    set_key(&mut con, "rg:ov:{t}:plan:acme", "cq 50 15");
    assert_eq!(
        raw(&mut con, now, &[moved(key, 100, &c, now, 10, 10)]),
        ints(&[5, 1, 15])
    );
    // A stored amount without a day: the request's day stands, the amount
    // is the stored one.
    set_key(&mut con, "rg:ov:{t}:plan:acme", "cq 50");
    assert_eq!(
        raw(&mut con, now, &[moved(key, 100, &c, now, 15, 10)]),
        ints(&[5, 1, 10])
    );
    assert_eq!(
        raw(&mut con, now, &[moved(key, 100, &c, now, 10, 10)]),
        ints(&[1, 3, 49, 0, utc(2027, 7, 10, 0) - now, 50, 0])
    );
    assert!(exists(&mut con, &format!("{key}:{}", utc(2027, 6, 10, 0))));
    // A stored override the script ignores (a day past the unit's) sets no
    // day either: decided on the default with the configured amount,
    // reported ignored (0 + 4 + 1).
    let w = cal(Per::Week, "UTC", 1);
    let wkey = "rg:rl:{t}:plan:cq.week.UTC:acme";
    set_key(&mut con, "rg:ov:{t}:plan:acme", "cq 50 9");
    let d = raw(&mut con, now, &[moved(wkey, 100, &w, now, 1, 1)]);
    assert_eq!(d, ints(&[1, 5, 99, 0, utc(2027, 6, 21, 0) - now]));
    // One whose amount is below the request's cost still sets the
    // customer's day (the amount alone is ignored, as every kind ignores an
    // override the cost does not fit): edges for the default are sent back
    // for the 3rd (a Wednesday), and edges for it are decided there with
    // the configured amount, reported ignored, the Envoy's remembered day
    // left as it is.
    set_key(&mut con, "rg:ov:{t}:plan:acme", "cq 1 3");
    let d = raw(&mut con, now, &[moved(wkey, 100, &w, now, 1, 1).cost(2)]);
    assert_eq!(d, ints(&[5, 1, 3]));
    let d = raw(&mut con, now, &[moved(wkey, 100, &w, now, 3, 1).cost(2)]);
    assert_eq!(d, ints(&[1, 5, 98, 0, utc(2027, 6, 23, 0) - now]));
    assert_eq!(
        get(&mut con, &format!("{wkey}:{}", utc(2027, 6, 16, 0))),
        Some("2".into())
    );
    // Anchoring that does not parse is malformed: an error, nothing written.
    for bad in [
        "@0,1,31",
        "@32,1,31",
        "@9,1,7",
        "@1,8,7",
        "@1,1",
        "@a,1,31",
        "@1,1,31,4",
    ] {
        let mut l = moved(wkey, 100, &w, now, 1, 1);
        l.c = format!("{}{bad}", l.c.split('@').next().unwrap());
        script::set_clock(&mut con, now);
        let r: redis::RedisResult<redis::Value> =
            script::with_limits(script::eval(&RATELIMIT_AT), &[l], None).query(&mut con);
        assert!(r.is_err(), "{bad}: {r:?}");
    }
}

#[test]
fn a_batch_member_on_another_day_is_named_and_its_neighbours_are_decided() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let c = cal(Per::Month, "UTC", 1);
    let now = utc(2027, 6, 20, 0);
    let from = utc(2027, 6, 1, 0);
    set_key(&mut con, "rg:ov:{t}:plan:acme", "cq 50 15");
    let zeta = moved("rg:rl:{t}:plan:cq.month.UTC:zeta", 2, &c, now, 1, 1);
    let acme = moved("rg:rl:{t}:plan:cq.month.UTC:acme", 2, &c, now, 1, 1);
    let members = [
        vec![zeta.clone()],
        vec![acme],
        vec![zeta.clone()],
        vec![zeta],
    ];
    let (keys, packed) = script::packed_batch(&members);
    script::set_clock(&mut con, now);
    let v: redis::Value = script::eval(&script::BATCH_AT)
        .arg(keys.len())
        .arg(&keys)
        .arg(&packed)
        .query(&mut con)
        .unwrap();
    let parts: Vec<redis::Value> = script::split_batch_reply(v, 4)
        .into_iter()
        .map(redis::Value::Array)
        .collect();
    let left = utc(2027, 7, 1, 0) - now;
    assert_eq!(
        parts,
        [
            ints(&[1, 1, 1, 0, left]),
            ints(&[5, 1, 15]),
            ints(&[1, 1, 0, 0, left]),
            ints(&[0, 0, 0, left, left]),
        ]
    );
    assert_eq!(
        get(
            &mut con,
            &format!("rg:rl:{{t}}:plan:cq.month.UTC:zeta:{from}")
        ),
        Some("2".into())
    );
    assert_eq!(
        keys_under(&mut con, "rg:rl:{t}:plan:cq.month.UTC:acme*"),
        Vec::<String>::new()
    );
}
