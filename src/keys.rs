//! Redis key building.
//!
//! Rate-limit keys look like `rg:rl:{9f86d081884c7d65}:per-user:tb2.10.1.1000:5:alice`:
//! prefix, kind, Redis Cluster hash tag, limit name, algorithm signature, descriptor.
//!
//! * The hash tag is shared by every key one request touches, so one script
//!   call never crosses slots (no CROSSSLOT in Redis Cluster). It is a digest
//!   of the configured `hashTag` parts: never empty (an empty `{}` would hash
//!   the whole key) and never containing a brace.
//! * The signature carries every parameter that shapes the stored state, so a
//!   reconfigured limit starts from a fresh key.
//! * Descriptor values are client bytes and stay as they are; each is
//!   length-prefixed so no two descriptors can produce the same key, and a
//!   value longer than [`MAX_RAW_VALUE`] is replaced by its SHA-256 so keys
//!   stay small whatever the client sends.

use sha2::{Digest, Sha256};

use crate::codec::{hex, sha256_hex};

/// Longest descriptor value kept verbatim in a key.
pub const MAX_RAW_VALUE: usize = 128;

/// Appends one descriptor value: `<len>:<bytes>`, or `#<sha256 hex>` when long.
pub fn push_value(out: &mut Vec<u8>, value: &[u8]) {
    if value.len() > MAX_RAW_VALUE {
        out.push(b'#');
        out.extend_from_slice(sha256_hex(value).as_bytes());
    } else {
        out.extend_from_slice(&crate::codec::decimal(value.len() as u64));
        out.push(b':');
        out.extend_from_slice(value);
    }
}

/// The hash tag (16 hex digits) of the values of the configured `hashTag`
/// parts, in order.
pub fn hash_tag_of<V: AsRef<[u8]>>(values: impl IntoIterator<Item = V>) -> String {
    let mut enc = Vec::new();
    for value in values {
        push_value(&mut enc, value.as_ref());
        enc.push(b':');
    }
    hex(&Sha256::digest(&enc)[..8])
}

/// Where a limit key's record lives in a fixed table of `slots` entries of
/// Envoy's shared data (which is never freed, so tables do not grow with the
/// keys clients invent): the shared-data key `<table>/<index>`, and 16 bytes
/// of the key's digest, stored in the record so a collision never answers
/// for another key.
pub fn shared_slot(table: &str, slots: u32, limit_key: &[u8]) -> (String, [u8; 16]) {
    shared_slot_of(table, slots, &Sha256::digest(limit_key).into())
}

/// [`shared_slot`] of a key whose SHA-256 is `full` (a request's checks
/// keep theirs: [`KeyDigest`]).
pub fn shared_slot_of(table: &str, slots: u32, full: &[u8; 32]) -> (String, [u8; 16]) {
    let mut digest = [0u8; 16];
    digest.copy_from_slice(&full[..16]);
    let index = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]) % slots;
    let mut shared_key = String::with_capacity(table.len() + 11);
    shared_key.push_str(table);
    shared_key.push('/');
    crate::codec::push_decimal(&mut shared_key, u64::from(index));
    (shared_key, digest)
}

/// The SHA-256 of a limit key, computed at its first use and then kept: the
/// over-limit cache, the lease table and the access log each need it for
/// the same key, and in the wasm one digest costs about as much as the rest
/// of an admitted request's work in the filter (envoy/cost_gate). Two
/// digests of equal keys are equal: it compares as always equal, so a
/// check's equality stays its key's.
#[derive(Clone, Default)]
pub struct KeyDigest(std::cell::OnceCell<[u8; 32]>);

impl KeyDigest {
    /// The digest of `key`, which must be the key it was first asked for
    /// (a check's, which never changes).
    pub fn of(&self, key: &[u8]) -> &[u8; 32] {
        self.0.get_or_init(|| recent_digest(key))
    }
}

/// Entries of the worker's table of recent digests ([`recent_digest`]).
const RECENT: usize = 64;

/// Keys longer than this are digested every time: a key holds at most a
/// few descriptor values of up to [`MAX_RAW_VALUE`] bytes each, and the
/// table's memory stays within RECENT x this.
const RECENT_KEY_MAX: usize = 512;

