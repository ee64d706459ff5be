//! `lua/batch.lua` against a real redis-server: M requests decided one after
//! another in one call must answer, member by member, exactly as the same
//! requests sent one by one to `lua/ratelimit.lua` in the same order, and
//! leave the same state behind (issue 13).
//!
//! The property test sends random sequences over every limit kind (token
//! buckets, sliding-window logs, GCRA, fixed windows, sliding-window
//! counters, concurrency limits), costs, shadow limits, idempotency keys and rejections both
//! ways and compares. The deterministic tests pin down the cases a reader
//! asks about first: a batch of one, a rejection in the middle, shadow limits,
//! a hot key, idempotency locks inside a batch, malformed sizes, TTLs.
//!
//! Redis TIME cannot be mocked, so every refill period and window here is
//! hour-scale. A batch runs at one instant (TIME read once); the one-by-one
//! calls of a case span a few milliseconds, measured with TIME before the
//! first and after the last. Why that cannot change a verdict:
//!
//! * token bucket: one token is `period` credits and each millisecond adds
//!   `refill` credits; with period >= 1 h and refill <= 3, a token takes at
//!   least 20 minutes to come back. `allowed` and `remaining` are
//!   `floor(credits / period)` comparisons, so extra credits worth
//!   milliseconds change neither; `retry_ms` and `reset_ms` are lower in the
//!   one-by-one run by exactly the age of the bucket's state (<= elapsed);
//! * sliding window: a member leaves only once it is a window (>= 1 h) old,
//!   so both runs count the same members; `retry_ms` and `reset_ms` are
//!   `stamp + window - now`, again lower by the member's age (<= elapsed).
//! * GCRA: the token bucket's arithmetic on one stored instant (the TAT),
//!   with the same hour-scale periods and rates: the same verdicts and
//!   remaining counts, `retry_ms` and `reset_ms` lower by the age of the
//!   TAT's first charge in B (<= elapsed), and the stored TATs apart by
//!   when B first charged, after the batch (<= the whole span of A and B);
//! * fixed window and sliding-window counter: windows are aligned to hour
//!   edges, so while no edge falls between the batch and the last
//!   one-by-one call, both runs count in the same window (and, the keys
//!   being new, no previous window weighs): counts, verdicts and stored
//!   state agree exactly, and `retry_ms` and `reset_ms` run to the same
//!   window edges, lower in B by how much later its call ran (<= the whole
//!   span). A case an edge falls into is not compared (about one case in
//!   50000 at a few tens of ms a case).
//! * concurrency: leases of an hour or more, so no slot's lease ends while a
//!   case runs and both runs count the same live slots: verdicts, remaining
//!   counts, `retry_ms` (1 s when rejected) and `reset_ms` (always 0) agree
//!   exactly. Each member's slot id is its own and the same in both runs,
//!   so both sets hold the same members; their scores (lease ends) are the
//!   batch's one instant plus the lease in A, and lie up to the whole span
//!   later in B.
//!
//! So verdicts and remaining counts must agree exactly; `retry_ms`, `reset_ms`
//! and a lock's PTTL are exact where no earlier state is involved, and
//! otherwise may differ only by the milliseconds that elapsed, one way.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::script::{self, idem, request_argv, sw, tb, Idem, Limit};
use support::{hash_fields, key_exists, key_pttl, read_bucket, redis_now_ms};

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};

use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::sample::{select, subsequence};
use proptest::test_runner::TestRunner;
use redis::{Connection, Value};

/// One hour: the refill period and window of nearly every limit here, so
/// that the milliseconds a test takes never refill a token or expire a
/// sliding-window member (see the module comment).
const HOUR: i64 = 3_600_000;

/// One minute: the idempotency lock TTL of the deterministic tests.
const MINUTE: i64 = 60_000;

// ---------------------------------------------------------------------------
// Requests in the layout of lua/ratelimit.lua

/// One request: its limits and, if keyed, its idempotency part.
#[derive(Debug, Clone)]
struct Request {
    limits: Vec<Limit>,
    idem: Option<Idem>,
}

fn request(limits: Vec<Limit>) -> Request {
    Request { limits, idem: None }
}

fn keyed(limits: Vec<Limit>, idem: Idem) -> Request {
    Request {
        limits,
        idem: Some(idem),
    }
}

impl Request {
    /// KEYS in the documented order: the limits', then the record.
    fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.limits.iter().map(|l| l.key.clone()).collect();
        if let Some(i) = &self.idem {
            keys.push(i.key.clone());
        }
        keys
    }

    /// ARGV as the filter sends it: an unkeyed request without the flag.
    fn argv(&self) -> Vec<String> {
        request_argv(&self.limits, self.idem.as_ref())
    }
}

// ---------------------------------------------------------------------------
// Calling the scripts

fn eval(script: &str, keys: &[String], argv: &[String]) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(script).arg(keys.len());
    for k in keys {
        cmd.arg(k);
    }
    for a in argv {
        cmd.arg(a);
    }
    cmd
}

/// KEYS and the packed argument of lua/batch.lua for `members`, packed by
/// the filter's own code.
fn batch_args(members: &[Request]) -> (Vec<Vec<u8>>, Vec<u8>) {
    let members: Vec<_> = members.iter().map(|m| (m.keys(), m.argv())).collect();
    support::script::packed(&members)
}

/// lua/batch.lua with hand-made KEYS and ARGV (the malformed-batch tests).
fn batch_raw(
    con: &mut Connection,
    keys: &[Vec<u8>],
    argv: &[Vec<u8>],
) -> redis::RedisResult<Value> {
    support::script::eval_raw(con, &redis_guard::scripts::BATCH, keys, argv)
}

/// One EVAL of lua/batch.lua: each member's reply, split by the documented
/// `[M, len_1, reply_1..., len_2, reply_2...]` framing (which this asserts).
fn batch(con: &mut Connection, members: &[Request]) -> Vec<Vec<Value>> {
    let (keys, packed) = batch_args(members);
    let v = batch_raw(con, &keys, &[packed])
        .unwrap_or_else(|e| panic!("batch EVAL failed for {members:?}: {e}"));
    script::split_batch_reply(v, members.len())
}

/// One EVAL of lua/ratelimit.lua for one request, the general way: an
/// unkeyed request says so with an explicit "0" flag, which keeps a lone
/// bucket off the short way (`lone_bucket()`) that its batch member takes, so
/// the property compares the two.
fn ratelimit(con: &mut Connection, req: &Request) -> Vec<Value> {
    let mut argv = req.argv();
    if req.idem.is_none() {
        argv.push("0".to_string());
    }
    let v: Value = eval(&redis_guard::scripts::RATELIMIT.source, &req.keys(), &argv)
        .query(con)
        .unwrap_or_else(|e| panic!("ratelimit EVAL failed for {req:?}: {e}"));
    let Value::Array(items) = v else {
        panic!("ratelimit reply is not an array: {v:?}")
    };
    items
}

