//! The alert rules (envoy/prometheus/alerts.yaml) and the Grafana dashboard
//! (envoy/grafana/redis-guard.json) against a real Prometheus (Debian's
//! binary, its own configuration and data in a scratch directory, a free
//! loopback port, scraping and evaluating every second) that scrapes a real
//! Envoy running the filter (admin `/stats/prometheus`).
//!
//! Under healthy traffic every dashboard query returns data, the dashboard's
//! variable lists the Envoy, every series an alert reads exists, every rule
//! evaluates without error, and only the over-limit rule holds (for the one
//! limit that refused most of its requests). With Redis frozen, then killed,
//! under traffic (failureMode deny), every alert expression holds and the
//! Redis-unreachable alert is firing within its `for` plus two evaluation
//! intervals of turning pending.
//!
//! The tests load alerts.yaml with two edits, asserted to apply exactly once:
//! the latency rule's `timeoutMs` constant (50, an operator's setting) becomes
//! the test filter's, and RedisGuardRedisUnreachable's `for: 2m` becomes
//! `for: 10s` so the live test stays under a minute.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use support::probe::*;
use support::*;

/// The test's `for:` of RedisGuardRedisUnreachable, and Prometheus' scrape
/// and evaluation interval.
const UNREACHABLE_FOR: Duration = Duration::from_secs(10);
const INTERVAL: Duration = Duration::from_secs(1);
/// The range substituted for Grafana's `$__rate_interval`.
const RATE_INTERVAL: &str = "1m";

/// alerts.yaml as the tests load it (see the module comment).
fn rules(timeout_ms: u64) -> String {
    let text = std::fs::read_to_string(root().join("envoy/prometheus/alerts.yaml")).unwrap();
    let edit = |text: String, from: &str, to: &str| {
        assert_eq!(text.matches(from).count(), 1, "`{from}` in alerts.yaml");
        text.replace(from, to)
    };
    let text = edit(
        text,
        "> 0.8 * 50 * 1000",
        &format!("> 0.8 * {timeout_ms} * 1000"),
    );
    edit(
        text,
        "for: 2m",
        &format!("for: {}s", UNREACHABLE_FOR.as_secs()),
    )
}

