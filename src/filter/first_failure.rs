//! One error line at the first failed Redis call of each kind since the
//! worker's VM started, with what to fix.
//!
//! With the default failure mode (`allow`) a wiring mistake (a wrong
//! `redis.cluster`, Webdis' credentials left out) disables every limit
//! without a single refused request: the failure mode answers, a stat
//! counts, and the decision stage's warning names the reason as one line
//! among many. This line is the one an operator finds at the top of the
//! log: logged once per kind, so a mistake that fails every request writes
//! it once, and a later failure of another kind still gets its own.
//!
//! Only the failure branches of [`super::call`] reach it: the success path
//! pays nothing. The state is one byte per VM (Envoy runs one VM per
//! worker, so each worker logs its own first failure).

use std::cell::Cell;

use crate::config::RedisTarget;
use crate::filter::ErrorKind;

/// Where the user reads what each failure means and how to fix it.
pub const TROUBLESHOOTING: &str = "docs/src/running/troubleshooting.md";

thread_local! {
    /// The kinds already logged, one bit each (`ErrorKind as u8`).
    static LOGGED: Cell<u8> = const { Cell::new(0) };
}

/// Logs `why` at error level if it is this VM's first failure of `kind`.
pub fn note(target: &RedisTarget, kind: ErrorKind, why: &str) {
    let line = LOGGED.with(|logged| first(logged, target, kind, why));
    if let Some(line) = line {
        log::error!("{line}");
    }
}

/// The line for a failure of `kind` if `logged` has none yet (marking it),
/// else `None`.
fn first(logged: &Cell<u8>, target: &RedisTarget, kind: ErrorKind, why: &str) -> Option<String> {
    let bit = 1u8 << (kind as u8);
    if logged.get() & bit != 0 {
        return None;
    }
    logged.set(logged.get() | bit);
    Some(format!(
        "redis-guard: first failed Redis call since start ({}): {why}. Fix: {}. Until it is fixed every request this filter decides takes its failure mode (allow forwards it unlimited, deny answers 503, local spends this Envoy's own budget); `redis-guard doctor --admin <envoy admin>` checks the wiring, {TROUBLESHOOTING} lists each cause",
        kind.name(),
        fix(target, kind)
    ))
}

/// What to check for each kind of failure.
fn fix(target: &RedisTarget, kind: ErrorKind) -> String {
    let cluster = &target.cluster;
    match kind {
        ErrorKind::Dispatch => format!(
            "redis.cluster is `{cluster}`: Envoy must have a cluster of exactly that name in front of Webdis (a typo, or a cluster your Envoy configuration does not define)"
        ),
        ErrorKind::Auth => format!(
            "give Webdis the credentials its http_basic_auth admits, either in redis.credentials or as the Authorization header an upstream header_mutation filter on the `{cluster}` cluster adds (envoy/envoy.yaml); for NOAUTH, WRONGPASS or NOPERM, Webdis' redis_auth and the Redis user's ACL (envoy/redis.acl)"
        ),
        ErrorKind::Timeout => format!(
            "no answer within redis.timeoutMs ({} ms): check that Webdis listens where the `{cluster}` cluster points and reaches Redis, and that timeoutMs is above the callout's round trip",
            target.timeout.as_millis()
        ),
        ErrorKind::Http => format!(
            "the `{cluster}` cluster answered with an HTTP error: check that it points at Webdis and that Webdis reaches Redis"
        ),
        ErrorKind::Redis => {
            "Redis answered an error (quoted above): out of memory, a cluster keys error, a script error".to_string()
        }
        ErrorKind::Reply => format!(
            "a reply the filter cannot read: check that the `{cluster}` cluster points at Webdis (envoy/webdis.json) and nothing rewrites its answers"
        ),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::config::Config;

    fn target() -> RedisTarget {
        Config::parse(br#"{"redis":{"cluster":"webdiss","timeoutMs":80}}"#)
            .unwrap()
            .redis
    }

    #[test]
    fn each_kind_is_logged_once_with_its_fix() {
        let logged = Cell::new(0);
        let t = target();
        let line = first(
            &logged,
            &t,
            ErrorKind::Dispatch,
            "dispatch to cluster `webdiss` refused: BadArgument",
        )
        .unwrap();
        assert_eq!(
            line,
            "redis-guard: first failed Redis call since start (dispatch): dispatch to cluster `webdiss` refused: BadArgument. Fix: redis.cluster is `webdiss`: Envoy must have a cluster of exactly that name in front of Webdis (a typo, or a cluster your Envoy configuration does not define). Until it is fixed every request this filter decides takes its failure mode (allow forwards it unlimited, deny answers 503, local spends this Envoy's own budget); `redis-guard doctor --admin <envoy admin>` checks the wiring, docs/src/running/troubleshooting.md lists each cause"
        );
        assert_eq!(first(&logged, &t, ErrorKind::Dispatch, "again"), None);
        // Another kind still gets its line, once.
        let auth = first(
            &logged,
            &t,
            ErrorKind::Auth,
            "webdis refused the call (HTTP 403)",
        )
        .unwrap();
        assert!(
            auth.contains(
                "(auth): webdis refused the call (HTTP 403). Fix: give Webdis the credentials"
            ),
            "{auth}"
        );
        assert!(auth.contains("on the `webdiss` cluster"), "{auth}");
        assert_eq!(first(&logged, &t, ErrorKind::Auth, "again"), None);
        let timeout = first(
            &logged,
            &t,
            ErrorKind::Timeout,
            "redis call failed or timed out",
        )
        .unwrap();
        assert!(
            timeout.contains("within redis.timeoutMs (80 ms)"),
            "{timeout}"
        );
        // The three not yet met get theirs; then every kind is spent.
        let rest: Vec<bool> = ErrorKind::ALL
            .iter()
            .map(|k| first(&logged, &t, *k, "x").is_some())
            .collect();
        assert_eq!(rest, [false, false, true, true, true, false]);
        for kind in ErrorKind::ALL {
            assert_eq!(first(&logged, &t, kind, "x"), None, "{kind:?}");
        }
        assert_eq!(logged.get(), 0b11_1111);
    }

    #[test]
    fn every_kind_has_its_own_bit() {
        let bits: Vec<u8> = ErrorKind::ALL.iter().map(|k| 1u8 << (*k as u8)).collect();
        let mut seen = 0u8;
        for b in bits {
            assert_eq!(seen & b, 0);
            seen |= b;
        }
    }
}
