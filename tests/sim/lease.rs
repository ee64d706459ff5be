//! Token leases across a fleet: 2 to 8 virtual Envoys, each with its own
//! shared-data slot driven by the filter's real lease core
//! (`redis_guard::lease::Slot`), sharing one bucket in a real Redis through
//! the real lua/lease.lua, lua/lease_return.lua and the strict
//! lua/ratelimit.lua, at the test clock. Envoys spend, fetch, give back and
//! send a give-back twice (a reply lost after the call ran); a strict
//! client charges; an operator resets the limit, and stores or removes the
//! key's plan (the limit takes plans: lua/lease.lua decides a key that has
//! one under it and grants nothing, the strict script decides it as
//! `tb+o`).
//!
//! Reference, from the book's promise (Fast paths: a leased bucket never
//! holds more than a bucket that never leased once tokens are given back):
//! a token bucket of the same shape that sees the same strict charges, the
//! same admitted costs, and of every grant only the tokens that never came
//! back, at the grant's instant, each under the figures (configured or the
//! plan's) the real call used, written at the instants the real bucket is
//! (a token bucket refills lazily, from its last write, under the figures
//! of the call that reads it: a plan's refill counts from the last write
//! before it, for a bucket that never leased too). After every step the
//! real bucket's level, under the configured figures and the plan's, must
//! be at or below the reference's. And a give-back made at the instant
//! of its slot's grant, nothing between, returns tokens (the grant took them
//! from the level it replied: they fit).

use std::sync::LazyLock;

use proptest::prelude::*;
use redis::Connection;
use redis_guard::keys::{block_key, give_back_key, restarted_give_back_record, state_keys_beside};
use redis_guard::lease::{Slot, Step, Tuple};
use redis_guard::scripts::{Script, LEASE, LEASE_RETURN};

use crate::engine::{self, Property};
use crate::support::script::{self, bucket, Bucket};

static LEASE_AT: LazyLock<Script> =
    LazyLock::new(|| script::without_expiry(&script::with_test_clock(&LEASE)));
static RETURN_AT: LazyLock<Script> =
    LazyLock::new(|| script::without_expiry(&script::with_test_clock(&LEASE_RETURN)));
static STRICT_AT: LazyLock<Script> =
    LazyLock::new(|| script::without_expiry(&script::RATELIMIT_AT));

/// A state key in the filter's layout, so that it has an override key.
const KEY: &str = "t:rl:{sim}:lease:s1:d";
/// Plans the operator stores (capacity, refill per period): below the
/// configured capacity, above it, and with ten to forty times its refill.
const PLANS: [(i64, i64); 3] = [(5, 10), (40, 3), (300, 40)];
/// The most tokens an Envoy holds (the limit's `lease.batch`).
const BATCH: u64 = 12;
/// A lease's life (ms): the longest the config allows.
const LEASE_MS: u64 = 600_000;
/// Clock steps (ms): none, within a token, a few tokens, past the longest
/// lease.
const TICKS: [i64; 11] = [
    0, 0, 1, 7, 900, 1_000, 4_000, 15_000, 30_000, 250_000, 700_000,
];

#[derive(Debug, Clone)]
pub enum Op {
    /// The clock moves on by TICKS[i].
    Tick(usize),
    /// Envoy `e` decides a request of `cost` on its lease (spends, or
    /// fetches with the request, or asks Redis strictly).
    Request { e: usize, cost: u64 },
    /// Envoy `e` gives its unspent tokens back now.
    GiveBack { e: usize },
    /// Envoy `e`'s last give-back call is delivered again.
    Resend { e: usize },
    /// A request decided strictly (an Envoy without a lease).
    Strict { cost: u64 },
    /// `redis-guard reset` of the limit.
    Reset,
    /// Envoy `e` fetches, the call runs in Redis, and its reply is lost (a
    /// timeout after the call ran): the grant is never held.
    LostFetch { e: usize },
    /// Envoy `e`'s configuration is reloaded: its slot is dropped with the
    /// tokens in it (they lapse: under-admission only).
    Reload { e: usize },
    /// Every Envoy decides a request in the same ms (a burst reaching the
    /// whole fleet: their fetches land together).
    Everyone { cost: u64 },
    /// `redis-guard override set` of PLANS[i], or unset (None).
    Plan(Option<usize>),
}

#[derive(Debug, Clone)]
pub struct Schedule {
    pub envoys: usize,
    pub capacity: i64,
    pub ops: Vec<Op>,
}

