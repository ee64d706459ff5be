//! Redis Cluster end to end: three real `redis-server --cluster-enabled`
//! masters, an Envoy running `redis_proxy` over an `envoy.clusters.redis`
//! cluster (envoy/redis-cluster.yaml) in front of them, one Webdis pointed at
//! that proxy, and two filter Envoys sharing it; all on loopback.
//!
//! The filter is unchanged: it still talks to one Webdis, which talks to one
//! RESP endpoint. What must hold is that the guarantees stay exact when the
//! keys of different tenants live on different masters, that no script call
//! crosses slots, and that a master without the script recovers by itself.
//! And that only the Envoys reach the nodes: they run envoy/redis.acl's
//! users plus the proxy's own, Webdis authenticates to the proxy, and no
//! node refuses the proxy anything it needs (`ClusterStack::assert_clean`).
//!
//! The harness (the cluster, the proxy, the stack and the tenant placement)
//! is tests/support/cluster.rs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use support::cluster::*;
use support::*;

/// Every key of a request hash-tagged by its tenant, so a tenant's keys
/// share one slot.
fn config(limits: &str, idempotency: &str) -> String {
    filter_config(3000)
        .hash_tag(r#"[{"header":"x-tenant"}]"#)
        .limits(limits)
        .idempotency(idempotency)
        .build()
}

// ---------------------------------------------------------------------------

#[test]
fn rate_limits_hold_exactly_across_two_envoys_over_the_cluster() {
    const SW: usize = 4;
    const TB: usize = 3;
    const PER_TENANT: usize = 8;
    let cfg = config(
        &format!(
            r#"[{{"name":"sw","match":{{"pathPrefix":"/sw"}},"descriptor":[{{"header":"x-tenant"}}],
                 "slidingWindow":{{"limit":{SW},"windowMs":600000}}}},
                {{"name":"tb","match":{{"pathPrefix":"/tb"}},"descriptor":[{{"header":"x-tenant"}}],
                 "tokenBucket":{{"capacity":{TB},"refill":1,"periodMs":3600000}}}}]"#
        ),
        "[]",
    );
    let stack = ClusterStack::start(&cfg);
    let tenants = tenants(16);
    let placed = placement(&stack.cluster, &tenants);

    // Tenant by tenant, so the threads race on one tenant's key at a time;
    // consecutive requests alternate between the two Envoys.
    let mut jobs = Vec::new();
    for t in &tenants {
        for path in ["/sw", "/tb"] {
            jobs.extend((0..PER_TENANT).map(|_| (t.as_str(), path)));
        }
    }
    let statuses = run_jobs(
        &jobs,
        8,
        Duration::from_secs(20),
        agent,
        |agent, i, (t, path)| {
            let e = &stack.envoys[i % 2];
            http_with(agent, "GET", &e.url(path), &[("x-tenant", t)], None).status
        },
    );
    let mut per: BTreeMap<(&str, &str), BTreeMap<u16, usize>> = BTreeMap::new();
    for ((t, path), status) in jobs.iter().zip(&statuses) {
        *per.entry((t, path))
            .or_default()
            .entry(*status)
            .or_insert(0) += 1;
    }
    for t in &tenants {
        for (path, limit) in [("/sw", SW), ("/tb", TB)] {
            assert_eq!(
                per[&(t.as_str(), path)],
                BTreeMap::from([(200, limit), (429, PER_TENANT - limit)]),
                "{t} {path}: exactly the limit admitted over both Envoys"
            );
        }
    }
    let admitted = tenants.len() * (SW + TB);
    assert_eq!(stack.upstream.executed(), admitted as u64);
    assert_eq!(
        stack.counter("redis_guard.ratelimit.sw.allowed"),
        (tenants.len() * SW) as u64
    );
    assert_eq!(
        stack.counter("redis_guard.ratelimit.tb.rejected"),
        (tenants.len() * (PER_TENANT - TB)) as u64
    );
    for e in &stack.envoys {
        assert!(
            e.counter("redis_guard.ratelimit.sw.allowed") > 0,
            "both took part"
        );
    }
    // Every decision Redis made rode a batch (on by default), each batch of
    // one tenant's tag, so of one slot: none failed (a CROSSSLOT would).
    let batch_calls = stack.counter("redis_guard.batch.calls");
    let decided = jobs.len() as u64 - stack.counter("redis_guard.overlimit_cache.rejected");
    assert!(
        (1..=decided).contains(&batch_calls),
        "{batch_calls} batch calls for {decided} decisions"
    );
    assert_eq!(stack.counter("redis_guard.redis.errors"), 0);

    // Exactly one key per tenant and limit, each on the master that owns its
    // slot, which is the master the tenant's tag maps to: all three are used.
    let by_node = stack.cluster.keys_by_node("rg:*");
    let mut seen = BTreeSet::new();
    for (node, keys) in &by_node {
        for key in keys {
            assert!(
                key.starts_with(b"rg:rl:"),
                "{}",
                String::from_utf8_lossy(key)
            );
            let t = tenants
                .iter()
                .find(|t| tag(t) == tag_in(key))
                .unwrap_or_else(|| panic!("unknown tag in {}", String::from_utf8_lossy(key)));
            assert_eq!(
                placed[t], *node,
                "{t}'s keys belong on master {}",
                placed[t]
            );
            assert!(seen.insert((t.clone(), limit_in(key))), "duplicate key");
        }
    }
    assert_eq!(seen.len(), tenants.len() * 2, "{seen:?}");
    assert_eq!(by_node.len(), MASTERS, "keys spread over every master");
    // The sliding window's state is exact too: one member per admitted request.
    for (node, keys) in &by_node {
        for key in keys.iter().filter(|k| limit_in(k) == "sw") {
            let n: usize = redis::cmd("ZCARD")
                .arg(key)
                .query(&mut stack.cluster.conn(*node))
                .unwrap();
            assert_eq!(n, SW);
        }
    }
    stack.assert_clean();
}