/// Every alert of a rules file: (name, expression).
fn alert_exprs(rules: &str) -> Vec<(String, String)> {
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(rules).unwrap();
    doc["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_sequence().unwrap().iter())
        .map(|r| {
            (
                r["alert"].as_str().unwrap().to_string(),
                r["expr"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Every metric name (`redis_guard_…`) an expression reads.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(i) = rest.find("redis_guard_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

fn dashboard() -> Value {
    let text = std::fs::read_to_string(root().join("envoy/grafana/redis-guard.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The dashboard's one query variable (the Envoys to show), as Grafana
/// runs it: its name, the metric and label of its
/// `label_values(<metric>, <label>)`, and the value "All" stands for.
struct Variable {
    name: String,
    metric: String,
    label: String,
    all: String,
}

fn dashboard_variable() -> Variable {
    let dash = dashboard();
    let vars: Vec<&Value> = dash["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["type"] == "query")
        .collect();
    assert_eq!(vars.len(), 1, "one query variable: {vars:?}");
    let v = vars[0];
    assert_eq!(v["datasource"]["uid"], "${datasource}", "{v}");
    let query = v["query"]["query"].as_str().unwrap();
    assert_eq!(v["definition"], query, "what the editor shows is what runs");
    let args = query
        .strip_prefix("label_values(")
        .and_then(|q| q.strip_suffix(')'))
        .unwrap_or_else(|| panic!("not a label_values() query: {query}"));
    let (metric, label) = args.split_once(',').unwrap();
    assert_eq!(v["includeAll"], true, "{v}");
    Variable {
        name: v["name"].as_str().unwrap().to_string(),
        metric: metric.trim().to_string(),
        label: label.trim().to_string(),
        all: v["allValue"].as_str().unwrap().to_string(),
    }
}

/// The dashboard's queries, with Grafana's variables replaced by what a
/// viewer of every Envoy over the last minute would send: (panel, query).
fn dashboard_queries() -> Vec<(String, String)> {
    let dash = dashboard();
    let var = dashboard_variable();
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().unwrap() {
        if panel["type"] == "row" {
            continue;
        }
        let title = panel["title"].as_str().unwrap();
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "{title}: the datasource variable"
        );
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            let expr = t["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", RATE_INTERVAL)
                .replace(&format!("${}", var.name), &var.all);
            assert!(!expr.contains('$'), "{title}: a variable left in {expr}");
            out.push((title.to_string(), expr));
        }
    }
    out
}

/// A Prometheus of its own: config, rules and data in a scratch directory.
struct Prometheus {
    port: u16,
    proc: Proc,
    dir: Scratch,
}

impl Prometheus {
    /// Scrapes `admin_ports`' `/stats/prometheus` (job `envoy`) and evaluates
    /// `rules`, both every [`INTERVAL`]; waits (bounded) until it is ready.
    fn start(admin_ports: &[u16], rules: &str) -> Prometheus {
        let bin = std::path::Path::new("/usr/bin/prometheus");
        assert!(
            bin.exists(),
            "prometheus not found at /usr/bin/prometheus: run `make apt-deps` \
             (Debian's prometheus package)"
        );
        let dir = Scratch::new("prometheus");
        let port = free_port();
        std::fs::write(dir.0.join("alerts.yaml"), rules).unwrap();
        let targets: Vec<String> = admin_ports
            .iter()
            .map(|p| format!("'127.0.0.1:{p}'"))
            .collect();
        let config = format!(
            "global:\n  scrape_interval: {i}s\n  scrape_timeout: {i}s\n  evaluation_interval: {i}s\n\
             rule_files:\n- {rules}\n\
             scrape_configs:\n- job_name: envoy\n  metrics_path: /stats/prometheus\n  \
             static_configs:\n  - targets: [{targets}]\n",
            i = INTERVAL.as_secs(),
            rules = dir.0.join("alerts.yaml").display(),
            targets = targets.join(", "),
        );
        std::fs::write(dir.0.join("prometheus.yml"), config).unwrap();
        let log = std::fs::File::create(dir.0.join("prometheus.log")).unwrap();
        let mut proc = Proc::spawn(
            "prometheus",
            Command::new(bin)
                .arg(format!(
                    "--config.file={}",
                    dir.0.join("prometheus.yml").display()
                ))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.0.join("data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdout(log.try_clone().unwrap())
                .stderr(log),
        );
        let start = Instant::now();
        loop {
            assert!(
                proc.is_running(),
                "prometheus exited:\n{}",
                std::fs::read_to_string(dir.0.join("prometheus.log")).unwrap_or_default()
            );
            let ready = agent()
                .get(&format!("http://127.0.0.1:{port}/-/ready"))
                .call()
                .map(|r| r.status() == 200)
                .unwrap_or(false);
            if ready {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "prometheus not ready in 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Prometheus { port, proc, dir }
    }

    fn api(&self, path: &str, params: &[(&str, &str)]) -> Value {
        let mut req = agent().get(&format!("http://127.0.0.1:{}/api/v1/{path}", self.port));
        for (k, v) in params {
            req = req.query(k, v);
        }
        let body: Value = match req.call() {
            Ok(r) => serde_json::from_str(&r.into_string().unwrap()).unwrap(),
            Err(ureq::Error::Status(code, r)) => {
                panic!("{path} {params:?}: {code} {}", r.into_string().unwrap())
            }
            Err(e) => panic!("{path}: {e}"),
        };
        assert_eq!(body["status"], "success", "{path} {params:?}: {body}");
        body["data"].clone()
    }

    /// An instant query's series (it must be a vector).
    fn query(&self, expr: &str) -> Vec<Value> {
        let data = self.api("query", &[("query", expr)]);
        assert_eq!(data["resultType"], "vector", "{expr}: {data}");
        data["result"].as_array().unwrap().clone()
    }

    /// The one value of a query summed to one series (None: no series).
    fn scalar(&self, expr: &str) -> Option<f64> {
        let r = self.query(expr);
        assert!(r.len() <= 1, "{expr}: {r:?}");
        r.first().map(value)
    }

    /// The state (`pending`, `firing`) of the alert `name`, if active.
    fn alert_state(&self, name: &str) -> Option<String> {
        self.api("alerts", &[])["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["labels"]["alertname"] == name)
            .map(|a| a["state"].as_str().unwrap().to_string())
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("prometheus.log")).unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.proc.kill();
    }
}

fn value(series: &Value) -> f64 {
    series["value"][1].as_str().unwrap().parse().unwrap()
}

/// Waits (bounded) until Prometheus holds the Envoys' current count of
/// `stat` (a filter counter): its scrapes caught up with the traffic.
fn caught_up(prom: &Prometheus, stack: &Stack, stat: &str) {
    let name = format!("redis_guard_{}", stat.replace('.', "_"));
    let mut last = (0.0, None);
    let caught = poll_every_until(Duration::from_secs(20), Duration::from_millis(200), || {
        // The Envoy's count is read again each time: a call may still land.
        let want = stack.counter(&format!("redis_guard.{stat}")) as f64;
        last = (want, prom.scalar(&format!("sum({name})")));
        last.1 == Some(want)
    });
    assert!(
        caught,
        "prometheus never caught up with {name}: Envoy {}, Prometheus {:?}",
        last.0, last.1
    );
}

/// Calls `check` every `every` until it holds, for at most `limit`.
fn poll_every_until(limit: Duration, every: Duration, mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if check() {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(every);
    }
}

/// Every rule loaded, none with an evaluation error.
fn assert_rules_healthy(prom: &Prometheus, rules: &str) {
    let groups = prom.api("rules", &[]);
    let loaded: Vec<&Value> = groups["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .collect();
    assert_eq!(loaded.len(), alert_exprs(rules).len(), "{groups}");
    for r in loaded {
        assert_eq!(r["health"], "ok", "{r}\n{}", prom.log());
    }
}

fn llm_chat(e: &Envoy, user: &str, extra: &[(&str, &str)]) -> Resp {
    let mut headers = vec![
        ("x-user", user),
        ("x-upstream-llm", "openai-json"),
        ("x-upstream-tokens", "10,20"),
    ];
    headers.extend_from_slice(extra);
    http(
        "POST",
        &e.url("/v1/chat/completions"),
        &headers,
        Some(b"{}"),
    )
}

const LIMITS: &str = r#"[
    {"name": "burst", "match": {"pathPrefix": "/api/"}, "descriptor": [{"header": "x-user"}],
     "tokenBucket": {"capacity": 5, "refill": 1, "periodMs": 600000}},
    {"name": "wide", "match": {"pathPrefix": "/wide/"}, "descriptor": [{"header": "x-user"}],
     "tokenBucket": {"capacity": 100000, "refill": 1, "periodMs": 600000}},
    {"name": "chat", "match": {"pathPrefix": "/v1/chat"}, "descriptor": [{"header": "x-user"}],
     "tokenBucket": {"capacity": 100000, "refill": 1, "periodMs": 600000},
     "usage": {"reserve": 10,
               "json": [{"pointer": "/usage/prompt_tokens"}, {"pointer": "/usage/completion_tokens"}]}}
  ]"#;
const IDEMPOTENCY: &str = r#"[{"name": "pay", "match": {"pathPrefix": "/pay"}}]"#;

/// The Envoy flushes its stats (the histograms) every second.
fn stack(config: &str) -> Stack {
    Stack::start_edited(config, 1, |yaml| {
        format!("stats_flush_interval: 1s\n{yaml}")
    })
}

/// Waits until Prometheus scraped the Envoy once (its series at 0), so the
/// rates that follow see the traffic from its start.
fn first_scrape(prom: &Prometheus) {
    poll_every(
        "prometheus' first scrape of the Envoy",
        Duration::from_secs(20),
        Duration::from_millis(200),
        || (!prom.query("redis_guard_redis_calls").is_empty()).then_some(()),
    );
}

#[test]
fn every_dashboard_query_and_alert_expression_returns_series_under_traffic() {
    const TIMEOUT_MS: u64 = 1000;
    // One call out per worker: concurrent requests queue and go in batches.
    let config = filter_config(TIMEOUT_MS)
        .failure_mode("allow")
        .batch(r#"{"maxInFlight": 1}"#)
        .limits(LIMITS)
        .idempotency(IDEMPOTENCY)
        .build();
    let stack = stack(&config);
    let e = stack.envoy();
    let rules = rules(TIMEOUT_MS);
    let prom = Prometheus::start(&[e.admin_port], &rules);
    first_scrape(&prom);

    // Admitted in batches: 8 clients at once on one key.
    let jobs: Vec<usize> = (0..160).collect();
    let codes = run_jobs(&jobs, 8, Duration::from_secs(60), agent, |a, _, _| {
        http_with(a, "GET", &e.url("/wide/x"), &[("x-user", "w")], None).status
    });
    assert!(codes.iter().all(|c| *c == 200), "{codes:?}");
    // Limit burst: 5 admitted, 25 refused (most from the over-limit cache).
    let codes: Vec<u16> = (0..30)
        .map(|_| get(&e.url("/api/orders"), &[("x-user", "a")]).status)
        .collect();
    assert_eq!(codes.iter().filter(|c| **c == 429).count(), 25, "{codes:?}");
    // Keyed: stored, replayed, mismatched.
    let pay = |body: &[u8]| {
        http(
            "POST",
            &e.url("/pay"),
            &[("idempotency-key", "k1")],
            Some(body),
        )
    };
    assert_eq!(pay(b"a").status, 200);
    assert_eq!(pay(b"a").header("idempotent-replayed"), Some("true"));
    assert_eq!(pay(b"b").status, 422);
    // Usage: 30 tokens, 20 beyond the reserve.
    assert_eq!(llm_chat(e, "u", &[]).status, 200);
    poll_eq("the settlement sent", 20, Duration::from_secs(5), || {
        stack.counter("redis_guard.usage.charged_units")
    });
    assert!(
        stack.counter("redis_guard.batch.calls") > 0,
        "no batch formed: the batch panels would have nothing to show"
    );

    for stat in [
        "redis.calls",
        "batch.calls",
        "usage.charged_units",
        "idempotency.replayed",
    ] {
        caught_up(&prom, &stack, stat);
    }
    // The histograms too (merged on Envoy's stats flush).
    poll_every(
        "prometheus scraping the batch-size histogram",
        Duration::from_secs(20),
        Duration::from_millis(200),
        || {
            let got = prom.scalar("sum(redis_guard_batch_size_count)");
            (got == Some(stack.counter("redis_guard.batch.calls") as f64)).then_some(())
        },
    );

    let queries = dashboard_queries();
    assert!(queries.len() >= 40, "{} queries", queries.len());
    for (panel, expr) in &queries {
        let series = prom.query(expr);
        assert!(!series.is_empty(), "panel {panel:?}: no series for {expr}");
        assert!(
            series.iter().any(|s| value(s).is_finite()),
            "panel {panel:?}: no finite value for {expr}: {series:?}"
        );
    }
    // The dashboard's variable lists the Envoy: its own query, as Grafana
    // sends `label_values(metric, label)` to Prometheus.
    let var = dashboard_variable();
    let values = prom.api(
        &format!("label/{}/values", var.label),
        &[("match[]", &var.metric)],
    );
    assert_eq!(
        values,
        serde_json::json!([format!("127.0.0.1:{}", e.admin_port)]),
        "label_values({}, {})",
        var.metric,
        var.label
    );

    assert_rules_healthy(&prom, &rules);
    for (alert, expr) in alert_exprs(&rules) {
        for name in metric_names(&expr) {
            let selector = if name.ends_with("_bucket") {
                name.clone()
            } else {
                format!("{name}{{job=\"envoy\"}}")
            };
            assert!(
                !prom.query(&selector).is_empty(),
                "{alert}: no series {name} in Prometheus"
            );
        }
        let series = prom.query(&expr);
        if alert == "RedisGuardOverLimitRatioHigh" {
            // Only burst refused most of what it saw (25 of 30).
            assert_eq!(series.len(), 1, "{series:?}");
            assert_eq!(
                series[0]["metric"],
                serde_json::json!({"job": "envoy", "limit": "burst"})
            );
            let ratio = value(&series[0]);
            assert!((ratio - 25.0 / 30.0).abs() < 1e-9, "{ratio}");
        } else {
            assert!(series.is_empty(), "{alert} holds while healthy: {series:?}");
        }
    }
}

#[test]
fn redis_down_fires_the_unreachable_alert_and_every_alert_expression_holds() {
    const TIMEOUT_MS: u64 = 200;
    // A store that meets a dead Redis is delivered until the lock's TTL
    // passes, then counted failed: a 2 s lock (above the upstream's 1.5 s)
    // so the count comes within the poll below.
    let config = filter_config(TIMEOUT_MS)
        .circuit_breaker(3, 1000)
        .limits(LIMITS)
        .idempotency(r#"[{"name": "pay", "match": {"pathPrefix": "/pay"}, "lockTtlMs": 2000}]"#)
        .build();
    let mut stack = stack(&config);
    let rules = rules(TIMEOUT_MS);
    let prom = Prometheus::start(&[stack.envoy().admin_port], &rules);
    first_scrape(&prom);
    // Disjoint borrows: Redis is stopped while the rest is in use.
    let e = &stack.envoys[0];
    let upstream = &stack.upstream;
    let redis = &mut stack.redis;

    // Healthy: limit burst refuses 25 of 30.
    let refused = (0..30)
        .filter(|_| get(&e.url("/api/orders"), &[("x-user", "a")]).status == 429)
        .count();
    assert_eq!(refused, 25);

    let stop = AtomicBool::new(false);
    let (t_down, denied) = std::thread::scope(|s| {
        // A keyed request and a usage request the upstream holds while
        // Redis goes: the record and the settlement that follow fail.
        let keyed = s.spawn(|| {
            http(
                "POST",
                &e.url("/pay"),
                &[("idempotency-key", "slow"), ("x-upstream-delay-ms", "1500")],
                Some(b"x"),
            )
            .status
        });
        let usage = s.spawn(|| llm_chat(e, "v", &[("x-upstream-delay-ms", "1500")]).status);
        poll(
            "both requests at the upstream",
            Duration::from_secs(10),
            || {
                (upstream.in_flight("/pay") == 1 && upstream.in_flight("/v1/chat/completions") == 1)
                    .then_some(())
            },
        );
        // Redis stalls: calls time out at timeoutMs (slow callouts), the
        // breaker opens; traffic (deny) goes on, paced, bounded.
        let stalled_at = unix_now();
        redis.freeze(true);
        let t_down = Instant::now();
        let stop = &stop;
        let traffic = s.spawn(move || {
            let agent = agent();
            let mut denied = 0;
            for _ in 0..3000 {
                if stop.load(Ordering::SeqCst) || t_down.elapsed() > Duration::from_secs(90) {
                    break;
                }
                let r = http_with(&agent, "GET", &e.url("/wide/x"), &[("x-user", "w")], None);
                denied += usize::from(r.status == 503);
                std::thread::sleep(Duration::from_millis(20));
            }
            denied
        });
        assert_eq!(keyed.join().unwrap(), 200, "the response goes out");
        assert_eq!(usage.join().unwrap(), 200, "the stream completes");
        poll(
            "the record and the settlement failed",
            Duration::from_secs(10),
            || {
                (e.counter("redis_guard.idempotency.store_failed") == 1
                    && e.counter("redis_guard.usage.lost") == 1)
                    .then_some(())
            },
        );
        // Then Redis dies (SIGKILL; a stopped process dies as well).
        redis.stop();

        // Pending, then firing. Every instant judged below is Prometheus'
        // own (its samples' timestamps), so how fast this test gets its turn
        // on a loaded machine does not enter.
        poll_every(
            "RedisGuardRedisUnreachable firing",
            Duration::from_secs(60),
            Duration::from_millis(100),
            || {
                let state = prom.alert_state("RedisGuardRedisUnreachable");
                (state.as_deref() == Some("firing")).then_some(())
            },
        );
        // The evaluations that found it pending, then firing: the first
        // sample of each state in ALERTS (ALERTS_FOR_STATE holds activeAt
        // in whole seconds only).
        let since = unix_now() - stalled_at + 10.0;
        let first_in = |state: &str| {
            let selector = format!(
                "ALERTS{{alertname=\"RedisGuardRedisUnreachable\",alertstate=\"{state}\"}}"
            );
            let got = samples(&prom, &selector, since);
            got.first().unwrap_or_else(|| panic!("no {state} sample")).0
        };
        let (active_at, fired_at) = (first_in("pending"), first_in("firing"));
        let pending_to_firing = fired_at - active_at;
        let (hold, interval) = (UNREACHABLE_FOR.as_secs_f64(), INTERVAL.as_secs_f64());
        eprintln!(
            "RedisGuardRedisUnreachable: pending {:.1} s after Redis stalled, firing \
             {pending_to_firing:.2} s later",
            active_at - stalled_at
        );
        // `for`, then the evaluation that finds it over (a skipped one at most).
        assert!(
            hold - 1e-3 <= pending_to_firing && pending_to_firing <= hold + 2.0 * interval,
            "firing {pending_to_firing:.2} s after pending, not within `for` ({hold} s) \
             + 2 evaluations"
        );
        // When it turned pending, against the failure-mode answers each
        // scrape counted. Not before the first scrape that had one; and once
        // a scrape had 7 more than before the stall, the expression held (a
        // rate over a minute of at least 7/60 > 0.1 a second; its errors
        // come with or before the answers: a request is denied after its call
        // failed, or once the breaker they opened is open): pending at the
        // next evaluation after that scrape was in, within two intervals.
        let denied = samples(&prom, "redis_guard_failure_mode_denied", since);
        let before = denied
            .iter()
            .take_while(|(t, _)| *t <= stalled_at)
            .last()
            .unwrap_or_else(|| panic!("no scrape before the stall: {denied:?}"))
            .1;
        let first_with = |n: f64| {
            denied
                .iter()
                .find(|(_, v)| *v >= before + n)
                .unwrap_or_else(|| panic!("no scrape with {n} denied: {denied:?}"))
                .0
        };
        let (one, seven) = (first_with(1.0), first_with(7.0));
        assert!(
            one <= active_at && active_at <= seven + 2.0 * interval,
            "pending at {active_at}: the first denial scraped at {one}, the 7th at {seven} \
             ({denied:?})"
        );

        // Now every rule's condition holds: failure-mode answers, the open
        // breaker, slow callouts at timeoutMs, the failed record, the lost
        // settlement and limit burst's refusals.
        assert_rules_healthy(&prom, &rules);
        for (alert, expr) in alert_exprs(&rules) {
            poll_every(
                &format!("{alert}'s expression holding"),
                Duration::from_secs(10),
                Duration::from_millis(200),
                || (!prom.query(&expr).is_empty()).then_some(()),
            );
        }
        stop.store(true, Ordering::SeqCst);
        (t_down, traffic.join().unwrap())
    });
    assert!(
        denied > 0,
        "no failure-mode answer in {:?}",
        t_down.elapsed()
    );
}

/// The samples of `selector` in the last `secs` seconds, summed over its
/// series at each timestamp (one Envoy: its series share their scrapes), as
/// (unix time, value), oldest first.
fn samples(prom: &Prometheus, selector: &str, secs: f64) -> Vec<(f64, f64)> {
    let data = prom.api(
        "query",
        &[("query", &format!("{selector}[{}s]", secs.ceil()))],
    );
    assert_eq!(data["resultType"], "matrix", "{selector}: {data}");
    let mut sum = std::collections::BTreeMap::<i64, f64>::new();
    for series in data["result"].as_array().unwrap() {
        for point in series["values"].as_array().unwrap() {
            let at = (point[0].as_f64().unwrap() * 1000.0).round() as i64;
            *sum.entry(at).or_default() += point[1].as_str().unwrap().parse::<f64>().unwrap();
        }
    }
    sum.into_iter()
        .map(|(ms, v)| (ms as f64 / 1000.0, v))
        .collect()
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}