/// One entry of the table: a key and its digest.
type Recent = Option<(Box<[u8]>, [u8; 32])>;

thread_local! {
    /// The worker's (a wasm VM is one thread) recent keys and their digests,
    /// one per entry, an entry chosen by a cheap hash of the key.
    static RECENT_DIGESTS: std::cell::RefCell<Vec<Recent>> =
        std::cell::RefCell::new(vec![None; RECENT]);
}

/// SHA-256 of `key`, from the worker's table of recent keys when `key` is
/// there, byte for byte (so always the key's own digest). A key a worker
/// sees once is digested once per request; a key it sees again and again
/// (a busy client's limit key, which is what a lease or the over-limit
/// cache is for) costs a lookup instead of a digest. A client that sends
/// ever new keys only evicts entries: each request then costs one digest,
/// as before, and the table's memory is bounded whatever the keys.
pub fn recent_digest(key: &[u8]) -> [u8; 32] {
    if key.len() > RECENT_KEY_MAX {
        return Sha256::digest(key).into();
    }
    // FNV-1a: not a defence against chosen collisions, which only evict.
    let hash = key.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let at = (hash % RECENT as u64) as usize;
    RECENT_DIGESTS
        .try_with(|table| {
            let Ok(mut table) = table.try_borrow_mut() else {
                return Sha256::digest(key).into();
            };
            let entry = table.get_mut(at);
            match entry {
                Some(Some((k, digest))) if **k == *key => *digest,
                Some(slot) => {
                    let digest: [u8; 32] = Sha256::digest(key).into();
                    *slot = Some((key.into(), digest));
                    digest
                }
                None => Sha256::digest(key).into(),
            }
        })
        .unwrap_or_else(|_| Sha256::digest(key).into())
}

impl PartialEq for KeyDigest {
    fn eq(&self, _: &KeyDigest) -> bool {
        true
    }
}

impl Eq for KeyDigest {}

impl std::fmt::Debug for KeyDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyDigest")
    }
}

/// Reads the `i`th big-endian u64 of a fixed-layout record after its
/// 16-byte digest (the caller checked the length).
pub fn record_u64(bytes: &[u8], i: usize) -> u64 {
    let at = 16 + 8 * i;
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_be_bytes(b)
}

/// `key_infix` is the limit's precomputed `:<name>:<signature>:`.
pub fn rate_limit_key(prefix: &str, tag: &str, key_infix: &str, descriptor: &[u8]) -> Vec<u8> {
    let mut key =
        Vec::with_capacity(prefix.len() + tag.len() + key_infix.len() + descriptor.len() + 8);
    key.extend_from_slice(prefix.as_bytes());
    key.extend_from_slice(b":rl:{");
    key.extend_from_slice(tag.as_bytes());
    key.push(b'}');
    key.extend_from_slice(key_infix.as_bytes());
    key.extend_from_slice(descriptor);
    key
}

/// The block key of a blocking limit's state key: `:bl:` in place of its
/// `:rl:`, so it shares the state's hash tag (lua/decide.lua block_key()
/// derives it the same way; the prefix holds no brace, so the first `:rl:{`
/// is the one after it).
pub fn block_key(state_key: &[u8]) -> Vec<u8> {
    let at = state_key.windows(5).position(|w| w == b":rl:{");
    match at {
        Some(i) => [&state_key[..i], b":bl:{", &state_key[i + 5..]].concat(),
        None => [state_key, b":bl"].concat(),
    }
}

/// The suffix of a leased token bucket's give-back record: `<state key>:ret`
/// (lua/lease.lua creates it at a grant, lua/lease_return.lua reads and
/// writes it; same hash tag). It holds the count and peaks of tokens given
/// back since the grants still out: a reset must delete it with the bucket,
/// or tokens leased before the reset would be judged against it and come
/// back into the fresh bucket.
pub const GIVE_BACK_SUFFIX: &[u8] = b":ret";

/// The give-back record of the token bucket `state_key`
/// ([`GIVE_BACK_SUFFIX`]).
pub fn give_back_key(state_key: &[u8]) -> Vec<u8> {
    [state_key, GIVE_BACK_SUFFIX].concat()
}

