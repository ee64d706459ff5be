//! A limit's kind and the parameters that shape its state: what the
//! scripts' arguments, the keys' signatures and a stored override's text are
//! made of. A leaf of `config`: `limit` compiles it from the raw fields, and
//! `block` and `overrides` read it without depending on `limit`.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    TokenBucket {
        capacity: u64,
        refill: u64,
        period_ms: u64,
    },
    SlidingWindow {
        limit: u64,
        window_ms: u64,
    },
    Gcra {
        rate: u64,
        period_ms: u64,
        burst: u64,
    },
    FixedWindow {
        limit: u64,
        window_ms: u64,
    },
    SlidingWindowCounter {
        limit: u64,
        window_ms: u64,
    },
    Concurrency {
        max: u64,
        lease_ms: u64,
    },
    /// A calendar quota: `amount` per window of `calendar`.
    Quota {
        amount: u64,
        calendar: crate::quota::Calendar,
    },
}

impl Algorithm {
    /// The most units one request may spend.
    pub fn quota(&self) -> u64 {
        match *self {
            Algorithm::TokenBucket { capacity, .. } => capacity,
            Algorithm::Gcra { burst, .. } => burst,
            Algorithm::Concurrency { max, .. } => max,
            Algorithm::Quota { amount, .. } => amount,
            Algorithm::SlidingWindow { limit, .. }
            | Algorithm::FixedWindow { limit, .. }
            | Algorithm::SlidingWindowCounter { limit, .. } => limit,
        }
    }

    /// The policy window in ms: for a token bucket and GCRA, the time to
    /// refill from empty; for the window kinds, the window; none (0) for a
    /// concurrency limit, whose capacity comes back when requests end.
    pub fn window_ms(&self) -> u64 {
        match *self {
            Algorithm::TokenBucket {
                capacity,
                refill,
                period_ms,
            } => (capacity * period_ms).div_ceil(refill),
            Algorithm::Gcra {
                rate,
                period_ms,
                burst,
            } => (burst * period_ms).div_ceil(rate),
            Algorithm::SlidingWindow { window_ms, .. }
            | Algorithm::FixedWindow { window_ms, .. }
            | Algorithm::SlidingWindowCounter { window_ms, .. } => window_ms,
            Algorithm::Concurrency { .. } => 0,
            // A month's nominal 30 days until a window is known (the
            // headers say the window the request was decided in).
            Algorithm::Quota { calendar, .. } => calendar.per.nominal_ms(),
        }
    }

    /// The kind's code in the scripts' arguments (lua/ratelimit.lua) and in
    /// a stored override's text.
    pub fn code(&self) -> &'static str {
        match self {
            Algorithm::TokenBucket { .. } => "tb",
            Algorithm::SlidingWindow { .. } => "sw",
            Algorithm::Gcra { .. } => "gcra",
            Algorithm::FixedWindow { .. } => "fw",
            Algorithm::SlidingWindowCounter { .. } => "swc",
            Algorithm::Concurrency { .. } => "cc",
            Algorithm::Quota { .. } => "cq",
        }
    }

    /// The key segment naming the algorithm and every parameter that shapes
    /// its stored state, so a changed limit starts from a fresh key instead of
    /// reading a state written under other parameters.
    pub fn signature(&self) -> String {
        match *self {
            Algorithm::TokenBucket {
                capacity,
                refill,
                period_ms,
            } => format!("tb2.{capacity}.{refill}.{period_ms}"),
            Algorithm::SlidingWindow { limit, window_ms } => format!("sw.{limit}.{window_ms}"),
            Algorithm::Gcra {
                rate,
                period_ms,
                burst,
            } => format!("gcra.{rate}.{period_ms}.{burst}"),
            Algorithm::FixedWindow { limit, window_ms } => format!("fw.{limit}.{window_ms}"),
            Algorithm::SlidingWindowCounter { limit, window_ms } => {
                format!("swc.{limit}.{window_ms}")
            }
            // The slots held are the same whatever the max or the lease:
            // a changed limit keeps counting the requests in flight.
            Algorithm::Concurrency { .. } => "cc".to_string(),
            // Not the amount: a plan's amount changed in the config mid-month
            // keeps every customer's use (a count means the same under
            // another amount). The anchor is in each window key's start.
            Algorithm::Quota { calendar, .. } => {
                format!("cq.{}.{}", calendar.per.name(), calendar.zone.name())
            }
        }
    }
}
