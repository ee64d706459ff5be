//! Matchers: which requests a limit or an idempotency rule covers.

use schemars::JsonSchema;
use serde::Deserialize;

use super::parts::{compile_part, Part, RawPart};
use super::{header_name, valid_header_name, ConfigError};
use crate::networks::Networks;
use crate::request::{RequestLine, RequestView};

/// The largest compiled `regex` (bytes of its program): bounds what one
/// pattern may cost the VM.
const REGEX_SIZE_LIMIT: usize = 1 << 20;

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
    /// Conditions on request headers.
    #[serde(default)]
    #[schemars(default = "super::defaults::no_items")]
    headers: Vec<RawHeaderMatch>,
    /// Conditions on descriptor parts' values (a JWT claim, an attribute,
    /// a query parameter).
    #[serde(default)]
    #[schemars(default = "super::defaults::no_items")]
    values: Vec<RawValueMatch>,
    /// The client's address is in one of these networks (`192.0.2.0/24`,
    /// `2001:db8::/32`, a single address); an IPv4-mapped IPv6 client counts
    /// as IPv4. Entries must not overlap, nor set host bits.
    #[serde(default)]
    client_networks: Vec<String>,
}

/// A header and one of `present`, `exact`, `prefix`, `regex` and `oneOf`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "HeaderMatch")]
struct RawHeaderMatch {
    /// The header's name (case-insensitive).
    name: String,
    /// true: the header is there; false: it is not.
    #[serde(default)]
    present: Option<bool>,
    /// The value equals this.
    #[serde(default)]
    exact: Option<String>,
    /// The value starts with this.
    #[serde(default)]
    prefix: Option<String>,
    /// Matched against the whole value, as bytes, in linear time.
    #[serde(default)]
    regex: Option<String>,
    /// Equal to one of these values.
    #[serde(default)]
    one_of: Option<Vec<String>>,
}

/// A descriptor part and one of `present`, `exact`, `prefix`, `regex` and `oneOf`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "ValueMatch")]
struct RawValueMatch {
    /// The descriptor part whose value is tested.
    part: RawPart,
    /// true: the part has a value; false: it has none (or one of the wrong type).
    #[serde(default)]
    present: Option<bool>,
    /// The value equals this.
    #[serde(default)]
    exact: Option<String>,
    /// The value starts with this.
    #[serde(default)]
    prefix: Option<String>,
    /// Matched against the whole value, as bytes, in linear time.
    #[serde(default)]
    regex: Option<String>,
    /// Equal to one of these values.
    #[serde(default)]
    one_of: Option<Vec<String>>,
}

/// The condition fields both kinds of match carry. (Written out in each:
/// serde cannot deny unknown fields across a `flatten`, and the config is
/// strict.)
type RawCondition = (
    Option<bool>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<Vec<String>>,
);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    Any,
    Prefix(String),
    Exact(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    Present(bool),
    Exact(String),
    Prefix(String),
    Regex(Pattern),
    OneOf(std::collections::BTreeSet<Vec<u8>>),
}

/// A compiled `regex`, anchored at both ends.
#[derive(Debug, Clone)]
pub struct Pattern(regex::bytes::Regex);

impl PartialEq for Pattern {
    fn eq(&self, other: &Pattern) -> bool {
        self.0.as_str() == other.0.as_str()
    }
}

impl Eq for Pattern {}

