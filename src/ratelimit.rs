//! Rate limiting without the host: which limits apply to a request, the script
//! call that decides them, and what the reply means.

use crate::codec::decimal;
use crate::config::{descriptor, Algorithm, Config, Cost, FailureMode, Read};
use crate::keys;
use crate::offload::ObjectRef;
use crate::overrides::Override;
use crate::request::{RequestLine, RequestView};
use crate::webdis::{Reply, Shown};

/// One limit that applies to this request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// Index into `Config::limits`.
    pub limit: usize,
    pub key: Vec<u8>,
    pub cost: u64,
    /// The limit's numbers as this request's override says (one stored in
    /// Redis replaces them again in the script).
    pub carried: Option<Override>,
    /// A quota's window edges at the proxy's clock (`Plan::set_clock`):
    /// the window around it and one on each side (src/quota.rs).
    pub edges: Option<[i64; 4]>,
    /// The anchor day this Envoy learnt a stored override sets for a
    /// quota's key (src/filter/stage/quota.rs): its windows are computed
    /// for it.
    pub remembered: Option<u8>,
    /// Which anchor a quota's edges were computed for, sent with them when
    /// the limit takes stored overrides (`Plan::set_clock`).
    pub anchoring: Option<crate::quota::Anchoring>,
    /// The key's SHA-256, once a stage needs it ([`Check::digest`]).
    pub digest: keys::KeyDigest,
}

impl Check {
    /// The SHA-256 of the check's key, computed once per request.
    pub fn digest(&self) -> &[u8; 32] {
        self.digest.of(&self.key)
    }
}

/// A script call's KEYS and ARGV.
pub type ScriptArgs = (Vec<Vec<u8>>, Vec<Vec<u8>>);

/// Every limit that applies to one request, decided together.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    pub checks: Vec<Check>,
    /// The request's hash tag, once computed (for its idempotency key too).
    pub tag: Option<String>,
    /// Limits left out because a value their descriptor reads was of the
    /// wrong type, with why.
    pub invalid: Vec<(usize, String)>,
    /// Limits whose `unless` exempted the request.
    pub exempt: Vec<usize>,
    /// Limits whose override the request carried but that does not parse
    /// (the configured numbers apply), with why.
    pub bad_overrides: Vec<(usize, String)>,
}

/// A request the filter refuses before asking Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRequest {
    pub detail: String,
}