/// Every key a limit's state lives in beside `state_key` itself, that a
/// reset must delete for the limit to be whole: a token bucket's hash of an
/// older filter ([`older_bucket_key`]). Not the give-back record
/// ([`give_back_key`]), which a reset restarts instead
/// ([`restarted_give_back_record`]); not a quota's window keys (which window
/// is current takes Redis' clock) nor a blocking limit's block
/// ([`block_key`]), which the CLI reports apart; not the override key, which
/// is configuration, not state.
pub fn state_keys_beside(state_key: &[u8]) -> Vec<Vec<u8>> {
    older_bucket_key(state_key).into_iter().collect()
}

/// How long a give-back record lives after its last grant (ms), as
/// lua/lease.lua sets it: longer than the longest lease (600 s).
pub const GIVE_BACK_RECORD_TTL_MS: u64 = 660_000;

/// The give-back record a reset leaves (lua/lease_return.lua's header):
/// count 0, the layout mark, started at `since_ms` (Redis' clock, the ms
/// after the reset's). Deleting the record is not enough: a grant in the
/// reset's very ms would start a new record that a tuple from before the
/// reset, of that same ms, could not be told from; one started after the
/// reset's ms refuses every tuple up to it.
pub fn restarted_give_back_record(since_ms: u64) -> Vec<u8> {
    [0.0f64, -2.0, since_ms as f64]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

/// The key of a quota's window that starts at `start_ms`: its state key
/// and `:<start>` (lua/quota.lua builds it the same way; same hash tag).
pub fn quota_window_key(state_key: &[u8], start_ms: i64) -> Vec<u8> {
    [state_key, format!(":{start_ms}").as_bytes()].concat()
}

/// Where `pat` first occurs in `key` at or after `from`.
fn find_from(key: &[u8], from: usize, pat: &[u8]) -> Option<usize> {
    key.get(from..)?
        .windows(pat.len())
        .position(|w| w == pat)
        .map(|i| i + from)
}

/// The override key of a limit's state key `<prefix>:rl:{<tag>}:<name>:
/// <signature>:<descriptor>`: `<prefix>:ov:{<tag>}:<name>:<descriptor>`,
/// without the signature, so an override outlives a change of the limit's
/// configured numbers (lua/decide.lua override_key() derives it the same
/// way). `None` for a key not in that layout.
pub fn override_key(state_key: &[u8]) -> Option<Vec<u8>> {
    let find = |from: usize, pat: &[u8]| find_from(state_key, from, pat);
    let s = find(0, b":rl:{")?;
    let t = find(s + 5, b"}:")?;
    let n = find(t + 2, b":")?;
    let g = find(n + 1, b":")?;
    Some(
        [
            &state_key[..s],
            b":ov:{",
            &state_key[s + 5..=n],
            &state_key[g + 1..],
        ]
        .concat(),
    )
}

/// The key under which a filter before the token bucket's one-string state
/// kept the bucket `state_key` as a hash: signature `tb.` for `tb2.`
/// (lua/token_bucket.lua tb_hash_key() derives it the same way; the scripts
/// read that hash for a bucket without its string during a rolling upgrade,
/// so a reset deletes it too). `None` for a key not in the layout or not a
/// token bucket's.
pub fn older_bucket_key(state_key: &[u8]) -> Option<Vec<u8>> {
    let find = |from: usize, pat: &[u8]| find_from(state_key, from, pat);
    let t = find(0, b"}:")?;
    let n = find(t + 2, b":")?;
    let signature = state_key.get(n + 1..)?;
    signature
        .starts_with(b"tb2.")
        .then(|| [&state_key[..=n], b"tb.", &signature[4..]].concat())
}

/// A token bucket's stored string (lua/token_bucket.lua): its credits and
/// the ms of its last update, two little-endian doubles. `None` for a
/// value of another length.
pub fn decode_bucket(state: &[u8]) -> Option<(f64, f64)> {
    let double = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(state.get(at..at + 8)?);
        Some(f64::from_le_bytes(b))
    };
    if state.len() != 16 {
        return None;
    }
    Some((double(0)?, double(8)?))
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_override_key_drops_the_signature_and_keeps_the_hash_tag() {
        let key = rate_limit_key("rg", "abc", ":per-key:tb.5.1.1000:", b"k:1");
        assert_eq!(
            override_key(&key).unwrap(),
            b"rg:ov:{abc}:per-key:k:1".to_vec()
        );
        assert_eq!(override_key(b"no-layout"), None);
    }

    #[test]
    fn an_older_bucket_key_swaps_the_signature_and_nothing_else() {
        let key = rate_limit_key("rg", "abc", ":per-key:tb2.5.1.1000:", b"3:tb2");
        assert_eq!(
            older_bucket_key(&key).unwrap(),
            b"rg:rl:{abc}:per-key:tb.5.1.1000:3:tb2".to_vec()
        );
        let window = rate_limit_key("rg", "abc", ":per-key:fw.5.1000:", b"3:tb2");
        assert_eq!(older_bucket_key(&window), None);
        assert_eq!(older_bucket_key(b"plain:tb2.5.1.1000"), None);
    }

    #[test]
    fn the_give_back_record_is_where_the_lease_scripts_keep_it() {
        let key = rate_limit_key("rg", "abc", ":per-key:tb2.5.1.1000:", b"1:a");
        assert_eq!(
            give_back_key(&key),
            b"rg:rl:{abc}:per-key:tb2.5.1.1000:1:a:ret".to_vec()
        );
        // lua/lease.lua and lua/lease_return.lua spell the suffix inline
        // (they are not joined with lua/keys.lua): they must spell this one.
        let suffix = format!("'{}'", String::from_utf8_lossy(GIVE_BACK_SUFFIX));
        for (name, source) in [
            ("lease.lua", include_str!("../lua/lease.lua")),
            ("lease_return.lua", include_str!("../lua/lease_return.lua")),
        ] {
            assert!(source.contains(&suffix), "{name} has no {suffix}");
        }
        assert_eq!(state_keys_beside(&key), [older_bucket_key(&key).unwrap()]);
        let window = rate_limit_key("rg", "abc", ":per-key:fw.5.1000:", b"1:a");
        assert!(state_keys_beside(&window).is_empty());
        // The restarted record is the layout both scripts read (count,
        // mark, start: three little-endian doubles) and lives as long.
        let lease = include_str!("../lua/lease.lua");
        let back = include_str!("../lua/lease_return.lua");
        for (name, source) in [("lease.lua", lease), ("lease_return.lua", back)] {
            assert!(source.contains("local LAYOUT = -2"), "{name}'s layout mark");
            assert!(source.contains("struct.pack('<ddd'"), "{name}'s head");
        }
        assert!(lease.contains(&format!("local RETURNED_TTL = {GIVE_BACK_RECORD_TTL_MS}")));
        let record = restarted_give_back_record(1_700_000_000_001);
        assert_eq!(record.len(), 24);
        assert_eq!(record[16..], 1_700_000_000_001f64.to_le_bytes());
    }

    #[test]
    fn a_bucket_decodes_from_its_sixteen_bytes_only() {
        let mut state = (-2500.0f64).to_le_bytes().to_vec();
        state.extend_from_slice(&1_733_350_000_000.0f64.to_le_bytes());
        assert_eq!(decode_bucket(&state), Some((-2500.0, 1_733_350_000_000.0)));
        assert_eq!(decode_bucket(&state[..15]), None);
        assert_eq!(decode_bucket(b""), None);
    }

    #[test]
    fn a_block_key_shares_its_state_keys_hash_tag() {
        let key = rate_limit_key("rg", "abc", ":login:fw.5.900000:", b"\x03ann:rl:{x}");
        let block = block_key(&key);
        assert!(block.starts_with(b"rg:bl:{abc}:login:fw.5.900000:"));
        assert!(block.ends_with(b"ann:rl:{x}"), "only the first `:rl:{{`");
    }

    use super::*;

    #[test]
    fn a_recent_digest_is_the_keys_own_whatever_the_table_holds() {
        // More keys than entries, each asked for three times in turns, and
        // keys that differ in one byte or in length only: every answer is
        // SHA-256 of the key asked for.
        let mut keys: Vec<Vec<u8>> = (0..3 * RECENT as u32)
            .map(|i| format!("rg:rl:{{t}}:a:tb:{i}").into_bytes())
            .collect();
        keys.push(b"".to_vec());
        keys.push(vec![b'x'; RECENT_KEY_MAX + 1]);
        keys.push(b"rg:rl:{t}:a:tb:1".to_vec());
        keys.push(b"rg:rl:{t}:a:tb:1\0".to_vec());
        for _ in 0..3 {
            for key in &keys {
                let want: [u8; 32] = Sha256::digest(key).into();
                assert_eq!(recent_digest(key), want, "{key:?}");
                assert_eq!(*KeyDigest::default().of(key), want);
            }
        }
    }

    #[test]
    fn length_prefixes_keep_distinct_descriptors_apart() {
        let mut a = Vec::new();
        push_value(&mut a, b"a:1");
        a.push(b':');
        push_value(&mut a, b"2");
        let mut b = Vec::new();
        push_value(&mut b, b"a");
        b.push(b':');
        push_value(&mut b, b"1:2");
        assert_ne!(a, b);
        assert_eq!(a, b"3:a:1:1:2");
    }

    #[test]
    fn long_values_are_replaced_by_their_digest() {
        let long = vec![b'x'; MAX_RAW_VALUE + 1];
        let mut out = Vec::new();
        push_value(&mut out, &long);
        assert_eq!(out.len(), 65);
        assert_eq!(out[0], b'#');
        let mut exact = Vec::new();
        push_value(&mut exact, &long[..MAX_RAW_VALUE]);
        assert_eq!(exact.len(), 4 + MAX_RAW_VALUE);
    }
}