impl Condition {
    fn holds(&self, value: Option<&[u8]>) -> bool {
        match self {
            Condition::Present(want) => value.is_some() == *want,
            Condition::Exact(v) => value == Some(v.as_bytes()),
            Condition::Prefix(p) => value.is_some_and(|v| v.starts_with(p.as_bytes())),
            Condition::Regex(r) => value.is_some_and(|v| r.0.is_match(v)),
            Condition::OneOf(set) => value.is_some_and(|v| set.contains(v)),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    pub path: PathMatch,
    /// Upper-case; empty means every method.
    pub methods: Vec<String>,
    /// Lower-case, without port.
    pub host: Option<String>,
    pub headers: Vec<(String, Condition)>,
    pub values: Vec<(Part, Condition)>,
    pub networks: Option<Networks>,
}

// Evaluated beside the conditions it reads, so that `request` (the request as
// the core sees it) knows nothing of configuration.
impl Matcher {
    /// Whether it holds for every request (no condition at all).
    pub fn is_empty(&self) -> bool {
        self.path == PathMatch::Any
            && self.methods.is_empty()
            && self.host.is_none()
            && self.headers.is_empty()
            && self.values.is_empty()
            && self.networks.is_none()
    }

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
        if let Some(networks) = &self.networks {
            if !view.client_address().is_some_and(|a| networks.contains(&a)) {
                return false;
            }
        }
        self.headers
            .iter()
            .all(|(name, cond)| cond.holds(view.header(name).as_deref()))
            && self
                .values
                .iter()
                .all(|(part, cond)| cond.holds(part.value(line, view).as_deref()))
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
        let condition = (h.present, h.exact, h.prefix, h.regex, h.one_of);
        headers.push((name, compile_condition(condition, &hat)?));
    }
    let mut values = Vec::with_capacity(raw.values.len());
    for (i, v) in raw.values.into_iter().enumerate() {
        let vat = format!("{at}.values[{i}]");
        let part = compile_part(v.part, &format!("{vat}.part"))?;
        let condition = (v.present, v.exact, v.prefix, v.regex, v.one_of);
        values.push((part, compile_condition(condition, &vat)?));
    }
    let networks = if raw.client_networks.is_empty() {
        None
    } else {
        Some(Networks::parse(&raw.client_networks).map_err(|bad| {
            ConfigError::new(format!("{at}.clientNetworks[{}]", bad.index), bad.reason)
        })?)
    };
    Ok(Matcher {
        path,
        methods,
        host,
        headers,
        values,
        networks,
    })
}

fn compile_condition(raw: RawCondition, at: &str) -> Result<Condition, ConfigError> {
    Ok(match raw {
        (Some(p), None, None, None, None) => Condition::Present(p),
        (None, Some(v), None, None, None) => Condition::Exact(v),
        (None, None, Some(p), None, None) => Condition::Prefix(p),
        (None, None, None, None, Some(list)) => {
            if list.is_empty() {
                return Err(ConfigError::new(
                    format!("{at}.oneOf"),
                    "must name at least one value (an empty list matches nothing)",
                ));
            }
            Condition::OneOf(list.into_iter().map(String::into_bytes).collect())
        }
        (None, None, None, Some(r), None) => {
            let build = |pattern: &str| {
                regex::bytes::RegexBuilder::new(pattern)
                    .unicode(false)
                    .size_limit(REGEX_SIZE_LIMIT)
                    .build()
                    .map_err(|e| {
                        let why = e.to_string();
                        let why = why.lines().last().unwrap_or("invalid").trim().to_string();
                        ConfigError::new(
                            format!("{at}.regex"),
                            format!("is not a valid regex ({why}); it is matched against the whole value, as bytes"),
                        )
                    })
            };
            // Alone first: a pattern such as `a)|(?:b` compiles only once
            // wrapped, and would then escape the anchors.
            build(&r)?;
            let compiled = build(&format!("^(?:{r})$"))?;
            Condition::Regex(Pattern(compiled))
        }
        _ => {
            return Err(ConfigError::new(
                at,
                "set exactly one of `present`, `exact`, `prefix`, `regex` and `oneOf`",
            ))
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::fake::FakeRequest;

    fn matcher(json: &str) -> Result<Matcher, ConfigError> {
        let raw: RawMatch = serde_json::from_str(json).unwrap();
        compile_match(raw, "match")
    }

    fn holds(m: &Matcher, r: &FakeRequest) -> bool {
        m.matches(&RequestLine::read(r), r)
    }

    #[test]
    fn header_conditions_are_present_exact_prefix_or_a_whole_value_regex() {
        let m = matcher(
            r#"{"headers":[{"name":"x-plan","prefix":"free"},
                           {"name":"x-user","regex":"svc-[0-9]+"}]}"#,
        )
        .unwrap();
        let r = |plan: &[u8], user: &[u8]| {
            FakeRequest::new("GET", "/")
                .with("x-plan", plan)
                .with("x-user", user)
        };
        assert!(holds(&m, &r(b"free-tier", b"svc-12")));
        assert!(!holds(&m, &r(b"pro", b"svc-12")));
        // The regex covers the whole value.
        assert!(!holds(&m, &r(b"free", b"svc-12x")));
        assert!(!holds(&m, &r(b"free", b"my-svc-12")));
        // Bytes, not text: a non-UTF-8 value is matched too.
        let bytes = matcher(r#"{"headers":[{"name":"x-user","regex":"a.b"}]}"#).unwrap();
        assert!(holds(
            &bytes,
            &FakeRequest::new("GET", "/").with("x-user", b"a\xffb")
        ));
        assert!(!holds(
            &m,
            &FakeRequest::new("GET", "/").with("x-plan", b"free")
        ));
    }

    #[test]
    fn value_conditions_read_descriptor_parts() {
        let m = matcher(r#"{"values":[{"part":{"query":"plan"},"exact":"free"}]}"#).unwrap();
        assert!(holds(&m, &FakeRequest::new("GET", "/x?plan=free")));
        assert!(!holds(&m, &FakeRequest::new("GET", "/x?plan=freedom")));
        assert!(!holds(&m, &FakeRequest::new("GET", "/x")), "absent");
        let absent = matcher(r#"{"values":[{"part":{"query":"plan"},"present":false}]}"#).unwrap();
        assert!(holds(&absent, &FakeRequest::new("GET", "/x")));
    }

    #[test]
    #[cfg_attr(
        target_arch = "wasm32",
        ignore = "its watchdog is a thread, which WASI preview 1 cannot spawn"
    )]
    fn a_pattern_that_backtracking_engines_choke_on_runs_in_linear_time() {
        // (a+)+$ against a's then a b: exponential for a backtracker (it
        // would not finish this century), one pass here (milliseconds).
        // The bound is liveness, not speed: a thousand times the need.
        let m = matcher(r#"{"headers":[{"name":"x","regex":"(a+)+"}]}"#).unwrap();
        let mut value = vec![b'a'; 100_000];
        value.push(b'b');
        let (done, answer) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = FakeRequest::new("GET", "/").with("x", &value);
            let _ = done.send(holds(&m, &r));
        });
        let matched = answer
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the match did not finish: the engine backtracks");
        assert!(!matched);
    }

    #[test]
    fn client_networks_and_one_of_lists_match_their_members_only() {
        let m = matcher(
            r#"{"clientNetworks":["10.0.0.0/8","2001:db8::/32"],
                "headers":[{"name":"x-api-key","oneOf":["k1","k2"]}]}"#,
        )
        .unwrap();
        let r = |addr: &str, key: &[u8]| {
            FakeRequest::new("GET", "/")
                .addr(addr)
                .with("x-api-key", key)
        };
        assert!(holds(&m, &r("10.9.9.9:1000", b"k2")));
        assert!(holds(&m, &r("[2001:db8::5]:1000", b"k1")));
        assert!(
            !holds(&m, &r("192.0.2.1:1000", b"k1")),
            "outside the networks"
        );
        assert!(!holds(&m, &r("10.9.9.9:1000", b"k3")), "not in the list");
        assert!(
            !holds(&m, &r("pipe:/run/envoy.sock", b"k1")),
            "not an address"
        );
        let err = matcher(r#"{"clientNetworks":["10.0.0.0/8","10.2.0.0/16"]}"#).unwrap_err();
        assert_eq!(err.field, "match.clientNetworks[1]");
        assert!(err.reason.contains("overlaps"), "{err:?}");
        let err = matcher(r#"{"clientNetworks":["10.0.0.0/33"]}"#).unwrap_err();
        assert_eq!(err.field, "match.clientNetworks[0]");
        let err = matcher(r#"{"values":[{"part":"method","oneOf":[]}]}"#).unwrap_err();
        assert_eq!(err.field, "match.values[0].oneOf");
        assert!(matcher("{}").unwrap().is_empty());
        assert!(!m.is_empty());
    }

    #[test]
    fn a_condition_is_exactly_one_of_four_and_a_bad_regex_names_its_field() {
        let err = matcher(r#"{"headers":[{"name":"x","exact":"a","prefix":"b"}]}"#).unwrap_err();
        assert_eq!(err.field, "match.headers[0]");
        let err = matcher(r#"{"values":[{"part":"method"}]}"#).unwrap_err();
        assert_eq!(err.field, "match.values[0]");
        let err = matcher(r#"{"values":[{"part":"path","regex":"(unclosed"}]}"#).unwrap_err();
        assert_eq!(err.field, "match.values[0].regex");
        assert!(err.reason.contains("not a valid regex"), "{err:?}");
        // Balanced only once wrapped: refused, not left unanchored.
        let err = matcher(r#"{"headers":[{"name":"x","regex":"a)|(?:b"}]}"#).unwrap_err();
        assert_eq!(err.field, "match.headers[0].regex");
        let err = matcher(r#"{"values":[{"part":{"query":""},"exact":"a"}]}"#).unwrap_err();
        assert_eq!(err.field, "match.values[0].part.query");
    }
}
