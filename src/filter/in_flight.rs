//! A worker's calls in flight: when each was sent (the latency histogram)
//! and the nonce its reply must give back first (the book, Running it: When
//! things fail: Webdis may write another connection's late reply to this one). A stream
//! that ends cancels its call and no reply removes the entries: the tables
//! are swept, not trusted to empty themselves.

use std::collections::HashMap;
use std::time::Duration;

/// Entries either table holds before stale ones are swept.
const SWEEP_AT: usize = 4096;

/// No call outlives the longest timeout the config allows.
const LONGEST_CALL: Duration = Duration::from_secs(120);

/// How long past its timeout a call's nonce is kept: Envoy answers a call
/// that timed out at its timeout, give or take its timers' coarseness.
pub const NONCE_GRACE: Duration = Duration::from_secs(1);

/// Hashes a callout token: a number the host hands out, never a client's,
/// so a multiplicative hash will do where SipHash (the default, built
/// against chosen keys) cost each call four hashings (envoy/cost_gate).
#[derive(Debug, Default, Clone, Copy)]
pub struct TokenHasher(u64);

impl std::hash::Hasher for TokenHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn write_u32(&mut self, n: u32) {
        // Fibonacci hashing: the table reads the product's high bits too.
        self.0 = (self.0 ^ u64::from(n)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A table keyed by callout token.
pub type ByToken<V> = HashMap<u32, V, std::hash::BuildHasherDefault<TokenHasher>>;

#[derive(Debug, Default)]
pub struct InFlight {
    sent_at: ByToken<Duration>,
    /// token -> (the latest its reply can come, the nonce).
    nonces: ByToken<(Duration, String)>,
}

impl InFlight {
    /// Call `token` left at `now` with this timeout, carrying `nonce`.
    pub fn sent(&mut self, token: u32, now: Duration, timeout: Duration, nonce: Option<String>) {
        if self.sent_at.len() >= SWEEP_AT {
            self.sent_at
                .retain(|_, at| now.saturating_sub(*at) < LONGEST_CALL);
            // Still full (many live calls, or resets faster than the sweep
            // ages them out): start over and lose a few latency samples,
            // rather than scan the table on every call.
            if self.sent_at.len() >= SWEEP_AT / 2 {
                self.sent_at.clear();
            }
        }
        self.sent_at.insert(token, now);
        let Some(nonce) = nonce else { return };
        // Only entries past their deadline go: a live call's nonce is never
        // dropped (its reply would find none to check, and fail).
        if self.nonces.len() >= SWEEP_AT {
            self.nonces.retain(|_, (due, _)| *due >= now);
        }
        self.nonces
            .insert(token, (now + timeout + NONCE_GRACE, nonce));
    }

    /// Call `token` answered at `now`: its latency, if known, and the nonce
    /// its reply must carry, if it was sent with one.
    pub fn answered(&mut self, token: u32, now: Duration) -> (Option<Duration>, Option<String>) {
        let latency = self.sent_at.remove(&token).map(|at| now.saturating_sub(at));
        (latency, self.nonces.remove(&token).map(|(_, nonce)| nonce))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_spread_over_a_table() {
        use std::hash::BuildHasher;
        let hasher = std::hash::BuildHasherDefault::<TokenHasher>::default();
        // Consecutive tokens (what Envoy hands out) differ in their top
        // seven bits (hashbrown's tag) and their low bits (its bucket).
        let hashes: Vec<u64> = (1u32..=64).map(|t| hasher.hash_one(t)).collect();
        let tags: std::collections::HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
        let buckets: std::collections::HashSet<u64> = hashes.iter().map(|h| h & 63).collect();
        assert!(
            tags.len() > 32 && buckets.len() > 32,
            "{} {}",
            tags.len(),
            buckets.len()
        );
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn an_answer_gets_its_latency_and_nonce_once() {
        let mut f = InFlight::default();
        f.sent(1, ms(100), ms(500), Some("ab".into()));
        f.sent(2, ms(110), ms(500), None);
        assert_eq!(f.answered(1, ms(130)), (Some(ms(30)), Some("ab".into())));
        assert_eq!(f.answered(1, ms(140)), (None, None), "a second reply");
        assert_eq!(f.answered(2, ms(150)), (Some(ms(40)), None));
    }

    #[test]
    fn a_full_table_drops_stale_nonces_but_never_a_live_one() {
        let mut f = InFlight::default();
        // Cancelled calls whose replies never come, due by 1.6 s.
        for token in 0..4096 {
            f.sent(token, ms(100), ms(500), Some(format!("{token:x}")));
        }
        // A live call, then the sweep at 2 s: the stale ones go.
        f.sent(5000, ms(1900), ms(500), Some("live".into()));
        f.sent(5001, ms(2000), ms(500), Some("next".into()));
        assert_eq!(f.nonces.len(), 2);
        assert_eq!(f.answered(5000, ms(2300)).1.as_deref(), Some("live"));
        // Within its deadline plus grace, a nonce survives any sweep.
        let mut g = InFlight::default();
        g.sent(7, ms(0), ms(500), Some("kept".into()));
        for token in 0..4096 {
            g.sent(100 + token, ms(1400), ms(500), Some("x".into()));
        }
        assert_eq!(g.answered(7, ms(1500)).1.as_deref(), Some("kept"));
    }

    #[test]
    fn a_full_latency_table_ages_out_or_starts_over() {
        let mut f = InFlight::default();
        for token in 0..4096 {
            f.sent(token, ms(0), ms(500), None);
        }
        // Two minutes on, every entry is stale: swept, the new one kept.
        f.sent(9999, ms(121_000), ms(500), None);
        assert_eq!(f.sent_at.len(), 1);
        // Full of live calls: cleared, losing samples, never growing.
        let mut g = InFlight::default();
        for token in 0..4097 {
            g.sent(token, ms(1), ms(500), None);
        }
        assert_eq!(g.sent_at.len(), 1);
        assert_eq!(g.answered(4096, ms(2)).0, Some(ms(1)));
    }
}
