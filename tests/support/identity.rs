//! Identities for the e2e tests: a JWT issuer Envoy's jwt_authn trusts,
//! and a PKI whose client certificates carry the URI SANs (SPIFFE IDs) an
//! mTLS listener verifies. Both are made per run.

use std::net::Ipv4Addr;

use super::{default_jwks, on_path, Scratch};

/// An identity provider for the tests: an ECDSA P-256 key pair made for
/// this run, the JWKS Envoy verifies with, and ES256 tokens it signs.
pub struct Issuer {
    key: jsonwebtoken::EncodingKey,
    jwks: String,
}

/// The issuer envoy/envoy.yaml's jwt_authn provider names.
pub const ISSUER: &str = "https://issuer.example.com";

impl Issuer {
    pub fn new() -> Issuer {
        use base64::engine::general_purpose::URL_SAFE_NO_PAD;
        use base64::Engine;
        let pair = rcgen::KeyPair::generate().unwrap();
        let point = pair.public_key_raw();
        assert_eq!(
            (point.len(), point[0]),
            (65, 4),
            "an uncompressed P-256 point"
        );
        let jwks = serde_json::json!({"keys": [{
            "kty": "EC", "crv": "P-256", "alg": "ES256", "kid": "test-1",
            "x": URL_SAFE_NO_PAD.encode(&point[1..33]),
            "y": URL_SAFE_NO_PAD.encode(&point[33..]),
        }]});
        Issuer {
            key: jsonwebtoken::EncodingKey::from_ec_der(&pair.serialize_der()),
            jwks: jwks.to_string(),
        }
    }

    /// A token with `claims` (issuer and a one-hour expiry added unless
    /// given).
    pub fn token(&self, claims: serde_json::Value) -> String {
        let mut claims = claims;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let obj = claims.as_object_mut().unwrap();
        obj.entry("iss").or_insert(ISSUER.into());
        obj.entry("exp").or_insert((now + 3600).into());
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
        header.kid = Some("test-1".into());
        jsonwebtoken::encode(&header, &claims, &self.key).unwrap()
    }

    /// envoy.yaml whose jwt_authn (before the filter: a token, when sent,
    /// must verify, else 401; its payload goes to dynamic metadata under
    /// `payload`; a request without one passes) trusts this issuer's keys,
    /// on every path.
    pub fn trusted_by(&self, yaml: String) -> String {
        let default = default_jwks();
        assert_eq!(yaml.matches(&default).count(), 1, "one jwt_authn provider");
        // Its rule covers the demo's path only; here, every path.
        let rule = "              - match: { prefix: \"/v1/me\" }\n";
        assert_eq!(yaml.matches(rule).count(), 1, "one jwt_authn rule");
        yaml.replace(&default, &self.jwks)
            .replace(rule, "              - match: { prefix: \"/\" }\n")
    }
}

/// A CA made for this run, a server certificate for 127.0.0.1 and client
/// certificates with the URI SANs the tests name, as PEM files in `dir`.
pub struct Pki {
    dir: Scratch,
    ca: rcgen::Certificate,
    ca_key: rcgen::KeyPair,
}

impl Pki {
    pub fn new() -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};
        let dir = Scratch::new("pki");
        let ca_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "redis-guard test CA");
        let ca = params.self_signed(&ca_key).unwrap();
        std::fs::write(dir.0.join("ca.pem"), ca.pem()).unwrap();
        let pki = Pki { dir, ca, ca_key };
        let mut server = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        server
            .subject_alt_names
            .push(SanType::IpAddress(Ipv4Addr::LOCALHOST.into()));
        pki.issue("server", server);
        pki
    }

    /// Signs `params` with the CA: `<name>.pem` and `<name>.key`.
    pub fn issue(&self, name: &str, params: rcgen::CertificateParams) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        std::fs::write(self.path(&format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(self.path(&format!("{name}.key")), key.serialize_pem()).unwrap();
    }

    /// A client certificate whose URI SAN is `uri`.
    pub fn client(&self, name: &str, uri: &str) {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![rcgen::SanType::URI(uri.try_into().unwrap())];
        self.issue(name, params);
    }

    pub fn path(&self, file: &str) -> String {
        self.dir.0.join(file).display().to_string()
    }

    /// envoy.yaml whose listener speaks TLS and requires a client
    /// certificate signed by the CA.
    pub fn listener(&self, yaml: String) -> String {
        let tls = format!(
            r#"    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          require_client_certificate: true
          common_tls_context:
            tls_certificates:
            - certificate_chain: {{ filename: "{}" }}
              private_key: {{ filename: "{}" }}
            validation_context:
              trusted_ca: {{ filename: "{}" }}
      filters:
"#,
            self.path("server.pem"),
            self.path("server.key"),
            self.path("ca.pem")
        );
        // The ingress listener's chain: the first (the replay route's
        // internal listener comes after it).
        let anchor = "    filter_chains:\n    - filters:\n";
        let first = yaml.find(anchor).unwrap();
        assert!(first < yaml.find("- name: redis_guard_replay").unwrap());
        yaml.replacen(anchor, &format!("    filter_chains:\n{tls}"), 1)
    }

    /// A GET over TLS as client `name` (none: no certificate), by curl; the
    /// status, or 0 when the handshake failed.
    pub fn get(&self, port: u16, path: &str, name: Option<&str>) -> u16 {
        self.get_with(port, path, name, &[])
    }

    /// The same with request headers.
    pub fn get_with(
        &self,
        port: u16,
        path: &str,
        name: Option<&str>,
        headers: &[(&str, &str)],
    ) -> u16 {
        let mut cmd = std::process::Command::new(on_path("curl"));
        cmd.args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "10",
        ])
        .args(["--cacert", &self.path("ca.pem")]);
        for (h, v) in headers {
            cmd.args(["-H", &format!("{h}: {v}")]);
        }
        if let Some(name) = name {
            cmd.args(["--cert", &self.path(&format!("{name}.pem"))])
                .args(["--key", &self.path(&format!("{name}.key"))]);
        }
        let out = cmd
            .arg(format!("https://127.0.0.1:{port}{path}"))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0)
    }
}