#[test]
fn idempotency_holds_over_the_cluster() {
    const CONCURRENT: usize = 8;
    let cfg = config(
        // A limit on the same requests: the acquire call carries two keys
        // (the limit's and the record's) that must share one slot.
        r#"[{"name":"pay-rate","match":{"pathPrefix":"/pay"},"descriptor":[{"header":"x-tenant"}],
             "slidingWindow":{"limit":100,"windowMs":600000}}]"#,
        r#"[{"name":"pay","match":{"pathPrefix":"/pay"},"tenant":[{"header":"x-tenant"}],
             "storeHeaders":["content-type"]}]"#,
    );
    let stack = ClusterStack::start(&cfg);
    let tenants = tenants(9);
    let placed = placement(&stack.cluster, &tenants);

    // Round by round: each tenant's duplicates are spread over the burst and
    // over both Envoys; the upstream holds the first one for 300 ms.
    let jobs: Vec<&str> = (0..CONCURRENT)
        .flat_map(|_| tenants.iter().map(String::as_str))
        .collect();
    let answers = run_jobs(&jobs, 12, Duration::from_secs(20), agent, |agent, i, t| {
        let e = &stack.envoys[i % 2];
        let r = http_with(
            agent,
            "POST",
            &e.url(&format!("/pay/{t}")),
            &[
                ("idempotency-key", "order-1"),
                ("x-tenant", t),
                ("x-upstream-delay-ms", "300"),
            ],
            Some(format!("{{\"tenant\":\"{t}\"}}").as_bytes()),
        );
        let replayed = r.header("idempotent-replayed").map(str::to_string);
        (r.status, replayed, r.body)
    });
    let mut originals = BTreeMap::new();
    for t in &tenants {
        let mine: Vec<_> = jobs
            .iter()
            .zip(&answers)
            .filter(|(j, _)| *j == t)
            .map(|(_, a)| a)
            .collect();
        let first: Vec<_> = mine
            .iter()
            .filter(|(s, rep, _)| *s == 200 && rep.is_none())
            .collect();
        assert_eq!(first.len(), 1, "{t}: one original answer");
        let others = mine
            .iter()
            .filter(|(s, rep, _)| *s == 409 || (*s == 200 && rep.as_deref() == Some("true")))
            .count();
        assert_eq!(others, CONCURRENT - 1, "{t}: the rest are 409s or replays");
        originals.insert(t.clone(), first[0].2.clone());
        assert_eq!(stack.upstream.executions_of(&format!("/pay/{t}")), 1, "{t}");
    }
    // Every later retry, on either Envoy, replays the stored answer.
    for t in &tenants {
        for e in &stack.envoys {
            let r = http(
                "POST",
                &e.url(&format!("/pay/{t}")),
                &[("idempotency-key", "order-1"), ("x-tenant", t)],
                Some(format!("{{\"tenant\":\"{t}\"}}").as_bytes()),
            );
            assert_eq!(r.status, 200, "{t}");
            assert_eq!(r.header("idempotent-replayed"), Some("true"), "{t}");
            assert_eq!(r.header("content-type"), Some("application/json"));
            assert_eq!(r.body, originals[t], "{t}: byte-identical replay");
        }
        assert_eq!(stack.upstream.executions_of(&format!("/pay/{t}")), 1, "{t}");
    }
    assert_eq!(stack.upstream.executed(), tenants.len() as u64);
    assert_eq!(
        stack.counter("redis_guard.idempotency.stored"),
        tenants.len() as u64
    );

    // One COMPLETED record per tenant, next to the tenant's limit key, on
    // the master owning the tenant's slot; the records span the cluster.
    let records = stack.cluster.keys_by_node("rg:idem:*");
    let mut found = BTreeSet::new();
    for (node, keys) in &records {
        for key in keys {
            let t = tenants.iter().find(|t| tag(t) == tag_in(key)).unwrap();
            assert_eq!(placed[t], *node, "{t}");
            let state: Option<String> = redis::cmd("HGET")
                .arg(key)
                .arg("s")
                .query(&mut stack.cluster.conn(*node))
                .unwrap();
            assert_eq!(state.as_deref(), Some("C"), "{t}: completed, not locked");
            assert!(found.insert(t.clone()), "{t}: one record");
            let limit_keys = stack
                .cluster
                .keys_on(*node, &format!("rg:rl:{{{}}}:*", tag(t)));
            assert_eq!(limit_keys.len(), 1, "{t}: its limit key on the same master");
        }
    }
    assert_eq!(found.len(), tenants.len());
    assert_eq!(records.len(), MASTERS, "records spread over every master");
    stack.assert_clean();
}

