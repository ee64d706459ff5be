//! Idempotency records are bounded: in the shipped envoy/filter.json (the
//! demo's and compose's configuration) every idempotency rule is covered by a
//! rate limit that applies to every request the rule sees, whoever sends it,
//! so an anonymous client cannot create 24-hour records without end. Checked
//! on the configuration, then through a real Envoy running that file.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use serde_json::Value;
use support::*;

fn shipped() -> Value {
    serde_json::from_str(&std::fs::read_to_string(root().join("envoy/filter.json")).unwrap())
        .unwrap()
}

/// A descriptor part every request has: the limit cannot be stepped around
/// by leaving a header out.
fn always_present(part: &Value) -> bool {
    part == "clientAddress" || part.get("clientPrefix").is_some()
}

/// The methods a match covers; an idempotency rule without `methods` covers
/// POST and PATCH (the parser's default), a limit without them every method.
fn methods(m: &Value, default: &[&str]) -> Option<Vec<String>> {
    match m.get("methods") {
        Some(v) => Some(
            v.as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_ascii_uppercase())
                .collect(),
        ),
        None if default.is_empty() => None,
        None => Some(default.iter().map(|s| s.to_string()).collect()),
    }
}

/// Whether every request `rule_match` selects is also selected by
/// `limit_match`. Sound, not complete: each condition of the limit must be
/// one the rule already has (or a path prefix of the rule's path), so a
/// `false` may be a cover this check cannot see, never the reverse.
fn covers(limit_match: &Value, rule_match: &Value) -> bool {
    let empty = serde_json::Map::new();
    let l = limit_match.as_object().unwrap_or(&empty);
    let r = rule_match.as_object().unwrap_or(&empty);
    let known = [
        "pathPrefix",
        "pathExact",
        "methods",
        "host",
        "headers",
        "values",
    ];
    if l.keys().any(|k| !known.contains(&k.as_str())) {
        return false;
    }
    let rule_path = r
        .get("pathExact")
        .or_else(|| r.get("pathPrefix"))
        .and_then(Value::as_str);
    if let Some(prefix) = l.get("pathPrefix").and_then(Value::as_str) {
        if !rule_path.is_some_and(|p| p.starts_with(prefix)) {
            return false;
        }
    }
    if l.contains_key("pathExact") && l.get("pathExact") != r.get("pathExact") {
        return false;
    }
    if let Some(lm) = methods(limit_match, &[]) {
        let rm = methods(rule_match, &["POST", "PATCH"]).unwrap();
        if !rm.iter().all(|m| lm.contains(m)) {
            return false;
        }
    }
    if l.contains_key("host") && l.get("host") != r.get("host") {
        return false;
    }
    ["headers", "values"].iter().all(|field| {
        let rule_has = r.get(*field).and_then(Value::as_array);
        l.get(*field).and_then(Value::as_array).is_none_or(|conds| {
            conds
                .iter()
                .all(|c| rule_has.is_some_and(|rc| rc.contains(c)))
        })
    })
}

/// A limit that bounds how many requests pass over time: a rate, applied
/// (not shadow), keyed only on parts every request has.
fn bounds_every_sender(limit: &Value) -> bool {
    let rate = [
        "tokenBucket",
        "gcra",
        "fixedWindow",
        "slidingWindow",
        "slidingWindowCounter",
    ]
    .iter()
    .any(|k| limit.get(*k).is_some());
    rate && limit.get("shadow") != Some(&Value::Bool(true))
        && limit["descriptor"]
            .as_array()
            .unwrap()
            .iter()
            .all(always_present)
}

/// The name of a limit covering idempotency rule `rule`, if any.
fn covering_limit<'a>(config: &'a Value, rule: &Value) -> Option<&'a str> {
    let nothing = Value::Null;
    config["limits"].as_array().unwrap().iter().find_map(|l| {
        (bounds_every_sender(l)
            && covers(
                l.get("match").unwrap_or(&nothing),
                rule.get("match").unwrap_or(&nothing),
            ))
        .then(|| l["name"].as_str().unwrap())
    })
}

#[test]
fn every_idempotency_rule_in_the_shipped_config_is_covered_by_a_limit_on_every_sender() {
    let config = shipped();
    let rules = config["idempotency"].as_array().unwrap();
    assert!(!rules.is_empty());
    let uncovered: Vec<&str> = rules
        .iter()
        .filter(|r| covering_limit(&config, r).is_none())
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert!(uncovered.is_empty(), "rules no limit bounds: {uncovered:?}");
}

