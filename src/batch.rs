//! Batches without the host: the one call that decides several requests of
//! one worker (lua/batch.lua), and each member's part of its reply.

use std::collections::HashMap;
use std::hash::Hash;

use crate::ratelimit::ScriptArgs;
use crate::webdis::{Reply, Shown};

/// The limit kinds' codes in a packed batch, in lua/batch.lua's order.
const KINDS: [&[u8]; 7] = [b"tb", b"sw", b"gcra", b"fw", b"swc", b"cc", b"cq"];

/// The largest figure a packed batch carries: its numbers are doubles,
/// exact up to 2^53 (the config keeps every figure below it).
const MAX_FIGURE: u64 = 1 << 53;

/// One batch as lua/batch.lua takes it: KEYS, the batch's first key alone
/// (what Redis Cluster checks and `redis_proxy` routes the call by: every
/// key of a batch shares its hash tag, so its slot), and the one packed
/// argument that holds every member and every key, each once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packed {
    pub keys: Vec<Vec<u8>>,
    pub body: Vec<u8>,
}

/// Distinct values in order of first use, each with its 1-based index.
/// A batch's tables are short (its members mostly share their limits, and
/// often their keys): they are searched in order, and hashed only past
/// [`Table::SCAN`] values, where a scan would cost more than hashing.
struct Table<T> {
    index: HashMap<T, u16>,
    items: Vec<T>,
}

impl<T: Copy + Eq + Hash> Table<T> {
    const SCAN: usize = 16;

    fn new() -> Table<T> {
        Table {
            index: HashMap::new(),
            items: Vec::new(),
        }
    }

    fn of(&mut self, item: T) -> Result<u16, String> {
        let found = if self.items.len() <= Table::<T>::SCAN {
            self.items
                .iter()
                .position(|i| *i == item)
                .map(|at| at as u16 + 1)
        } else {
            if self.index.is_empty() {
                for (at, i) in self.items.iter().enumerate() {
                    self.index.insert(*i, at as u16 + 1);
                }
            }
            self.index.get(&item).copied()
        };
        if let Some(i) = found {
            return Ok(i);
        }
        let i = u16::try_from(self.items.len() + 1).map_err(|_| "more than 65535 distinct")?;
        if !self.index.is_empty() {
            self.index.insert(item, i);
        }
        self.items.push(item);
        Ok(i)
    }
}

/// A limit's parameters: kind code, its three numbers (a concurrency
/// limit's third is its request's slot id, carried per member) and enforce
/// (0, 1 or a block in ms, negative for a usage-based limit, as
/// lua/ratelimit.lua takes it).
type Params = (u8, u64, u64, u64, i64);

fn figure(raw: &[u8]) -> Result<u64, String> {
    // What `str::parse::<u64>` accepts (an optional `+`, then digits), read
    // in place: a batch reads six of these per member.
    let digits = raw.strip_prefix(b"+").unwrap_or(raw);
    let value = (!digits.is_empty())
        .then(|| {
            digits.iter().try_fold(0u64, |n, &d| {
                d.is_ascii_digit()
                    .then(|| n.checked_mul(10)?.checked_add(u64::from(d - b'0')))
                    .flatten()
            })
        })
        .flatten();
    value.filter(|n| *n <= MAX_FIGURE).ok_or_else(|| {
        format!(
            "not a figure below 2^53: {:?}",
            String::from_utf8_lossy(raw)
        )
    })
}

/// A figure that may be negative (an enforce value).
fn signed_figure(raw: &[u8]) -> Result<i64, String> {
    match raw.strip_prefix(b"-") {
        Some(rest) => figure(rest).map(|n| -(n as i64)),
        None => figure(raw).map(|n| n as i64),
    }
}

fn put_u16(out: &mut Vec<u8>, n: usize) -> Result<(), String> {
    let n = u16::try_from(n).map_err(|_| format!("{n} does not fit a packed batch's u16"))?;
    out.extend_from_slice(&n.to_be_bytes());
    Ok(())
}

fn put_figure(out: &mut Vec<u8>, n: u64) {
    // n <= 2^53: the double is exact.
    out.extend_from_slice(&(n as f64).to_be_bytes());
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) -> Result<(), String> {
    put_u16(out, b.len())?;
    out.extend_from_slice(b);
    Ok(())
}

