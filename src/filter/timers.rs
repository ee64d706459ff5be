//! The wake-ups a worker's root owes its streams (retry pauses, slot
//! renewals), earliest first. A heap, not a list: under a concurrency limit
//! every admitted request asks for a renewal seconds ahead, most of them
//! for streams long gone by then, and a tick every millisecond must not
//! look at all of them.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::time::Duration;

struct Entry<T> {
    due: Duration,
    /// Order of arrival: wake-ups due at the same time keep it.
    seq: u64,
    item: T,
}

impl<T> PartialEq for Entry<T> {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.seq) == (other.due, other.seq)
    }
}

impl<T> Eq for Entry<T> {}

impl<T> PartialOrd for Entry<T> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<T> Ord for Entry<T> {
    /// Reversed: the heap's top is the earliest.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.due, other.seq).cmp(&(self.due, self.seq))
    }
}

pub struct Timers<T> {
    heap: BinaryHeap<Entry<T>>,
    seq: u64,
}

impl<T> Default for Timers<T> {
    fn default() -> Self {
        Timers {
            heap: BinaryHeap::new(),
            seq: 0,
        }
    }
}

impl<T> Timers<T> {
    pub fn push(&mut self, due: Duration, item: T) {
        self.seq = self.seq.wrapping_add(1);
        self.heap.push(Entry {
            due,
            seq: self.seq,
            item,
        });
    }

    /// Takes every wake-up due at `now`, earliest first.
    pub fn take_due(&mut self, now: Duration) -> Vec<T> {
        let mut due = Vec::new();
        while self.heap.peek().is_some_and(|e| e.due <= now) {
            if let Some(e) = self.heap.pop() {
                due.push(e.item);
            }
        }
        due
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    pub fn len(&self) -> usize {
        self.heap.len()
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
        t.push(ms(30), "c");
        t.push(ms(10), "a");
        t.push(ms(20), "b1");
        t.push(ms(20), "b2");
        assert!(t.take_due(ms(9)).is_empty());
        assert_eq!(t.take_due(ms(20)), ["a", "b1", "b2"]);
        assert_eq!(t.len(), 1);
        assert_eq!(t.take_due(ms(1000)), ["c"]);
        assert!(t.is_empty());
    }
}
