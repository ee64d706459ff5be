//! Token leases, the Envoy side: tokens one Envoy took from a bucket in Redis
//! (lua/lease.lua) and spends without calling Redis, shared by its workers
//! through shared data with compare-and-swap.
//!
//! One slot per bucket key (a fixed table, as for the over-limit cache:
//! shared data is never freed), holding the tokens left, when they lapse, and
//! whether a worker is fetching more. Only one worker fetches at a time; the
//! others decide their requests in Redis meanwhile (exact, just slower), so an
//! Envoy holds at most one batch per key: the bound on tokens it can strand.
//!
//! Unspent tokens go back to Redis (lua/lease_return.lua) when the lease
//! is about to end or the key's traffic stopped: taken out of the slot with
//! the same compare-and-swap the spends use, so a token is spent or given
//! back, never both. Each goes back under the tuple Redis replied with a
//! grant, which bounds what Redis may take back (the script's header has
//! the proof). A tuple covers its own grant's tokens and those of later
//! grants, never an earlier grant's (over-admission: an earlier grant's
//! tokens may have been out while the bucket refilled to the cap, which
//! the later tuple's bound does not see). And Redis takes nothing back
//! under a tuple older than the longest lease (600 s). So the slot keeps
//! two: the newest grant's, for the tokens it brought, and an older one for
//! the tokens held from before it, which are spent first. A slot that
//! never empties thus gives back under its last two grants' tuples, not its
//! first one's; only grants so small that the older tokens outlast the next
//! grant keep the older tuple longer (those tokens may then come back to
//! nothing: under-admission only).

use crate::codec::decimal;
use crate::keys::{record_u64, shared_slot, shared_slot_of};

/// Slots per Envoy (each 104 bytes of shared data).
pub const SLOTS: u32 = 4096;

/// Bytes of a slot's record.
const RECORD: usize = 104;

/// No spend on a key for this long (ms) and its Envoy gives the tokens
/// back: well above the gaps of steady traffic (a request a second per
/// Envoy and key keeps its lease; a tenth of that would send tokens back
/// and fetch them again between bursts), short beside the leases worth
/// having (minutes), so tokens an Envoy stopped spending are back in Redis
/// about a second later.
pub const IDLE_MS: u64 = 1_000;

/// A lease this close to its end (ms, at most a quarter of its TTL) gives
/// its tokens back rather than let them lapse.
pub const ENDING_MS: u64 = 50;

/// What lua/lease.lua replied with a grant, for giving its tokens back:
/// Redis' clock (ms), the bucket's level after the grant (credits) and the
/// bucket's give-back counter then.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tuple {
    pub at_ms: u64,
    pub level: u64,
    pub returned: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct State {
    digest: [u8; 16],
    tokens: u64,
    /// Proxy clock, ms: leased tokens are void from here on.
    expires_ms: u64,
    /// Proxy clock, ms: a worker is fetching a lease until then.
    fetching_until_ms: u64,
    /// Proxy clock, ms: the last spend (or grant) of this key.
    active_ms: u64,
    /// Of `tokens`, those the newest grant brought (the rest are older, and
    /// spent first).
    newest_tokens: u64,
    /// The newest grant's tuple.
    newest: Tuple,
    /// The tuple of the oldest grant whose tokens are among the older ones.
    older: Tuple,
}

impl State {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(RECORD);
        out.extend_from_slice(&self.digest);
        for v in [
            self.tokens,
            self.expires_ms,
            self.fetching_until_ms,
            self.active_ms,
            self.newest_tokens,
            self.newest.at_ms,
            self.newest.level,
            self.newest.returned,
            self.older.at_ms,
            self.older.level,
            self.older.returned,
        ] {
            out.extend_from_slice(&v.to_be_bytes());
        }
        out
    }

    /// Holds `tokens` now: the spends and lapses in between took the older
    /// ones first.
    fn hold(&mut self, tokens: u64) {
        self.tokens = tokens;
        self.newest_tokens = self.newest_tokens.min(tokens);
    }

    /// A record of another length (an older filter's 40 or 72 bytes) is
    /// no record: its tokens are dropped (under-admission only).
    fn decode(bytes: &[u8]) -> Option<State> {
        if bytes.len() != RECORD {
            return None;
        }
        let mut digest = [0u8; 16];
        digest.copy_from_slice(&bytes[..16]);
        Some(State {
            digest,
            tokens: record_u64(bytes, 0),
            expires_ms: record_u64(bytes, 1),
            fetching_until_ms: record_u64(bytes, 2),
            active_ms: record_u64(bytes, 3),
            newest_tokens: record_u64(bytes, 4),
            newest: Tuple {
                at_ms: record_u64(bytes, 5),
                level: record_u64(bytes, 6),
                returned: record_u64(bytes, 7),
            },
            older: Tuple {
                at_ms: record_u64(bytes, 8),
                level: record_u64(bytes, 9),
                returned: record_u64(bytes, 10),
            },
        })
    }
}

