//! Token leases, the Envoy side: tokens one Envoy took from a bucket in Redis
//! (lua/lease.lua) and spends without calling Redis, shared by its workers
//! through shared data with compare-and-swap.
//!
//! One slot per bucket key (a fixed table, as for the over-limit cache:
//! shared data is never freed), holding the tokens left, when they lapse, and
//! whether a worker is fetching more. Only one worker fetches at a time; the
//! others decide their requests in Redis meanwhile (exact, just slower), so an
//! Envoy holds at most one batch per key: the bound on tokens it can strand.

use crate::keys::{record_u64, shared_slot, shared_slot_of};

/// Slots per Envoy (each 40 bytes of shared data).
pub const SLOTS: u32 = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct State {
    digest: [u8; 16],
    tokens: u64,
    /// Proxy clock, ms: leased tokens are void from here on.
    expires_ms: u64,
    /// Proxy clock, ms: a worker is fetching a lease until then.
    fetching_until_ms: u64,
}

impl State {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(40);
        out.extend_from_slice(&self.digest);
        out.extend_from_slice(&self.tokens.to_be_bytes());
        out.extend_from_slice(&self.expires_ms.to_be_bytes());
        out.extend_from_slice(&self.fetching_until_ms.to_be_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Option<State> {
        if bytes.len() != 40 {
            return None;
        }
        let mut digest = [0u8; 16];
        digest.copy_from_slice(&bytes[..16]);
        Some(State {
            digest,
            tokens: record_u64(bytes, 0),
            expires_ms: record_u64(bytes, 1),
            fetching_until_ms: record_u64(bytes, 2),
        })
    }
}

/// What a request on a leased limit does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Write these bytes (compare-and-swap): the request spent leased tokens.
    /// With `prefetch`, the write also claimed the fetch of that many more
    /// tokens, to be sent in the background (the batch ran low).
    Spend {
        bytes: Vec<u8>,
        prefetch: Option<u64>,
    },
    /// Write these bytes (compare-and-swap), then fetch `want` tokens from
    /// Redis with this request (nothing left to spend here).
    Fetch { bytes: Vec<u8>, want: u64 },
    /// Nothing to spend and another worker is fetching (or no claim was
    /// asked for): decide this request in Redis.
    Strict,
}

/// Below this many tokens a spending request starts the next fetch, so the
/// grant usually lands before the batch runs out.
pub fn low_water(batch: u64) -> u64 {
    batch.div_ceil(2)
}

/// A bucket key's lease slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub shared_key: String,
    digest: [u8; 16],
}

impl Slot {
    pub fn of(limit_key: &[u8]) -> Slot {
        let (shared_key, digest) = shared_slot("redis-guard/lease", SLOTS, limit_key);
        Slot { shared_key, digest }
    }

    /// [`Slot::of`] the key whose SHA-256 is `full`.
    pub fn of_digest(full: &[u8; 32]) -> Slot {
        let (shared_key, digest) = shared_slot_of("redis-guard/lease", SLOTS, full);
        Slot { shared_key, digest }
    }

    /// Whether the stored bytes are another key's live lease (tokens not yet
    /// lapsed, or a fetch out): a key whose slot is taken is decided in Redis
    /// rather than evict them (which would strand the other key's tokens and
    /// let its fetch land twice).
    fn taken_by_another(&self, stored: Option<&[u8]>, now_ms: u64) -> bool {
        stored.and_then(State::decode).is_some_and(|s| {
            s.digest != self.digest
                && ((now_ms < s.expires_ms && s.tokens > 0) || now_ms < s.fetching_until_ms)
        })
    }

    /// This key's state in the stored bytes (another key's, or none: empty).
    fn state(&self, stored: Option<&[u8]>) -> State {
        stored
            .and_then(State::decode)
            .filter(|s| s.digest == self.digest)
            .unwrap_or(State {
                digest: self.digest,
                tokens: 0,
                expires_ms: 0,
                fetching_until_ms: 0,
            })
    }

