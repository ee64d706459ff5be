//! Property tests over the parsers that read bytes nobody vouches for:
//!
//! * `webdis::parse_reply`: Webdis' (RESP) answer, relayed from Redis;
//! * `config::Config::parse`: the plugin configuration;
//! * `idempotency::parse_key`: a client's `Idempotency-Key` header;
//! * `idempotency::decode_headers`: stored response headers read back from Redis.
//!
//! Each must return `Ok` or `Err` on any input, never panic, and the encoders
//! must round-trip through them. The cases are bounded (`CASES` per property,
//! small trees) and the seed is fixed, so CI runs the same inputs every time;
//! `PROPTEST_RNG_SEED=<n>` and `PROPTEST_CASES=<n>` explore further locally.
//! Failures are not persisted to disk.
//!
//! `tests/fixtures/hostile/` is a corpus of nasty inputs replayed, whole and
//! truncated at every length, through every parser.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::collection::vec;
// Only the seed settings: the rest of tests/support starts processes and
// talks HTTP, which this file's wasm32 run (make test-wasm32) cannot build.
mod support {
    pub mod fixed_seed;
}

use proptest::option;
use proptest::prelude::*;
use proptest::sample::{select, Index};
use serde_json::{Map, Number, Value};

use redis_guard::config::{Config, ConfigError, ENV_ACCESS_KEY_ID, ENV_SECRET_ACCESS_KEY};
use redis_guard::idempotency::{decode_headers, encode_headers, parse_key, MAX_KEY_LEN};
use redis_guard::webdis::{parse_reply, Reply, ReplyError};

/// Cases per property: enough to find shallow bugs, small enough that the
/// whole file stays far below 30 s in a debug build on two cores.
const CASES: u32 = 256;
/// The seed CI runs with, unless `PROPTEST_RNG_SEED` says otherwise.
const SEED: u64 = 0x7265_6469_735f_6775; // "redis_gu"

fn config() -> ProptestConfig {
    support::fixed_seed::config(CASES, SEED, 2048)
}

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

// ---------------------------------------------------------------------------
// RESP