/// An integer of the reply; figures of 2^31 and more come as decimal
/// strings (lua/wire.lua).
fn int(v: &Value) -> i64 {
    match v {
        Value::Int(i) => *i,
        Value::BulkString(b) if b.len() > 9 && b.iter().all(u8::is_ascii_digit) => {
            std::str::from_utf8(b).unwrap().parse().unwrap()
        }
        other => panic!("expected an integer, got {other:?}"),
    }
}

fn ints(vs: &[Value]) -> Vec<i64> {
    vs.iter().map(int).collect()
}

/// The batch's replies as integers (no member here is answered with a
/// stored response, the only reply with strings).
fn batch_ints(con: &mut Connection, members: &[Request]) -> Vec<Vec<i64>> {
    batch(con, members).iter().map(|r| ints(r)).collect()
}

fn zcard(con: &mut Connection, key: &str) -> i64 {
    redis::cmd("ZCARD").arg(key).query(con).unwrap()
}

/// Every key under `ns:`, sorted.
fn keys_under(con: &mut Connection, ns: &str) -> Vec<String> {
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{ns}:*"))
        .query(con)
        .unwrap();
    keys.sort();
    keys
}

/// A token bucket's stored credits (one token = `period` credits), if any.
fn credits(con: &mut Connection, key: &str) -> Option<i64> {
    read_bucket(con, key).map(|(c, _)| c)
}

// ---------------------------------------------------------------------------
// The property: a batch decides as the same members sent one by one

/// Cases of the property: each a sequence of up to `MAX_MEMBERS` requests,
/// enough to find ordering bugs over six kinds, few enough that the test
/// takes about a second or two in a debug build.
const CASES: u32 = 96;
const MAX_MEMBERS: usize = 24;
/// Limit definitions per case: few, so members collide on keys constantly.
const POOL: usize = 5;
/// Idempotency record keys and fingerprints per case: two of each, so locks
/// are contended (verdict 2) and reused with another body (verdict 4).
const RECORDS: usize = 2;
/// A new seed each run (printed, `PROPTEST_RNG_SEED` replays it), so every
/// run tries other sequences.
fn config() -> ProptestConfig {
    support::fixed_seed::config(CASES, support::fixed_seed::fresh_seed(), 512)
}

/// One limit definition of a case's pool; its key is `ns:d<index>`.
#[derive(Debug, Clone)]
struct Def {
    alg: &'static str,
    /// tb: capacity; gcra: burst; sw, fw, swc: limit; cc: max. 1..=6, so
    /// rejections are frequent.
    a: i64,
    /// tb: refill tokens per period; gcra: rate per period; sw, fw, swc:
    /// window (ms); cc: lease (ms).
    b: i64,
    /// tb, gcra: period (ms); sw, fw, swc: 0; cc: 0 (the slot id is the
    /// member's own: see `Case::requests`).
    c: i64,
    /// A blocking limit's block (an hour), 0 for none (never for cc): its
    /// enforced rejections block the key in both namespaces alike.
    block: i64,
}

impl Def {
    /// Fixed window or sliding-window counter: times run to window edges.
    fn windowed(&self) -> bool {
        self.alg == "fw" || self.alg == "swc"
    }
}

/// One limit of a member: which definition, the drawn cost (clamped to the
/// definition's capacity when sent, as config validation guarantees), and
/// whether it is enforced or shadow.
#[derive(Debug, Clone)]
struct Use {
    def: usize,
    cost: i64,
    enforce: bool,
}

#[derive(Debug, Clone)]
struct Member {
    uses: Vec<Use>,
    /// (record key index, fingerprint index), if the request is keyed.
    idem: Option<(usize, usize)>,
}

#[derive(Debug, Clone)]
struct Case {
    defs: Vec<Def>,
    members: Vec<Member>,
}

fn def_strategy() -> impl Strategy<Value = Def> {
    (kind_strategy(), prop::bool::weighted(0.3)).prop_map(|(mut d, blocking)| {
        if blocking && d.alg != "cc" {
            d.block = HOUR;
        }
        d
    })
}

/// A token bucket that does not block.
fn tb_strategy() -> impl Strategy<Value = Def> {
    (1..=6i64, 1..=3i64, select(vec![HOUR, 2 * HOUR])).prop_map(|(a, b, c)| Def {
        alg: "tb",
        a,
        b,
        c,
        block: 0,
    })
}

fn kind_strategy() -> impl Strategy<Value = Def> {
    // Hour-scale periods and windows (see the module comment); refill 1..=3
    // tokens per period, and every period is a multiple of 6, so the retry
    // and reset divisions come out exact.
    prop_oneof![
        tb_strategy(),
        (1..=6i64, select(vec![HOUR, 2 * HOUR])).prop_map(|(a, b)| Def {
            alg: "sw",
            a,
            b,
            c: 0,
            block: 0
        }),
        (1..=6i64, 1..=3i64, select(vec![HOUR, 2 * HOUR])).prop_map(|(a, b, c)| Def {
            alg: "gcra",
            a,
            b,
            c,
            block: 0
        }),
        (1..=6i64, select(vec![HOUR, 2 * HOUR])).prop_map(|(a, b)| Def {
            alg: "fw",
            a,
            b,
            c: 0,
            block: 0
        }),
        (1..=6i64, select(vec![HOUR, 2 * HOUR])).prop_map(|(a, b)| Def {
            alg: "swc",
            a,
            b,
            c: 0,
            block: 0
        }),
        (1..=6i64, select(vec![HOUR, 2 * HOUR])).prop_map(|(a, b)| Def {
            alg: "cc",
            a,
            b,
            c: 0,
            block: 0
        }),
    ]
}

fn member_strategy() -> impl Strategy<Value = Member> {
    prop_oneof![
        3 => any_member_strategy(),
        // The commonest request: one enforced limit, no key. On the pool's
        // first definition, often a token bucket (`case_strategy`): the
        // shape lua/batch.lua decides by its lone-bucket path.
        1 => (1..=3i64).prop_map(|cost| Member {
            uses: vec![Use {
                def: 0,
                cost,
                enforce: true
            }],
            idem: None,
        }),
    ]
}

fn any_member_strategy() -> impl Strategy<Value = Member> {
    (
        // 1..=3 distinct definitions in any order (a request's limits have
        // distinct names, so distinct keys).
        subsequence((0..POOL).collect::<Vec<_>>(), 1..=3).prop_shuffle(),
        vec((1..=3i64, prop::bool::weighted(0.75)), 3),
        option::weighted(0.25, (0..RECORDS, 0..RECORDS)),
    )
        .prop_map(|(defs, params, idem)| Member {
            uses: defs
                .into_iter()
                .zip(params)
                .map(|(def, (cost, enforce))| Use { def, cost, enforce })
                .collect(),
            idem,
        })
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop_oneof![def_strategy(), tb_strategy()],
        vec(def_strategy(), POOL - 1),
        vec(member_strategy(), 1..=MAX_MEMBERS),
    )
        .prop_map(|(first, rest, members)| Case {
            defs: std::iter::once(first).chain(rest).collect(),
            members,
        })
}