impl Plan {
    /// Collects the limits whose match and descriptor apply to the request.
    pub fn build(
        config: &Config,
        line: &RequestLine,
        view: &dyn RequestView,
    ) -> Result<Plan, BadRequest> {
        let mut checks = Vec::new();
        let mut invalid = Vec::new();
        let mut exempt = Vec::new();
        let mut bad_overrides = Vec::new();
        let mut tag: Option<String> = None;
        for (i, limit) in config.limits.iter().enumerate() {
            if !limit.matcher.matches(line, view) {
                continue;
            }
            if limit.unless.as_ref().is_some_and(|u| u.matches(line, view)) {
                exempt.push(i);
                continue;
            }
            let descriptor = match descriptor(&limit.descriptor, line, view) {
                Read::Value(d) => d,
                Read::Missing => continue,
                Read::Invalid(why) => {
                    invalid.push((i, why));
                    continue;
                }
            };
            let cost = match &limit.cost {
                Cost::Fixed(c) => *c,
                Cost::Header { name, default, max } => match view.header(name) {
                    None => *default,
                    Some(raw) => match parse_cost(&raw, *max) {
                        Some(cost) => cost,
                        // A shadow limit never rejects, not even a bad header.
                        None if limit.shadow => *default,
                        None => {
                            return Err(BadRequest {
                                detail: format!(
                                    "header `{name}` must be a whole number from 1 to {max} (limit `{}`)",
                                    limit.name
                                ),
                            })
                        }
                    },
                },
            };
            let carried = match &limit.overrides.request {
                None => None,
                Some(part) => part.value(line, view).and_then(|v| {
                    Override::carried(&v, &limit.algorithm)
                        .and_then(|o| o.fits(cost))
                        .map_err(|why| bad_overrides.push((i, why)))
                        .ok()
                }),
            };
            let tag = tag.get_or_insert_with(|| config.hash_tag_for(line, view));
            checks.push(Check {
                limit: i,
                key: keys::rate_limit_key(&config.key_prefix, tag, &limit.key_infix, &descriptor),
                cost,
                carried,
                edges: None,
                remembered: None,
                anchoring: None,
                digest: keys::KeyDigest::default(),
            });
        }
        Ok(Plan {
            checks,
            tag,
            invalid,
            exempt,
            bad_overrides,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.checks.is_empty()
    }

    /// Computes each quota's window edges at `now_ms` (the proxy's clock);
    /// the script picks the window that holds Redis' (src/quota.rs). A
    /// clock outside the quota's range leaves none: the script refuses the
    /// call and the failure mode decides.
    ///
    /// The anchor day: a stored override's, as far as this Envoy knows it
    /// (`Check::remembered`), else the request's, else the configured one;
    /// the script checks it against the stored override it reads.
    pub fn set_clock(&mut self, config: &Config, now_ms: i64) {
        for check in &mut self.checks {
            let Some(limit) = config.limits.get(check.limit) else {
                continue;
            };
            // A customer's anchor day carried by the request moves its
            // windows.
            let algorithm = check
                .carried
                .map_or(limit.algorithm, |o| o.apply(&limit.algorithm));
            if let Algorithm::Quota { calendar, .. } = algorithm {
                let anchoring =
                    crate::quota::Anchoring::of(calendar.per, calendar.anchor, check.remembered);
                let sent = anchoring.map_or(calendar.anchor, |a| a.sent);
                check.edges = crate::quota::Calendar {
                    anchor: sent,
                    ..calendar
                }
                .edges(now_ms);
                check.anchoring = anchoring.filter(|_| limit.overrides.redis);
            }
        }
    }

    /// KEYS and ARGV of lua/lease.lua for check `i` (a leased token bucket):
    /// the request's cost (0 for a background prefetch) and the tokens wanted.
    pub fn lease_args(
        &self,
        config: &Config,
        i: usize,
        prefetch: bool,
        tokens: u64,
    ) -> Option<ScriptArgs> {
        let check = self.checks.get(i)?;
        let Algorithm::TokenBucket {
            capacity,
            refill,
            period_ms,
        } = config.limits.get(check.limit)?.algorithm
        else {
            return None;
        };
        let cost = if prefetch { 0 } else { check.cost };
        let mut argv: Vec<Vec<u8>> = [capacity, refill, period_ms, cost, tokens]
            .iter()
            .map(|v| decimal(*v))
            .collect();
        // A key with a stored plan is decided under it, and granted nothing.
        if config.limits.get(check.limit)?.overrides.redis {
            argv.push(b"o".to_vec());
        }
        Some((vec![check.key.clone()], argv))
    }

    /// KEYS and ARGV for `lua/ratelimit.lua`, in its documented order, with
    /// the idempotency lock when the request carries a key, and the
    /// request's slot id for its concurrency limits (none: an empty id the
    /// script refuses, never another request's).
    pub fn script_args(
        &self,
        config: &Config,
        idem: Option<&IdemArgs>,
        slot: Option<&str>,
    ) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let mut keys: Vec<Vec<u8>> = self.checks.iter().map(|c| c.key.clone()).collect();
        let mut argv = Vec::with_capacity(1 + self.checks.len() * 6);
        argv.push(decimal(self.checks.len() as u64));
        for check in &self.checks {
            let limit = &config.limits[check.limit];
            let (alg, a, b, c) = kind_args(&limit.algorithm);
            let (a, b) = match check.carried {
                Some(Override::TokenBucket { capacity, refill }) => (capacity, refill),
                Some(Override::Limit(n) | Override::Quota { amount: n, .. }) => (n, b),
                None => (a, b),
            };
            // `+o`: the script looks up an override for the key.
            let mut alg = alg.as_bytes().to_vec();
            if limit.overrides.redis {
                alg.extend_from_slice(b"+o");
            }
            // A concurrency limit's third value is the request's slot id.
            let c = match limit.algorithm {
                Algorithm::Concurrency { .. } => slot.unwrap_or("").as_bytes().to_vec(),
                Algorithm::Quota { .. } => {
                    let mut arg = edges_arg(check.edges);
                    if let (false, Some(a)) = (arg.is_empty(), check.anchoring) {
                        arg.extend_from_slice(a.suffix().as_bytes());
                    }
                    arg
                }
                _ => decimal(c),
            };
            argv.push(alg);
            argv.push(decimal(a));
            argv.push(decimal(b));
            argv.push(c);
            argv.push(decimal(check.cost));
            argv.push(enforce_value(limit));
        }
        if let Some(idem) = idem {
            keys.push(idem.key.clone());
            argv.push(b"1".to_vec());
            argv.push(idem.owner.as_bytes().to_vec());
            argv.push(idem.fingerprint.as_bytes().to_vec());
            argv.push(decimal(idem.lock_ttl_ms));
        }
        (keys, argv)
    }

    /// The failure mode when Redis cannot decide: deny if any enforced limit
    /// that applies says deny (shadow limits never deny).
    pub fn failure_mode(&self, config: &Config) -> FailureMode {
        let enforced = |mode| {
            self.checks.iter().any(|c| {
                let l = &config.limits[c.limit];
                !l.shadow && l.failure_mode == mode
            })
        };
        if enforced(FailureMode::Deny) {
            FailureMode::Deny
        } else if enforced(FailureMode::Local) {
            FailureMode::Local
        } else {
            FailureMode::Allow
        }
    }
}

/// A kind's code and its three numbers in a script call (see
/// lua/ratelimit.lua; lua/settle.lua takes the same). A concurrency limit's
/// third value is its request's slot id instead (0 here).
pub fn kind_args(algorithm: &Algorithm) -> (&'static str, u64, u64, u64) {
    let (a, b, c) = match *algorithm {
        Algorithm::TokenBucket {
            capacity,
            refill,
            period_ms,
        } => (capacity, refill, period_ms),
        Algorithm::Gcra {
            rate,
            period_ms,
            burst,
        } => (burst, rate, period_ms),
        Algorithm::SlidingWindow { limit, window_ms }
        | Algorithm::FixedWindow { limit, window_ms }
        | Algorithm::SlidingWindowCounter { limit, window_ms } => (limit, window_ms, 0),
        Algorithm::Concurrency { max, lease_ms } => (max, lease_ms, 0),
        // Its third value is the window edges (`Check::edges`), not a number.
        Algorithm::Quota { amount, .. } => (amount, 0, 0),
    };
    (algorithm.code(), a, b, c)
}

/// A quota's edges as the script reads them: four decimal ms,
/// comma-separated; none, an empty string the script refuses.
pub fn edges_arg(edges: Option<[i64; 4]>) -> Vec<u8> {
    match edges {
        Some([a, b, c, d]) => format!("{a},{b},{c},{d}").into_bytes(),
        None => Vec::new(),
    }
}

/// A limit's enforce value: a shadow limit is reported, never enforced
/// ("0"); a blocking one says its block in ms, negated for a usage-based
/// limit (its settlement starts the block, not a rejection: its state holds
/// the reserves of requests still running); any other is "1".
fn enforce_value(limit: &crate::config::Limit) -> Vec<u8> {
    match (limit.shadow, limit.block_ms) {
        (true, _) => b"0".to_vec(),
        (false, Some(ms)) if limit.usage.is_some() => format!("-{ms}").into_bytes(),
        (false, Some(ms)) => decimal(ms),
        (false, None) => b"1".to_vec(),
    }
}

fn parse_cost(raw: &[u8], max: u64) -> Option<u64> {
    let s = std::str::from_utf8(raw).ok()?.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || s.len() > 20 {
        return None;
    }
    let n: u64 = s.parse().ok()?;
    (1..=max).contains(&n).then_some(n)
}

/// The idempotency part of a script call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdemArgs {
    pub key: Vec<u8>,
    pub owner: String,
    pub fingerprint: String,
    pub lock_ttl_ms: u64,
}

