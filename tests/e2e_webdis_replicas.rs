//! Two Webdis behind the `webdis` cluster, one of them SIGKILLed under
//! load (issue 30): a call that never reached a Webdis (connection refused)
//! is certain not to have run a script, so the filter sends it again and
//! Envoy picks the other Webdis (envoy.yaml's outlier detection ejects the
//! dead one). Only the calls in flight on the killed Webdis take the failure
//! mode; admissions stay exact.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

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

/// One request of the load: which client sent it, when (from the test's
/// start) it left and was answered, and the answer.
#[derive(Debug, Clone, Copy)]
struct Sent {
    n: usize,
    client: usize,
    sent: Duration,
    done: Duration,
    status: u16,
}

/// Calls of the webdis cluster that Envoy failed before they were written
/// to any Webdis (a connect refused, or a connection that died before the
/// call was put on it): the calls the filter must send again.
fn refused_before_sent(e: &Envoy) -> u64 {
    admin_stat(
        e.admin_port,
        "cluster.webdis.upstream_rq_pending_failure_eject",
    )
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

    let t0 = Instant::now();
    let started = AtomicUsize::new(0);
    let clients = AtomicUsize::new(0);
    // When the SIGKILL went, and when the process was gone (reaped).
    let kill: Mutex<Option<(Duration, Duration)>> = Mutex::new(None);
    let killed = AtomicBool::new(false);
    let killer = Mutex::new(Some(&mut a));
    let jobs: Vec<usize> = (0..THREADS * PER_THREAD).collect();
    // ~200 requests a second: 8 clients, each pausing 40 ms between its
    // requests (pacing, not synchronisation: nothing waits on a state).
    let log = run_jobs(
        &jobs,
        THREADS,
        Duration::from_secs(120),
        || (agent(), clients.fetch_add(1, Ordering::SeqCst)),
        |(agent, client), i, _| {
            let n = started.fetch_add(1, Ordering::SeqCst);
            if n == KILL_AT {
                if let Some(w) = killer.lock().unwrap().take() {
                    let at = t0.elapsed();
                    w.stop();
                    *kill.lock().unwrap() = Some((at, t0.elapsed()));
                }
                killed.store(true, Ordering::SeqCst);
            } else if n > KILL_AT {
                // Requests numbered after the kill start once the killed
                // Webdis is gone, and no later: whatever Envoy has or has
                // not yet noticed of it is what "after the kill" meets.
                probe::poll("the kill", Duration::from_secs(10), || {
                    killed.load(Ordering::SeqCst).then_some(())
                });
            }
            let e = &envoys[i % 2];
            let sent = t0.elapsed();
            let status = http_with(agent, "GET", &e.url("/r"), &[("x-user", "u")], None).status;
            let done = t0.elapsed();
            std::thread::sleep(Duration::from_millis(40));
            Sent {
                n,
                client: *client,
                sent,
                done,
                status,
            }
        },
    );
    let (kill_sent, kill_done) = kill.into_inner().unwrap().expect("the kill happened");
    let others: Vec<u16> = log
        .iter()
        .map(|r| r.status)
        .filter(|s| *s != 200 && *s != 503)
        .collect();
    assert!(
        others.is_empty(),
        "200 or the failure mode's 503: {others:?}"
    );
    let failed: Vec<Sent> = log.iter().filter(|r| r.status != 200).copied().collect();
    let retried: Vec<u64> = envoys
        .iter()
        .map(|e| e.counter("redis_guard.redis.retries"))
        .collect();
    let refused: Vec<u64> = envoys.iter().map(refused_before_sent).collect();
    eprintln!(
        "killed {} ms after the start (gone {} ms later); failure-mode answers: {} {failed:?}; \
         calls sent again after a refused connection, per Envoy: {retried:?} (Envoy's calls \
         failed before they were written: {refused:?})",
        kill_sent.as_millis(),
        (kill_done - kill_sent).as_millis(),
        failed.len(),
    );
    // Only calls in flight at the kill may fail: each started before the
    // Webdis was gone and was answered after the signal went. Every request
    // that started after it, and met the dead Webdis, was sent again to
    // the other.
    for r in &failed {
        assert!(
            r.n < KILL_AT && r.sent < kill_done && r.done >= kill_sent,
            "a request not in flight at the kill got the failure mode: {r:?} (kill {kill_sent:?} \
             to {kill_done:?})"
        );
    }
    // A client has one request in flight at a time: at most one failure
    // each.
    let mut per_client: BTreeMap<usize, usize> = BTreeMap::new();
    for r in &failed {
        *per_client.entry(r.client).or_default() += 1;
    }
    assert!(
        per_client.values().all(|n| *n <= 1),
        "more than one failure for a client: {per_client:?} {failed:?}"
    );
    // The dead Webdis was met after the kill, and every call Envoy failed
    // before it was written was sent again, by the filter, once per
    // refusal: on each Envoy the filter's count is Envoy's own.
    assert!(
        retried.iter().sum::<u64>() > 0,
        "no call met the dead Webdis: the test did not test the retry"
    );
    assert_eq!(
        retried, refused,
        "retries per Envoy against Envoy's refusals"
    );
    let admitted = log.iter().filter(|r| r.status == 200).count() as i64;
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
}