    /// Spend `cost` leased tokens (claiming a background fetch when the batch
    /// runs low), or (with `claim`) claim the fetch of a new batch by this
    /// request, or leave it to Redis. Every fetch asks for what tops the tokens
    /// held up to `batch`, so an Envoy never holds more than `batch`.
    /// `fetch_for_ms` bounds a claim: a fetch that never answers (its stream
    /// gone) frees the slot after it.
    pub fn step(
        &self,
        stored: Option<&[u8]>,
        cost: u64,
        now_ms: u64,
        fetch_for_ms: u64,
        batch: u64,
        claim: bool,
    ) -> Step {
        if self.taken_by_another(stored, now_ms) {
            return Step::Strict;
        }
        let mut s = self.state(stored);
        let usable = if now_ms < s.expires_ms { s.tokens } else { 0 };
        let fetching = now_ms < s.fetching_until_ms;
        if usable >= cost {
            let left = usable - cost;
            s.tokens = left;
            let mut prefetch = None;
            if left < low_water(batch) && !fetching {
                s.fetching_until_ms = now_ms.saturating_add(fetch_for_ms);
                prefetch = Some(batch - left);
            }
            return Step::Spend {
                bytes: s.encode(),
                prefetch,
            };
        }
        if fetching || !claim {
            return Step::Strict;
        }
        s.tokens = usable;
        s.fetching_until_ms = now_ms.saturating_add(fetch_for_ms);
        Step::Fetch {
            bytes: s.encode(),
            want: batch.saturating_sub(usable).max(1),
        }
    }

    /// The fetch answered: `granted` tokens usable until `expires_ms`, added
    /// to whatever is left of the current lease, never more than `batch`;
    /// the fetch claim ends. `None`: the slot went to another key meanwhile
    /// (this key's claim lapsed): the grant is dropped, not merged.
    pub fn granted(
        &self,
        stored: Option<&[u8]>,
        granted: u64,
        now_ms: u64,
        expires_ms: u64,
        batch: u64,
    ) -> Option<Vec<u8>> {
        if self.taken_by_another(stored, now_ms) {
            return None;
        }
        let mut s = self.state(stored);
        let left = if now_ms < s.expires_ms { s.tokens } else { 0 };
        s.tokens = left.saturating_add(granted).min(batch);
        s.expires_ms = expires_ms;
        s.fetching_until_ms = 0;
        Some(s.encode())
    }

    /// The fetch failed: release the claim so another worker may try
    /// (`None`: the slot is not this key's any more).
    pub fn fetch_failed(&self, stored: Option<&[u8]>) -> Option<Vec<u8>> {
        let s = stored.and_then(State::decode)?;
        if s.digest != self.digest {
            return None;
        }
        let mut s = s;
        s.fetching_until_ms = 0;
        Some(s.encode())
    }