/// The RESP2 encoding of `r`, written independently of the crate.
fn to_resp(r: &Reply, out: &mut Vec<u8>) {
    match r {
        Reply::Status(s) => {
            out.push(b'+');
            out.extend_from_slice(s.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        Reply::Error(s) => {
            out.push(b'-');
            out.extend_from_slice(s.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        Reply::Int(n) => out.extend_from_slice(format!(":{n}\r\n").as_bytes()),
        Reply::Bulk(None) => out.extend_from_slice(b"$-1\r\n"),
        Reply::Bulk(Some(b)) => {
            out.extend_from_slice(format!("${}\r\n", b.len()).as_bytes());
            out.extend_from_slice(b);
            out.extend_from_slice(b"\r\n");
        }
        Reply::Array(None) => out.extend_from_slice(b"*-1\r\n"),
        Reply::Array(Some(items)) => {
            out.extend_from_slice(format!("*{}\r\n", items.len()).as_bytes());
            for item in items {
                to_resp(item, out);
            }
        }
    }
}

fn resp(r: &Reply) -> Vec<u8> {
    let mut out = Vec::new();
    to_resp(r, &mut out);
    out
}

/// A status or error line: any text without CR LF (the line terminator).
fn resp_line() -> impl Strategy<Value = String> {
    prop_oneof![
        vec(any::<char>(), 0..16).prop_map(|cs| cs.into_iter().collect::<String>()),
        vec(select(&['\r', '\n', ' ', 'E', 'R', '\0', 'é'][..]), 0..16)
            .prop_map(|cs| cs.into_iter().collect::<String>()),
    ]
    // Replacing each CR LF by a space cannot create a new one.
    .prop_map(|s| s.replace("\r\n", " "))
}

fn reply_leaf() -> impl Strategy<Value = Reply> {
    prop_oneof![
        resp_line().prop_map(Reply::Status),
        resp_line().prop_map(Reply::Error),
        any::<i64>().prop_map(Reply::Int),
        option::of(vec(any::<u8>(), 0..32)).prop_map(Reply::Bulk),
        // Webdis re-encodes integers inside arrays as bulk strings.
        any::<i64>().prop_map(|n| Reply::Bulk(Some(n.to_string().into_bytes()))),
        Just(Reply::Array(None)),
    ]
}

/// A reply tree at most 4 arrays deep, at most 6 elements per array.
fn reply() -> impl Strategy<Value = Reply> {
    reply_leaf().prop_recursive(4, 64, 6, |inner| {
        vec(inner, 0..6).prop_map(|items| Reply::Array(Some(items)))
    })
}

/// RESP-flavoured noise: type bytes, line ends, lengths around the edges of
/// i64/usize and the element-count guard, and raw bytes.
fn resp_soup() -> impl Strategy<Value = Vec<u8>> {
    let token = prop_oneof![
        select(vec![
            &b"*"[..],
            b"$",
            b":",
            b"+",
            b"-",
            b"\r\n",
            b"\r",
            b"\n",
            b"\0",
            b"-1",
            b"-5",
            b"0",
            b"1",
            b"3",
            b"999999999999",
            b"9223372036854775807",
            b"-9223372036854775808",
            b"18446744073709551616",
            b"*1\r\n",
            b"$1048576\r\n",
        ])
        .prop_map(<[u8]>::to_vec),
        any::<i64>().prop_map(|n| n.to_string().into_bytes()),
        vec(any::<u8>(), 0..4),
    ];
    vec(token, 0..48).prop_map(|parts| parts.concat())
}

/// Everything a caller may do with a parsed reply must be panic-free too.
fn touch_reply(r: &Reply) {
    let _ = r.as_int();
    let _ = r.error_kind();
    if let Reply::Array(Some(items)) = r {
        items.iter().for_each(touch_reply);
    }
}

fn check_reply(input: &[u8]) -> Result<Reply, ReplyError> {
    let parsed = parse_reply(input);
    match &parsed {
        Ok(r) => {
            touch_reply(r);
            // Whatever was accepted is a fixed point of encode ∘ parse.
            assert_eq!(parse_reply(&resp(r)).as_ref(), Ok(r), "re-encoded {r:?}");
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
    parsed
}

/// `*1\r\n` `depth` times around `:1\r\n`.
fn nested_resp(depth: usize) -> Vec<u8> {
    let mut v = b"*1\r\n".repeat(depth);
    v.extend_from_slice(b":1\r\n");
    v
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn resp_arbitrary_bytes_never_panic(input in vec(any::<u8>(), 0..256)) {
        check_reply(&input).ok();
    }

    #[test]
    fn resp_soup_never_panics(input in resp_soup()) {
        check_reply(&input).ok();
    }

    #[test]
    fn resp_round_trips(r in reply()) {
        let wire = resp(&r);
        prop_assert_eq!(parse_reply(&wire), Ok(r));
    }

    /// RESP is self-delimiting: every proper prefix is truncated, and any byte
    /// after a complete reply is trailing.
    #[test]
    fn resp_prefixes_are_truncated_and_suffixes_trailing(
        r in reply(),
        cut in any::<Index>(),
        extra in vec(any::<u8>(), 1..8),
    ) {
        let wire = resp(&r);
        let at = cut.index(wire.len());
        prop_assert_eq!(parse_reply(&wire[..at]), Err(ReplyError::Truncated));
        let mut longer = wire.clone();
        longer.extend_from_slice(&extra);
        prop_assert_eq!(parse_reply(&longer), Err(ReplyError::TrailingBytes));
    }

    /// A valid reply with a few bytes overwritten: no panic, and anything
    /// accepted survives re-encoding.
    #[test]
    fn resp_corrupted_replies_never_panic(
        r in reply(),
        edits in vec((any::<Index>(), any::<u8>()), 1..4),
    ) {
        let mut wire = resp(&r);
        for (at, byte) in edits {
            let i = at.index(wire.len());
            wire[i] = byte;
        }
        check_reply(&wire).ok();
    }

    #[test]
    fn resp_huge_declared_lengths_are_refused(
        n in prop_oneof![1_000_000u64..u64::MAX, Just(999_999_999_999u64)],
        tag in select(&[b'$', b'*'][..]),
        body in vec(any::<u8>(), 0..64),
    ) {
        let mut input = format!("{}{n}\r\n", tag as char).into_bytes();
        input.extend_from_slice(&body);
        prop_assert!(check_reply(&input).is_err());
    }

    #[test]
    fn resp_negative_lengths_are_null(
        n in i64::MIN..0,
        tag in select(&[b'$', b'*'][..]),
    ) {
        let input = format!("{}{n}\r\n", tag as char).into_bytes();
        let expected = if tag == b'$' { Reply::Bulk(None) } else { Reply::Array(None) };
        prop_assert_eq!(parse_reply(&input), Ok(expected));
    }

    /// Webdis sends integers inside arrays as bulk strings; `as_int` reads both.
    #[test]
    fn resp_integers_parse_from_bulk_digits(ns in vec(any::<i64>(), 0..6)) {
        for &n in &ns {
            let digits = n.to_string();
            let bulk = format!("${}\r\n{digits}\r\n", digits.len());
            prop_assert_eq!(parse_reply(bulk.as_bytes()).unwrap().as_int(), Some(n));
            prop_assert_eq!(parse_reply(format!(":{n}\r\n").as_bytes()).unwrap().as_int(), Some(n));
        }
        let mut array = format!("*{}\r\n", ns.len()).into_bytes();
        for n in &ns {
            let digits = n.to_string();
            array.extend_from_slice(format!("${}\r\n{digits}\r\n", digits.len()).as_bytes());
        }
        let Reply::Array(Some(items)) = parse_reply(&array).unwrap() else {
            panic!("not an array");
        };
        let ints: Vec<_> = items.iter().map(Reply::as_int).collect();
        prop_assert_eq!(ints, ns.into_iter().map(Some).collect::<Vec<_>>());
    }

    /// `as_int` on a bulk string only succeeds on an optionally signed run of
    /// ASCII digits that fits in an i64.
    #[test]
    fn resp_as_int_only_reads_digits(bytes in prop_oneof![
        vec(any::<u8>(), 0..24),
        vec(select(&b"+-0123456789 x\0"[..]), 0..24),
    ]) {
        if let Some(n) = Reply::Bulk(Some(bytes.clone())).as_int() {
            let digits = bytes.strip_prefix(b"+").or_else(|| bytes.strip_prefix(b"-")).unwrap_or(&bytes);
            prop_assert!(!digits.is_empty() && digits.iter().all(u8::is_ascii_digit), "{:?} -> {}", bytes, n);
        }
    }
}

#[test]
fn resp_nesting_is_bounded() {
    // The parser refuses more than 8 levels below the top: no deep recursion,
    // whatever the input declares.
    for depth in 0..=40 {
        let got = parse_reply(&nested_resp(depth));
        if depth <= 8 {
            assert!(got.is_ok(), "depth {depth}: {got:?}");
        } else {
            assert_eq!(got, Err(ReplyError::TooDeep), "depth {depth}");
        }
    }
    assert_eq!(
        parse_reply(&b"*1\r\n".repeat(100_000)),
        Err(ReplyError::TooDeep)
    );
}

/// Every input of up to 5 bytes over the bytes that steer the parser.
#[test]
fn resp_exhaustive_short_inputs() {
    const ALPHABET: &[u8] = b"*$:+-\r\n019a\0";
    let mut input = Vec::new();
    fn walk(input: &mut Vec<u8>, left: usize) {
        check_reply(input).ok();
        if left == 0 {
            return;
        }
        for &b in ALPHABET {
            input.push(b);
            walk(input, left - 1);
            input.pop();
        }
    }
    walk(&mut input, 5);
}

// ---------------------------------------------------------------------------
// Config

const CONFIG_KEYS: &[&str] = &[
    "redis",
    "cluster",
    "authority",
    "timeoutMs",
    "circuitBreaker",
    "failures",
    "coolDownMs",
    "keyPrefix",
    "hashTag",
    "failureMode",
    "rateLimitHeaders",
    "limits",
    "idempotency",
    "name",
    "match",
    "pathPrefix",
    "pathExact",
    "methods",
    "host",
    "headers",
    "present",
    "exact",
    "descriptor",
    "header",
    "literal",
    "tokenBucket",
    "capacity",
    "refill",
    "periodMs",
    "slidingWindow",
    "limit",
    "windowMs",
    "cost",
    "costHeader",
    "max",
    "shadow",
    "localFraction",
    "required",
    "tenant",
    "lockTtlMs",
    "recordTtlMs",
    "storeStatuses",
    "storeHeaders",
    "maxRequestBodyBytes",
    "maxStoredBodyBytes",
];

const CONFIG_STRINGS: &[&str] = &[
    "",
    " ",
    "webdis",
    "allow",
    "deny",
    "local",
    "ietf",
    "x-ratelimit",
    "clientAddress",
    "path",
    "method",
    "/",
    "/api/",
    "/a?b",
    "GET",
    ":authority",
    "content-length",
    "x-user",
    "2xx",
    "599",
    "600",
    "[::1]",
    "host:80",
    "a{b}",
    "\0",
    "\u{feff}",
    "é",
];

fn json_string() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => select(CONFIG_STRINGS).prop_map(str::to_string),
        1 => select(CONFIG_KEYS).prop_map(str::to_string),
        2 => vec(any::<char>(), 0..12).prop_map(|cs| cs.into_iter().collect()),
    ]
}

fn json_key() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => select(CONFIG_KEYS).prop_map(str::to_string),
        1 => vec(any::<char>(), 0..8).prop_map(|cs| cs.into_iter().collect()),
    ]
}

fn json_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        select(vec![
            0u64,
            1,
            2,
            99,
            100,
            999,
            1000,
            1_000_000,
            1_000_001,
            60_000,
            60_001,
            86_400_000,
            2_592_000_000,
            1 << 20,
            8 << 20,
            64 << 20,
            (1 << 53) - 1,
            1 << 53,
            u64::from(u32::MAX),
            u64::from(u32::MAX) + 1,
            u64::MAX,
        ])
        .prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        select(
            &[
                0.0,
                -0.0,
                0.5,
                1.0,
                1.5,
                1e-300,
                1e300,
                f64::MAX,
                f64::MIN_POSITIVE
            ][..]
        )
        .prop_map(Value::from),
        any::<f64>().prop_map(|f| Number::from_f64(f).map_or(Value::Null, Value::Number)),
    ]
}

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        json_number(),
        json_string().prop_map(Value::String),
    ]
}

