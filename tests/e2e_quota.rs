//! Calendar quotas through real Envoys, Redis and Webdis, at a controlled
//! clock: a month's end, a billing anchor on the 31st renewing on a leap
//! day, both daylight-saving days of a zone, and the README's recipe
//! "monthly plan + per-second burst limit" (envoy/recipes/quota.json, as it
//! is) with a customer's plan changed mid-month by the CLI.
//!
//! The clock: Redis' TIME cannot be set (and libfaketime 0.9.10 cannot be
//! preloaded into redis-server: its jemalloc recursion aborts the start),
//! so these Envoys run a test build of the filter (cargo feature
//! `test-clock`, built here into target/test-clock/) whose decision scripts
//! read Redis' clock from the key `rg:test:clock`, as the Lua tests' scripts
//! do, and whose quota windows are computed at the proxy clock a request
//! header gives. Everything else is the release filter's code; the release
//! build has neither path (checked below).
//!
//! Each Envoy keeps its own over-limit cache, which answers a key it saw
//! rejected for up to a second of real time: a renewal is checked on an
//! Envoy that has not rejected the key, or polled until Redis answers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use support::probe::poll;
use support::*;

/// The test build's proxy clock header and Redis clock key.
const NOW: &str = "x-redis-guard-test-now";
const CLOCK_KEY: &str = "rg:test:clock";
/// TTL past a window's end (lua/quota.lua CQ_MARGIN_MS).
const MARGIN_MS: i64 = 60_000;
const HOUR: i64 = 3_600_000;

/// The filter built with the test clock, in a target directory of its own.
fn test_clock_wasm() -> &'static PathBuf {
    static WASM: OnceLock<PathBuf> = OnceLock::new();
    WASM.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let dir = root().join("target/test-clock");
        let status = Command::new(cargo)
            .args(["build", "--release", "--lib", "--target", "wasm32-wasip1"])
            .args(["--features", "test-clock", "--target-dir"])
            .arg(&dir)
            .current_dir(root())
            .status()
            .unwrap();
        assert!(status.success(), "building the test-clock filter failed");
        dir.join("wasm32-wasip1/release/redis_guard.wasm")
    })
}

/// Redis, Webdis, the upstream and `envoys` Envoys running the test build.
fn start(config: &str, envoys: usize) -> Stack {
    let release = wasm_path().display().to_string();
    let test = test_clock_wasm().display().to_string();
    Stack::start_edited(config, envoys, |yaml| {
        assert!(yaml.contains(&release));
        yaml.replace(&release, &test)
    })
}

fn set_clock(con: &mut redis::Connection, ms: i64) {
    redis::cmd("SET")
        .arg(CLOCK_KEY)
        .arg(ms)
        .query::<()>(con)
        .unwrap();
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

/// A GET of `path` for API key `key`, the proxy's clock at `proxy_ms`.
fn get(envoy: &Envoy, path: &str, key: &str, proxy_ms: i64) -> Resp {
    get_with(envoy, path, key, proxy_ms, None)
}

/// The same, carrying the customer's plan in `x-plan` if `plan` says one.
fn get_with(envoy: &Envoy, path: &str, key: &str, proxy_ms: i64, plan: Option<&str>) -> Resp {
    let now = proxy_ms.to_string();
    let mut headers = vec![("x-api-key", key), (NOW, now.as_str())];
    headers.extend(plan.map(|p| ("x-plan", p)));
    http_with(&agent(), "GET", &envoy.url(path), &headers, None)
}

/// A quota window's key (the state key and `:<start>`), its count and PTTL.
fn window(con: &mut redis::Connection, limit: &str, key: &str, start: i64) -> (String, i64) {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("rg:rl:*:{limit}:cq.*:{key}:{start}"))
        .query(con)
        .unwrap();
    assert_eq!(keys.len(), 1, "{limit} {key} {start}: {keys:?}");
    let count: String = redis::cmd("GET").arg(&keys[0]).query(con).unwrap();
    let pttl: i64 = redis::cmd("PTTL").arg(&keys[0]).query(con).unwrap();
    (count, pttl)
}

