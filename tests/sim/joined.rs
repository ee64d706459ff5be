//! Calls joined: a tick's settlements of one hash tag go in one
//! lua/settle.lua call (src/filter/deferred.rs), a worker's neighbouring
//! requests in one lua/batch.lua call (src/batch.rs packs them). The
//! promise (book: Batches; Usage-based costs): a joined call decides and
//! charges exactly what its members sent one by one would, and one member
//! that cannot be decided fails only itself.
//!
//! Reference: the same members sent one by one, in order, to a twin
//! keyspace of the same Redis at the same clock. Members include quota
//! members whose edges no longer hold Redis' clock (a settlement that came
//! more than a window after its decision; an Envoy clock off by more than
//! a window), which alone are errors.

use std::sync::LazyLock;

use proptest::prelude::*;
use redis::{Connection, Value};
use redis_guard::quota::{zone, Calendar, Per};
use redis_guard::scripts::{Script, SETTLE};

use crate::engine::{self, Property};
use crate::support::script::{self, Limit, HOUR, T0};

static SETTLE_AT: LazyLock<Script> =
    LazyLock::new(|| script::without_expiry(&script::with_test_clock(&SETTLE)));
static BATCH_AT: LazyLock<Script> = LazyLock::new(|| script::without_expiry(&script::BATCH_AT));
static ONE_AT: LazyLock<Script> = LazyLock::new(|| script::without_expiry(&script::RATELIMIT_AT));

/// What a member came to: its reply's values, or a failure of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    Values(Vec<i64>),
    Failed,
}