impl Case {
    fn def_key(ns: &str, i: usize) -> String {
        format!("{ns}:d{i}")
    }

    fn record_key(ns: &str, r: usize) -> String {
        format!("{ns}:i{r}")
    }

    /// Member j's concurrency slot id (hex, as the filter's): its own, and
    /// the same under both namespaces, so the sets compare equal.
    fn slot(j: usize) -> String {
        format!("{:x}", 0xa0 + j)
    }

    /// The members as requests on keys under `ns`. Member j's owner token is
    /// `owner-j` and its slot id `Case::slot(j)` under both namespaces, so
    /// the records and the slots compare equal.
    fn requests(&self, ns: &str) -> Vec<Request> {
        self.members
            .iter()
            .enumerate()
            .map(|(j, m)| Request {
                limits: m
                    .uses
                    .iter()
                    .map(|u| {
                        let d = &self.defs[u.def];
                        Limit {
                            key: Case::def_key(ns, u.def),
                            alg: d.alg,
                            a: d.a,
                            b: d.b,
                            c: if d.alg == "cc" {
                                Case::slot(j)
                            } else {
                                d.c.to_string()
                            },
                            cost: u.cost.min(d.a),
                            enforce: u.enforce,
                            block: d.block,
                        }
                    })
                    .collect(),
                idem: m.idem.map(|(r, f)| Idem {
                    key: Case::record_key(ns, r),
                    owner: format!("owner-{j}"),
                    fingerprint: format!("fp-{f}"),
                    lock_ms: HOUR,
                }),
            })
            .collect()
    }
}

/// What the property saw across all cases, so a generator that stopped
/// producing rejections (or locks, or shadow rejections) fails loudly instead
/// of passing vacuously.
#[derive(Default)]
struct Seen {
    verdicts: [Cell<u32>; 5],
    shadow_rejections_admitted: Cell<u32>,
    time_dependent_compared: Cell<u32>,
    /// Rejections by a blocking limit (its block started or running).
    blocked: Cell<u32>,
    /// Per kind: (limits that admitted, limits that rejected).
    by_kind: RefCell<BTreeMap<&'static str, (u32, u32)>>,
    /// Cases not compared because an hour edge fell between the runs.
    at_an_edge: Cell<u32>,
    /// Members lua/batch.lua decides by its lone-bucket path (one enforced
    /// token bucket, no block, no key): (admitted, rejected).
    alone: [Cell<u32>; 2],
}

fn bump(c: &Cell<u32>) {
    c.set(c.get() + 1);
}

/// `a` (batch) and `b` (one by one) where time may separate them: the batch
/// ran at one instant, so its state is never older than B's and B's counters
/// are lower by the age of B's state, at most `elapsed` ms.
fn check_time_dependent(what: &str, a: i64, b: i64, elapsed: i64) -> Result<(), TestCaseError> {
    prop_assert!(
        b <= a && a - b <= elapsed,
        "{what}: batch {a}, one by one {b}, {elapsed} ms elapsed"
    );
    Ok(())
}

/// Compares the replies member by member. `a` from the batch, `b` from the
/// one-by-one calls, which spanned at most `elapsed` ms; `a_elapsed` is how
/// long the batch call took (bounds PTTLs read inside it); `span` is from
/// the batch's start to the last one-by-one call's end.
fn compare_replies(
    case: &Case,
    a: &[Vec<i64>],
    b: &[Vec<i64>],
    (elapsed, a_elapsed, span): (i64, i64, i64),
    seen: &Seen,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(a.len(), b.len());
    // Definitions charged by an earlier member: their state was written at
    // the batch's one instant in A, and at some earlier call in B.
    let mut touched = [false; POOL];
    for (j, ((m, ra), rb)) in case.members.iter().zip(a).zip(b).enumerate() {
        let at = format!("member {j}: batch {ra:?}, one by one {rb:?}");
        prop_assert_eq!(ra[0], rb[0], "verdict of {}", at);
        prop_assert_eq!(ra.len(), rb.len(), "reply length of {}", at);
        let verdict = usize::try_from(ra[0]).unwrap();
        prop_assert!(verdict <= 4, "{}", at);
        bump(&seen.verdicts[verdict]);
        match verdict {
            0 | 1 => {
                prop_assert_eq!(ra.len(), 1 + 4 * m.uses.len(), "{}", at);
                for (i, u) in m.uses.iter().enumerate() {
                    let d = &case.defs[u.def];
                    let (va, vb) = (&ra[1 + 4 * i..5 + 4 * i], &rb[1 + 4 * i..5 + 4 * i]);
                    let what = format!("{at}, limit {i} ({d:?}, {u:?})");
                    prop_assert_eq!(va[0], vb[0], "allowed: {}", what);
                    prop_assert_eq!(va[1], vb[1], "remaining: {}", what);
                    {
                        let mut by_kind = seen.by_kind.borrow_mut();
                        let e = by_kind.entry(d.alg).or_default();
                        if va[0] == 1 {
                            e.0 += 1;
                        } else {
                            e.1 += 1;
                        }
                    }
                    let charged = verdict == 1 && va[0] == 1;
                    if va[0] == 1 {
                        prop_assert_eq!((va[2], vb[2]), (0, 0), "retry when allowed: {}", what);
                    } else if verdict == 1 {
                        // Only a shadow limit may reject an admitted request.
                        prop_assert!(!u.enforce, "enforced rejection admitted: {}", what);
                        bump(&seen.shadow_rejections_admitted);
                    }
                    // A key nobody charged yet is fresh in both (full bucket,
                    // empty window, no TAT), and a charged window's reset is
                    // its window: time cannot change these, so they are
                    // exact. A fixed window's or counter's times run to
                    // window edges, so they depend on when each call ran. A
                    // concurrency limit's never depend on time.
                    let exact = d.alg == "cc"
                        || (!d.windowed() && (!touched[u.def] || (d.alg == "sw" && charged)));
                    let bound = if d.windowed() { span } else { elapsed };
                    if d.block > 0 && u.enforce && va[0] == 0 {
                        // Blocked: retry and reset are the block's PTTL,
                        // started by this or an earlier member (an hour).
                        bump(&seen.blocked);
                        for v in [va[2], va[3], vb[2], vb[3]] {
                            prop_assert!(v > HOUR - span - 1 && v <= HOUR, "block {}: {}", v, what);
                        }
                    } else if exact {
                        prop_assert_eq!(va[2], vb[2], "retry_ms: {}", what);
                        prop_assert_eq!(va[3], vb[3], "reset_ms: {}", what);
                    } else {
                        bump(&seen.time_dependent_compared);
                        check_time_dependent(&format!("retry_ms: {what}"), va[2], vb[2], bound)?;
                        check_time_dependent(&format!("reset_ms: {what}"), va[3], vb[3], bound)?;
                    }
                }
                // What this member charged is no longer fresh for later ones.
                for (i, u) in m.uses.iter().enumerate() {
                    if verdict == 1 && ra[1 + 4 * i] == 1 {
                        touched[u.def] = true;
                    }
                }
            }
            2 => {
                // [2, lock PTTL]: the lock was taken by an earlier member,
                // with a TTL of an hour, at most `elapsed` ms before in B.
                prop_assert_eq!(ra.len(), 2, "{}", at);
                prop_assert!(ra[1] > HOUR - a_elapsed - 1 && ra[1] <= HOUR, "{}", at);
                prop_assert!(rb[1] > HOUR - elapsed - 1 && rb[1] <= HOUR, "{}", at);
            }
            4 => prop_assert_eq!(ra, rb, "{}", at),
            _ => prop_assert!(false, "unexpected verdict: {}", at),
        }
    }
    Ok(())
}

