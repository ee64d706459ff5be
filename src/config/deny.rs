//! The deny list: requests answered `403` (gRPC `PERMISSION_DENIED`) before
//! any limit is looked at or Redis is asked.

use schemars::JsonSchema;
use serde::Deserialize;

use super::matcher::{compile_match, Matcher, RawMatch};
use super::{valid_name, ConfigError};

/// One deny rule: a request its `match` covers is refused.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "DenyRule")]
pub(super) struct RawDenyRule {
    /// Names the rule in logs: letters, digits, '-', '_', '.'.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9._-]+$"))]
    name: String,
    /// Which requests are refused: client networks (`clientNetworks`), a
    /// key or claim's values (`values` with `oneOf`), any `match` condition.
    #[serde(rename = "match")]
    matcher: RawMatch,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenyRule {
    pub name: String,
    pub matcher: Matcher,
}

pub(super) fn compile_deny(raw: Vec<RawDenyRule>) -> Result<Vec<DenyRule>, ConfigError> {
    let mut rules: Vec<DenyRule> = Vec::with_capacity(raw.len());
    for (i, r) in raw.into_iter().enumerate() {
        let at = format!("deny[{i}]");
        if !valid_name(&r.name) {
            return Err(ConfigError::new(
                format!("{at}.name"),
                "must be 1 to 64 characters of A-Z a-z 0-9 - _ .",
            ));
        }
        if rules.iter().any(|d| d.name == r.name) {
            return Err(ConfigError::new(
                format!("{at}.name"),
                format!("duplicate deny rule name `{}`", r.name),
            ));
        }
        let field = format!("{at}.match");
        let matcher = compile_match(r.matcher, &field)?;
        if matcher.is_empty() {
            return Err(ConfigError::new(
                field,
                "has no condition: it would refuse every request",
            ));
        }
        rules.push(DenyRule {
            name: r.name,
            matcher,
        });
    }
    Ok(rules)
}
