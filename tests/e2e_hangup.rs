//! A client that hangs up while the upstream works (issue 28): real Envoy,
//! Webdis, Redis and the demo upstream, which counts what it executes and
//! how much of one path it runs at once. Envoy forwarded the request, so
//! the upstream may be running it, or may have run it: a keyed request's
//! lock and a concurrency slot stay taken until their TTL or lease, so a
//! retry never runs beside the first attempt.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use support::probe::*;
use support::*;

/// How long the upstream works on a first attempt (its delay, or the pause
/// in its body). The client must hang up, and Envoy see it, within it.
const UPSTREAM_MS: u64 = 3000;
/// What each step that must fit a span leaves spare: the hang-up seen before
/// the upstream answers, and the retries after the first attempt before the
/// lock's TTL or the slots' lease ends. Measured on this suite's 2 cores at a
/// load average of 8.6: the hang-up was seen at most 160 ms after the lock
/// was taken, and the retry after the first attempt answered at most 200 ms
/// after the upstream did. 3 s is over ten times either (it was 1.5 s, with
/// an upstream of 1.5 s: issue 42 asked for more room under load).
const MARGIN_MS: u64 = 3000;
/// The lock's TTL: longer than the upstream's slowest answer here, so the
/// first attempt is over before a retry may run.
const LOCK_TTL_MS: u64 = UPSTREAM_MS + MARGIN_MS;
/// The slots' lease: it outlasts the upstream's work by the margin too.
const LEASE_MS: u64 = UPSTREAM_MS + MARGIN_MS;

/// A poll's bound: `span` to wait for, plus 5 s for a loaded machine.
fn within(span_ms: u64) -> Duration {
    Duration::from_millis(span_ms + 5000)
}

/// One idempotency rule on /pay (tenant from x-tenant) and a concurrency
/// limit of two on /slow, leased for `lease_ms`.
fn config(lease_ms: u64) -> String {
    filter_config(1000)
        .limits(&format!(
            r#"[{{"name":"slots","match":{{"pathPrefix":"/slow"}},"descriptor":[{{"literal":"all"}}],
                 "concurrency":{{"max":2,"leaseMs":{lease_ms}}}}}]"#
        ))
        .idempotency(&format!(
            r#"[{{"name":"pay","match":{{"pathPrefix":"/pay"}},
                 "tenant":[{{"header":"x-tenant"}}],"lockTtlMs":{LOCK_TTL_MS}}}]"#
        ))
        .build()
}

/// Sends one keyed PATCH on a connection of its own and leaves it open.
fn open_keyed(port: u16, path: &str, key: &str, upstream: &[(&str, &[u8])]) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut headers: Vec<(&str, &[u8])> =
        vec![("idempotency-key", key.as_bytes()), ("x-tenant", b"acme")];
    headers.extend_from_slice(upstream);
    let body = b"{\"amount\":5}";
    let fixed = format!("content-length: {}\r\n", body.len());
    s.write_all(&raw_request_bytes("PATCH", path, &fixed, &headers, body))
        .unwrap();
    s
}

fn patch(e: &Envoy, path: &str, key: &str) -> Resp {
    let h = [("idempotency-key", key), ("x-tenant", "acme")];
    http("PATCH", &e.url(path), &h, Some(b"{\"amount\":5}"))
}

/// The idempotency records in Redis.
fn records(stack: &Stack) -> Vec<Vec<u8>> {
    redis::cmd("KEYS")
        .arg("rg:idem:*")
        .query(&mut stack.redis.conn())
        .unwrap()
}

/// Waits (bounded) until Envoy has seen `n` clients close their connection
/// while their request was active.
fn hang_ups_seen(e: &Envoy, n: u64) {
    poll_eq("hang-ups seen", n, Duration::from_secs(5), || {
        admin_stat(
            e.admin_port,
            "http.ingress.downstream_cx_destroy_remote_active_rq",
        )
    });
}

/// After the hang-up: a retry meets the lock (409, Retry-After) while the
/// first attempt runs and after it, until the lock's TTL; then it runs, and
/// never beside the first.
fn retries_wait_for_the_lock_then_run_once(stack: &Stack, path: &str, key: &str) {
    let e = stack.envoy();
    hang_ups_seen(e, 1);
    let retry = patch(e, path, key);
    assert_eq!(
        retry.status,
        409,
        "{}",
        String::from_utf8_lossy(&retry.body)
    );
    assert_eq!(retry.header("retry-after"), Some("1"));
    // The first attempt finishes upstream; the lock still stands after it.
    poll_eq("first attempt over", 0, within(UPSTREAM_MS), || {
        stack.upstream.in_flight(path)
    });
    assert_eq!(patch(e, path, key).status, 409);
    assert_eq!(stack.upstream.executions_of(path), 1);
    assert_eq!(e.counter("redis_guard.idempotency.abandoned"), 1);
    // Until its TTL: then the key is free and the retry runs (once).
    poll_eq("lock expired", 0, within(LOCK_TTL_MS), || {
        records(stack).len()
    });
    let rerun = patch(e, path, key);
    assert_eq!(
        (rerun.status, rerun.header("idempotent-replayed")),
        (200, None)
    );
    let replay = patch(e, path, key);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(stack.upstream.executions_of(path), 2);
    assert_eq!(stack.upstream.peak_in_flight(path), 1, "never two at once");
    assert_eq!(e.counter("redis_guard.idempotency.released"), 0);
}