/// A GCRA key's TAT as (ms, rem): "<ms>" or "<ms>:<rem>".
fn tat(con: &mut Connection, key: &str) -> Option<(i64, i64)> {
    let v: Option<String> = redis::cmd("GET").arg(key).query(con).unwrap();
    v.map(|v| match v.split_once(':') {
        Some((ms, rem)) => (ms.parse().unwrap(), rem.parse().unwrap()),
        None => (v.parse().unwrap(), 0),
    })
}

/// A concurrency key's members (slots) and their scores (lease ends).
fn slot_ends(con: &mut Connection, key: &str) -> BTreeMap<String, i64> {
    support::zset_scores(con, key).into_iter().collect()
}

/// Compares the state each namespace holds afterwards, key by key. B's
/// calls spanned `elapsed` ms, and ended `span` ms after the batch began.
fn compare_state(
    con: &mut Connection,
    case: &Case,
    (na, nb): (&str, &str),
    (elapsed, span): (i64, i64),
) -> Result<(), TestCaseError> {
    let mut expected_a = BTreeSet::new();
    let mut expected_b = BTreeSet::new();
    for (i, d) in case.defs.iter().enumerate() {
        let (ka, kb) = (Case::def_key(na, i), Case::def_key(nb, i));
        if d.block > 0 {
            // The same rejections blocked the key in both (`:bl` appended:
            // these keys have no `:rl:{`).
            let (ba, bb) = (format!("{ka}:bl"), format!("{kb}:bl"));
            prop_assert_eq!(key_exists(con, &ba), key_exists(con, &bb), "{} exists", ba);
            if key_exists(con, &ba) {
                expected_a.insert(ba);
                expected_b.insert(bb);
            }
        }
        prop_assert_eq!(key_exists(con, &ka), key_exists(con, &kb), "{} exists", ka);
        if key_exists(con, &ka) {
            expected_a.insert(ka.clone());
            expected_b.insert(kb.clone());
        }
        if d.alg == "gcra" {
            match (tat(con, &ka), tat(con, &kb)) {
                (None, None) => {}
                (Some((ma, ra)), Some((mb, rb))) => {
                    // The same units charged, from a first charge in B at
                    // most `span` ms after the batch's instant.
                    prop_assert_eq!(ra, rb, "TAT fraction of {} vs {}", ka, kb);
                    prop_assert!(
                        mb >= ma && mb - ma <= span,
                        "TAT {ma} (batch) vs {mb} (one by one), span {span} ms"
                    );
                }
                other => prop_assert!(false, "{} vs {}: {:?}", ka, kb, other),
            }
        } else if d.alg == "fw" {
            let get = |con: &mut Connection, k: &str| -> Option<String> {
                redis::cmd("GET").arg(k).query(con).unwrap()
            };
            prop_assert_eq!(
                get(con, &ka),
                get(con, &kb),
                "window count {} vs {}",
                ka,
                kb
            );
        } else if d.alg == "swc" {
            prop_assert_eq!(
                hash_fields(con, &ka),
                hash_fields(con, &kb),
                "counter {} vs {}",
                ka,
                kb
            );
        } else if d.alg == "tb" {
            match (credits(con, &ka), credits(con, &kb)) {
                (None, None) => {}
                (Some(ca), Some(cb)) => {
                    // The batch charged whole tokens at one instant; B's
                    // bucket refilled a little between calls, never a token.
                    prop_assert_eq!(ca % d.c, 0, "{} credits {}", ka, ca);
                    prop_assert_eq!(ca / d.c, cb / d.c, "tokens of {} vs {}", ka, kb);
                    prop_assert!(
                        cb >= ca && cb - ca <= d.b * elapsed,
                        "credits {ca} (batch) vs {cb} (one by one), {elapsed} ms elapsed"
                    );
                }
                other => prop_assert!(false, "{} vs {}: {:?}", ka, kb, other),
            }
        } else if d.alg == "cc" {
            let (sa, sb) = (slot_ends(con, &ka), slot_ends(con, &kb));
            prop_assert_eq!(
                sa.keys().collect::<Vec<_>>(),
                sb.keys().collect::<Vec<_>>(),
                "slots of {} vs {}",
                ka,
                kb
            );
            // A charged every slot at its one instant, with one lease.
            let a_ends: BTreeSet<i64> = sa.values().copied().collect();
            prop_assert!(a_ends.len() <= 1, "{} lease ends {:?}", ka, a_ends);
            for (m, ea) in &sa {
                let eb = sb[m];
                prop_assert!(
                    eb >= *ea && eb - ea <= span,
                    "{m}: lease end {ea} (batch) vs {eb} (one by one), span {span} ms"
                );
            }
        } else {
            prop_assert_eq!(zcard(con, &ka), zcard(con, &kb), "ZCARD {} vs {}", ka, kb);
        }
    }
    for r in 0..RECORDS {
        let (ka, kb) = (Case::record_key(na, r), Case::record_key(nb, r));
        prop_assert_eq!(
            hash_fields(con, &ka),
            hash_fields(con, &kb),
            "record {}",
            ka
        );
        if key_exists(con, &ka) {
            expected_a.insert(ka);
            expected_b.insert(kb);
        }
    }
    // Nothing else was written, and everything written expires.
    for (ns, expected) in [(na, expected_a), (nb, expected_b)] {
        let found: BTreeSet<String> = keys_under(con, ns).into_iter().collect();
        prop_assert_eq!(&found, &expected, "keys under {}", ns);
        for k in &found {
            let ttl = key_pttl(con, k);
            prop_assert!(ttl > 0, "{} has PTTL {}", k, ttl);
        }
    }
    Ok(())
}

