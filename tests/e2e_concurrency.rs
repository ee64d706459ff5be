//! Concurrency limits end to end: real Envoys, Webdis, Redis and a slow
//! upstream that reports how many requests of each path it ran at once. A
//! slot is taken by the request's decision and given back when its response
//! is complete; an Envoy renews the leases of its running requests, so only
//! a dead Envoy's slots, and those of requests whose client left while the
//! upstream worked, wait for their lease to end.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use support::probe::poll;
use support::*;

/// One concurrency limit on /slow, per x-user. The Redis timeout is the
/// longest a lease allows (a renewal must be over before the next, every
/// quarter lease), at most 5 s.
fn config(max: u64, lease_ms: u64) -> String {
    filter_config((lease_ms / 4).min(5000))
        .limits(&format!(
            r#"[{{"name":"slots","match":{{"pathPrefix":"/slow"}},"descriptor":[{{"header":"x-user"}}],
                 "concurrency":{{"max":{max},"leaseMs":{lease_ms}}}}}]"#
        ))
        .build()
}

/// The sorted set of user `user`'s slots.
fn slots_key(con: &mut redis::Connection, user_hint: &str) -> Option<String> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*:slots:cc:*{user_hint}*"))
        .query(con)
        .unwrap();
    keys.into_iter().next()
}

/// Waits (bounded) until Redis holds `n` slots; the release of a stream
/// that ended is sent as it ends, but arrives a moment later.
fn wait_for_slots(con: &mut redis::Connection, n: u64, limit: Duration) {
    support::probe::poll_eq("slots held", n, limit, || slots_held(con, "slots"));
}

/// Sends one GET for `path` on a connection of its own and leaves it open:
/// the request runs until the upstream answers (after `delay_ms`), or until
/// the connection is dropped (the client left).
fn open_request(port: u16, path: &str, user: &str, delay_ms: u64) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let delay = delay_ms.to_string();
    let req = raw_request_bytes(
        "GET",
        path,
        "",
        &[
            ("x-user", user.as_bytes()),
            ("x-upstream-delay-ms", delay.as_bytes()),
        ],
        b"",
    );
    s.write_all(&req).unwrap();
    s
}

/// What the gated upstream has seen: requests arrived, held now, the most
/// held at once, and whether the gate is open.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    arrived: u64,
    held: u64,
    peak: u64,
    open: bool,
}

/// An upstream that answers nothing until the test opens its gate, so an
/// admitted request holds its slot exactly as long as the test says and no
/// longer or shorter, however slow the machine. (Envoy's route gives up on
/// it after 10 s.)
struct Gate {
    port: u16,
    seen: Arc<(Mutex<Seen>, Condvar)>,
}

impl Gate {
    fn start() -> Gate {
        let port = free_port();
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let seen: Arc<(Mutex<Seen>, Condvar)> = Arc::default();
        let shared = Arc::clone(&seen);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let seen = Arc::clone(&shared);
                std::thread::spawn(move || Gate::serve(stream, &seen));
            }
        });
        Gate { port, seen }
    }

    /// One request per connection (a GET: no body), answered once the gate
    /// opens, then the connection closes.
    fn serve(mut stream: TcpStream, seen: &(Mutex<Seen>, Condvar)) {
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let (lock, opened) = seen;
        let mut s = lock.lock().unwrap();
        s.arrived += 1;
        s.held += 1;
        s.peak = s.peak.max(s.held);
        while !s.open {
            s = opened.wait(s).unwrap();
        }
        drop(s);
        let _ = stream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok");
        lock.lock().unwrap().held -= 1;
    }

    fn set_open(&self, open: bool) {
        let (lock, opened) = &*self.seen;
        lock.lock().unwrap().open = open;
        opened.notify_all();
    }

    fn seen(&self) -> Seen {
        *self.seen.0.lock().unwrap()
    }

    /// Closes the gate and forgets the peak (nothing may be held).
    fn close_for_a_new_round(&self) {
        let mut s = self.seen.0.lock().unwrap();
        assert_eq!(s.held, 0, "a request still held");
        s.open = false;
        s.peak = 0;
    }
}

/// Redis, Webdis and `envoys` Envoys whose upstream is a closed [`Gate`].
struct Gated {
    redis: Redis,
    _webdis: Webdis,
    gate: Gate,
    envoys: Vec<Envoy>,
}

impl Gated {
    fn start(cfg: &str, envoys: usize) -> Gated {
        let redis = Redis::start();
        let webdis = Webdis::start(redis.port);
        let gate = Gate::start();
        let envoys = (0..envoys)
            .map(|_| Envoy::start(cfg, webdis.port, gate.port))
            .collect();
        Gated {
            redis,
            _webdis: webdis,
            gate,
            envoys,
        }
    }

    fn counter(&self, name: &str) -> u64 {
        self.envoys.iter().map(|e| e.counter(name)).sum()
    }
}