/// Kinds of step a run leaves out (`SIM_WITHOUT=reset,resend`): to show
/// what the rest finds on its own.
fn without(kind: &str) -> bool {
    std::env::var("SIM_WITHOUT").is_ok_and(|v| v.split(',').any(|k| k.trim() == kind))
}

fn op() -> impl Strategy<Value = Op> {
    let w = |kind: &str, weight: u32| if without(kind) { 0 } else { weight };
    // Weighted toward what breaks a give-back bound: several Envoys holding
    // grants of one instant, the clock moving, large strict charges, and
    // give-backs in any order after them.
    prop_oneof![
        4 => (0..TICKS.len()).prop_map(Op::Tick),
        3 => (0..8usize, 0..3u64).prop_map(|(e, cost)| Op::Request { e, cost }),
        5 => (0..8usize).prop_map(|e| Op::GiveBack { e }),
        w("resend", 1) => (0..8usize).prop_map(|e| Op::Resend { e }),
        2 => (1..20u64).prop_map(|cost| Op::Strict { cost }),
        2 => (50..100u64).prop_map(|cost| Op::Strict { cost }),
        w("reset", 1) => Just(Op::Reset),
        1 => (0..8usize).prop_map(|e| Op::LostFetch { e }),
        1 => (0..8usize).prop_map(|e| Op::Reload { e }),
        3 => (0..2u64).prop_map(|cost| Op::Everyone { cost }),
        w("plan", 2) => (0..=PLANS.len()).prop_map(|i| Op::Plan((i < PLANS.len()).then_some(i))),
    ]
}

pub fn schedules() -> impl Strategy<Value = Schedule> {
    (
        2..=8usize,
        prop::sample::select(vec![20i64, 40, 100]),
        prop::collection::vec(op(), 1..36),
    )
        .prop_map(|(envoys, capacity, ops)| Schedule {
            envoys,
            capacity,
            ops,
        })
}

/// A bucket's capacity and refill (per period), as a call used them.
type Figures = (i64, i64);

/// What happened to the real bucket, for the reference to replay.
#[derive(Debug, Clone, Copy)]
enum Event {
    Step,
    /// A lease call admitted `cost` and granted grant `id`.
    Take {
        cost: i64,
        id: usize,
        under: Figures,
    },
    Charge(i64, Figures),
    /// A give-back; whether it wrote the bucket (took tokens back).
    Back(bool),
    Reset,
    Plan,
}

/// What one logged step saw: the event, the real bucket's stored (credits,
/// ms) after it, the clock and the plan stored then.
type Logged = (Event, Option<(i64, i64)>, i64, Option<Figures>);

/// A token bucket's level at `now` from its stored state, under `f`, as
/// lua/token_bucket.lua reads it.
fn lazy(state: Option<(i64, i64)>, now: i64, f: Figures, period: i64) -> i64 {
    let full = f.0 * period;
    match state {
        None => full,
        Some((c, t)) if now > t => full.min(c + (now - t) * f.1),
        Some((c, _)) => full.min(c),
    }
}

/// One virtual Envoy: its slot's shared data, which grants its tokens came
/// from (oldest first), and its last give-back call.
#[derive(Default)]
struct Envoy {
    stored: Option<Vec<u8>>,
    from: Vec<(usize, u64)>,
    last_back: Option<Vec<String>>,
    /// What each part of that call took back, and the tokens (by grant,
    /// oldest first) it left out: a part answered 0 while a plan was stored
    /// may take them back when sent again once the plan is gone.
    last_got: Vec<i64>,
    unreturned: Vec<(usize, u64)>,
    /// Tokens of a grant that landed with nothing after it yet.
    fresh: u64,
}

struct World<'a> {
    con: &'a mut Connection,
    b: Bucket,
    now: i64,
    slot: Slot,
    envoys: Vec<Envoy>,
    kept: Vec<i64>,
    log: Vec<Logged>,
    /// The instant of the last reset.
    reset_at: i64,
    /// The plan stored now, and the instant a plan last charged the bucket
    /// (which restarts its give-back record after that ms).
    plan: Option<Figures>,
    plan_charged_at: i64,
}