#[test]
fn a_batch_decides_exactly_as_the_same_members_sent_one_by_one_in_order() {
    let redis = support::Redis::start();
    let con = RefCell::new(redis.conn());
    let case_no = Cell::new(0usize);
    let seen = Seen::default();
    let mut runner = TestRunner::new(config());
    let result = runner.run(&case_strategy(), |case| {
        let con = &mut *con.borrow_mut();
        let n = case_no.get();
        case_no.set(n + 1);
        let (na, nb) = (format!("a{n}"), format!("b{n}"));

        // A: the whole sequence as one EVAL of BATCH.
        let start = redis_now_ms(con);
        let t0 = start;
        let a = batch_ints(con, &case.requests(&na));
        let a_elapsed = redis_now_ms(con) - t0;

        // B: each member as its own EVAL of RATELIMIT, in the same order.
        let t0 = redis_now_ms(con);
        let b: Vec<Vec<i64>> = case
            .requests(&nb)
            .iter()
            .map(|r| ints(&ratelimit(con, r)))
            .collect();
        let end = redis_now_ms(con);
        let elapsed = end - t0;
        let span = end - start;
        // The module comment's reasoning needs refill * elapsed below one
        // period (elapsed < HOUR / 3 at refill 3 per hour): check it, with
        // margin, rather than assume it.
        prop_assert!(elapsed < HOUR / 6, "one-by-one calls took {} ms", elapsed);
        // Every window here ends on an hour edge; one between the runs puts
        // them in different windows (see the module comment).
        if case.defs.iter().any(Def::windowed) && start / HOUR != end / HOUR {
            bump(&seen.at_an_edge);
            return Ok(());
        }

        compare_replies(&case, &a, &b, (elapsed, a_elapsed, span), &seen)?;
        let first = &case.defs[0];
        if first.alg == "tb" && first.block == 0 {
            for (m, reply) in case.members.iter().zip(&a) {
                let lone = m.idem.is_none() && m.uses.len() == 1 && m.uses[0].enforce;
                if lone && m.uses[0].def == 0 {
                    bump(&seen.alone[usize::from(reply[0] == 0)]);
                }
            }
        }
        compare_state(con, &case, (&na, &nb), (elapsed, span))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    // The generator must keep producing what the property is about.
    if runner.config().cases >= CASES {
        let v: Vec<u32> = seen.verdicts.iter().map(Cell::get).collect();
        assert!(
            v[0] > 0 && v[1] > 0 && v[2] > 0 && v[4] > 0,
            "verdicts seen (0..=4): {v:?}"
        );
        assert!(seen.shadow_rejections_admitted.get() > 0);
        assert!(seen.time_dependent_compared.get() > 0);
        assert!(seen.blocked.get() > 0, "no blocking limit rejected");
        let alone = [seen.alone[0].get(), seen.alone[1].get()];
        assert!(alone[0] > 0 && alone[1] > 0, "lone buckets: {alone:?}");
        // Every kind both admitted and rejected somewhere.
        let by_kind = seen.by_kind.borrow();
        for kind in ["tb", "sw", "gcra", "fw", "swc", "cc"] {
            let (yes, no) = by_kind.get(kind).copied().unwrap_or_default();
            assert!(yes > 0 && no > 0, "{kind}: {yes} admitted, {no} rejected");
        }
        // Only a rare case lands on an edge (not, say, every case): one
        // when the run crosses the top of an hour, and about 1% more.
        let edges = seen.at_an_edge.get();
        assert!(
            edges <= 1 + runner.config().cases / 100,
            "{edges} cases at an hour edge"
        );
    }
}

// ---------------------------------------------------------------------------
// Deterministic cases

/// Replies in `Value` form, for exact comparisons that include strings.
fn values(vs: &[i64]) -> Vec<Value> {
    vs.iter().map(|&i| Value::Int(i)).collect()
}

#[test]
fn a_batch_of_one_member_answers_exactly_as_ratelimit() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let far_future = redis_now_ms(&mut con) + HOUR;

    // Each request runs against identical prepared state under two
    // namespaces: as the only member of a batch under `x<i>`, alone through
    // RATELIMIT under `y<i>`. Every reply here is independent of the clock:
    // fresh keys, or buckets stamped in the future (which get no refill).
    type Prepare = fn(&mut Connection, &str, i64);
    let none: Prepare = |_, _, _| {};
    let empty_bucket: Prepare = |con, ns, t| support::write_bucket(con, &format!("{ns}:t"), 0, t);
    let stored: Prepare = |con, ns, _| {
        redis::cmd("HSET")
            .arg(format!("{ns}:i"))
            .arg(&[
                "s",
                "C",
                "f",
                "fp-1",
                "st",
                "201",
                "h",
                "x-a: 1\n",
                "b",
                "body\0bytes",
            ])
            .query::<()>(con)
            .unwrap();
        redis::cmd("PEXPIRE")
            .arg(format!("{ns}:i"))
            .arg(HOUR)
            .query::<()>(con)
            .unwrap();
    };
    let offloaded: Prepare = |con, ns, _| {
        redis::cmd("HSET")
            .arg(format!("{ns}:i"))
            .arg(&[
                "s", "C", "f", "fp-1", "st", "200", "h", "", "b", "", "ok", "obj/1",
            ])
            .arg(&["oc", "ab12", "ol", "4096"])
            .query::<()>(con)
            .unwrap();
    };
    type Make = fn(&str) -> Request;
    let cases: Vec<(&str, Prepare, Make)> = vec![
        ("admitted by both algorithms, cost 2 and 1", none, |ns| {
            request(vec![
                tb(&format!("{ns}:t"), 5, 1, HOUR).cost(2),
                sw(&format!("{ns}:w"), 3, HOUR),
            ])
        }),
        ("rejected by an empty bucket", empty_bucket, |ns| {
            request(vec![
                sw(&format!("{ns}:w"), 3, HOUR),
                tb(&format!("{ns}:t"), 5, 2, HOUR).cost(3),
            ])
        }),
        (
            "admitted while a shadow bucket would reject",
            empty_bucket,
            |ns| {
                request(vec![
                    tb(&format!("{ns}:t"), 5, 1, HOUR).shadow(),
                    sw(&format!("{ns}:w"), 3, HOUR).cost(3),
                ])
            },
        ),
        ("a keyed request takes the free lock", none, |ns| {
            keyed(
                vec![tb(&format!("{ns}:t"), 5, 1, HOUR)],
                idem(&format!("{ns}:i"), "owner-1", "fp-1", MINUTE),
            )
        }),
        (
            "a completed key answers its stored response",
            stored,
            |ns| {
                keyed(
                    vec![tb(&format!("{ns}:t"), 5, 1, HOUR)],
                    idem(&format!("{ns}:i"), "owner-1", "fp-1", MINUTE),
                )
            },
        ),
        (
            "an offloaded key answers its object reference",
            offloaded,
            |ns| {
                keyed(
                    vec![tb(&format!("{ns}:t"), 5, 1, HOUR)],
                    idem(&format!("{ns}:i"), "owner-1", "fp-1", MINUTE),
                )
            },
        ),
        (
            "a key used with another fingerprint answers 4",
            stored,
            |ns| {
                keyed(
                    vec![tb(&format!("{ns}:t"), 5, 1, HOUR)],
                    idem(&format!("{ns}:i"), "owner-1", "fp-2", MINUTE),
                )
            },
        ),
    ];
    for (i, (what, prepare, make)) in cases.into_iter().enumerate() {
        let (nx, ny) = (format!("x{i}"), format!("y{i}"));
        prepare(&mut con, &nx, far_future);
        prepare(&mut con, &ny, far_future);
        let (rx, ry) = (make(&nx), make(&ny));
        let (keys, packed) = batch_args(std::slice::from_ref(&rx));
        let got = batch_raw(&mut con, &keys, &[packed]).unwrap();
        let want = ratelimit(&mut con, &ry);
        let mut framed = values(&[1, want.len() as i64]);
        framed.extend(want);
        assert_eq!(got, Value::Array(framed), "{what}");
        // And the same state: bucket credits, window sizes, records.
        assert_eq!(
            credits(&mut con, &format!("{nx}:t")),
            credits(&mut con, &format!("{ny}:t")),
            "{what}"
        );
        assert_eq!(
            zcard(&mut con, &format!("{nx}:w")),
            zcard(&mut con, &format!("{ny}:w")),
            "{what}"
        );
        assert_eq!(
            hash_fields(&mut con, &format!("{nx}:i")),
            hash_fields(&mut con, &format!("{ny}:i")),
            "{what}"
        );
    }
}

#[test]
fn a_rejected_member_in_the_middle_writes_nothing_and_later_members_still_get_the_budget() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    // One batch runs at one instant, so every number below is exact.
    let k = || tb("m:k", 3, 1, HOUR);
    let w = || sw("m:w", 2, HOUR);
    let replies = batch_ints(
        &mut con,
        &[
            request(vec![k().cost(2), w()]),
            // The window has 1 of 2 left: cost 2 is rejected, so the bucket,
            // which would admit, must not be charged either.
            request(vec![k(), w().cost(2)]),
            request(vec![k(), w()]),
            request(vec![k()]),
            request(vec![w()]),
        ],
    );
    assert_eq!(
        replies,
        vec![
            // Admitted: bucket 3 - 2 = 1 left, full again in 2 hours; window 1 left.
            vec![1, 1, 1, 0, 2 * HOUR, 1, 1, 0, HOUR],
            // Rejected by the window: the bucket reports its unspent budget
            // (1 token), the window its 1 left and the hour until its oldest
            // member leaves.
            vec![0, 1, 1, 0, 2 * HOUR, 0, 1, HOUR, HOUR],
            // The budget the rejection left is still there for the next member.
            vec![1, 1, 0, 0, 3 * HOUR, 1, 0, 0, HOUR],
            // Now both are spent.
            vec![0, 0, 0, HOUR, HOUR],
            vec![0, 0, 0, HOUR, HOUR],
        ]
    );
    assert_eq!(credits(&mut con, "m:k"), Some(0));
    assert_eq!(zcard(&mut con, "m:w"), 2);
}

