//! Requests in flight across a fleet: concurrency slots and idempotency
//! locks, taken by the decision (lua/ratelimit.lua) and given back by the
//! calls a request's end sends (lua/concurrency_renew.lua,
//! lua/concurrency_release.lua, lua/idempotency_complete.lua,
//! lua/idempotency_release.lua), each of which may be delivered twice (a
//! reply lost after the call ran, sent again), at the test clock.
//!
//! References, from the book: a concurrency limit never has more requests
//! in flight than its maximum, where a request is in flight from its
//! admission until its release or the end of its last renewed lease (an
//! Envoy that stops renewing frees its slots then); an idempotency key runs
//! upstream at most once while its lock or record holds, and every replay
//! carries what that one run answered.

use std::collections::HashMap;
use std::sync::LazyLock;

use proptest::prelude::*;
use redis::Connection;
use redis_guard::scripts::{Script, CC_RELEASE, CC_RENEW, IDEM_COMPLETE, IDEM_RELEASE};

use crate::engine::{self, Property};
use crate::support::script::{self, cc, idem, parse, Held, Reply};

static ONE_AT: LazyLock<Script> = LazyLock::new(|| script::without_expiry(&script::RATELIMIT_AT));
static RENEW_AT: LazyLock<Script> =
    LazyLock::new(|| script::without_expiry(&script::with_test_clock(&CC_RENEW)));
// The release reads no clock.
static RELEASE_AT: LazyLock<Script> = LazyLock::new(|| script::without_expiry(&CC_RELEASE));
static COMPLETE_AT: LazyLock<Script> = LazyLock::new(|| script::without_expiry(&IDEM_COMPLETE));
static FORGO_AT: LazyLock<Script> = LazyLock::new(|| script::without_expiry(&IDEM_RELEASE));

pub fn load(con: &mut Connection) {
    engine::load(
        con,
        &[&ONE_AT, &RENEW_AT, &RELEASE_AT, &COMPLETE_AT, &FORGO_AT],
    );
}

const CC_KEY: &str = "t:{f}:cc";
const MAX: i64 = 3;
const LEASE_MS: i64 = 1_000;

#[derive(Debug, Clone)]
pub enum CcOp {
    Tick(i64),
    /// A new request of `cost` (its slot id is its number).
    Admit {
        cost: i64,
    },
    /// Request `r`'s Envoy renews its lease (twice: the call delivered again).
    Renew {
        r: usize,
        twice: bool,
    },
    /// Request `r` ends: its release (twice: delivered again).
    Release {
        r: usize,
        twice: bool,
    },
}

pub fn cc_schedules() -> impl Strategy<Value = Vec<CcOp>> {
    let op = prop_oneof![
        2 => prop::sample::select(vec![1i64, 300, 999, 1_000, 1_001, 5_000]).prop_map(CcOp::Tick),
        4 => (1..3i64).prop_map(|cost| CcOp::Admit { cost }),
        3 => (0..16usize, any::<bool>()).prop_map(|(r, twice)| CcOp::Renew { r, twice }),
        3 => (0..16usize, any::<bool>()).prop_map(|(r, twice)| CcOp::Release { r, twice }),
    ];
    prop::collection::vec(op, 1..40)
}

struct InFlight {
    slot: String,
    cost: i64,
    /// The end of its lease as renewed (test-clock ms); None once released.
    until: Option<i64>,
}

pub fn run_cc(con: &mut Connection, ops: &[CcOp]) -> Result<(), String> {
    engine::fresh(con);
    let mut now = script::T0;
    script::set_clock(con, now);
    let mut reqs: Vec<InFlight> = Vec::new();
    let held = |r: &InFlight| Held {
        key: CC_KEY.to_string(),
        lease_ms: LEASE_MS,
        cost: r.cost,
    };
    for (step, op) in ops.iter().enumerate() {
        match *op {
            CcOp::Tick(dt) => {
                now += dt;
                script::set_clock(con, now);
            }
            CcOp::Admit { cost } => {
                let slot = format!("{:x}", reqs.len() + 1);
                let limit = cc(CC_KEY, MAX, LEASE_MS, &slot).cost(cost);
                let v = script::with_limits(script::evalsha(&ONE_AT), &[limit], None)
                    .query(con)
                    .map_err(|e| format!("step {step}: admit: {e}"))?;
                let admitted = matches!(parse(v), Reply::Decided(d) if d.admitted);
                reqs.push(InFlight {
                    slot,
                    cost,
                    until: admitted.then_some(now + LEASE_MS),
                });
                let flying: i64 = reqs
                    .iter()
                    .filter(|r| r.until.is_some_and(|u| now < u))
                    .map(|r| r.cost)
                    .sum();
                if flying > MAX {
                    return Err(format!(
                        "step {step}: {flying} slots in flight, more than the maximum {MAX}"
                    ));
                }
            }
            CcOp::Renew { r, twice } => {
                let Some(req) = reqs.get_mut(r) else { continue };
                let h = [held(req)];
                for _ in 0..1 + usize::from(twice) {
                    let got: Vec<i64> =
                        script::with_renewal(script::evalsha(&RENEW_AT), &req.slot, &h)
                            .query(con)
                            .map_err(|e| format!("step {step}: renew: {e}"))?;
                    // Renewed: held until a lease from now. A slot released,
                    // or whose lease ended, must not come back.
                    match (got[0], req.until) {
                        (1, Some(u)) if now < u => req.until = Some(now + LEASE_MS),
                        (1, _) => {
                            return Err(format!(
                                "step {step}: request {r}'s slot came back by a renewal after \
                                 it was released or its lease ended"
                            ))
                        }
                        _ => {}
                    }
                }
            }
            CcOp::Release { r, twice } => {
                let Some(req) = reqs.get_mut(r) else { continue };
                let h = [held(req)];
                for _ in 0..1 + usize::from(twice) {
                    script::with_release(script::evalsha(&RELEASE_AT), &req.slot, &h)
                        .query::<i64>(con)
                        .map_err(|e| format!("step {step}: release: {e}"))?;
                }
                req.until = None;
            }
        }
    }
    Ok(())
}

