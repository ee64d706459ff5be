//! The filter's Envoy stats as Prometheus scrapes them (`/stats/prometheus`):
//! after a scenario with known outcomes, every counter, the circuit gauge and
//! the callout latency histogram hold exactly what happened. Limit names and
//! error kinds arrive as labels (the `stats_tags` in envoy.yaml).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use support::probe::*;
use support::*;

fn config() -> String {
    filter_config(300)
        .circuit_breaker(2, 1000)
        .failure_mode("allow")
        .limits(
            r#"[
    {"name": "burst", "match": {"pathPrefix": "/api/"}, "descriptor": [{"header": "x-user"}],
     "tokenBucket": {"capacity": 3, "refill": 1, "periodMs": 600000}},
    {"name": "trial.v2", "match": {"pathPrefix": "/api/search"}, "descriptor": [{"header": "x-user"}],
     "slidingWindow": {"limit": 1, "windowMs": 600000}, "shadow": true},
    {"name": "local-two", "match": {"pathPrefix": "/local/"}, "descriptor": [{"header": "x-user"}],
     "tokenBucket": {"capacity": 2, "refill": 1, "periodMs": 600000},
     "failureMode": "local", "localFraction": 1},
    {"name": "leased", "match": {"pathPrefix": "/lease/"}, "descriptor": [{"header": "x-user"}],
     "tokenBucket": {"capacity": 100, "refill": 1, "periodMs": 600000},
     "lease": {"tokens": 4, "ttlMs": 600000}}
  ]"#,
        )
        .idempotency(r#"[{"name": "pay", "match": {"pathPrefix": "/pay"}}]"#)
        .build()
}

const LIMITS: [&str; 4] = ["burst", "trial.v2", "local-two", "leased"];
const VERDICTS: [&str; 4] = ["checked", "allowed", "rejected", "shadow_rejected"];
const KINDS: [&str; 6] = ["timeout", "dispatch", "http", "redis", "reply", "auth"];
/// Every series without labels, by its name after `redis_guard_`.
const PLAIN: [&str; 46] = [
    "redis_calls",
    "batch_calls",
    "batch_alone",
    "redis_script_reloads",
    "redis_retries",
    "redis_errors",
    "failure_mode_allowed",
    "failure_mode_denied",
    "failure_mode_local",
    "local_allowed",
    "local_rejected",
    "circuit_opened",
    "circuit_closed",
    "circuit_short_circuited",
    "circuit_open_workers",
    "overlimit_cache_rejected",
    "lease_fetches",
    "lease_spent",
    "lease_returned",
    "idempotency_acquired",
    "idempotency_replayed",
    "idempotency_conflicted",
    "idempotency_mismatched",
    "idempotency_released",
    "idempotency_abandoned",
    "idempotency_stored",
    "idempotency_store_failed",
    "idempotency_too_large",
    "idempotency_unguarded",
    "idempotency_offloaded",
    "idempotency_offload_failed",
    "idempotency_object_fetched",
    "idempotency_object_missing",
    "idempotency_object_corrupt",
    "idempotency_object_fetch_failed",
    "concurrency_released",
    "concurrency_abandoned",
    "concurrency_renewed",
    "concurrency_lost",
    "usage_charged_units",
    "usage_refunded_units",
    "usage_fallback",
    "usage_reserve_unread",
    "descriptor_invalid",
    "usage_lost",
    "denied",
];

const BATCH_SIZE: &str = "redis_guard_batch_size";

/// What every series of the filter must hold: (name, labels) -> value.
/// Starts with all of them at 0; each phase sets what it changed.
struct Expected(BTreeMap<(String, String), u64>);

impl Expected {
    fn new() -> Expected {
        let mut m = BTreeMap::new();
        for limit in LIMITS {
            // No `unless` or overrides here (e2e_exempt_deny and
            // e2e_overrides count them).
            for stat in ["exempt", "override_applied", "override_invalid"] {
                m.insert(
                    (
                        format!("redis_guard_ratelimit_{stat}"),
                        format!("limit=\"{limit}\""),
                    ),
                    0,
                );
            }
            for stat in VERDICTS {
                m.insert(
                    (
                        format!("redis_guard_ratelimit_{stat}"),
                        format!("limit=\"{limit}\""),
                    ),
                    0,
                );
            }
        }
        for kind in KINDS {
            m.insert(
                (
                    "redis_guard_redis_errors_by_kind".to_string(),
                    format!("kind=\"{kind}\""),
                ),
                0,
            );
        }
        for name in PLAIN {
            m.insert((format!("redis_guard_{name}"), String::new()), 0);
        }
        // The tz database release compiled in, an info gauge: always 1.
        m.insert(
            ("redis_guard_tzdb".to_string(), "tzdb=\"2025b\"".to_string()),
            1,
        );
        Expected(m)
    }