#[test]
fn a_shadow_limit_that_would_reject_neither_rejects_nor_charges() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let member = || {
        request(vec![
            tb("s:e", 5, 1, HOUR),
            tb("s:t", 1, 1, HOUR).shadow(),
            sw("s:w", 1, HOUR).shadow(),
        ])
    };
    let replies = batch_ints(&mut con, &[member(), member(), member()]);
    assert_eq!(
        replies,
        vec![
            // A shadow limit that admits is charged like any other.
            vec![1, 1, 4, 0, HOUR, 1, 0, 0, HOUR, 1, 0, 0, HOUR],
            // Then both shadow limits would reject: reported, not enforced.
            vec![1, 1, 3, 0, 2 * HOUR, 0, 0, HOUR, HOUR, 0, 0, HOUR, HOUR],
            vec![1, 1, 2, 0, 3 * HOUR, 0, 0, HOUR, HOUR, 0, 0, HOUR, HOUR],
        ]
    );
    // The enforced bucket paid three times, the shadow limits once each.
    assert_eq!(credits(&mut con, "s:e"), Some(2 * HOUR));
    assert_eq!(credits(&mut con, "s:t"), Some(0));
    assert_eq!(zcard(&mut con, "s:w"), 1);
}

#[test]
fn two_hundred_members_on_one_key_with_capacity_one_hundred_admit_exactly_one_hundred() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    // One token back per hour: the second batch, milliseconds later, finds
    // both limits still spent.
    for limit in [tb("h:t", 100, 1, HOUR), sw("h:w", 100, HOUR)] {
        let members: Vec<Request> = (0..200).map(|_| request(vec![limit.clone()])).collect();
        let replies = batch_ints(&mut con, &members);
        for (j, r) in replies.iter().enumerate() {
            let j = j as i64;
            if j < 100 {
                assert_eq!(r[..3], [1, 1, 99 - j], "{} member {j}: {r:?}", limit.key);
            } else {
                assert_eq!(r[..4], [0, 0, 0, HOUR], "{} member {j}: {r:?}", limit.key);
            }
        }
        let admitted = replies.iter().filter(|r| r[0] == 1).count();
        assert_eq!(admitted, 100, "{}", limit.key);

        let again = batch_ints(&mut con, &members);
        assert!(again.iter().all(|r| r[0] == 0 && r[2] == 0), "{again:?}");
    }
    assert_eq!(credits(&mut con, "h:t"), Some(0));
    assert_eq!(zcard(&mut con, "h:w"), 100);
}

#[test]
fn a_batch_reads_and_writes_each_token_bucket_once_however_many_members_charge_it() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let members: Vec<Request> = (0..20)
        .map(|j| {
            // Two buckets: "o:a" charged by every member, "o:b" by every
            // other one.
            let mut limits = vec![tb("o:a", 100, 1, HOUR)];
            if j % 2 == 0 {
                limits.push(tb("o:b", 100, 1, HOUR));
            }
            request(limits)
        })
        .collect();
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut con)
        .unwrap();
    let replies = batch_ints(&mut con, &members);
    assert!(replies.iter().all(|r| r[0] == 1));
    // A bucket is one string: one GET reads it, one SET with PX writes it
    // and its TTL.
    assert_eq!(
        support::state_commands(&mut con),
        [
            ("get", 2),
            ("set", 2),
            ("hmget", 0),
            ("hset", 0),
            ("pexpire", 0)
        ],
        "one read and one write per bucket"
    );
    // What those single writes left is what twenty charges in a row would.
    let mut con2 = redis.conn();
    assert_eq!(credits(&mut con2, "o:a").map(|c| c / HOUR), Some(80));
    assert_eq!(credits(&mut con2, "o:b").map(|c| c / HOUR), Some(90));
}

