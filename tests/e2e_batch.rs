//! Batched decisions end to end: real Envoys (their workers batch what
//! arrives while their calls are out), Webdis and Redis. Exact budgets under
//! load, batches that really carry several requests, clients that leave
//! while queued or in flight, and Redis dying with a batch out.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use support::probe::*;
use support::*;

const PERIOD_MS: i64 = 3_600_000;

/// One token bucket of `capacity` per x-user on /x (deny on failure) and one
/// on /open (allow on failure), refilled 1 per hour (so no test run refills
/// a token); batching as `batch` says.
fn config(capacity: u64, batch: &str, timeout_ms: u64) -> String {
    filter_config(timeout_ms)
        .batch(batch)
        .limits(&format!(
            r#"[{{"name":"per-user","match":{{"pathPrefix":"/x"}},"descriptor":[{{"header":"x-user"}}],
               "tokenBucket":{{"capacity":{capacity},"refill":1,"periodMs":{PERIOD_MS}}}}},
               {{"name":"open","match":{{"pathPrefix":"/open"}},"failureMode":"allow",
               "descriptor":[{{"header":"x-user"}}],
               "tokenBucket":{{"capacity":{capacity},"refill":1,"periodMs":{PERIOD_MS}}}}}]"#
        ))
        .build()
}

/// Tokens left in `user`'s bucket of the `per-user` limit, read from Redis
/// (`user` must not occur in another key: the test users are `user-…`).
fn tokens_left(con: &mut redis::Connection, user: &str) -> i64 {
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(con).unwrap();
    let mine: Vec<&String> = keys
        .iter()
        .filter(|k| k.contains("per-user") && k.contains(user))
        .collect();
    assert_eq!(mine.len(), 1, "one bucket of {user} in {keys:?}");
    let key = mine[0];
    read_bucket(con, key).expect("a bucket").0 / PERIOD_MS
}

#[test]
fn two_envoys_batching_under_load_admit_exactly_the_budget_with_batches_of_several() {
    let stack = Stack::start(&config(100, "{}", 5000), 2);
    let jobs: Vec<usize> = (0..240).collect();
    let agent = agent;
    let statuses = run_jobs(&jobs, 48, Duration::from_secs(60), agent, |agent, i, _| {
        let e = &stack.envoys[i % 2];
        http_with(agent, "GET", &e.url("/x"), &[("x-user", "user-u")], None).status
    });
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    let rejected = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!(
        (admitted, rejected),
        (100, 140),
        "exactly the budget, no 5xx: {statuses:?}"
    );
    assert_eq!(stack.upstream.executed(), 100);
    assert_eq!(tokens_left(&mut stack.redis.conn(), "user-u"), 0);

    // Batches of several: fewer batch calls than requests they decided.
    let mut decided_by_batches = 0;
    let mut batch_calls = 0;
    for e in &stack.envoys {
        let checked = e.counter("redis_guard.ratelimit.per-user.checked");
        let cached = e.counter("redis_guard.overlimit_cache.rejected");
        let alone = e.counter("redis_guard.batch.alone");
        decided_by_batches += checked - cached - alone;
        batch_calls += e.counter("redis_guard.batch.calls");
    }
    assert!(batch_calls > 0);
    // The batch-size histogram holds one sample per batch call, and its
    // samples add up to the requests the batches decided (Envoy merges it
    // on its stats flush).
    for e in &stack.envoys {
        let calls = e.counter("redis_guard.batch.calls");
        let s = scrape_with_samples(e, "redis_guard_batch_size", calls);
        let (_, samples, _) = s.histogram("redis_guard_batch_size");
        assert_eq!(samples, calls, "one batch-size sample per batch call");
    }
    assert!(
        batch_calls < decided_by_batches,
        "{batch_calls} batch calls for {decided_by_batches} requests: no batch carried two"
    );
    // Every call was a batch, a request that found its worker quiet and
    // went alone, or either sent again (as EVAL after a NOSCRIPT: on a fresh
    // Redis, several calls can be out before the first EVAL has cached the
    // script; or after a refusal).
    let sum = |name: &str| -> u64 { stack.envoys.iter().map(|e| e.counter(name)).sum() };
    assert_eq!(
        sum("redis_guard.redis.calls"),
        batch_calls
            + sum("redis_guard.batch.alone")
            + sum("redis_guard.redis.script_reloads")
            + sum("redis_guard.redis.retries")
    );
    assert_eq!(sum("redis_guard.redis.errors"), 0);
}

/// One Envoy with one worker (every request meets the same batcher), one
/// call out at a time, and Redis frozen so the first call stays out.
struct Frozen {
    envoy: Envoy,
    upstream: Upstream,
    redis: Redis,
    _webdis: Webdis,
}

fn frozen(cfg: &str) -> Frozen {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let envoy = Envoy::start_with_workers(cfg, webdis.port, upstream.port, 1);
    // Warm-up: its call goes alone (the worker is quiet) and caches the
    // single-request script; a first batch may still meet NOSCRIPT and go
    // again as EVAL, which the tests below allow for.
    assert_eq!(
        get(&envoy.url("/x"), &[("x-user", "user-warm")]).status,
        200
    );
    redis.freeze(true);
    Frozen {
        envoy,
        upstream,
        redis,
        _webdis: webdis,
    }
}

