//! The filter's Envoy stats as Prometheus scrapes them (`/stats/prometheus`):
//! after a scenario with known outcomes, every counter, the circuit gauge and
//! the callout latency histogram hold exactly what happened. Limit names and
//! error kinds arrive as labels (the `stats_tags` in envoy.yaml).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use support::*;

const CONFIG: &str = r#"{
  "redis": {"cluster": "webdis", "timeoutMs": 300,
            "circuitBreaker": {"failures": 2, "coolDownMs": 1000}},
  "failureMode": "allow",
  "limits": [
    {"name": "burst", "match": {"pathPrefix": "/api/"}, "descriptor": [{"header": "x-user"}],
     "tokenBucket": {"capacity": 3, "refill": 1, "periodMs": 600000}},
    {"name": "trial.v2", "match": {"pathPrefix": "/api/search"}, "descriptor": [{"header": "x-user"}],
     "slidingWindow": {"limit": 1, "windowMs": 600000}, "shadow": true},
    {"name": "local-two", "match": {"pathPrefix": "/local/"}, "descriptor": [{"header": "x-user"}],
     "tokenBucket": {"capacity": 2, "refill": 1, "periodMs": 600000},
     "failureMode": "local", "localFraction": 1}
  ],
  "idempotency": [{"name": "pay", "match": {"pathPrefix": "/pay"}}]
}"#;

/// One scrape: (metric name, labels as `k="v",...`) -> value.
struct Scrape {
    values: BTreeMap<(String, String), f64>,
    text: String,
}

impl Scrape {
    fn take(envoy: &Envoy) -> Scrape {
        let r = get(
            &format!("http://127.0.0.1:{}/stats/prometheus", envoy.admin_port),
            &[],
        );
        assert_eq!(r.status, 200);
        let text = String::from_utf8(r.body).unwrap();
        let mut values = BTreeMap::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            values.insert(
                (name.to_string(), labels.to_string()),
                value.parse().unwrap(),
            );
        }
        Scrape { values, text }
    }

    /// The value of a series; panics (showing the filter's lines) if absent.
    fn get(&self, name: &str, labels: &str) -> u64 {
        match self.values.get(&(name.to_string(), labels.to_string())) {
            Some(v) => *v as u64,
            None => panic!(
                "no series {name}{{{labels}}} in:\n{}",
                self.text
                    .lines()
                    .filter(|l| l.contains("redis_guard"))
                    .collect::<Vec<_>>()
                    .join("\n")
            ),
        }
    }

    fn limit(&self, stat: &str, limit: &str) -> u64 {
        self.get(
            &format!("redis_guard_ratelimit_{stat}"),
            &format!("limit=\"{limit}\""),
        )
    }

    /// A limit's checked, allowed, rejected and shadow_rejected counters.
    fn verdicts(&self, limit: &str) -> [u64; 4] {
        ["checked", "allowed", "rejected", "shadow_rejected"].map(|stat| self.limit(stat, limit))
    }

    fn plain(&self, name: &str) -> u64 {
        self.get(&format!("redis_guard_{name}"), "")
    }

    fn error_kind(&self, kind: &str) -> u64 {
        self.get(
            "redis_guard_redis_errors_by_kind",
            &format!("kind=\"{kind}\""),
        )
    }

    fn type_of(&self, name: &str) -> Option<&str> {
        self.text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("# TYPE {name} ")))
    }
}