impl World<'_> {
    fn configured(&self) -> Figures {
        (self.b.capacity, self.b.refill)
    }

    /// The figures a call decided under, from its verdict (+2: the plan's).
    fn under(&mut self, verdict: i64) -> Figures {
        match self.plan {
            Some(plan) if verdict & 2 != 0 => {
                self.plan_charged_at = self.now;
                plan
            }
            _ => self.configured(),
        }
    }

    fn ms(&self) -> u64 {
        self.now as u64
    }

    /// Drops what the Envoy's slot no longer holds (lapsed) from the model.
    fn lapse(&mut self, e: usize) {
        let held = self
            .slot
            .tokens(self.envoys[e].stored.as_deref(), self.ms());
        let env = &mut self.envoys[e];
        let mut extra = env
            .from
            .iter()
            .map(|f| f.1)
            .sum::<u64>()
            .saturating_sub(held);
        while extra > 0 {
            let n = env.from[0].1.min(extra);
            env.from[0].1 -= n;
            extra -= n;
            if env.from[0].1 == 0 {
                env.from.remove(0);
            }
        }
    }

    /// A strict decision (`tb+o`): charged, logged.
    fn strict(&mut self, cost: i64) {
        let mut limit = self.b.limit(KEY, cost);
        limit.alg = "tb+o";
        let raw: Vec<i64> = script::with_limits(script::evalsha(&STRICT_AT), &[limit], None)
            .query(self.con)
            .unwrap_or_else(|e| panic!("strict call: {e}"));
        if raw[0] == 1 {
            let under = self.under(raw[1]);
            self.push(Event::Charge(cost, under));
        }
    }

    /// lua/lease.lua for `cost` and `want`, reading plans: the grant, its
    /// tuple and the figures it decided under, if admitted.
    fn lease(&mut self, cost: u64, want: u64) -> Option<(u64, Tuple, Figures)> {
        let raw: Vec<i64> = script::with_lease(
            script::evalsha(&LEASE_AT),
            KEY,
            self.b,
            cost as i64,
            want as i64,
        )
        .arg("o")
        .query(self.con)
        .unwrap_or_else(|e| panic!("lease call: {e}"));
        if raw[0] != 1 {
            return None;
        }
        let under = self.under(raw[1]);
        if self.plan.is_some() && raw[5] != 0 {
            panic!("a grant of {} to a key with a plan: {raw:?}", raw[5]);
        }
        let tuple = Tuple {
            at_ms: raw[6] as u64,
            level: raw[7] as u64,
            returned: raw[8] as u64,
        };
        Some((raw[5] as u64, tuple, under))
    }

    /// One call giving back to the bucket once per part (seven values each),
    /// as the root sends a slot's give-backs: the tokens taken back per part.
    fn give_back_call(&mut self, args: &[String]) -> Result<Vec<i64>, String> {
        let parts = args.len() / 7;
        script::evalsha(&RETURN_AT)
            .arg(parts)
            .arg(vec![KEY; parts])
            .arg(args)
            .query(self.con)
            .map_err(|e| format!("give-back {args:?}: {e}"))
    }

    fn push(&mut self, event: Event) {
        let state = crate::support::read_bucket(self.con, KEY);
        self.log.push((event, state, self.now, self.plan));
        for env in &mut self.envoys {
            env.fresh = 0;
        }
    }

    /// Envoy `e` fetched with a request of `cost` (0: a prefetch).
    fn fetch(&mut self, e: usize, cost: u64, want: u64) {
        let Some((granted, tuple, under)) = self.lease(cost, want) else {
            let stored = self.envoys[e].stored.clone();
            if let Some(bytes) = self.slot.fetch_failed(stored.as_deref()) {
                self.envoys[e].stored = Some(bytes);
            }
            return;
        };
        let id = self.kept.len();
        self.kept.push(granted as i64);
        self.push(Event::Take {
            cost: cost as i64,
            id,
            under,
        });
        let now = self.ms();
        self.lapse(e);
        let before = self.slot.tokens(self.envoys[e].stored.as_deref(), now);
        let stored = self.envoys[e].stored.clone();
        let written = self.slot.granted(
            stored.as_deref(),
            granted,
            tuple,
            now,
            now + LEASE_MS,
            BATCH,
        );
        if let Some(bytes) = written {
            self.envoys[e].stored = Some(bytes);
        }
        let after = self.slot.tokens(self.envoys[e].stored.as_deref(), now);
        let added = after.saturating_sub(before);
        if added > 0 {
            self.envoys[e].from.push((id, added));
        }
        // A grant in the ms of a reset, or of a plan's charge, is refused at
        // give-back (the record starts after that ms: under-admission by
        // design).
        let restarted = self.reset_at.max(self.plan_charged_at);
        self.envoys[e].fresh = if self.now > restarted { added } else { 0 };
    }

    fn request(&mut self, e: usize, cost: u64) {
        self.lapse(e);
        let now = self.ms();
        let stored = self.envoys[e].stored.clone();
        match self
            .slot
            .step(stored.as_deref(), cost, now, 1_000, BATCH, true)
        {
            Step::Spend { bytes, prefetch } => {
                self.envoys[e].stored = Some(bytes);
                let env = &mut self.envoys[e];
                let mut k = cost;
                while k > 0 {
                    let n = env.from[0].1.min(k);
                    env.from[0].1 -= n;
                    k -= n;
                    if env.from[0].1 == 0 {
                        env.from.remove(0);
                    }
                }
                if let Some(want) = prefetch {
                    self.fetch(e, 0, want);
                }
            }
            Step::Fetch { bytes, want } => {
                self.envoys[e].stored = Some(bytes);
                self.fetch(e, cost, want);
            }
            Step::Strict => self.strict(cost as i64),
        }
    }

    fn give_back(&mut self, e: usize) -> Result<(), String> {
        self.lapse(e);
        let now = self.ms();
        let stored = self.envoys[e].stored.clone();
        let Ok((bytes, backs)) = self.slot.take_all_back(stored.as_deref(), now, 0, 0) else {
            return Ok(());
        };
        self.envoys[e].stored = Some(bytes);
        let (c, r, p) = (
            self.b.capacity as u64,
            self.b.refill as u64,
            self.b.period as u64,
        );
        let args: Vec<String> = backs
            .iter()
            .flat_map(|b| b.args(c, r, p))
            .map(|a| String::from_utf8(a).unwrap_or_default())
            .collect();
        let fresh = self.envoys[e].fresh;
        let got = self.give_back_call(&args)?;
        for (b, x) in backs.iter().zip(&got) {
            if !(0..=b.tokens as i64).contains(x) {
                return Err(format!("a give-back of {} returned {x}", b.tokens));
            }
        }
        // The newest grant's part comes first: right after its grant, with
        // nothing between, it fits whole.
        if fresh > 0 && got.first() == Some(&0) && !without("fresh") {
            return Err(format!(
                "envoy {e} gave back {backs:?} at the instant its grant of {fresh} landed, \
                 nothing between, and Redis took none back"
            ));
        }
        let env = &mut self.envoys[e];
        env.unreturned = std::mem::take(&mut env.from);
        env.last_back = Some(args);
        self.took_back(e, got.iter().sum());
        self.envoys[e].last_got = got.clone();
        self.push(Event::Back(got.iter().any(|x| *x > 0)));
        Ok(())
    }

    /// `n` tokens of Envoy `e`'s last give-back taken back: the newest
    /// grants' first.
    fn took_back(&mut self, e: usize, mut n: i64) {
        for (id, held) in self.envoys[e].unreturned.iter_mut().rev() {
            let m = (*held as i64).min(n);
            self.kept[*id] -= m;
            *held -= m as u64;
            n -= m;
        }
    }

    fn resend(&mut self, e: usize) -> Result<(), String> {
        let Some(args) = self.envoys[e].last_back.clone() else {
            return Ok(());
        };
        // The Envoy sees only this reply; the first's tokens were counted.
        // A part the first call took back answers the same and writes
        // nothing; one it answered 0 is a first give-back now.
        let got = self.give_back_call(&args)?;
        let first = std::mem::take(&mut self.envoys[e].last_got);
        let mut new = 0;
        let mut now_got = first.clone();
        for (k, x) in got.iter().enumerate() {
            match first.get(k) {
                Some(0) => {
                    new += x;
                    now_got[k] = *x;
                }
                // Or 0 (a plan stored, a reset between): nothing written.
                Some(y) if *x != 0 && y != x => {
                    return Err(format!("a give-back of {y} sent again answered {x}"));
                }
                _ => {}
            }
        }
        self.took_back(e, new);
        self.envoys[e].last_got = now_got;
        self.push(Event::Back(new > 0));
        Ok(())
    }

    fn reset(&mut self) {
        // What `redis-guard reset` does to a token bucket (src/cli/): its
        // keys deleted, its give-back record started after this ms.
        let mut keys = vec![KEY.as_bytes().to_vec(), block_key(KEY.as_bytes())];
        keys.extend(state_keys_beside(KEY.as_bytes()));
        for k in keys {
            redis::cmd("DEL").arg(k).query::<()>(self.con).unwrap();
        }
        redis::cmd("SET")
            .arg(give_back_key(KEY.as_bytes()))
            .arg(restarted_give_back_record(self.now as u64 + 1))
            .arg("XX")
            .query::<()>(self.con)
            .unwrap();
        self.reset_at = self.now;
        self.push(Event::Reset);
    }

    /// What `redis-guard override set` (or unset) does: one SET (DEL) of
    /// the key's override key.
    fn set_plan(&mut self, i: Option<usize>) {
        let over = redis_guard::keys::override_key(KEY.as_bytes()).unwrap_or_default();
        self.plan = i.map(|i| PLANS[i]);
        let mut cmd = redis::cmd(if self.plan.is_some() { "SET" } else { "DEL" });
        cmd.arg(over);
        if let Some((c, r)) = self.plan {
            cmd.arg(format!("tb {c} {r}"));
        }
        cmd.query::<()>(self.con).unwrap();
        self.push(Event::Plan);
    }

    /// The reference replayed with what is known now; the first step whose
    /// real level exceeds it.
    fn check(&self) -> Result<(), String> {
        let period = self.b.period;
        let configured = self.configured();
        let mut reference: Option<(i64, i64)> = None;
        for (i, &(event, real, now, plan)) in self.log.iter().enumerate() {
            // A write at `now` under `f`, `take` credits less.
            let write = |r, f, take: i64| Some((lazy(r, now, f, period) - take, now));
            match event {
                Event::Take { cost, id, under } => {
                    reference = write(reference, under, (cost + self.kept[id]) * period);
                }
                Event::Charge(y, under) => reference = write(reference, under, y * period),
                Event::Back(true) => reference = write(reference, configured, 0),
                Event::Reset => reference = None,
                Event::Step | Event::Back(false) | Event::Plan => {}
            }
            for f in [Some(configured), plan].into_iter().flatten() {
                let (r, f_ref) = (lazy(real, now, f, period), lazy(reference, now, f, period));
                if r > f_ref {
                    return Err(format!(
                        "after step {i} ({event:?}) the bucket holds {r} credits under {f:?}, \
                         more than the {f_ref} of a bucket that never leased the tokens given \
                         back (configured {configured:?}, tokens of {period} credits)"
                    ));
                }
            }
        }
        Ok(())
    }
}

