//! Matchers: which requests a limit or an idempotency rule covers.

use schemars::JsonSchema;
use serde::Deserialize;

use super::{header_name, valid_header_name, ConfigError};
use crate::request::{RequestLine, RequestView};

/// Conditions that must all hold; an empty match covers every request.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Match")]
pub(super) struct RawMatch {
    /// The normalised path starts with this (starts with '/').
    #[serde(default)]
    path_prefix: Option<String>,
    /// The normalised path, without query, equals this.
    #[serde(default)]
    path_exact: Option<String>,
    /// Methods covered (any when empty).
    #[serde(default)]
    methods: Vec<String>,
    /// :authority, without port, case-insensitive.
    #[serde(default)]
    host: Option<String>,
    #[serde(default)]
    headers: Vec<RawHeaderMatch>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "HeaderMatch")]
struct RawHeaderMatch {
    name: String,
    #[serde(default)]
    present: Option<bool>,
    #[serde(default)]
    exact: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    Any,
    Prefix(String),
    Exact(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderCondition {
    Present(bool),
    Exact(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    pub path: PathMatch,
    /// Upper-case; empty means every method.
    pub methods: Vec<String>,
    /// Lower-case, without port.
    pub host: Option<String>,
    pub headers: Vec<(String, HeaderCondition)>,
}

// Evaluated beside the conditions it reads, so that `request` (the request as
// the core sees it) knows nothing of configuration.
impl Matcher {
    pub fn matches(&self, line: &RequestLine, view: &dyn RequestView) -> bool {
        match &self.path {
            PathMatch::Any => {}
            PathMatch::Prefix(p) => {
                if !line.path.starts_with(p.as_bytes()) {
                    return false;
                }
            }
            PathMatch::Exact(p) => {
                if line.path != p.as_bytes() {
                    return false;
                }
            }
        }
        if !self.methods.is_empty() && !self.methods.contains(&line.method) {
            return false;
        }
        if let Some(host) = &self.host {
            if *host != line.host {
                return false;
            }
        }
        self.headers.iter().all(|(name, cond)| {
            let value = view.header(name);
            match cond {
                HeaderCondition::Present(want) => value.is_some() == *want,
                HeaderCondition::Exact(v) => value.as_deref() == Some(v.as_bytes()),
            }
        })
    }
}

pub(super) fn compile_match(raw: RawMatch, at: &str) -> Result<Matcher, ConfigError> {
    let path = match (raw.path_prefix, raw.path_exact) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::new(
                at,
                "set at most one of `pathPrefix` and `pathExact`",
            ))
        }
        (Some(p), None) => PathMatch::Prefix(match_path(p, &format!("{at}.pathPrefix"))?),
        (None, Some(p)) => PathMatch::Exact(match_path(p, &format!("{at}.pathExact"))?),
        (None, None) => PathMatch::Any,
    };
    let mut methods = Vec::with_capacity(raw.methods.len());
    for (i, m) in raw.methods.iter().enumerate() {
        if m.starts_with(':') || !valid_header_name(m) {
            return Err(ConfigError::new(
                format!("{at}.methods[{i}]"),
                format!("`{m}` is not an HTTP method"),
            ));
        }
        methods.push(m.to_ascii_uppercase());
    }
    let host = match raw.host {
        Some(h) if h.is_empty() => {
            return Err(ConfigError::new(format!("{at}.host"), "must not be empty"))
        }
        Some(h) => {
            // Requests are matched on their host without the port.
            let bare = h.strip_prefix('[').map_or(!h.contains(':'), |v6| {
                v6.ends_with(']') && !v6.contains('[')
            });
            if !bare || h.contains('/') || h.bytes().any(|b| !b.is_ascii_graphic()) {
                return Err(ConfigError::new(
                    format!("{at}.host"),
                    "must be a host name without port, path or spaces (it is compared with the request's host, port removed)",
                ));
            }
            Some(h.to_ascii_lowercase())
        }
        None => None,
    };
    let mut headers = Vec::with_capacity(raw.headers.len());
    for (i, h) in raw.headers.into_iter().enumerate() {
        let hat = format!("{at}.headers[{i}]");
        let name = header_name(&h.name, &format!("{hat}.name"))?;
        let cond = match (h.present, h.exact) {
            (Some(p), None) => HeaderCondition::Present(p),
            (None, Some(v)) => HeaderCondition::Exact(v),
            _ => {
                return Err(ConfigError::new(
                    hat,
                    "set exactly one of `present` and `exact`",
                ))
            }
        };
        headers.push((name, cond));
    }
    Ok(Matcher {
        path,
        methods,
        host,
        headers,
    })
}

fn match_path(p: String, field: &str) -> Result<String, ConfigError> {
    if !p.starts_with('/') {
        return Err(ConfigError::new(field, "must start with '/'"));
    }
    if p.contains('?') {
        return Err(ConfigError::new(
            field,
            "must not contain '?': requests are matched on their path without the query string",
        ));
    }
    Ok(p)
}