/// A JSON value at most 5 containers deep, at most 6 entries per container.
fn json_value() -> impl Strategy<Value = Value> {
    json_leaf().prop_recursive(5, 96, 6, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..6).prop_map(Value::Array),
            vec((json_key(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A config that parsed must also be usable: the derived numbers the filter
/// computes per request must not overflow.
fn use_config(cfg: &Config) {
    for l in &cfg.limits {
        let _ = (l.algorithm.quota(), l.algorithm.window_ms());
        let _ = l.algorithm.signature();
        let _ = format!("{:?}", l.descriptor);
        assert!(l.local_per_mille >= 1 && l.local_per_mille <= 1000);
    }
    for rule in &cfg.idempotency {
        for status in [0, 100, 200, 204, 404, 599, 600, u32::MAX] {
            let _ = rule.stores(status);
        }
    }
}

/// `Config::parse` with a fixed environment: configs whose objectStore or
/// Webdis credentials are `fromEnvironment` (envoy/filter.json, a seed) get
/// past them whatever the test process has set, so mutations reach every
/// check.
fn parse_config(input: &[u8]) -> Result<Config, ConfigError> {
    Config::parse_with_env(input, &|name| match name {
        ENV_ACCESS_KEY_ID => Some("AKIAIOSFODNN7EXAMPLE".to_string()),
        ENV_SECRET_ACCESS_KEY => Some("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".to_string()),
        "REDIS_GUARD_WEBDIS_USERNAME" => Some("redis-guard".to_string()),
        "REDIS_GUARD_WEBDIS_PASSWORD" => Some("example-password".to_string()),
        _ => None,
    })
}

fn check_config(input: &[u8]) -> Result<Config, ConfigError> {
    let parsed = parse_config(input);
    match &parsed {
        Ok(cfg) => use_config(cfg),
        Err(e) => {
            assert!(
                !e.reason.is_empty(),
                "empty reason for {:?} (field `{}`)",
                String::from_utf8_lossy(input),
                e.field
            );
            assert!(!e.to_string().is_empty());
        }
    }
    parsed
}

/// `envoy/filter.json` and the valid fixtures: seeds for mutation.
fn seed_configs() -> &'static [(String, Value)] {
    static SEEDS: OnceLock<Vec<(String, Value)>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let mut paths = vec![manifest_dir().join("envoy/filter.json")];
        let good = manifest_dir().join("tests/fixtures/config/good");
        if let Ok(dir) = fs::read_dir(&good) {
            let mut more: Vec<PathBuf> = dir.map(|e| e.unwrap().path()).collect();
            more.sort();
            paths.extend(more);
        }
        paths
            .into_iter()
            .map(|p| {
                let bytes = fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                let cfg = parse_config(&bytes);
                assert!(cfg.is_ok(), "{} must be valid: {cfg:?}", p.display());
                (
                    p.display().to_string(),
                    serde_json::from_slice(&bytes).unwrap(),
                )
            })
            .collect()
    })
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Seg {
    Key(String),
    Idx(usize),
}

/// Paths to every node of `v` (the root included).
fn node_paths(v: &Value, at: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
    out.push(at.clone());
    match v {
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                at.push(Seg::Idx(i));
                node_paths(item, at, out);
                at.pop();
            }
        }
        Value::Object(map) => {
            for (k, item) in map {
                at.push(Seg::Key(k.clone()));
                node_paths(item, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

fn get_mut<'a>(mut v: &'a mut Value, path: &[Seg]) -> &'a mut Value {
    for seg in path {
        v = match (seg, v) {
            (Seg::Key(k), Value::Object(map)) => map.get_mut(k).unwrap(),
            (Seg::Idx(i), Value::Array(items)) => &mut items[*i],
            (seg, v) => panic!("no {seg:?} in {v}"),
        };
    }
    v
}

#[derive(Debug, Clone)]
enum Mutation {
    /// Replace a leaf (a scalar, or an empty list or object) with any value.
    ReplaceLeaf(Index, Value),
    /// Replace a leaf with another of its kind (number, string, bool), so the
    /// document gets past the types into the validation of values.
    ReplaceLeafSameKind(Index, Value, String, bool),
    /// Replace any node, containers included.
    ReplaceNode(Index, Value),
    /// Rename a key (possibly onto another key of the same object).
    RenameKey(Index, String),
    RemoveKey(Index),
    /// Wrap a node in a one-element array.
    WrapInArray(Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<Index>(), json_leaf()).prop_map(|(i, v)| Mutation::ReplaceLeaf(i, v)),
        1 => (any::<Index>(), json_value()).prop_map(|(i, v)| Mutation::ReplaceLeaf(i, v)),
        4 => (any::<Index>(), json_number(), json_string(), any::<bool>())
            .prop_map(|(i, n, s, b)| Mutation::ReplaceLeafSameKind(i, n, s, b)),
        1 => (any::<Index>(), json_value()).prop_map(|(i, v)| Mutation::ReplaceNode(i, v)),
        3 => (any::<Index>(), json_key()).prop_map(|(i, k)| Mutation::RenameKey(i, k)),
        1 => any::<Index>().prop_map(Mutation::RemoveKey),
        1 => any::<Index>().prop_map(Mutation::WrapInArray),
    ]
}

fn is_leaf(v: &Value) -> bool {
    match v {
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => true,
    }
}

fn apply(doc: &mut Value, m: Mutation) {
    let mut all = Vec::new();
    node_paths(doc, &mut Vec::new(), &mut all);
    // Paths that end in a key, for renaming and removing.
    let keyed: Vec<&Vec<Seg>> = all
        .iter()
        .filter(|p| matches!(p.last(), Some(Seg::Key(_))))
        .collect();
    match m {
        Mutation::ReplaceLeaf(i, new) => {
            let leaves: Vec<&Vec<Seg>> = all.iter().filter(|p| is_leaf(get_ref(doc, p))).collect();
            let path = leaves[i.index(leaves.len())].clone();
            *get_mut(doc, &path) = new;
        }
        Mutation::ReplaceLeafSameKind(i, number, string, flag) => {
            let leaves: Vec<&Vec<Seg>> = all.iter().filter(|p| is_leaf(get_ref(doc, p))).collect();
            let path = leaves[i.index(leaves.len())].clone();
            let leaf = get_mut(doc, &path);
            *leaf = match leaf {
                Value::Number(_) => number,
                Value::String(_) => Value::String(string),
                Value::Bool(_) => Value::Bool(flag),
                _ => return,
            };
        }
        Mutation::ReplaceNode(i, new) => {
            let path = all[i.index(all.len())].clone();
            *get_mut(doc, &path) = new;
        }
        Mutation::WrapInArray(i) => {
            let path = all[i.index(all.len())].clone();
            let node = get_mut(doc, &path);
            *node = Value::Array(vec![node.take()]);
        }
        Mutation::RenameKey(..) | Mutation::RemoveKey(..) if keyed.is_empty() => {}
        Mutation::RenameKey(i, new_key) => {
            let path = keyed[i.index(keyed.len())].clone();
            let (last, parent) = path.split_last().unwrap();
            let Seg::Key(old) = last else { unreachable!() };
            let Value::Object(map) = get_mut(doc, parent) else {
                unreachable!()
            };
            let v = map.remove(old).unwrap();
            map.insert(new_key, v);
        }
        Mutation::RemoveKey(i) => {
            let path = keyed[i.index(keyed.len())].clone();
            let (last, parent) = path.split_last().unwrap();
            let Seg::Key(old) = last else { unreachable!() };
            let Value::Object(map) = get_mut(doc, parent) else {
                unreachable!()
            };
            map.remove(old);
        }
    }
}

fn get_ref<'a>(mut v: &'a Value, path: &[Seg]) -> &'a Value {
    for seg in path {
        v = match (seg, v) {
            (Seg::Key(k), Value::Object(map)) => &map[k],
            (Seg::Idx(i), Value::Array(items)) => &items[*i],
            (seg, v) => panic!("no {seg:?} in {v}"),
        };
    }
    v
}

