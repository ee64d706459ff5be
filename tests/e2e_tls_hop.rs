//! The Envoy -> Webdis hop encrypted, for plain Envoy: the filter's `webdis`
//! cluster speaks TLS (an UpstreamTlsContext that verifies the server against
//! a CA and its name) to a terminating proxy in front of Webdis (an Envoy
//! listener with a certificate, tcp_proxy on to Webdis on loopback).
//! Certificates are made per run (rcgen). A certificate that does not verify
//! is a failure: the failure mode, never a plaintext call.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use serde_json::json;
use support::*;

const NAME: &str = "webdis.internal";

/// Two CAs (the one that signed Webdis' proxy, and another) and the proxy's
/// certificate for NAME, as files.
struct Pki {
    dir: Scratch,
}

impl Pki {
    fn new() -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
        let dir = Scratch::new("tls-hop");
        let ca = |file: &str| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            // Names of their own: rcgen's default one, the same for every
            // certificate, would make each look self-signed.
            params.distinguished_name.push(DnType::CommonName, file);
            let cert = params.self_signed(&key).unwrap();
            std::fs::write(dir.0.join(file), cert.pem()).unwrap();
            (cert, key)
        };
        let (ca_cert, ca_key) = ca("ca.pem");
        ca("other-ca.pem");
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec![NAME.to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, NAME);
        let cert = params.signed_by(&key, &ca_cert, &ca_key).unwrap();
        std::fs::write(dir.0.join("webdis.pem"), cert.pem()).unwrap();
        std::fs::write(dir.0.join("webdis.key"), key.serialize_pem()).unwrap();
        Pki { dir }
    }

    fn path(&self, file: &str) -> String {
        self.dir.0.join(file).display().to_string()
    }
}

/// envoy.yaml with a TLS listener on `tls_port` that forwards to Webdis on
/// `webdis_port`, and the `webdis` cluster (already pointed at `tls_port`)
/// speaking TLS to it, trusting `trusted_ca`, expecting NAME.
fn tls_hop(
    pki: &Pki,
    tls_port: u16,
    webdis_port: u16,
    trusted_ca: &str,
) -> impl Fn(String) -> String {
    tls_hop_expecting(pki, tls_port, webdis_port, trusted_ca, NAME)
}

/// The same, the cluster expecting the name `expected` (SNI and SAN).
fn tls_hop_expecting(
    pki: &Pki,
    tls_port: u16,
    webdis_port: u16,
    trusted_ca: &str,
    expected: &str,
) -> impl Fn(String) -> String {
    let expected = expected.to_string();
    let (cert, key, ca) = (
        pki.path("webdis.pem"),
        pki.path("webdis.key"),
        pki.path(trusted_ca),
    );
    move |yaml: String| {
        let mut doc: serde_json::Value = serde_yaml_ng::from_str(&yaml).unwrap();
        let resources = &mut doc["static_resources"];
        resources["listeners"].as_array_mut().unwrap().push(json!({
            "name": "webdis_tls",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": tls_port}},
            "filter_chains": [{
                "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                    "common_tls_context": {"tls_certificates": [{
                        "certificate_chain": {"filename": cert},
                        "private_key": {"filename": key}}]}}},
                "filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                    "stat_prefix": "webdis_tls", "cluster": "webdis_plain"}}]}]
        }));
        let clusters = resources["clusters"].as_array_mut().unwrap();
        clusters.push(json!({
            "name": "webdis_plain", "type": "STATIC", "connect_timeout": "0.25s",
            "load_assignment": {"cluster_name": "webdis_plain", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address":
                    {"address": "127.0.0.1", "port_value": webdis_port}}}}]}]}
        }));
        let webdis = clusters.iter_mut().find(|c| c["name"] == "webdis").unwrap();
        webdis["transport_socket"] = json!({"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": expected,
            "common_tls_context": {"validation_context": {
                "trusted_ca": {"filename": ca},
                "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": expected}}]}}}});
        serde_yaml_ng::to_string(&doc).unwrap()
    }
}

fn config(mode: &str) -> String {
    filter_config(2000)
        .failure_mode(mode)
        .limits(
            r#"[{"name":"per-user","descriptor":[{"header":"x-user"}],
                "tokenBucket":{"capacity":3,"refill":1,"periodMs":3600000}}]"#,
        )
        .build()
}

#[test]
fn decisions_cross_a_verified_tls_hop_to_webdis() {
    let pki = Pki::new();
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    let tls_port = free_port();
    let e = Envoy::start_edited(
        &config("deny"),
        tls_port,
        upstream.port,
        tls_hop(&pki, tls_port, webdis.port, "ca.pem"),
    );
    let user = [("x-user", "alice")];
    let st: Vec<u16> = (0..4).map(|_| get(&e.url("/a"), &user).status).collect();
    assert_eq!(st, [200, 200, 200, 429]);
    assert!(admin_stat(e.admin_port, "cluster.webdis.ssl.handshake") >= 1);
    assert_eq!(
        admin_stat(e.admin_port, "cluster.webdis.ssl.fail_verify_error"),
        0
    );
    // Four decisions, the first sent twice (NOSCRIPT, then EVAL).
    assert_eq!(scripts_run(&redis), 5, "every decision crossed the hop");
    assert_eq!(e.counter("redis_guard.redis.script_reloads"), 1);
}

#[test]
fn a_certificate_that_does_not_verify_is_a_failure_never_a_plaintext_call() {
    let pki = Pki::new();
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    for (mode, status) in [("deny", 503), ("allow", 200)] {
        let tls_port = free_port();
        let e = Envoy::start_edited(
            &config(mode),
            tls_port,
            upstream.port,
            tls_hop(&pki, tls_port, webdis.port, "other-ca.pem"),
        );
        let st: Vec<u16> = (0..3)
            .map(|_| get(&e.url("/a"), &[("x-user", "bob")]).status)
            .collect();
        assert_eq!(st, [status; 3], "{mode}");
        assert!(
            admin_stat(e.admin_port, "cluster.webdis.ssl.fail_verify_error") >= 1,
            "{mode}"
        );
        assert_eq!(e.counter("redis_guard.redis.errors"), 3, "{mode}");
    }
    assert_eq!(scripts_run(&redis), 0, "nothing reached Webdis or Redis");
    assert_eq!(upstream.executed(), 3, "allow forwarded its requests");
}

#[test]
fn a_certificate_from_the_trusted_ca_for_another_name_fails_verification_and_takes_the_failure_mode(
) {
    let pki = Pki::new();
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    // The right CA signed it, but for NAME; the cluster expects another name.
    let tls_port = free_port();
    let e = Envoy::start_edited(
        &config("deny"),
        tls_port,
        upstream.port,
        tls_hop_expecting(
            &pki,
            tls_port,
            webdis.port,
            "ca.pem",
            "redis-proxy.internal",
        ),
    );
    let st: Vec<u16> = (0..3)
        .map(|_| get(&e.url("/a"), &[("x-user", "carol")]).status)
        .collect();
    assert_eq!(st, [503; 3], "deny, every time");
    assert!(admin_stat(e.admin_port, "cluster.webdis.ssl.fail_verify_san") >= 1);
    assert_eq!(
        admin_stat(e.admin_port, "cluster.webdis.ssl.fail_verify_error"),
        0,
        "the chain verified: only the name is wrong"
    );
    assert_eq!(e.counter("redis_guard.redis.errors"), 3);
    assert_eq!(scripts_run(&redis), 0, "nothing reached Webdis or Redis");
    assert_eq!(upstream.executed(), 0);
}
