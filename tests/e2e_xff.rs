//! A client cannot choose the address its requests are counted under: the
//! shipped envoy/envoy.yaml (`use_remote_address: true`,
//! `xff_num_trusted_hops: 0`) keys `clientAddress` on the connection's peer,
//! so a forged `X-Forwarded-For` neither moves a request into a fresh budget
//! nor out of its own, over IPv4 and IPv6. With one trusted proxy in front
//! (`xff_num_trusted_hops: 1`) the address that proxy appended counts, and
//! whatever the client wrote before it does not.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::net::TcpListener;

use support::*;

/// A window no run crosses the edge of: 2^40 ms, aligned to the Unix epoch.
const LONG_WINDOW_MS: u64 = 1 << 40;
/// Requests per client address.
const LIMIT: usize = 3;

/// `LIMIT` requests per `clientAddress` on /c/.
fn config() -> String {
    filter_config(1000)
        .limits(&format!(
            r#"[{{"name":"per-client","match":{{"pathPrefix":"/c/"}},"descriptor":["clientAddress"],
                 "fixedWindow":{{"limit":{LIMIT},"windowMs":{LONG_WINDOW_MS}}}}}]"#
        ))
        .build()
}

/// The per-client keys in Redis, sorted.
fn client_keys(stack: &Stack) -> Vec<String> {
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:per-client:*")
        .query(&mut stack.redis.conn())
        .unwrap();
    keys.sort();
    keys
}

/// The statuses of `LIMIT + 1` requests to `url`, the i-th carrying
/// `X-Forwarded-For: forged(i)`.
fn statuses(url: &str, forged: impl Fn(usize) -> String) -> Vec<u16> {
    (0..=LIMIT)
        .map(|i| get(url, &[("x-forwarded-for", &forged(i))]).status)
        .collect()
}

fn admitted_then_limited() -> Vec<u16> {
    let mut want = vec![200; LIMIT];
    want.push(429);
    want
}

#[test]
fn a_forged_x_forwarded_for_counts_in_the_real_ipv4_clients_one_budget() {
    let stack = Stack::start(&config(), 1);
    let url = stack.envoy().url("/c/x");
    // The first the address the issue reproduced with, then a new one each
    // time: none of them is a budget of its own.
    let forged = |i: usize| {
        if i == 0 {
            "203.0.113.8".to_string()
        } else {
            format!("203.0.113.{}, 198.51.100.{i}", 8 + i)
        }
    };
    assert_eq!(statuses(&url, forged), admitted_then_limited());
    // Nor does a header take a request out of the budget it spent.
    assert_eq!(get(&url, &[]).status, 429);
    assert_eq!(get(&url, &[("x-forwarded-for", "127.0.0.9")]).status, 429);
    assert_eq!(stack.upstream.executed(), LIMIT as u64);
    let keys = client_keys(&stack);
    assert!(
        keys.len() == 1 && keys[0].ends_with(":127.0.0.1"),
        "{keys:?}"
    );
}

/// A port nothing listens on at [::1] (a TCP port number is per address
/// family: 127.0.0.1's free ports say nothing about ::1's), taken from
/// `free_port`'s claimed range: an ephemeral port (`[::1]:0`) could be
/// given to any process' outgoing connection before Envoy binds it.
fn free_port_v6() -> u16 {
    for _ in 0..100 {
        let port = free_port();
        match TcpListener::bind(("::1", port)) {
            Ok(_) => return port,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
            Err(e) => panic!("bind [::1]: the loopback interface has no IPv6 address ({e})"),
        }
    }
    panic!("no port free on both 127.0.0.1 and [::1] in 100 tries");
}

/// envoy.yaml with the public listener also listening on [::1]:`port`
/// (`additional_addresses`: the support code waits for 127.0.0.1, which it
/// keeps).
fn also_on_ipv6(port: u16) -> impl Fn(String) -> String {
    move |yaml: String| {
        let listener = "  - name: ingress\n    address:\n";
        let at = yaml.find(listener).expect("the ingress listener");
        let line_end = at + listener.len() + yaml[at + listener.len()..].find('\n').unwrap() + 1;
        assert!(yaml[at + listener.len()..line_end].contains("socket_address"));
        format!(
            "{}    additional_addresses:\n    - address:\n        socket_address: {{ address: \"::1\", port_value: {port} }}\n{}",
            &yaml[..line_end],
            &yaml[line_end..]
        )
    }
}

#[test]
fn a_forged_x_forwarded_for_counts_in_the_real_ipv6_clients_one_budget() {
    let port = free_port_v6();
    let stack = Stack::start_edited(&config(), 1, also_on_ipv6(port));
    wait_for_port_v6(port);
    let url = format!("http://[::1]:{port}/c/x");
    let forged = |i: usize| {
        if i == 0 {
            "2001:db8::8".to_string()
        } else {
            format!("2001:db8::{:x}, 2001:db8:1::{i}", 8 + i)
        }
    };
    assert_eq!(statuses(&url, forged), admitted_then_limited());
    assert_eq!(get(&url, &[]).status, 429);
    // IPv4 on the same listener is another client, with its own budget.
    assert_eq!(get(&stack.envoy().url("/c/x"), &[]).status, 200);
    assert_eq!(stack.upstream.executed(), LIMIT as u64 + 1);
    let keys = client_keys(&stack);
    assert!(
        keys.len() == 2
            && keys.iter().any(|k| k.ends_with(":127.0.0.1"))
            && keys.iter().any(|k| k.ends_with(":::1")),
        "{keys:?}"
    );
}

/// Envoy listens on all its addresses once /ready says so; this bounds the
/// wait for the extra one rather than assuming it.
fn wait_for_port_v6(port: u16) {
    let start = std::time::Instant::now();
    while std::net::TcpStream::connect(("::1", port)).is_err() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "Envoy did not listen on [::1]:{port}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn behind_one_trusted_proxy_the_address_it_appended_counts_and_the_clients_own_entries_do_not() {
    let stack = Stack::start_edited(&config(), 1, behind_one_proxy);
    let url = stack.envoy().url("/c/x");
    // The proxy appended 198.51.100.7, the address it saw; what the client
    // wrote before it changes each time and does not matter.
    let via_proxy = |i: usize| format!("203.0.113.{}, 198.51.100.7", 8 + i);
    assert_eq!(statuses(&url, via_proxy), admitted_then_limited());
    // Another client behind the same proxy has its own budget.
    assert_eq!(
        get(&url, &[("x-forwarded-for", "203.0.113.8, 198.51.100.9")]).status,
        200
    );
    assert_eq!(stack.upstream.executed(), LIMIT as u64 + 1);
    let keys = client_keys(&stack);
    assert!(
        keys.len() == 2 && keys[0].ends_with(":198.51.100.7") && keys[1].ends_with(":198.51.100.9"),
        "{keys:?}"
    );
}
