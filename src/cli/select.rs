//! From a configuration, a limit or rule name and part values to the Redis
//! key the filter uses. The values stand in for a request (a
//! [`RequestView`]), so the filter's own descriptor, hash-tag and key code
//! builds the key: a client prefix is masked, a number claim printed, a long
//! value digested exactly as for a real request.

use std::collections::BTreeMap;
use std::path::Path;

use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use redis_guard::config::{descriptor, Config, Idempotency, Limit, Part, Read};
use redis_guard::idempotency::{parse_key, record_key};
use redis_guard::keys::rate_limit_key;
use redis_guard::ratelimit::Plan;
use redis_guard::request::{RequestLine, RequestView, ValueType};

use crate::Failure;

/// Reads and parses a configuration with the filter's parser; credentials
/// given as fromEnvironment are read from this process' environment, as
/// the filter reads them from its VM's.
pub fn load(path: &Path) -> Result<Config, Failure> {
    load_with(path, false)
}

/// As [`load`]; with `assume_env`, a fromEnvironment variable this process
/// lacks counts as set (to a placeholder), for a CI job without secrets.
pub fn load_with(path: &Path, assume_env: bool) -> Result<Config, Failure> {
    let text = std::fs::read(path)
        .map_err(|e| Failure::config(format!("cannot read {}: {e}", path.display())))?;
    let env = |name: &str| {
        std::env::var(name)
            .ok()
            .or_else(|| assume_env.then(|| "placeholder".to_string()))
    };
    Config::parse_with_env(&text, &env).map_err(|e| Failure::config(e.to_string()))
}

/// The name a part's value is given by (`--value NAME=VALUE`); none for a
/// literal, whose value the configuration holds.
pub fn part_name(part: &Part) -> Option<String> {
    Some(match part {
        Part::Header(h) => h.clone(),
        Part::Query(q) => format!("query:{q}"),
        Part::Literal(_) => return None,
        Part::ClientAddress | Part::ClientPrefix { .. } => "clientAddress".to_string(),
        // ["metadata", "filter_metadata", namespace, path...]
        Part::Metadata(path, _) => path.get(3..).unwrap_or_default().join("."),
        Part::Attribute(path) => path.join("."),
        Part::Path => "path".to_string(),
        Part::Method => "method".to_string(),
        Part::GrpcService => "grpcService".to_string(),
        Part::GrpcMethod => "grpcMethod".to_string(),
    })
}

/// The names a list of parts needs values for, in order, once each.
pub fn names(parts: &[Part]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for name in parts.iter().filter_map(part_name) {
        if !out.contains(&name) {
            out.push(name);
        }
    }
    out
}

/// One limit's key for the given values.
pub struct LimitTarget<'a> {
    pub limit: &'a Limit,
    pub key: Vec<u8>,
}

/// One idempotency record's key.
pub struct RecordTarget<'a> {
    pub rule: &'a Idempotency,
    pub key: Vec<u8>,
}

pub fn limit<'a>(
    config: &'a Config,
    name: &str,
    values: &[String],
) -> Result<LimitTarget<'a>, Failure> {
    let Some(limit) = config.limits.iter().find(|l| l.name == name) else {
        return Err(unknown(
            "limit",
            name,
            config.limits.iter().map(|l| &l.name),
        ));
    };
    let view = Values::new(config, values, &limit.descriptor)?;
    let line = RequestLine::read(&view);
    let descriptor = match descriptor(&limit.descriptor, &line, &view) {
        Read::Value(d) => d,
        Read::Missing => {
            return Err(missing(
                &format!("limit `{name}`"),
                &limit.descriptor,
                &view,
            ))
        }
        Read::Invalid(why) => return Err(Failure::selection(format!("limit `{name}`: {why}"))),
    };
    let tag = config.hash_tag_for(&line, &view);
    Ok(LimitTarget {
        limit,
        key: rate_limit_key(&config.key_prefix, &tag, &limit.key_infix, &descriptor),
    })
}

/// Every limit that applies to a request with these values (its path and
/// method given as `path=` and `method=`), as the filter plans it, and the
/// request's line; for `wire`, which sends what the filter would.
pub fn plan(config: &Config, values: &[String]) -> Result<(Plan, RequestLine), Failure> {
    let mut parts: Vec<Part> = vec![Part::Path, Part::Method];
    for limit in &config.limits {
        parts.extend(limit.descriptor.iter().cloned());
    }
    for rule in &config.idempotency {
        parts.extend(rule.tenant.iter().cloned());
    }
    let view = Values::new(config, values, &parts)?;
    let line = RequestLine::read(&view);
    let plan = Plan::build(config, &line, &view)
        .map_err(|bad| Failure::selection(format!("the request is refused: {}", bad.detail)))?;
    Ok((plan, line))
}

pub fn record<'a>(
    config: &'a Config,
    name: &str,
    key: &str,
    values: &[String],
) -> Result<RecordTarget<'a>, Failure> {
    let Some(rule) = config.idempotency.iter().find(|r| r.name == name) else {
        return Err(unknown(
            "idempotency rule",
            name,
            config.idempotency.iter().map(|r| &r.name),
        ));
    };
    let key = parse_key(key.as_bytes())
        .map_err(|why| Failure::selection(format!("invalid key: {why}")))?;
    let view = Values::new(config, values, &rule.tenant)?;
    let line = RequestLine::read(&view);
    let mut tenant = Vec::new();
    for (j, part) in rule.tenant.iter().enumerate() {
        if j > 0 {
            tenant.push(b':');
        }
        // As the filter: an absent or empty tenant value has no key space.
        let value = part.value(&line, &view).unwrap_or_default();
        if value.is_empty() {
            return Err(missing(&format!("rule `{name}`"), &rule.tenant, &view));
        }
        redis_guard::keys::push_value(&mut tenant, &value);
    }
    let tag = config.hash_tag_for(&line, &view);
    Ok(RecordTarget {
        rule,
        key: record_key(&config.key_prefix, &tag, rule, &tenant, &key),
    })
}