/// One member's part of the body, from its lua/ratelimit.lua KEYS and ARGV.
fn pack_member<'a>(
    (keys, argv): &'a ScriptArgs,
    key_table: &mut Table<&'a [u8]>,
    params: &mut Table<Params>,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let n = argv
        .first()
        .map(|v| figure(v))
        .transpose()?
        .ok_or("no ARGV")?;
    let n = usize::try_from(n).map_err(|_| "too many limits")?;
    let values = n
        .checked_mul(6)
        .and_then(|v| v.checked_add(1))
        .ok_or("too many limits")?;
    let flag = argv.get(values).map(Vec::as_slice);
    let keyed = flag == Some(b"1");
    let expected = match flag {
        None => values,
        Some(b"0") => values.saturating_add(1),
        Some(b"1") => values.saturating_add(4),
        Some(_) => return Err("an idempotency flag that is neither 0 nor 1".to_string()),
    };
    if argv.len() != expected || keys.len() != n.saturating_add(usize::from(keyed)) {
        return Err("KEYS and ARGV are not in lua/ratelimit.lua's layout".to_string());
    }
    put_u16(out, n)?;
    for (i, key) in keys.iter().take(n).enumerate() {
        let v = &argv[1 + 6 * i..7 + 6 * i];
        // `+o`: the limit takes overrides (the kind's code plus 128).
        let (alg, overridable) = match v[0].strip_suffix(b"+o") {
            Some(alg) => (alg, 128),
            None => (v[0].as_slice(), 0),
        };
        let kind = KINDS
            .iter()
            .position(|k| *k == alg)
            .ok_or("unknown limit kind")?;
        // A concurrency limit's slot id and a quota's window edges are
        // strings, the member's own (a quota's edges are computed at its
        // request's arrival).
        let cc = KINDS[kind] == b"cc" || KINDS[kind] == b"cq";
        let c = if cc { 0 } else { figure(&v[3])? };
        let p = (
            kind as u8 + 1 + overridable,
            figure(&v[1])?,
            figure(&v[2])?,
            c,
            signed_figure(&v[5])?,
        );
        put_u16(out, usize::from(params.of(p)?))?;
        put_u16(out, usize::from(key_table.of(key.as_slice())?))?;
        put_figure(out, figure(&v[4])?);
        if cc {
            put_bytes(out, &v[3])?;
        }
    }
    out.push(u8::from(keyed));
    if keyed {
        let (key, idem) = (&keys[n], &argv[values + 1..]);
        put_u16(out, usize::from(key_table.of(key.as_slice())?))?;
        put_bytes(out, &idem[0])?;
        put_bytes(out, &idem[1])?;
        put_figure(out, figure(&idem[2])?);
    }
    Ok(())
}

/// lua/batch.lua's KEYS and packed argument for `members` (each a request's
/// own KEYS and ARGV for lua/ratelimit.lua), decided in this order. Each key
/// and each limit's parameters are sent once, however many members use
/// them; every figure is an 8-byte double (exact below 2^53). The layout is
/// lua/batch.lua's header. An error is a member not built by
/// `Plan::script_args`: a bug, never a client's doing.
pub fn pack(members: &[ScriptArgs]) -> Result<Packed, String> {
    let mut keys = Table::new();
    let mut params = Table::new();
    let mut body = Vec::with_capacity(16 + members.len() * 48);
    for member in members {
        pack_member(member, &mut keys, &mut params, &mut body)?;
    }
    let mut head = Vec::with_capacity(8 + params.items.len() * 33);
    head.push(PACKED_VERSION);
    put_u16(&mut head, params.items.len())?;
    for (kind, a, b, c, enforce) in &params.items {
        head.push(*kind);
        put_figure(&mut head, *a);
        put_figure(&mut head, *b);
        put_figure(&mut head, *c);
        // |enforce| <= 2^42: the double is exact.
        head.extend_from_slice(&(*enforce as f64).to_be_bytes());
    }
    put_u16(&mut head, members.len())?;
    head.extend_from_slice(&body);
    put_keys(&mut head, &keys.items)?;
    let first = keys.items.first().ok_or("a batch without a key")?;
    Ok(Packed {
        keys: vec![first.to_vec()],
        body: head,
    })
}

/// The key table after the last member: each key front-coded against the
/// one before it (a batch's keys share their prefix, hash tag and limit
/// name: mostly only the descriptor differs), as raw bytes. In the body,
/// unlike a `KEYS` entry in the request's path, a key needs no
/// percent-encoding, and only its new part travels.
fn put_keys(out: &mut Vec<u8>, keys: &[&[u8]]) -> Result<(), String> {
    put_u16(out, keys.len())?;
    let mut prev: &[u8] = &[];
    for key in keys {
        let shared = prev
            .iter()
            .zip(key.iter())
            .take(usize::from(u16::MAX))
            .take_while(|(a, b)| a == b)
            .count();
        put_u16(out, shared)?;
        put_bytes(out, &key[shared..])?;
        prev = key;
    }
    Ok(())
}

