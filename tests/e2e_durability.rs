//! What survives a Redis crash: keyed requests run to completion, Redis is
//! killed (SIGKILL: nothing flushed on the way out) and started again from
//! its directory, and every key is retried through the same real Envoy and
//! Webdis. With an append-only file fsynced on every write (what the demo
//! and compose run), every retry is a replay and budgets stay spent; without
//! persistence (the control) every record is gone and every retry runs again.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::*;

const KEYS: usize = 30;

/// Keyed POSTs to /pay, scoped by x-tenant; GET /metered limited to 5 an hour.
fn config() -> String {
    filter_config(3000)
        .limits(
            r#"[{"name":"metered","match":{"pathPrefix":"/metered"},
                "fixedWindow":{"limit":5,"windowMs":3600000}}]"#,
        )
        .idempotency(
            r#"[{"name":"pay","match":{"pathPrefix":"/pay"},"tenant":[{"header":"x-tenant"}]}]"#,
        )
        .build()
}

struct Crashable {
    redis: Redis,
    webdis: Webdis,
    upstream: Upstream,
    envoy: Envoy,
}

impl Crashable {
    fn start(aof: Option<&'static str>) -> Crashable {
        let redis = Redis::start_with_aof(aof);
        let webdis = Webdis::start(redis.port);
        let upstream = Upstream::start();
        let envoy = Envoy::start(&config(), webdis.port, upstream.port);
        Crashable {
            redis,
            webdis,
            upstream,
            envoy,
        }
    }

    fn pay(&self, i: usize) -> Resp {
        let key = format!("key-{i}");
        http(
            "POST",
            &self.envoy.url(&format!("/pay/{i}")),
            &[("idempotency-key", &key), ("x-tenant", "acme")],
            Some(format!("{{\"amount\":{i}}}").as_bytes()),
        )
    }

    fn metered(&self) -> u16 {
        get(&self.envoy.url("/metered"), &[]).status
    }

    /// Runs every key and spends 3 of the 5 metered requests, then kills
    /// Redis the moment the last answer is in, and starts it again.
    fn run_then_crash(&mut self) -> Vec<Resp> {
        let first: Vec<Resp> = (0..KEYS).map(|i| self.pay(i)).collect();
        for r in &first {
            assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
            assert_eq!(r.header("idempotent-replayed"), None);
        }
        for _ in 0..3 {
            assert_eq!(self.metered(), 200);
        }
        self.redis.restart();
        self.webdis.wait_until_redis_answers();
        first
    }
}

#[test]
fn with_an_append_only_file_fsynced_always_every_record_survives_a_crash() {
    let mut s = Crashable::start(Some("always"));
    let first = s.run_then_crash();
    for (i, before) in first.iter().enumerate() {
        let retry = s.pay(i);
        assert_eq!(retry.status, before.status);
        assert_eq!(
            retry.header("idempotent-replayed"),
            Some("true"),
            "key-{i} ran again"
        );
        assert_eq!(retry.body, before.body, "key-{i}: the stored response");
    }
    assert_eq!(s.upstream.executed(), (KEYS + 3) as u64, "no key ran twice");
    // The budget spent before the crash stays spent: 2 of 5 are left.
    let after: Vec<u16> = (0..3).map(|_| s.metered()).collect();
    assert_eq!(after, [200, 200, 429]);
    // Records keep their TTL across the restart.
    let mut con = s.redis.conn();
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("rg:idem:*").query(&mut con).unwrap();
    assert_eq!(keys.len(), KEYS);
    for key in keys {
        let pttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut con).unwrap();
        assert!(
            pttl > 0,
            "{} has no TTL ({pttl})",
            String::from_utf8_lossy(&key)
        );
    }
}

#[test]
fn without_persistence_a_crash_forgets_every_record_and_every_retry_runs_again() {
    let mut s = Crashable::start(None);
    s.run_then_crash();
    for i in 0..KEYS {
        let retry = s.pay(i);
        assert_eq!(retry.status, 200);
        assert_eq!(
            retry.header("idempotent-replayed"),
            None,
            "key-{i}: nothing to replay"
        );
    }
    assert_eq!(
        s.upstream.executed(),
        (2 * KEYS + 3) as u64,
        "every key ran twice"
    );
    // The spent budget is forgotten too: 5 more.
    let after: Vec<u16> = (0..6).map(|_| s.metered()).collect();
    assert_eq!(after, [200, 200, 200, 200, 200, 429]);
}
