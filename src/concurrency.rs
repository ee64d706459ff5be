//! Concurrency slots without the host: which of a request's limits it holds
//! a slot in, the calls that renew and release them, and what a renewal's
//! answer says. The slot is taken by the request's decision (lua/concurrency.lua).

use std::time::Duration;

use crate::config::{Algorithm, Config, RENEWALS_PER_LEASE};
use crate::ratelimit::{Outcome, Plan, ScriptArgs};
use crate::webdis::{Reply, Shown};

/// Hex digits of a slot id: 64 bits, so two requests in flight at once
/// never share one (and the member stays short: it is stored per slot).
pub const SLOT_ID_LEN: usize = 16;

/// One concurrency limit the request may hold a slot in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// Index into `Config::limits`.
    pub limit: usize,
    pub key: Vec<u8>,
    pub cost: u64,
    pub lease_ms: u64,
    /// Not a shadow limit: it can reject.
    pub enforced: bool,
}

/// The request's slots: its slot id, and the limits it may hold one in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slots {
    pub id: String,
    pub held: Vec<Held>,
}

impl Slots {
    /// The concurrency limits of `plan`, under a slot id from `token` (a
    /// token no other request produces, asked for only when a concurrency
    /// limit applies); `None` when the plan has none.
    pub fn of_plan(config: &Config, plan: &Plan, token: impl FnOnce() -> String) -> Option<Slots> {
        let held: Vec<Held> = plan
            .checks
            .iter()
            .filter_map(|check| match config.limits[check.limit].algorithm {
                Algorithm::Concurrency { lease_ms, .. } => Some(Held {
                    limit: check.limit,
                    key: check.key.clone(),
                    cost: check.cost,
                    lease_ms,
                    enforced: !config.limits[check.limit].shadow,
                }),
                _ => None,
            })
            .collect();
        if held.is_empty() {
            return None;
        }
        let id: String = token()
            .chars()
            .filter(|c| c.is_ascii_hexdigit())
            .map(|c| c.to_ascii_lowercase())
            .take(SLOT_ID_LEN)
            .collect();
        Some(Slots { id, held })
    }

    /// After an admitting decision: keeps the limits whose slot was taken
    /// (every one that admitted; a shadow limit that would have rejected
    /// took none). False if none was.
    pub fn keep_taken(&mut self, plan: &Plan, outcome: &Outcome) -> bool {
        let taken: Vec<usize> = plan
            .checks
            .iter()
            .zip(&outcome.results)
            .filter(|(_, r)| outcome.admitted && r.allowed)
            .map(|(c, _)| c.limit)
            .collect();
        self.held.retain(|h| taken.contains(&h.limit));
        !self.held.is_empty()
    }

    /// KEYS and ARGV of lua/concurrency_release.lua: a slot id and a cost
    /// per key, so the releases of several requests join into one call.
    pub fn release_args(&self) -> ScriptArgs {
        let keys = self.held.iter().map(|h| h.key.clone()).collect();
        let mut argv = Vec::with_capacity(2 * self.held.len());
        for h in &self.held {
            argv.push(self.id.as_bytes().to_vec());
            argv.push(h.cost.to_string().into_bytes());
        }
        (keys, argv)
    }

    /// KEYS and ARGV of lua/concurrency_renew.lua.
    pub fn renew_args(&self) -> ScriptArgs {
        let keys = self.held.iter().map(|h| h.key.clone()).collect();
        let mut argv = vec![self.id.as_bytes().to_vec()];
        for h in &self.held {
            argv.push(h.lease_ms.to_string().into_bytes());
            argv.push(h.cost.to_string().into_bytes());
        }
        (keys, argv)
    }

    /// How often the leases are renewed: a share of the shortest.
    pub fn renew_every(&self) -> Duration {
        let shortest = self.held.iter().map(|h| h.lease_ms).min().unwrap_or(0);
        Duration::from_millis(shortest) / RENEWALS_PER_LEASE
    }

    /// Reads a renewal's answer (one 0/1 per key, in `renew_args` order):
    /// drops the slots that were gone and returns the limits they were in.
    pub fn on_renewed(&mut self, reply: &Reply) -> Result<Vec<usize>, String> {
        let Reply::Array(Some(items)) = reply else {
            return Err(format!("unexpected renewal reply: {}", Shown(reply)));
        };
        if items.len() != self.held.len() {
            return Err(format!(
                "renewal answered {} keys, {} asked",
                items.len(),
                self.held.len()
            ));
        }
        let mut still = Vec::with_capacity(items.len());
        for item in items {
            match item.as_int() {
                Some(1) => still.push(true),
                Some(0) => still.push(false),
                _ => return Err(format!("unexpected renewal reply: {}", Shown(item))),
            }
        }
        let lost = self
            .held
            .iter()
            .zip(&still)
            .filter(|(_, s)| !**s)
            .map(|(h, _)| h.limit)
            .collect();
        let mut keep = still.into_iter();
        self.held.retain(|_| keep.next().unwrap_or(false));
        Ok(lost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ratelimit::LimitResult;
    use crate::request::fake::FakeRequest;
    use crate::request::RequestLine;

    fn config() -> Config {
        Config::parse(
            br#"{"redis":{"cluster":"webdis"},"limits":[
                {"name":"c","concurrency":{"max":5,"leaseMs":3000},"cost":2},
                {"name":"t","tokenBucket":{"capacity":10,"refill":1,"periodMs":1000}},
                {"name":"s","shadow":true,"concurrency":{"max":1,"leaseMs":900}}]}"#,
        )
        .unwrap()
    }

