//! Token leases end to end, two Envoy processes (two workers each) sharing one
//! bucket in Redis. A leased token leaves Redis before any request spends it,
//! so the Envoys together never admit more than the bucket holds; grants
//! shrink as the bucket empties, and an Envoy that stops getting traffic
//! gives its unspent tokens back (lua/lease_return.lua), so the other admits
//! them. Both bounds are asserted, with no refill to speak of during a test
//! (one token per hour, or 100 a day).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::probe::*;
use support::*;

fn config(capacity: u64, tokens: u64, ttl_ms: u64) -> String {
    config_refilled(capacity, (1, 3_600_000), tokens, ttl_ms)
}

/// A leased bucket refilled `refill` tokens every `period_ms`.
fn config_refilled(
    capacity: u64,
    (refill, period_ms): (u64, u64),
    tokens: u64,
    ttl_ms: u64,
) -> String {
    filter_config(2000)
        .limits(&format!(
            r#"[{{"name":"leased","match":{{"pathPrefix":"/api/"}},
            "descriptor":[{{"header":"x-user"}}],
            "tokenBucket":{{"capacity":{capacity},"refill":{refill},"periodMs":{period_ms}}},
            "lease":{{"tokens":{tokens},"ttlMs":{ttl_ms}}}}}]"#
        ))
        .build()
}

/// The bucket's key, once a grant created its give-back record
/// (`<key>:ret`, lua/lease.lua).
fn bucket_key(redis: &Redis) -> String {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:ret")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(keys.len(), 1, "one leased bucket: {keys:?}");
    keys[0].strip_suffix(":ret").unwrap().to_string()
}

/// Tokens given back to the bucket so far: the first little-endian double
/// of its give-back record.
fn given_back(redis: &Redis, key: &str) -> u64 {
    let record: Option<Vec<u8>> = redis::cmd("GET")
        .arg(format!("{key}:ret"))
        .query(&mut redis.conn())
        .unwrap();
    record.map_or(0, |b| f64::from_le_bytes(b[..8].try_into().unwrap()) as u64)
}

/// Whole tokens the bucket holds in Redis now: `capacity` tokens of
/// `period_ms` credits, `refill` credits a ms.
fn tokens_in_redis(
    redis: &Redis,
    key: &str,
    capacity: i64,
    (refill, period_ms): (i64, i64),
) -> u64 {
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    let full = capacity * period_ms;
    let credits = match read_bucket(&mut con, key) {
        None => full,
        Some((c, t)) => full.min(c + (now - t).max(0) * refill),
    };
    (credits / period_ms) as u64
}

/// Sends requests to `envoys` in turn until a whole round of them is
/// refused; returns how many were admitted (bounded: `most` requests).
fn until_refused(envoys: &[&Envoy], most: usize) -> u64 {
    let mut admitted = 0;
    let mut refused_in_a_row = 0;
    for i in 0..most {
        if status(envoys[i % envoys.len()]) == 200 {
            admitted += 1;
            refused_in_a_row = 0;
        } else {
            refused_in_a_row += 1;
            if refused_in_a_row == envoys.len() {
                break;
            }
        }
    }
    admitted
}

fn status(e: &Envoy) -> u16 {
    get(&e.url("/api/x"), &[("x-user", "u")]).status
}

fn admitted(e: &Envoy, n: usize) -> usize {
    (0..n).filter(|_| status(e) == 200).count()
}