/// The packed layout's version, its first byte: lua/batch.lua refuses any
/// other (a filter and a script of different releases never mix silently;
/// each release's script has its own SHA-1 anyway).
pub const PACKED_VERSION: u8 = 3;

/// Splits lua/batch.lua's flat reply into each member's own reply, in the
/// form lua/ratelimit.lua gives it; `m` members were sent. A member the
/// script refused (one value, its error's text) is the error reply its lone
/// call would have had.
pub fn split_reply(reply: Reply, m: usize) -> Result<Vec<Reply>, String> {
    let Reply::Array(Some(items)) = reply else {
        return Err(format!("expected an array, got {}", Shown(&reply)));
    };
    let mut items = items.into_iter();
    let count = items.next().as_ref().and_then(Reply::as_int);
    if count != i64::try_from(m).ok() {
        return Err(format!("a batch of {m} answered for {count:?}"));
    }
    let mut out = Vec::with_capacity(m);
    for j in 0..m {
        let len = items
            .next()
            .as_ref()
            .and_then(Reply::as_int)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| format!("member {j}: no length"))?;
        let part: Vec<Reply> = items.by_ref().take(len).collect();
        if part.len() != len {
            return Err(format!(
                "member {j}: {len} values announced, {} left",
                part.len()
            ));
        }
        let refused = match part.as_slice() {
            [only] => only.member_failure().map(str::to_string),
            _ => None,
        };
        out.push(match refused {
            Some(why) => Reply::Error(why),
            None => Reply::Array(Some(part)),
        });
    }
    if items.next().is_some() {
        return Err("values after the last member".to_string());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_figure_reads_as_str_parse_reads_it() {
        for raw in [
            "0",
            "7",
            "+7",
            "+",
            "",
            "-1",
            "9007199254740992",
            "9007199254740993",
            "18446744073709551615",
            "18446744073709551616",
            "1a",
            " 1",
            "007",
            "++1",
        ] {
            let parsed = raw.parse::<u64>().ok().filter(|n| *n <= MAX_FIGURE);
            assert_eq!(figure(raw.as_bytes()).ok(), parsed, "{raw:?}");
        }
    }

    #[test]
    fn a_long_table_indexes_as_a_short_one() {
        let mut t = Table::new();
        let items: Vec<u32> = (0..40).map(|i| i % 23).collect();
        let got: Vec<u16> = items.iter().map(|i| t.of(*i).unwrap()).collect();
        let want: Vec<u16> = items.iter().map(|i| *i as u16 + 1).collect();
        assert_eq!(got, want);
        assert_eq!(t.items.len(), 23);
    }

    fn bytes(v: &[&str]) -> Vec<Vec<u8>> {
        v.iter().map(|s| s.as_bytes().to_vec()).collect()
    }

    fn f(n: f64) -> Vec<u8> {
        n.to_be_bytes().to_vec()
    }

    #[test]
    fn a_batch_packs_each_key_and_each_limits_parameters_once() {
        let a = (
            bytes(&["k1"]),
            bytes(&["1", "tb", "5", "1", "1000", "1", "1"]),
        );
        let b = (
            bytes(&["k1", "c", "idem"]),
            bytes(&[
                "2", "tb", "5", "1", "1000", "2", "1", "cc", "3", "60000", "s1", "1", "0", "1",
                "own", "fp", "9000",
            ]),
        );
        let p = pack(&[a, b]).unwrap();
        assert_eq!(p.keys, bytes(&["k1"]), "the first key routes the call");
        let mut want = vec![PACKED_VERSION, 0, 2];
        want.push(1);
        want.extend([f(5.0), f(1.0), f(1000.0), f(1.0)].concat());
        want.push(6);
        want.extend([f(3.0), f(60000.0), f(0.0), f(0.0)].concat());
        want.extend([0, 2]);
        // a: one limit, parameters 1 on key 1, cost 1, no key.
        want.extend([0, 1, 0, 1, 0, 1]);
        want.extend(f(1.0));
        want.push(0);
        // b: two limits, then its idempotency key.
        want.extend([0, 2, 0, 1, 0, 1]);
        want.extend(f(2.0));
        want.extend([0, 2, 0, 2]);
        want.extend(f(1.0));
        want.extend([0, 2, b's', b'1']);
        want.extend([1, 0, 3, 0, 3, b'o', b'w', b'n', 0, 2, b'f', b'p']);
        want.extend(f(9000.0));
        // The keys, front-coded: "k1", then "c" and "idem" (no prefix shared).
        want.extend([0, 3, 0, 0, 0, 2, b'k', b'1', 0, 0, 0, 1, b'c']);
        want.extend([0, 0, 0, 4, b'i', b'd', b'e', b'm']);
        assert_eq!(p.body, want);
    }

    #[test]
    fn keys_that_share_a_prefix_send_only_what_is_new() {
        let member = |key: &str| {
            (
                bytes(&[key]),
                bytes(&["1", "tb", "5", "1", "1000", "1", "1"]),
            )
        };
        let p = pack(&[
            member("rg:rl:{t}:a:5:alice"),
            member("rg:rl:{t}:a:3:bob"),
            member("rg:rl:{t}:a:5:alina"),
        ])
        .unwrap();
        let mut tail = vec![0, 3];
        tail.extend([0, 0, 0, 19]);
        tail.extend(b"rg:rl:{t}:a:5:alice");
        tail.extend([0, 12, 0, 5]);
        tail.extend(b"3:bob");
        tail.extend([0, 12, 0, 7]);
        tail.extend(b"5:alina");
        assert!(p.body.ends_with(&tail), "{:?}", p.body);
        assert_eq!(p.keys, bytes(&["rg:rl:{t}:a:5:alice"]));
    }

    #[test]
    fn a_member_not_in_the_request_layout_is_an_error() {
        let cases = [
            (bytes(&["k"]), bytes(&["1", "tb", "5", "1", "1000", "1"])),
            (
                bytes(&["k"]),
                bytes(&["1", "xx", "5", "1", "1000", "1", "1"]),
            ),
            (bytes(&["k"]), bytes(&["1", "tb", "5", "1", "-1", "1", "1"])),
            (
                bytes(&["k"]),
                bytes(&["1", "tb", "9007199254740993", "1", "1", "1", "1"]),
            ),
            (bytes(&[]), bytes(&["1", "tb", "5", "1", "1000", "1", "1"])),
            (
                bytes(&["k", "i"]),
                bytes(&["1", "tb", "5", "1", "1000", "1", "1", "1", "o"]),
            ),
            (
                bytes(&["k"]),
                bytes(&["1", "tb", "5", "1", "1000", "1", "1", "x", "o", "f", "9"]),
            ),
        ];
        for case in cases {
            assert!(pack(std::slice::from_ref(&case)).is_err(), "{case:?}");
        }
    }

    fn int(n: i64) -> Reply {
        Reply::Int(n)
    }

    #[test]
    fn a_reply_splits_into_each_members_own_reply() {
        let flat = Reply::Array(Some(vec![
            int(2),
            int(5),
            int(1),
            int(1),
            int(4),
            int(0),
            int(1000),
            int(2),
            int(2),
            int(150),
        ]));
        let parts = split_reply(flat, 2).unwrap();
        assert_eq!(
            parts,
            [
                Reply::Array(Some(vec![int(1), int(1), int(4), int(0), int(1000)])),
                Reply::Array(Some(vec![int(2), int(150)])),
            ]
        );
    }

    #[test]
    fn a_member_the_script_refused_is_its_lone_calls_error_reply() {
        let why = "ERR redis-guard ratelimit: limit 1 has a bad enforce value";
        let flat = Reply::Array(Some(vec![
            int(3),
            int(1),
            Reply::Bulk(Some(why.as_bytes().to_vec())),
            int(1),
            int(4),
            int(1),
            Reply::Bulk(Some(b"ERR".to_vec())),
        ]));
        let parts = split_reply(flat, 3).unwrap();
        assert_eq!(
            parts,
            [
                Reply::Error(why.to_string()),
                Reply::Array(Some(vec![int(4)])),
                // Not the marker: a string that is not `ERR <why>`.
                Reply::Array(Some(vec![Reply::Bulk(Some(b"ERR".to_vec()))])),
            ]
        );
    }

    #[test]
    fn a_reply_that_does_not_add_up_is_an_error_not_a_verdict() {
        let short = Reply::Array(Some(vec![int(2), int(1), int(1)]));
        assert!(split_reply(short, 2).is_err(), "second member missing");
        let long = Reply::Array(Some(vec![int(1), int(1), int(1), int(9)]));
        assert!(split_reply(long, 1).is_err(), "values left over");
        let count = Reply::Array(Some(vec![int(3), int(1), int(1)]));
        assert!(split_reply(count, 1).is_err(), "another batch's count");
        assert!(split_reply(Reply::Error("ERR x".into()), 1).is_err());
    }
}
