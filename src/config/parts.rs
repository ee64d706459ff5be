//! Parts: the request values (a header, the client address, the path, the
//! method, or a literal) that descriptors, tenants and the hash tag are built from.

use std::fmt;

use schemars::JsonSchema;
use serde::Deserialize;

use super::{header_name, ConfigError};
use crate::keys::{hash_tag_of, push_value};
use crate::request::{client_ip, RequestLine, RequestView};

/// One piece of a descriptor: `{"header": "x-user"}`, `{"literal": "free"}`,
/// `"clientAddress"`, `"path"` or `"method"`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Part")]
pub(super) enum RawPart {
    Header(String),
    Literal(String),
    ClientAddress,
    Path,
    Method,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Header(String),
    Literal(String),
    ClientAddress,
    Path,
    Method,
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Part::Header(h) => write!(f, "{{\"header\": \"{h}\"}}"),
            Part::Literal(l) => write!(f, "{{\"literal\": \"{l}\"}}"),
            Part::ClientAddress => write!(f, "\"clientAddress\""),
            Part::Path => write!(f, "\"path\""),
            Part::Method => write!(f, "\"method\""),
        }
    }
}

impl Part {
    /// The value of this part for a request; `None` when a header is missing.
    pub fn value(&self, line: &RequestLine, view: &dyn RequestView) -> Option<Vec<u8>> {
        match self {
            Part::Header(name) => view.header(name),
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
                RawPart::Literal(v) => Part::Literal(v),
                RawPart::ClientAddress => Part::ClientAddress,
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
}
