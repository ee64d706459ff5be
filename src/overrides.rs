//! Per-value overrides without the host: the text stored at a limit's
//! override key (src/keys.rs `override_key`), as `redis-guard override set`
//! writes it and lua/decide.lua reads it, with the same bounds.
//!
//! `tb <capacity> <refill>` for a token bucket (its period stays the
//! configured one, so its stored level keeps its meaning), `<kind> <limit>`
//! for a fixed window (`fw`), a sliding-window counter (`swc`), a sliding
//! window (`sw`), a calendar quota (`cq`) or a concurrency limit's maximum
//! (`cc`: its state is the slots in flight, which a maximum only bounds);
//! decimal, one space apart. A
//! quota's override, stored or carried by the request, may add the
//! customer's anchor day, `cq <amount> <anchorDay>`. The filter computes the
//! windows before the script reads a stored one: the script checks the
//! anchor they were computed for against it and names the right one when
//! they differ (src/quota.rs `Anchoring`, lua/quota.lua).

use crate::config::Algorithm;

/// Largest figure of a counting kind (and of a bucket's capacity or refill).
const MAX_FIGURE: u64 = 1 << 50;
/// Largest sliding-window limit (one sorted-set member per unit).
const MAX_LOG: u64 = 1_000_000;
/// Largest concurrency maximum (lua/decide.lua's bound on `cc`).
const MAX_SLOTS: u64 = 1 << 20;
/// A bucket's capacity and refill times its period stay below this (doubles).
const EXACT: u64 = 1 << 53;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Override {
    TokenBucket {
        capacity: u64,
        refill: u64,
    },
    /// A window kind's limit (a quota's amount, a concurrency limit's
    /// maximum).
    Limit(u64),
    /// A quota's amount and anchor day.
    Quota {
        amount: u64,
        anchor: u8,
    },
}

impl Override {
    /// The figures for `algorithm`, checked as the script checks them.
    pub fn new(
        algorithm: &Algorithm,
        capacity: Option<u64>,
        refill: Option<u64>,
        limit: Option<u64>,
    ) -> Result<Override, String> {
        let o = match (algorithm, capacity, refill, limit) {
            (Algorithm::TokenBucket { .. }, Some(capacity), Some(refill), None) => {
                Override::TokenBucket { capacity, refill }
            }
            (Algorithm::TokenBucket { .. }, _, _, _) => {
                return Err("a token bucket's override is a capacity and a refill".to_string())
            }
            (
                Algorithm::FixedWindow { .. }
                | Algorithm::SlidingWindowCounter { .. }
                | Algorithm::SlidingWindow { .. }
                | Algorithm::Quota { .. }
                | Algorithm::Concurrency { .. },
                None,
                None,
                Some(limit),
            ) => Override::Limit(limit),
            (Algorithm::Concurrency { .. }, _, _, _) => {
                return Err("a concurrency limit's override is a maximum".to_string())
            }
            (
                Algorithm::FixedWindow { .. }
                | Algorithm::SlidingWindowCounter { .. }
                | Algorithm::SlidingWindow { .. }
                | Algorithm::Quota { .. },
                _,
                _,
                _,
            ) => return Err("a window's override is a limit".to_string()),
            _ => return Err("this kind of limit takes no overrides".to_string()),
        };
        o.check(algorithm)?;
        Ok(o)
    }

    /// A quota's override moved to anchor day `anchor` (checked against
    /// the quota's unit, as a carried one is).
    pub fn with_anchor(self, algorithm: &Algorithm, anchor: u8) -> Result<Override, String> {
        let o = match self {
            Override::Limit(amount) | Override::Quota { amount, .. }
                if matches!(algorithm, Algorithm::Quota { .. }) =>
            {
                Override::Quota { amount, anchor }
            }
            _ => return Err("only a quota's override takes an anchor day".to_string()),
        };
        o.check(algorithm)?;
        Ok(o)
    }