#[test]
fn a_client_that_hangs_up_while_the_upstream_works_leaves_the_lock_to_its_ttl() {
    let stack = Stack::start(&config(30_000), 1);
    let path = "/pay/wait";
    let client = open_keyed(
        stack.envoy().port,
        path,
        "k-hangup",
        &[("x-upstream-delay-ms", UPSTREAM_MS.to_string().as_bytes())],
    );
    poll_eq("upstream executing", 1, Duration::from_secs(5), || {
        stack.upstream.in_flight(path)
    });
    drop(client);
    retries_wait_for_the_lock_then_run_once(&stack, path, "k-hangup");
}

#[test]
fn a_client_that_hangs_up_mid_response_leaves_the_lock_to_its_ttl() {
    let stack = Stack::start(&config(30_000), 1);
    let path = "/pay/half";
    // Half the body, a pause, the rest: the client leaves in the pause.
    let mut client = open_keyed(
        stack.envoy().port,
        path,
        "k-half",
        &[
            ("x-upstream-pad-bytes", b"4096"),
            (
                "x-upstream-body-pause-ms",
                UPSTREAM_MS.to_string().as_bytes(),
            ),
        ],
    );
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut head = [0u8; 12];
    client.read_exact(&mut head).unwrap();
    assert_eq!(&head[..12], b"HTTP/1.1 200");
    drop(client);
    retries_wait_for_the_lock_then_run_once(&stack, path, "k-half");
}

/// Sends one GET for `path` on a connection of its own, the upstream
/// answering after `delay_ms`, and leaves the connection open.
fn open_slow(port: u16, path: &str, delay_ms: u64) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let delay = delay_ms.to_string();
    let req = raw_request_bytes(
        "GET",
        path,
        "",
        &[("x-upstream-delay-ms", delay.as_bytes())],
        b"",
    );
    s.write_all(&req).unwrap();
    s
}

/// The slots whose lease has not ended, by Redis' clock (each member's
/// score is its lease's end).
fn slots(stack: &Stack) -> u64 {
    let mut con = stack.redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:slots:cc:*")
        .query(&mut con)
        .unwrap();
    let now = redis_now_ms(&mut con);
    keys.iter()
        .map(|k| {
            redis::cmd("ZCOUNT")
                .arg(k)
                .arg(format!("({now}"))
                .arg("+inf")
                .query::<u64>(&mut con)
                .unwrap()
        })
        .sum()
}

#[test]
fn clients_that_hang_up_keep_their_slots_until_the_lease_so_the_upstream_never_runs_more_than_max()
{
    // The lease outlasts the upstream's work and ends a while after.
    let stack = Stack::start(&config(LEASE_MS), 1);
    let e = stack.envoy();
    let path = "/slow/work";
    let first = open_slow(e.port, path, UPSTREAM_MS);
    let second = open_slow(e.port, path, UPSTREAM_MS);
    poll_eq("two running", 2, Duration::from_secs(5), || {
        stack.upstream.in_flight(path)
    });
    drop(first);
    drop(second);
    hang_ups_seen(e, 2);
    // The upstream still works on both: a third is refused, not run beside.
    let third = get(&e.url(path), &[]);
    assert_eq!(third.status, 429);
    assert_eq!(slots(&stack), 2);
    poll_eq("upstream done", 0, within(UPSTREAM_MS), || {
        stack.upstream.in_flight(path)
    });
    // The first two are over, their slots still held: the filter gave them
    // back neither at the hang-up nor when the upstream answered.
    assert_eq!(slots(&stack), 2, "held until the lease");
    assert_eq!(get(&e.url(path), &[]).status, 429);
    // The lease ends the slots (nobody renews them now), then one runs.
    poll_eq("slots expired", 0, within(LEASE_MS), || slots(&stack));
    assert_eq!(get(&e.url(path), &[]).status, 200);
    assert_eq!(
        stack.upstream.executions_of(path),
        3,
        "the two 429s never ran"
    );
    assert!(
        stack.upstream.peak_in_flight(path) <= 2,
        "over the limit: {}",
        stack.upstream.peak_in_flight(path)
    );
    assert_eq!(e.counter("redis_guard.concurrency.released"), 1);
    assert_eq!(e.counter("redis_guard.concurrency.abandoned"), 2);
}
