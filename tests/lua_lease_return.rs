//! `lua/lease_return.lua` (with lua/token_bucket.lua joined in, as the
//! filter sends it) against a real redis-server: unspent leased tokens given
//! back, never more than a bucket that never leased them would hold. The
//! seeded run and the worked cases use the test clock (tests/support/
//! script.rs) with TTLs dropped, so every level is exact; the record's TTL
//! and the contract errors run at Redis' own clock.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::LazyLock;

use redis::Connection;
use redis_guard::scripts::{Script, LEASE, LEASE_RETURN};
use support::script::{self, bucket, eval_lease, lease_peaks, lease_returned, Bucket};
use support::{key_exists as exists, key_pttl as pttl, read_bucket as state};

/// One hour: with one credit per ms, a test never refills a whole token.
const HOUR: i64 = 3_600_000;

/// lua/lease.lua's TTL of the give-back record (ms).
const RETURNED_TTL: i64 = 660_000;

/// A slow bucket: one token per hour (one credit per ms).
fn hourly(capacity: i64) -> Bucket {
    bucket(capacity, 1, HOUR)
}

/// `cmd` (EVAL of lua/ratelimit.lua) with the bucket as one limit.
fn strict_cmd(cmd: redis::Cmd, key: &str, b: Bucket, cost: i64) -> redis::Cmd {
    script::with_limits(cmd, &[b.limit(key, cost)], None)
}

/// lua/lease.lua at the test clock, without TTLs (the test clock jumps; a
/// TTL runs on Redis' own clock).
static LEASE_AT: LazyLock<Script> =
    LazyLock::new(|| script::without_expiry(&script::with_test_clock(&LEASE)));
/// lua/lease_return.lua at the test clock, without TTLs.
static RETURN_AT: LazyLock<Script> =
    LazyLock::new(|| script::without_expiry(&script::with_test_clock(&LEASE_RETURN)));
/// The strict script at the test clock, without TTLs.
static STRICT_AT: LazyLock<Script> =
    LazyLock::new(|| script::without_expiry(&script::RATELIMIT_AT));

/// The script's one error reply for a malformed give-back.
const BAD_RETURN: (&str, &str) = ("ERR", "redis-guard lease return: seven numbers per key");

/// A lease at the test clock: the verdict and grant, and the tuple.
fn lease_at(
    con: &mut Connection,
    key: &str,
    b: Bucket,
    cost: i64,
    lease_of: i64,
) -> ([i64; 6], [i64; 3]) {
    let raw: Vec<i64> = script::with_lease(script::eval(&LEASE_AT), key, b, cost, lease_of)
        .query(con)
        .unwrap();
    script::split_lease(raw.try_into().unwrap())
}

/// A strict request of `cost` at the test clock; true if admitted.
fn strict_at(con: &mut Connection, key: &str, b: Bucket, cost: i64) -> bool {
    let raw: Vec<i64> = strict_cmd(script::eval(&STRICT_AT), key, b, cost)
        .query(con)
        .unwrap();
    raw[0] == 1
}

/// Gives `tokens` back to `key` with a grant's tuple; the tokens taken back.
fn give_back(
    con: &mut Connection,
    script: &Script,
    key: &str,
    b: Bucket,
    tokens: i64,
    tuple: [i64; 3],
) -> i64 {
    let raw: Vec<i64> = script::eval(script)
        .arg(1)
        .arg(key)
        .arg(b.capacity)
        .arg(b.refill)
        .arg(b.period)
        .arg(tokens)
        .arg(&tuple[..])
        .query(con)
        .unwrap_or_else(|e| panic!("give-back of {tokens} to {key} ({tuple:?}): {e}"));
    assert_eq!(raw.len(), 1, "one figure per key: {raw:?}");
    raw[0]
}

/// The bucket's level (credits) at test-clock instant `now`.
fn level_at(con: &mut Connection, key: &str, b: Bucket, now: i64) -> i64 {
    let full = b.capacity * b.period;
    match state(con, key) {
        None => full,
        Some((c, t)) if now > t => full.min(c + (now - t) * b.refill),
        Some((c, _)) => full.min(c),
    }
}

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