/// No `what` of that name: the error lists the configuration's.
fn unknown<'a>(what: &str, name: &str, known: impl Iterator<Item = &'a String>) -> Failure {
    let known: Vec<&str> = known.map(String::as_str).collect();
    let known = if known.is_empty() {
        "none".to_string()
    } else {
        known.join(", ")
    };
    Failure::selection(format!(
        "no {what} named `{name}` (the configuration has: {known})"
    ))
}

fn missing(what: &str, parts: &[Part], view: &Values) -> Failure {
    let needed = names(parts);
    let absent: Vec<&String> = needed
        .iter()
        .filter(|n| !view.given.contains_key(n.as_str()))
        .collect();
    let absent = if absent.is_empty() {
        "(an empty value is no value)".to_string()
    } else {
        absent
            .iter()
            .map(|n| format!("--value {n}=..."))
            .collect::<Vec<_>>()
            .join(" ")
    };
    Failure::selection(format!(
        "{what} needs a value for each of: {} (missing: {absent})",
        needed.join(", ")
    ))
}

/// The given values as a request: headers, query parameters, the client
/// address, the request line and the host's attributes (typed as the
/// configuration types them).
struct Values {
    given: BTreeMap<String, String>,
    /// Host attribute paths and the bytes Envoy would serialize for them.
    properties: Vec<(Vec<String>, Vec<u8>)>,
    path: String,
    grpc: bool,
}

impl Values {
    fn new(config: &Config, raw: &[String], parts: &[Part]) -> Result<Values, Failure> {
        let mut given = BTreeMap::new();
        for pair in raw {
            let Some((name, value)) = pair.split_once('=') else {
                return Err(Failure::selection(format!(
                    "--value {pair}: expected NAME=VALUE"
                )));
            };
            if given.insert(name.to_string(), value.to_string()).is_some() {
                return Err(Failure::selection(format!("--value {name} given twice")));
            }
        }
        let relevant: Vec<&Part> = parts.iter().chain(config.hash_tag.iter()).collect();
        let known: Vec<String> = relevant.iter().filter_map(|p| part_name(p)).collect();
        if let Some(unknown) = given.keys().find(|n| !known.contains(n)) {
            return Err(Failure::selection(format!(
                "--value {unknown}: no part of this selection is named so (it needs: {})",
                if known.is_empty() {
                    "no values".to_string()
                } else {
                    names(parts).join(", ")
                }
            )));
        }
        let mut properties = Vec::new();
        for part in &relevant {
            let (path, ty) = match part {
                Part::Metadata(path, ty) => (path, *ty),
                Part::Attribute(path) => (path, ValueType::String),
                _ => continue,
            };
            let Some(name) = part_name(part) else {
                continue;
            };
            let Some(value) = given.get(&name) else {
                continue;
            };
            properties.push((path.clone(), host_bytes(&name, value, ty)?));
        }
        let grpc = given.contains_key("grpcService") || given.contains_key("grpcMethod");
        let mut path = match (given.get("path"), grpc) {
            (Some(p), _) => p.clone(),
            (None, true) => format!(
                "/{}/{}",
                given.get("grpcService").map_or("", String::as_str),
                given.get("grpcMethod").map_or("", String::as_str)
            ),
            (None, false) => "/".to_string(),
        };
        let query: Vec<String> = given
            .iter()
            .filter_map(|(n, v)| {
                let name = n.strip_prefix("query:")?;
                Some(format!(
                    "{}={}",
                    utf8_percent_encode(name, NON_ALPHANUMERIC),
                    utf8_percent_encode(v, NON_ALPHANUMERIC)
                ))
            })
            .collect();
        if !query.is_empty() {
            path.push('?');
            path.push_str(&query.join("&"));
        }
        Ok(Values {
            given,
            properties,
            path,
            grpc,
        })
    }
}

/// A value as Envoy hands a typed attribute over: a number as its 8-byte
/// double, a bool as one byte, a string as its bytes.
fn host_bytes(name: &str, value: &str, ty: ValueType) -> Result<Vec<u8>, Failure> {
    match ty {
        ValueType::String => Ok(value.as_bytes().to_vec()),
        ValueType::Number => value
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite())
            .map(|x| x.to_le_bytes().to_vec())
            .ok_or_else(|| Failure::selection(format!("--value {name}: not a number"))),
        ValueType::Bool => match value {
            "true" => Ok(vec![1]),
            "false" => Ok(vec![0]),
            _ => Err(Failure::selection(format!(
                "--value {name}: not a bool (true or false)"
            ))),
        },
    }
}

impl RequestView for Values {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        match name {
            ":path" => Some(self.path.clone().into_bytes()),
            ":method" => Some(
                self.given
                    .get("method")
                    .map_or("GET", String::as_str)
                    .as_bytes()
                    .to_vec(),
            ),
            "content-type" if self.grpc => Some(b"application/grpc".to_vec()),
            _ => self.given.get(name).map(|v| v.as_bytes().to_vec()),
        }
    }

    fn client_address(&self) -> Option<String> {
        let ip = self.given.get("clientAddress")?;
        Some(if ip.contains(':') {
            format!("[{ip}]:0")
        } else {
            format!("{ip}:0")
        })
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.properties
            .iter()
            .find(|(p, _)| p.iter().map(String::as_str).eq(path.iter().copied()))
            .map(|(_, v)| v.clone())
    }
}