fn seed_index() -> impl Strategy<Value = usize> {
    // Half of the cases start from envoy/filter.json itself.
    prop_oneof![Just(0usize), 0..seed_configs().len()]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn config_arbitrary_bytes_never_panic(input in vec(any::<u8>(), 0..256)) {
        check_config(&input).ok();
    }

    #[test]
    fn config_arbitrary_json_never_panics(v in json_value()) {
        check_config(&serde_json::to_vec(&v).unwrap()).ok();
    }

    /// Any JSON under a `redis` that is valid, so the walk gets past the first field.
    #[test]
    fn config_arbitrary_fields_never_panic(
        fields in vec((json_key(), json_value()), 0..6),
    ) {
        let mut doc = Map::new();
        doc.insert("redis".into(), serde_json::json!({"cluster": "webdis"}));
        doc.extend(fields);
        check_config(&serde_json::to_vec(&Value::Object(doc)).unwrap()).ok();
    }

    /// One to three structural mutations of a valid config: `Ok`, or `Err`
    /// with a reason.
    #[test]
    fn config_mutations_never_panic(
        seed in seed_index(),
        mutations in vec(mutation(), 1..4),
        pretty in any::<bool>(),
    ) {
        let (_, original) = &seed_configs()[seed];
        let mut doc = original.clone();
        for m in mutations {
            apply(&mut doc, m);
        }
        let bytes = if pretty {
            serde_json::to_vec_pretty(&doc).unwrap()
        } else {
            serde_json::to_vec(&doc).unwrap()
        };
        check_config(&bytes).ok();
    }

    /// Byte-level damage to a valid config file: overwrite, insert or delete.
    #[test]
    fn config_byte_edits_never_panic(
        seed in seed_index(),
        edits in vec((0u8..3, any::<Index>(), any::<u8>()), 1..6),
    ) {
        let path = &seed_configs()[seed].0;
        let mut bytes = fs::read(path).unwrap();
        for (op, at, byte) in edits {
            match op {
                0 if !bytes.is_empty() => {
                    let i = at.index(bytes.len());
                    bytes[i] = byte;
                }
                1 => {
                    let i = at.index(bytes.len() + 1);
                    bytes.insert(i, byte);
                }
                _ if !bytes.is_empty() => {
                    let i = at.index(bytes.len());
                    bytes.remove(i);
                }
                _ => {}
            }
        }
        check_config(&bytes).ok();
    }
}