/// One sliding window of `limit` per tenant, ten minutes long.
fn window_per_tenant(limit: usize) -> String {
    config(
        &format!(
            r#"[{{"name":"w","descriptor":[{{"header":"x-tenant"}}],
                 "slidingWindow":{{"limit":{limit},"windowMs":600000}}}}]"#
        ),
        "[]",
    )
}

#[test]
fn noscript_is_handled_per_node() {
    const LIMIT: usize = 6;
    let cfg = window_per_tenant(LIMIT);
    let stack = ClusterStack::start(&cfg);
    let tenants = tenants(12);
    placement(&stack.cluster, &tenants);
    let reloads = || stack.counter("redis_guard.redis.script_reloads");
    // One request at a time, alternating Envoys: every tenant spends one.
    let one_each = |round: usize| {
        for (i, t) in tenants.iter().enumerate() {
            let e = &stack.envoys[(i + round) % 2];
            let r = get(&e.url("/x"), &[("x-tenant", t)]);
            assert_eq!(r.status, 200, "{t} round {round}");
            assert_eq!(
                r.header("x-ratelimit-remaining"),
                Some((LIMIT - 1 - round).to_string().as_str()),
                "{t} round {round}"
            );
        }
    };

    // Sequential requests are deterministic: with one call in flight at a
    // time, the first EVALSHA a master sees answers NOSCRIPT, the EVAL that
    // follows goes to the same master (same first key) and caches the script
    // there, and no later call to that master misses it. So the reloads are
    // exactly the masters (a fresh cluster has no script anywhere, and the
    // tenants span all three), whichever Envoy or worker sent the call.
    one_each(0);
    assert_eq!(
        reloads(),
        MASTERS as u64,
        "a fresh cluster: one load per master"
    );
    one_each(1);
    assert_eq!(reloads(), MASTERS as u64, "cached on every master now");
    stack.cluster.flush_scripts();
    one_each(2);
    assert_eq!(
        reloads(),
        2 * MASTERS as u64,
        "after SCRIPT FLUSH each master needs its own reload"
    );

    // Concurrent requests: several EVALSHAs can reach a flushed master
    // before the first EVAL has cached the script there, and each of those
    // reloads. The count then depends on the interleaving: what is certain
    // is at least one reload per master (each got traffic and had no script)
    // and at most one per request. The limits stay exact either way.
    stack.cluster.flush_scripts();
    let before = reloads();
    let per_tenant = 6;
    let jobs: Vec<&str> = (0..per_tenant)
        .flat_map(|_| tenants.iter().map(String::as_str))
        .collect();
    let statuses = run_jobs(&jobs, 8, Duration::from_secs(20), agent, |agent, i, t| {
        let e = &stack.envoys[i % 2];
        http_with(agent, "GET", &e.url("/x"), &[("x-tenant", t)], None).status
    });
    for t in &tenants {
        let mut counts = BTreeMap::new();
        for (_, s) in jobs.iter().zip(&statuses).filter(|(j, _)| *j == t) {
            *counts.entry(*s).or_insert(0) += 1;
        }
        let left = LIMIT - 3;
        assert_eq!(
            counts,
            BTreeMap::from([(200, left), (429, per_tenant - left)]),
            "{t}: exactly what was left of the window, no 5xx"
        );
    }
    let grew = reloads() - before;
    assert!(
        (MASTERS as u64..=jobs.len() as u64).contains(&grew),
        "reloads after the second flush: {grew}"
    );
    assert_eq!(
        stack.upstream.executed(),
        (tenants.len() * LIMIT) as u64,
        "every admitted request and nothing else"
    );
    // The scripts these requests ride are cached on every master again:
    // unkeyed requests are batched (the default), so each master holds the
    // batch script (batches of one tag, on that tag's master), the single
    // one (a request that found its worker quiet went alone), or both.
    for node in 0..MASTERS {
        let cached: Vec<bool> = redis::cmd("SCRIPT")
            .arg("EXISTS")
            .arg(redis_guard::scripts::BATCH.sha1.as_str())
            .arg(redis_guard::scripts::RATELIMIT.sha1.as_str())
            .query(&mut stack.cluster.conn(node))
            .unwrap();
        assert!(cached.contains(&true), "master {node}: {cached:?}");
    }
    stack.assert_clean();
}