pub fn load(con: &mut Connection) {
    engine::load(con, &[&LEASE_AT, &RETURN_AT, &STRICT_AT]);
}

pub fn run(con: &mut Connection, s: &Schedule) -> Result<(), String> {
    engine::fresh(con);
    let mut w = World {
        con,
        b: bucket(s.capacity, 1, 1_000),
        now: script::T0,
        slot: Slot::of(KEY.as_bytes()),
        envoys: (0..s.envoys).map(|_| Envoy::default()).collect(),
        kept: Vec::new(),
        log: Vec::new(),
        reset_at: i64::MIN,
        plan: None,
        plan_charged_at: i64::MIN,
    };
    script::set_clock(w.con, w.now);
    for op in &s.ops {
        // Shrinking may bring a left-out kind back (a union shrinks toward
        // its first variants): skipped here too.
        if (without("reset") && matches!(op, Op::Reset))
            || (without("resend") && matches!(op, Op::Resend { .. }))
        {
            continue;
        }
        match *op {
            Op::Tick(i) => {
                w.now += TICKS[i];
                script::set_clock(w.con, w.now);
                if TICKS[i] > 0 {
                    w.push(Event::Step);
                }
            }
            Op::Request { e, cost } => w.request(e % s.envoys, cost),
            Op::GiveBack { e } => w.give_back(e % s.envoys)?,
            Op::Resend { e } => w.resend(e % s.envoys)?,
            Op::Strict { cost } => w.strict((cost as i64).min(s.capacity)),
            Op::Reset => w.reset(),
            Op::LostFetch { e } => {
                let e = e % s.envoys;
                if let Some((granted, _, under)) = w.lease(1, BATCH) {
                    // Redis charged and granted; the Envoy saw nothing.
                    let id = w.kept.len();
                    w.kept.push(granted as i64);
                    w.push(Event::Take { cost: 1, id, under });
                    let stored = w.envoys[e].stored.clone();
                    if let Some(bytes) = w.slot.fetch_failed(stored.as_deref()) {
                        w.envoys[e].stored = Some(bytes);
                    }
                }
            }
            Op::Everyone { cost } => {
                for e in 0..s.envoys {
                    w.request(e, cost);
                }
            }
            Op::Plan(i) => w.set_plan(i),
            Op::Reload { e } => {
                let env = &mut w.envoys[e % s.envoys];
                env.stored = None;
                env.from.clear();
                env.fresh = 0;
            }
        }
        w.check()?;
    }
    Ok(())
}

pub const PROPERTY: Property = Property {
    name: "leases_never_hold_more_than_a_bucket_that_never_leased",
    seed: 0x5EA5_E0B1,
};