const CROSSINGS: &str = r#"[
  {"name":"month","match":{"pathPrefix":"/month/"},"descriptor":[{"header":"x-api-key"}],
   "quota":{"amount":2,"per":"month","timeZone":"Europe/Berlin"}},
  {"name":"billing","match":{"pathPrefix":"/billing/"},"descriptor":[{"header":"x-api-key"}],
   "quota":{"amount":2,"per":"month","timeZone":"America/New_York","anchorDay":31}},
  {"name":"day","match":{"pathPrefix":"/day/"},"descriptor":[{"header":"x-api-key"}],
   "quota":{"amount":2,"per":"day","timeZone":"Europe/Berlin"}},
  {"name":"anchored","match":{"pathPrefix":"/anchored/"},"descriptor":[{"header":"x-api-key"}],
   "quota":{"amount":100,"per":"month","timeZone":"Europe/Berlin"},
   "overrides":{"request":{"header":"x-plan"}}}
]"#;

/// One renewal: the amount (2) spent at `from`, the third request refused
/// until `renewal` (Retry-After), still refused 1 ms before it, admitted at
/// it on another Envoy, in a new key that lives `next_ms` (the new window)
/// and a margin. The proxy's clock is `skew_ms` behind Redis' throughout;
/// every request carries `plan` (`x-plan`) if given.
#[allow(clippy::too_many_arguments)]
fn cross(
    stack: &Stack,
    path: &str,
    key: &str,
    from: i64,
    renewal: i64,
    next_ms: i64,
    skew_ms: i64,
    plan: Option<&str>,
) {
    let get = |envoy: &Envoy, path: &str, key: &str, at: i64| get_with(envoy, path, key, at, plan);
    let mut con = stack.redis.conn();
    let limit = path.trim_matches('/').split('/').next().unwrap();
    let (a, b) = (&stack.envoys[0], &stack.envoys[1]);
    set_clock(&mut con, from);
    for _ in 0..2 {
        assert_eq!(get(a, path, key, from - skew_ms).status, 200);
    }
    let r = get(b, path, key, from - skew_ms);
    assert_eq!(r.status, 429, "{r:?}");
    let wait = (renewal - from + 999) / 1000;
    assert_eq!(
        r.header("retry-after"),
        Some(wait.to_string().as_str()),
        "{path}"
    );
    // 1 ms before the renewal, on an Envoy that never rejected the key (no
    // over-limit cache entry): Redis refuses, 1 s to wait.
    set_clock(&mut con, renewal - 1);
    let r = get(a, path, key, renewal - 1 - skew_ms);
    assert_eq!(r.status, 429, "{path} 1 ms before the renewal: {r:?}");
    assert_eq!(r.header("retry-after"), Some("1"));
    // At the renewal, on the other Envoy (its cache may answer the rejection
    // it saw for up to a second first).
    set_clock(&mut con, renewal);
    let r = poll("the renewal admitted", Duration::from_secs(5), || {
        let r = get(b, path, key, renewal - skew_ms);
        (r.status == 200).then_some(r)
    });
    let next_s = next_ms / 1000;
    assert_eq!(
        r.header("ratelimit"),
        Some(format!("\"{limit}\";r=1;t={next_s}").as_str()),
        "{path}"
    );
    let (count, pttl) = window(&mut con, limit, key, renewal);
    assert_eq!(count, "1");
    // PX counts on Redis' real clock from the call: within a few seconds.
    assert!(
        pttl <= next_ms + MARGIN_MS && pttl > next_ms + MARGIN_MS - 10_000,
        "{path}: PTTL {pttl}"
    );
}