#[test]
fn an_envoy_that_stops_getting_traffic_gives_its_batch_back_and_never_spends_it() {
    // 40 tokens, batches of 5, leases that outlive the test.
    let stack = Stack::start(&config(40, 5, 600_000), 2);
    let (e1, e2) = (&stack.envoys[0], &stack.envoys[1]);
    let hourly = (1, 3_600_000);

    // e1 fetches: its request plus 5 tokens leave the bucket (34 left; a
    // quarter of 39 holds the batch).
    assert_eq!(admitted(e1, 1), 1);
    assert_eq!(e1.counter("redis_guard.lease.fetches"), 1);
    let key = bucket_key(&stack.redis);
    // Nothing given back yet, or (on a machine that stalled a second since
    // the request) the whole batch: never a part of it.
    let early = given_back(&stack.redis, &key);
    assert!(early == 0 || early == 5, "{early} given back");
    // e1 gets no more traffic: a second later its 5 go back to Redis.
    poll_eq("e1's batch given back", 5, Duration::from_secs(10), || {
        given_back(&stack.redis, &key)
    });
    assert_eq!(tokens_in_redis(&stack.redis, &key, 40, hourly), 39);
    assert_eq!(e1.counter("redis_guard.lease.returned"), 5);
    // All other traffic goes to e2, which admits every one of them.
    assert_eq!(until_refused(&[e2], 60), 39);
    // e1 spends nothing it gave back: its requests are Redis' to decide.
    assert_eq!(admitted(e1, 3), 0);
    assert_eq!(e1.counter("redis_guard.lease.spent"), 0);
    // Exactly the bucket, no more, no less.
    assert_eq!(stack.upstream.executed(), 40);
}

#[test]
fn two_envoys_taking_turns_on_a_limit_of_100_admit_at_least_98_and_never_more() {
    // 100 tokens, 100 a day (a token every 14.4 min: none during the test),
    // batches of 10, leases that outlive the test.
    let daily = (100, 86_400_000);
    let stack = Stack::start(&config_refilled(100, daily, 10, 600_000), 2);
    let (e1, e2) = (&stack.envoys[0], &stack.envoys[1]);
    let redis = &stack.redis;
    let per_ms = (daily.0 as i64, daily.1 as i64);

    // Turns of 7 requests, five each: every one admitted.
    let mut ok = 0;
    for _ in 0..5 {
        ok += admitted(e1, 7) as u64;
        ok += admitted(e2, 7) as u64;
    }
    assert_eq!(ok, 70);
    let key = bucket_key(redis);
    // e1 takes one more turn and stops; what the Envoys hold (or is on its
    // way to them) is what neither they admitted nor Redis holds.
    ok += admitted(e1, 7) as u64;
    assert_eq!(ok, 77);
    let held = 100 - ok - tokens_in_redis(redis, &key, 100, per_ms);
    assert!(held > 0, "the Envoys hold tokens after their turns");
    // Both idle: their tokens come back, given back by the Envoys (the
    // bound may keep at most a couple back, never more than were held).
    poll(
        "the held tokens given back",
        Duration::from_secs(10),
        || (ok + tokens_in_redis(redis, &key, 100, per_ms) >= 98).then_some(()),
    );
    assert!(given_back(redis, &key) > 0, "no tokens given back");
    assert!(ok + tokens_in_redis(redis, &key, 100, per_ms) <= 100);
    // e2 goes on alone: it admits what came back, e1's included.
    let in_redis = tokens_in_redis(redis, &key, 100, per_ms);
    let alone = until_refused(&[e2], 60);
    assert!(
        alone >= in_redis,
        "e2 admits what Redis held: {alone} of {in_redis}"
    );
    ok += alone;
    // Both again, until both are refused with nothing left in Redis (a
    // refused Envoy holds nothing: it would have spent it).
    poll(
        "both refused with the bucket empty",
        Duration::from_secs(10),
        || {
            ok += until_refused(&[e1, e2], 40);
            (tokens_in_redis(redis, &key, 100, per_ms) == 0).then_some(())
        },
    );
    assert!((98..=100).contains(&ok), "admitted {ok} of 100");
    assert_eq!(stack.upstream.executed(), ok, "every admission counted");
}

