//! Parts: the request values (a header, the client address, the path, the
//! method, or a literal) that descriptors, tenants and the hash tag are built from.

use std::fmt;

use schemars::JsonSchema;
use serde::Deserialize;

use super::{header_name, ConfigError};

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
