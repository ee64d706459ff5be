//! Every rate-limit kind's bound, from any number of Envoys, alone and in
//! batches, at the test clock: requests of random costs decided by the real
//! lua/ratelimit.lua and lua/batch.lua (packed by the filter's packer).
//!
//! References, from the book (Limits: the six kinds), checked over every
//! interval of the admissions so far:
//! - token bucket (capacity C, refill r per P) and GCRA (burst C, rate r
//!   per P): at most C + floor(r × elapsed / P) units in any interval;
//! - sliding-window log (L per W): at most L in any (t − W, t];
//! - fixed window: at most L in each window aligned to the epoch;
//! - sliding-window counter: at most 2L in any span of W ms.

use std::sync::LazyLock;

use proptest::prelude::*;
use redis::{Connection, Value};
use redis_guard::scripts::Script;

use crate::engine::{self, Property};
use crate::support::script::{self, fw, gcra, parse, sw, swc, tb, Limit, Reply};

static ONE_AT: LazyLock<Script> = LazyLock::new(|| script::without_expiry(&script::RATELIMIT_AT));
static BATCH_AT: LazyLock<Script> = LazyLock::new(|| script::without_expiry(&script::BATCH_AT));

pub fn load(con: &mut Connection) {
    engine::load(con, &[&ONE_AT, &BATCH_AT]);
}

const KINDS: usize = 5;
const PERIOD: i64 = 1_000;
const WINDOW: i64 = 4_000;
const CAP: i64 = 8;

fn limit(kind: usize, cost: i64) -> Limit {
    let key = format!("t:{{k}}:{kind}");
    match kind {
        0 => tb(&key, CAP, 2, PERIOD),
        1 => gcra(&key, CAP, 2, PERIOD),
        2 => sw(&key, CAP, WINDOW),
        3 => fw(&key, CAP, WINDOW),
        _ => swc(&key, CAP, WINDOW),
    }
    .cost(cost)
}

#[derive(Debug, Clone)]
pub enum KindOp {
    Tick(i64),
    /// One request alone.
    One {
        kind: usize,
        cost: i64,
    },
    /// Neighbouring requests of one worker, joined.
    Batch(Vec<(usize, i64)>),
}

pub fn schedules() -> impl Strategy<Value = Vec<KindOp>> {
    let req = (0..KINDS, 1..5i64);
    let op = prop_oneof![
        2 => prop::sample::select(vec![1i64, 7, 250, 499, 999, 1_000, 1_999, 3_999, 4_001])
            .prop_map(KindOp::Tick),
        3 => req.clone().prop_map(|(kind, cost)| KindOp::One { kind, cost }),
        2 => prop::collection::vec(req, 1..8).prop_map(KindOp::Batch),
    ];
    prop::collection::vec(op, 1..24)
}

/// Whether the admissions `(instant, cost)` of `kind` keep its bound.
fn bound(kind: usize, admitted: &[(i64, i64)]) -> Result<(), String> {
    for (i, &(s, _)) in admitted.iter().enumerate() {
        let mut sum = 0;
        for &(e, c) in &admitted[i..] {
            sum += c;
            let elapsed = e - s;
            let (most, what) = match kind {
                0 | 1 => (CAP + 2 * elapsed / PERIOD, "capacity + refill × elapsed"),
                2 if elapsed < WINDOW => (CAP, "the limit in a window"),
                3 if s.div_euclid(WINDOW) == e.div_euclid(WINDOW) => {
                    (CAP, "the limit in an aligned window")
                }
                4 if elapsed < WINDOW => (2 * CAP, "twice the limit in a window's span"),
                _ => continue,
            };
            if sum > most {
                return Err(format!(
                    "kind {kind}: {sum} units admitted from {s} to {e}, more than {most} \
                     ({what})"
                ));
            }
        }
    }
    Ok(())
}

fn admitted(v: Value) -> Result<bool, String> {
    match parse(v) {
        Reply::Decided(d) => Ok(d.admitted),
        other => Err(format!("unexpected {other:?}")),
    }
}

pub fn run(con: &mut Connection, ops: &[KindOp]) -> Result<(), String> {
    engine::fresh(con);
    let mut now = script::T0 + 123;
    script::set_clock(con, now);
    let mut log: Vec<Vec<(i64, i64)>> = vec![Vec::new(); KINDS];
    for (step, op) in ops.iter().enumerate() {
        let mut touched = Vec::new();
        match op {
            KindOp::Tick(dt) => {
                now += dt;
                script::set_clock(con, now);
            }
            KindOp::One { kind, cost } => {
                let v = script::with_limits(script::evalsha(&ONE_AT), &[limit(*kind, *cost)], None)
                    .query(con)
                    .map_err(|e| format!("step {step}: {e}"))?;
                if admitted(v)? {
                    log[*kind].push((now, *cost));
                    touched.push(*kind);
                }
            }
            KindOp::Batch(reqs) => {
                let members: Vec<Vec<Limit>> =
                    reqs.iter().map(|&(k, c)| vec![limit(k, c)]).collect();
                let (keys, body) = script::packed_batch(&members);
                let v: Value = script::evalsha(&BATCH_AT)
                    .arg(keys.len())
                    .arg(&keys)
                    .arg(&body)
                    .query(con)
                    .map_err(|e| format!("step {step}: batch: {e}"))?;
                for (m, reply) in script::split_batch_reply(v, reqs.len())
                    .into_iter()
                    .enumerate()
                {
                    if admitted(Value::Array(reply))? {
                        log[reqs[m].0].push((now, reqs[m].1));
                        touched.push(reqs[m].0);
                    }
                }
            }
        }
        for kind in touched {
            bound(kind, &log[kind]).map_err(|e| format!("step {step}: {e}"))?;
        }
    }
    Ok(())
}

pub const PROPERTY: Property = Property {
    name: "every_kind_keeps_its_bound_over_every_interval",
    seed: 0x0B0_0DED,
};