#[test]
fn a_keyed_member_takes_its_lock_and_a_later_member_with_the_same_key_is_busy() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let k = || tb("l:k", 5, 1, HOUR);
    let r = || tb("l:r", 1, 1, HOUR);
    let replies = batch_ints(
        &mut con,
        &[
            keyed(vec![k()], idem("l:i", "owner-0", "fp-1", MINUTE)),
            // Same key and body, another request: the lock is held.
            keyed(vec![k()], idem("l:i", "owner-1", "fp-1", MINUTE)),
            // Same key, another body.
            keyed(vec![k()], idem("l:i", "owner-2", "fp-2", MINUTE)),
            // Spends the one token of l:r ...
            request(vec![r()]),
            // ... so this keyed member is rejected, and takes no lock ...
            keyed(vec![r()], idem("l:j", "owner-4", "fp-1", MINUTE)),
            // ... which the next member with that key then takes.
            keyed(vec![k()], idem("l:j", "owner-5", "fp-1", MINUTE)),
            // A keyed request no limit matches: only the lock.
            keyed(vec![], idem("l:n", "owner-6", "fp-1", MINUTE)),
        ],
    );
    assert_eq!(replies[0], vec![1, 1, 4, 0, HOUR]);
    assert_eq!(replies[1].len(), 2, "{:?}", replies[1]);
    assert_eq!(replies[1][0], 2, "busy: {:?}", replies[1]);
    assert!(
        replies[1][1] > 0 && replies[1][1] <= MINUTE,
        "lock PTTL: {:?}",
        replies[1]
    );
    assert_eq!(replies[2], vec![4]);
    assert_eq!(replies[3], vec![1, 1, 0, 0, HOUR]);
    assert_eq!(replies[4], vec![0, 0, 0, HOUR, HOUR]);
    // Busy and mismatched members spent nothing: l:k paid for members 0 and 5.
    assert_eq!(replies[5], vec![1, 1, 3, 0, 2 * HOUR]);
    assert_eq!(credits(&mut con, "l:k"), Some(3 * HOUR));
    assert_eq!(replies[6], vec![1]);

    let record = |owner: &str| {
        vec![
            ("f".to_string(), "fp-1".to_string()),
            ("o".to_string(), owner.to_string()),
            ("s".to_string(), "P".to_string()),
        ]
    };
    assert_eq!(hash_fields(&mut con, "l:i"), record("owner-0"));
    assert_eq!(hash_fields(&mut con, "l:j"), record("owner-5"));
    assert_eq!(hash_fields(&mut con, "l:n"), record("owner-6"));
    for key in ["l:i", "l:j", "l:n"] {
        let ttl = key_pttl(&mut con, key);
        assert!(ttl > 0 && ttl <= MINUTE, "{key} PTTL {ttl}");
    }
}

/// A valid member under `ns`: one token of a 3-token bucket.
fn valid_member(ns: &str, key: &str) -> Request {
    request(vec![tb(&format!("{ns}:{key}"), 3, 1, HOUR)])
}

/// KEYS and ARGV of one hand-made call of lua/batch.lua.
struct Raw {
    keys: Vec<Vec<u8>>,
    argv: Vec<Vec<u8>>,
}

/// `members` packed as the filter packs them, then changed by `edit` (the
/// packed argument's bytes, in lua/batch.lua's layout).
fn edited(members: &[Request], edit: impl FnOnce(&mut Vec<u8>)) -> Raw {
    let (keys, mut packed) = batch_args(members);
    edit(&mut packed);
    Raw {
        keys,
        argv: vec![packed],
    }
}

