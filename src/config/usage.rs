//! Usage-based cost: a limit charged what the response says its request
//! cost (LLM tokens, bytes, credits), settled after the response.

use schemars::JsonSchema;
use serde::Deserialize;

use super::{header_name, ConfigError};
use crate::statuses::StatusSet;
use crate::usage::Term;

/// Most bytes of a JSON body, or of one event of a stream, read for the usage.
pub const MAX_USAGE_BODY: usize = 16 << 20;
pub const DEFAULT_USAGE_BODY: usize = 1 << 20;
/// Largest unit count one settlement moves (lua/settle.lua's bound).
pub const MAX_USAGE_UNITS: u64 = (1 << 50) - 1;

/// Charge what the response says the request cost. The request is admitted
/// only if the limit has `reserve` units left, and takes them; when the
/// response is over, the difference to its real cost is charged (the
/// balance may go below zero: debt, repaid by refill) or refunded.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "Usage")]
pub(super) struct RawUsage {
    /// A response header holding the cost as a whole number, or a response
    /// trailer of that name (gRPC sends its metadata there); read before
    /// the body.
    #[serde(default)]
    header: Option<String>,
    /// JSON Pointers (RFC 6901) into the response body, or into each event
    /// of a `text/event-stream` body: the cost is their weighted sum.
    #[serde(default)]
    #[schemars(default = "super::defaults::no_items")]
    json: Vec<RawTerm>,
    /// Count only responses with these statuses (HTTP classes `4xx`,
    /// codes `401`, gRPC names `UNAUTHENTICATED`): a request takes `reserve`
    /// at admission and gets it back when its response's status is not
    /// listed (a login limit that counts failed attempts only). Instead of
    /// `header` and `json`. A response that never arrives counts.
    #[serde(default)]
    count_statuses: Vec<String>,
    /// Units a request must find left, taken at admission (default 1).
    #[serde(default)]
    #[schemars(range(min = 1))]
    #[schemars(default = "super::defaults::one")]
    reserve: Option<u64>,
    /// JSON Pointers into the request's JSON body (e.g. `/max_tokens`):
    /// when the body holds any of them, the request reserves their weighted
    /// sum (at least 1, at most the limit's quota) instead of `reserve`.
    #[serde(default)]
    #[schemars(default = "super::defaults::no_items")]
    reserve_from: Vec<RawTerm>,
    /// Units charged when the usage never arrives: the client left, the
    /// upstream failed, the body was not JSON (default: what the request
    /// reserved).
    #[serde(default)]
    fallback: Option<u64>,
    /// Most bytes of a JSON body, or of one event, read (default 1 MiB);
    /// the request body too, for `reserveFrom`.
    #[serde(default)]
    #[schemars(range(min = 1, max = 16777216))]
    #[schemars(default = "super::defaults::usage_max_body_bytes")]
    max_body_bytes: Option<usize>,
}

/// One term of the cost.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "UsageTerm")]
struct RawTerm {
    /// A JSON Pointer, e.g. `/usage/completion_tokens`.
    pointer: String,
    /// Units per unit it counts (default 1).
    #[serde(default)]
    #[schemars(range(min = 1))]
    #[schemars(default = "super::defaults::one")]
    weight: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    pub header: Option<String>,
    pub terms: Vec<Term>,
    /// Response-counted: the request costs `reserve` if its response's
    /// status is in the set, nothing otherwise.
    pub counted: Option<StatusSet>,
    pub reserve: u64,
    /// Terms read from the request body for its reservation.
    pub reserve_from: Vec<Term>,
    /// `None`: what the request reserved.
    pub fallback: Option<u64>,
    pub max_body: usize,
    /// The most a request may reserve: the limit's quota.
    pub quota: u64,
}

/// `quota`: the most units the limit admits at once (its reserve's bound).
pub(super) fn compile_usage(raw: RawUsage, at: &str, quota: u64) -> Result<Usage, ConfigError> {
    let header = match raw.header {
        Some(h) => Some(header_name(&h, &format!("{at}.header"))?),
        None => None,
    };
    let counted = if raw.count_statuses.is_empty() {
        None
    } else {
        if header.is_some() || !raw.json.is_empty() {
            return Err(ConfigError::new(
                format!("{at}.countStatuses"),
                "decides the cost by the response's status: remove `header` and `json`",
            ));
        }
        let set = StatusSet::parse(&raw.count_statuses)
            .map_err(|(i, why)| ConfigError::new(format!("{at}.countStatuses[{i}]"), why))?;
        Some(set)
    };
    if header.is_none() && raw.json.is_empty() && counted.is_none() {
        return Err(ConfigError::new(
            at,
            "set `header`, `json` or both (where the response states its cost), or `countStatuses`",
        ));
    }
    let terms = compile_terms(raw.json, &format!("{at}.json"))?;
    let reserve_from = compile_terms(raw.reserve_from, &format!("{at}.reserveFrom"))?;
    let reserve = raw.reserve.unwrap_or(1);
    if reserve == 0 || reserve > quota {
        return Err(ConfigError::new(
            format!("{at}.reserve"),
            format!("must be between 1 and {quota} (the limit's quota)"),
        ));
    }
    if raw.fallback.is_some_and(|f| f > MAX_USAGE_UNITS) {
        return Err(ConfigError::new(
            format!("{at}.fallback"),
            "must be below 2^50",
        ));
    }
    let max_body = raw.max_body_bytes.unwrap_or(DEFAULT_USAGE_BODY);
    if max_body == 0 || max_body > MAX_USAGE_BODY {
        return Err(ConfigError::new(
            format!("{at}.maxBodyBytes"),
            "must be between 1 and 16777216",
        ));
    }
    Ok(Usage {
        header,
        terms,
        counted,
        reserve,
        reserve_from,
        fallback: raw.fallback,
        max_body,
        quota,
    })
}

fn compile_terms(raw: Vec<RawTerm>, at: &str) -> Result<Vec<Term>, ConfigError> {
    let mut terms = Vec::with_capacity(raw.len());
    for (i, t) in raw.into_iter().enumerate() {
        if !(t.pointer.is_empty() || t.pointer.starts_with('/')) {
            return Err(ConfigError::new(
                format!("{at}[{i}].pointer"),
                "must be a JSON Pointer: empty, or starting with `/`",
            ));
        }
        let weight = t.weight.unwrap_or(1);
        if weight == 0 {
            return Err(ConfigError::new(
                format!("{at}[{i}].weight"),
                "must be at least 1",
            ));
        }
        terms.push(Term {
            pointer: t.pointer,
            weight,
        });
    }
    Ok(terms)
}
