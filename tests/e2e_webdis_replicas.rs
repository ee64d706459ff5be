//! Two Webdis behind the `webdis` cluster, one of them SIGKILLed under
//! load (issue 30): a call that never reached a Webdis (connection refused)
//! is certain not to have run a script, so the filter sends it again and
//! Envoy picks the other Webdis (envoy.yaml's outlier detection ejects the
//! dead one). Only the calls in flight on the killed Webdis take the failure
//! mode; admissions stay exact.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use support::*;

const PERIOD_MS: i64 = 3_600_000;
const CAPACITY: i64 = 100_000;
const THREADS: usize = 8;
const PER_THREAD: usize = 100;
/// The kill comes when this many requests have started.
const KILL_AT: usize = 200;

/// A token bucket far larger than the load, failure mode deny: every
/// request Redis decides is admitted, and one Redis could not decide is a
/// 503.
fn config() -> String {
    filter_config(2000)
        .limits(&format!(
            r#"[{{"name":"per-user","match":{{"pathPrefix":"/r"}},"descriptor":[{{"header":"x-user"}}],
               "failureMode":"deny",
               "tokenBucket":{{"capacity":{CAPACITY},"refill":1,"periodMs":{PERIOD_MS}}}}}]"#
        ))
        .build()
}

/// The rendered envoy.yaml with a second endpoint in the webdis cluster.
fn with_second_webdis(yaml: String, first: u16, second: u16) -> String {
    let line = format!("socket_address: {{ address: 127.0.0.1, port_value: {first} }}");
    assert_eq!(yaml.matches(&line).count(), 1, "one endpoint on :{first}");
    yaml.replace(
        &line,
        &format!(
            "{line}\n        - endpoint:\n            address:\n              \
             socket_address: {{ address: 127.0.0.1, port_value: {second} }}"
        ),
    )
}

/// Whether Envoy holds no open connection to the Webdis on `port` (its
/// admin's /clusters: `webdis::127.0.0.1:<port>::cx_active::0`).
fn connections_closed(e: &Envoy, port: u16) -> bool {
    let url = format!("http://127.0.0.1:{}/clusters", e.admin_port);
    let text = String::from_utf8_lossy(&get(&url, &[]).body).to_string();
    let want = format!("webdis::127.0.0.1:{port}::cx_active::0");
    text.lines().any(|l| l == want)
}

#[test]
fn a_killed_webdis_fails_only_its_calls_in_flight_and_the_rest_are_decided_through_the_other() {
    let redis = Redis::start();
    let mut a = Webdis::start(redis.port);
    let b = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let (pa, pb) = (a.port, b.port);
    let envoys: Vec<Envoy> = (0..2)
        .map(|_| {
            Envoy::start_edited(&config(), pa, upstream.port, |y| {
                with_second_webdis(y, pa, pb)
            })
        })
        .collect();

    let started = AtomicUsize::new(0);
    let killed = AtomicBool::new(false);
    let killer = Mutex::new(Some(&mut a));
    let jobs: Vec<usize> = (0..THREADS * PER_THREAD).collect();
    // ~200 requests a second: 8 clients, each pausing 40 ms between its
    // requests (pacing, not synchronisation: nothing waits on a state).
    let answers = run_jobs(
        &jobs,
        THREADS,
        Duration::from_secs(120),
        agent,
        |agent, i, _| {
            let n = started.fetch_add(1, Ordering::SeqCst);
            if n == KILL_AT {
                if let Some(w) = killer.lock().unwrap().take() {
                    w.stop();
                }
                // Requests after the kill start once every Envoy has seen
                // its connections to the dead Webdis close: a call written
                // on a connection Envoy has not yet seen closed may have
                // been sent, and is rightly not sent again.
                for e in &envoys {
                    let what = format!("Envoy's connections to :{pa} closed");
                    probe::poll(&what, Duration::from_secs(10), || {
                        connections_closed(e, pa).then_some(())
                    });
                }
                killed.store(true, Ordering::SeqCst);
            } else if n > KILL_AT {
                // Requests numbered after the kill start after it.
                probe::poll("the kill", Duration::from_secs(10), || {
                    killed.load(Ordering::SeqCst).then_some(())
                });
            }
            let e = &envoys[i % 2];
            let status = http_with(agent, "GET", &e.url("/r"), &[("x-user", "u")], None).status;
            std::thread::sleep(Duration::from_millis(40));
            (n, status)
        },
    );
    let failed: Vec<usize> = answers
        .iter()
        .filter(|(_, s)| *s != 200)
        .map(|(n, _)| *n)
        .collect();
    let others: Vec<u16> = answers
        .iter()
        .map(|(_, s)| *s)
        .filter(|s| *s != 200 && *s != 503)
        .collect();
    assert!(
        others.is_empty(),
        "200 or the failure mode's 503: {others:?}"
    );
    eprintln!(
        "failure-mode answers: {} (requests {failed:?})",
        failed.len()
    );
    // Only calls in flight at the kill may fail: requests that started
    // before it (at most one per other client). Every request that started
    // after it, and met the dead Webdis, was sent again to the other.
    assert!(
        failed.iter().all(|n| *n < KILL_AT),
        "requests that started after the kill got the failure mode: {failed:?}"
    );
    assert!(failed.len() < THREADS, "{failed:?}");
    let admitted = answers.iter().filter(|(_, s)| *s == 200).count() as i64;
    assert_eq!(upstream.executions_of("/r") as i64, admitted);
    let mut con = redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*per-user*")
        .query(&mut con)
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let left = read_bucket(&mut con, &keys[0]).unwrap().0 / PERIOD_MS;
    // A call lost mid-flight may have run its script: its token is spent
    // though the request got the failure mode.
    let spent = CAPACITY - left;
    assert!(
        (admitted..=admitted + failed.len() as i64).contains(&spent),
        "{spent} tokens spent for {admitted} admitted and {} failed",
        failed.len()
    );
    let retried: u64 = envoys
        .iter()
        .map(|e| e.counter("redis_guard.redis.retries"))
        .sum();
    eprintln!("calls sent again after a refused connection: {retried}");
}