    fn set(&mut self, name: &str, value: u64) {
        let key = (format!("redis_guard_{name}"), String::new());
        assert!(self.0.contains_key(&key), "no series {name}");
        self.0.insert(key, value);
    }

    /// A limit's checked, allowed, rejected and shadow_rejected counters.
    fn verdicts(&mut self, limit: &str, values: [u64; 4]) {
        for (stat, v) in VERDICTS.iter().zip(values) {
            self.0.insert(
                (
                    format!("redis_guard_ratelimit_{stat}"),
                    format!("limit=\"{limit}\""),
                ),
                v,
            );
        }
    }

    fn error_kind(&mut self, kind: &str, value: u64) {
        self.0.insert(
            (
                "redis_guard_redis_errors_by_kind".to_string(),
                format!("kind=\"{kind}\""),
            ),
            value,
        );
    }

    /// Waits (bounded) until the latency histogram holds one sample per
    /// call, then compares every series of the filter, and fails on any
    /// `redis_guard` series this list does not name.
    fn check(&self, envoy: &Envoy) {
        let calls = self.0[&("redis_guard_redis_calls".to_string(), String::new())];
        let s = scrape_with_samples(envoy, LATENCY, calls);
        let got: BTreeMap<_, _> = self
            .0
            .keys()
            .map(|(n, l)| ((n.clone(), l.clone()), s.get(n, l)))
            .collect();
        assert_eq!(got, self.0);
        assert_eq!(s.type_of(LATENCY), Some("histogram"));
        assert_eq!(s.type_of("redis_guard_circuit_open_workers"), Some("gauge"));
        assert_eq!(s.type_of("redis_guard_tzdb"), Some("gauge"));
        let (_, samples, sum) = s.histogram(LATENCY);
        assert_eq!(samples, calls, "one latency sample per call");
        assert!(sum > 0.0);
        // Requests here come one at a time, so each finds its worker quiet
        // and sends its own call: no batch, no batch-size sample (e2e_batch
        // checks the samples of real batches).
        let batches = self.0[&("redis_guard_batch_calls".to_string(), String::new())];
        assert_eq!(s.type_of(BATCH_SIZE), Some("histogram"));
        let (buckets, samples, _) = s.histogram(BATCH_SIZE);
        assert_eq!(samples, batches);
        // Envoy's sums are approximate; its buckets are exact: every sample
        // above 0.5 and at most 1.
        let at = |bound: f64| buckets.iter().find(|(b, _)| *b == bound).map(|(_, n)| *n);
        assert_eq!((at(0.5), at(1.0)), (Some(0), Some(batches)));
        assert_eq!(s.unread("redis_guard"), Vec::<String>::new());
    }
}