/// A GET of /x sent on a connection of its own and left waiting: dropping
/// the connection is its client leaving, when the test says (a client
/// timeout would say when instead, and a slow machine reorders them).
fn waiting(port: u16, user: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let req = raw_request_bytes("GET", "/x", "", &[("x-user", user.as_bytes())], b"");
    s.write_all(&req).unwrap();
    s
}

#[test]
fn clients_that_leave_while_queued_are_dropped_and_while_in_flight_are_skipped() {
    let f = frozen(&config(10, r#"{"maxInFlight":1}"#, 10_000));
    let e = &f.envoy;
    let calls = || e.counter("redis_guard.batch.calls");
    let alone = || e.counter("redis_guard.batch.alone");
    let admin = e.admin_port;
    let arrived = || admin_stat(admin, "http.ingress.downstream_rq_total");
    let left = || admin_stat(admin, "http.ingress.downstream_cx_destroy_remote_active_rq");
    let (calls_before, alone_before, in_before, left_before) =
        (calls(), alone(), arrived(), left());
    // A finds its worker quiet: its own call leaves at once and waits on
    // the frozen Redis, holding the group.
    let a = waiting(e.port, "user-u");
    poll("A's call is out", Duration::from_secs(10), || {
        (alone() == alone_before + 1).then_some(())
    });
    // B, D and C queue behind it.
    let b = waiting(e.port, "user-u");
    let d = waiting(e.port, "user-u");
    let url = e.url("/x");
    let c = std::thread::spawn(move || get(&url, &[("x-user", "user-u")]).status);
    poll("A, B, D and C arrived", Duration::from_secs(10), || {
        (arrived() == in_before + 4).then_some(())
    });
    // B's client leaves while it is queued behind A.
    drop(b);
    poll("Envoy saw B leave", Duration::from_secs(10), || {
        (left() == left_before + 1).then_some(())
    });
    // A's client leaves: Envoy cancels its call, the group is free, and the
    // worker sends what queued (B dropped): D and C in one batch.
    drop(a);
    poll(
        "the batch of D and C is out",
        Duration::from_secs(10),
        || (calls() == calls_before + 1).then_some(()),
    );
    // D's client leaves while its batch is out.
    drop(d);
    poll(
        "Envoy saw A, B and D leave",
        Duration::from_secs(10),
        || (left() == left_before + 3).then_some(()),
    );
    f.redis.freeze(false);
    assert_eq!(c.join().unwrap(), 200, "C, still there, is decided");
    // A's command had reached Redis before its call was cancelled, and D's
    // batch ran: both are charged, with nobody there to forward to. B left
    // before its batch did: not charged.
    let mut con = f.redis.conn();
    assert_eq!(
        tokens_left(&mut con, "user-u"),
        10 - 3,
        "A, D and C charged, B not"
    );
    assert_eq!(f.upstream.executions_of("/x"), 2, "warm-up and C");
    assert_eq!(calls(), calls_before + 1);
    assert_eq!(e.counter("redis_guard.redis.errors"), 0);
}

#[test]
fn redis_dying_with_a_batch_out_gives_each_member_its_own_failure_mode() {
    // Two calls per group: the first request goes alone (its worker is
    // quiet), the next two leave as one batch beside it, or as two, one of
    // them once the lone call has failed.
    let mut f = frozen(&config(10, r#"{"maxInFlight":2}"#, 2000));
    let e = &f.envoy;
    let before = e.counter("redis_guard.batch.calls");
    let alone = e.counter("redis_guard.batch.alone");
    let urls = [e.url("/x"), e.url("/open"), e.url("/x")];
    let mut waiting = Vec::new();
    for (i, url) in urls.into_iter().enumerate() {
        waiting.push(std::thread::spawn(move || {
            get(&url, &[("x-user", "user-v")]).status
        }));
        if i == 0 {
            poll("the first call is out", Duration::from_secs(5), || {
                (e.counter("redis_guard.batch.alone") == alone + 1).then_some(())
            });
        }
    }
    // All three reached the filter (which queues them as they arrive),
    // the warm-up request before them.
    let admin = e.admin_port;
    poll("three requests in", Duration::from_secs(5), || {
        (admin_stat(admin, "http.ingress.downstream_rq_total") >= 4).then_some(())
    });
    poll("a batch is out", Duration::from_secs(5), || {
        (e.counter("redis_guard.batch.calls") > before).then_some(())
    });
    f.redis.stop();
    let statuses: Vec<u16> = waiting.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(statuses, [503, 200, 503], "deny, allow, deny: each its own");
    assert_eq!(e.counter("redis_guard.failure_mode.denied"), 2);
    assert_eq!(e.counter("redis_guard.failure_mode.allowed"), 1);
    assert_eq!(
        e.counter("redis_guard.redis.errors"),
        3,
        "each member counted"
    );
    assert_eq!(f.upstream.executions_of("/open"), 1);
}
