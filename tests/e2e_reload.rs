//! Live configuration reloads (issue 30): the filter's configuration
//! delivered by ECDS (`config_discovery` with a file-based
//! `path_config_source`, the file replaced atomically), as istiod delivers a
//! WasmPlugin update, every 2 s for 20 s while two Envoys take traffic with
//! batching on, a batch of each Envoy out at every reload. No request goes
//! unanswered or takes the failure mode, a limit whose parameters did not
//! change keeps counting in its one key (exactly), and no concurrency slot
//! or idempotency lock is left behind.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use redis_guard::scripts::BATCH;
use support::*;

const PERIOD_MS: i64 = 3_600_000;
const CAPACITY: i64 = 1_000_000;
const RELOADS: u64 = 10;
/// The name of the ECDS resource and of the filter that takes it.
const NAME: &str = "redis_guard_ecds";
/// How long a gate waits for a batch call to hold (nothing is held
/// meanwhile: batches go out only while a call of the worker is out, which
/// this load does not keep up all the time).
const BATCH_LIMIT: Duration = Duration::from_secs(20);
/// How long a held batch waits for its Envoy to take the reload: within the
/// client's own timeout (support::agent, 15 s) and the filter's.
const RELOAD_LIMIT: Duration = Duration::from_secs(5);
/// `timeoutMs` (a reload changes it by one): twice as long as a batch may
/// be held at a reload, so none is held into its timeout.
const TIMEOUT_MS: u64 = 10_000;
/// The concurrency lease: at least four times the timeout, as the filter
/// requires.
const LEASE_MS: u64 = 4 * (TIMEOUT_MS + 1);

/// A token bucket and a concurrency limit per x-user on /r, an idempotency
/// rule on /pay; `timeout_ms` is what each reload changes.
fn config(timeout_ms: u64) -> String {
    filter_config(timeout_ms)
        // One call out per worker and hash tag: what arrives meanwhile
        // queues into the next batch, so batches are out at every reload.
        .batch(r#"{"maxInFlight":1}"#)
        .limits(&format!(
            r#"[{{"name":"bucket","match":{{"pathPrefix":"/"}},"descriptor":[{{"header":"x-user"}}],
               "failureMode":"deny",
               "tokenBucket":{{"capacity":{CAPACITY},"refill":1,"periodMs":{PERIOD_MS}}}}},
               {{"name":"inflight","match":{{"pathPrefix":"/r"}},"descriptor":[{{"header":"x-user"}}],
               "failureMode":"deny","concurrency":{{"max":1000,"leaseMs":{LEASE_MS}}}}}]"#
        ))
        .idempotency(
            r#"[{"name":"pay","match":{"pathPrefix":"/pay"},
                "tenant":[{"header":"x-tenant"}],"lockTtlMs":60000}]"#,
        )
        .build()
}

/// The rendered envoy.yaml with the filter taken from ECDS (a file in
/// `dir`); writes that file with the filter's block as rendered.
fn via_ecds(yaml: String, dir: &Path) -> String {
    let start = yaml
        .find("          - name: envoy.filters.http.wasm\n")
        .expect("the wasm filter");
    let end = yaml[start..]
        .find("          - name: envoy.filters.http.router\n")
        .map(|i| start + i)
        .expect("the router after it");
    let block = &yaml[start..end];
    // The block's typed_config, re-indented as the resource's.
    let typed: Vec<String> = block
        .lines()
        .skip_while(|l| l.trim() != "typed_config:")
        .skip(1)
        .map(|l| {
            format!(
                "    {}",
                l.strip_prefix("              ").unwrap_or(l.trim_start())
            )
        })
        .collect();
    let resource = format!(
        "resources:\n- \"@type\": type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig\n  \
         name: {NAME}\n  typed_config:\n{}\n",
        typed.join("\n")
    );
    std::fs::write(dir.join("template.yaml"), &resource).unwrap();
    replace_file(dir, &resource);
    let discovered = format!(
        "          - name: {NAME}\n            config_discovery:\n              config_source:\n                \
         path_config_source:\n                  path: {file}\n                  \
         watched_directory: {{ path: {dir} }}\n              \
         type_urls: [\"type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm\"]\n",
        file = dir.join("ecds.yaml").display(),
        dir = dir.display()
    );
    // A config source needs the node's identity, as istiod's would.
    let node = "node: { id: redis-guard-test, cluster: redis-guard-test }\n";
    format!("{node}{}{discovered}{}", &yaml[..start], &yaml[end..])
}