#[test]
fn config_seeds_parse() {
    assert!(seed_configs().len() >= 2);
    assert!(seed_configs()[0].0.ends_with("envoy/filter.json"));
}

/// serde_json stops at 128 levels of nesting ("recursion limit exceeded";
/// 127 nested arrays still parse)
/// instead of recursing into the stack: a deeply nested config is an `Err`.
#[test]
fn config_deep_nesting_is_an_error_not_a_stack_overflow() {
    let nested = |depth: usize| {
        let mut v = "[".repeat(depth);
        v.push_str(&"]".repeat(depth));
        v
    };
    assert!(serde_json::from_str::<Value>(&nested(127)).is_ok());
    let deep = serde_json::from_str::<Value>(&nested(128)).unwrap_err();
    assert!(
        deep.to_string().contains("recursion limit exceeded"),
        "{deep}"
    );

    for depth in [128, 129, 10_000] {
        assert!(check_config(nested(depth).as_bytes()).is_err());
        let objects = format!("{}1{}", r#"{"redis":"#.repeat(depth), "}".repeat(depth));
        assert!(check_config(objects.as_bytes()).is_err());
        // Deep nesting where a list is allowed, past the valid fields.
        let in_limits = format!(
            r#"{{"redis":{{"cluster":"webdis"}},"limits":{}}}"#,
            nested(depth)
        );
        assert!(check_config(in_limits.as_bytes()).is_err());
    }
}

// ---------------------------------------------------------------------------
// Idempotency keys and stored headers

fn check_key(raw: &[u8]) -> Result<Vec<u8>, String> {
    let parsed = parse_key(raw);
    match &parsed {
        Ok(key) => {
            assert!(!key.is_empty() && key.len() <= MAX_KEY_LEN, "{raw:?}");
            assert!(
                key.iter().all(|b| (0x20..=0x7e).contains(b)),
                "{raw:?} -> {key:?}"
            );
        }
        Err(reason) => assert!(!reason.is_empty()),
    }
    parsed
}

fn check_headers(raw: &[u8]) -> Result<Vec<(String, Vec<u8>)>, String> {
    let parsed = decode_headers(raw);
    match &parsed {
        // What was decoded is a fixed point of decode ∘ encode (the input may
        // differ: lengths like "+05", names that were not UTF-8).
        Ok(h) => assert_eq!(decode_headers(&encode_headers(h)).as_ref(), Ok(h)),
        Err(reason) => assert!(!reason.is_empty()),
    }
    parsed
}

/// SF-string quoting of a printable key.
fn quote(key: &[u8]) -> Vec<u8> {
    let mut out = vec![b'"'];
    for &b in key {
        if b == b'"' || b == b'\\' {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.push(b'"');
    out
}

fn headers() -> impl Strategy<Value = Vec<(String, Vec<u8>)>> {
    let name = prop_oneof![
        select(&["content-type", "x-odd", "", "5:abc", "0:", "é"][..]).prop_map(str::to_string),
        vec(any::<char>(), 0..12).prop_map(|cs| cs.into_iter().collect()),
    ];
    let value = prop_oneof![
        vec(any::<u8>(), 0..32),
        vec(select(&b"0123456789:"[..]), 0..12),
    ];
    vec((name, value), 0..8)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn key_arbitrary_bytes_never_panic(raw in prop_oneof![
        vec(any::<u8>(), 0..300),
        vec(select(&b"\"\\ \ta\x00\x7f\xff"[..]), 0..12),
    ]) {
        check_key(&raw).ok();
    }

    #[test]
    fn key_bare_printable_is_accepted_verbatim(
        key in vec(0x21u8..=0x7e, 1..=MAX_KEY_LEN).prop_filter("quoted", |k| k[0] != b'"'),
        pad in select(vec![&b""[..], b" ", b"\t", b" \t "]),
    ) {
        let raw = [pad, &key[..], pad].concat();
        prop_assert_eq!(check_key(&raw), Ok(key));
    }

    #[test]
    fn key_quoted_round_trips(key in vec(0x20u8..=0x7e, 1..=MAX_KEY_LEN)) {
        prop_assert_eq!(check_key(&quote(&key)), Ok(key));
    }

    #[test]
    fn key_over_long_is_refused(key in vec(0x21u8..=0x7e, MAX_KEY_LEN + 1..MAX_KEY_LEN + 64)) {
        prop_assert!(check_key(&key).is_err());
        prop_assert!(check_key(&quote(&key)).is_err());
    }

    #[test]
    fn headers_arbitrary_bytes_never_panic(raw in prop_oneof![
        vec(any::<u8>(), 0..256),
        vec(select(&b"0123456789:+-a"[..]), 0..32),
    ]) {
        check_headers(&raw).ok();
    }

    #[test]
    fn headers_round_trip(h in headers()) {
        prop_assert_eq!(check_headers(&encode_headers(&h)), Ok(h));
    }

    /// A prefix of an encoding decodes exactly when it ends between two
    /// headers, and then to those headers.
    #[test]
    fn headers_prefixes_decode_only_at_boundaries(h in headers(), cut in any::<Index>()) {
        let wire = encode_headers(&h);
        let at = cut.index(wire.len() + 1);
        let boundary = (0..=h.len()).find(|&k| encode_headers(&h[..k]).len() == at);
        match (check_headers(&wire[..at]), boundary) {
            (Ok(got), Some(k)) => prop_assert_eq!(&got[..], &h[..k]),
            (Err(_), None) => {}
            (got, boundary) => prop_assert!(false, "prefix {} of {:?}: {:?}, boundary {:?}", at, wire, got, boundary),
        }
    }
}

/// Every input of up to 6 bytes over the bytes that steer the decoder.
#[test]
fn headers_exhaustive_short_inputs() {
    const ALPHABET: &[u8] = b"019:+-a";
    fn walk(input: &mut Vec<u8>, left: usize) {
        check_headers(input).ok();
        if left == 0 {
            return;
        }
        for &b in ALPHABET {
            input.push(b);
            walk(input, left - 1);
            input.pop();
        }
    }
    walk(&mut Vec::new(), 6);
}

// ---------------------------------------------------------------------------
// The hostile corpus

#[derive(Debug, Clone, Copy)]
enum Expect {
    /// The parser the file targets must accept it.
    Ok,
    /// … must refuse it, with an error whose text contains this.
    Err(&'static str),
}

/// Which parser each corpus file targets (by prefix), and what it must say.
/// Every file is also fed to all the other parsers, which must not panic.
const CORPUS: &[(&str, Expect)] = &[
    ("empty.bin", Expect::Ok), // decode_headers: no headers stored
    (
        "idem_headers_huge_length.bin",
        Expect::Err("stored headers: truncated"),
    ),
    ("idem_key_control_bytes.bin", Expect::Err("byte 0x00")),
    ("json_bom.json", Expect::Err("expected value")),
    (
        "json_duplicate_keys.json",
        Expect::Err("duplicate field `redis`"),
    ),
    ("json_huge_numbers.json", Expect::Err("")),
    ("json_invalid_utf8.json", Expect::Err("invalid unicode")),
    ("json_lone_surrogate.json", Expect::Err("hex escape")),
    ("json_nested_arrays_10k.json", Expect::Err("")),
    ("json_nested_objects_10k.json", Expect::Err("unknown field")),
    (
        "json_raw_nul_in_string.json",
        Expect::Err("control character"),
    ),
    (
        "json_trailing_garbage.json",
        Expect::Err("trailing characters"),
    ),
    ("resp_array_count_huge.resp", Expect::Err("truncated")),
    (
        "resp_bulk_1mb_declared_3_bytes.resp",
        Expect::Err("truncated"),
    ),
    ("resp_bulk_unterminated.resp", Expect::Err("not terminated")),
    ("resp_invalid_utf8.resp", Expect::Ok),
    ("resp_length_overflows_i64.resp", Expect::Err("bad integer")),
    ("resp_negative_lengths.resp", Expect::Ok),
    (
        "resp_nested_arrays_64.resp",
        Expect::Err("nested too deeply"),
    ),
    ("resp_nul_bytes.resp", Expect::Ok),
    ("resp_truncated_array.resp", Expect::Err("truncated")),
    ("resp_truncated_header.resp", Expect::Err("truncated")),
];

/// Runs every parser on `input`; returns the target parser's outcome as text.
fn feed_all(name: &str, input: &[u8]) -> Result<(), String> {
    let reply = check_reply(input).map(drop).map_err(|e| e.to_string());
    let config = check_config(input).map(drop).map_err(|e| e.to_string());
    let key = check_key(input).map(drop);
    let headers = check_headers(input).map(drop);
    // serde_json itself, as the config parser sees it.
    let _ = serde_json::from_slice::<Value>(input);
    if name.starts_with("resp_") {
        reply
    } else if name.starts_with("json_") {
        config
    } else if name.starts_with("idem_key") {
        key
    } else {
        headers
    }
}

#[test]
fn hostile_corpus_never_panics() {
    let dir = manifest_dir().join("tests/fixtures/hostile");
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let listed: Vec<&str> = CORPUS.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names, listed,
        "every corpus file needs an entry in CORPUS (sorted)"
    );

    let mut failures = Vec::new();
    for (path, (name, expect)) in files.iter().zip(CORPUS) {
        let input = fs::read(path).unwrap();
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            // Small files are also replayed cut at every length.
            if input.len() <= 4096 {
                for at in 0..input.len() {
                    feed_all(name, &input[..at]).ok();
                }
            }
            feed_all(name, &input)
        }));
        match (outcome, expect) {
            (Err(panic), _) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                failures.push(format!("{name}: panicked: {msg}"));
            }
            (Ok(Ok(())), Expect::Ok) => {}
            (Ok(Err(e)), Expect::Err(words)) if e.contains(words) => {}
            (Ok(got), expect) => failures.push(format!("{name}: got {got:?}, want {expect:?}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(files.len() >= 15);
}

/// The 10k-deep JSON files hit serde_json's recursion limit, not the stack.
#[test]
fn hostile_deep_json_hits_the_recursion_limit() {
    let dir = manifest_dir().join("tests/fixtures/hostile");
    for name in [
        "json_nested_arrays_10k.json",
        "json_nested_objects_10k.json",
    ] {
        let input = fs::read(dir.join(name)).unwrap();
        let err = serde_json::from_slice::<Value>(&input).unwrap_err();
        assert!(
            err.to_string().contains("recursion limit exceeded"),
            "{name}: {err}"
        );
        assert!(Config::parse(&input).is_err(), "{name}");
    }
}
