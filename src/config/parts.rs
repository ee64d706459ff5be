//! Parts: the request values (a header, a query parameter, the client
//! address or its network prefix, the path, the method, or a literal) that
//! descriptors, tenants and the hash tag are built from.

use std::fmt;

use schemars::JsonSchema;
use serde::Deserialize;

use super::{header_name, ConfigError};
use crate::keys::{hash_tag_of, push_value};
use crate::request::{
    address_prefix, client_ip, grpc_call, query_param, typed_value, RequestLine, RequestView,
    ValueType,
};

/// IPv4 and IPv6 prefix lengths when `clientPrefix` leaves them out.
pub const DEFAULT_V4_PREFIX: u8 = 24;
pub const DEFAULT_V6_PREFIX: u8 = 56;

/// One piece of a descriptor: `{"header": "x-user"}`, `{"query": "api_key"}`,
/// `{"literal": "free"}`, `"clientAddress"`, `{"clientPrefix": {"ipv4": 24,
/// "ipv6": 56}}`, `"path"` or `"method"`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Part")]
pub(super) enum RawPart {
    /// A request header's value by its name, as bytes.
    Header(String),
    /// A query parameter by name: its first value, percent-decoded once.
    Query(String),
    /// A fixed value: one budget shared by every request the limit covers.
    Literal(String),
    /// The client's IP address, without port (the connection's peer unless
    /// Envoy trusts proxy hops of `X-Forwarded-For`).
    ClientAddress,
    /// The client address masked to its network (default /24 and /56).
    ClientPrefix(RawPrefix),
    /// A value in the request's dynamic metadata, which filters before this
    /// one set (`jwt_authn`'s payload, `ext_authz`'s identity).
    Metadata(RawMetadata),
    /// An Envoy attribute by its dotted name, e.g.
    /// `connection.uri_san_peer_certificate` (the mTLS peer's SPIFFE ID
    /// under Istio) or `connection.requested_server_name`.
    Attribute(String),
    /// The request's path, without the query string.
    Path,
    /// The request's method.
    Method,
    /// A gRPC call's service (`shop.v1.Orders` of `/shop.v1.Orders/Create`);
    /// missing for a request that is not gRPC.
    GrpcService,
    /// A gRPC call's method (`Create`).
    GrpcMethod,
}

/// Where in the dynamic metadata the value is, and what it holds.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "MetadataPart")]
pub(super) struct RawMetadata {
    /// The filter namespace, e.g. `envoy.filters.http.jwt_authn`.
    namespace: String,
    /// Keys into its structure, e.g. `["payload", "sub"]`.
    path: Vec<String>,
    /// What the value holds (default `string`): Envoy hands it over
    /// without its type.
    #[serde(default, rename = "type")]
    #[schemars(default = "super::defaults::metadata_type")]
    value_type: Option<RawValueType>,
}

/// The type a metadata value is read as.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(rename = "ValueType")]
pub(super) enum RawValueType {
    /// Text, kept as it is (UTF-8, no control characters).
    String,
    /// A JSON number, written in decimal (integers without a fraction).
    Number,
    /// true or false.
    Bool,
}

/// How many leading bits of the client's address make its network.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "ClientPrefix")]
pub(super) struct RawPrefix {
    /// Bits of an IPv4 address kept (default 24).
    #[serde(default)]
    #[schemars(range(min = 0, max = 32))]
    #[schemars(default = "super::defaults::client_prefix_v4")]
    ipv4: Option<u8>,
    /// Bits of an IPv6 address kept (default 56).
    #[serde(default)]
    #[schemars(range(min = 0, max = 128))]
    #[schemars(default = "super::defaults::client_prefix_v6")]
    ipv6: Option<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Header(String),
    Query(String),
    Literal(String),
    ClientAddress,
    ClientPrefix {
        v4: u8,
        v6: u8,
    },
    /// The attribute path read (its namespace included) and its type.
    Metadata(Vec<String>, ValueType),
    Attribute(Vec<String>),
    Path,
    Method,
    GrpcService,
    GrpcMethod,
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Part::Header(h) => write!(f, "{{\"header\": \"{h}\"}}"),
            Part::Query(q) => write!(f, "{{\"query\": \"{q}\"}}"),
            Part::ClientPrefix { v4, v6 } => {
                write!(
                    f,
                    "{{\"clientPrefix\": {{\"ipv4\": {v4}, \"ipv6\": {v6}}}}}"
                )
            }
            Part::Metadata(p, _) => write!(f, "{{\"metadata\": {:?}}}", &p[2..]),
            Part::Attribute(p) => write!(f, "{{\"attribute\": \"{}\"}}", p.join(".")),
            Part::Literal(l) => write!(f, "{{\"literal\": \"{l}\"}}"),
            Part::ClientAddress => write!(f, "\"clientAddress\""),
            Part::Path => write!(f, "\"path\""),
            Part::Method => write!(f, "\"method\""),
            Part::GrpcService => write!(f, "\"grpcService\""),
            Part::GrpcMethod => write!(f, "\"grpcMethod\""),
        }
    }
}