/// One Envoy's slot: tokens held, the tuple kept, and which grants the held
/// tokens came from (id, tokens still held), oldest first.
#[derive(Debug, Default)]
struct Pot {
    held: i64,
    tuple: [i64; 3],
    from: Vec<(usize, i64)>,
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

/// Runs a seeded sequence of grants, strict charges, spends, give-backs
/// and clock steps on a real bucket (three Envoys' slots), then replays it
/// on a reference bucket that never took the tokens given back, and asserts
/// the real level never exceeds the reference's. Returns (tokens given
/// back, give-backs the bound cut).
fn safety_run(seed: u64, steps: usize, script: &Script) -> (i64, usize) {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:lease:safety";
    // 30 tokens, one a second: refill matters at the scale of the steps.
    let b = bucket(30, 1, 1000);
    let full = b.capacity * b.period;
    let mut rng = Rng(seed);
    let mut now = script::T0;
    script::set_clock(&mut con, now);
    let mut pots: [Pot; 3] = Default::default();
    let mut grants: Vec<i64> = Vec::new(); // tokens each grant took
    let mut kept: Vec<i64> = Vec::new(); // of which never given back
    let mut log: Vec<(Event, i64)> = Vec::new(); // with the real level after
    let (mut back_total, mut cut) = (0, 0);
    for _ in 0..steps {
        let e = rng.below(3) as usize;
        let event = match rng.below(100) {
            0..=29 => {
                let dt = [0, 1, 7, 120, 900, 4_000, 30_000][rng.below(7) as usize];
                now += dt;
                script::set_clock(&mut con, now);
                Some(Event::Step(dt))
            }
            30..=54 => {
                let cost = rng.below(3);
                let (reply, tuple) = lease_at(&mut con, key, b, cost, 1 + rng.below(BATCH as u64));
                (reply[0] == 1).then(|| {
                    let g = reply[5];
                    let id = grants.len();
                    grants.push(g);
                    kept.push(g);
                    let pot = &mut pots[e];
                    // An Envoy holds at most a batch: what a grant brings
                    // beyond it is dropped (src/lease.rs), taken for good.
                    let g = g.min(BATCH - pot.held);
                    if g > 0 {
                        if pot.held == 0 {
                            // An empty slot takes the new tuple; one that
                            // holds tokens keeps the older.
                            pot.tuple = tuple;
                        }
                        pot.held += g;
                        pot.from.push((id, g));
                    }
                    Event::Take { cost, id }
                })
            }
            55..=69 => {
                let y = 1 + rng.below(4);
                strict_at(&mut con, key, b, y).then_some(Event::Charge(y))
            }
            70..=84 => {
                // Spends, oldest grant first: no Redis call.
                let pot = &mut pots[e];
                let mut k = rng.below(pot.held as u64 + 1);
                pot.held -= k;
                while k > 0 {
                    let first = &mut pot.from[0];
                    let n = first.1.min(k);
                    first.1 -= n;
                    k -= n;
                    if first.1 == 0 {
                        pot.from.remove(0);
                    }
                }
                None
            }
            _ => {
                let pot = &mut pots[e];
                if pot.held == 0 {
                    None
                } else {
                    let x = give_back(&mut con, script, key, b, pot.held, pot.tuple);
                    assert!((0..=pot.held).contains(&x), "{x} of {}", pot.held);
                    back_total += x;
                    if x < pot.held {
                        cut += 1;
                    }
                    // The tokens given back are the newest grants'.
                    let mut x = x;
                    for (id, n) in pot.from.iter().rev() {
                        let m = (*n).min(x);
                        kept[*id] -= m;
                        x -= m;
                    }
                    *pot = Pot::default();
                    Some(Event::Back)
                }
            }
        };
        if let Some(event) = event {
            log.push((event, level_at(&mut con, key, b, now)));
        }
    }
    // The reference: the same admissions and clock, without the tokens that
    // came back.
    let mut reference = full;
    for (i, (event, real)) in log.iter().enumerate() {
        match *event {
            Event::Step(dt) => reference = full.min(reference + dt * b.refill),
            Event::Take { cost, id } => reference -= (cost + kept[id]) * b.period,
            Event::Charge(y) => reference -= y * b.period,
            Event::Back => {}
        }
        assert!(
            *real <= reference,
            "seed {seed}, event {i} {event:?}: the bucket holds {real} credits, \
             more than {reference} had the tokens given back never left"
        );
    }
    let _ = grants;
    (back_total, cut)
}

#[test]
fn giving_back_never_leaves_more_than_had_the_tokens_never_left() {
    let (mut back, mut cut) = (0, 0);
    for seed in (1..=16u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)) {
        let (b, c) = safety_run(seed, 600, &RETURN_AT);
        back += b;
        cut += c;
    }
    // The runs exercise both sides of the bound: tokens came back, and the
    // bound held some back.
    assert!(back > 0 && cut > 0, "given back {back}, cut {cut}");
}