pub const CC_PROPERTY: Property = Property {
    name: "a_concurrency_limit_never_has_more_in_flight_than_its_maximum",
    seed: 0xCC_0001,
};

// ---------------------------------------------------------------------------
// Idempotency keys

#[derive(Debug, Clone)]
pub enum IdemOp {
    /// Envoy `e` receives a request with key `k` (a client's try).
    Try { e: usize, k: usize },
    /// Envoy `e`'s upstream answers `status` for the request it runs.
    Answer { e: usize, status: i64 },
    /// Envoy `e`'s last call after the decision is delivered again.
    Again { e: usize },
}

pub fn idem_schedules() -> impl Strategy<Value = Vec<IdemOp>> {
    let op = prop_oneof![
        4 => (0..4usize, 0..3usize).prop_map(|(e, k)| IdemOp::Try { e, k }),
        3 => (0..4usize, prop::sample::select(vec![200i64, 201, 500, 503])).prop_map(
            |(e, status)| IdemOp::Answer { e, status }
        ),
        2 => (0..4usize).prop_map(|e| IdemOp::Again { e }),
    ];
    prop::collection::vec(op, 1..40)
}

#[derive(Default)]
struct IdemEnvoy {
    /// The key and owner it runs upstream now.
    running: Option<(usize, String)>,
    /// Its last completion or release, to send again.
    last: Option<(bool, usize, String, i64)>,
}

pub fn run_idem(con: &mut Connection, ops: &[IdemOp]) -> Result<(), String> {
    engine::fresh(con);
    let mut envoys: Vec<IdemEnvoy> = (0..4).map(|_| IdemEnvoy::default()).collect();
    // Per key: upstream runs, and the answer stored (status, body).
    let mut runs: HashMap<usize, Vec<(i64, String)>> = HashMap::new();
    let mut owners = 0u64;
    let record = |k: usize| format!("t:{{i}}:idem:{k}");
    let send = |con: &mut Connection, stored: bool, k: usize, owner: &str, status: i64| {
        if stored {
            script::evalsha(&COMPLETE_AT)
                .arg(1)
                .arg(record(k))
                .arg(owner)
                .arg(status)
                .arg("content-type: text/plain")
                .arg(format!("run by {owner}"))
                .arg(86_400_000)
                .query::<i64>(con)
        } else {
            script::evalsha(&FORGO_AT)
                .arg(1)
                .arg(record(k))
                .arg(owner)
                .query::<i64>(con)
        }
    };
    for (step, op) in ops.iter().enumerate() {
        match *op {
            IdemOp::Try { e, k } => {
                if envoys[e].running.is_some() {
                    continue;
                }
                owners += 1;
                let owner = format!("{owners:x}");
                let i = idem(&record(k), &owner, "fp", 30_000);
                let v = script::with_limits(script::evalsha(&ONE_AT), &[], Some(&i))
                    .query(con)
                    .map_err(|err| format!("step {step}: acquire: {err}"))?;
                match parse(v) {
                    Reply::Decided(d) if d.admitted => {
                        envoys[e].running = Some((k, owner.clone()));
                        let r = runs.entry(k).or_default();
                        r.push((0, owner));
                        if r.len() > 1 {
                            return Err(format!(
                                "step {step}: key {k} runs upstream a second time ({r:?})"
                            ));
                        }
                    }
                    Reply::Completed { status, body, .. } => {
                        let first = runs.get(&k).and_then(|r| r.first()).cloned();
                        let want = first.map(|(s, o)| (s, format!("run by {o}")));
                        let got = (status, String::from_utf8_lossy(&body).into_owned());
                        if want.as_ref() != Some(&got) {
                            return Err(format!(
                                "step {step}: key {k} replayed {got:?}, its one run answered \
                                 {want:?}"
                            ));
                        }
                    }
                    Reply::Busy(_) | Reply::Mismatch => {}
                    other => return Err(format!("step {step}: unexpected {other:?}")),
                }
            }
            IdemOp::Answer { e, status } => {
                let Some((k, owner)) = envoys[e].running.take() else {
                    continue;
                };
                // 2xx is stored and replayed; 5xx releases the lock so a
                // retry runs again (book: Idempotency keys).
                let stored = status < 500;
                let done = send(con, stored, k, &owner, status)
                    .map_err(|err| format!("step {step}: {err}"))?;
                if done == 1 {
                    if let Some(r) = runs.get_mut(&k) {
                        if stored {
                            r[0].0 = status;
                        } else {
                            r.clear();
                        }
                    }
                }
                envoys[e].last = Some((stored, k, owner, status));
            }
            IdemOp::Again { e } => {
                let Some((stored, k, owner, status)) = envoys[e].last.clone() else {
                    continue;
                };
                send(con, stored, k, &owner, status)
                    .map_err(|err| format!("step {step}: {err}"))?;
            }
        }
    }
    Ok(())
}

pub const IDEM_PROPERTY: Property = Property {
    name: "an_idempotency_key_runs_upstream_at_most_once",
    seed: 0x1DE0_0001,
};