impl Part {
    /// The value of this part for a request; `None` when a header or query
    /// parameter is missing (or the client address is not an address).
    pub fn value(&self, line: &RequestLine, view: &dyn RequestView) -> Option<Vec<u8>> {
        match self {
            Part::Header(name) => view.header(name),
            Part::Query(name) => query_param(&view.header(":path")?, name),
            Part::ClientPrefix { v4, v6 } => view
                .client_address()
                .and_then(|a| address_prefix(client_ip(&a), *v4, *v6))
                .map(String::into_bytes),
            Part::Metadata(..) | Part::Attribute(_) => match self.read(line, view) {
                Read::Value(v) => Some(v),
                Read::Missing | Read::Invalid(_) => None,
            },
            Part::Literal(v) => Some(v.as_bytes().to_vec()),
            Part::ClientAddress => view
                .client_address()
                .map(|a| client_ip(&a).as_bytes().to_vec()),
            Part::Path => Some(line.path.clone()),
            Part::Method => Some(line.method.as_bytes().to_vec()),
            Part::GrpcService | Part::GrpcMethod => {
                let path = view.header(":path")?;
                let content_type = view.header("content-type");
                let (service, method) = grpc_call(&path, content_type.as_deref())?;
                let value = if *self == Part::GrpcService {
                    service
                } else {
                    method
                };
                Some(value.to_vec())
            }
        }
    }
}

/// A part's value for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read {
    Value(Vec<u8>),
    /// The request has none (a header, a parameter, a claim it lacks).
    Missing,
    /// The request has one of the wrong type (a list or an object where a
    /// string was configured): counted, and treated as missing.
    Invalid(String),
}

impl Part {
    /// The value of this part, telling a missing one from a wrong one.
    pub fn read(&self, line: &RequestLine, view: &dyn RequestView) -> Read {
        let (path, ty) = match self {
            Part::Metadata(path, ty) => (path, *ty),
            Part::Attribute(path) => (path, ValueType::String),
            other => return other.value(line, view).map_or(Read::Missing, Read::Value),
        };
        let keys: Vec<&str> = path.iter().map(String::as_str).collect();
        match view.property(&keys) {
            None => Read::Missing,
            Some(raw) => match typed_value(raw, ty) {
                Ok(v) => Read::Value(v),
                Err(why) => Read::Invalid(format!("{self}: {why}")),
            },
        }
    }
}

/// The encoded descriptor of `parts`: `Missing` when a value it names is
/// missing (as with Envoy's rate-limit actions, the limit then does not
/// apply), `Invalid` when one is of the wrong type (it does not apply
/// either, and is counted).
pub fn descriptor(parts: &[Part], line: &RequestLine, view: &dyn RequestView) -> Read {
    let mut out = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push(b':');
        }
        match part.read(line, view) {
            Read::Value(v) => push_value(&mut out, &v),
            other => return other,
        }
    }
    Read::Value(out)
}