#[test]
fn calls_with_several_keys_never_cross_slots() {
    let cfg = config(
        r#"[{"name":"tenant","descriptor":[{"header":"x-tenant"}],
             "slidingWindow":{"limit":50,"windowMs":600000}},
            {"name":"user","match":{"pathPrefix":"/x"},
             "descriptor":[{"header":"x-tenant"},{"header":"x-user"}],
             "tokenBucket":{"capacity":2,"refill":1,"periodMs":3600000}},
            {"name":"method","descriptor":[{"header":"x-tenant"},"method"],
             "slidingWindow":{"limit":50,"windowMs":600000}}]"#,
        r#"[{"name":"pay","match":{"pathPrefix":"/pay"},"tenant":[{"header":"x-tenant"}]}]"#,
    );
    let stack = ClusterStack::start(&cfg);

    // The proxy does not hide CROSSSLOT: two keys of different slots in one
    // call reach a master and come back as its error. So the filter never
    // seeing one (assert_clean) means its keys always shared a slot.
    assert!(
        stack
            .proxy
            .command(&["EVAL", "return 1", "2", "rg:a", "rg:b"])
            .starts_with("-CROSSSLOT"),
        "a cross-slot call is refused by the master"
    );

    let tenants = tenants(12);
    let placed = placement(&stack.cluster, &tenants);
    for (i, t) in tenants.iter().enumerate() {
        // Three keys per call: tenant, user and method limits.
        let statuses: Vec<u16> = (0..3)
            .map(|k| {
                let e = &stack.envoys[(i + k) % 2];
                get(&e.url("/x"), &[("x-tenant", t), ("x-user", "u")]).status
            })
            .collect();
        assert_eq!(statuses, [200, 200, 429], "{t}");
        // Three keys again: tenant and method limits plus the record.
        let pay = |e: &Envoy| {
            http(
                "POST",
                &e.url("/pay"),
                &[("x-tenant", t), ("idempotency-key", "k")],
                Some(b"{}"),
            )
        };
        let first = pay(&stack.envoys[i % 2]);
        assert_eq!(first.status, 200, "{t}");
        let again = pay(&stack.envoys[(i + 1) % 2]);
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{t}");
    }

    // Every key of a tenant sits in one slot on the tenant's master: the
    // three limit keys and the record.
    let by_node = stack.cluster.keys_by_node("rg:*");
    let mut per_tenant: BTreeMap<String, BTreeSet<(usize, u16)>> = BTreeMap::new();
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    for (node, keys) in &by_node {
        for key in keys {
            let t = tenants.iter().find(|t| tag(t) == tag_in(key)).unwrap();
            per_tenant
                .entry(t.clone())
                .or_default()
                .insert((*node, stack.cluster.slot_of(key)));
            *count.entry(t.clone()).or_insert(0) += 1;
        }
    }
    for t in &tenants {
        let places = &per_tenant[t];
        assert_eq!(places.len(), 1, "{t}: one slot, one master: {places:?}");
        assert_eq!(places.iter().next().unwrap().0, placed[t], "{t}");
        // tenant, user, method (GET), method (POST), the record.
        assert_eq!(count[t], 5, "{t}");
    }
    assert_eq!(by_node.len(), MASTERS);
    assert_eq!(
        stack
            .proxy
            .stat("redis.cluster_proxy.splitter.invalid_request"),
        0
    );
    stack.assert_clean();
}

