//! The wake-ups a worker's root owes its streams (retry pauses, slot
//! renewals), earliest first, each owned by a stream. Under a concurrency
//! limit every admitted request asks for a renewal seconds ahead, and most
//! of those streams end long before: a stream's end cancels its wake-ups, so
//! nothing is kept for a stream that is gone and a tick every millisecond
//! looks only at what is due.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

#[derive(Debug, Default)]
pub struct Timers {
    /// (due, arrival order) -> owner.
    by_due: BTreeMap<(Duration, u64), u32>,
    /// owner -> its entries in `by_due`.
    by_owner: HashMap<u32, Vec<(Duration, u64)>>,
    seq: u64,
}

impl Timers {
    pub fn push(&mut self, due: Duration, owner: u32) {
        self.seq = self.seq.wrapping_add(1);
        let key = (due, self.seq);
        self.by_due.insert(key, owner);
        self.by_owner.entry(owner).or_default().push(key);
    }

    /// Takes the owners of every wake-up due at `now`, earliest first (an
    /// owner once per wake-up).
    pub fn take_due(&mut self, now: Duration) -> Vec<u32> {
        let mut due = Vec::new();
        while let Some(entry) = self.by_due.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let (key, owner) = entry.remove_entry();
            if let Some(keys) = self.by_owner.get_mut(&owner) {
                keys.retain(|k| *k != key);
                if keys.is_empty() {
                    self.by_owner.remove(&owner);
                }
            }
            due.push(owner);
        }
        due
    }

    /// Drops every wake-up of `owner` (its stream ended).
    pub fn cancel(&mut self, owner: u32) {
        for key in self.by_owner.remove(&owner).unwrap_or_default() {
            self.by_due.remove(&key);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.by_due.is_empty()
    }

    pub fn len(&self) -> usize {
        self.by_due.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn wake_ups_come_out_when_due_earliest_first_ties_in_arrival_order() {
        let mut t = Timers::default();
        t.push(ms(30), 3);
        t.push(ms(10), 1);
        t.push(ms(20), 21);
        t.push(ms(20), 22);
        assert!(t.take_due(ms(9)).is_empty());
        assert_eq!(t.take_due(ms(20)), [1, 21, 22]);
        assert_eq!(t.len(), 1);
        assert_eq!(t.take_due(ms(1000)), [3]);
        assert!(t.is_empty());
    }

    #[test]
    fn a_stream_that_ended_leaves_no_wake_up_behind() {
        let mut t = Timers::default();
        t.push(ms(10), 7);
        t.push(ms(20), 7);
        t.push(ms(15), 8);
        t.cancel(7);
        assert_eq!(t.len(), 1);
        assert_eq!(t.take_due(ms(100)), [8]);
        assert!(t.is_empty());
        t.cancel(8);
        assert!(t.by_owner.is_empty());
    }
}
