//! A fleet: four Envoys of two workers each (eight VMs, eight batchers)
//! deciding one key's token bucket and concurrency limit through one Webdis
//! and Redis, batching on (the default). Admissions are exact across all of
//! them: every admitted request spent one token and reached the upstream,
//! never more ran at once than the limit allows, and every slot came back.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use support::*;

const CAPACITY: u64 = 100;
const MAX_IN_FLIGHT: u64 = 6;
const PERIOD_MS: i64 = 3_600_000;

/// A token bucket of CAPACITY per x-user (one token back an hour: no run
/// refills one) and at most MAX_IN_FLIGHT of a user's requests at once, both
/// on /f.
fn config() -> String {
    filter_config(5000)
        .limits(&format!(
            r#"[{{"name":"bucket","match":{{"pathPrefix":"/f"}},"descriptor":[{{"header":"x-user"}}],
               "tokenBucket":{{"capacity":{CAPACITY},"refill":1,"periodMs":{PERIOD_MS}}}}},
               {{"name":"inflight","match":{{"pathPrefix":"/f"}},"descriptor":[{{"header":"x-user"}}],
               "concurrency":{{"max":{MAX_IN_FLIGHT},"leaseMs":60000}}}}]"#
        ))
        .build()
}

/// The bucket's one key, read from Redis.
fn bucket_key(con: &mut redis::Connection) -> String {
    let keys: Vec<String> = redis::cmd("KEYS").arg("*:bucket:*").query(con).unwrap();
    assert_eq!(keys.len(), 1, "one key of the bucket: {keys:?}");
    keys[0].clone()
}

#[test]
fn four_envoys_of_two_workers_admit_exactly_the_budget_and_never_more_at_once_than_the_limit() {
    let stack = Stack::start(&config(), 4);
    let jobs: Vec<usize> = (0..400).collect();
    // Each admitted request holds its slot while the upstream waits 20 ms.
    let statuses = run_jobs(&jobs, 32, Duration::from_secs(90), agent, |agent, i, _| {
        let e = &stack.envoys[i % 4];
        let headers = [("x-user", "fleet"), ("x-upstream-delay-ms", "20")];
        http_with(agent, "GET", &e.url("/f"), &headers, None).status
    });
    let others: Vec<u16> = statuses
        .iter()
        .copied()
        .filter(|s| *s != 200 && *s != 429)
        .collect();
    assert!(others.is_empty(), "only 200 and 429: {others:?}");
    let mut admitted = statuses.iter().filter(|s| **s == 200).count() as u64;
    assert!(
        admitted <= CAPACITY,
        "{admitted} admitted, budget {CAPACITY}"
    );
    let mut con = stack.redis.conn();

    // Every slot comes back: each stream's release is sent as it ends.
    probe::poll_eq(
        "slots held after the load",
        0,
        Duration::from_secs(10),
        || slots_held(&mut con, "inflight"),
    );
    // Then one request at a time, on every Envoy in turn: with no slot
    // taken, only the bucket can refuse, and it admits exactly what is left.
    let mut n = 0;
    loop {
        let e = &stack.envoys[n % 4];
        let status = get(&e.url("/f"), &[("x-user", "fleet")]).status;
        n += 1;
        match status {
            200 => admitted += 1,
            429 => break,
            s => panic!("request {n} after the load: {s}"),
        }
        assert!(admitted <= CAPACITY, "admitted past the budget");
    }
    assert_eq!(admitted, CAPACITY, "the whole budget, and not one more");
    assert_eq!(stack.upstream.executions_of("/f"), CAPACITY);
    let bucket = bucket_key(&mut con);
    assert_eq!(read_bucket(&mut con, &bucket).unwrap().0 / PERIOD_MS, 0);
    let peak = stack.upstream.peak_in_flight("/f");
    assert!(
        (1..=MAX_IN_FLIGHT).contains(&peak),
        "at most {MAX_IN_FLIGHT} at once across the fleet, saw {peak}"
    );
    assert_eq!(slots_held(&mut con, "inflight"), 0);
    assert_eq!(stack.counter("redis_guard.redis.errors"), 0);
    for mode in ["allowed", "denied", "local"] {
        let name = format!("redis_guard.failure_mode.{mode}");
        assert_eq!(stack.counter(&name), 0, "{name}");
    }
}