/// The hash tag of a configuration whose `hashTag` depends on no request
/// (none, or literals only): computed once, not per request.
pub(super) fn static_hash_tag(parts: &[Part]) -> Option<String> {
    let values = parts
        .iter()
        .map(|part| match part {
            Part::Literal(v) => Some(v.as_bytes()),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()?;
    Some(hash_tag_of(values))
}

pub(super) fn compile_parts(raw: Vec<RawPart>, at: &str) -> Result<Vec<Part>, ConfigError> {
    raw.into_iter()
        .enumerate()
        .map(|(i, p)| compile_part(p, &format!("{at}[{i}]")))
        .collect()
}

/// One part, `at` naming it in errors.
pub(super) fn compile_part(p: RawPart, at: &str) -> Result<Part, ConfigError> {
    Ok(match p {
        RawPart::Header(name) => Part::Header(header_name(&name, &format!("{at}.header"))?),
        RawPart::Query(name) => {
            if name.is_empty() {
                return Err(ConfigError::new(
                    format!("{at}.query"),
                    "must name a query parameter",
                ));
            }
            Part::Query(name)
        }
        RawPart::Literal(v) => Part::Literal(v),
        RawPart::ClientAddress => Part::ClientAddress,
        RawPart::ClientPrefix(p) => {
            let v4 = p.ipv4.unwrap_or(DEFAULT_V4_PREFIX);
            let v6 = p.ipv6.unwrap_or(DEFAULT_V6_PREFIX);
            if v4 > 32 {
                return Err(ConfigError::new(
                    format!("{at}.clientPrefix.ipv4"),
                    "must be between 0 and 32",
                ));
            }
            if v6 > 128 {
                return Err(ConfigError::new(
                    format!("{at}.clientPrefix.ipv6"),
                    "must be between 0 and 128",
                ));
            }
            Part::ClientPrefix { v4, v6 }
        }
        RawPart::Metadata(m) => {
            if m.namespace.is_empty() {
                return Err(ConfigError::new(
                    format!("{at}.metadata.namespace"),
                    "must name a filter namespace, e.g. `envoy.filters.http.jwt_authn`",
                ));
            }
            if m.path.is_empty() || m.path.iter().any(String::is_empty) {
                return Err(ConfigError::new(
                    format!("{at}.metadata.path"),
                    "must be one or more non-empty keys, e.g. [\"payload\", \"sub\"]",
                ));
            }
            let mut path = vec!["metadata".to_string(), "filter_metadata".to_string()];
            path.push(m.namespace);
            path.extend(m.path);
            let ty = match m.value_type {
                None | Some(RawValueType::String) => ValueType::String,
                Some(RawValueType::Number) => ValueType::Number,
                Some(RawValueType::Bool) => ValueType::Bool,
            };
            Part::Metadata(path, ty)
        }
        RawPart::Attribute(name) => {
            let path: Vec<String> = name.split('.').map(str::to_string).collect();
            if path.iter().any(String::is_empty) {
                return Err(ConfigError::new(
                    format!("{at}.attribute"),
                    "must be a dotted attribute name, e.g. `connection.uri_san_peer_certificate`",
                ));
            }
            Part::Attribute(path)
        }
        RawPart::Path => Part::Path,
        RawPart::Method => Part::Method,
        RawPart::GrpcService => Part::GrpcService,
        RawPart::GrpcMethod => Part::GrpcMethod,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::fake::FakeRequest;

    #[test]
    fn missing_header_means_no_descriptor() {
        let r = FakeRequest::new("GET", "/x");
        let line = RequestLine::read(&r);
        let parts = vec![Part::Header("x-user".into())];
        assert_eq!(descriptor(&parts, &line, &r), Read::Missing);
        let r = r.with("x-user", b"al/ice");
        assert_eq!(
            descriptor(&parts, &line, &r),
            Read::Value(b"6:al/ice".to_vec())
        );
    }

    #[test]
    fn client_address_part_drops_the_port() {
        let r = FakeRequest::new("GET", "/x").addr("127.0.0.9:4242");
        let line = RequestLine::read(&r);
        assert_eq!(
            descriptor(&[Part::ClientAddress, Part::Method, Part::Path], &line, &r),
            Read::Value(b"9:127.0.0.9:3:GET:2:/x".to_vec())
        );
    }

    #[test]
    fn query_and_client_prefix_parts_read_their_values_or_none() {
        let r = FakeRequest::new("GET", "/x?api_key=k%201&n=2").addr("[2001:db8:0:1ff::9]:4242");
        let line = RequestLine::read(&r);
        let parts = vec![
            Part::Query("api_key".into()),
            Part::ClientPrefix { v4: 24, v6: 56 },
        ];
        assert_eq!(
            descriptor(&parts, &line, &r),
            Read::Value(b"3:k 1:19:2001:db8:0:100::/56".to_vec())
        );
        assert_eq!(
            descriptor(&[Part::Query("user".into())], &line, &r),
            Read::Missing
        );
        let r = FakeRequest::new("GET", "/x?api_key=a").addr("198.51.100.7:1");
        let line = RequestLine::read(&r);
        assert_eq!(
            descriptor(&parts, &line, &r),
            Read::Value(b"1:a:15:198.51.100.0/24".to_vec())
        );
    }

    #[test]
    fn metadata_and_attribute_parts_read_typed_values_missing_or_invalid() {
        let jwt = |claim: &str| {
            vec![
                "metadata".to_string(),
                "filter_metadata".into(),
                "envoy.filters.http.jwt_authn".into(),
                "payload".into(),
                claim.to_string(),
            ]
        };
        let ns = "envoy.filters.http.jwt_authn";
        let r = FakeRequest::new("GET", "/x")
            .prop(
                &["metadata", "filter_metadata", ns, "payload", "sub"],
                b"alice",
            )
            .prop(
                &["metadata", "filter_metadata", ns, "payload", "org"],
                &7f64.to_le_bytes(),
            )
            .prop(
                &["metadata", "filter_metadata", ns, "payload", "roles"],
                b"\x01\0\0\0\x01\0\0\0\0\0\0\0a\0\0",
            )
            .prop(
                &["source", "principal"],
                b"spiffe://cluster.local/ns/a/sa/b",
            );
        let line = RequestLine::read(&r);
        let sub = Part::Metadata(jwt("sub"), ValueType::String);
        let org = Part::Metadata(jwt("org"), ValueType::Number);
        let principal = Part::Attribute(vec!["source".into(), "principal".into()]);
        assert_eq!(
            descriptor(&[sub.clone(), org, principal], &line, &r),
            Read::Value(b"5:alice:1:7:32:spiffe://cluster.local/ns/a/sa/b".to_vec())
        );
        let missing = Part::Metadata(jwt("tenant"), ValueType::String);
        assert_eq!(
            descriptor(&[sub.clone(), missing], &line, &r),
            Read::Missing
        );
        let roles = Part::Metadata(jwt("roles"), ValueType::String);
        assert!(matches!(
            descriptor(&[sub, roles.clone()], &line, &r),
            Read::Invalid(why) if why.contains("roles")
        ));
        assert_eq!(roles.value(&line, &r), None, "a wrong type is no value");
    }
}