#[test]
fn quotas_renew_at_the_calendar_edge_on_redis_clock_through_envoy() {
    let config = filter_config(2000).field("limits", CROSSINGS).build();
    let stack = start(&config, 2);
    let mut con = stack.redis.conn();
    // Month end in Berlin: 2027-02-01 00:00 CET, the proxy on Redis' clock.
    // Its policy says February's window, 28 days in seconds.
    let renewal = utc(2027, 1, 31, 23);
    let feb = utc(2027, 2, 28, 23) - renewal;
    cross(
        &stack,
        "/month/x",
        "m1",
        renewal - HOUR,
        renewal,
        feb,
        0,
        None,
    );
    set_clock(&mut con, renewal + 1000);
    let r = get(&stack.envoys[0], "/month/x", "m1", renewal + 1000);
    assert_eq!(
        r.header("ratelimit-policy"),
        Some(format!("\"month\";q=2;w={}", feb / 1000).as_str())
    );
    // A billing anchor on the 31st in New York renews on 2028-02-29 00:00
    // EST, the proxy 30 s behind.
    let leap = utc(2028, 2, 29, 5);
    let march = utc(2028, 3, 31, 4) - leap;
    cross(
        &stack,
        "/billing/x",
        "b1",
        utc(2028, 2, 1, 12),
        leap,
        march,
        30_000,
        None,
    );
    // Berlin's 23-hour day (2027-03-28: spent at its start, 82800 s to wait)
    // and its 25-hour day (2027-10-31: 90000 s), the proxy a minute behind.
    let spring = utc(2027, 3, 27, 23);
    cross(
        &stack,
        "/day/x",
        "d1",
        spring,
        spring + 23 * HOUR,
        24 * HOUR,
        60_000,
        None,
    );
    let autumn = utc(2027, 10, 30, 22);
    cross(
        &stack,
        "/day/x",
        "d2",
        autumn,
        autumn + 25 * HOUR,
        24 * HOUR,
        60_000,
        None,
    );
    // A customer whose plan (carried by the request) is 2 a month from the
    // 15th: renewed at 2027-01-15 00:00 CET, not on the 1st.
    let fifteenth = utc(2027, 1, 14, 23);
    let next = utc(2027, 2, 14, 23) - fifteenth;
    let plan = Some("cq 2 15");
    cross(
        &stack,
        "/anchored/x",
        "p1",
        utc(2027, 1, 2, 0),
        fifteenth,
        next,
        0,
        plan,
    );
}

#[test]
fn a_proxy_clock_a_window_away_from_redis_fails_as_the_failure_mode_says() {
    let config = filter_config(2000).field("limits", CROSSINGS).build();
    let stack = start(&config, 1);
    let mut con = stack.redis.conn();
    let now = utc(2027, 6, 15, 12);
    set_clock(&mut con, now);
    // Three days behind: no window of its edges holds Redis' clock; the
    // config's failureMode is deny.
    let r = get(stack.envoy(), "/day/x", "s1", now - 3 * 24 * HOUR);
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(get(stack.envoy(), "/day/x", "s1", now).status, 200);
}

#[test]
fn the_release_build_has_no_test_clock_and_the_test_build_has_one() {
    let release = std::fs::read(wasm_path()).unwrap();
    let test = std::fs::read(test_clock_wasm()).unwrap();
    let has = |bytes: &[u8], s: &str| bytes.windows(s.len()).any(|w| w == s.as_bytes());
    for s in [NOW, CLOCK_KEY] {
        assert!(!has(&release, s), "the release filter holds {s}");
        assert!(has(&test, s), "the test filter lacks {s}");
    }
}

#[test]
fn the_quota_recipe_renews_a_monthly_plan_and_keeps_the_use_when_the_cli_changes_it() {
    let config = filter_config(2000).recipe("quota").build();
    let stack = start(&config, 3);
    let mut con = stack.redis.conn();
    let (a, b, c) = (&stack.envoys[0], &stack.envoys[1], &stack.envoys[2]);
    // 23:59 CET on January 31st: a minute before the plan renews.
    let renewal = utc(2027, 1, 31, 23);
    let t = renewal - 60_000;
    set_clock(&mut con, t);
    // The per-second burst: 20 at once, the 21st waits for a refill.
    for _ in 0..20 {
        assert_eq!(get(a, "/v1/x", "acme", t).status, 200);
    }
    let r = get(b, "/v1/x", "acme", t);
    assert_eq!(
        (r.status, r.header("retry-after")),
        (429, Some("1")),
        "{r:?}"
    );
    // The customer's plan is 22 a month from now on (the CLI's override):
    // the 20 spent still count.
    let dir = Scratch::new("quota");
    let path = dir.0.join("filter.json");
    std::fs::write(&path, &config).unwrap();
    let args = [
        "override",
        "set",
        "--limit",
        "monthly-plan",
        "--value",
        "x-api-key=acme",
        "--quota",
        "22",
    ];
    cli_json(env!("CARGO_BIN_EXE_redis-guard"), &stack, &path, &args);
    let t = t + 1000;
    set_clock(&mut con, t);
    for _ in 0..2 {
        assert_eq!(get(a, "/v1/x", "acme", t).status, 200);
    }
    // Refused by the plan until the renewal, 59 s on (Envoy b's cache may
    // answer its per-second rejection first, for up to 100 ms).
    poll("the plan's refusal", Duration::from_secs(5), || {
        let r = get(b, "/v1/x", "acme", t);
        assert_eq!(r.status, 429);
        (r.header("retry-after") == Some("59")).then_some(())
    });
    let jan = utc(2026, 12, 31, 23);
    assert_eq!(window(&mut con, "monthly-plan", "acme", jan).0, "22");
    set_clock(&mut con, renewal - 1);
    assert_eq!(get(a, "/v1/x", "acme", renewal - 1).status, 429);
    set_clock(&mut con, renewal);
    assert_eq!(get(c, "/v1/x", "acme", renewal).status, 200);
    assert_eq!(window(&mut con, "monthly-plan", "acme", renewal).0, "1");
}