#[test]
fn two_envoys_under_concurrent_load_never_admit_more_than_the_bucket() {
    let capacity = 40;
    let stack = Arc::new(Stack::start(&config(capacity, 8, 600_000), 2));
    let ok = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let stack = Arc::clone(&stack);
            let ok = Arc::clone(&ok);
            std::thread::spawn(move || {
                let agent = agent();
                let e = &stack.envoys[t % 2];
                // Bounded: 15 requests per thread, 120 in all.
                for _ in 0..15 {
                    let r = http_with(&agent, "GET", &e.url("/api/x"), &[("x-user", "u")], None);
                    assert!(r.status == 200 || r.status == 429, "{}", r.status);
                    if r.status == 200 {
                        ok.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let admitted = ok.load(Ordering::SeqCst);
    assert_eq!(stack.upstream.executed(), admitted);
    // Never more than the bucket; never fewer than the bucket minus one
    // unspent batch per Envoy.
    assert!(admitted <= capacity, "over-admitted: {admitted}");
    assert!(admitted >= capacity - 2 * 8, "under-admitted: {admitted}");
    // Whatever was not admitted is held by the Envoys or back in Redis:
    // draining both reaches the bucket, but for at most the couple of
    // tokens a give-back's bound may keep.
    let envoys = [&stack.envoys[0], &stack.envoys[1]];
    let mut more = 0;
    poll("the rest admitted", Duration::from_secs(10), || {
        more += until_refused(&envoys, 80);
        (admitted + more >= capacity - 2).then_some(())
    });
    assert!(
        admitted + more <= capacity,
        "over-admitted: {admitted} + {more}"
    );
    assert_eq!(stack.upstream.executed(), admitted + more);
}

/// The full set of rate-limit fields a response decided by Redis carries.
const ALL_FIELDS: [&str; 5] = [
    "ratelimit-policy",
    "ratelimit",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
];

fn fields(r: &Resp) -> Vec<String> {
    rate_limit_fields(&r.headers)
}

fn leased_get(e: &Envoy) -> Resp {
    let r = get(&e.url("/api/x"), &[("x-user", "u")]);
    assert_eq!(r.status, 200);
    r
}

#[test]
fn locally_admitted_requests_carry_no_rate_limit_fields_and_the_fetching_request_does() {
    // Batches of 4: the fetch takes the request's token and 4 more.
    let stack = Stack::start(&config(100, 4, 600_000), 1);
    let e = stack.envoy();
    let fetching = leased_get(e);
    assert_eq!(e.counter("redis_guard.lease.fetches"), 1);
    assert_eq!(fields(&fetching), ALL_FIELDS);
    assert_eq!(fetching.header("x-ratelimit-remaining"), Some("95"));
    // Two spends leave 2 of 4: not below half, so no fetch and no call.
    let calls = e.counter("redis_guard.redis.calls");
    for _ in 0..2 {
        let local = leased_get(e);
        assert_eq!(fields(&local), Vec::<String>::new(), "{:?}", local.headers);
    }
    assert_eq!(e.counter("redis_guard.lease.spent"), 2);
    assert_eq!(e.counter("redis_guard.redis.calls"), calls);
    assert_eq!(stack.upstream.executed(), 3);
}

/// Scripts Redis holds (SCRIPT FLUSH empties it; EVAL adds one).
fn cached_scripts(redis: &Redis) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query(&mut redis.conn())
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("number_of_cached_scripts:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn a_background_fetch_meeting_noscript_is_dropped_and_the_next_fetching_request_reloads() {
    // Batches of 2: a spend that leaves 0 (below half) starts a background fetch.
    let stack = Stack::start(&config(100, 2, 600_000), 1);
    let e = stack.envoy();
    let c = |name: &str| e.counter(&format!("redis_guard.{name}"));
    leased_get(e);
    assert_eq!((c("lease.fetches"), c("redis.script_reloads")), (1, 1));
    // Redis loses its scripts (as after a restart), the Envoy keeps its 2 tokens.
    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query::<()>(&mut stack.redis.conn())
        .unwrap();
    assert_eq!(cached_scripts(&stack.redis), 0);
    let calls = c("redis.calls");
    leased_get(e);
    assert_eq!(c("redis.calls"), calls, "1 of 2 left: no fetch yet");
    // The last token: its spend sends a fetch from the root context, which
    // meets NOSCRIPT and is dropped (an unreadable lease reply).
    leased_get(e);
    poll_eq(
        "the background fetch answered",
        1,
        Duration::from_secs(5),
        || c("redis.errors_by_kind.reply"),
    );
    assert_eq!(c("redis.calls"), calls + 1);
    assert_eq!(c("redis.errors"), 1);
    assert_eq!(c("lease.spent"), 2);
    assert_eq!(c("lease.fetches"), 1, "nothing granted");
    assert_eq!(c("redis.script_reloads"), 1, "not reloaded by the fetch");
    assert_eq!(cached_scripts(&stack.redis), 0);
    // No tokens left and no fetch out: this request fetches itself, meets
    // NOSCRIPT, and loads the script with EVAL.
    let fetching = leased_get(e);
    assert_eq!(fields(&fetching), ALL_FIELDS);
    assert_eq!(c("redis.calls"), calls + 1 + 2);
    assert_eq!(c("redis.script_reloads"), 2);
    assert_eq!(c("lease.fetches"), 2);
    assert_eq!(cached_scripts(&stack.redis), 1);
    // 100 - (1 + 2) at the first fetch - (1 + 2) now: the dropped fetch
    // took nothing from the bucket.
    assert_eq!(fetching.header("x-ratelimit-remaining"), Some("94"));
    assert_eq!(stack.upstream.executed(), 4);
}

/// Over Redis Cluster (three masters behind Envoy's redis_proxy): each
/// tenant's grant and give-back touch its own master, the give-back record
/// beside the bucket (same hash tag) included; nothing crosses slots.
#[test]
fn over_redis_cluster_each_tenants_tokens_go_back_to_its_own_master() {
    use support::cluster::{placement, tag, tenants, ClusterStack};
    let cfg = filter_config(3000)
        .hash_tag(r#"[{"header":"x-tenant"}]"#)
        .limits(
            r#"[{"name":"leased","match":{"pathPrefix":"/api/"},
            "descriptor":[{"header":"x-tenant"}],
            "tokenBucket":{"capacity":40,"refill":1,"periodMs":3600000},
            "lease":{"tokens":5,"ttlMs":600000}}]"#,
        )
        .build();
    let stack = ClusterStack::start(&cfg);
    let tenants = tenants(6);
    let placed = placement(&stack.cluster, &tenants);
    let e = &stack.envoys[0];
    // One request per tenant: each fetches its request plus 5 tokens.
    for t in &tenants {
        assert_eq!(get(&e.url("/api/x"), &[("x-tenant", t)]).status, 200);
    }
    assert_eq!(e.counter("redis_guard.lease.fetches"), 6);
    // The Envoy gets no more traffic: every tenant's 5 go back, each to
    // the master that owns the tenant's slot.
    let counts = || -> Vec<u64> {
        tenants
            .iter()
            .map(|t| {
                let node = placed[t];
                let keys = stack
                    .cluster
                    .keys_on(node, &format!("*{{{}}}*:ret", tag(t)));
                keys.first().map_or(0, |k| {
                    let record: Vec<u8> = redis::cmd("GET")
                        .arg(k)
                        .query(&mut stack.cluster.conn(node))
                        .unwrap();
                    f64::from_le_bytes(record[..8].try_into().unwrap()) as u64
                })
            })
            .collect()
    };
    poll_eq(
        "every tenant's 5 given back",
        vec![5; 6],
        Duration::from_secs(15),
        counts,
    );
    // The other Envoy admits each tenant's whole bucket but the first request.
    let other = &stack.envoys[1];
    for t in &tenants {
        let ok = (0..45)
            .filter(|_| get(&other.url("/api/x"), &[("x-tenant", t)]).status == 200)
            .count();
        assert_eq!(ok, 39, "tenant {t}");
    }
    assert_eq!(stack.upstream.executed(), 6 * 40);
    stack.assert_clean();
}