    fn check(&self, algorithm: &Algorithm) -> Result<(), String> {
        let ok = match (*self, algorithm) {
            (
                Override::TokenBucket { capacity, refill },
                Algorithm::TokenBucket { period_ms, .. },
            ) => {
                let exact = |n: u64| n.checked_mul(*period_ms).is_some_and(|p| p < EXACT);
                (1..=MAX_FIGURE).contains(&capacity)
                    && (1..=MAX_FIGURE).contains(&refill)
                    && exact(capacity)
                    && exact(refill)
            }
            (Override::Limit(n), Algorithm::SlidingWindow { .. }) => (1..=MAX_LOG).contains(&n),
            (Override::Limit(n), Algorithm::Concurrency { .. }) => (1..=MAX_SLOTS).contains(&n),
            (
                Override::Limit(n),
                Algorithm::FixedWindow { .. }
                | Algorithm::SlidingWindowCounter { .. }
                | Algorithm::Quota { .. },
            ) => (1..=MAX_FIGURE).contains(&n),
            (Override::Quota { amount, anchor }, Algorithm::Quota { calendar, .. }) => {
                (1..=MAX_FIGURE).contains(&amount)
                    && calendar.per.anchors().is_some_and(|r| r.contains(&anchor))
            }
            _ => false,
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "out of bounds: from 1 to 2^50 (a sliding window's limit at most {MAX_LOG}; a concurrency limit's maximum at most {MAX_SLOTS}; a bucket's capacity and refill times its period below 2^53; a quota's anchor day within its month or week, none for a day or an hour)"
            ))
        }
    }

    /// The limit's algorithm with these numbers (what its headers state).
    pub fn apply(&self, algorithm: &Algorithm) -> Algorithm {
        match (*self, *algorithm) {
            (
                Override::TokenBucket { capacity, refill },
                Algorithm::TokenBucket { period_ms, .. },
            ) => Algorithm::TokenBucket {
                capacity,
                refill,
                period_ms,
            },
            (Override::Limit(limit), Algorithm::FixedWindow { window_ms, .. }) => {
                Algorithm::FixedWindow { limit, window_ms }
            }
            (Override::Limit(limit), Algorithm::SlidingWindowCounter { window_ms, .. }) => {
                Algorithm::SlidingWindowCounter { limit, window_ms }
            }
            (Override::Limit(limit), Algorithm::SlidingWindow { window_ms, .. }) => {
                Algorithm::SlidingWindow { limit, window_ms }
            }
            (Override::Limit(amount), Algorithm::Quota { calendar, .. }) => {
                Algorithm::Quota { amount, calendar }
            }
            (Override::Limit(max), Algorithm::Concurrency { lease_ms, .. }) => {
                Algorithm::Concurrency { max, lease_ms }
            }
            (Override::Quota { amount, anchor }, Algorithm::Quota { calendar, .. }) => {
                Algorithm::Quota {
                    amount,
                    calendar: crate::quota::Calendar { anchor, ..calendar },
                }
            }
            (_, other) => other,
        }
    }

    /// The override, if a request of `cost` can ever fit it (else it would
    /// reject every such request with a Retry-After that never comes true).
    pub fn fits(self, cost: u64) -> Result<Override, String> {
        let quota = match self {
            Override::TokenBucket { capacity, .. } => capacity,
            Override::Limit(n) | Override::Quota { amount: n, .. } => n,
        };
        if quota < cost {
            return Err(format!(
                "{quota} leaves no room for a request of cost {cost}"
            ));
        }
        Ok(self)
    }

    /// The stored text.
    pub fn text(&self, algorithm: &Algorithm) -> String {
        match *self {
            Override::TokenBucket { capacity, refill } => format!("tb {capacity} {refill}"),
            Override::Limit(n) => format!("{} {n}", algorithm.code()),
            Override::Quota { amount, anchor } => format!("cq {amount} {anchor}"),
        }
    }

    /// An override a request carries: a whole number (a bucket's capacity
    /// and refill alike, a window's limit) or an override's text.
    pub fn carried(value: &[u8], algorithm: &Algorithm) -> Result<Override, String> {
        let digits = !value.is_empty() && value.len() <= 20 && value.iter().all(u8::is_ascii_digit);
        if !digits {
            return Override::parse(value, algorithm)
                .or_else(|why| Override::anchored(value, algorithm).ok_or(why));
        }
        let n: u64 = std::str::from_utf8(value)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| "a number past 64 bits".to_string())?;
        let o = match algorithm {
            Algorithm::TokenBucket { .. } => Override::TokenBucket {
                capacity: n,
                refill: n,
            },
            _ => Override::Limit(n),
        };
        o.check(algorithm)?;
        Ok(o)
    }

    /// A quota's `cq <amount> <anchorDay>`, checked.
    fn anchored(value: &[u8], algorithm: &Algorithm) -> Option<Override> {
        let text = std::str::from_utf8(value).ok()?;
        let mut words = text.split(' ');
        let figure = |w: Option<&str>| {
            w.filter(|w| !w.is_empty() && w.len() <= 20 && w.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|w| w.parse::<u64>().ok())
        };
        if words.next() != Some("cq") {
            return None;
        }
        let amount = figure(words.next())?;
        let anchor = u8::try_from(figure(words.next())?).ok()?;
        if words.next().is_some() {
            return None;
        }
        let o = Override::Quota { amount, anchor };
        o.check(algorithm).ok()?;
        Some(o)
    }

    /// Reads a stored text as the script would, for a limit of `algorithm`:
    /// `Err` says why the script ignores it.
    pub fn parse(text: &[u8], algorithm: &Algorithm) -> Result<Override, String> {
        let text = std::str::from_utf8(text).map_err(|_| "not text".to_string())?;
        let mut words = text.split(' ');
        let k = words.next().unwrap_or_default();
        if k != algorithm.code() {
            return Err(format!(
                "`{text}` is not an override for a `{}` limit",
                algorithm.code()
            ));
        }
        let figures: Vec<u64> = words
            .map(|w| {
                if w.is_empty() || !w.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                w.parse().ok()
            })
            .collect::<Option<_>>()
            .ok_or_else(|| {
                format!("`{text}`: figures are whole decimal numbers, one space apart")
            })?;
        let o = match (algorithm, figures.as_slice()) {
            (Algorithm::TokenBucket { .. }, [capacity, refill]) => Override::TokenBucket {
                capacity: *capacity,
                refill: *refill,
            },
            (Algorithm::TokenBucket { .. }, _) => {
                return Err(format!("`{text}`: tb takes a capacity and a refill"))
            }
            (_, [n]) => Override::Limit(*n),
            (Algorithm::Quota { .. }, [amount, anchor]) => Override::Quota {
                amount: *amount,
                anchor: u8::try_from(*anchor).unwrap_or(0),
            },
            (Algorithm::Quota { .. }, _) => {
                return Err(format!(
                    "`{text}`: cq takes an amount and, for a month or a week, an anchor day"
                ))
            }
            _ => return Err(format!("`{text}`: a window takes one limit")),
        };
        o.check(algorithm)?;
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TB: Algorithm = Algorithm::TokenBucket {
        capacity: 100,
        refill: 100,
        period_ms: 60_000,
    };
    const FW: Algorithm = Algorithm::FixedWindow {
        limit: 100,
        window_ms: 60_000,
    };

    #[test]
    fn an_override_round_trips_through_its_stored_text() {
        let o = Override::new(&TB, Some(10_000), Some(10_000), None).unwrap();
        assert_eq!(o.text(&TB), "tb 10000 10000");
        assert_eq!(Override::parse(b"tb 10000 10000", &TB), Ok(o));
        let w = Override::new(&FW, None, None, Some(5000)).unwrap();
        assert_eq!(w.text(&FW), "fw 5000");
        assert_eq!(Override::parse(b"fw 5000", &FW), Ok(w));
    }

    #[test]
    fn a_quotas_override_carried_or_stored_may_set_its_anchor_day() {
        let month = Algorithm::Quota {
            amount: 100,
            calendar: crate::quota::Calendar {
                per: crate::quota::Per::Month,
                zone: chrono_tz::Tz::UTC,
                anchor: 1,
            },
        };
        let o = Override::carried(b"cq 5000 15", &month).unwrap();
        assert_eq!(
            o,
            Override::Quota {
                amount: 5000,
                anchor: 15
            }
        );
        let Algorithm::Quota { amount, calendar } = o.apply(&month) else {
            panic!()
        };
        assert_eq!(
            (amount, calendar.anchor, calendar.per),
            (5000, 15, crate::quota::Per::Month)
        );
        assert_eq!(o.text(&month), "cq 5000 15");
        assert_eq!(Override::carried(b"cq 7", &month), Ok(Override::Limit(7)));
        assert_eq!(Override::carried(b"7", &month), Ok(Override::Limit(7)));
        assert_eq!(Override::parse(b"cq 5000 15", &month), Ok(o));
        assert_eq!(
            Override::Limit(9).with_anchor(&month, 31),
            Ok(Override::Quota {
                amount: 9,
                anchor: 31
            })
        );
        assert!(Override::Limit(9).with_anchor(&month, 32).is_err());
        assert!(Override::Limit(9).with_anchor(&FW, 3).is_err());
        for bad in [
            &b"cq 5000 32"[..],
            b"cq 5000 0",
            b"cq 5000 256",
            b"cq 5 5 5",
        ] {
            assert!(
                Override::parse(bad, &month).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        for bad in [
            &b"cq 5000 32"[..],
            b"cq 5000 0",
            b"cq 0 5",
            b"cq 5 5 5",
            b"cq 5 300",
            b"fw 5 5",
        ] {
            assert!(
                Override::carried(bad, &month).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let Algorithm::Quota { calendar, .. } = month else {
            panic!()
        };
        let day = Algorithm::Quota {
            amount: 100,
            calendar: crate::quota::Calendar {
                per: crate::quota::Per::Day,
                ..calendar
            },
        };
        assert!(
            Override::carried(b"cq 5 1", &day).is_err(),
            "a day has no anchor"
        );
        assert!(Override::parse(b"cq 5 1", &day).is_err());
        assert!(Override::Limit(5).with_anchor(&day, 1).is_err());
        assert_eq!(Override::parse(b"cq 5", &day), Ok(Override::Limit(5)));
    }

    #[test]
    fn a_concurrency_limits_override_is_its_maximum() {
        let cc = Algorithm::Concurrency {
            max: 1,
            lease_ms: 30_000,
        };
        let o = Override::new(&cc, None, None, Some(3)).unwrap();
        assert_eq!(o.text(&cc), "cc 3");
        assert_eq!(Override::parse(b"cc 3", &cc), Ok(o));
        assert_eq!(Override::carried(b"3", &cc), Ok(o));
        assert_eq!(
            o.apply(&cc),
            Algorithm::Concurrency {
                max: 3,
                lease_ms: 30_000
            }
        );
        for bad in [&b"cc 0"[..], b"cc 1048577", b"fw 3", b"cc 3 3"] {
            assert!(
                Override::parse(bad, &cc).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(Override::new(&cc, Some(3), Some(3), None).is_err());
        assert_eq!(
            Override::parse(b"cc 1048576", &cc),
            Ok(Override::Limit(1 << 20))
        );
    }

    #[test]
    fn what_the_script_ignores_is_refused_here_too() {
        for bad in [
            &b"tb -5 1"[..],
            b"tb 1125899906842625 1",
            b"tb 5",
            b"tb 0 1",
            b"fw 5",
            b"tb 5 5 5",
            b"hello",
            b"",
            b"tb 5.5 1",
            b"TB 5 5",
            b"fw 5 ",
            b"tb  5 5",
            b"tb 5 5\xff",
            // capacity * period reaches 2^53.
            b"tb 150119987580 1",
        ] {
            assert!(
                Override::parse(bad, &TB).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(Override::new(&TB, Some(5), None, None).is_err());
        assert!(Override::new(&FW, None, None, Some(1 << 51)).is_err());
        assert!(Override::new(&FW, Some(1), Some(1), None).is_err());
        let gcra = Algorithm::Gcra {
            rate: 1,
            period_ms: 1,
            burst: 1,
        };
        assert!(Override::new(&gcra, None, None, Some(5)).is_err());
    }
}