/// Replaces `dir/ecds.yaml` atomically (written beside it, then renamed:
/// Envoy watches the directory for the move).
fn replace_file(dir: &Path, text: &str) {
    let tmp = dir.join("..").join(format!(
        "{}.ecds.tmp",
        dir.file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join("ecds.yaml")).unwrap();
}

/// The resource with the filter configuration for `timeout_ms`: the
/// template's `value:` line (the configuration as a JSON string) replaced.
fn resource_for(dir: &Path, timeout_ms: u64) -> String {
    let template = std::fs::read_to_string(dir.join("template.yaml")).unwrap();
    let value = serde_json::to_string(&with_test_credentials(&config(timeout_ms))).unwrap();
    template
        .lines()
        .map(|l| match l.find("value: ") {
            Some(i) if l.trim_start().starts_with("value: ") => {
                format!("{}value: {value}", &l[..i])
            }
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// Configurations this Envoy took from the file (the first one included).
fn reloads(e: &Envoy) -> u64 {
    admin_stat(
        e.admin_port,
        &format!("extension_config_discovery.http_filter.{NAME}.config_reload"),
    )
}

fn keys(con: &mut redis::Connection, pattern: &str) -> Vec<String> {
    redis::cmd("KEYS").arg(pattern).query(con).unwrap()
}

/// A stand-in in front of Webdis, one per Envoy, that passes every call on
/// but can hold the batch calls (lua/batch.lua's EVALSHA): once armed, a
/// batch call that arrives waits, unsent to Webdis, until `release`. So a
/// reload can be made while a batch is known to be out: armed, a batch
/// held, the configuration replaced and taken, then the batch let go, to be
/// answered by the root context that sent it.
struct Gate {
    port: u16,
    state: Arc<(Mutex<Held>, Condvar)>,
}

#[derive(Default)]
struct Held {
    armed: bool,
    /// Batch calls waiting now, and held since the gate was armed.
    waiting: usize,
    since_armed: usize,
}

impl Gate {
    fn start(webdis_port: u16) -> Gate {
        let port = free_port();
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let state: Arc<(Mutex<Held>, Condvar)> = Arc::default();
        let shared = Arc::clone(&state);
        let batch = format!("EVALSHA/{}/", BATCH.sha1).into_bytes();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (state, batch) = (Arc::clone(&shared), batch.clone());
                std::thread::spawn(move || Gate::serve(conn, webdis_port, &state, &batch));
            }
        });
        Gate { port, state }
    }

    fn serve(conn: TcpStream, webdis: u16, state: &(Mutex<Held>, Condvar), batch: &[u8]) {
        let mut out = conn.try_clone().unwrap();
        let mut from_envoy = std::io::BufReader::new(conn);
        let mut to_webdis: Option<(TcpStream, std::io::BufReader<TcpStream>)> = None;
        while let Some(request) = probe::read_message(&mut from_envoy) {
            if request.windows(batch.len()).any(|w| w == batch) {
                let (lock, cv) = state;
                let mut held = lock.lock().unwrap();
                if held.armed {
                    held.waiting += 1;
                    held.since_armed += 1;
                    cv.notify_all();
                    while held.armed {
                        held = cv.wait(held).unwrap();
                    }
                    held.waiting -= 1;
                }
            }
            let (w, r) = to_webdis.get_or_insert_with(|| {
                let s = TcpStream::connect(("127.0.0.1", webdis)).unwrap();
                (s.try_clone().unwrap(), std::io::BufReader::new(s))
            });
            w.write_all(&request).unwrap();
            let reply = probe::read_message(r).expect("webdis closed the connection");
            if out.write_all(&reply).is_err() {
                return;
            }
        }
    }

    /// Holds the batch calls that arrive from now on, and waits (bounded)
    /// until one is held.
    fn hold_a_batch(&self) {
        let (lock, cv) = &*self.state;
        let mut held = lock.lock().unwrap();
        held.armed = true;
        held.since_armed = 0;
        let (held, timeout) = cv
            .wait_timeout_while(held, BATCH_LIMIT, |h| h.waiting == 0)
            .unwrap();
        assert!(
            !timeout.timed_out(),
            "no batch call within {BATCH_LIMIT:?} ({} held)",
            held.since_armed
        );
    }

    /// Lets every held call go; returns how many batch calls were held
    /// since the gate was armed.
    fn release(&self) -> usize {
        let (lock, cv) = &*self.state;
        let mut held = lock.lock().unwrap();
        held.armed = false;
        cv.notify_all();
        held.since_armed
    }
}

/// Sets its flag when dropped, a panic's unwinding included.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn ecds_reloads_every_two_seconds_under_load_leave_no_request_unanswered_and_nothing_held() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let dirs: Vec<Scratch> = (0..2).map(|_| Scratch::new("ecds")).collect();
    let gates: Vec<Gate> = (0..2).map(|_| Gate::start(webdis.port)).collect();
    let envoys: Vec<Envoy> = dirs
        .iter()
        .zip(&gates)
        .map(|(d, g)| {
            Envoy::start_edited(&config(TIMEOUT_MS), g.port, upstream.port, |y| {
                via_ecds(y, &d.0)
            })
        })
        .collect();
    for e in &envoys {
        let r = get(&e.url("/r"), &[("x-user", "warm")]);
        assert_eq!(r.status, 200, "the ECDS-delivered filter runs");
    }

    let base: Vec<u64> = envoys.iter().map(reloads).collect();
    let done = AtomicBool::new(false);
    let statuses = std::thread::scope(|s| {
        let reloader = s.spawn(|| {
            // The load stops when the reloads are over, or have failed.
            let _stop = StopOnDrop(&done);
            let mut held = Vec::new();
            let mut longest = Duration::ZERO;
            for k in 1..=RELOADS {
                // Pacing of the reloads, as istiod pushes them: nothing
                // waits on this sleep.
                std::thread::sleep(Duration::from_secs(2));
                // Each Envoy's reload is taken while one of its batch calls
                // is out: sent under the old configuration, answered after
                // the new one was taken.
                let mut at_reload = Vec::new();
                for (((e, d), b), g) in envoys.iter().zip(&dirs).zip(&base).zip(&gates) {
                    g.hold_a_batch();
                    let t = std::time::Instant::now();
                    replace_file(&d.0, &resource_for(&d.0, TIMEOUT_MS + k % 2));
                    let what = format!("reload {k} taken, once");
                    probe::poll_eq(&what, b + k, RELOAD_LIMIT, || reloads(e));
                    at_reload.push(g.release());
                    longest = longest.max(t.elapsed());
                }
                held.push(at_reload);
            }
            (held, longest)
        });
        let jobs: Vec<usize> = (0..100_000).collect();
        let out = run_jobs(&jobs, 16, Duration::from_secs(120), agent, |agent, i, _| {
            if done.load(Ordering::SeqCst) {
                return None;
            }
            let e = &envoys[i % 2];
            let status = if i % 4 == 0 {
                let key = format!("k-{i}");
                let h = [
                    ("x-user", "u"),
                    ("x-tenant", "t"),
                    ("idempotency-key", key.as_str()),
                ];
                http_with(agent, "POST", &e.url("/pay"), &h, Some(b"{}")).status
            } else {
                http_with(agent, "GET", &e.url("/r"), &[("x-user", "u")], None).status
            };
            // Pacing, not synchronisation: at most ~200 requests a second
            // per client.
            std::thread::sleep(Duration::from_millis(5));
            Some(status)
        });
        (out, reloader.join().unwrap())
    });
    let (statuses, (held, longest)) = statuses;
    let answered: Vec<u16> = statuses.into_iter().flatten().collect();
    let batch_calls: u64 = envoys
        .iter()
        .map(|e| e.counter("redis_guard.batch.calls"))
        .sum();
    eprintln!(
        "{} requests across {RELOADS} reloads per Envoy, {batch_calls} batch calls; batch calls \
         out at each reload, per Envoy: {held:?} (held until the reload was taken: {longest:?} \
         at most)",
        answered.len()
    );
    // Batches were out at every reload of each Envoy (every one of them
    // answered: the 200s below), and the gate held only batch calls the
    // filter counted as such.
    assert_eq!(held.len() as u64, RELOADS);
    assert!(
        held.iter()
            .all(|r| r.len() == 2 && r.iter().all(|n| *n >= 1)),
        "a reload with no batch out: {held:?}"
    );
    assert!(held.iter().flatten().sum::<usize>() as u64 <= batch_calls);
    let others: Vec<&u16> = answered.iter().filter(|s| **s != 200).collect();
    assert!(
        others.is_empty(),
        "every request answered 200 across {RELOADS} reloads: {} of {} were not: {others:?}",
        others.len(),
        answered.len()
    );
    assert!(!answered.is_empty(), "the load ran alongside the reloads");
    let admitted = answered.len() as i64;
    let mut con = redis.conn();
    // The bucket did not change: one key across every reload, charged once
    // per admitted request (the warm-up requests are x-user "warm").
    let buckets = keys(&mut con, "*:bucket:*:1:u");
    assert_eq!(buckets.len(), 1, "{buckets:?}");
    let left = read_bucket(&mut con, &buckets[0]).unwrap().0 / PERIOD_MS;
    assert_eq!(CAPACITY - left, admitted);
    assert_eq!(upstream.executed(), admitted as u64 + 2);
    // Nothing held: every slot released, every record completed.
    let locks_in_progress = |con: &mut redis::Connection| {
        keys(con, "*:idem:*")
            .iter()
            .filter(|k| {
                let s: Option<String> = redis::cmd("HGET").arg(k).arg("s").query(con).unwrap();
                s.as_deref() != Some("C")
            })
            .count()
    };
    probe::poll_eq(
        "slots and locks held after the load",
        (0, 0),
        Duration::from_secs(10),
        || {
            (
                slots_held(&mut con, "inflight"),
                locks_in_progress(&mut con),
            )
        },
    );
    for (e, b) in envoys.iter().zip(&base) {
        assert_eq!(e.counter("redis_guard.redis.errors"), 0);
        assert_eq!(reloads(e), b + RELOADS);
    }
}
