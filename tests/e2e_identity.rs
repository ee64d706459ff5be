//! Limits keyed on who the caller is, end to end through a real Envoy: a
//! query parameter (its first value, percent-decoded once) and the client's
//! network prefix (addresses of one /24 share a budget). Requests come from
//! chosen loopback sources (Linux routes all of 127.0.0.0/8 to lo).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::time::Duration;

use socket2::{Domain, Socket, Type};
use support::*;

/// 2 an hour per `api_key` on /q/, 3 an hour per client /24 on /n/.
fn config() -> String {
    filter_config(1000)
        .limits(
            r#"[{"name":"per-key","match":{"pathPrefix":"/q/"},"descriptor":[{"query":"api_key"}],
                 "fixedWindow":{"limit":2,"windowMs":3600000}},
                {"name":"per-net","match":{"pathPrefix":"/n/"},"descriptor":[{"clientPrefix":{"ipv4":24}}],
                 "fixedWindow":{"limit":3,"windowMs":3600000}}]"#,
        )
        .build()
}

#[test]
fn a_query_parameter_budget_is_per_decoded_first_value_and_absent_means_unlimited() {
    let stack = Stack::start(&config(), 1);
    let e = stack.envoy();
    let status = |path: &str| get(&e.url(path), &[]).status;
    assert_eq!(status("/q/a?api_key=a%20b"), 200);
    // The same key: decoded, first of two, among other parameters.
    assert_eq!(status("/q/b?x=1&api_key=a%20b&api_key=zzz"), 200);
    assert_eq!(status("/q/a?api_key=a%20b"), 429);
    // Other keys: `+` is not a space; %2520 decodes once, to %20.
    assert_eq!(status("/q/a?api_key=a+b"), 200);
    assert_eq!(status("/q/a?api_key=a%2520b"), 200);
    assert_eq!(status("/q/a?api_key=zzz"), 200);
    // Without the parameter the limit does not apply.
    for _ in 0..5 {
        assert_eq!(status("/q/a?other=1"), 200);
    }
    assert_eq!(stack.upstream.executed(), 2 + 3 + 5);
}

/// A GET of `path` from `source` (a loopback address), its status.
fn get_from(source: Ipv4Addr, port: u16, path: &str) -> u16 {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    socket
        .bind(&SocketAddrV4::new(source, 0).into())
        .unwrap_or_else(|e| panic!("bind {source}: {e}"));
    socket
        .connect_timeout(
            &SocketAddrV4::new(Ipv4Addr::LOCALHOST, port).into(),
            Duration::from_secs(5),
        )
        .unwrap();
    let mut s: TcpStream = socket.into();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    s.write_all(&raw_request_bytes(
        "GET",
        path,
        "connection: close\r\n",
        &[],
        b"",
    ))
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let line = String::from_utf8_lossy(&out);
    line.split(' ').nth(1).unwrap().parse().unwrap()
}

#[test]
fn addresses_in_one_ipv4_prefix_share_a_budget_and_other_prefixes_have_their_own() {
    let stack = Stack::start(&config(), 1);
    let port = stack.envoy().port;
    let ip = |s: &str| s.parse::<Ipv4Addr>().unwrap();
    // 127.0.0.2 and 127.0.0.3 are one /24: three between them.
    assert_eq!(get_from(ip("127.0.0.2"), port, "/n/x"), 200);
    assert_eq!(get_from(ip("127.0.0.2"), port, "/n/x"), 200);
    assert_eq!(get_from(ip("127.0.0.3"), port, "/n/x"), 200);
    assert_eq!(get_from(ip("127.0.0.3"), port, "/n/x"), 429);
    assert_eq!(get_from(ip("127.0.0.2"), port, "/n/x"), 429);
    // 127.0.1.2 is another /24, with its own three.
    for _ in 0..3 {
        assert_eq!(get_from(ip("127.0.1.2"), port, "/n/x"), 200);
    }
    assert_eq!(get_from(ip("127.0.1.2"), port, "/n/x"), 429);
    assert_eq!(stack.upstream.executed(), 6);
}
