//! The local fallback: an in-process token bucket per descriptor, used when
//! Redis cannot decide and a limit's failure mode is `local`. The state lives
//! in proxy-wasm shared data (one copy per Envoy, shared by its workers) and
//! is updated with compare-and-swap; this module is the pure part: the bucket
//! arithmetic and its encoding.
//!
//! Same exact integer scheme as `lua/token_bucket.lua`: one token is
//! `period_ms` credits and every elapsed millisecond adds `refill` credits.

use crate::config::Algorithm;

/// The local budget of one limit: `fraction` of its global quota and rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalBucket {
    pub capacity: u64,
    pub refill: u64,
    pub period_ms: u64,
}

impl LocalBucket {
    /// `None` for a concurrency limit: what it bounds is requests in flight,
    /// which no bucket refilled with time can stand for (config refuses it a
    /// local failure mode).
    pub fn for_limit(algorithm: &Algorithm, fraction_per_mille: u64) -> Option<LocalBucket> {
        let scale = |v: u64| (v.saturating_mul(fraction_per_mille) / 1000).max(1);
        Some(match *algorithm {
            Algorithm::TokenBucket {
                capacity,
                refill,
                period_ms,
            } => LocalBucket {
                capacity: scale(capacity),
                refill: scale(refill),
                period_ms,
            },
            // GCRA admits exactly what this bucket does.
            Algorithm::Gcra {
                rate,
                period_ms,
                burst,
            } => LocalBucket {
                capacity: scale(burst),
                refill: scale(rate),
                period_ms,
            },
            // The window kinds, locally: their limit per window as a bucket
            // that refills it over one window (no burst at a window's edge).
            Algorithm::SlidingWindow { limit, window_ms }
            | Algorithm::FixedWindow { limit, window_ms }
            | Algorithm::SlidingWindowCounter { limit, window_ms } => LocalBucket {
                capacity: scale(limit),
                refill: scale(limit),
                period_ms: window_ms,
            },
            // A quota's amount over its nominal window (a 30-day month):
            // a share of a month's allowance for an outage, not a calendar.
            Algorithm::Quota { amount, calendar } => LocalBucket {
                capacity: scale(amount),
                refill: scale(amount),
                period_ms: calendar.per.nominal_ms(),
            },
            Algorithm::Concurrency { .. } => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taken {
    pub allowed: bool,
    pub remaining: u64,
    pub retry_ms: u64,
    /// The state to write back (compare-and-swap).
    pub state: Vec<u8>,
}

/// Decodes `credits:last_ms`; anything else counts as a fresh (full) bucket.
fn decode(state: Option<&[u8]>) -> Option<(u128, u64)> {
    let s = std::str::from_utf8(state?).ok()?;
    let (c, t) = s.split_once(':')?;
    Some((c.parse().ok()?, t.parse().ok()?))
}

/// Takes `cost` tokens at `now_ms` if the bucket holds them.
pub fn take(bucket: &LocalBucket, state: Option<&[u8]>, now_ms: u64, cost: u64) -> Taken {
    let period = u128::from(bucket.period_ms.max(1));
    let refill = u128::from(bucket.refill.max(1));
    let full = u128::from(bucket.capacity) * period;
    let (mut credits, last) = decode(state).unwrap_or((full, now_ms));
    if now_ms > last {
        credits = credits.saturating_add(u128::from(now_ms - last) * refill);
    }
    credits = credits.min(full);
    let stamp = now_ms.max(last);
    let need = u128::from(cost) * period;
    let (allowed, left, retry) = if credits >= need {
        (true, credits - need, 0)
    } else {
        (false, credits, (need - credits).div_ceil(refill))
    };
    Taken {
        allowed,
        remaining: u64::try_from(left / period).unwrap_or(u64::MAX),
        retry_ms: u64::try_from(retry).unwrap_or(u64::MAX),
        state: format!("{left}:{stamp}").into_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: LocalBucket = LocalBucket {
        capacity: 3,
        refill: 1,
        period_ms: 1000,
    };

    #[test]
    fn a_fresh_bucket_admits_its_capacity_then_rejects() {
        let mut state: Option<Vec<u8>> = None;
        for expected in [2, 1, 0] {
            let t = take(&B, state.as_deref(), 5000, 1);
            assert!(t.allowed);
            assert_eq!(t.remaining, expected);
            state = Some(t.state);
        }
        let t = take(&B, state.as_deref(), 5000, 1);
        assert!(!t.allowed);
        assert_eq!(t.retry_ms, 1000);
        let t = take(&B, state.as_deref(), 6000, 1);
        assert!(t.allowed, "one token back after one period");
    }

    #[test]
    fn refill_is_capped_and_garbage_state_is_a_full_bucket() {
        let t = take(&B, Some(b"0:0"), 1_000_000, 1);
        assert_eq!(t.remaining, 2);
        let t = take(&B, Some(b"not a state"), 10, 1);
        assert_eq!(t.remaining, 2);
    }

    #[test]
    fn the_local_budget_is_a_fraction_of_the_global_one() {
        let sw = Algorithm::SlidingWindow {
            limit: 100,
            window_ms: 60_000,
        };
        assert_eq!(
            LocalBucket::for_limit(&sw, 100).unwrap(),
            LocalBucket {
                capacity: 10,
                refill: 10,
                period_ms: 60_000
            }
        );
        let tiny = Algorithm::SlidingWindow {
            limit: 3,
            window_ms: 1000,
        };
        assert_eq!(
            LocalBucket::for_limit(&tiny, 100).unwrap().capacity,
            1,
            "never zero"
        );
    }

    #[test]
    fn a_concurrency_limit_has_no_local_bucket() {
        let cc = Algorithm::Concurrency {
            max: 10,
            lease_ms: 30_000,
        };
        assert_eq!(LocalBucket::for_limit(&cc, 1000), None);
    }

    #[test]
    fn gcra_runs_locally_as_the_bucket_it_equals_and_the_window_kinds_as_their_window() {
        let gcra = Algorithm::Gcra {
            rate: 30,
            period_ms: 1000,
            burst: 50,
        };
        assert_eq!(
            LocalBucket::for_limit(&gcra, 100).unwrap(),
            LocalBucket {
                capacity: 5,
                refill: 3,
                period_ms: 1000
            }
        );
        for window in [
            Algorithm::FixedWindow {
                limit: 100,
                window_ms: 60_000,
            },
            Algorithm::SlidingWindowCounter {
                limit: 100,
                window_ms: 60_000,
            },
        ] {
            assert_eq!(
                LocalBucket::for_limit(&window, 100).unwrap(),
                LocalBucket {
                    capacity: 10,
                    refill: 10,
                    period_ms: 60_000
                }
            );
        }
    }
}
