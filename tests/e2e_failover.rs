//! A master killed under traffic: three Redis Cluster masters with one
//! replica each behind the `redis_proxy` Envoy (envoy/redis-cluster.yaml),
//! one Webdis, two filter Envoys, steady rate-limited and keyed traffic from
//! several threads, and one master SIGKILLed mid-stream. Its replica takes
//! over (`cluster-node-timeout` 1 s, tests/support/cluster.rs) and the test
//! measures what the filter's users see: how long decisions for the dead
//! master's tenants fail (the filter's failure mode, `deny` here: a 503),
//! whether their budgets stay exact (replication is asynchronous: a write
//! the master acknowledged but had not yet sent to its replica is lost with
//! it, and budget spent by it is given back), and how many idempotency
//! records completed before the kill are found after it (a lost record runs
//! again when retried). It prints the figures (README, Durability) and
//! asserts the bounds that hold on any machine.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use support::cluster::*;
use support::*;

/// Sliding window per tenant on /rl, ten minutes long: more than the
/// traffic of the test spends (at most about 11 a second per tenant), so
/// every limited request around the kill is decided by Redis and admitted,
/// and small enough that one tenant's rest is spent afterwards in a second.
const LIMIT: usize = 300;
/// `lockTtlMs` of the keyed requests: a lock whose owner met the kill (its
/// release could not reach the dead master) is gone this long after.
const LOCK_TTL_MS: u64 = 2000;
/// Client threads, each sending one request every CADENCE at most: steady
/// load (up to 200 a second) whatever the machine, about what two cores
/// serve through six Redis nodes, the proxy, Webdis and two Envoys.
const THREADS: usize = 4;
const CADENCE: Duration = Duration::from_millis(20);
/// Traffic before the kill (the replicas are in sync long before).
const WARM_UP: Duration = Duration::from_millis(2500);
/// How long every tenant must be decided without a failure before the
/// traffic stops.
const SETTLED: Duration = Duration::from_secs(2);
/// Bounds: the failover in the cluster; decisions back for every tenant
/// after the kill; decisions back after the promotion (the proxy asks the
/// nodes for the slot table every 250 ms, envoy/redis-cluster.yaml, and
/// each open breaker probes every COOL_DOWN_MS here: issue 30's goal, 1 s
/// from the promotion to the last failure's answer, is the bound, on top
/// of what the machine takes to answer any request then, measured); the
/// traffic.
const FAILOVER_LIMIT: Duration = Duration::from_secs(15);
const RECOVERY_LIMIT: Duration = Duration::from_secs(15);
const PROXY_LAG_LIMIT: Duration = Duration::from_millis(1000);
/// `circuitBreaker.coolDownMs`: what README "Failover" recommends for Redis
/// Cluster (an open breaker probes this often and finds the promoted
/// replica sooner).
const COOL_DOWN_MS: u64 = 250;
/// How often the test asks the killed master's replica for its role.
const ROLE_POLL: Duration = Duration::from_millis(2);
const TRAFFIC_LIMIT: Duration = Duration::from_secs(40);
const MAX_REQUESTS: usize = 40_000;
/// A write acknowledged this long before the kill has reached the replica:
/// on loopback a replica trails its master by well under a millisecond, so
/// a second is a wide margin, yet it stays a bound on what replication may
/// lose, not an assumption that it loses nothing.
const REPLICATION_WINDOW: Duration = Duration::from_secs(1);

fn config() -> String {
    filter_config(1000)
        .circuit_breaker(5, COOL_DOWN_MS)
        .hash_tag(r#"[{"header":"x-tenant"}]"#)
        .limits(&format!(
            r#"[{{"name":"w","match":{{"pathPrefix":"/rl"}},"descriptor":[{{"header":"x-tenant"}}],
                 "slidingWindow":{{"limit":{LIMIT},"windowMs":600000}}}}]"#
        ))
        .idempotency(&format!(
            r#"[{{"name":"pay","match":{{"pathPrefix":"/pay"}},"tenant":[{{"header":"x-tenant"}}],
                 "lockTtlMs":{LOCK_TTL_MS}}}]"#
        ))
        .build()
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// GET /rl: one unit of the tenant's window.
    Limited,
    /// POST /pay/<n> with its own idempotency key.
    Keyed,
}

