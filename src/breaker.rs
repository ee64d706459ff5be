//! A circuit breaker for the Redis path, per Envoy worker and group of Redis
//! Cluster slots ([`Breakers`]).
//!
//! After `threshold` consecutive failed calls the breaker opens: requests go
//! straight to their failure mode for `cool_down`, without waiting on a dead
//! Redis. Then one request probes; its success closes the breaker, its
//! failure opens it again. Cells, not a RefCell: nothing here can panic.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use crate::keys::{cluster_slot, key_slot};

#[derive(Debug)]
pub struct Breaker {
    threshold: u32,
    cool_down: Duration,
    failures: Cell<u32>,
    open_until: Cell<Option<Duration>>,
    probing: Cell<bool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed,
    Open,
    /// One probe is in flight; everyone else still takes the failure mode.
    Probing,
}

impl Breaker {
    pub fn new(threshold: u32, cool_down: Duration) -> Breaker {
        Breaker {
            threshold: threshold.max(1),
            cool_down,
            failures: Cell::new(0),
            open_until: Cell::new(None),
            probing: Cell::new(false),
        }
    }

    pub fn state(&self, now: Duration) -> State {
        match self.open_until.get() {
            None => State::Closed,
            Some(_) if self.probing.get() => State::Probing,
            Some(until) if now < until => State::Open,
            Some(_) => State::Probing,
        }
    }

    /// May this request call Redis? Past the cool-down, the first asker
    /// becomes the probe.
    pub fn allow(&self, now: Duration) -> bool {
        match self.open_until.get() {
            None => true,
            Some(until) if now >= until && !self.probing.get() => {
                self.probing.set(true);
                true
            }
            Some(_) => false,
        }
    }

    /// Failed calls since the last success (0 when healthy). The first of a
    /// burst is the one worth a log line; the rest are counted in stats.
    pub fn consecutive_failures(&self) -> u32 {
        self.failures.get()
    }

    /// Returns true when this success closed an open breaker.
    pub fn success(&self) -> bool {
        self.failures.set(0);
        self.probing.set(false);
        self.open_until.take().is_some()
    }

    /// The probe's request ended before its call was answered (client gone):
    /// let the next request probe instead of waiting forever.
    pub fn abandon_probe(&self) {
        self.probing.set(false);
    }

    /// Open or probing: this worker's requests are not all calling Redis.
    pub fn tripped(&self) -> bool {
        self.open_until.get().is_some()
    }

    /// Returns true when this failure opened (or re-opened) the breaker.
    pub fn failure(&self, now: Duration) -> bool {
        let n = self.failures.get().saturating_add(1);
        self.failures.set(n);
        if self.probing.get() || n >= self.threshold {
            self.probing.set(false);
            self.open_until.set(Some(now + self.cool_down));
            return true;
        }
        false
    }
}

/// Slot groups: 64 contiguous ranges of 256 of Redis Cluster's 16384 slots.
/// A master owns whole ranges but for the one or two its boundaries cut, so
/// its failure opens the breakers of its own tenants (and at most those of
/// the one or two groups it shares), not everyone's.
pub const SLOT_GROUPS: usize = 64;
const SLOTS_PER_GROUP: u16 = 16384 / SLOT_GROUPS as u16;

/// A worker's breakers, one per group of Redis Cluster slots: a request
/// consults the one of its hash tag's slot. With one Redis, or one hash tag,
/// every request meets the same one.
#[derive(Debug)]
pub struct Breakers {
    groups: Vec<Rc<Breaker>>,
}

impl Breakers {
    pub fn new(threshold: u32, cool_down: Duration) -> Breakers {
        Breakers {
            groups: (0..SLOT_GROUPS)
                .map(|_| Rc::new(Breaker::new(threshold, cool_down)))
                .collect(),
        }
    }

    /// The group of the slot `tag` hashes to.
    pub fn group(tag: &str) -> usize {
        usize::from(cluster_slot(tag.as_bytes()) / SLOTS_PER_GROUP)
    }