/// `redis-guard` with `--json` against `redis`, on the config at `config`.
fn cli(redis: &Redis, config: &std::path::Path, args: &[&str]) -> serde_json::Value {
    cli_json_on(env!("CARGO_BIN_EXE_redis-guard"), redis, config, args)
}

#[test]
fn the_cli_shows_a_quotas_use_and_next_renewal_in_its_zone_and_resets_it() {
    use redis_guard::quota::{zone, Calendar, Per};
    use support::script::{request, Limit};
    // On Redis' own clock (the release scripts, as the CLI reads TIME too).
    let redis = Redis::start();
    let mut con = redis.conn();
    let dir = Scratch::new("quota-cli");
    let path = dir.0.join("filter.json");
    let limits = r#"[{"name":"plan","descriptor":[{"header":"x-api-key"}],
        "quota":{"amount":10,"per":"month","timeZone":"Europe/Berlin","anchorDay":31},
        "overrides":{"redis":true}}]"#;
    std::fs::write(&path, filter_config(2000).field("limits", limits).build()).unwrap();
    let which = ["--limit", "plan", "--value", "x-api-key=acme"];
    let inspect = || cli(&redis, &path, &[&["inspect"][..], &which[..]].concat());
    let seen = inspect();
    let key = seen["key"].as_str().unwrap().to_string();
    assert_eq!(
        (&seen["quota"]["used"], &seen["quota"]["left"]),
        (&0.into(), &10.into())
    );
    let c = Calendar {
        per: Per::Month,
        zone: zone("Europe/Berlin").unwrap(),
        anchor: 31,
    };
    // Three units through the filter's script, its edges at Redis' clock
    // (a renewal between these reads is a window the check below names).
    let spend = |con: &mut redis::Connection| {
        let now = redis_now_ms(con);
        let [e0, e1, e2, e3] = c.edges(now).unwrap();
        let l = Limit {
            key: key.clone(),
            alg: "cq",
            a: 10,
            b: 0,
            c: format!("{e0},{e1},{e2},{e3}"),
            cost: 3,
            enforce: true,
            block: 0,
        };
        let v = request(con, std::slice::from_ref(&l), None)
            .decision()
            .limits[0];
        (v.allowed, c.window(now).unwrap(), v)
    };
    let (allowed, w, v) = spend(&mut con);
    assert!(allowed, "{v:?}");
    assert_eq!(v.remaining, 7);
    let seen = inspect();
    let q = &seen["quota"];
    assert_eq!((&q["used"], &q["left"]), (&3.into(), &7.into()), "{seen}");
    assert_eq!(q["windowStartMs"], w.start_ms);
    assert_eq!(q["renewalMs"], w.end_ms);
    assert_eq!(q["renewal"], c.format(w.end_ms).unwrap());
    assert!(
        q["renewal"].as_str().unwrap().ends_with(" Europe/Berlin"),
        "{q}"
    );
    // The customer's plan set to 4 a month: 1 left of it.
    let set = [&["override", "set", "--quota", "4"][..], &which[..]].concat();
    cli(&redis, &path, &set);
    let seen = inspect();
    let q = &seen["quota"];
    assert_eq!(
        (&q["used"], &q["amount"], &q["left"]),
        (&3.into(), &4.into(), &1.into()),
        "{q}"
    );
    // The top-level figures (the script's) follow the stored amount too.
    assert_eq!(
        (&seen["allowed"], &seen["remaining"]),
        (&true.into(), &1.into()),
        "{seen}"
    );
    // Reset: the window's key goes, the whole amount is back.
    let reset = cli(
        &redis,
        &path,
        &[&["reset", "--yes"][..], &which[..]].concat(),
    );
    assert_eq!(reset["deleted"], true);
    assert_eq!(inspect()["quota"]["used"], 0);
    // The customer's billing day set to the 15th: the renewal shown is the
    // next 15th at midnight in Berlin.
    let set = [
        &["override", "set", "--quota", "4", "--anchor-day", "15"][..],
        &which[..],
    ]
    .concat();
    cli(&redis, &path, &set);
    let c15 = Calendar { anchor: 15, ..c };
    let before = c15.window(redis_now_ms(&mut con)).unwrap();
    let seen = inspect();
    let after = c15.window(redis_now_ms(&mut con)).unwrap();
    let q = &seen["quota"];
    assert!(
        [before.end_ms, after.end_ms].contains(&q["renewalMs"].as_i64().unwrap()),
        "{seen}"
    );
    let renewal = q["renewal"].as_str().unwrap();
    assert!(renewal.contains("-15T00:00:00+0"), "{renewal}");
    assert_eq!(
        renewal,
        c15.format(q["renewalMs"].as_i64().unwrap()).unwrap()
    );
    assert_eq!(
        (&q["amount"], &seen["allowed"], &seen["remaining"]),
        (&4.into(), &true.into(), &4.into()),
        "{seen}"
    );
}