    fn plan(cfg: &Config) -> Plan {
        let req = FakeRequest::new("GET", "/");
        let line = RequestLine::read(&req);
        Plan::build(cfg, &line, &req).unwrap()
    }

    fn result(allowed: bool) -> LimitResult {
        LimitResult {
            allowed,
            remaining: 0,
            retry_ms: 0,
            reset_ms: 0,
            overridden: crate::ratelimit::OverrideUse::None,
            plan: None,
        }
    }

    #[test]
    fn a_plan_without_a_concurrency_limit_holds_no_slot() {
        let cfg = Config::parse(
            br#"{"redis":{"cluster":"webdis"},"limits":[
                {"name":"t","tokenBucket":{"capacity":10,"refill":1,"periodMs":1000}}]}"#,
        )
        .unwrap();
        assert_eq!(
            Slots::of_plan(&cfg, &plan(&cfg), || panic!("no token needed")),
            None
        );
    }

    #[test]
    fn the_slot_id_is_the_first_sixteen_hex_digits_of_the_token_in_lower_case() {
        let cfg = config();
        let s = Slots::of_plan(&cfg, &plan(&cfg), || {
            "0123456789ABCDEF0123456789abcdef".into()
        })
        .unwrap();
        assert_eq!(s.id, "0123456789abcdef");
        assert_eq!(s.held.len(), 2);
        assert_eq!((s.held[0].cost, s.held[0].lease_ms), (2, 3000));
        // Renewed four times per lease of the shortest.
        assert_eq!(s.renew_every(), Duration::from_millis(225));
    }

    #[test]
    fn release_and_renew_name_every_slot_with_its_cost_and_lease() {
        let cfg = config();
        let p = plan(&cfg);
        let s = Slots::of_plan(&cfg, &p, || "abcdef0123456789".into()).unwrap();
        let text = |v: Vec<Vec<u8>>| {
            v.into_iter()
                .map(|a| String::from_utf8(a).unwrap())
                .collect::<Vec<_>>()
        };
        let (keys, argv) = s.release_args();
        assert_eq!(keys, vec![p.checks[0].key.clone(), p.checks[2].key.clone()]);
        assert_eq!(
            text(argv),
            ["abcdef0123456789", "2", "abcdef0123456789", "1"]
        );
        let (_, argv) = s.renew_args();
        assert_eq!(text(argv), ["abcdef0123456789", "3000", "2", "900", "1"]);
    }

    #[test]
    fn only_the_limits_that_admitted_an_admitted_request_hold_a_slot() {
        let cfg = config();
        let p = plan(&cfg);
        let mut s = Slots::of_plan(&cfg, &p, || "ab".into()).unwrap();
        // The shadow limit would have rejected: it took no slot.
        let outcome = Outcome {
            admitted: true,
            results: vec![result(true), result(true), result(false)],
        };
        assert!(s.keep_taken(&p, &outcome));
        assert_eq!(s.held.iter().map(|h| h.limit).collect::<Vec<_>>(), [0]);
        // A rejected request took none.
        let mut s = Slots::of_plan(&cfg, &p, || "ab".into()).unwrap();
        let rejected = Outcome {
            admitted: false,
            results: vec![result(true), result(false), result(true)],
        };
        assert!(!s.keep_taken(&p, &rejected));
        assert!(s.held.is_empty());
    }

    #[test]
    fn a_renewal_drops_the_slots_that_were_gone() {
        let cfg = config();
        let mut s = Slots::of_plan(&cfg, &plan(&cfg), || "ab".into()).unwrap();
        let int = |i: i64| Reply::Int(i);
        assert_eq!(
            s.on_renewed(&Reply::Array(Some(vec![int(1), int(0)]))),
            Ok(vec![2])
        );
        assert_eq!(s.held.len(), 1);
        assert!(s.on_renewed(&Reply::Array(Some(vec![]))).is_err());
        assert!(s.on_renewed(&Reply::Int(1)).is_err());
        assert_eq!(s.held.len(), 1, "an unreadable answer drops nothing");
    }
}