/// The Redis Cluster slot of a hash tag (the text between `{` and `}` of
/// every key of one request): CRC16/XMODEM of it, modulo 16384, as Redis
/// computes it (`keyHashSlot`).
pub fn cluster_slot(tag: &[u8]) -> u16 {
    const CRC16: crc::Crc<u16> = crc::Crc::<u16>::new(&crc::CRC_16_XMODEM);
    CRC16.checksum(tag) & 0x3fff
}

/// The Redis Cluster slot of a whole key, by Redis' own rule: the text
/// between its first `{` and the first `}` after it when that is not empty,
/// else the whole key. It is the slot `redis_proxy` routes a script call by
/// (its first key), so a call's breaker is the master's that runs it.
pub fn key_slot(key: &[u8]) -> u16 {
    let tag = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = key.get(open + 1..)?;
        let close = rest.iter().position(|&b| b == b'}')?;
        rest.get(..close).filter(|t| !t.is_empty())
    });
    cluster_slot(tag.unwrap_or(key))
}

#[cfg(test)]
mod slot_tests {
    use super::{cluster_slot, key_slot};

    #[test]
    fn slots_are_the_ones_redis_cluster_computes() {
        // Redis' own examples (CLUSTER KEYSLOT).
        assert_eq!(cluster_slot(b"foo"), 12182);
        assert_eq!(cluster_slot(b"bar"), 5061);
        assert_eq!(cluster_slot(b"user1000"), 3443);
        assert_eq!(cluster_slot(b""), 0);
    }

    #[test]
    fn a_key_hashes_by_its_first_non_empty_tag_as_redis_does() {
        // The examples of Redis' cluster specification (hash tags).
        assert_eq!(key_slot(b"{user1000}.following"), cluster_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), cluster_slot(b"foo{}{bar}"));
        assert_eq!(key_slot(b"foo{{bar}}zap"), cluster_slot(b"{bar"));
        assert_eq!(key_slot(b"foo{bar}{zap}"), cluster_slot(b"bar"));
        assert_eq!(key_slot(b"rg:rl:{ab12}:w:x"), cluster_slot(b"ab12"));
        assert_eq!(key_slot(b"no-tag{"), cluster_slot(b"no-tag{"));
        assert_eq!(key_slot(b""), 0);
    }
}