/// Tokens taken out of a slot to go back to Redis, with the tuple that
/// bounds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Back {
    pub tokens: u64,
    pub tuple: Tuple,
}

impl Back {
    /// lua/lease_return.lua's seven ARGV values for this give-back to a
    /// bucket of `capacity`, `refill` per `period_ms`.
    pub fn args(&self, capacity: u64, refill: u64, period_ms: u64) -> [Vec<u8>; 7] {
        [
            capacity,
            refill,
            period_ms,
            self.tokens,
            self.tuple.at_ms,
            self.tuple.level,
            self.tuple.returned,
        ]
        .map(decimal)
    }
}

/// The hash tag of a rate-limit key (`...{<tag>}...`): give-backs of one
/// tag go in one call, which Redis Cluster routes to one slot. A key
/// without one: the empty tag.
pub fn tag_of(limit_key: &[u8]) -> String {
    let Some(open) = limit_key.iter().position(|b| *b == b'{') else {
        return String::new();
    };
    let rest = &limit_key[open + 1..];
    rest.iter()
        .position(|b| *b == b'}')
        .map(|close| String::from_utf8_lossy(&rest[..close]).into_owned())
        .unwrap_or_default()
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
                active_ms: 0,
                newest_tokens: 0,
                newest: Tuple::default(),
                older: Tuple::default(),
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
            s.hold(left);
            s.active_ms = now_ms;
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
        s.hold(usable);
        s.fetching_until_ms = now_ms.saturating_add(fetch_for_ms);
        Step::Fetch {
            bytes: s.encode(),
            want: batch.saturating_sub(usable).max(1),
        }
    }

    /// The fetch answered: `granted` tokens usable until `expires_ms`, added
    /// to whatever is left of the current lease, never more than `batch`;
    /// the fetch claim ends. The grant's tuple becomes the newest, for the
    /// tokens it brought; the tokens held before become the older ones,
    /// under the tuple of the oldest grant among them (the older tuple while
    /// some of its tokens are left, else the newest before this grant).
    /// `None`: the slot went to another key meanwhile (this key's claim
    /// lapsed): the grant is dropped, not merged.
    pub fn granted(
        &self,
        stored: Option<&[u8]>,
        granted: u64,
        tuple: Tuple,
        now_ms: u64,
        expires_ms: u64,
        batch: u64,
    ) -> Option<Vec<u8>> {
        if self.taken_by_another(stored, now_ms) {
            return None;
        }
        let mut s = self.state(stored);
        s.hold(if now_ms < s.expires_ms { s.tokens } else { 0 });
        let left = s.tokens;
        let held = left.saturating_add(granted).min(batch);
        // A grant none of whose tokens fit leaves the tuples as they were.
        let brought = held.saturating_sub(left);
        if brought > 0 {
            if s.newest_tokens == left {
                s.older = s.newest;
            }
            s.newest = tuple;
            s.newest_tokens = brought;
        }
        s.hold(held);
        s.expires_ms = expires_ms;
        s.fetching_until_ms = 0;
        s.active_ms = now_ms;
        Some(s.encode())
    }

    /// Takes every unspent token out of this key's slot to give back, when
    /// the lease ends within `ending_ms` or nothing was spent for
    /// `idle_ms`: the record to write (compare-and-swap) and what goes
    /// back, one give-back per tuple (at most two), the newest grant's
    /// first: the older one's bound does not count it (its grant came
    /// later), where the newest's bound would count the older one's.
    /// `Err(true)`: tokens held, not yet to give back; `Err(false)`: none
    /// held (spent, lapsed, or the slot is another key's): the worker may
    /// forget the slot.
    pub fn take_all_back(
        &self,
        stored: Option<&[u8]>,
        now_ms: u64,
        idle_ms: u64,
        ending_ms: u64,
    ) -> Result<(Vec<u8>, Vec<Back>), bool> {
        let s = stored
            .and_then(State::decode)
            .filter(|s| s.digest == self.digest);
        let Some(mut s) = s else {
            return Err(false);
        };
        if now_ms >= s.expires_ms || s.tokens == 0 {
            return Err(false);
        }
        let idle = now_ms.saturating_sub(s.active_ms) >= idle_ms;
        let ending = s.expires_ms.saturating_sub(now_ms) <= ending_ms;
        if !idle && !ending {
            return Err(true);
        }
        let older = s.tokens.saturating_sub(s.newest_tokens);
        let backs = [(s.newest_tokens, s.newest), (older, s.older)]
            .into_iter()
            .filter(|(tokens, _)| *tokens > 0)
            .map(|(tokens, tuple)| Back { tokens, tuple })
            .collect();
        s.hold(0);
        Ok((s.encode(), backs))
    }

    /// [`Slot::take_all_back`] for a caller that sends one give-back: every
    /// unspent token comes out, the newest grant's go back, and the older
    /// ones, if any, are dropped (under-admission only). The filter sends
    /// both.
    pub fn take_back(
        &self,
        stored: Option<&[u8]>,
        now_ms: u64,
        idle_ms: u64,
        ending_ms: u64,
    ) -> Result<(Vec<u8>, Back), bool> {
        let (bytes, backs) = self.take_all_back(stored, now_ms, idle_ms, ending_ms)?;
        let first = backs.first().copied().unwrap_or(Back {
            tokens: 0,
            tuple: Tuple::default(),
        });
        Ok((bytes, first))
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

    /// A grant's tuple, when the test does not look at it.
    const T: Tuple = Tuple {
        at_ms: 1,
        level: 2,
        returned: 3,
    };

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
        let mut stored = slot.granted(None, 3, T, 0, 100, 3).unwrap();
        let mut spent = 0;
        while let Step::Spend { bytes, .. } = slot.step(Some(&stored), 1, 10, 50, 3, false) {
            stored = bytes;
            spent += 1;
        }
        assert_eq!(spent, 3, "exactly the grant");
        assert_eq!(slot.tokens(Some(&stored), 10), 0);
        let stored = slot.granted(Some(&stored), 5, T, 20, 100, 5).unwrap();
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
        let mut stored = slot.granted(None, 8, T, 0, 1_000, 8).unwrap();
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
        let stored = slot.granted(Some(&stored), 5, T, 30, 1_000, 8).unwrap();
        assert_eq!(slot.tokens(Some(&stored), 30), 5);
    }

    #[test]
    fn a_key_whose_slot_holds_another_live_lease_goes_to_redis_and_evicts_nothing() {
        let a = Slot::of(b"a");
        let stored = a.granted(None, 10, T, 0, 1_000, 10).unwrap();
        let b = Slot {
            shared_key: a.shared_key.clone(),
            digest: [9; 16],
        };
        assert_eq!(b.step(Some(&stored), 1, 10, 50, 10, true), Step::Strict);
        assert_eq!(b.tokens(Some(&stored), 10), 0);
        assert_eq!(
            b.granted(Some(&stored), 5, T, 10, 1_000, 10),
            None,
            "no merge"
        );
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
        let stored = slot.granted(None, 6, T, 0, 1_000, 8).unwrap();
        let stored = slot.granted(Some(&stored), 6, T, 1, 1_000, 8).unwrap();
        assert_eq!(slot.tokens(Some(&stored), 2), 8);
    }

    fn tuple(at_ms: u64) -> Tuple {
        Tuple {
            at_ms,
            level: 40_000,
            returned: 7,
        }
    }

    #[test]
    fn each_grants_tokens_go_back_under_its_tuple_and_older_ones_under_the_oldest() {
        let slot = Slot::of(b"a");
        let back = |tokens, at| Back {
            tokens,
            tuple: tuple(at),
        };
        let all_back = |stored: &[u8], now| {
            slot.take_all_back(Some(stored), now + IDLE_MS, IDLE_MS, ENDING_MS)
                .map(|(_, backs)| backs)
        };
        // 4, then 3 more while the 4 are held: each under its own tuple,
        // the newest first.
        let stored = slot.granted(None, 4, tuple(100), 0, 10_000, 8).unwrap();
        let stored = slot
            .granted(Some(&stored), 3, tuple(200), 5, 10_000, 8)
            .unwrap();
        assert_eq!(all_back(&stored, 5), Ok(vec![back(3, 200), back(4, 100)]));
        // A third grant while both are held: the older tuple covers the
        // second grant's tokens too (a tuple covers later grants, never
        // earlier ones). Spends take the older tokens first.
        let stored = bytes(slot.step(Some(&stored), 3, 6, 50, 8, false));
        let stored = slot
            .granted(Some(&stored), 2, tuple(300), 7, 10_000, 8)
            .unwrap();
        assert_eq!(all_back(&stored, 7), Ok(vec![back(2, 300), back(4, 100)]));
        // Spent down into the newest grant's tokens: the older ones are
        // gone, and the next grant's older tuple is that newest one.
        let stored = bytes(slot.step(Some(&stored), 5, 8, 50, 8, false));
        assert_eq!(all_back(&stored, 8), Ok(vec![back(1, 300)]));
        let stored = slot
            .granted(Some(&stored), 6, tuple(400), 9, 10_000, 8)
            .unwrap();
        assert_eq!(all_back(&stored, 9), Ok(vec![back(6, 400), back(1, 300)]));
        // A grant none of whose tokens fit (the slot holds a batch) leaves
        // the tuples as they were.
        let stored = slot
            .granted(Some(&stored), 5, tuple(500), 10, 10_000, 7)
            .unwrap();
        assert_eq!(all_back(&stored, 10), Ok(vec![back(6, 400), back(1, 300)]));
        // Spent to 0, then granted again: the new grant's tuple alone.
        let mut stored = stored;
        for _ in 0..7 {
            stored = bytes(slot.step(Some(&stored), 1, 11, 50, 100, false));
        }
        let stored = slot
            .granted(Some(&stored), 2, tuple(600), 20, 10_000, 8)
            .unwrap();
        assert_eq!(all_back(&stored, 20), Ok(vec![back(2, 600)]));
        // Lapsed tokens count as none: the next grant's tuple alone too.
        let stored = slot.granted(None, 2, tuple(700), 0, 100, 8).unwrap();
        let stored = slot
            .granted(Some(&stored), 2, tuple(800), 100, 10_000, 8)
            .unwrap();
        assert_eq!(all_back(&stored, 100), Ok(vec![back(2, 800)]));
        // Nothing held, or not yet due: as take_back.
        assert_eq!(
            all_back(&bytes(slot.step(Some(&stored), 2, 100, 50, 8, false)), 100),
            Err(false)
        );
        assert_eq!(
            slot.take_all_back(Some(&stored), 101, IDLE_MS, ENDING_MS),
            Err(true)
        );
    }

    #[test]
    fn a_slot_that_never_empties_gives_back_under_its_last_two_grants_tuples() {
        // 20 minutes of traffic: every minute 5 spent and 5 more granted,
        // the slot never empty. Redis takes nothing back under a tuple
        // older than 600 s.
        const MINUTE: u64 = 60_000;
        let slot = Slot::of(b"a");
        let mut stored = slot.granted(None, 8, tuple(0), 0, 11 * MINUTE, 8).unwrap();
        for m in 1..=20 {
            for _ in 0..5 {
                stored = bytes(slot.step(Some(&stored), 1, m * MINUTE - 1, 50, 8, false));
            }
            let (at, until) = (m * MINUTE, (m + 10) * MINUTE);
            stored = slot
                .granted(Some(&stored), 5, tuple(at), at, until, 8)
                .unwrap();
        }
        let before = stored.clone();
        // Idle: the last grant's 5 under its tuple, then the 3 left of the
        // one before under that one's.
        let at = 20 * MINUTE + IDLE_MS;
        let (stored, backs) = slot
            .take_all_back(Some(&stored), at, IDLE_MS, ENDING_MS)
            .unwrap();
        let back = |tokens, at| Back {
            tokens,
            tuple: tuple(at),
        };
        assert_eq!(backs, [back(5, 20 * MINUTE), back(3, 19 * MINUTE)]);
        assert_eq!(slot.tokens(Some(&stored), at), 0, "every token out");
        // A caller that sends one give-back: the newest grant's, the older
        // tokens dropped.
        assert_eq!(
            slot.take_back(Some(&before), at, IDLE_MS, ENDING_MS),
            Ok((stored, back(5, 20 * MINUTE)))
        );
    }

    #[test]
    fn tokens_go_back_once_idle_or_ending_and_are_then_neither_spent_nor_given_again() {
        let slot = Slot::of(b"a");
        let stored = slot.granted(None, 5, T, 0, 10_000, 8).unwrap();
        let stored = bytes(slot.step(Some(&stored), 1, 40, 50, 8, false));
        // Spent at 40: not idle until 40 + IDLE_MS.
        assert_eq!(
            slot.take_back(Some(&stored), 40 + IDLE_MS - 1, IDLE_MS, ENDING_MS),
            Err(true)
        );
        let (taken, back) = slot
            .take_back(Some(&stored), 40 + IDLE_MS, IDLE_MS, ENDING_MS)
            .unwrap();
        assert_eq!(back.tokens, 4);
        assert_eq!(slot.tokens(Some(&taken), 200), 0, "none left to spend");
        assert_eq!(slot.step(Some(&taken), 1, 200, 50, 8, false), Step::Strict);
        assert_eq!(
            slot.take_back(Some(&taken), 300, IDLE_MS, ENDING_MS),
            Err(false)
        );
        // Busy but ending: given back before it lapses.
        let stored = slot.granted(None, 5, T, 0, 1_000, 8).unwrap();
        let stored = bytes(slot.step(Some(&stored), 1, 940, 50, 8, false));
        assert_eq!(
            slot.take_back(Some(&stored), 949, IDLE_MS, ENDING_MS),
            Err(true)
        );
        assert_eq!(
            slot.take_back(Some(&stored), 950, IDLE_MS, ENDING_MS)
                .map(|(_, b)| b.tokens),
            Ok(4)
        );
        // Lapsed: nothing (Redis would refuse nothing, but the Envoy no
        // longer counts them as held).
        assert_eq!(
            slot.take_back(Some(&stored), 1_000, IDLE_MS, ENDING_MS),
            Err(false)
        );
        // Another key's record, or none: nothing, and forget it.
        let other = Slot::of(b"b").granted(None, 5, T, 0, 1_000, 8).unwrap();
        assert_eq!(
            slot.take_back(Some(&other), 500, IDLE_MS, ENDING_MS),
            Err(false)
        );
        assert_eq!(slot.take_back(None, 500, IDLE_MS, ENDING_MS), Err(false));
    }

    #[test]
    fn an_older_filters_record_is_no_record() {
        let slot = Slot::of(b"a");
        let mut old = slot.granted(None, 5, T, 0, 1_000, 8).unwrap();
        old.truncate(40);
        assert_eq!(slot.tokens(Some(&old), 10), 0);
        assert_eq!(
            slot.take_back(Some(&old), 500, IDLE_MS, ENDING_MS),
            Err(false)
        );
    }

    #[test]
    fn a_give_back_names_the_bucket_and_the_tuple_in_the_scripts_order() {
        let back = Back {
            tokens: 3,
            tuple: Tuple {
                at_ms: 1_764_900_000_123,
                level: 31_000,
                returned: 9,
            },
        };
        let args: Vec<String> = back
            .args(40, 1, 1000)
            .iter()
            .map(|a| String::from_utf8(a.clone()).unwrap())
            .collect();
        assert_eq!(
            args,
            ["40", "1", "1000", "3", "1764900000123", "31000", "9"]
        );
        assert_eq!(tag_of(b"rg:rl:{0123abcd}:a:tb2.1:x"), "0123abcd");
        assert_eq!(tag_of(b"rg:rl:{}:a"), "");
        assert_eq!(tag_of(b"no-tag"), "");
        assert_eq!(tag_of(b"rg:{open"), "");
    }
}