/// Writes the big-endian u16 `v` at `at`.
fn set_u16(body: &mut [u8], at: usize, v: u16) {
    body[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

// Offsets in a batch of token-bucket members sharing one parameter set
// (lua/batch.lua's layout): version 1, P 2, the set 33 (kind, four
// figures), M 2, then per member its limit count 2, set 2, key 2, cost 8 and
// flag 1.
const M_AT: usize = 36;
const MEMBER_AT: usize = 38;
const MEMBER_LEN: usize = 15;
/// One member's batch: its key table after it.
const KEYS_AT: usize = MEMBER_AT + MEMBER_LEN;

/// Runs each malformed batch under its own namespace and returns, for every
/// case that broke the contract, what went wrong: the reply must be an error
/// `ERR redis-guard batch: ...` (a batch that does not unpack; a member that
/// unpacks but whose numbers `malformed()` refuses fails alone, see
/// `a_malformed_member_fails_alone_...`), and no key may be written.
fn malformed_failures(cases: Vec<(&str, Raw)>) -> Vec<String> {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let mut failures = Vec::new();
    for (i, (what, Raw { keys, argv })) in cases.into_iter().enumerate() {
        // Two letters, as "NS" is: the packed key table carries the keys
        // too, each after its length, which must stay right.
        assert!(i < 26, "one letter per case");
        let ns = format!("n{}", char::from(b'a' + i as u8));
        let in_ns = |b: Vec<u8>| -> Vec<u8> {
            let mut out = b;
            while let Some(at) = out.windows(2).position(|w| w == b"NS") {
                out[at..at + 2].copy_from_slice(ns.as_bytes());
            }
            out
        };
        let keys: Vec<Vec<u8>> = keys.into_iter().map(in_ns).collect();
        let argv: Vec<Vec<u8>> = argv.into_iter().map(in_ns).collect();
        match batch_raw(&mut con, &keys, &argv) {
            Ok(v) => failures.push(format!("{what}: answered {v:?}, not an error")),
            // The crate splits `ERR <detail>` into the code and the detail.
            Err(e)
                if e.code() == Some("ERR")
                    && e.detail()
                        .is_some_and(|d| d.starts_with("redis-guard batch: ")) => {}
            Err(e) => failures.push(format!(
                "{what}: error {:?} {:?}, not `ERR redis-guard batch: ...`",
                e.code(),
                e.detail()
            )),
        }
        let written = keys_under(&mut con, &ns);
        if !written.is_empty() {
            let state: Vec<_> = written
                .iter()
                .map(|k| {
                    (
                        k.clone(),
                        redis::cmd("DUMP").arg(k).query::<Vec<u8>>(&mut con),
                    )
                })
                .collect();
            failures.push(format!("{what}: wrote {state:?}"));
        }
    }
    failures
}

#[test]
fn a_malformed_packed_batch_gives_an_error_reply_and_writes_nothing() {
    let one = || vec![valid_member("NS", "v")];
    let cases = vec![
        ("version 1", edited(&one(), |b| b[0] = 1)),
        ("member count 0", edited(&one(), |b| set_u16(b, M_AT, 0))),
        (
            "member count 2, one member sent",
            edited(&one(), |b| set_u16(b, M_AT, 2)),
        ),
        ("unknown kind", edited(&one(), |b| b[3] = 9)),
        (
            "a parameter set it does not carry",
            edited(&one(), |b| set_u16(b, MEMBER_AT + 2, 2)),
        ),
        ("key 0", edited(&one(), |b| set_u16(b, MEMBER_AT + 4, 0))),
        (
            "a key beyond the key table",
            edited(&one(), |b| set_u16(b, MEMBER_AT + 4, 2)),
        ),
        (
            "a key table of two keys, one sent",
            edited(&one(), |b| set_u16(b, KEYS_AT, 2)),
        ),
        (
            "a first key sharing bytes with no key before it",
            edited(&one(), |b| set_u16(b, KEYS_AT + 2, 1)),
        ),
        ("KEYS[1] not the key table's first key", {
            let mut raw = edited(&one(), |_| {});
            raw.keys = vec![b"NS:other".to_vec()];
            raw
        }),
        ("two KEYS", {
            let mut raw = edited(&one(), |_| {});
            raw.keys.push(b"NS:w".to_vec());
            raw
        }),
        (
            "an idempotency flag of 7",
            edited(&one(), |b| b[MEMBER_AT + MEMBER_LEN - 1] = 7),
        ),
        (
            "one byte short",
            edited(&one(), |b| {
                b.pop();
            }),
        ),
        ("a byte after the last key", edited(&one(), |b| b.push(0))),
        ("two ARGV", {
            let mut raw = edited(&one(), |_| {});
            raw.argv.push(b"x".to_vec());
            raw
        }),
        ("no ARGV", {
            let mut raw = edited(&one(), |_| {});
            raw.argv.clear();
            raw
        }),
    ];
    let failures = malformed_failures(cases);
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn a_malformed_member_after_a_valid_one_gives_an_error_reply_and_writes_nothing() {
    // A member that does not unpack breaks the packing: the filter built
    // it, so it is a bug and the whole batch an error (lua/batch.lua's
    // header). An error reply tells the filter nothing was decided; if the
    // valid member before it was charged anyway, that budget (and any lock
    // it took) is spent for nothing.
    let two = || vec![valid_member("NS", "v"), valid_member("NS", "w")];
    let second = MEMBER_AT + MEMBER_LEN;
    let keyed_first = || {
        vec![
            keyed(
                vec![tb("NS:v", 3, 1, HOUR)],
                idem("NS:i", "owner-1", "fp-1", MINUTE),
            ),
            valid_member("NS", "w"),
        ]
    };
    let cases = vec![
        (
            "second member's key beyond the key table",
            edited(&two(), |b| set_u16(b, second + 4, 9)),
        ),
        (
            "second member's parameter set 0",
            edited(&two(), |b| set_u16(b, second + 2, 0)),
        ),
        (
            "second member's idempotency flag 2",
            edited(&two(), |b| b[second + MEMBER_LEN - 1] = 2),
        ),
        (
            "second member cut short",
            edited(&two(), |b| b.truncate(second + 3)),
        ),
        (
            "a keyed member, then bytes after the last key (the lock outlives the error)",
            edited(&keyed_first(), |b| b.push(0)),
        ),
    ];
    let failures = malformed_failures(cases);
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A member's reply entry when the script refused it: the error text its
/// lone call of lua/ratelimit.lua gets.
fn refused(why: &str) -> Vec<Value> {
    vec![Value::BulkString(
        format!("ERR redis-guard ratelimit: {why}").into_bytes(),
    )]
}

#[test]
fn a_malformed_member_fails_alone_and_the_others_are_decided_as_without_it() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    // A quota whose edges hold no instant near Redis' clock (edges of
    // 1970: an Envoy clock off by more than a window), beside a token
    // bucket in its request, between two requests without a quota.
    let stale = Limit {
        key: "t:q".to_string(),
        alg: "cq",
        a: 10,
        b: 0,
        c: "1000,2000,3000,4000".to_string(),
        cost: 1,
        enforce: true,
        block: 0,
    };
    let bucket = |ns: &str, k: &str| tb(&format!("{ns}:{k}"), 3, 1, HOUR);
    let members = [
        request(vec![bucket("t", "a")]),
        request(vec![bucket("t", "b"), stale.clone()]),
        request(vec![bucket("t", "a")]),
    ];
    let why = "limit 2: no window of its edges holds Redis' clock (the proxy's clock is off by more than a window)";
    let replies = batch(&mut con, &members);
    assert_eq!(replies[1], refused(why));
    assert_eq!(
        [ints(&replies[0]), ints(&replies[2])],
        [[1, 1, 2, 0, HOUR], [1, 1, 1, 0, 2 * HOUR]]
    );
    // Nothing of the refused member written (its bucket neither).
    assert_eq!(keys_under(&mut con, "t"), ["t:a"]);
    // The same batch without it decides the others alike.
    let without = [
        request(vec![bucket("u", "a")]),
        request(vec![bucket("u", "a")]),
    ];
    assert_eq!(
        batch_ints(&mut con, &without),
        [ints(&replies[0]), ints(&replies[2])]
    );
    // Its lone call is the same error.
    let lone = members[1].clone();
    let err = eval(
        &redis_guard::scripts::RATELIMIT.source,
        &lone.keys(),
        &lone.argv(),
    )
    .query::<Value>(&mut con)
    .unwrap_err();
    assert_eq!(
        (err.code(), err.detail()),
        (Some("ERR"), Some(&*format!("redis-guard ratelimit: {why}")))
    );
    // A parameter set every member shares with an enforce value of 2:
    // each member refused alone, nothing written.
    let (keys, mut packed) = batch_args(&[valid_member("v", "a"), valid_member("v", "b")]);
    packed[28..36].copy_from_slice(&2f64.to_be_bytes());
    let v = batch_raw(&mut con, &keys, &[packed]).unwrap();
    assert_eq!(
        script::split_batch_reply(v, 2),
        [
            refused("limit 1 has a bad enforce value"),
            refused("limit 1 has a bad enforce value")
        ]
    );
    assert_eq!(keys_under(&mut con, "v"), Vec::<String>::new());
}

#[test]
fn every_key_a_batch_writes_has_a_ttl() {
    let redis = support::Redis::start();
    let mut con = redis.conn();
    let replies = batch_ints(
        &mut con,
        &[
            request(vec![tb("t:a", 2, 1, HOUR), sw("t:b", 2, HOUR).shadow()]),
            keyed(
                vec![sw("t:c", 3, 2 * HOUR).cost(2)],
                idem("t:i", "owner-1", "fp-1", MINUTE),
            ),
            request(vec![
                tb("t:a", 2, 1, HOUR),
                tb("t:d", 4, 2, 2 * HOUR).cost(3),
            ]),
            // Rejected: writes nothing, so t:e must not appear at all.
            request(vec![tb("t:e", 4, 1, HOUR), tb("t:a", 2, 1, HOUR)]),
        ],
    );
    assert_eq!(
        replies.iter().map(|r| r[0]).collect::<Vec<_>>(),
        [1, 1, 1, 0]
    );
    // Each key's PTTL is at most what its reply promised: full again, the
    // window's newest member gone, the lock's TTL.
    let bounds = [
        ("t:a", 2 * HOUR),
        ("t:b", HOUR),
        ("t:c", 2 * HOUR),
        ("t:d", 3 * HOUR),
        ("t:i", MINUTE),
    ];
    assert_eq!(
        keys_under(&mut con, "t"),
        bounds
            .iter()
            .map(|(k, _)| k.to_string())
            .collect::<Vec<_>>()
    );
    for (key, bound) in bounds {
        let ttl = key_pttl(&mut con, key);
        assert!(ttl > 0 && ttl <= bound, "{key} PTTL {ttl}, bound {bound}");
    }
}