#[test]
fn a_give_back_after_the_bucket_refilled_to_the_cap_returns_at_most_c_minus_m() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    // 40 tokens, one a second.
    let b = bucket(40, 1, 1000);
    let case = |con: &mut Connection, key: &str, wait: i64| {
        script::set_clock(con, script::T0);
        // Full: 1 charged, 8 granted (a quarter of 39 is 9), 31 left.
        let (reply, tuple) = lease_at(con, key, b, 1, 8);
        assert_eq!(reply, [1, 1, 31, 0, 9_000, 8]);
        assert_eq!(tuple, [script::T0, 31_000, 0]);
        script::set_clock(con, script::T0 + wait);
        assert!(strict_at(con, key, b, 3));
        give_back(con, &RETURN_AT, key, b, 8, tuple)
    };
    // 9 s later the bucket refilled to the cap while the 8 were out (M = C):
    // a bucket that never leased them holds 40 - 3 = 37, as this one does
    // already. The naive give-back (8, capped at 40) would make it 40.
    assert_eq!(case(&mut con, "t:{x}:lease:cap", 9_000), 0);
    assert_eq!(
        level_at(&mut con, "t:{x}:lease:cap", b, script::T0 + 9_000),
        37_000
    );
    // 5 s later it reached 36 (M): C - M = 4 come back, 33 + 4 = 37, what a
    // bucket that never leased them holds (39 + 5 capped at 40, less 3).
    assert_eq!(case(&mut con, "t:{x}:lease:part", 5_000), 4);
    assert_eq!(
        level_at(&mut con, "t:{x}:lease:part", b, script::T0 + 5_000),
        37_000
    );
    assert_eq!(lease_returned(&mut con, "t:{x}:lease:part"), 4);
    // At once (no refill, no charge between): all 8.
    script::set_clock(&mut con, script::T0);
    let (_, tuple) = lease_at(&mut con, "t:{x}:lease:now", b, 1, 8);
    assert_eq!(
        give_back(&mut con, &RETURN_AT, "t:{x}:lease:now", b, 8, tuple),
        8
    );
    assert_eq!(level_at(&mut con, "t:{x}:lease:now", b, script::T0), 39_000);
    // Two Envoys taking turns: grants of 8 and 7 (a quarter of 30), the
    // second given back whole, leaving 30 (a peak), then a strict request
    // takes 10. The first is judged against the highest level since its
    // grant, 31 (its own), not against 31 plus the 7 given back meanwhile
    // (which would let only 2 come back): all 8, and the bucket holds 28,
    // exactly what a bucket that never leased holds (40 - 1 - 1 - 10).
    let key = "t:{x}:lease:two";
    let (r1, t1) = lease_at(&mut con, key, b, 1, 8);
    let (r2, t2) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!((r1[5], r2[5]), (8, 7));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 7, t2), 7);
    assert_eq!(lease_peaks(&mut con, key), [[7, 30_000, script::T0]]);
    assert!(strict_at(&mut con, key, b, 10));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, t1), 8);
    assert_eq!(level_at(&mut con, key, b, script::T0), 28_000);
    assert_eq!(lease_returned(&mut con, key), 15);
    // The 8 left 28, below the 30 peak: both kept, levels falling.
    assert_eq!(
        lease_peaks(&mut con, key),
        [[7, 30_000, script::T0], [15, 28_000, script::T0]]
    );
    // A peak above a grant's level decides its bound: grant A at 28 (cost
    // 1, 6 granted: 21 left), the strict side takes 5 (16), grant B (cost
    // 1, 3 granted: 12 left), A gives back 6 (18: a peak above B's 12), and
    // B's 3 are judged against M' = 18: all 3 come back (21), what a bucket
    // that never leased holds (28 - 1 - 5 - 1).
    let (ra, ta) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!((ra[5], ta[1]), (6, 21_000));
    assert!(strict_at(&mut con, key, b, 5));
    let (rb, tb) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!((rb[5], tb[1]), (3, 12_000));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 6, ta), 6);
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 3, tb), 3);
    assert_eq!(level_at(&mut con, key, b, script::T0), 21_000);
    assert_eq!(
        lease_peaks(&mut con, key).last(),
        Some(&[24, 21_000, script::T0])
    );

    // And a peak that lets the refill reach the cap: B takes 8 (31 left),
    // the strict side 16 (15), A takes 3 at 11, B gives back 8 (19: a
    // peak), 21 s later the bucket is full, the strict side takes 3 (37).
    // A's level was 11, 11 + 21 < 40, but the peak's 19 + 21 reached the
    // cap: nothing comes back (a bucket that never leased holds 37 too).
    let key = "t:{x}:lease:peak";
    script::set_clock(&mut con, script::T0);
    let (rb, tb) = lease_at(&mut con, key, b, 1, 8);
    assert!(strict_at(&mut con, key, b, 16));
    let (ra, ta) = lease_at(&mut con, key, b, 1, 8);
    assert_eq!((rb[5], ra[5], ta[1]), (8, 3, 11_000));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 8, tb), 8);
    script::set_clock(&mut con, script::T0 + 21_000);
    assert!(strict_at(&mut con, key, b, 3));
    assert_eq!(give_back(&mut con, &RETURN_AT, key, b, 3, ta), 0);
    assert_eq!(level_at(&mut con, key, b, script::T0 + 21_000), 37_000);
}