/// One request of the traffic and its answer; times from the test's start.
#[derive(Clone, Debug)]
struct Sent {
    n: usize,
    tenant: usize,
    kind: Kind,
    sent: Duration,
    done: Duration,
    status: u16,
    replayed: bool,
}

impl Sent {
    fn path(&self) -> String {
        format!("/pay/{}", self.n)
    }

    fn key(&self) -> String {
        format!("key-{}", self.n)
    }
}

/// Request `n`: tenants in turn; each tenant's requests alternate between a
/// limited and a keyed one, and every two rounds between the two Envoys.
fn request(agent: &ureq::Agent, envoys: &[Envoy], tenants: &[String], n: usize) -> Sent {
    let tenant = n % tenants.len();
    let round = n / tenants.len();
    let kind = if round % 2 == 0 {
        Kind::Limited
    } else {
        Kind::Keyed
    };
    let e = &envoys[(round / 2) % 2];
    let t = tenants[tenant].as_str();
    let mut sent = Sent {
        n,
        tenant,
        kind,
        sent: Duration::ZERO,
        done: Duration::ZERO,
        status: 0,
        replayed: false,
    };
    let r = match kind {
        Kind::Limited => http_with(agent, "GET", &e.url("/rl"), &[("x-tenant", t)], None),
        Kind::Keyed => pay(agent, e, t, &sent),
    };
    sent.status = r.status;
    sent.replayed = r.header("idempotent-replayed") == Some("true");
    sent
}

fn pay(agent: &ureq::Agent, e: &Envoy, tenant: &str, s: &Sent) -> Resp {
    http_with(
        agent,
        "POST",
        &e.url(&s.path()),
        &[("idempotency-key", &s.key()), ("x-tenant", tenant)],
        Some(format!("{{\"n\":{}}}", s.n).as_bytes()),
    )
}

