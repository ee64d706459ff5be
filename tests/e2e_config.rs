//! A bad filter configuration in a real Envoy: the filter's `on_configure`
//! refuses it from inside the VM with a log line naming the field and the
//! reason, and Envoy, whose plugin then fails to load, does not start: no
//! listener ever serves traffic without the filter.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::probe::*;
use support::*;

/// A filter configuration with one token bucket of `capacity` (and
/// `extra` inside the limit).
fn config(capacity: &str, extra: &str) -> String {
    format!(
        r#"{{"redis":{{"cluster":"webdis","timeoutMs":500}},
            "limits":[{{"name":"api","tokenBucket":{{"capacity":{capacity},"refill":1,"periodMs":600000}}{extra}}}]}}"#
    )
}

#[test]
fn envoy_refuses_a_bad_configuration_and_its_log_names_the_field() {
    for (cfg, field, reason) in [
        (
            config("0", ""),
            "limits[0].tokenBucket.capacity",
            "must be at least 1",
        ),
        (
            config("5", r#","lease":{"tokens":6,"ttlMs":1000}"#),
            "limits[0].lease.tokens",
            "must be between 1 and the capacity (5)",
        ),
        (
            config("5", r#","costt":1"#),
            "limits[0].costt",
            "unknown field `costt`, expected one of",
        ),
    ] {
        let refused = envoy_refusing(&cfg);
        let log = &refused.log;
        // Envoy exits with an error...
        assert_eq!(refused.status.code(), Some(1), "{field}:\n{log}");
        // ...after the filter, from inside the VM, named the field (a wasm
        // log line at error level: on_configure, not a parser run elsewhere).
        let line = log
            .lines()
            .find(|l| l.contains("wasm log") && l.contains("invalid configuration"))
            .unwrap_or_else(|| panic!("no filter log line for {field}:\n{log}"));
        assert!(line.contains("[error]"), "{line}");
        assert!(
            line.contains(&format!("invalid configuration at `{field}`: {reason}")),
            "{line}"
        );
        // Envoy took on_configure's false as the plugin failing to load.
        assert!(
            log.contains("Failed to configure base Wasm plugin"),
            "{log}"
        );
        assert!(
            log.contains("Unable to create Wasm plugin redis_guard"),
            "{log}"
        );
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", refused.port)).is_err(),
            "something listens on the listener's port"
        );
    }
}

#[test]
fn the_same_configuration_with_a_good_value_starts_and_serves() {
    // The control for the test above: only the value differs, and this one
    // Envoy loads and runs the filter.
    let stack = Stack::start(&config("1", ""), 1);
    let e = stack.envoy();
    assert_eq!(get(&e.url("/x"), &[]).status, 200);
    assert_eq!(get(&e.url("/x"), &[]).status, 429);
    assert!(e
        .log()
        .lines()
        .all(|l| !l.contains("invalid configuration")));
}
