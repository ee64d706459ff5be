//! Parts: the request values (a header, a query parameter, the client
//! address or its network prefix, the path, the method, or a literal) that
//! descriptors, tenants and the hash tag are built from.

use std::fmt;

use schemars::JsonSchema;
use serde::Deserialize;

use super::{header_name, ConfigError};
use crate::keys::{hash_tag_of, push_value};
use crate::request::{address_prefix, client_ip, query_param, RequestLine, RequestView};

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
    Header(String),
    /// A query parameter by name: its first value, percent-decoded once.
    Query(String),
    Literal(String),
    ClientAddress,
    /// The client address masked to its network (default /24 and /56).
    ClientPrefix(RawPrefix),
    Path,
    Method,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "ClientPrefix")]
pub(super) struct RawPrefix {
    /// Bits of an IPv4 address kept (default 24).
    #[serde(default)]
    #[schemars(range(min = 0, max = 32))]
    ipv4: Option<u8>,
    /// Bits of an IPv6 address kept (default 56).
    #[serde(default)]
    #[schemars(range(min = 0, max = 128))]
    ipv6: Option<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Header(String),
    Query(String),
    Literal(String),
    ClientAddress,
    ClientPrefix { v4: u8, v6: u8 },
    Path,
    Method,
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
            Part::Literal(l) => write!(f, "{{\"literal\": \"{l}\"}}"),
            Part::ClientAddress => write!(f, "\"clientAddress\""),
            Part::Path => write!(f, "\"path\""),
            Part::Method => write!(f, "\"method\""),
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
            Part::Literal(v) => Some(v.as_bytes().to_vec()),
            Part::ClientAddress => view
                .client_address()
                .map(|a| client_ip(&a).as_bytes().to_vec()),
            Part::Path => Some(line.path.clone()),
            Part::Method => Some(line.method.as_bytes().to_vec()),
        }
    }
}

/// The encoded descriptor of `parts`, or `None` when a header it names is
/// missing (as with Envoy's rate-limit actions, the limit then does not apply).
pub fn descriptor(parts: &[Part], line: &RequestLine, view: &dyn RequestView) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push(b':');
        }
        push_value(&mut out, &part.value(line, view)?);
    }
    Some(out)
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
        .map(|(i, p)| {
            Ok(match p {
                RawPart::Header(name) => {
                    Part::Header(header_name(&name, &format!("{at}[{i}].header"))?)
                }
                RawPart::Query(name) => {
                    if name.is_empty() {
                        return Err(ConfigError::new(
                            format!("{at}[{i}].query"),
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
                            format!("{at}[{i}].clientPrefix.ipv4"),
                            "must be between 0 and 32",
                        ));
                    }
                    if v6 > 128 {
                        return Err(ConfigError::new(
                            format!("{at}[{i}].clientPrefix.ipv6"),
                            "must be between 0 and 128",
                        ));
                    }
                    Part::ClientPrefix { v4, v6 }
                }
                RawPart::Path => Part::Path,
                RawPart::Method => Part::Method,
            })
        })
        .collect()
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
        assert_eq!(descriptor(&parts, &line, &r), None);
        let r = r.with("x-user", b"al/ice");
        assert_eq!(descriptor(&parts, &line, &r), Some(b"6:al/ice".to_vec()));
    }

    #[test]
    fn client_address_part_drops_the_port() {
        let r = FakeRequest::new("GET", "/x").addr("127.0.0.9:4242");
        let line = RequestLine::read(&r);
        assert_eq!(
            descriptor(&[Part::ClientAddress, Part::Method, Part::Path], &line, &r),
            Some(b"9:127.0.0.9:3:GET:2:/x".to_vec())
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
            Some(b"3:k 1:19:2001:db8:0:100::/56".to_vec())
        );
        assert_eq!(descriptor(&[Part::Query("user".into())], &line, &r), None);
        let r = FakeRequest::new("GET", "/x?api_key=a").addr("198.51.100.7:1");
        let line = RequestLine::read(&r);
        assert_eq!(
            descriptor(&parts, &line, &r),
            Some(b"1:a:15:198.51.100.0/24".to_vec())
        );
    }
}