/// What the request script decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Rate limits decided (and, if admitted, the idempotency lock taken).
    Limits(Outcome),
    /// Another request holds the key's lock for this long.
    Busy { pttl_ms: u64 },
    /// The key completed before: the stored response.
    Replay {
        status: u32,
        headers: Vec<u8>,
        body: Vec<u8>,
        /// The body is in the object store (`body` is empty).
        object: Option<ObjectRef>,
    },
    /// The key was used with another request.
    Mismatch,
    /// Nothing decided: a stored override puts these quotas' windows on
    /// another anchor day than the one their edges were computed for
    /// (check index, the anchor day to compute them for).
    Anchors(Vec<(usize, u8)>),
}

/// Reads the request script's reply (see the contract in lua/ratelimit.lua).
pub fn parse_verdict(reply: &Reply, n: usize) -> Result<Verdict, String> {
    let Reply::Array(Some(items)) = reply else {
        return Err(format!("expected an array, got {}", Shown(reply)));
    };
    let code = items.first().and_then(Reply::as_int);
    let bulk = |i: usize| match items.get(i) {
        Some(Reply::Bulk(Some(b))) => Ok(b.clone()),
        Some(Reply::Bulk(None)) => Ok(Vec::new()),
        Some(other) => Err(format!("expected a string, got {}", Shown(other))),
        None => Err("expected a string, got nothing".to_string()),
    };
    match (code, items.len()) {
        (Some(0 | 1), _) => parse_outcome(reply, n).map(Verdict::Limits),
        (Some(2), 2) => {
            let pttl = items[1].as_int().filter(|v| *v > 0).ok_or("bad lock TTL")?;
            Ok(Verdict::Busy {
                pttl_ms: pttl.unsigned_abs(),
            })
        }
        (Some(3), len @ (4 | 7)) => {
            let status = items[1]
                .as_int()
                .and_then(|s| u32::try_from(s).ok())
                .filter(|s| (100..600).contains(s))
                .ok_or("bad stored status")?;
            let object = if len == 7 {
                let key = String::from_utf8(bulk(4)?).map_err(|_| "object key is not UTF-8")?;
                let sha256 =
                    String::from_utf8(bulk(5)?).map_err(|_| "object checksum is not UTF-8")?;
                let size = items[6]
                    .as_int()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or("bad object length")?;
                if key.is_empty() || sha256.len() != 64 {
                    return Err("bad object reference".to_string());
                }
                Some(ObjectRef {
                    key,
                    sha256,
                    len: size,
                })
            } else {
                None
            };
            Ok(Verdict::Replay {
                status,
                headers: bulk(2)?,
                body: bulk(3)?,
                object,
            })
        }
        (Some(4), 1) => Ok(Verdict::Mismatch),
        (Some(5), len) if len >= 3 && len % 2 == 1 => items[1..]
            .chunks_exact(2)
            .map(|pair| {
                let i = pair[0]
                    .as_int()
                    .and_then(|i| usize::try_from(i).ok())
                    .filter(|i| (1..=n).contains(i));
                let anchor = pair[1]
                    .as_int()
                    .and_then(|a| u8::try_from(a).ok())
                    .filter(|a| (1..=31).contains(a));
                match (i, anchor) {
                    (Some(i), Some(anchor)) => Ok((i - 1, anchor)),
                    _ => {
                        let shown: Vec<String> =
                            pair.iter().map(|r| Shown(r).to_string()).collect();
                        Err(format!("bad anchor reply {}", shown.join(", ")))
                    }
                }
            })
            .collect::<Result<_, _>>()
            .map(Verdict::Anchors),
        _ => Err(format!(
            "unexpected verdict {:?} of {} items",
            code,
            items.len()
        )),
    }
}

