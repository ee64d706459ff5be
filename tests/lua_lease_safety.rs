//! lua/lease_return.lua against a real redis-server, seeded: a fleet of 3
//! to 8 Envoys holding leases of one bucket, as src/lease.rs keeps them
//! (each grant's tokens under its tuple, older ones under the oldest
//! earlier grant's), fetching, spending, giving back (and sending a
//! give-back again), beside strict requests and clock steps, at the test
//! clock with TTLs dropped so every level is exact. After the run, a
//! reference bucket replays it without the tokens given back: the real one
//! must never hold more. The worked cases are in tests/lua_lease_return.rs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use redis::Connection;
use redis_guard::scripts::Script;
use support::script::{
    self, bucket, give_backs, lease_at, lease_record, level_at, start_leasing, strict_at, Bucket,
    RETURN_AT, RETURN_SMALL,
};

/// What happened to the real bucket, for the reference to replay.
#[derive(Debug, Clone, Copy)]
enum Event {
    /// The clock moved on by this many ms.
    Step(i64),
    /// A lease admitted a request of `cost` and granted grant `id`.
    Take { cost: i64, id: usize },
    /// A strict request of this cost was admitted.
    Charge(i64),
    /// Tokens came back (the reference never took them).
    Back,
}

/// A give-back call: (tokens, tuple) per give-back, one key.
type Call = Vec<(i64, [i64; 3])>;

/// One Envoy's slot as src/lease.rs keeps it: tokens held, of which the
/// newest grant's, its tuple and the older tokens' (the oldest grant's
/// among them), and which grants the held tokens came from (id, tokens
/// still held), oldest first.
#[derive(Debug, Default)]
struct Pot {
    held: i64,
    newest_held: i64,
    newest: [i64; 3],
    older: [i64; 3],
    from: Vec<(usize, i64)>,
    /// The last give-back call sent and Redis' answers.
    sent: Option<(Call, Vec<i64>)>,
}

/// The most tokens one simulated Envoy asks for and holds.
const BATCH: i64 = 12;

/// A small seeded generator: the same sequence on every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> i64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n) as i64
    }
}

/// A fleet of Envoys on one real bucket, at the test clock: what each
/// holds, and the log the reference replays.
struct Fleet<'a> {
    con: &'a mut Connection,
    key: String,
    /// lua/lease_return.lua as the test calls it.
    give_back: &'static Script,
    b: Bucket,
    now: i64,
    rng: Rng,
    pots: Vec<Pot>,
    /// Per grant: its tokens never given back.
    kept: Vec<i64>,
    /// The events, each with the real level after it.
    log: Vec<(Event, i64)>,
    /// Tokens given back, and give-backs the bound cut.
    back: i64,
    cut: usize,
    resent: usize,
    /// The first give-back sent again whose answer changed.
    wrong: Option<String>,
}

