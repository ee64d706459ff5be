//! The deny list without the host: which rule refuses a request, and the
//! answer it gets.

use serde_json::json;

use crate::config::DenyRule;
use crate::request::{RequestLine, RequestView};
use crate::response::{problem_reply, LocalReply};

/// The first rule that refuses the request, if any.
pub fn refusing<'a>(
    rules: &'a [DenyRule],
    line: &RequestLine,
    view: &dyn RequestView,
) -> Option<&'a DenyRule> {
    rules.iter().find(|r| r.matcher.matches(line, view))
}

/// `403`: the rule's name is in the problem (for the client's support
/// ticket), not which condition matched (no hint at how to get around it).
pub fn forbidden(rule: &str) -> LocalReply {
    problem_reply(
        "redis_guard_denied",
        403,
        "Forbidden",
        "this client or key is not allowed",
        json!({ "rule": rule }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::request::fake::FakeRequest;

    fn config(deny: &str) -> Config {
        Config::parse(format!(r#"{{"redis": {{"cluster": "webdis"}}, "deny": {deny}}}"#).as_bytes())
            .unwrap()
    }

    #[test]
    fn the_first_rule_that_matches_refuses_with_a_403_naming_it() {
        let cfg = config(
            r#"[{"name": "bad-nets", "match": {"clientNetworks": ["198.51.100.0/24", "2001:db8:bad::/48"]}},
                {"name": "revoked", "match": {"headers": [{"name": "x-api-key", "oneOf": ["k-old", "k-leaked"]}]}}]"#,
        );
        let who = |addr: &str, key: &[u8]| {
            let r = FakeRequest::new("GET", "/")
                .addr(addr)
                .with("x-api-key", key);
            refusing(&cfg.deny, &RequestLine::read(&r), &r).map(|d| d.name.clone())
        };
        assert_eq!(who("198.51.100.9:1", b"k"), Some("bad-nets".into()));
        assert_eq!(who("[2001:db8:bad::1]:1", b"k"), Some("bad-nets".into()));
        assert_eq!(who("192.0.2.1:1", b"k-leaked"), Some("revoked".into()));
        assert_eq!(who("192.0.2.1:1", b"k-new"), None);
        let reply = forbidden("revoked");
        assert_eq!(reply.status, 403);
        assert_eq!(reply.details, "redis_guard_denied");
        let doc: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(doc["rule"], "revoked");
        assert_eq!(crate::grpc::code_for(reply.status), 7, "PERMISSION_DENIED");
    }

    #[test]
    fn a_rule_without_a_condition_or_with_a_bad_network_is_a_config_error() {
        let err = |deny: &str| {
            Config::parse(format!(r#"{{"redis": {{"cluster": "w"}}, "deny": {deny}}}"#).as_bytes())
                .unwrap_err()
        };
        let e = err(r#"[{"name": "all", "match": {}}]"#);
        assert_eq!(e.field, "deny[0].match");
        let e =
            err(r#"[{"name": "n", "match": {"clientNetworks": ["10.0.0.0/8", "10.0.0.0/16"]}}]"#);
        assert_eq!(e.field, "deny[0].match.clientNetworks[1]");
        let e = err(
            r#"[{"name": "a", "match": {"host": "x"}}, {"name": "a", "match": {"host": "y"}}]"#,
        );
        assert_eq!(e.field, "deny[1].name");
    }
}
