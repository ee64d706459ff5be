//! What Redis holds of the plans: which keys are a limit's override keys
//! (and the part values each was built from), and reading them in batches.

use std::collections::BTreeMap;

use redis_guard::config::{Config, Limit, Part};
use redis_guard::keys::{key_slot, override_key, push_value, MAX_RAW_VALUE};
use redis_guard::overrides::Override;

use super::file::{self, Who};
use crate::select;
use crate::store::Store;
use crate::Failure;

/// Keys per MGET, MSET or DEL: one round trip each, short enough that
/// Redis never stalls the fleet's decisions on one (about 30 KB of plans).
pub const BATCH: usize = 500;

/// The encoded values of `key` when it is an override key of `limit` as
/// the filter builds them (src/keys.rs: `<prefix>:ov:{<tag>}:<name>:` and
/// each part's `<len>:<bytes>` or `#<sha256>`): one per part, `None` for a
/// value the key holds only as its digest.
pub fn key_parts(config: &Config, limit: &Limit, key: &[u8]) -> Option<Vec<Option<Vec<u8>>>> {
    let rest = key
        .strip_prefix(config.key_prefix.as_bytes())?
        .strip_prefix(b":ov:{")?;
    let close = rest.iter().position(|&b| b == b'}')?;
    let (tag, rest) = rest.split_at(close);
    let lower_hex = |b: &[u8]| b.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'));
    let tag_ok = match &config.static_tag {
        Some(t) => tag == t.as_bytes(),
        None => tag.len() == 16 && lower_hex(tag),
    };
    if !tag_ok {
        return None;
    }
    let mut rest = rest
        .strip_prefix(b"}:")?
        .strip_prefix(limit.name.as_bytes())?
        .strip_prefix(b":")?;
    let mut parts = Vec::with_capacity(limit.descriptor.len());
    for (i, part) in limit.descriptor.iter().enumerate() {
        if i > 0 {
            rest = rest.strip_prefix(b":")?;
        }
        let (value, used) = match rest.strip_prefix(b"#") {
            Some(digest) => (None, 1 + digest.get(..64).filter(|d| lower_hex(d))?.len()),
            None => {
                let colon = rest.iter().take(4).position(|&b| b == b':')?;
                let digits = std::str::from_utf8(rest.get(..colon)?).ok()?;
                let len: usize = digits.parse().ok()?;
                // The filter writes the length in plain decimal and hashes a longer value.
                if len > MAX_RAW_VALUE || digits != len.to_string() {
                    return None;
                }
                let value = rest.get(colon + 1..colon + 1 + len)?;
                (Some(value.to_vec()), colon + 1 + len)
            }
        };
        if let Part::Literal(literal) = part {
            let mut encoded = Vec::new();
            push_value(&mut encoded, literal.as_bytes());
            if rest.get(..used)? != encoded.as_slice() {
                return None;
            }
        }
        parts.push(value);
        rest = rest.get(used..)?;
    }
    rest.is_empty().then_some(parts)
}

/// The part values `key` was built from, by the names `--value` takes,
/// when building the key from them again gives `key` (a value the key
/// holds as its digest cannot be told, nor one the filter transformed
/// otherwise than a client prefix's masking).
fn recover(config: &Config, limit: &Limit, key: &[u8]) -> Option<BTreeMap<String, String>> {
    let parts = key_parts(config, limit, key)?;
    let mut values = BTreeMap::new();
    for (part, value) in limit.descriptor.iter().zip(parts) {
        let value = String::from_utf8(value?).ok()?;
        let Some(name) = select::part_name(part) else {
            continue;
        };
        // A network `10.1.2.0/24` is given as an address in it.
        let value = match part {
            Part::ClientPrefix { .. } => value.split('/').next().unwrap_or_default().to_string(),
            _ => value,
        };
        if values
            .insert(name, value.clone())
            .is_some_and(|v| v != value)
        {
            return None;
        }
    }
    let given: Vec<String> = values.iter().map(|(n, v)| format!("{n}={v}")).collect();
    let target = select::limit(config, &limit.name, &given).ok()?;
    (override_key(&target.key)?.as_slice() == key).then_some(values)
}

/// A stored plan's canonical line, or why the filter ignores it.
pub fn stored_line(
    config: &Config,
    limit: &Limit,
    key: &[u8],
    text: &[u8],
) -> Result<String, String> {
    let plan = Override::parse(text, &limit.algorithm)?;
    let who = recover(config, limit, key).map_or_else(|| Who::Key(key.to_vec()), Who::Values);
    Ok(file::canonical(&limit.name, &who, &plan))
}

/// What is stored at `keys`, in batches of [`BATCH`] keys, one round trip
/// each (MGET: a key of another type reads as none, as the script ignores
/// it). `per_slot` on one node of a Redis Cluster, which refuses a command
/// whose keys are in different slots: a batch then holds one slot's keys.
/// Through `--cluster` the client splits a batch by slot itself.
pub fn stored(
    redis: &mut Store,
    keys: &[&[u8]],
    per_slot: bool,
) -> Result<Vec<Option<Vec<u8>>>, Failure> {
    let mut out = vec![None; keys.len()];
    for batch in batches(keys, per_slot) {
        let mut mget = redis::cmd("MGET");
        for &i in &batch {
            mget.arg(keys.get(i).copied().unwrap_or_default());
        }
        let got: Vec<Option<Vec<u8>>> = redis.query(&mget)?;
        if got.len() != batch.len() {
            return Err(Failure::redis("MGET answered a different number of values"));
        }
        for (i, value) in batch.into_iter().zip(got) {
            if let Some(slot) = out.get_mut(i) {
                *slot = value;
            }
        }
    }
    Ok(out)
}

/// The indices of `keys` in batches of at most [`BATCH`] (of one slot each
/// when `per_slot`).
fn batches(keys: &[&[u8]], per_slot: bool) -> Vec<Vec<usize>> {
    let mut groups: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
    for (i, key) in keys.iter().enumerate() {
        let slot = if per_slot { key_slot(key) } else { 0 };
        groups.entry(slot).or_default().push(i);
    }
    groups
        .values()
        .flat_map(|group| group.chunks(BATCH).map(<[usize]>::to_vec))
        .collect()
}

/// Whether the server is a node of a Redis Cluster (`INFO cluster`).
pub fn cluster_node(redis: &mut Store) -> Result<bool, Failure> {
    let info: String = redis.query(redis::cmd("INFO").arg("cluster"))?;
    Ok(info.lines().any(|l| l.trim() == "cluster_enabled:1"))
}

/// A SCAN pattern that matches `text` literally.
fn glob_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Every override key of `limit` on this server (SCAN), each one the
/// filter could have built (another key the pattern matches is left alone).
pub fn scan(redis: &mut Store, config: &Config, limit: &Limit) -> Result<Vec<Vec<u8>>, Failure> {
    let pattern = format!(
        "{}:ov:{{*}}:{}:*",
        glob_literal(&config.key_prefix),
        glob_literal(&limit.name)
    );
    let mut cursor = 0u64;
    let mut keys = Vec::new();
    loop {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000);
        let (next, found): (u64, Vec<Vec<u8>>) = redis.query(&cmd)?;
        keys.extend(
            found
                .into_iter()
                .filter(|k| key_parts(config, limit, k).is_some()),
        );
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    // SCAN may return a key twice.
    keys.sort();
    keys.dedup();
    Ok(keys)
}