#[test]
fn a_tenant_whose_slot_moves_to_another_master_keeps_its_exact_budget() {
    const LIMIT: usize = 6;
    let cfg = window_per_tenant(LIMIT);
    let mut stack = ClusterStack::start(&cfg);
    let t = "tenant-moving";
    let slot = stack.cluster.slot_of(format!("{{{}}}", tag(t)).as_bytes());
    let from = stack.cluster.owner(slot);
    let to = (from + 1) % MASTERS;
    let mut n = 0;
    let mut send = |stack: &ClusterStack| {
        n += 1;
        get(&stack.envoys[n % 2].url("/x"), &[("x-tenant", t)]).status
    };
    let redirects = |stack: &ClusterStack| {
        stack
            .proxy
            .stat("cluster.redis_cluster.upstream_internal_redirect_succeeded_total")
    };
    let window_on = |stack: &ClusterStack, node: usize| -> Vec<usize> {
        stack
            .cluster
            .keys_on(node, "rg:rl:*")
            .iter()
            .map(|k| {
                // ASKING: the target of a migration answers for an importing
                // slot only to a client that says it was sent there.
                let mut con = stack.cluster.conn(node);
                let _: () = redis::cmd("ASKING").query(&mut con).unwrap();
                redis::cmd("ZCARD").arg(k).query(&mut con).unwrap()
            })
            .collect()
    };

    assert_eq!([send(&stack), send(&stack)], [200, 200]);
    assert_eq!(window_on(&stack, from), [2]);
    // Slot migrating, key not moved yet: the source still serves it.
    stack.cluster.begin_migration(slot, from, to);
    assert_eq!(send(&stack), 200);
    assert_eq!(window_on(&stack, from), [3]);
    // Key moved, slot not handed over: the source answers ASK, Envoy follows
    // it to the target, where the window goes on from the moved state.
    stack.cluster.move_keys(slot, from, to);
    let before = redirects(&stack);
    assert_eq!(send(&stack), 200);
    assert!(redirects(&stack) > before, "the call was redirected (ASK)");
    assert_eq!(window_on(&stack, from), Vec::<usize>::new());
    assert_eq!(window_on(&stack, to), [4]);
    // Slot handed over: Envoy's slot table is stale until its next refresh,
    // so calls meet MOVED (followed) or go straight to the new owner.
    stack.cluster.finish_migration(slot, to);
    let rest: Vec<u16> = (0..4).map(|_| send(&stack)).collect();
    assert_eq!(rest, [200, 200, 429, 429], "exactly {LIMIT} in all");
    assert_eq!(window_on(&stack, to), [LIMIT]);
    assert_eq!(stack.upstream.executed(), LIMIT as u64);
    let by_node = stack.cluster.keys_by_node("rg:*");
    assert_eq!(by_node.keys().copied().collect::<Vec<_>>(), [to]);
    stack.assert_clean();
}