/// Waits (bounded) until the upstream runs `n` requests of `path`.
fn wait_in_flight(upstream: &Upstream, path: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while upstream.in_flight(path) != n {
        assert!(
            Instant::now() < deadline,
            "upstream never ran {n} of {path}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn two_envoys_under_concurrent_load_let_exactly_max_requests_reach_the_upstream_at_once() {
    let stack = Gated::start(&config(5, 30_000), 2);
    let mut con = stack.redis.conn();
    for round in 0..2 {
        stack.gate.close_for_a_new_round();
        let arrived_before = stack.gate.seen().arrived;
        // The admitted requests are held at the upstream until every one of
        // the 40 has been decided, so all were decided while the admitted
        // held their slots, however slowly they arrived.
        let rejected = AtomicUsize::new(0);
        let jobs: Vec<usize> = (0..40).collect();
        let path = format!("/slow?round={round}");
        let statuses = std::thread::scope(|s| {
            let load = s.spawn(|| {
                run_jobs(&jobs, 40, Duration::from_secs(60), agent, |agent, i, _| {
                    let e = &stack.envoys[i % 2];
                    let status =
                        http_with(agent, "GET", &e.url(&path), &[("x-user", "load")], None).status;
                    if status == 429 {
                        rejected.fetch_add(1, Ordering::SeqCst);
                    }
                    status
                })
            });
            poll("every request decided", Duration::from_secs(60), || {
                let held = stack.gate.seen().held;
                (rejected.load(Ordering::SeqCst) as u64 + held == 40).then_some(())
            });
            stack.gate.set_open(true);
            load.join().unwrap()
        });
        let admitted = statuses.iter().filter(|s| **s == 200).count();
        let rejected = statuses.iter().filter(|s| **s == 429).count();
        assert_eq!((admitted, rejected), (5, 35), "round {round}");
        let seen = stack.gate.seen();
        assert_eq!(seen.arrived - arrived_before, 5, "round {round}");
        assert_eq!(seen.peak, 5, "round {round}");
        // Every slot came back when its request ended: the next round
        // starts from an empty set, long before any lease (30 s) ends.
        wait_for_slots(&mut con, 0, Duration::from_secs(10));
    }
    let released = stack.counter("redis_guard.concurrency.released");
    assert_eq!(released, 10, "one release per admitted request");
    let cached = stack.counter("redis_guard.overlimit_cache.rejected");
    assert_eq!(cached, 0, "a concurrency 429 is never cached");
    let errors = stack.counter("redis_guard.redis.errors");
    assert_eq!(errors, 0);
}

#[test]
fn a_concurrency_limit_says_its_free_slots_and_rejects_with_retry_after_one_second() {
    let stack = Stack::start(&config(2, 30_000), 1);
    let e = stack.envoy();
    let user = [("x-user", "alice")];
    // Sequential requests: each ends (and frees its slot) before the next.
    for _ in 0..3 {
        let r = get(&e.url("/slow"), &user);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-ratelimit-limit"), Some("2"));
        assert_eq!(r.header("x-ratelimit-remaining"), Some("1"));
        assert_eq!(r.header("x-ratelimit-reset"), Some("0"));
        // No window: capacity comes back when requests end.
        assert_eq!(r.header("ratelimit-policy"), Some("\"slots\";q=2"));
        assert_eq!(r.header("ratelimit"), Some("\"slots\";r=1;t=0"));
    }
    let _a = open_request(e.port, "/slow?a", "alice", 10_000);
    let _b = open_request(e.port, "/slow?b", "alice", 10_000);
    wait_in_flight(&stack.upstream, "/slow?a", 1);
    wait_in_flight(&stack.upstream, "/slow?b", 1);
    let r = get(&e.url("/slow"), &user);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(r.json()["limits"], serde_json::json!(["slots"]));
    // Another descriptor has slots of its own.
    assert_eq!(get(&e.url("/slow"), &[("x-user", "bob")]).status, 200);
}

#[test]
fn a_client_that_leaves_keeps_its_slot_while_the_upstream_may_still_work() {
    // A slot is the upstream's work: the upstream still runs the request its
    // client left, so the slot stays until its lease ends (e2e_hangup shows
    // it ending and the upstream never over max).
    let stack = Stack::start(&config(1, 30_000), 1);
    let e = stack.envoy();
    let mut con = stack.redis.conn();
    let user = [("x-user", "carol")];
    let client = open_request(e.port, "/slow?left", "carol", 10_000);
    wait_in_flight(&stack.upstream, "/slow?left", 1);
    drop(client);
    let deadline = Instant::now() + Duration::from_secs(5);
    while e.counter("redis_guard.concurrency.abandoned") != 1 {
        assert!(
            Instant::now() < deadline,
            "the hang-up never reached the filter"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        get(&e.url("/slow?next"), &user).status,
        429,
        "the slot is held"
    );
    assert_eq!(slots_held(&mut con, "slots"), 1);
    assert_eq!(e.counter("redis_guard.concurrency.released"), 0);
}

#[test]
fn an_envoy_killed_with_sigkill_frees_its_slots_when_their_lease_ends() {
    const LEASE_MS: u64 = 1500;
    let mut stack = Stack::start(&config(2, LEASE_MS), 2);
    let other = stack.envoys[1].url("/slow?after");
    let user = [("x-user", "dave")];
    let port = stack.envoys[0].port;
    let _a = open_request(port, "/slow?a", "dave", 10_000);
    let _b = open_request(port, "/slow?b", "dave", 10_000);
    wait_in_flight(&stack.upstream, "/slow?a", 1);
    wait_in_flight(&stack.upstream, "/slow?b", 1);
    let mut con = stack.redis.conn();
    let key = slots_key(&mut con, "").unwrap();
    // When each slot's lease ends, on Redis' clock: its score (the scripts
    // count a slot live while its score is ahead of Redis TIME). Once both
    // have ended the set may expire: no ends.
    let ends = |con: &mut redis::Connection| -> BTreeMap<String, i64> {
        zset_scores(con, &key).into_iter().collect()
    };
    // Past the leases the slots were taken with: they live on renewals.
    let taken_until = zset_scores(&mut con, &key)
        .iter()
        .map(|(_, end)| *end)
        .max()
        .unwrap();
    wait_until(&mut con, taken_until + 1);
    assert_eq!(get(&other, &user).status, 429, "renewed past their lease");
    stack.envoys[0].kill();
    // Rejected while both dead leases run, admitted once one has ended: each
    // answer is checked against Redis TIME around it, not the test's clock.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let before = ends(&mut con);
        let end_before = before.values().copied().min().unwrap_or(i64::MIN);
        let sent = redis_now_ms(&mut con);
        let status = get(&other, &user).status;
        let answered = redis_now_ms(&mut con);
        if status == 200 {
            assert!(
                answered >= end_before,
                "admitted by {answered}, before the first dead lease ended at {end_before}"
            );
            break;
        }
        assert_eq!(status, 429);
        // A renewal the killed Envoy sent may land after the kill and push
        // an end later: the ends read after the answer include it (a slot
        // gone by then had ended where it was read before).
        let after = ends(&mut con);
        let end_after = before
            .iter()
            .map(|(slot, end)| after.get(slot).copied().unwrap_or(*end).max(*end))
            .min()
            .unwrap_or(i64::MIN);
        assert!(
            sent < end_after,
            "rejected though sent at {sent}, when a dead lease had ended ({end_after})"
        );
        assert!(
            Instant::now() < deadline,
            "the dead Envoy's slots never came back"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_stream_longer_than_its_lease_keeps_its_slot() {
    const LEASE_MS: u64 = 1000;
    let stack = Gated::start(&config(1, LEASE_MS), 2);
    let user = [("x-user", "erin")];
    let other = stack.envoys[1].url("/slow?other");
    let started = Instant::now();
    let (long, held_for) = std::thread::scope(|s| {
        let url = stack.envoys[0].url("/slow?long");
        let long =
            s.spawn(move || http_with(&agent(), "GET", &url, &[("x-user", "erin")], None).status);
        poll(
            "the long stream reached the upstream",
            Duration::from_secs(10),
            || (stack.gate.seen().held == 1).then_some(()),
        );
        let held = Instant::now();
        // The stream is held for four leases and until eight checks were
        // made (whichever is later): the checks after the first lease found
        // the slot renewed. The gate, not a delay, ends the stream.
        let mut checks = 0;
        while held.elapsed() < Duration::from_millis(4 * LEASE_MS) || checks < 8 {
            assert_eq!(get(&other, &user).status, 429, "at {:?}", held.elapsed());
            checks += 1;
            std::thread::sleep(Duration::from_millis(100));
        }
        let held_for = held.elapsed();
        stack.gate.set_open(true);
        (long.join().unwrap(), held_for)
    });
    let lived = started.elapsed();
    assert_eq!(long, 200);
    assert_eq!(get(&other, &user).status, 200, "free once the stream ended");
    assert_eq!(
        stack.gate.seen().arrived,
        2,
        "the long stream, then the other"
    );
    let e = &stack.envoys[0];
    // A renewal every quarter lease, never more often; and at least one a
    // lease while the slot was seen held, or it would have lapsed (the
    // last one may still be on its way: one less).
    let renewed = e.counter("redis_guard.concurrency.renewed");
    let at_most = lived.as_millis() as u64 / (LEASE_MS / 4) + 1;
    let at_least = held_for.as_millis() as u64 / LEASE_MS - 1;
    assert!(
        (at_least..=at_most).contains(&renewed),
        "{renewed} renewals in {lived:?}, held {held_for:?}"
    );
    assert_eq!(e.counter("redis_guard.concurrency.lost"), 0);
}

#[test]
fn a_client_sending_one_request_after_another_never_finds_its_own_slot_still_taken() {
    // The response's last piece waits for the release: once the client has
    // the whole response, its slot is free, on either Envoy.
    let stack = Stack::start(&config(1, 30_000), 2);
    let agent = agent();
    for i in 0..40 {
        let e = &stack.envoys[i % 2];
        let r = http_with(&agent, "GET", &e.url("/slow"), &[("x-user", "frank")], None);
        assert_eq!(r.status, 200, "request {i}");
        assert_eq!(r.header("x-ratelimit-remaining"), Some("0"), "request {i}");
    }
    let released = stack.counter("redis_guard.concurrency.released");
    assert_eq!(released, 40);
}
