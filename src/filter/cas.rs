//! The one bounded read-modify-write over the Envoy's shared data, which
//! every worker of one Envoy sees (local budgets, leases).

use crate::filter::Host;

/// How an update ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Update {
    Written,
    /// The change declined to write (nothing to do with what it read).
    Declined,
    /// Every attempt lost its race: the caller picks the safe side.
    Contended,
}

/// Attempts before giving up: under contention a worker retries a few
/// times, then takes the caller's safe side rather than spin.
const ATTEMPTS: usize = 8;

/// Reads `key`, lets `change` compute the new value from what it read (or
/// decline with `None`), and writes it back only if nobody wrote meanwhile.
pub fn update<H: Host>(
    host: &mut H,
    key: &str,
    mut change: impl FnMut(Option<&[u8]>) -> Option<Vec<u8>>,
) -> Update {
    for _ in 0..ATTEMPTS {
        let (stored, cas) = host.shared_get(key);
        let Some(bytes) = change(stored.as_deref()) else {
            return Update::Declined;
        };
        if host.shared_set(key, &bytes, create_or_swap(cas)) {
            return Update::Written;
        }
    }
    Update::Contended
}

/// The compare-and-swap token for writing back what was read: the one read,
/// or, when the key did not exist, one no existing key carries. Envoy checks a
/// token only against a key that exists and writes a missing key whatever
/// the token, so without this two workers that both found the key missing
/// would both "create" it and one write would be lost (a local budget or a
/// lease counted twice). With it, the second creator fails and reads again.
pub fn create_or_swap(cas: Option<u32>) -> Option<u32> {
    Some(cas.unwrap_or(CREATE_ONLY))
}

/// Envoy hands out tokens from one counter starting at 1: this one is
/// reached only after four billion writes, and then matches one key at most.
const CREATE_ONLY: u32 = u32::MAX;