impl Fleet<'_> {
    fn logged(&mut self, event: Event) {
        let level = level_at(self.con, &self.key, self.b, self.now);
        self.log.push((event, level));
    }

    /// Envoy `e` fetches: a request of `cost` and a grant of up to `want`.
    fn take(&mut self, e: usize, cost: i64, want: i64) {
        let (reply, tuple) = lease_at(self.con, &self.key, self.b, cost, want);
        if reply[0] == 0 {
            return;
        }
        let id = self.kept.len();
        self.kept.push(reply[5]);
        let pot = &mut self.pots[e];
        // An Envoy holds at most a batch: what a grant brings beyond it is
        // dropped (src/lease.rs), taken for good.
        let g = reply[5].min(BATCH - pot.held);
        if g > 0 {
            // The tokens held become the older ones: under the older tuple
            // while some of its grant's are left, else the newest's.
            if pot.newest_held == pot.held {
                pot.older = pot.newest;
            }
            pot.newest = tuple;
            pot.newest_held = g;
            pot.held += g;
            pot.from.push((id, g));
        }
        self.logged(Event::Take { cost, id });
    }

    /// Envoy `e` spends some of its tokens, oldest grant first: no call.
    fn spend(&mut self, e: usize) {
        let pot = &mut self.pots[e];
        let mut k = self.rng.below(pot.held as u64 + 1);
        pot.held -= k;
        pot.newest_held = pot.newest_held.min(pot.held);
        while k > 0 {
            let first = &mut pot.from[0];
            let n = first.1.min(k);
            first.1 -= n;
            k -= n;
            if first.1 == 0 {
                pot.from.remove(0);
            }
        }
    }

    /// Envoy `e` gives back whatever it holds, in one call: the newest
    /// grant's tokens under its tuple, then the older ones under theirs.
    fn back(&mut self, e: usize) {
        let pot = std::mem::take(&mut self.pots[e]);
        self.pots[e].sent = pot.sent;
        let parts: Call = [
            (pot.newest_held, pot.newest),
            (pot.held - pot.newest_held, pot.older),
        ]
        .into_iter()
        .filter(|(n, _)| *n > 0)
        .collect();
        if parts.is_empty() {
            return;
        }
        let xs = give_backs(self.con, self.give_back, &self.key, self.b, &parts);
        // The newest grant's tokens are the last grant's held; the older
        // ones given back are taken as the newest among the rest.
        let mut from = pot.from.iter().rev();
        for ((tokens, _), x) in parts.iter().zip(&xs) {
            assert!((0..=*tokens).contains(x), "{x} of {tokens}");
            self.back += x;
            self.cut += usize::from(x < tokens);
            let (mut x, mut left) = (*x, *tokens);
            while left > 0 {
                let Some((id, n)) = from.next() else { break };
                let m = (*n).min(x);
                self.kept[*id] -= m;
                x -= m;
                left -= n;
            }
        }
        self.pots[e].sent = Some((parts, xs));
        self.logged(Event::Back);
    }

    /// Envoy `e`'s last give-back delivered again (a reply lost after the
    /// call ran): the same answer, or none once the record no longer tells
    /// it (merged, or older than the longest lease), and nothing more in
    /// the bucket (the reference counts its tokens once).
    fn resend(&mut self, e: usize) {
        let Some((parts, first)) = self.pots[e].sent.clone() else {
            return;
        };
        let xs = give_backs(self.con, self.give_back, &self.key, self.b, &parts);
        let same = xs.iter().zip(&first).all(|(x, f)| x == f || *x == 0);
        if !same && self.wrong.is_none() {
            let i = self.log.len();
            self.wrong = Some(format!(
                "event {i}: {parts:?} sent again: {xs:?}, first {first:?}"
            ));
        }
        self.resent += 1;
        self.logged(Event::Back);
    }

    /// A strict request of `y`, logged if admitted.
    fn charge(&mut self, y: i64) {
        if y > 0 && strict_at(self.con, &self.key, self.b, y) {
            self.logged(Event::Charge(y));
        }
    }

    /// The first event after which the real bucket held more than the
    /// reference: the same admissions and clock, without the tokens that
    /// came back.
    fn broken(&self) -> Option<String> {
        if self.wrong.is_some() {
            return self.wrong.clone();
        }
        let full = self.b.capacity * self.b.period;
        let mut reference = full;
        for (i, (event, real)) in self.log.iter().enumerate() {
            match *event {
                Event::Step(dt) => reference = full.min(reference + dt * self.b.refill),
                Event::Take { cost, id } => {
                    reference -= (cost + self.kept[id]) * self.b.period;
                }
                Event::Charge(y) => reference -= y * self.b.period,
                Event::Back => {}
            }
            if *real > reference {
                return Some(format!(
                    "event {i} {event:?}: the bucket holds {real} credits, more than \
                     {reference} had the tokens given back never left"
                ));
            }
        }
        None
    }
}