    /// Tokens usable now (for tests and stats).
    pub fn tokens(&self, stored: Option<&[u8]>, now_ms: u64) -> u64 {
        let s = self.state(stored);
        if now_ms < s.expires_ms {
            s.tokens
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(step: Step) -> Vec<u8> {
        match step {
            Step::Spend { bytes, .. } | Step::Fetch { bytes, .. } => bytes,
            Step::Strict => panic!("expected a write"),
        }
    }

    #[test]
    fn an_empty_slot_claims_the_fetch_and_others_go_strict_meanwhile() {
        let slot = Slot::of(b"bucket");
        let claimed = slot.step(None, 1, 1_000, 50, 8, true);
        assert!(matches!(claimed, Step::Fetch { want: 8, .. }));
        let claimed = bytes(claimed);
        assert_eq!(slot.step(None, 1, 1_000, 50, 8, false), Step::Strict);
        assert_eq!(
            slot.step(Some(&claimed), 1, 1_020, 50, 8, true),
            Step::Strict
        );
        // A claim nobody answers lapses.
        assert!(matches!(
            slot.step(Some(&claimed), 1, 1_050, 50, 8, true),
            Step::Fetch { .. }
        ));
        let freed = slot.fetch_failed(Some(&claimed)).unwrap();
        assert!(matches!(
            slot.step(Some(&freed), 1, 1_020, 50, 8, true),
            Step::Fetch { .. }
        ));
    }

    #[test]
    fn granted_tokens_are_spent_exactly_once_and_lapse() {
        let slot = Slot::of(b"bucket");
        let mut stored = slot.granted(None, 3, 0, 100, 3).unwrap();
        let mut spent = 0;
        while let Step::Spend { bytes, .. } = slot.step(Some(&stored), 1, 10, 50, 3, false) {
            stored = bytes;
            spent += 1;
        }
        assert_eq!(spent, 3, "exactly the grant");
        assert_eq!(slot.tokens(Some(&stored), 10), 0);
        let stored = slot.granted(Some(&stored), 5, 20, 100, 5).unwrap();
        assert!(
            matches!(
                slot.step(Some(&stored), 6, 30, 50, 5, true),
                Step::Fetch { want: 1, .. }
            ),
            "cost above what is held: fetch what tops it up to the batch"
        );
        assert!(matches!(
            slot.step(Some(&stored), 5, 30, 50, 5, false),
            Step::Spend { .. }
        ));
        assert_eq!(slot.tokens(Some(&stored), 100), 0, "lapsed at expiry");
        assert!(matches!(
            slot.step(Some(&stored), 1, 100, 50, 5, true),
            Step::Fetch { want: 5, .. }
        ));
    }

    #[test]
    fn a_batch_running_low_starts_the_next_fetch_once_and_never_holds_more() {
        let slot = Slot::of(b"bucket");
        // Batch of 8: the low-water mark is 4.
        let mut stored = slot.granted(None, 8, 0, 1_000, 8).unwrap();
        let mut prefetches = Vec::new();
        for _ in 0..8 {
            match slot.step(Some(&stored), 1, 10, 50, 8, true) {
                Step::Spend { bytes, prefetch } => {
                    stored = bytes;
                    prefetches.extend(prefetch);
                }
                other => panic!("{other:?}"),
            }
        }
        // One claim, at 3 left, for the 5 that top it up to 8.
        assert_eq!(prefetches, vec![5]);
        // While it is out, an empty slot sends requests to Redis.
        assert_eq!(slot.step(Some(&stored), 1, 20, 50, 8, true), Step::Strict);
        let stored = slot.granted(Some(&stored), 5, 30, 1_000, 8).unwrap();
        assert_eq!(slot.tokens(Some(&stored), 30), 5);
    }

    #[test]
    fn a_key_whose_slot_holds_another_live_lease_goes_to_redis_and_evicts_nothing() {
        let a = Slot::of(b"a");
        let stored = a.granted(None, 10, 0, 1_000, 10).unwrap();
        let b = Slot {
            shared_key: a.shared_key.clone(),
            digest: [9; 16],
        };
        assert_eq!(b.step(Some(&stored), 1, 10, 50, 10, true), Step::Strict);
        assert_eq!(b.tokens(Some(&stored), 10), 0);
        assert_eq!(b.granted(Some(&stored), 5, 10, 1_000, 10), None, "no merge");
        assert_eq!(b.fetch_failed(Some(&stored)), None);
        assert_eq!(a.tokens(Some(&stored), 10), 10, "a's lease intact");
        // Once a's lease lapsed, b may take the slot.
        assert!(matches!(
            b.step(Some(&stored), 1, 1_000, 50, 10, true),
            Step::Fetch { .. }
        ));
    }

    #[test]
    fn a_grant_never_lifts_an_envoy_above_one_batch() {
        let slot = Slot::of(b"a");
        let stored = slot.granted(None, 6, 0, 1_000, 8).unwrap();
        let stored = slot.granted(Some(&stored), 6, 1, 1_000, 8).unwrap();
        assert_eq!(slot.tokens(Some(&stored), 2), 8);
    }
}