    /// The breaker of `tag`'s slot group; without a tag, group 0 (a request
    /// that needs no Redis key has no call to make anyway).
    pub fn for_tag(&self, tag: Option<&str>) -> Rc<Breaker> {
        self.at(tag.map_or(0, Breakers::group))
    }

    /// The breaker of the group of `key`'s slot: a call's first key, which
    /// `redis_proxy` routes it by. Every key of a call shares one hash tag,
    /// whichever stage built it (limits, an idempotency rule's tenant), so
    /// this is the group of the master that runs the call.
    pub fn for_key(&self, key: Option<&[u8]>) -> Rc<Breaker> {
        self.at(key.map_or(0, |k| usize::from(key_slot(k) / SLOTS_PER_GROUP)))
    }

    fn at(&self, i: usize) -> Rc<Breaker> {
        match self.groups.get(i) {
            Some(b) => Rc::clone(b),
            None => Rc::new(Breaker::new(1, Duration::ZERO)),
        }
    }

    /// How many groups are open or probing (each counted in the gauge).
    pub fn tripped(&self) -> usize {
        self.groups.iter().filter(|b| b.tripped()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn opens_after_consecutive_failures_only() {
        let b = Breaker::new(3, MS(1000));
        assert!(!b.failure(MS(0)));
        assert!(!b.failure(MS(1)));
        assert!(!b.success(), "never opened");
        assert!(!b.failure(MS(2)));
        assert!(!b.failure(MS(3)));
        assert_eq!(b.state(MS(3)), State::Closed);
        assert!(b.failure(MS(4)));
        assert_eq!(b.state(MS(5)), State::Open);
        assert!(!b.allow(MS(5)));
    }

    #[test]
    fn one_probe_after_the_cool_down_closes_or_reopens() {
        let b = Breaker::new(1, MS(100));
        b.failure(MS(0));
        assert!(!b.allow(MS(99)));
        assert!(b.allow(MS(100)), "the probe");
        assert!(!b.allow(MS(101)), "only one probe at a time");
        assert_eq!(b.state(MS(101)), State::Probing);
        assert!(b.failure(MS(150)), "a failed probe reopens");
        assert!(!b.allow(MS(200)));
        assert!(b.allow(MS(250)));
        assert!(b.tripped());
        assert!(b.success(), "the probe's success closes it");
        assert!(!b.tripped());
        assert!(!b.success(), "closing a closed breaker is no transition");
        assert_eq!(b.state(MS(251)), State::Closed);
        assert!(b.allow(MS(251)));
        b.failure(MS(300));
        assert!(b.allow(MS(400)), "a probe");
        b.abandon_probe();
        assert!(
            b.allow(MS(401)),
            "its stream ended unanswered: another probes"
        );
        assert!(!b.allow(MS(402)));
    }

    #[test]
    fn each_slot_group_has_its_own_breaker() {
        let b = Breakers::new(1, MS(1000));
        // "foo" is slot 12182 (group 47), "bar" 5061 (group 19).
        assert_eq!(Breakers::group("foo"), 47);
        assert_eq!(Breakers::group("bar"), 19);
        b.for_tag(Some("foo")).failure(MS(0));
        assert!(!b.for_tag(Some("foo")).allow(MS(1)));
        assert!(
            b.for_tag(Some("bar")).allow(MS(1)),
            "another group calls on"
        );
        assert_eq!(b.tripped(), 1);
        assert!(Rc::ptr_eq(&b.for_tag(None), &b.for_tag(Some(""))));
    }

    #[test]
    fn a_key_meets_the_breaker_of_its_hash_tag() {
        let b = Breakers::new(1, MS(1000));
        for key in [&b"rg:rl:{foo}:w:x"[..], b"rg:idem:{foo}:k", b"{foo}"] {
            assert!(Rc::ptr_eq(&b.for_key(Some(key)), &b.for_tag(Some("foo"))));
        }
        assert!(!Rc::ptr_eq(
            &b.for_key(Some(b"rg:rl:{bar}:w")),
            &b.for_tag(Some("foo"))
        ));
        assert!(Rc::ptr_eq(&b.for_key(None), &b.for_tag(None)));
    }
}