/// Runs `steps` seeded events on a real bucket `key` shared by `envoys`
/// Envoys: fetches (one, or a burst of every empty Envoy at one instant),
/// spends, give-backs (one, or every Envoy in turn), strict requests
/// (small, or all but a few of what the bucket holds) and clock steps at
/// the scale of the bucket's refill. What tells a give-back bound that is
/// sound per grant but not across grants: several grants out at once,
/// one given back early, a refill that would have reached the cap, a large
/// strict request, then the others given back.
fn safety_run<'a>(
    con: &'a mut Connection,
    key: &str,
    seed: u64,
    envoys: usize,
    give_back: &'static Script,
) -> Fleet<'a> {
    // 100 tokens, one a second.
    let b = bucket(100, 1, 1000);
    let full = b.capacity * b.period;
    script::set_clock(con, script::T0);
    let mut f = Fleet {
        con,
        key: key.to_string(),
        give_back,
        b,
        now: script::T0,
        rng: Rng(seed),
        pots: (0..envoys).map(|_| Pot::default()).collect(),
        kept: Vec::new(),
        log: Vec::new(),
        back: 0,
        cut: 0,
        resent: 0,
        wrong: None,
    };
    for _ in 0..600 {
        let e = f.rng.below(envoys as u64) as usize;
        match f.rng.below(100) {
            0..=32 => {
                let dt = [0, 1, full / 4, full / 6, full / 3, 2 * full][f.rng.below(6) as usize];
                f.now += dt / b.refill;
                script::set_clock(f.con, f.now);
                f.logged(Event::Step(dt / b.refill));
            }
            33..=34 => {
                let (cost, want) = (f.rng.below(3), 1 + f.rng.below(BATCH as u64));
                f.take(e, cost, want);
            }
            35..=44 => {
                for k in 0..envoys {
                    if f.pots[k].held == 0 {
                        f.take(k, 0, BATCH);
                    }
                }
            }
            45..=56 => {
                let y = 1 + f.rng.below(4);
                f.charge(y);
            }
            57..=65 => {
                let level = level_at(f.con, key, b, f.now) / b.period;
                let y = level - f.rng.below(4);
                f.charge(y);
            }
            66..=67 => f.spend(e),
            68..=87 => f.back(e),
            88..=91 => f.resend(e),
            _ => {
                let mut order: Vec<usize> = (0..envoys).collect();
                for i in (1..envoys).rev() {
                    order.swap(i, f.rng.below(i as u64 + 1) as usize);
                }
                for k in order {
                    f.back(k);
                }
            }
        }
    }
    f
}

/// Seeds of the run below, each with 3 to 8 Envoys.
const SEEDS: u64 = 100;

#[test]
fn giving_back_never_leaves_more_than_had_the_tokens_never_left() {
    let (_redis, mut con) = start_leasing();
    let (mut back, mut cut, mut merged, mut resent, mut broken) = (0, 0, 0, 0, Vec::new());
    for i in 1..=SEEDS {
        let seed = i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let envoys = 3 + (i % 6) as usize;
        let key = format!("t:{{x}}:lease:safety:{i}");
        // Every other run with records of two entries: merged ones count
        // as the header says.
        let script = if i % 2 == 0 {
            &RETURN_SMALL
        } else {
            &RETURN_AT
        };
        let f = safety_run(&mut con, &key, seed, envoys, script);
        back += f.back;
        cut += f.cut;
        resent += f.resent;
        if let Some(why) = f.broken() {
            broken.push(format!("seed {i} ({seed:#x}, {envoys} Envoys): {why}"));
        }
        let record = lease_record(f.con, &key);
        merged += record.map_or(0, |r| r.entries.iter().filter(|e| e[5] > 1).count());
    }
    assert!(
        broken.is_empty(),
        "{} of {SEEDS} runs broke:\n{}",
        broken.len(),
        broken.join("\n")
    );
    // The runs exercise every side of the bound: tokens came back, the
    // bound held some back, records merged entries, give-backs came twice.
    assert!(
        back > 0 && cut > 0 && merged > 0 && resent > 0,
        "given back {back}, cut {cut}, merged entries {merged}, sent again {resent}"
    );
}
