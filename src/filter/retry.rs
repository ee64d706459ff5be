//! After a call is refused or fails: the pause before it goes again, and
//! the breaker's bookkeeping. The request's own call (`stage::decision`)
//! and the worker's batches (`stage::batch`) follow both, the root's
//! deferred calls ([`deferred`](crate::filter::deferred)) the pauses, so
//! they sit below all three.

use std::time::Duration;

use crate::breaker::Breaker;
use crate::filter::{Counter, Host};

/// The first pause after a refusal: Webdis needs a moment to reconnect to a
/// restarted Redis; an immediate retry would meet the same 503.
pub const RETRY_DELAY: Duration = Duration::from_millis(25);
/// Pauses one call may take: few enough that a dead Redis costs at most
/// 1 + MAX_PAUSES calls per request.
pub const MAX_PAUSES: u8 = 3;

/// The pause before retry `n` (0-based): 25, 50, 100 ms. Webdis retries its
/// Redis connection on a fixed 100 ms timer, so the pauses together (175 ms)
/// outlast one reconnect; doubling keeps a dead Redis from being asked
/// often.
pub fn pause_before(n: u8) -> Duration {
    RETRY_DELAY * (1u32 << n.min(MAX_PAUSES))
}

/// Tells the breaker a call failed; counts it opening.
pub fn tell_breaker<H: Host>(host: &mut H, breaker: &Breaker) {
    let was_tripped = breaker.tripped();
    if breaker.failure(host.now()) {
        log::warn!("redis-guard: circuit breaker open: Redis calls paused");
        host.count(Counter::CircuitOpened);
        if !was_tripped {
            host.count(Counter::CircuitTripped);
        }
    }
}