/// Reads lua/lease.lua's reply: one limit's outcome, the tokens granted and
/// the grant's tuple (what bounds their give-back).
pub fn parse_lease(reply: &Reply) -> Result<(Outcome, u64, crate::lease::Tuple), String> {
    let Reply::Array(Some(items)) = reply else {
        return Err(format!("expected an array, got {}", Shown(reply)));
    };
    // 11: a stored plan decided it, its two figures last.
    if items.len() != 9 && items.len() != 11 {
        return Err(format!("expected 9 or 11 items, got {}", items.len()));
    }
    let verdict = [&items[..5], &items[9..]].concat();
    let outcome = parse_outcome(&Reply::Array(Some(verdict)), 1)?;
    let [granted, at_ms, level, returned] = [5, 6, 7, 8].map(|i| {
        items[i]
            .as_int()
            .and_then(|v| u64::try_from(v).ok())
            .ok_or("bad grant")
    });
    let granted = granted?;
    if granted > 0 && !outcome.admitted {
        return Err("a grant with a rejection".to_string());
    }
    let tuple = crate::lease::Tuple {
        at_ms: at_ms?,
        level: level?,
        returned: returned?,
    };
    Ok((outcome, granted, tuple))
}

/// One limit's verdict, as the script returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitResult {
    pub allowed: bool,
    pub remaining: u64,
    pub retry_ms: u64,
    pub reset_ms: u64,
    /// Whether an override stored in Redis decided it.
    pub overridden: OverrideUse,
    /// The stored plan's figures when one decided it (`Applied`), as the
    /// same reply states them: a token bucket's capacity and refill,
    /// another kind's limit, amount or maximum and 0. None where the reply
    /// does not say (the over-limit cache's).
    pub plan: Option<[u64; 2]>,
}

impl LimitResult {
    /// The numbers this limit decided the request under, for its headers:
    /// the stored plan's when one decided it, else the one the request
    /// carried, else the configured ones. None when a plan decided it whose
    /// figures are unknown here (a limit is better left out than misstated).
    pub fn decided_under(
        &self,
        configured: &Algorithm,
        carried: Option<Override>,
    ) -> Option<Algorithm> {
        if self.overridden != OverrideUse::Applied {
            return Some(carried.map_or(*configured, |o| o.apply(configured)));
        }
        let [a, b] = self.plan?;
        let plan = match configured {
            Algorithm::TokenBucket { .. } => Override::TokenBucket {
                capacity: a,
                refill: b,
            },
            _ => Override::Limit(a),
        };
        Some(plan.apply(configured))
    }
}

