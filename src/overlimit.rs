//! The over-limit cache: when Redis rejects a request because limit key K has
//! no room for cost C until T, no request of cost >= C on K can be admitted
//! before T (capacity only returns with time; other admissions only take it).
//! So every worker of the Envoy may answer such requests 429 locally until T
//! without calling Redis, and answer exactly what Redis would have.
//!
//! T is held on the proxy's clock as `sent + retry`: the moment the call left
//! the proxy plus the wait Redis computed. Redis evaluated the call after it
//! was sent, so this is never later than the real T: the cache may stop a
//! little early (one trip), never late.
//!
//! Entries live in Envoy's shared data, which has no expiry or deletion, so
//! the space is a fixed table of [`SLOTS`] entries indexed by the key's
//! digest: a key under attack keeps its slot, a collision only evicts an
//! entry (the next request asks Redis), and the memory is bounded whatever
//! keys clients invent. Each entry carries the key's digest, so a collision
//! never answers for another key.

use crate::keys::{record_u64, shared_slot, shared_slot_of};

/// Entries per Envoy (each 48 bytes of shared data).
pub const SLOTS: u32 = 4096;

/// The longest an entry answers for Redis. Redis' answer holds until T only
/// while Redis keeps the key's state: a flush, a failover to a replica that
/// lagged, or a restart can free the budget early. Re-asking once a second
/// bounds that error and still leaves a key under attack at about one call
/// per second per Envoy. It also bounds the damage of the proxy's wall clock
/// stepping back (an entry that claims more than this is ignored).
pub const HOLD_MAX_MS: u64 = 1000;

/// What the cache knows about one limit key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    digest: [u8; 16],
    /// Proxy clock, ms: the cache answers for Redis until then (at most
    /// [`HOLD_MAX_MS`] after the call left).
    pub until_ms: u64,
    /// Proxy clock, ms: no request of `cost` or more fits before this
    /// (sent + Redis' retry): what a cached 429's `Retry-After` says. It may
    /// lie hours past `until_ms` (a block, a spent daily budget), and the
    /// answer must not shrink to the hold's second.
    pub retry_at_ms: u64,
    pub cost: u64,
    /// Units left when Redis rejected (a lower bound until `until_ms`).
    pub remaining: u64,
}

/// Where a limit key's entry lives: its shared-data key and digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub shared_key: String,
    digest: [u8; 16],
}

impl Slot {
    pub fn of(limit_key: &[u8]) -> Slot {
        let (shared_key, digest) = shared_slot("redis-guard/over", SLOTS, limit_key);
        Slot { shared_key, digest }
    }

    /// [`Slot::of`] the key whose SHA-256 is `full`.
    pub fn of_digest(full: &[u8; 32]) -> Slot {
        let (shared_key, digest) = shared_slot_of("redis-guard/over", SLOTS, full);
        Slot { shared_key, digest }
    }

    /// The entry for a rejection of `cost` whose call left at `sent_ms`, Redis
    /// saying `retry_ms`. Redis reads its clock in whole milliseconds
    /// (rounded down), so room may come back up to 1 ms before sent + retry:
    /// the entry ends 1 ms earlier, and at most [`HOLD_MAX_MS`] after sending.
    pub fn entry(&self, sent_ms: u64, retry_ms: u64, cost: u64, remaining: u64) -> Entry {
        Entry {
            digest: self.digest,
            until_ms: sent_ms.saturating_add(retry_ms.saturating_sub(1).min(HOLD_MAX_MS)),
            retry_at_ms: sent_ms.saturating_add(retry_ms),
            cost,
            remaining,
        }
    }

    /// The wait (ms) before a request of `cost` on this key could fit, as
    /// Redis said it, if the stored bytes say it cannot fit now and the cache
    /// still answers for Redis; `None` when Redis must decide.
    pub fn rejects(&self, stored: Option<&[u8]>, cost: u64, now_ms: u64) -> Option<(u64, u64)> {
        let entry = Entry::decode(stored?)?;
        let hold = entry.until_ms.checked_sub(now_ms).filter(|w| *w > 0)?;
        // More than an entry can hold: the clock stepped back; ignore it.
        (entry.digest == self.digest && cost >= entry.cost && hold <= HOLD_MAX_MS).then(|| {
            (
                entry.retry_at_ms.saturating_sub(now_ms).max(hold),
                entry.remaining,
            )
        })
    }
}

impl Entry {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(48);
        out.extend_from_slice(&self.digest);
        out.extend_from_slice(&self.until_ms.to_be_bytes());
        out.extend_from_slice(&self.cost.to_be_bytes());
        out.extend_from_slice(&self.remaining.to_be_bytes());
        out.extend_from_slice(&self.retry_at_ms.to_be_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Option<Entry> {
        // An older filter's 40-byte entry (shared data outlives a VM's
        // reload) is no entry: Redis decides.
        if bytes.len() != 48 {
            return None;
        }
        let mut digest = [0u8; 16];
        digest.copy_from_slice(&bytes[..16]);
        Some(Entry {
            digest,
            until_ms: record_u64(bytes, 0),
            cost: record_u64(bytes, 1),
            remaining: record_u64(bytes, 2),
            retry_at_ms: record_u64(bytes, 3),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_only_its_own_key_at_or_above_the_cost_before_the_deadline() {
        let slot = Slot::of(b"rg:rl:{t}:a:tb.1.1.1000:1:x");
        // Sent at 0, Redis said 1001 ms: held until 1000 (1 ms of rounding),
        // the wait counted to Redis' 1001.
        let stored = slot.entry(0, 1_001, 2, 0).encode();
        assert_eq!(slot.rejects(Some(&stored), 2, 400), Some((601, 0)));
        assert_eq!(slot.rejects(Some(&stored), 5, 999), Some((2, 0)));
        assert_eq!(slot.rejects(Some(&stored), 2, 1_000), None, "not at T");
        assert_eq!(
            slot.rejects(Some(&stored), 1, 400),
            None,
            "a cheaper request may fit"
        );
        assert_eq!(slot.rejects(None, 2, 400), None);
        assert_eq!(slot.rejects(Some(b"short"), 2, 400), None);
        // Another key in the same slot never answers for this one.
        let other = Slot {
            shared_key: slot.shared_key.clone(),
            digest: [7; 16],
        };
        assert_eq!(other.rejects(Some(&stored), 2, 400), None);
    }

    #[test]
    fn an_entry_holds_at_most_a_second_and_distrusts_a_clock_that_went_back() {
        let slot = Slot::of(b"k");
        // Redis said an hour: held one second, answering the hour's rest.
        let stored = slot.entry(5_000, 3_600_000, 1, 0).encode();
        assert_eq!(slot.rejects(Some(&stored), 1, 5_999), Some((3_599_001, 0)));
        assert_eq!(slot.rejects(Some(&stored), 1, 6_000), None);
        // The clock jumped back 10 s: the entry would claim 11 s: ignored.
        assert_eq!(slot.rejects(Some(&stored), 1, 0), None);
    }

    #[test]
    fn entries_round_trip_and_slots_stay_in_the_table() {
        let slot = Slot::of(b"k");
        let e = slot.entry(u64::MAX - 10, 3, 3, 9);
        assert_eq!(Entry::decode(&e.encode()), Some(e));
        for i in 0..1000u32 {
            let s = Slot::of(&i.to_be_bytes());
            let index: u32 = s
                .shared_key
                .trim_start_matches("redis-guard/over/")
                .parse()
                .unwrap();
            assert!(index < SLOTS);
        }
    }
}