#[test]
fn concurrency_slots_hold_exactly_per_tenant_over_the_cluster_and_stay_when_clients_leave() {
    const MAX: usize = 2;
    let cfg = config(
        &format!(
            r#"[{{"name":"cc","match":{{"pathPrefix":"/cc"}},"descriptor":[{{"header":"x-tenant"}}],
                 "concurrency":{{"max":{MAX},"leaseMs":30000}}}}]"#
        ),
        "[]",
    );
    let stack = ClusterStack::start(&cfg);
    let tenants = tenants(6);
    // Six requests per tenant at once, each running 2 s upstream: exactly
    // MAX per tenant get in, each tenant's slots on its own master.
    let jobs: Vec<&str> = tenants
        .iter()
        .flat_map(|t| std::iter::repeat_n(t.as_str(), 6))
        .collect();
    let statuses = run_jobs(
        &jobs,
        jobs.len(),
        Duration::from_secs(30),
        agent,
        |agent, i, t| {
            let e = &stack.envoys[i % 2];
            let headers = [("x-tenant", *t), ("x-upstream-delay-ms", "2000")];
            http_with(agent, "GET", &e.url(&format!("/cc?{t}")), &headers, None).status
        },
    );
    for t in &tenants {
        let mine: Vec<u16> = jobs
            .iter()
            .zip(&statuses)
            .filter(|(j, _)| **j == t.as_str())
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(
            mine.iter().filter(|s| **s == 200).count(),
            MAX,
            "{t}: {mine:?}"
        );
        assert_eq!(mine.iter().filter(|s| **s == 429).count(), 6 - MAX, "{t}");
        assert_eq!(
            stack.upstream.peak_in_flight(&format!("/cc?{t}")),
            MAX as u64
        );
    }
    // Released as each response completed: no slot left on any master.
    assert!(stack.cluster.keys_by_node("rg:*").is_empty());

    // Clients of every tenant leave at once while the upstream works: each
    // tenant's slots stay taken on its own master until their lease ends
    // (the upstream may still run those requests), with a TTL that ends them.
    let mut held = Vec::new();
    for t in &tenants {
        for _ in 0..MAX {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", stack.envoys[0].port)).unwrap();
            let req = raw_request_bytes(
                "GET",
                &format!("/cc?left-{t}"),
                "",
                &[
                    ("x-tenant", t.as_bytes()),
                    ("x-upstream-delay-ms", b"10000"),
                ],
                b"",
            );
            std::io::Write::write_all(&mut s, &req).unwrap();
            held.push(s);
        }
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let running = || {
        tenants
            .iter()
            .map(|t| stack.upstream.in_flight(&format!("/cc?left-{t}")))
            .sum::<u64>()
    };
    while running() != (tenants.len() * MAX) as u64 {
        assert!(std::time::Instant::now() < deadline, "never all running");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(held);
    let abandoned = || stack.counter("redis_guard.concurrency.abandoned");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while abandoned() != (tenants.len() * MAX) as u64 {
        assert!(
            std::time::Instant::now() < deadline,
            "hang-ups: {}",
            abandoned()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let by_node = stack.cluster.keys_by_node("rg:*");
    let keys: Vec<&Vec<u8>> = by_node.values().flatten().collect();
    assert_eq!(keys.len(), tenants.len(), "one set per tenant");
    for t in &tenants {
        let mine = keys.iter().filter(|k| k.ends_with(t.as_bytes())).count();
        assert_eq!(mine, 1, "{t}'s slots in one set");
    }
    let status = |t: &str| {
        let e = &stack.envoys[1];
        get(&e.url(&format!("/cc?after-{t}")), &[("x-tenant", t)]).status
    };
    for t in &tenants {
        assert_eq!(status(t), 429, "{t}: its slots are still taken");
    }
    assert_eq!(
        stack.counter("redis_guard.concurrency.released"),
        (tenants.len() * MAX) as u64
    );
    stack.assert_clean();
}

// ---------------------------------------------------------------------------
// Only the Envoys reach Redis.

/// A command as the filter POSTs it to Webdis: every byte of every argument
/// that is not an ASCII letter or digit percent-encoded, `.raw` output.
fn webdis_command(args: &[&str]) -> Vec<u8> {
    let encoded: Vec<String> = args
        .iter()
        .map(|a| {
            a.bytes()
                .map(|b| match b.is_ascii_alphanumeric() {
                    true => (b as char).to_string(),
                    false => format!("%{b:02X}"),
                })
                .collect()
        })
        .collect();
    format!("{}.raw", encoded.join("/")).into_bytes()
}

#[test]
fn the_nodes_refuse_what_their_users_may_not_do_and_a_wrong_redis_password_decides_nothing() {
    let cluster = RedisCluster::start();
    let proxy = RedisProxy::start(&cluster);
    // Webdis with the default user's password: the proxy admits it.
    let webdis = Webdis::start(proxy.port);
    webdis.wait_until_redis_answers();
    // Discovery, AUTH and a script went through without a refusal.
    assert_eq!(cluster.acl_refusals(), []);

    // Every node has exactly these users (tests/support/cluster.rs, node_acl).
    for port in &cluster.ports {
        let mut users: Vec<String> = redis::cmd("ACL")
            .arg("USERS")
            .query(&mut admin_conn(*port))
            .unwrap();
        users.sort();
        assert_eq!(users, ["admin", "default", PROXY_USER], "node {port}");
    }

    // One slot for every key below (one hash tag), on its master: a key
    // outside the prefix and one under it, written by the admin.
    let canary = "other:{g}canary";
    let node = cluster.owner(cluster.slot_of(canary.as_bytes()));
    let port = cluster.ports[node];
    let mut admin = cluster.conn(node);
    for (key, value) in [(canary, "kept"), ("rg:{g}x", "1")] {
        redis::cmd("SET")
            .arg(key)
            .arg(value)
            .query::<()>(&mut admin)
            .unwrap();
    }

    // Through Webdis, with its credentials and the right Redis password:
    // a script runs on the node as the proxy's user, which may use the
    // filter's keys and nothing else.
    for script in [
        ["EVAL", "redis.call('SET',KEYS[1],'owned')", "1", canary],
        ["EVAL", "return redis.call('GET',KEYS[1])", "1", canary],
        [
            "EVAL",
            "return redis.call('GET','other:{g}canary')",
            "1",
            "rg:{g}x",
        ],
        [
            "EVAL",
            "redis.call('SET','other:{g}canary','owned')",
            "1",
            "rg:{g}x",
        ],
        ["EVAL", "return redis.call('KEYS','*')", "1", "rg:{g}x"],
        ["EVAL", "return redis.call('SCAN','0')", "1", "rg:{g}x"],
        ["EVAL", "return redis.call('FLUSHALL')", "1", "rg:{g}x"],
        [
            "EVAL",
            "return redis.call('CONFIG','GET','requirepass')",
            "1",
            "rg:{g}x",
        ],
        ["EVAL", "return redis.call('ACL','LIST')", "1", "rg:{g}x"],
        // Its one CLUSTER subcommand is SLOTS.
        [
            "EVAL",
            "return redis.call('CLUSTER','NODES')",
            "1",
            "rg:{g}x",
        ],
    ] {
        let r = webdis.post(&webdis_command(&script));
        let reply = String::from_utf8_lossy(&r.body);
        assert_eq!(r.status, 200, "{script:?}: Webdis passes EVAL on");
        assert!(server::refused_by_acl(&reply), "{script:?}: {reply}");
    }
    let refusals = cluster.acl_refusals();
    assert!(
        !refusals.is_empty()
            && refusals
                .iter()
                .all(|(_, e)| e.contains(&format!("username={PROXY_USER} "))),
        "the scripts ran as the proxy's user: {refusals:#?}"
    );
    let r = webdis.post(&webdis_command(&[
        "EVAL",
        "return redis.call('GET',KEYS[1])",
        "1",
        "rg:{g}x",
    ]));
    assert_eq!((r.status, r.body.as_slice()), (200, &b"$1\r\n1\r\n"[..]));

    // Straight to the node: without a password nothing runs; with the
    // default user's (Webdis') or the proxy's, administration, enumeration
    // and keys outside the prefix are refused.
    let run = |con: &mut redis::Connection, args: &[&str]| -> Result<redis::Value, String> {
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(con).map_err(|e| e.to_string())
    };
    let mut anonymous = redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .unwrap()
        .get_connection()
        .unwrap();
    for args in [&["PING"][..], &["GET", "rg:{g}x"], &["CLUSTER", "SLOTS"]] {
        let r = run(&mut anonymous, args);
        assert!(
            matches!(&r, Err(e) if e.contains("NOAUTH")),
            "{args:?} without a password: {r:?}"
        );
    }
    let mut default = conn_as(port, "default", REDIS_PASSWORD);
    let mut proxy_user = conn_as(port, PROXY_USER, REDIS_PROXY_PASSWORD);
    let administration: [&[&str]; 9] = [
        &["FLUSHALL"],
        &["KEYS", "*"],
        &["SCAN", "0"],
        &["CONFIG", "GET", "*"],
        &["ACL", "LIST"],
        &["CLUSTER", "NODES"],
        &["CLUSTER", "RESET"],
        &["GET", canary],
        &["SET", "other:{g}new", "1"],
    ];
    for (user, con) in [("default", &mut default), (PROXY_USER, &mut proxy_user)] {
        for args in administration {
            let r = run(con, args);
            assert!(
                matches!(&r, Err(e) if e.contains("NOPERM")),
                "{user}: {args:?}: {r:?}"
            );
        }
    }
    // The two commands the proxy needs beyond the scripts' are its own.
    for args in [&["CLUSTER", "SLOTS"][..], &["ASKING"]] {
        let r = run(&mut default, args);
        assert!(
            matches!(&r, Err(e) if e.contains("NOPERM")),
            "default: {args:?}: {r:?}"
        );
        let r = run(&mut proxy_user, args);
        assert!(r.is_ok(), "{PROXY_USER}: {args:?}: {r:?}");
    }
    // Under the prefix, what the scripts do (README "Threat model").
    let x: String = redis::cmd("GET")
        .arg("rg:{g}x")
        .query(&mut default)
        .unwrap();
    assert_eq!(x, "1");
    // Nothing changed anywhere.
    let kept: String = redis::cmd("GET").arg(canary).query(&mut admin).unwrap();
    assert_eq!(kept, "kept");
    let mut all: Vec<Vec<u8>> = (0..MASTERS).flat_map(|n| cluster.keys_on(n, "*")).collect();
    all.sort();
    assert_eq!(all, [canary.as_bytes(), b"rg:{g}x"]);

    // Webdis with a wrong Redis password, or none: the proxy answers its
    // AUTH with an error (which Webdis does not check) and every command
    // with NOAUTH; no node sees them (no failed AUTH in their ACL LOG).
    let wrong = Webdis::start_with_redis_auth(proxy.port, Some("not-the-redis-password"));
    let none = Webdis::start_with_redis_auth(proxy.port, None);
    for w in [&wrong, &none] {
        let r = w.post(b"EVAL/return%207/1/rg%3Aready.raw");
        assert_eq!(
            (r.status, String::from_utf8_lossy(&r.body).as_ref()),
            (200, "-NOAUTH Authentication required.\r\n")
        );
    }
    // A filter behind it decides nothing: its failure mode (deny) applies,
    // counted as `auth` (src/filter/call.rs: NOAUTH, as NOPERM and Webdis'
    // own 401/403).
    let upstream = Upstream::start();
    let envoy = Envoy::start(&window_per_tenant(5), wrong.port, upstream.port);
    let r = get(&envoy.url("/x"), &[("x-tenant", "t")]);
    assert_eq!(r.status, 503);
    assert_eq!(upstream.executed(), 0);
    assert_eq!(envoy.counter("redis_guard.redis.errors"), 1);
    assert_eq!(envoy.counter("redis_guard.redis.errors_by_kind.auth"), 1);
    assert_eq!(envoy.counter("redis_guard.redis.errors_by_kind.redis"), 0);
    assert_eq!(envoy.counter("redis_guard.failure_mode.denied"), 1);
    assert!(envoy.log().contains("NOAUTH"), "{}", envoy.log());
    assert!(cluster
        .keys_on(cluster.node_of_tenant("t"), "rg:rl:*")
        .is_empty());
    let refusals = cluster.acl_refusals();
    assert!(
        !refusals.iter().any(|(_, e)| e.contains("reason=auth ")),
        "{refusals:#?}"
    );

    // Neither password is in the proxy's /config_dump.
    let dump = proxy.config_dump();
    assert!(dump.contains("[redacted]"));
    for secret in [REDIS_PASSWORD, REDIS_PROXY_PASSWORD] {
        assert!(!dump.contains(secret), "{secret} in /config_dump");
    }
}