/// What became of a limit's override in its decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OverrideUse {
    /// None stored (or the limit takes none): the configured numbers.
    #[default]
    None,
    /// Its numbers replaced the configured ones.
    Applied,
    /// One is stored but does not parse within the kind's bounds: ignored.
    Invalid,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub admitted: bool,
    /// In `Plan::checks` order.
    pub results: Vec<LimitResult>,
}

/// Reads the script's flat reply: `[admitted, (allowed, remaining, retry_ms,
/// reset_ms) × n]`, then `(a, b)` of the stored plan of each limit one
/// decided, in order (lua/ratelimit.lua).
pub fn parse_outcome(reply: &Reply, n: usize) -> Result<Outcome, String> {
    let Reply::Array(Some(items)) = reply else {
        return Err(format!("expected an array, got {}", Shown(reply)));
    };
    let verdicts = n.checked_mul(4).and_then(|v| v.checked_add(1));
    if verdicts.is_none_or(|v| items.len() < v || (items.len() - v) % 2 != 0) {
        return Err(format!(
            "expected {} integers for {n} limits and two per plan, got {}",
            4 * n + 1,
            items.len()
        ));
    }
    let mut ints = Vec::with_capacity(items.len());
    for item in items {
        let v = item
            .as_int()
            .ok_or_else(|| format!("expected an integer, got {}", Shown(item)))?;
        ints.push(v);
    }
    let flag = |v: i64| match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(format!("expected 0 or 1, got {v}")),
    };
    // A limit's first value: allowed (0/1), plus 2 when an override decided
    // it, 4 when a stored override was ignored (lua/ratelimit.lua).
    let allowed = |v: i64| {
        let used = match v & !1 {
            0 => OverrideUse::None,
            2 => OverrideUse::Applied,
            4 => OverrideUse::Invalid,
            _ => return Err(format!("expected a verdict from 0 to 5, got {v}")),
        };
        Ok((v & 1 == 1 && v >= 0, used))
    };
    let nonneg = |v: i64| u64::try_from(v).map_err(|_| format!("expected a count, got {v}"));
    let admitted = flag(ints[0])?;
    let mut results = Vec::with_capacity(n);
    let (verdicts, plans) = ints[1..].split_at(4 * n);
    let mut plans = plans.chunks_exact(2);
    for chunk in verdicts.chunks_exact(4) {
        let (allowed, overridden) = allowed(chunk[0])?;
        let plan = match overridden {
            OverrideUse::Applied => {
                let ab = plans.next().ok_or("a plan's figures missing")?;
                Some([nonneg(ab[0])?, nonneg(ab[1])?])
            }
            _ => None,
        };
        results.push(LimitResult {
            allowed,
            overridden,
            plan,
            remaining: nonneg(chunk[1])?,
            retry_ms: nonneg(chunk[2])?,
            reset_ms: nonneg(chunk[3])?,
        });
    }
    if plans.next().is_some() {
        return Err("more plans' figures than limits a plan decided".to_string());
    }
    Ok(Outcome { admitted, results })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::fake::FakeRequest;

    fn config(limits: &str) -> Config {
        Config::parse(format!(r#"{{"redis":{{"cluster":"webdis"}},"limits":{limits}}}"#).as_bytes())
            .unwrap()
    }

    fn plan(cfg: &Config, req: &FakeRequest) -> Result<Plan, BadRequest> {
        Plan::build(cfg, &RequestLine::read(req), req)
    }

    #[test]
    fn applies_only_matching_limits_with_all_descriptor_parts() {
        let cfg = config(
            r#"[
            {"name":"api","match":{"pathPrefix":"/api"},"descriptor":[{"header":"x-user"}],
             "tokenBucket":{"capacity":10,"refill":1,"periodMs":1000}},
            {"name":"all","descriptor":["clientAddress"],"slidingWindow":{"limit":5,"windowMs":1000}}]"#,
        );
        let p = plan(&cfg, &FakeRequest::new("GET", "/api/x")).unwrap();
        assert_eq!(p.checks.len(), 1, "api limit skipped without x-user");
        assert_eq!(p.checks[0].limit, 1);
        let p = plan(
            &cfg,
            &FakeRequest::new("GET", "/api/x").with("x-user", b"bob"),
        )
        .unwrap();
        assert_eq!(p.checks.len(), 2);
        let p = plan(
            &cfg,
            &FakeRequest::new("GET", "/other").with("x-user", b"bob"),
        )
        .unwrap();
        assert_eq!(p.checks.len(), 1);
    }

    #[test]
    fn keys_of_one_request_share_one_hash_tag() {
        let cfg = config(
            r#"[{"name":"a","tokenBucket":{"capacity":10,"refill":1,"periodMs":1000}},
                {"name":"b","slidingWindow":{"limit":5,"windowMs":1000}}]"#,
        );
        let p = plan(&cfg, &FakeRequest::new("GET", "/")).unwrap();
        let tag = |k: &[u8]| {
            let s = String::from_utf8(k.to_vec()).unwrap();
            let open = s.find('{').unwrap();
            let close = s.find('}').unwrap();
            s[open..=close].to_string()
        };
        assert_eq!(tag(&p.checks[0].key), tag(&p.checks[1].key));
        assert!(String::from_utf8_lossy(&p.checks[0].key).starts_with("rg:rl:{"));
        assert!(String::from_utf8_lossy(&p.checks[1].key).contains(":b:sw.5.1000:"));
    }

    #[test]
    fn cost_header_is_bounded() {
        let cfg = config(
            r#"[{"name":"a","cost":2,"costHeader":{"name":"X-Cost","max":5},
                 "tokenBucket":{"capacity":10,"refill":1,"periodMs":1000}}]"#,
        );
        let base = FakeRequest::new("GET", "/");
        assert_eq!(plan(&cfg, &base).unwrap().checks[0].cost, 2);
        assert_eq!(
            plan(&cfg, &base.clone().with("x-cost", b"5"))
                .unwrap()
                .checks[0]
                .cost,
            5
        );
        for bad in [
            &b"6"[..],
            b"0",
            b"-1",
            b"1.5",
            b"",
            b"99999999999999999999999",
            b"\xff",
        ] {
            let err = plan(&cfg, &base.clone().with("x-cost", bad)).unwrap_err();
            assert!(err.detail.contains("x-cost"), "{}", err.detail);
        }
        // The same header on a shadow limit falls back to the default cost.
        let cfg = config(
            r#"[{"name":"a","cost":2,"shadow":true,"costHeader":{"name":"X-Cost","max":5},
                 "tokenBucket":{"capacity":10,"refill":1,"periodMs":1000}}]"#,
        );
        let p = plan(&cfg, &base.clone().with("x-cost", b"6")).unwrap();
        assert_eq!(p.checks[0].cost, 2);
    }

    /// The number of KEYS and the ARGV of an unkeyed GET under `limits`.
    fn unkeyed_args(limits: &str) -> (usize, Vec<String>) {
        let cfg = config(limits);
        let p = plan(&cfg, &FakeRequest::new("GET", "/")).unwrap();
        let (keys, argv) = p.script_args(&cfg, None, None);
        let argv = argv
            .into_iter()
            .map(|a| String::from_utf8(a).unwrap())
            .collect();
        (keys.len(), argv)
    }

    #[test]
    fn script_args_follow_the_contract() {
        let (keys, argv) = unkeyed_args(
            r#"[{"name":"a","tokenBucket":{"capacity":10,"refill":2,"periodMs":1000}},
                {"name":"b","shadow":true,"slidingWindow":{"limit":5,"windowMs":60000}}]"#,
        );
        assert_eq!(keys, 2);
        // No idempotency flag after the limits: the request carries no key.
        assert_eq!(
            argv,
            ["2", "tb", "10", "2", "1000", "1", "1", "sw", "5", "60000", "0", "1", "0"]
        );
    }

    #[test]
    fn script_args_name_each_new_kind_by_its_code() {
        let (keys, argv) = unkeyed_args(
            r#"[{"name":"g","gcra":{"rate":3,"periodMs":1000,"burst":5},"cost":2},
                {"name":"f","fixedWindow":{"limit":100,"windowMs":60000}},
                {"name":"s","shadow":true,"slidingWindowCounter":{"limit":7,"windowMs":1000}}]"#,
        );
        assert_eq!(keys, 3);
        // gcra: burst, rate, periodMs; the window kinds: limit, windowMs, 0.
        assert_eq!(
            argv,
            [
                "3", "gcra", "5", "3", "1000", "2", "1", "fw", "100", "60000", "0", "1", "1",
                "swc", "7", "1000", "0", "1", "0"
            ]
        );
    }

    #[test]
    fn idempotency_adds_its_key_and_arguments_last() {
        let cfg =
            config(r#"[{"name":"a","tokenBucket":{"capacity":10,"refill":2,"periodMs":1000}}]"#);
        let p = plan(&cfg, &FakeRequest::new("GET", "/")).unwrap();
        let idem = IdemArgs {
            key: b"rg:idem:{t}:r::3:abc".to_vec(),
            owner: "o1".into(),
            fingerprint: "f1".into(),
            lock_ttl_ms: 30000,
        };
        let (keys, argv) = p.script_args(&cfg, Some(&idem), None);
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[1], idem.key);
        let tail: Vec<String> = argv[7..]
            .iter()
            .map(|a| String::from_utf8(a.clone()).unwrap())
            .collect();
        assert_eq!(tail, ["1", "o1", "f1", "30000"]);
    }

    #[test]
    fn parses_idempotency_verdicts() {
        let bulk = |s: &[u8]| Reply::Bulk(Some(s.to_vec()));
        let arr = |v: Vec<Reply>| Reply::Array(Some(v));
        assert_eq!(
            parse_verdict(&arr(vec![bulk(b"2"), bulk(b"2900")]), 0).unwrap(),
            Verdict::Busy { pttl_ms: 2900 }
        );
        assert_eq!(
            parse_verdict(
                &arr(vec![
                    bulk(b"3"),
                    bulk(b"201"),
                    bulk(b"2:ab1:c"),
                    bulk(b"\x00\r\n")
                ]),
                0
            )
            .unwrap(),
            Verdict::Replay {
                status: 201,
                headers: b"2:ab1:c".to_vec(),
                body: b"\x00\r\n".to_vec(),
                object: None,
            }
        );
        let sha = "ab".repeat(32);
        let offloaded = |key: &[u8], sha: &str, len: &[u8]| {
            arr(vec![
                bulk(b"3"),
                bulk(b"200"),
                bulk(b"12:content-type4:text"),
                bulk(b""),
                bulk(key),
                bulk(sha.as_bytes()),
                bulk(len),
            ])
        };
        assert_eq!(
            parse_verdict(&offloaded(b"rg/pay/x", &sha, b"1048576"), 0).unwrap(),
            Verdict::Replay {
                status: 200,
                headers: b"12:content-type4:text".to_vec(),
                body: Vec::new(),
                object: Some(ObjectRef {
                    key: "rg/pay/x".into(),
                    sha256: sha.clone(),
                    len: 1 << 20,
                }),
            }
        );
        for bad in [
            offloaded(b"", &sha, b"1"),
            offloaded(b"k", "abc", b"1"),
            offloaded(b"k", &sha, b"-1"),
            offloaded(b"k", &sha, b"x"),
            offloaded(b"\xff", &sha, b"1"),
        ] {
            assert!(parse_verdict(&bad, 0).is_err(), "{bad:?}");
        }
        assert_eq!(
            parse_verdict(&arr(vec![bulk(b"4")]), 0).unwrap(),
            Verdict::Mismatch
        );
        assert_eq!(
            parse_verdict(
                &arr(vec![
                    bulk(b"5"),
                    bulk(b"2"),
                    bulk(b"15"),
                    bulk(b"1"),
                    bulk(b"31")
                ]),
                2
            )
            .unwrap(),
            Verdict::Anchors(vec![(1, 15), (0, 31)])
        );
        for bad in [
            arr(vec![bulk(b"5")]),
            arr(vec![bulk(b"5"), bulk(b"3"), bulk(b"15")]),
            arr(vec![bulk(b"5"), bulk(b"0"), bulk(b"15")]),
            arr(vec![bulk(b"5"), bulk(b"1"), bulk(b"32")]),
            arr(vec![bulk(b"5"), bulk(b"1"), bulk(b"0")]),
            arr(vec![bulk(b"5"), bulk(b"1"), bulk(b"1"), bulk(b"1")]),
        ] {
            assert!(parse_verdict(&bad, 2).is_err(), "{bad:?}");
        }
        assert!(matches!(
            parse_verdict(&arr(vec![bulk(b"1")]), 0).unwrap(),
            Verdict::Limits(Outcome { admitted: true, .. })
        ));
        for bad in [
            arr(vec![bulk(b"2")]),
            arr(vec![bulk(b"2"), bulk(b"0")]),
            arr(vec![bulk(b"3"), bulk(b"99"), bulk(b""), bulk(b"")]),
            arr(vec![bulk(b"3"), bulk(b"200"), bulk(b"")]),
            arr(vec![bulk(b"6")]),
            arr(vec![]),
        ] {
            assert!(parse_verdict(&bad, 0).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn failure_mode_denies_if_any_enforced_limit_denies() {
        let cfg = config(
            r#"[{"name":"a","failureMode":"deny","shadow":true,"tokenBucket":{"capacity":1,"refill":1,"periodMs":1}},
                {"name":"b","slidingWindow":{"limit":5,"windowMs":1000}}]"#,
        );
        let p = plan(&cfg, &FakeRequest::new("GET", "/")).unwrap();
        assert_eq!(p.failure_mode(&cfg), FailureMode::Allow);
        let cfg = config(
            r#"[{"name":"a","failureMode":"deny","tokenBucket":{"capacity":1,"refill":1,"periodMs":1}}]"#,
        );
        let p = plan(&cfg, &FakeRequest::new("GET", "/")).unwrap();
        assert_eq!(p.failure_mode(&cfg), FailureMode::Deny);
    }

    #[test]
    fn parses_outcomes_and_rejects_odd_replies() {
        let bulk = |s: &str| Reply::Bulk(Some(s.as_bytes().to_vec()));
        let reply = Reply::Array(Some(vec![
            bulk("0"),
            bulk("1"),
            bulk("4"),
            bulk("0"),
            bulk("900"),
            bulk("0"),
            bulk("0"),
            bulk("1500"),
            bulk("1500"),
        ]));
        let o = parse_outcome(&reply, 2).unwrap();
        assert!(!o.admitted);
        assert_eq!(
            o.results[1],
            LimitResult {
                allowed: false,
                remaining: 0,
                retry_ms: 1500,
                reset_ms: 1500,
                overridden: OverrideUse::None,
                plan: None,
            }
        );
        assert!(parse_outcome(&reply, 1).is_err());
        assert!(parse_outcome(&Reply::Int(1), 0).is_err());
        // A plan decided the second limit (3: allowed + 2): its figures
        // follow every verdict; one pair per such limit, no more, no less.
        let planned = |extra: &[&str]| {
            let mut v: Vec<Reply> = ["1", "1", "5", "0", "900", "3", "40", "0", "1500"]
                .iter()
                .map(|s| bulk(s))
                .collect();
            v.extend(extra.iter().map(|s| bulk(s)));
            Reply::Array(Some(v))
        };
        let o = parse_outcome(&planned(&["50", "25"]), 2).unwrap();
        assert_eq!(o.results[0].plan, None);
        assert_eq!(o.results[1].plan, Some([50, 25]));
        assert_eq!(o.results[1].overridden, OverrideUse::Applied);
        assert!(parse_outcome(&planned(&[]), 2).is_err());
        assert!(parse_outcome(&planned(&["50"]), 2).is_err());
        assert!(parse_outcome(&planned(&["50", "25", "1", "1"]), 2).is_err());
        let bad = Reply::Array(Some(vec![bulk("2")]));
        assert!(parse_outcome(&bad, 0).is_err());
        let neg = Reply::Array(Some(vec![
            bulk("1"),
            bulk("1"),
            bulk("-1"),
            bulk("0"),
            bulk("0"),
        ]));
        assert!(parse_outcome(&neg, 1).is_err());
    }

    #[test]
    fn a_lease_reply_decided_by_a_plan_states_it_after_the_tuple() {
        let bulk = |s: &str| Reply::Bulk(Some(s.as_bytes().to_vec()));
        let reply = |v: &[&str]| Reply::Array(Some(v.iter().map(|s| bulk(s)).collect()));
        // lua/lease.lua under a stored plan of 12, 12: verdict 1 + 2, no
        // grant, no tuple, then the plan's capacity and refill.
        let planned = [
            "1", "3", "7", "0", "1500000", "0", "0", "0", "0", "12", "12",
        ];
        let (o, granted, tuple) = parse_lease(&reply(&planned)).unwrap();
        assert!(o.admitted && o.results[0].allowed);
        assert_eq!(o.results[0].overridden, OverrideUse::Applied);
        assert_eq!(o.results[0].plan, Some([12, 12]));
        assert_eq!(o.results[0].remaining, 7);
        assert_eq!((granted, tuple), (0, crate::lease::Tuple::default()));
        // Refused under it: 0 + 2, the plan stated too.
        let refused = [
            "0", "2", "0", "300000", "300000", "0", "0", "0", "0", "12", "12",
        ];
        let (o, _, _) = parse_lease(&reply(&refused)).unwrap();
        assert!(!o.admitted && !o.results[0].allowed);
        assert_eq!(o.results[0].plan, Some([12, 12]));
        // Without a plan, nine items as before; a flag without its figures,
        // or figures without the flag, is no reply.
        let plain = ["1", "1", "91", "0", "9", "8", "1000", "91", "0"];
        let (o, granted, _) = parse_lease(&reply(&plain)).unwrap();
        assert_eq!((o.results[0].plan, granted), (None, 8));
        assert!(parse_lease(&reply(&planned[..9])).is_err());
        let mut stray = plain.to_vec();
        stray.extend(["12", "12"]);
        assert!(parse_lease(&reply(&stray)).is_err());
        assert!(parse_lease(&reply(&planned[..10])).is_err());
    }
}