/// Executions per path, from the upstream's own count (one read).
fn executions(stack: &ClusterStack) -> BTreeMap<String, u64> {
    let stats = get(
        &format!("http://127.0.0.1:{}/__stats", stack.upstream.port),
        &[],
    )
    .json();
    stats["byPath"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(p, n)| (p.clone(), n.as_u64().unwrap()))
        .collect()
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// When the replica `con` is connected to took over, as it says itself:
/// asks its ROLE every ROLE_POLL (on a connection opened before the kill,
/// so no connect delays the answer) until it answers `master`, bounded by
/// `limit`. Returns the moment that answer came back, taken right then, and
/// the moment the last answer still saying replica came back: the promotion
/// happened between the two.
fn wait_promoted(
    con: &mut redis::Connection,
    t0: Instant,
    limit: Duration,
) -> (Duration, Duration) {
    let start = Instant::now();
    let mut replica_until = t0.elapsed();
    loop {
        let role: Vec<redis::Value> = redis::cmd("ROLE").query(con).unwrap();
        let now = t0.elapsed();
        match role.first() {
            Some(redis::Value::BulkString(r)) if r.as_slice() == b"master" => {
                return (now, replica_until)
            }
            // Redis says `slave`; a server may say `replica`.
            Some(redis::Value::BulkString(r))
                if [&b"slave"[..], b"replica"].contains(&r.as_slice()) =>
            {
                replica_until = now
            }
            other => panic!("ROLE answered {other:?}"),
        }
        assert!(
            start.elapsed() < limit,
            "the replica not promoted within {limit:?}"
        );
        std::thread::sleep(ROLE_POLL);
    }
}

/// Requests of `log` that match `f`.
fn count(log: &[Sent], f: impl Fn(&Sent) -> bool) -> usize {
    log.iter().filter(|r| f(r)).count()
}

#[test]
fn a_master_killed_under_traffic_fails_over_and_the_figures_stay_within_bounds() {
    let began = Instant::now();
    let mut stack = ClusterStack::start_with_replicas(&config());
    let tenants = tenants(9);
    let placed = placement(&stack.cluster, &tenants);
    let victim = placed[&tenants[0]];
    let on_victim: Vec<bool> = tenants.iter().map(|t| placed[t] == victim).collect();
    let replica = stack.cluster.replica_of(victim);
    let mut replica_con = admin_conn(replica);
    eprintln!(
        "stack up in {} ms; master {} (replica {replica}) holds {} of {} tenants",
        ms(began.elapsed()),
        stack.cluster.ports[victim],
        on_victim.iter().filter(|v| **v).count(),
        tenants.len()
    );

    // ---- Traffic; the kill and the failover under it. ---------------------
    let t0 = Instant::now();
    let log: Mutex<Vec<Sent>> = Mutex::new(Vec::new());
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let (kill_at, (promoted_at, replica_until), cluster_ok_at, stopped_at) = {
        let ClusterStack {
            envoys, cluster, ..
        } = &mut stack;
        let envoys: &[Envoy] = envoys;
        let last_failure_or = |at: Duration| {
            log.lock()
                .unwrap()
                .iter()
                .filter(|r| r.status == 503)
                .map(|r| r.done)
                .max()
                .unwrap_or(at)
        };
        std::thread::scope(|s| {
            for _ in 0..THREADS {
                s.spawn(|| {
                    let agent = agent();
                    let mut next_at = Instant::now();
                    while !stop.load(Ordering::SeqCst) && t0.elapsed() < TRAFFIC_LIMIT {
                        let n = next.fetch_add(1, Ordering::SeqCst);
                        if n >= MAX_REQUESTS {
                            return;
                        }
                        let sent = t0.elapsed();
                        let mut r = request(&agent, envoys, &tenants, n);
                        r.sent = sent;
                        r.done = t0.elapsed();
                        log.lock().unwrap().push(r);
                        next_at += CADENCE;
                        let now = Instant::now();
                        match next_at.checked_duration_since(now) {
                            Some(wait) => std::thread::sleep(wait),
                            None => next_at = now,
                        }
                    }
                });
            }
            std::thread::sleep(WARM_UP);
            let kill_at = cluster.kill_master(victim) - t0;
            let promoted = wait_promoted(&mut replica_con, t0, FAILOVER_LIMIT);
            let promoted_at = promoted.0;
            // Every survivor serves the slots again (for the slot table
            // the checks below read).
            assert_eq!(cluster.wait_failover(victim, FAILOVER_LIMIT), replica);
            let cluster_ok_at = t0.elapsed();
            // Until no tenant has met a failure for SETTLED (bounded).
            loop {
                std::thread::sleep(Duration::from_millis(100));
                let now = t0.elapsed();
                let quiet_since = last_failure_or(kill_at).max(promoted_at);
                if now >= quiet_since + SETTLED || now >= TRAFFIC_LIMIT {
                    break;
                }
            }
            stop.store(true, Ordering::SeqCst);
            (kill_at, promoted, cluster_ok_at, t0.elapsed())
        })
    };
    let log = log.into_inner().unwrap();
    let victims = |r: &Sent| on_victim[r.tenant];
    assert!(
        stopped_at < TRAFFIC_LIMIT && log.len() < MAX_REQUESTS,
        "decisions never settled: {} requests in {} ms",
        log.len(),
        ms(stopped_at)
    );
    let statuses: BTreeSet<u16> = log.iter().map(|r| r.status).collect();
    assert!(
        statuses.is_subset(&BTreeSet::from([200, 503])),
        "only admissions (the budgets are not spent) and the failure mode: {statuses:?}"
    );
    assert!(
        log.iter().all(|r| !r.replayed),
        "every key of the traffic is new"
    );
    assert!(
        log.iter().all(|r| r.status != 503 || r.done >= kill_at),
        "a failure before the kill"
    );
    // The kill met traffic: the dead master's tenants were being admitted
    // and their keys completed up to the last moment.
    let just_before = |kind: Kind| {
        count(&log, |r| {
            victims(r)
                && r.kind == kind
                && r.status == 200
                && kill_at.saturating_sub(Duration::from_millis(500)) <= r.done
                && r.done < kill_at
        })
    };
    assert!(
        just_before(Kind::Limited) > 0 && just_before(Kind::Keyed) > 0,
        "no traffic on the dead master's tenants in the 500 ms before the kill"
    );
    let promoted = promoted_at - kill_at;
    eprintln!(
        "{} requests in {} ms ({:.0}/s); killed at {} ms; the replica said master {} ms after \
         the kill (replica {} ms before that), every survivor ok {} ms after it",
        log.len(),
        ms(stopped_at),
        log.len() as f64 / stopped_at.as_secs_f64(),
        ms(kill_at),
        ms(promoted),
        ms(promoted_at - replica_until),
        ms(cluster_ok_at - promoted_at),
    );

    // ---- Recovery: the failure mode until the proxy reaches the replica. ---
    let failed = |of_victims: bool| -> Vec<&Sent> {
        log.iter()
            .filter(|r| victims(r) == of_victims && r.status == 503)
            .collect()
    };
    let (lost, others) = (failed(true), failed(false));
    let last = |f: &[&Sent]| f.iter().map(|r| r.done - kill_at).max();
    let recovered = last(&lost).expect("the dead master's tenants never failed");
    let recovered_all = recovered.max(last(&others).unwrap_or_default());
    let denied = stack.counter("redis_guard.failure_mode.denied");
    let short_circuited = stack.counter("redis_guard.circuit.short_circuited");
    // A call that timed out may have run (and charged) all the same.
    let timeouts = stack.counter("redis_guard.redis.errors_by_kind.timeout");
    eprintln!(
        "failure mode (503): {} requests of the dead master's tenants, the last answered {} ms \
         after the kill; {} of the other tenants', the last {} ms after; \
         stats: failure_mode.denied {denied}, redis.errors {} ({} of them Redis errors, \
         {timeouts} timeouts), redis.retries {}, circuit.opened {}, \
         circuit.short_circuited {short_circuited}",
        lost.len(),
        ms(recovered),
        others.len(),
        ms(last(&others).unwrap_or_default()),
        stack.counter("redis_guard.redis.errors"),
        stack.counter("redis_guard.redis.errors_by_kind.redis"),
        stack.counter("redis_guard.redis.retries"),
        stack.counter("redis_guard.circuit.opened"),
    );
    timeline(&log, &on_victim, kill_at, recovered_all);
    // Each tenant's slot group (the breaker's unit) and its 503s: a tenant
    // of a surviving master fails only while it shares a group with the
    // dead master's (the group's breaker opened on their failures).
    let group =
        |t: &str| redis_guard::breaker::Breakers::group(&redis_guard::keys::hash_tag_of([t]));
    let victim_groups: Vec<usize> = tenants
        .iter()
        .zip(&on_victim)
        .filter(|(_, v)| **v)
        .map(|(t, _)| group(t))
        .collect();
    let per_tenant: Vec<String> = tenants
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let n = log
                .iter()
                .filter(|r| r.tenant == i && r.status == 503)
                .count();
            let shares = !on_victim[i] && victim_groups.contains(&group(t));
            format!(
                "{t} group {}{} {n}",
                group(t),
                if shares { " (shared)" } else { "" }
            )
        })
        .collect();
    eprintln!("503s by tenant: {}", per_tenant.join(", "));
    let mut reasons: Vec<String> = stack
        .envoys
        .iter()
        .flat_map(|e| {
            e.log()
                .lines()
                .filter_map(|l| {
                    l.split_once("undecided, denying: ")
                        .map(|(_, why)| why.to_string())
                })
                .collect::<Vec<_>>()
        })
        .collect();
    reasons.sort();
    reasons.dedup();
    eprintln!("why undecided: {reasons:?}");
    // Every 503 is the filter's failure mode, counted as such.
    assert_eq!((lost.len() + others.len()) as u64, denied);
    // The surviving masters' tenants are served through the failover: at
    // most 1% of their requests in the window fail (issue 30's bound; the
    // breaker is per slot group of each call's own keys, keyed requests'
    // included, so none of them is short-circuited).
    let others_in_window = count(&log, |r| {
        !victims(r) && r.sent >= kill_at && r.sent <= kill_at + recovered
    });
    eprintln!(
        "the other tenants: {} of {others_in_window} requests in the failover window failed",
        others.len()
    );
    assert!(others_in_window > 0, "no traffic on the surviving masters");
    assert!(
        others.len() * 100 <= others_in_window,
        "{} of the surviving masters' {others_in_window} requests failed: over 1%",
        others.len()
    );
    // The dead master's slots went unserved at least until the others had
    // flagged it (NODE_TIMEOUT_MS), and everything was back within the bound.
    assert!(
        recovered >= Duration::from_millis(NODE_TIMEOUT_MS),
        "failures stopped {} ms after the kill: before any failover could happen",
        ms(recovered)
    );
    assert!(
        recovered_all < RECOVERY_LIMIT,
        "decisions failed until {} ms after the kill",
        ms(recovered_all)
    );
    // The proxy followed the failover soon after the promotion: the last
    // failure of the dead master's tenants was answered within
    // PROXY_LAG_LIMIT of the moment the replica said it was master. On top
    // of it, the longest any surviving tenant's request took to be answered
    // in the failover window: what the machine takes to answer anything
    // then (it is slower under load), and no failure's answer can come
    // sooner after its cause than that. Every failure here is the proxy's
    // immediate "upstream failure" for the dead master or the breaker's
    // short circuit, not the filter's 1 s timeout: one that timed out after
    // the promotion would be a call the proxy held, and fails this.
    let slowest = log
        .iter()
        .filter(|r| !victims(r) && r.sent >= kill_at && r.done <= kill_at + recovered_all)
        .map(|r| r.done - r.sent)
        .max()
        .unwrap_or_default();
    let lag = (kill_at + recovered).saturating_sub(promoted_at);
    eprintln!(
        "the last failure answered {} ms after the promotion (bound {} ms + {} ms, the slowest \
         answer to a surviving tenant in the window)",
        ms(lag),
        ms(PROXY_LAG_LIMIT),
        ms(slowest)
    );
    assert!(
        lag < PROXY_LAG_LIMIT + slowest,
        "a failure answered {} ms after the promotion (bound {} + {} ms)",
        ms(lag),
        ms(PROXY_LAG_LIMIT),
        ms(slowest)
    );
    // Then SETTLED of successes for every tenant.
    for (i, t) in tenants.iter().enumerate() {
        let ok = count(&log, |r| {
            r.tenant == i && r.status == 200 && r.sent > kill_at + recovered_all
        });
        assert!(ok > 0, "{t} decided again after the recovery");
    }

    // ---- Budgets: admitted against what the masters hold now. -------------
    let mut given_back = BTreeMap::new();
    for (i, t) in tenants.iter().enumerate() {
        let admitted = count(&log, |r| {
            r.tenant == i && r.kind == Kind::Limited && r.status == 200
        });
        let node = placed[t];
        let keys = stack
            .cluster
            .keys_on(node, &format!("rg:rl:{{{}}}:*", tag(t)));
        assert_eq!(keys.len(), 1, "{t}: {keys:?}");
        let held: usize = redis::cmd("ZCARD")
            .arg(&keys[0])
            .query(&mut stack.cluster.conn(node))
            .unwrap();
        if !on_victim[i] {
            // Its master lived: exact, but for a call of this tenant's that
            // may have run with its answer lost (a timeout), and those took
            // the failure mode: at most this tenant's own 503s.
            let failed = count(&log, |r| {
                r.tenant == i && r.kind == Kind::Limited && r.status == 503
            });
            assert!(
                (admitted..=admitted + failed).contains(&held),
                "{t}: {admitted} admitted, {held} held, {failed} failed"
            );
        }
        given_back.insert(t.clone(), (admitted, held, admitted as i64 - held as i64));
    }
    // What replication may have lost: the dead master's admissions answered
    // within REPLICATION_WINDOW before the kill, or after it (the old master
    // decided those: nobody else served its slots until the promotion).
    let window = count(&log, |r| {
        victims(r)
            && r.kind == Kind::Limited
            && r.status == 200
            && kill_at.saturating_sub(REPLICATION_WINDOW) <= r.done
            && r.done <= promoted_at
    }) as i64;
    // What a kill may have charged without admitting: a decision made, its
    // answer lost with the master (the filter took its failure mode).
    let cut_off = count(&log, |r| {
        victims(r) && r.kind == Kind::Limited && r.status == 503 && r.sent < kill_at
    }) as i64
        + timeouts as i64;
    let victims_given_back: i64 = given_back
        .iter()
        .filter(|(t, _)| placed[*t] == victim)
        .map(|(_, (_, _, g))| g)
        .sum();
    eprintln!(
        "budgets (admitted, held in Redis, given back): {given_back:?}; the dead master's \
         tenants: {victims_given_back} given back (bounds: -{cut_off} cut off at the kill or \
         timed out, {window} admitted in the replication window)"
    );
    assert!(
        (-cut_off..=window).contains(&victims_given_back),
        "given back {victims_given_back}, outside [-{cut_off}, {window}]"
    );
    // Afterwards the budget is exact: tenant 0 gets what the new master's
    // window has left, not one more, from either Envoy.
    let (admitted0, held0, given_back0) = given_back[&tenants[0]];
    let left = LIMIT - held0;
    let drain: Vec<usize> = (0..left + 3).collect();
    let drained = run_jobs(
        &drain,
        THREADS,
        Duration::from_secs(30),
        agent,
        |a, i, _| {
            let e = &stack.envoys[i % 2];
            http_with(a, "GET", &e.url("/rl"), &[("x-tenant", &tenants[0])], None).status
        },
    );
    assert_eq!(
        (
            drained.iter().filter(|s| **s == 200).count(),
            drained.iter().filter(|s| **s == 429).count()
        ),
        (left, 3),
        "{}: exactly the {left} the window has left",
        tenants[0]
    );
    eprintln!(
        "{}: {} admitted over the test against a budget of {LIMIT} ({given_back0} over)",
        tenants[0],
        admitted0 + left
    );

    // ---- Idempotency: every key retried once the cluster is back. ---------
    let before = executions(&stack);
    let keyed: Vec<&Sent> = log.iter().filter(|r| r.kind == Kind::Keyed).collect();
    let retry = |rs: &[&Sent]| -> Vec<(u16, bool)> {
        run_jobs(
            rs,
            THREADS,
            Duration::from_secs(60),
            agent,
            |agent, i, r| {
                let resp = pay(agent, &stack.envoys[(i + 1) % 2], &tenants[r.tenant], r);
                (
                    resp.status,
                    resp.header("idempotent-replayed") == Some("true"),
                )
            },
        )
    };
    let mut answers = retry(&keyed);
    // A lock whose owner met the kill (its release could not reach the dead
    // master) answers 409 until its TTL ends; then the key runs.
    let locked: Vec<usize> = (0..keyed.len()).filter(|i| answers[*i].0 == 409).collect();
    if !locked.is_empty() {
        std::thread::sleep(Duration::from_millis(LOCK_TTL_MS + 200));
        let again = retry(&locked.iter().map(|i| keyed[*i]).collect::<Vec<_>>());
        for (i, a) in locked.iter().zip(again) {
            answers[*i] = a;
        }
    }
    let after = executions(&stack);
    let mut table: BTreeMap<(&str, &str, &str), usize> = BTreeMap::new();
    let mut ran_again = 0;
    for (r, (status, replayed)) in keyed.iter().zip(&answers) {
        let when = match r.status {
            200 if r.done < kill_at => "completed before the kill",
            200 if r.sent > kill_at + recovered_all => "completed after the recovery",
            200 => "completed during the failover",
            _ => "failure mode",
        };
        let whose = if on_victim[r.tenant] {
            "dead master's"
        } else {
            "other"
        };
        let outcome = match (status, replayed) {
            (200, true) => "replayed",
            (200, false) => "executed",
            (409, _) => "409 after the lock's TTL",
            _ => "other",
        };
        *table.entry((when, whose, outcome)).or_insert(0) += 1;
        // The upstream's count agrees with the answer, key by key.
        let path = r.path();
        let ran = after.get(&path).copied().unwrap_or(0) - before.get(&path).copied().unwrap_or(0);
        assert_eq!(ran, u64::from(outcome == "executed"), "{path}");
        assert_eq!(
            after.get(&path).copied().unwrap_or(0),
            u64::from(r.status == 200) + ran
        );
        match (when, outcome) {
            // Never ran (the failure mode answered before the upstream): runs now.
            ("failure mode", o) => assert_eq!(o, "executed", "{path}"),
            ("completed after the recovery", o) => assert_eq!(o, "replayed", "{path}"),
            (_, "executed") => ran_again += 1,
            (_, o) => assert_eq!(o, "replayed", "{path}"),
        }
        if when == "completed before the kill"
            && (!on_victim[r.tenant] || r.done + REPLICATION_WINDOW < kill_at)
        {
            assert_eq!(
                outcome, "replayed",
                "{path}: a record long replicated ({when})"
            );
        }
    }
    let store_failed = stack.counter("redis_guard.idempotency.store_failed");
    let completed_before = count(&log, |r| {
        victims(r) && r.kind == Kind::Keyed && r.status == 200 && r.done < kill_at
    });
    let found_before = table
        .get(&("completed before the kill", "dead master's", "replayed"))
        .copied()
        .unwrap_or(0);
    // The keys that may run again: a response delivered while its record
    // could not be written (idempotency.store_failed), or a record the old
    // master acknowledged in the replication window.
    let record_window = count(&log, |r| {
        victims(r)
            && r.kind == Kind::Keyed
            && r.status == 200
            && kill_at.saturating_sub(REPLICATION_WINDOW) <= r.done
            && r.done <= promoted_at
    });
    eprintln!(
        "keyed retries ((original, tenant, retry) -> keys): {table:?}; {} locks waited out; \
         idempotency.store_failed {store_failed}; records of the dead master's tenants \
         completed before the kill: {found_before} of {completed_before} found",
        locked.len()
    );
    assert!(completed_before > 0);
    assert!(
        ran_again as u64 <= store_failed + record_window as u64,
        "{ran_again} keys ran again; {store_failed} stores failed, {record_window} in the window"
    );
    // Nothing reached the upstream that no answer accounts for.
    let limited = count(&log, |r| r.kind == Kind::Limited && r.status == 200);
    let keyed_ran = count(&log, |r| r.kind == Kind::Keyed && r.status == 200);
    let retried_ran = answers.iter().filter(|(s, rep)| *s == 200 && !rep).count();
    assert_eq!(
        stack.upstream.executed(),
        (limited + left + keyed_ran + retried_ran) as u64
    );
    eprintln!("total {} ms", ms(began.elapsed()));
}

/// Outcomes per 250 ms from 500 ms before the kill to 500 ms after the
/// last failure: `ok/failed` for the dead master's tenants, then the others'.
fn timeline(log: &[Sent], on_victim: &[bool], kill_at: Duration, until: Duration) {
    let step = Duration::from_millis(250);
    let mut line = String::new();
    let mut at = kill_at.saturating_sub(2 * step);
    while at < kill_at + until + 2 * step {
        let cell = |v: bool, status: u16| {
            count(log, |r| {
                on_victim[r.tenant] == v && r.status == status && at <= r.done && r.done < at + step
            })
        };
        line.push_str(&format!(
            " {:+}ms {}/{} {}/{};",
            at.as_millis() as i64 - kill_at.as_millis() as i64,
            cell(true, 200),
            cell(true, 503),
            cell(false, 200),
            cell(false, 503)
        ));
        at += step;
    }
    eprintln!("timeline (ok/failed, dead master's tenants then the others):{line}");
}