#[test]
fn prometheus_scrape_counts_every_decision_exactly() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let envoy = &envoy_flushing_stats(&config(), webdis.port, upstream.port);
    let mut want = Expected::new();

    // Rate limits: user a spends a bucket of 3 in 5 tries; user b searches
    // twice, which the shadow limit (1 per window) would have refused once.
    let codes: Vec<u16> = (0..5)
        .map(|_| get(&envoy.url("/api/orders"), &[("x-user", "a")]).status)
        .collect();
    assert_eq!(codes, vec![200, 200, 200, 429, 429]);
    for _ in 0..2 {
        assert_eq!(
            get(&envoy.url("/api/search"), &[("x-user", "b")]).status,
            200
        );
    }
    // A leased limit: the first request fetches itself plus a batch of 4,
    // the next two spend from the batch (4 -> 2 left: not below half, so
    // no background fetch starts).
    for _ in 0..3 {
        assert_eq!(get(&envoy.url("/lease/x"), &[("x-user", "e")]).status, 200);
    }

    // Idempotency: store, replay, mismatch, conflict, release.
    let pay = |key: &str, body: &[u8], extra: &[(&str, &str)]| {
        let mut headers = vec![("idempotency-key", key)];
        headers.extend_from_slice(extra);
        http("POST", &envoy.url("/pay"), &headers, Some(body))
    };
    assert_eq!(pay("k1", b"a", &[]).status, 200);
    let replay = pay("k1", b"a", &[]);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(pay("k1", b"other", &[]).status, 422);
    let before = upstream.executed();
    let url = envoy.url("/pay");
    let slow = std::thread::spawn(move || {
        http(
            "POST",
            &url,
            &[("idempotency-key", "k2"), ("x-upstream-delay-ms", "1500")],
            Some(b"b"),
        )
        .status
    });
    poll("k2 reaches the upstream", Duration::from_secs(5), || {
        (upstream.executed() > before).then_some(())
    });
    assert_eq!(pay("k2", b"b", &[]).status, 409);
    assert_eq!(slow.join().unwrap(), 200);
    assert_eq!(pay("k3", b"c", &[("x-upstream-status", "500")]).status, 500);

    // 7 limit decisions, of which a's second 429 came from the over-limit
    // cache, each a request's own call: batching is on by default, but one
    // request at a time always finds its worker quiet and goes alone; the
    // lease fetch; k1 take+store, replay, mismatch, k2 take+store,
    // conflict, k3 take+release (keyed requests keep their own call); and
    // an EVAL after the first NOSCRIPT of each script (the decision, shared
    // by lone and keyed requests, the lease, the store, the release) on a
    // fresh Redis.
    // The lease's 2 unspent tokens go back to Redis a second after its last
    // spend (the requests above take longer): one give-back, EVALSHA then
    // EVAL on this fresh Redis (lua/lease_return.lua).
    poll(
        "the lease's unspent tokens given back",
        Duration::from_secs(10),
        || {
            let mut con = redis.conn();
            let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("*:ret").query(&mut con).ok()?;
            let record: Vec<u8> = redis::cmd("GET").arg(keys.first()?).query(&mut con).ok()?;
            (record.get(..8)? == 2f64.to_le_bytes()).then_some(())
        },
    );
    want.set("redis_calls", 6 + 1 + 9 + 4 + 2);
    want.set("batch_calls", 0);
    want.set("batch_alone", 6);
    want.verdicts("burst", [7, 5, 2, 0]);
    // A limit name with a dot stays whole in its label.
    want.verdicts("trial.v2", [2, 1, 0, 1]);
    want.verdicts("leased", [3, 3, 0, 0]);
    want.set("lease_fetches", 1);
    want.set("lease_spent", 2);
    want.set("lease_returned", 2);
    want.set("overlimit_cache_rejected", 1);
    want.set("redis_script_reloads", 5);
    for (stat, n) in [
        ("acquired", 3),
        ("replayed", 1),
        ("mismatched", 1),
        ("conflicted", 1),
        ("released", 1),
        ("stored", 2),
    ] {
        want.set(&format!("idempotency_{stat}"), n);
    }
    want.check(envoy);

    // Redis stops answering. One keep-alive connection keeps these requests
    // on one Envoy worker, whose breaker (2 failures) opens: two requests
    // time out (Envoy ends each callout with its own 504), the next two are
    // sent to the failure mode without a call.
    redis.freeze(true);
    let agent = agent();
    for i in 0..4 {
        let r = http_with(
            &agent,
            "GET",
            &envoy.url("/api/orders"),
            &[("x-user", "c")],
            None,
        );
        assert_eq!(r.status, 200, "request {i} fails open");
    }
    // On the same worker, a limit in `local` mode: its budget of 2 (the
    // whole bucket, localFraction 1) is spent in process, the third is 429.
    let local: Vec<u16> = (0..3)
        .map(|_| {
            http_with(
                &agent,
                "GET",
                &envoy.url("/local/x"),
                &[("x-user", "d")],
                None,
            )
            .status
        })
        .collect();
    assert_eq!(local, vec![200, 200, 429]);
    // Two more calls (each timed out, each one latency sample), each a
    // request alone: the breaker hears of each.
    want.set("redis_calls", 22 + 2);
    want.set("batch_alone", 6 + 2);
    want.set("failure_mode_local", 3);
    want.set("local_allowed", 2);
    want.set("local_rejected", 1);
    want.verdicts("local-two", [3, 0, 1, 0]);
    want.set("redis_errors", 2);
    want.error_kind("timeout", 2);
    want.set("failure_mode_allowed", 4);
    want.set("circuit_opened", 1);
    want.set("circuit_short_circuited", 2 + 3);
    want.set("circuit_open_workers", 1);
    want.verdicts("burst", [7 + 4, 5, 2, 0]);
    want.check(envoy);

    // Redis answers again. The breaker's cool-down (1 s on the proxy clock)
    // must pass before a request probes; any request sent to look would be
    // counted, so this one wait is a sleep.
    redis.freeze(false);
    std::thread::sleep(Duration::from_millis(1100));
    let r = http_with(
        &agent,
        "GET",
        &envoy.url("/api/orders"),
        &[("x-user", "c")],
        None,
    );
    assert_eq!(r.status, 200);
    // The probe's call, decided by Redis, closed the breaker: a probe goes
    // alone, not in a batch.
    want.set("redis_calls", 25);
    want.set("circuit_closed", 1);
    want.set("circuit_open_workers", 0);
    want.verdicts("burst", [12, 6, 2, 0]);
    want.check(envoy);
}