/// Envoy merges histograms on its stats flush (every 5 s by default), so the
/// latency count is polled until it reaches `want` (bounded at 15 s).
fn latency_count(envoy: &Envoy, want: u64) -> Scrape {
    let start = Instant::now();
    loop {
        let s = Scrape::take(envoy);
        let count = s
            .values
            .get(&(
                "redis_guard_redis_callout_latency_us_count".to_string(),
                String::new(),
            ))
            .copied()
            .unwrap_or(0.0) as u64;
        if count >= want || start.elapsed() > Duration::from_secs(15) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn prometheus_scrape_counts_every_decision_exactly() {
    let stack = Stack::start(CONFIG, 1);
    let envoy = stack.envoy();

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
    let before = stack.upstream.executed();
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
    let start = Instant::now();
    while stack.upstream.executed() == before {
        assert!(start.elapsed() < Duration::from_secs(5), "k2 never ran");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(pay("k2", b"b", &[]).status, 409);
    assert_eq!(slow.join().unwrap(), 200);
    assert_eq!(pay("k3", b"c", &[("x-upstream-status", "500")]).status, 500);

    // 7 limit decisions, of which a's second 429 came from the over-limit
    // cache; k1 take+store, replay, mismatch, k2 take+store, conflict, k3
    // take+release; and an EVAL after the first NOSCRIPT of each script
    // (the decision, the store, the release) on a fresh Redis.
    let calls = 6 + 9 + 3;
    let s = latency_count(envoy, calls);
    assert_eq!(s.verdicts("burst"), [7, 5, 2, 0]);
    // A limit name with a dot stays whole in its label.
    assert_eq!(s.verdicts("trial.v2"), [2, 1, 0, 1]);
    assert_eq!(s.plain("redis_calls"), calls);
    assert_eq!(s.plain("overlimit_cache_rejected"), 1);
    assert_eq!(s.plain("redis_script_reloads"), 3);
    assert_eq!(s.plain("redis_errors"), 0);
    for (stat, want) in [
        ("acquired", 3),
        ("replayed", 1),
        ("mismatched", 1),
        ("conflicted", 1),
        ("released", 1),
        ("stored", 2),
        ("store_failed", 0),
        ("unguarded", 0),
        ("too_large", 0),
        ("offloaded", 0),
        ("offload_failed", 0),
        ("object_fetched", 0),
        ("object_missing", 0),
        ("object_corrupt", 0),
        ("object_fetch_failed", 0),
    ] {
        assert_eq!(s.plain(&format!("idempotency_{stat}")), want, "{stat}");
    }
    assert_eq!(
        s.type_of("redis_guard_redis_callout_latency_us"),
        Some("histogram")
    );
    assert_eq!(
        s.plain("redis_callout_latency_us_count"),
        calls,
        "one sample per call"
    );
    assert_eq!(s.type_of("redis_guard_circuit_open_workers"), Some("gauge"));
    assert_eq!(s.plain("circuit_open_workers"), 0);

    // Redis stops answering. One keep-alive connection keeps these requests
    // on one Envoy worker, whose breaker (2 failures) opens: two requests
    // time out (Envoy ends each callout with its own 504), the next two are
    // sent to the failure mode without a call.
    stack.redis.freeze(true);
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
    let s = Scrape::take(envoy);
    assert_eq!(s.plain("failure_mode_local"), 3);
    assert_eq!(s.plain("local_allowed"), 2);
    assert_eq!(s.plain("local_rejected"), 1);
    assert_eq!(
        (
            s.limit("checked", "local-two"),
            s.limit("rejected", "local-two")
        ),
        (3, 1)
    );
    assert_eq!(s.plain("redis_retries"), 0);
    assert_eq!(s.plain("redis_errors"), 2);
    assert_eq!(s.error_kind("timeout"), 2);
    for kind in ["dispatch", "http", "redis", "reply"] {
        assert_eq!(s.error_kind(kind), 0, "{kind}");
    }
    assert_eq!(s.plain("failure_mode_allowed"), 4);
    assert_eq!(s.plain("failure_mode_denied"), 0);
    assert_eq!(s.plain("circuit_opened"), 1);
    assert_eq!(s.plain("circuit_short_circuited"), 2 + 3);
    assert_eq!(s.plain("circuit_open_workers"), 1);
    assert_eq!(s.limit("checked", "burst"), 7 + 4);

    // Redis answers again; after the cool-down one probe closes the breaker.
    stack.redis.freeze(false);
    std::thread::sleep(Duration::from_millis(1100));
    let r = http_with(
        &agent,
        "GET",
        &envoy.url("/api/orders"),
        &[("x-user", "c")],
        None,
    );
    assert_eq!(r.status, 200);
    let s = Scrape::take(envoy);
    assert_eq!(s.plain("circuit_closed"), 1);
    assert_eq!(s.plain("circuit_open_workers"), 0);
    assert_eq!(s.plain("redis_errors"), 2);
}