#[test]
fn quotas_hold_per_tenant_over_redis_cluster_each_window_key_in_its_tenants_slot() {
    use redis_guard::quota::{zone, Calendar, Per};
    use support::cluster::{placement, tag, tag_in, tenants, ClusterStack};
    // The release filter on the cluster's own clock: a month in Tokyo.
    let cfg = filter_config(3000)
        .hash_tag(r#"[{"header":"x-tenant"}]"#)
        .limits(
            r#"[{"name":"plan","descriptor":[{"header":"x-tenant"}],
                 "quota":{"amount":2,"per":"month","timeZone":"Asia/Tokyo"}}]"#,
        )
        .build();
    let stack = ClusterStack::start(&cfg);
    let c = Calendar {
        per: Per::Month,
        zone: zone("Asia/Tokyo").unwrap(),
        anchor: 1,
    };
    let tenants = tenants(9);
    let placed = placement(&stack.cluster, &tenants);
    let mut con = stack.cluster.conn(0);
    for (i, t) in tenants.iter().enumerate() {
        let statuses: Vec<u16> = (0..2)
            .map(|k| support::get(&stack.envoys[(i + k) % 2].url("/x"), &[("x-tenant", t)]).status)
            .collect();
        assert_eq!(statuses, [200, 200], "{t}");
        let t0 = redis_now_ms(&mut con);
        let r = support::get(&stack.envoys[i % 2].url("/x"), &[("x-tenant", t)]);
        let t1 = redis_now_ms(&mut con);
        assert_eq!(r.status, 429, "{t}");
        // Retry-After: until the renewal, on the clock the masters share.
        let end = c.window(t0).unwrap().end_ms;
        let wait: i64 = r.header("retry-after").unwrap().parse().unwrap();
        assert!(
            (end - t1 + 999) / 1000 <= wait && wait <= (end - t0 + 999) / 1000,
            "{t}: {wait}"
        );
    }
    // One window key per tenant, on its master, named by the window's start.
    let start = c.window(redis_now_ms(&mut con)).unwrap().start_ms;
    let by_node = stack.cluster.keys_by_node("rg:*");
    let mut seen = 0;
    for (node, keys) in &by_node {
        for key in keys {
            let t = tenants.iter().find(|t| tag(t) == tag_in(key)).unwrap();
            assert_eq!(*node, placed[t], "{t}");
            assert!(String::from_utf8_lossy(key).ends_with(&format!(":{start}")));
            seen += 1;
        }
    }
    assert_eq!(seen, tenants.len());
    stack.assert_clean();
}