fn number(v: &Value) -> Option<i64> {
    match v {
        Value::Int(n) => Some(*n),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

/// A member's values, or Failed when any is not a number (an error marker).
fn outcome(values: &[Value]) -> Outcome {
    values
        .iter()
        .map(number)
        .collect::<Option<Vec<i64>>>()
        .map_or(Outcome::Failed, Outcome::Values)
}

const KINDS: [&str; 5] = ["tb", "gcra", "fw", "swc", "cq"];

/// An hourly quota in a zone with a 45-minute offset and one with daylight
/// saving: edges computed from the real calendar core.
fn calendar(which: usize) -> Calendar {
    let name = ["Asia/Kathmandu", "America/New_York"][which % 2];
    Calendar {
        per: Per::Hour,
        zone: zone(name).unwrap(),
        anchor: 1,
    }
}

// ---------------------------------------------------------------------------
// Settlements

#[derive(Debug, Clone)]
pub struct Settlement {
    customer: usize,
    kind: usize,
    delta: i64,
    /// ms since the decision (a quota's edges were computed then).
    age: i64,
}

#[derive(Debug, Clone)]
pub enum SettleOp {
    Tick(i64),
    Settle(Vec<Settlement>),
}

fn settlement() -> impl Strategy<Value = Settlement> {
    (
        0..3usize,
        0..KINDS.len(),
        -30..80i64,
        prop::sample::select(vec![0i64, 40, 2_000, 50 * 60_000, 3 * HOUR, 30 * HOUR]),
    )
        .prop_map(|(customer, kind, delta, age)| Settlement {
            customer,
            kind,
            delta,
            age,
        })
}

pub fn settle_schedules() -> impl Strategy<Value = Vec<SettleOp>> {
    let op = prop_oneof![
        1 => prop::sample::select(vec![1i64, 500, 20_000, HOUR]).prop_map(SettleOp::Tick),
        4 => prop::collection::vec(settlement(), 1..5).prop_map(SettleOp::Settle),
    ];
    prop::collection::vec(op, 1..10)
}

/// lua/settle.lua's seven values for a member at `now`, keyed under `space`.
fn settle_args(space: &str, s: &Settlement, now: i64) -> (String, [String; 7]) {
    let kind = KINDS[s.kind];
    let key = format!("{space}:{{s}}:{kind}:{}", s.customer);
    let (a, b, c) = match kind {
        "tb" => ("100".into(), "10".into(), "1000".into()),
        "gcra" => ("100".into(), "10".into(), "1000".into()),
        "fw" | "swc" => ("100".into(), "60000".into(), "0".into()),
        _ => {
            let [e0, e1, e2, e3] = calendar(s.customer).edges(now - s.age).unwrap();
            ("100".into(), "0".into(), format!("{e0},{e1},{e2},{e3}"))
        }
    };
    let args = [
        kind.to_string(),
        a,
        b,
        c,
        s.delta.to_string(),
        s.age.to_string(),
        "0".to_string(),
    ];
    (key, args)
}

fn settle_call(
    con: &mut Connection,
    space: &str,
    members: &[Settlement],
    now: i64,
) -> Vec<Outcome> {
    let mut cmd = script::evalsha(&SETTLE_AT);
    cmd.arg(members.len());
    let args: Vec<_> = members.iter().map(|s| settle_args(space, s, now)).collect();
    for (key, _) in &args {
        cmd.arg(key);
    }
    for (_, a) in &args {
        cmd.arg(&a[..]);
    }
    match cmd.query::<Value>(con) {
        Err(_) => vec![Outcome::Failed; members.len()],
        Ok(Value::Array(items)) if items.len() == members.len() => items
            .iter()
            .map(|v| outcome(std::slice::from_ref(v)))
            .collect(),
        Ok(other) => panic!("settle replied {other:?} for {} members", members.len()),
    }
}

pub fn load(con: &mut Connection) {
    engine::load(con, &[&SETTLE_AT, &BATCH_AT, &ONE_AT]);
}

pub fn run_settle(con: &mut Connection, ops: &[SettleOp]) -> Result<(), String> {
    engine::fresh(con);
    let mut now = T0 + 37 * 60_000;
    script::set_clock(con, now);
    for (step, op) in ops.iter().enumerate() {
        match op {
            SettleOp::Tick(dt) => {
                now += dt;
                script::set_clock(con, now);
            }
            SettleOp::Settle(members) => {
                let joined = settle_call(con, "j", members, now);
                for (i, m) in members.iter().enumerate() {
                    let alone = settle_call(con, "a", std::slice::from_ref(m), now);
                    if alone[0] != joined[i] {
                        return Err(format!(
                            "step {step}: settlement {i} ({m:?}) came to {:?} alone but {:?} \
                             joined with {members:?}",
                            alone[0], joined[i]
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

pub const SETTLE_PROPERTY: Property = Property {
    name: "joined_settlements_charge_what_each_alone_would",
    seed: 0x5E77_1E00,
};

// ---------------------------------------------------------------------------
// Batches

#[derive(Debug, Clone)]
pub struct Request {
    customer: usize,
    /// With the quota: 0 none, 1 edges from a clock within the window,
    /// 2 from a clock two windows behind Redis'.
    quota: u8,
    cost: i64,
}

#[derive(Debug, Clone)]
pub enum BatchOp {
    Tick(i64),
    Batch(Vec<Request>),
}

pub fn batch_schedules() -> impl Strategy<Value = Vec<BatchOp>> {
    let request = (
        0..3usize,
        prop::sample::select(vec![0u8, 0, 1, 1, 2]),
        1..30i64,
    )
        .prop_map(|(customer, quota, cost)| Request {
            customer,
            quota,
            cost,
        });
    let op = prop_oneof![
        1 => prop::sample::select(vec![1i64, 700, 20 * 60_000]).prop_map(BatchOp::Tick),
        4 => prop::collection::vec(request, 1..7).prop_map(BatchOp::Batch),
    ];
    prop::collection::vec(op, 1..8)
}

fn limits(space: &str, r: &Request, now: i64) -> Vec<Limit> {
    let mut out =
        vec![script::tb(&format!("{space}:{{b}}:tb:{}", r.customer), 60, 1, 1_000).cost(r.cost)];
    if r.quota > 0 {
        let proxy = if r.quota == 1 {
            now - 1_000
        } else {
            now - 2 * HOUR - 1
        };
        let [e0, e1, e2, e3] = calendar(r.customer).edges(proxy).unwrap();
        out.push(Limit {
            key: format!("{space}:{{b}}:cq:{}", r.customer),
            alg: "cq",
            a: 100,
            b: 0,
            c: format!("{e0},{e1},{e2},{e3}"),
            cost: r.cost,
            enforce: true,
            block: 0,
        });
    }
    out
}

fn batch_call(con: &mut Connection, members: &[Vec<Limit>]) -> Vec<Outcome> {
    let (keys, body) = script::packed_batch(members);
    let v = script::evalsha(&BATCH_AT)
        .arg(keys.len())
        .arg(&keys)
        .arg(&body)
        .query::<Value>(con);
    match v {
        Err(_) => vec![Outcome::Failed; members.len()],
        Ok(v) => script::split_batch_reply(v, members.len())
            .iter()
            .map(|m| outcome(m))
            .collect(),
    }
}

fn one_call(con: &mut Connection, limits: &[Limit]) -> Outcome {
    match script::with_limits(script::evalsha(&ONE_AT), limits, None).query::<Value>(con) {
        Err(_) => Outcome::Failed,
        Ok(Value::Array(items)) => outcome(&items),
        Ok(other) => panic!("ratelimit replied {other:?}"),
    }
}

pub fn run_batch(con: &mut Connection, ops: &[BatchOp]) -> Result<(), String> {
    engine::fresh(con);
    let mut now = T0 + 59 * 60_000;
    script::set_clock(con, now);
    for (step, op) in ops.iter().enumerate() {
        match op {
            BatchOp::Tick(dt) => {
                now += dt;
                script::set_clock(con, now);
            }
            BatchOp::Batch(requests) => {
                let joined: Vec<Vec<Limit>> =
                    requests.iter().map(|r| limits("j", r, now)).collect();
                let got = batch_call(con, &joined);
                for (i, r) in requests.iter().enumerate() {
                    let alone = one_call(con, &limits("a", r, now));
                    if alone != got[i] {
                        return Err(format!(
                            "step {step}: request {i} ({r:?}) came to {alone:?} alone but \
                             {:?} in the batch {requests:?}",
                            got[i]
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

pub const BATCH_PROPERTY: Property = Property {
    name: "a_batch_decides_what_its_members_alone_would",
    seed: 0xBA7C_4000,
};
