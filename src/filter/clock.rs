//! The host's clock as one callback sees it. Each reading is a host call (a
//! VM crossing), and a callback runs in microseconds: its deadlines, pauses
//! and lease expiries, all in milliseconds, cannot tell its readings apart.
//! So a callback reads the clock at its first use and keeps it; only a
//! call's send time is read afresh, for the latency it starts.

use std::cell::Cell;
use std::time::Duration;

#[derive(Debug, Default)]
pub struct CallbackClock(Cell<Option<Duration>>);

impl CallbackClock {
    /// A clock for a new callback; `known`: a time this callback already
    /// read (a reply's arrival, a tick's).
    pub fn new(known: Option<Duration>) -> CallbackClock {
        CallbackClock(Cell::new(known))
    }

    /// The callback's time: `read` (the host's clock) at the first use only.
    pub fn now(&self, read: impl FnOnce() -> Duration) -> Duration {
        if let Some(now) = self.0.get() {
            return now;
        }
        self.renew(read)
    }

    /// Reads the host's clock now (a call leaving: its latency is timed
    /// from here, not from the callback's start); later uses share it.
    pub fn renew(&self, read: impl FnOnce() -> Duration) -> Duration {
        let now = read();
        self.0.set(Some(now));
        now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_callback_reads_the_clock_once_unless_a_call_leaves() {
        let reads = Cell::new(0u64);
        let read = || {
            reads.set(reads.get() + 1);
            Duration::from_millis(reads.get())
        };
        let clock = CallbackClock::new(None);
        assert_eq!(clock.now(read), Duration::from_millis(1));
        assert_eq!(clock.now(read), Duration::from_millis(1));
        assert_eq!(clock.renew(read), Duration::from_millis(2));
        assert_eq!(clock.now(read), Duration::from_millis(2));
        assert_eq!(reads.get(), 2);
        // A time the callback already read is never read again.
        let known = CallbackClock::new(Some(Duration::from_secs(7)));
        assert_eq!(known.now(read), Duration::from_secs(7));
        assert_eq!(reads.get(), 2);
    }
}