/// An LLM call for `key` through `envoy` at `proxy_ms`: the demo upstream
/// answers as OpenAI (JSON) with `tokens` ("prompt,completion") used.
fn llm(envoy: &Envoy, key: &str, proxy_ms: i64, tokens: &str) -> Resp {
    let now = proxy_ms.to_string();
    let headers = [
        ("x-api-key", key),
        (NOW, now.as_str()),
        ("x-upstream-llm", "openai-json"),
        ("x-upstream-tokens", tokens),
    ];
    http_with(
        &agent(),
        "POST",
        &envoy.url("/v1/chat/completions"),
        &headers,
        Some(b"{}"),
    )
}

/// Polls the count of `key`'s window starting at `start` until it is `want`.
fn counts(con: &mut redis::Connection, limit: &str, key: &str, start: i64, want: &str) {
    poll(
        &format!("{key}'s count at {start} to be {want}"),
        Duration::from_secs(5),
        || {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("rg:rl:*:{limit}:cq.*:{key}:{start}"))
                .query(con)
                .unwrap();
            let got: Option<String> = keys
                .first()
                .and_then(|k| redis::cmd("GET").arg(k).query(con).unwrap());
            (got.as_deref() == Some(want)).then_some(())
        },
    );
}

#[test]
fn a_daily_token_allowance_reserves_settles_into_its_day_and_renews_at_midnight() {
    let limits = r#"[{"name":"tokens","match":{"pathPrefix":"/v1/chat"},"descriptor":[{"header":"x-api-key"}],
        "quota":{"amount":100,"per":"day","timeZone":"Europe/Berlin"},
        "usage":{"reserve":10,"json":[{"pointer":"/usage/prompt_tokens"},{"pointer":"/usage/completion_tokens"}]}}]"#;
    let stack = start(&filter_config(2000).field("limits", limits).build(), 2);
    let mut con = stack.redis.conn();
    let (a, b) = (&stack.envoys[0], &stack.envoys[1]);
    // 2027-10-31 in Berlin: the 25-hour day.
    let day = utc(2027, 10, 30, 22);
    let midnight = day + 25 * HOUR;
    let t = day + HOUR;
    set_clock(&mut con, t);
    // 10 reserved, 30 used: settled to 30.
    let r = llm(a, "acme", t, "10,20");
    assert_eq!(r.status, 200, "{r:?}");
    counts(&mut con, "tokens", "acme", day, "30");
    // 90 used with 70 left: the day ends 20 in debt.
    assert_eq!(llm(b, "acme", t, "40,50").status, 200);
    counts(&mut con, "tokens", "acme", day, "120");
    let r = llm(a, "acme", t, "1,1");
    assert_eq!(r.status, 429, "{r:?}");
    let wait = ((midnight - t) / 1000).to_string();
    assert_eq!(r.header("retry-after"), Some(wait.as_str()));
    // At midnight the allowance is whole again (the other Envoy: a's
    // over-limit cache may answer its rejection for up to a second).
    // (10 s into the new day: a refund lands only in the window its reserve
    // was surely taken in, judged by the real ms since the decision, which
    // this frozen clock does not advance.)
    set_clock(&mut con, midnight + 10_000);
    let r = llm(b, "acme", midnight + 10_000, "1,1");
    assert_eq!(r.status, 200, "{r:?}");
    counts(&mut con, "tokens", "acme", midnight, "2");
    counts(&mut con, "tokens", "acme", day, "120");
}

const STORED: &str = r#"[
  {"name":"plan","match":{"pathPrefix":"/plan/"},"descriptor":[{"header":"x-api-key"}],
   "quota":{"amount":2,"per":"month","timeZone":"Europe/Berlin"},
   "overrides":{"redis":true}}
]"#;