#[test]
fn the_cover_check_refuses_what_does_not_bound_every_sender() {
    let limit = |m: Value, descriptor: Value| {
        serde_json::json!({"name": "l", "match": m, "descriptor": descriptor,
                           "slidingWindow": {"limit": 1, "windowMs": 1000}})
    };
    let rule = serde_json::json!({"name": "r", "match": {"pathPrefix": "/api/payments"}});
    let config = |l: Value| serde_json::json!({"limits": [l]});
    let by_client = serde_json::json!(["clientAddress"]);
    // The issue's gap: GET and POST only, while the rule takes PATCH too.
    let get_post = limit(
        serde_json::json!({"pathPrefix": "/api/", "methods": ["GET", "POST"]}),
        by_client.clone(),
    );
    assert_eq!(covering_limit(&config(get_post), &rule), None);
    // Keyed on a header a client can leave out.
    let per_user = limit(
        serde_json::json!({"pathPrefix": "/api/"}),
        serde_json::json!([{"header": "x-user"}]),
    );
    assert_eq!(covering_limit(&config(per_user), &rule), None);
    // Only for requests with a header the rule does not require.
    let free_plan = limit(
        serde_json::json!({"pathPrefix": "/api/", "headers": [{"name": "x-plan", "exact": "free"}]}),
        by_client.clone(),
    );
    assert_eq!(covering_limit(&config(free_plan), &rule), None);
    let mut shadow = limit(
        serde_json::json!({"pathPrefix": "/api/"}),
        by_client.clone(),
    );
    shadow["shadow"] = Value::Bool(true);
    assert_eq!(covering_limit(&config(shadow), &rule), None);
    // Another path.
    let other = limit(
        serde_json::json!({"pathPrefix": "/api/orders"}),
        by_client.clone(),
    );
    assert_eq!(covering_limit(&config(other), &rule), None);
    // A cover: a shorter prefix, every method.
    let cover = limit(serde_json::json!({"pathPrefix": "/api/"}), by_client);
    assert_eq!(covering_limit(&config(cover), &rule), Some("l"));
}

#[test]
fn anonymous_keyed_requests_with_fresh_keys_stop_at_the_limit_and_redis_holds_no_more_records() {
    let config = shipped();
    let rule = config["idempotency"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "payments")
        .unwrap();
    let limit_name = covering_limit(&config, rule).expect("a limit covering payments");
    let limit = config["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == limit_name)
        .unwrap();
    // A window far longer than this test: the budget cannot come back.
    let window = &limit["slidingWindow"];
    assert!(window["windowMs"].as_u64().unwrap() >= 60_000, "{limit}");
    let budget = window["limit"].as_u64().unwrap();

    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let upstream = Upstream::start();
    // As the demo runs it: the objectStore's key (these requests are far
    // too small to reach it) and Webdis' Authorization header (the webdis
    // cluster adds it) come from Envoy's environment.
    let authorization = webdis_authorization();
    let envoy = Envoy::start_full(
        &config.to_string(),
        webdis.port,
        upstream.port,
        None,
        &[
            ("AWS_ACCESS_KEY_ID", "AKIDTEST"),
            ("AWS_SECRET_ACCESS_KEY", "test-secret"),
            ("REDIS_GUARD_WEBDIS_AUTHORIZATION", &authorization),
        ],
        |yaml| yaml,
    );
    // PATCH with no x-user: the issue's request, which no limit covered.
    let send = |i: u64| {
        http(
            "PATCH",
            &envoy.url(&format!("/api/payments/p{i}")),
            &[("idempotency-key", &format!("fresh-{i}"))],
            Some(b"{\"amount\":1}"),
        )
        .status
    };
    let statuses: Vec<u16> = (0..=budget).map(send).collect();
    let mut want = vec![200; budget as usize];
    want.push(429);
    assert_eq!(statuses, want, "{}", envoy.log());
    assert_eq!(upstream.executed(), budget);
    let records: Vec<String> = redis::cmd("KEYS")
        .arg("rg:idem:*:payments:*")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(records.len() as u64, budget, "{records:?}");
}