#[test]
fn the_counter_outlives_every_lease_and_a_stale_or_unknown_tuple_gives_nothing_back() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let key = "t:{x}:lease:counter";
    let ck = format!("{key}:ret");
    let b = hourly(40);
    let (reply, tuple) = script::split_lease(eval_lease(&mut con, key, b, 1, 4));
    assert_eq!(reply[5], 4);
    assert!(pttl(&mut con, &ck) > 600_000);
    // Given back at once: all 4 (the refill of a few ms is far from a token).
    assert_eq!(give_back(&mut con, &LEASE_RETURN, key, b, 4, tuple), 4);
    assert_eq!(lease_returned(&mut con, key), 4);
    let ttl = pttl(&mut con, &ck);
    assert!(
        600_000 < ttl && ttl <= RETURNED_TTL,
        "the give-back keeps the TTL: {ttl}"
    );

    let (_, tuple) = script::split_lease(eval_lease(&mut con, key, b, 1, 4));
    assert_eq!(tuple[2], 4, "the next grant carries the count");
    let stored = state(&mut con, key);
    // Older than the longest lease: nothing.
    let [t0, level, counted] = tuple;
    let stale = [t0 - 600_001, level, counted];
    assert_eq!(give_back(&mut con, &LEASE_RETURN, key, b, 4, stale), 0);
    // A counter below the tuple's (it went backwards): nothing.
    assert_eq!(
        give_back(&mut con, &LEASE_RETURN, key, b, 4, [t0, level, 5]),
        0
    );
    // A tuple from Redis' future (a clock stepped back): nothing.
    assert_eq!(
        give_back(&mut con, &LEASE_RETURN, key, b, 4, [t0 + HOUR, level, 4]),
        0
    );
    // The counter gone: nothing, and it is not created.
    redis::cmd("DEL").arg(&ck).query::<()>(&mut con).unwrap();
    assert_eq!(give_back(&mut con, &LEASE_RETURN, key, b, 4, tuple), 0);
    assert!(!exists(&mut con, &ck));
    assert_eq!(state(&mut con, key), stored, "nothing written");
}

#[test]
fn a_give_back_refuses_anything_but_seven_whole_numbers_per_key() {
    let (_redis, mut con) = support::Redis::start_with_conn();
    let (a, b) = ("t:{x}:lease:rerr-a", "t:{x}:lease:rerr-b");
    let good = ["10", "1", "1000", "2", "1700000000000", "5000", "0"];
    let mut cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec![], vec![]),
        (vec![a], good[..6].to_vec()),
        (vec![a, b], good.to_vec()),
        (vec![a], [&good[..], &["1"]].concat()),
    ];
    for i in 0..good.len() {
        for bad in ["nan", "inf", "", "2.5", "-1", "x"] {
            let mut argv = good.to_vec();
            argv[i] = bad;
            cases.push((vec![a], argv));
        }
    }
    // No tokens, or more than the capacity.
    for tokens in ["0", "11"] {
        let mut argv = good.to_vec();
        argv[3] = tokens;
        cases.push((vec![a], argv));
    }
    // A bad second key spoils the first: nothing written.
    cases.push((vec![a, b], [&good[..], &good[..6], &["-1"]].concat()));
    for (keys, argv) in &cases {
        let Err(err) = script::eval_raw(&mut con, &LEASE_RETURN, keys, argv) else {
            panic!("KEYS {keys:?} ARGV {argv:?} must fail");
        };
        assert_eq!(
            (err.code(), err.detail()),
            (Some(BAD_RETURN.0), Some(BAD_RETURN.1)),
            "KEYS {keys:?} ARGV {argv:?}: {err}"
        );
    }
    for k in [a, b] {
        assert!(!exists(&mut con, k) && !exists(&mut con, &format!("{k}:ret")));
    }
}