#[test]
fn a_stored_anchor_day_moves_one_customers_renewal_and_a_change_is_caught_by_the_script() {
    let config = filter_config(2000).field("limits", STORED).build();
    let stack = start(&config, 2);
    let mut con = stack.redis.conn();
    let dir = Scratch::new("quota-anchor");
    let path = dir.0.join("filter.json");
    std::fs::write(&path, &config).unwrap();
    let anchor = |day: &str| {
        let args = [
            "override",
            "set",
            "--limit",
            "plan",
            "--value",
            "x-api-key=acme",
            "--quota",
            "2",
            "--anchor-day",
            day,
        ];
        cli_json(env!("CARGO_BIN_EXE_redis-guard"), &stack, &path, &args)
    };
    anchor("15");
    // Acme renews on the 15th (2027-01-15 00:00 CET): each Envoy first
    // sends edges for the configured 1st, the script sends them back, the
    // request goes again for the 15th. Refused 1 ms before, admitted at it.
    // (A limit a stored override decided is left out of the RateLimit
    // fields; Retry-After says the renewal.)
    let (a, b) = (&stack.envoys[0], &stack.envoys[1]);
    let fifteenth = utc(2027, 1, 14, 23);
    let from = utc(2027, 1, 2, 0);
    set_clock(&mut con, from);
    for _ in 0..2 {
        assert_eq!(get(a, "/plan/x", "acme", from).status, 200);
    }
    assert_eq!(
        window(&mut con, "plan", "acme", utc(2026, 12, 14, 23)).0,
        "2"
    );
    let r = get(b, "/plan/x", "acme", from);
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(
        r.header("retry-after"),
        Some(((fifteenth - from + 999) / 1000).to_string().as_str())
    );
    set_clock(&mut con, fifteenth - 1);
    let r = get(a, "/plan/x", "acme", fifteenth - 1);
    assert_eq!((r.status, r.header("retry-after")), (429, Some("1")));
    set_clock(&mut con, fifteenth);
    poll("acme renewed on the 15th", Duration::from_secs(5), || {
        (get(b, "/plan/x", "acme", fifteenth).status == 200).then_some(())
    });
    assert_eq!(window(&mut con, "plan", "acme", fifteenth).0, "1");
    // Zeta, without an override, keeps the configured 1st (2027-02-01 CET).
    let feb1 = utc(2027, 1, 31, 23);
    cross(
        &stack,
        "/plan/x",
        "zeta",
        utc(2027, 1, 20, 0),
        feb1,
        utc(2027, 2, 28, 23) - feb1,
        0,
        None,
    );
    // Acme's billing day moves to the 20th mid-window. Both Envoys remember
    // the 15th: the script catches it and the request is decided in the
    // window from January 20th (a new key), the 15th's left as it was.
    anchor("20");
    let twentieth = utc(2027, 1, 19, 23);
    let feb20 = utc(2027, 2, 19, 23);
    let t = utc(2027, 2, 1, 12);
    set_clock(&mut con, t);
    // (An Envoy that refused acme within the last second may answer from
    // its over-limit cache first.)
    poll("acme admitted on the 20th", Duration::from_secs(5), || {
        (get(a, "/plan/x", "acme", t).status == 200).then_some(())
    });
    assert_eq!(window(&mut con, "plan", "acme", twentieth).0, "1");
    assert_eq!(window(&mut con, "plan", "acme", fifteenth).0, "1");
    poll("acme on b", Duration::from_secs(5), || {
        (get(b, "/plan/x", "acme", t).status == 200).then_some(())
    });
    let r = get(a, "/plan/x", "acme", t);
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(
        r.header("retry-after"),
        Some(((feb20 - t + 999) / 1000).to_string().as_str())
    );
    assert_eq!(window(&mut con, "plan", "acme", twentieth).0, "2");
    // Renewed on the 20th: refused 1 ms before, admitted at it.
    set_clock(&mut con, feb20 - 1);
    assert_eq!(get(b, "/plan/x", "acme", feb20 - 1).status, 429);
    set_clock(&mut con, feb20);
    poll("acme renewed on the 20th", Duration::from_secs(5), || {
        (get(a, "/plan/x", "acme", feb20).status == 200).then_some(())
    });
    assert_eq!(window(&mut con, "plan", "acme", feb20).0, "1");
}
