//! Responses the filter writes itself, and the rate-limit header fields.
//!
//! Header fields follow draft-ietf-httpapi-ratelimit-headers (`RateLimit-Policy:
//! "name";q=…;w=…` and `RateLimit: "name";r=…;t=…`, one list member per
//! enforced limit) and the de-facto `X-RateLimit-Limit/Remaining/Reset`, which
//! carry one limit: the one that rejected the request, or else the one with the
//! least quota left. Shadow limits are never advertised to clients.

use serde_json::json;

use crate::codec::push_decimal;
use crate::config::Config;
use crate::grpc;
use crate::ratelimit::{Outcome, Plan};

/// A response the filter sends instead of forwarding the request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// For a gRPC request: the `grpc-status` of a trailers-only answer,
    /// whose `grpc-message` is `body` (see [`grpc_reply`]).
    pub grpc_status: Option<u32>,
    /// How long the client should wait before it retries, exactly (the
    /// `retry-after` field rounds it up to seconds).
    pub retry_ms: Option<u64>,
    /// Envoy's response code details for this answer (`%RESPONSE_CODE_DETAILS%`
    /// in an access log): one value per kind of answer, so a log tells them
    /// apart. Envoy's own are snake case without spaces; so are these.
    pub details: &'static str,
}

impl LocalReply {
    /// The same answer under other response code details.
    pub fn with_details(mut self, details: &'static str) -> LocalReply {
        self.details = details;
        self
    }
}

fn seconds_up(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// An RFC 9457 problem document with extra members.
pub fn problem(status: u32, title: &str, detail: &str, extra: serde_json::Value) -> Vec<u8> {
    let mut doc =
        json!({ "type": "about:blank", "title": title, "status": status, "detail": detail });
    if let (Some(doc), serde_json::Value::Object(extra)) = (doc.as_object_mut(), extra) {
        doc.extend(extra);
    }
    doc.to_string().into_bytes()
}

pub(crate) fn problem_reply(
    details: &'static str,
    status: u32,
    title: &str,
    detail: &str,
    extra: serde_json::Value,
) -> LocalReply {
    LocalReply {
        details,
        status,
        headers: vec![(
            "content-type".to_string(),
            "application/problem+json".to_string(),
        )],
        body: problem(status, title, detail, extra),
        ..LocalReply::default()
    }
}

pub fn bad_request(detail: &str) -> LocalReply {
    problem_reply(
        "redis_guard_bad_request",
        400,
        "Bad Request",
        detail,
        json!({}),
    )
}

/// 409: another request with the same idempotency key is in progress.
/// `Retry-After: 1`: the first request normally finishes long before its
/// lock would expire, so the lock's remaining TTL is no useful hint.
pub fn idempotency_conflict() -> LocalReply {
    let mut reply = problem_reply(
        "redis_guard_idempotency_conflict",
        409,
        "Conflict",
        "a request with this idempotency key is being processed",
        json!({ "retryAfter": 1 }),
    );
    reply
        .headers
        .push(("retry-after".to_string(), "1".to_string()));
    reply.retry_ms = Some(1000);
    reply
}

/// 429 from the local fallback budget (Redis could not decide): no
/// RateLimit fields, since the global state is unknown.
pub fn too_many_requests_locally(limit: &str, retry_ms: u64) -> LocalReply {
    let retry_after = seconds_up(retry_ms).max(1);
    let mut reply = problem_reply(
        "redis_guard_rate_limited_locally",
        429,
        "Too Many Requests",
        &format!(
            "rate limit `{limit}` exceeded (local budget while the shared store is unavailable)"
        ),
        json!({ "limits": [limit], "retryAfter": retry_after }),
    );
    reply
        .headers
        .push(("retry-after".to_string(), retry_after.to_string()));
    reply.retry_ms = Some(retry_ms.max(1));
    reply
}

/// 422: the idempotency key was used with a different request.
pub fn idempotency_mismatch() -> LocalReply {
    problem_reply(
        "redis_guard_idempotency_mismatch",
        422,
        "Unprocessable Content",
        "this idempotency key was used with a different request (method, path or body)",
        json!({}),
    )
}

/// 413: a keyed request's body is over the configured cap.
pub fn payload_too_large(max: usize) -> LocalReply {
    problem_reply(
        "redis_guard_request_too_large",
        413,
        "Content Too Large",
        &format!("requests with an idempotency key may carry at most {max} bytes"),
        json!({ "maxBytes": max }),
    )
}

/// 502: the key completed, but its stored body is gone from the object store
/// (deleted, or removed by a lifecycle rule shorter than the record). The
/// request already ran: it is not run again, and retries get this until the
/// record expires.
pub fn stored_response_missing() -> LocalReply {
    problem_reply(
        "redis_guard_stored_response_missing",
        502,
        "Bad Gateway",
        "the stored response for this idempotency key is missing from the object store; the request was executed and is not run again",
        json!({ "storedResponse": "missing" }),
    )
}

/// 502: the object store returned bytes that are not the stored body.
pub fn stored_response_corrupt() -> LocalReply {
    problem_reply(
        "redis_guard_stored_response_corrupt",
        502,
        "Bad Gateway",
        "the stored response for this idempotency key failed its checksum; the request was executed and is not run again",
        json!({ "storedResponse": "corrupt" }),
    )
}

/// 503: the stored body could not be fetched now (store unreachable, slow,
/// or refusing the filter's signature); a retry may get the replay.
pub fn stored_response_unavailable() -> LocalReply {
    let mut reply = problem_reply(
        "redis_guard_stored_response_unavailable",
        503,
        "Service Unavailable",
        "the stored response for this idempotency key cannot be fetched from the object store now; the request was executed and is not run again",
        json!({ "storedResponse": "unavailable", "retryAfter": 1 }),
    );
    reply
        .headers
        .push(("retry-after".to_string(), "1".to_string()));
    reply
}

/// A `content-length` value, when it is a whole number.
pub fn content_length(raw: &[u8]) -> Option<usize> {
    std::str::from_utf8(raw).ok()?.trim().parse().ok()
}

/// When a response is complete for its client: at the stream's end, or as
/// soon as all its content-length has passed (an HTTP/1.1 client stops
/// reading there, before Envoy's end of stream). Says so once.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Completion {
    expected: Option<usize>,
    seen: usize,
    done: bool,
}

impl Completion {
    /// The response's headers (`end`: nothing follows them). A
    /// `content-length: 0` is complete at the end of stream, as the
    /// idempotency record counts it.
    pub fn headers(&mut self, content_length: Option<usize>, end: bool) -> bool {
        self.expected = content_length;
        self.ends(end)
    }

    /// A piece of its body of `size` bytes.
    pub fn body(&mut self, size: usize, end: bool) -> bool {
        self.seen = self.seen.saturating_add(size);
        let whole = self.expected.is_some_and(|n| self.seen >= n);
        self.ends(end || whole)
    }

    /// Its trailers: nothing follows them.
    pub fn trailers(&mut self) -> bool {
        self.ends(true)
    }

    fn ends(&mut self, end: bool) -> bool {
        let first = end && !self.done;
        self.done |= end;
        first
    }
}

/// Fail-closed answer when Redis cannot decide.
/// 503 when Redis cannot decide and the failure mode denies; other causes
/// say theirs with [`LocalReply::with_details`].
pub fn unavailable(detail: &str) -> LocalReply {
    problem_reply(
        "redis_guard_failure_mode_denied",
        503,
        "Service Unavailable",
        detail,
        json!({}),
    )
}

/// The filter's problem reply as a gRPC client must get it: a trailers-only
/// response whose `grpc-message` is the problem's `detail`. Headers other
/// than `content-type` stay (rate-limit fields, `retry-after`): they are the
/// response's metadata. A reply that is not a problem (a replay) is left as
/// it is.
pub fn grpc_reply(reply: &LocalReply) -> LocalReply {
    let problem = reply
        .headers
        .iter()
        .any(|(n, v)| n == "content-type" && v == "application/problem+json");
    if !problem || reply.grpc_status.is_some() {
        return reply.clone();
    }
    let detail = serde_json::from_slice::<serde_json::Value>(&reply.body)
        .ok()
        .and_then(|doc| doc.get("detail")?.as_str().map(str::to_string))
        .unwrap_or_default();
    let code = grpc::code_for(reply.status);
    let mut headers: Vec<(String, String)> = reply
        .headers
        .iter()
        .filter(|(n, _)| n != "content-type")
        .cloned()
        .collect();
    if let (grpc::RESOURCE_EXHAUSTED, Some(ms)) = (code, reply.retry_ms) {
        headers.push((
            "grpc-status-details-bin".to_string(),
            grpc::status_details(code, &detail, ms),
        ));
    }
    LocalReply {
        status: reply.status,
        headers,
        body: detail.into_bytes(),
        grpc_status: Some(code),
        retry_ms: reply.retry_ms,
        details: reply.details,
    }
}

/// Index (into the plan) of the limit the X-RateLimit fields describe.
fn headline(config: &Config, plan: &Plan, outcome: &Outcome) -> Option<usize> {
    let enforced = plan
        .checks
        .iter()
        .enumerate()
        .filter(|(i, c)| {
            let limit = &config.limits[c.limit];
            !limit.shadow
                && outcome.results[*i]
                    .decided_under(&limit.algorithm, c.carried)
                    .is_some()
        })
        .map(|(i, _)| i);
    if outcome.admitted {
        enforced.min_by_key(|&i| {
            let r = &outcome.results[i];
            (r.remaining, std::cmp::Reverse(r.reset_ms))
        })
    } else {
        enforced
            .filter(|&i| !outcome.results[i].allowed)
            .max_by_key(|&i| outcome.results[i].retry_ms)
    }
}

/// The rate-limit header fields for this outcome (admitted or rejected).
pub fn rate_limit_headers(
    config: &Config,
    plan: &Plan,
    outcome: &Outcome,
) -> Vec<(String, String)> {
    let mut headers = Vec::new();
    // Written with push_str, not format!: every admitted response carries
    // these (the formatting machinery was most of their cost in the wasm).
    let number = |n: u64| {
        let mut s = String::new();
        push_decimal(&mut s, n);
        s
    };
    if config.headers_ietf {
        let mut policy = String::new();
        let mut state = String::new();
        for (check, result) in plan.checks.iter().zip(&outcome.results) {
            let limit = &config.limits[check.limit];
            // The numbers the request was decided under: the customer's
            // stored plan, as the decision's reply states it, or the one it
            // carried. A plan whose figures are unknown here (the over-limit
            // cache keeps none) leaves the limit out rather than misstated.
            if limit.shadow {
                continue;
            }
            let Some(algorithm) = result.decided_under(&limit.algorithm, check.carried) else {
                continue;
            };
            if !policy.is_empty() {
                policy.push_str(", ");
                state.push_str(", ");
            }
            // `"name";q=…;w=…`. A concurrency limit has no window: its quota
            // is requests in flight, back when they end, not with time. A
            // quota's window is the one it was decided in, at the proxy's
            // clock (a month of 28 to 31 days, a day of 23 to 25 hours), in
            // seconds as for any window.
            let window = match check.edges {
                Some([_, start, end, _]) => u64::try_from(end.saturating_sub(start)).unwrap_or(0),
                None => algorithm.window_ms(),
            };
            policy.push('"');
            policy.push_str(&limit.name);
            policy.push_str("\";q=");
            push_decimal(&mut policy, algorithm.quota());
            match window {
                0 => {}
                window => {
                    policy.push_str(";w=");
                    push_decimal(&mut policy, seconds_up(window));
                }
            }
            // `"name";r=…;t=…`
            state.push('"');
            state.push_str(&limit.name);
            state.push_str("\";r=");
            push_decimal(&mut state, result.remaining);
            state.push_str(";t=");
            push_decimal(&mut state, seconds_up(result.reset_ms));
        }
        if !policy.is_empty() {
            headers.push(("ratelimit-policy".to_string(), policy));
            headers.push(("ratelimit".to_string(), state));
        }
    }
    if config.headers_x {
        if let Some(i) = headline(config, plan, outcome) {
            let check = &plan.checks[i];
            let limit = &config.limits[check.limit];
            let r = &outcome.results[i];
            let quota = r
                .decided_under(&limit.algorithm, check.carried)
                .map_or(0, |a| a.quota());
            headers.push(("x-ratelimit-limit".to_string(), number(quota)));
            headers.push(("x-ratelimit-remaining".to_string(), number(r.remaining)));
            headers.push((
                "x-ratelimit-reset".to_string(),
                number(seconds_up(r.reset_ms)),
            ));
        }
    }
    headers
}

/// The 429 for a rejected outcome: problem body naming the limit, `Retry-After`
/// equal to the reset of the limit that rejected (the longest wait among them).
pub fn too_many_requests(config: &Config, plan: &Plan, outcome: &Outcome) -> LocalReply {
    let rejecting: Vec<usize> = plan
        .checks
        .iter()
        .enumerate()
        .filter(|(i, c)| !config.limits[c.limit].shadow && !outcome.results[*i].allowed)
        .map(|(i, _)| i)
        .collect();
    let retry_ms = rejecting
        .iter()
        .map(|&i| outcome.results[i].retry_ms)
        .max()
        .unwrap_or(1000);
    let retry_after = seconds_up(retry_ms).max(1);
    let names: Vec<&str> = rejecting
        .iter()
        .map(|&i| config.limits[plan.checks[i].limit].name.as_str())
        .collect();
    let detail = format!("rate limit `{}` exceeded", names.join("`, `"));
    let mut reply = problem_reply(
        "redis_guard_rate_limited",
        429,
        "Too Many Requests",
        &detail,
        json!({ "limits": names, "retryAfter": retry_after }),
    );
    reply
        .headers
        .push(("retry-after".to_string(), retry_after.to_string()));
    reply
        .headers
        .extend(rate_limit_headers(config, plan, outcome));
    reply.retry_ms = Some(retry_ms.max(1));
    reply
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_answer_of_the_filter_has_its_grpc_status() {
        let cases = [
            (
                too_many_requests_locally("l", 1500),
                grpc::RESOURCE_EXHAUSTED,
            ),
            (unavailable("down"), grpc::UNAVAILABLE),
            (bad_request("bad key"), grpc::INVALID_ARGUMENT),
            (idempotency_conflict(), grpc::ABORTED),
            (idempotency_mismatch(), grpc::FAILED_PRECONDITION),
            (stored_response_missing(), grpc::DATA_LOSS),
        ];
        for (reply, code) in cases {
            let grpc = grpc_reply(&reply);
            assert_eq!(grpc.grpc_status, Some(code), "{}", reply.status);
            let doc: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
            assert_eq!(grpc.body, doc["detail"].as_str().unwrap().as_bytes());
            assert!(grpc.headers.iter().all(|(n, _)| n != "content-type"));
        }
    }

    #[test]
    fn a_rejection_keeps_its_rate_limit_metadata_and_carries_retry_info() {
        let reply = too_many_requests_locally("per-ip", 1500);
        let grpc = grpc_reply(&reply);
        let get = |name: &str| {
            grpc.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(get("retry-after").as_deref(), Some("2"));
        let details = get("grpc-status-details-bin").unwrap();
        let raw = {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD_NO_PAD.decode(details)
        }
        .unwrap();
        let message =
            "rate limit `per-ip` exceeded (local budget while the shared store is unavailable)";
        // Status{code: 8, message, details: [Any{RetryInfo{1.5 s}}]}
        let mut want = vec![0x08, 8, 0x12, message.len() as u8];
        want.extend_from_slice(message.as_bytes());
        let type_url = b"type.googleapis.com/google.rpc.RetryInfo";
        let retry = [0x0a, 8, 0x08, 1, 0x10, 0x80, 0xca, 0xb5, 0xee, 0x01];
        want.extend_from_slice(&[0x1a, (2 + type_url.len() + 2 + retry.len()) as u8]);
        want.extend_from_slice(&[0x0a, type_url.len() as u8]);
        want.extend_from_slice(type_url);
        want.extend_from_slice(&[0x12, retry.len() as u8]);
        want.extend_from_slice(&retry);
        assert_eq!(raw, want);
    }

    #[test]
    fn every_kind_of_answer_has_its_own_response_code_details_without_spaces() {
        let all = [
            bad_request("x"),
            idempotency_conflict(),
            too_many_requests_locally("l", 10),
            idempotency_mismatch(),
            payload_too_large(1),
            stored_response_missing(),
            stored_response_corrupt(),
            stored_response_unavailable(),
            unavailable("x"),
        ];
        let mut seen: Vec<&str> = all.iter().map(|r| r.details).collect();
        assert!(seen
            .iter()
            .all(|d| d.starts_with("redis_guard_") && !d.contains(char::is_whitespace)));
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), all.len(), "one value per kind: {seen:?}");
        // gRPC's form of an answer keeps them.
        assert_eq!(
            grpc_reply(&idempotency_conflict()).details,
            "redis_guard_idempotency_conflict"
        );
    }

    #[test]
    fn a_reply_that_is_not_a_problem_is_left_alone() {
        let replay = LocalReply {
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())],
            body: b"{}".to_vec(),
            grpc_status: None,
            retry_ms: None,
            details: "redis_guard_idempotent_replay",
        };
        assert_eq!(grpc_reply(&replay), replay);
    }

    #[test]
    fn a_response_is_complete_once_at_its_content_length_or_its_end() {
        let mut c = Completion::default();
        assert!(!c.headers(Some(5), false));
        assert!(!c.body(3, false));
        assert!(c.body(2, false), "all 5 bytes: the client has it all");
        assert!(!c.body(0, true), "said once");
        assert!(!c.trailers());
        let mut c = Completion::default();
        assert!(!c.headers(None, false));
        assert!(!c.body(100, false));
        assert!(c.body(0, true));
        let mut c = Completion::default();
        assert!(
            !c.headers(Some(0), false),
            "an empty body: complete at its end"
        );
        assert!(c.body(0, true));
        let mut c = Completion::default();
        assert!(c.headers(None, true));
        let mut c = Completion::default();
        c.headers(None, false);
        assert!(c.trailers());
    }
    use crate::ratelimit::{Check, LimitResult};

    fn setup(headers: &str) -> (Config, Plan) {
        let cfg = Config::parse(
            format!(
                r#"{{"redis":{{"cluster":"w"}},{headers}"limits":[
                {{"name":"burst","tokenBucket":{{"capacity":10,"refill":1,"periodMs":1000}}}},
                {{"name":"minute","slidingWindow":{{"limit":100,"windowMs":60000}}}},
                {{"name":"trial","shadow":true,"slidingWindow":{{"limit":1,"windowMs":1000}}}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        let checks = (0..3)
            .map(|i| Check {
                limit: i,
                key: vec![],
                edges: None,
                remembered: None,
                anchoring: None,
                cost: 1,
                carried: None,
                digest: Default::default(),
            })
            .collect();
        (
            cfg,
            Plan {
                checks,
                ..Plan::default()
            },
        )
    }

    fn res(allowed: bool, remaining: u64, retry_ms: u64, reset_ms: u64) -> LimitResult {
        LimitResult {
            allowed,
            remaining,
            retry_ms,
            reset_ms,
            overridden: crate::ratelimit::OverrideUse::None,
            plan: None,
        }
    }

    fn get<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
        h.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn headers_state_the_plan_that_decided_a_limit_and_leave_out_one_whose_plan_is_unknown() {
        use crate::ratelimit::OverrideUse;
        let (cfg, plan) = setup("");
        let under = |r: LimitResult, plan: Option<[u64; 2]>| LimitResult {
            overridden: OverrideUse::Applied,
            plan,
            ..r
        };
        let outcome = Outcome {
            admitted: true,
            results: vec![
                under(res(true, 40, 0, 2000), Some([50, 25])),
                under(res(true, 900, 0, 59_001), Some([1000, 0])),
                res(true, 0, 0, 0),
            ],
        };
        let h = rate_limit_headers(&cfg, &plan, &outcome);
        // The bucket's plan: capacity 50, refill 25 a second (w: 2 s to
        // fill); the window's: 1,000 a minute.
        assert_eq!(
            get(&h, "ratelimit-policy"),
            Some("\"burst\";q=50;w=2, \"minute\";q=1000;w=60")
        );
        assert_eq!(get(&h, "x-ratelimit-limit"), Some("50"));
        assert_eq!(get(&h, "x-ratelimit-remaining"), Some("40"));
        // A plan decided it but its figures are unknown (the over-limit
        // cache's answer): left out, never the configured quota.
        let outcome = Outcome {
            admitted: true,
            results: vec![
                under(res(true, 40, 0, 2000), None),
                res(true, 90, 0, 60_000),
                res(true, 0, 0, 0),
            ],
        };
        let h = rate_limit_headers(&cfg, &plan, &outcome);
        assert_eq!(get(&h, "ratelimit-policy"), Some("\"minute\";q=100;w=60"));
        assert_eq!(get(&h, "x-ratelimit-limit"), Some("100"));
    }

    #[test]
    fn admitted_headers_describe_the_tightest_enforced_limit() {
        let (cfg, plan) = setup("");
        let outcome = Outcome {
            admitted: true,
            results: vec![
                res(true, 3, 0, 7000),
                res(true, 50, 0, 59_001),
                res(false, 0, 200, 200),
            ],
        };
        let h = rate_limit_headers(&cfg, &plan, &outcome);
        assert_eq!(
            get(&h, "ratelimit-policy"),
            Some("\"burst\";q=10;w=10, \"minute\";q=100;w=60")
        );
        assert_eq!(
            get(&h, "ratelimit"),
            Some("\"burst\";r=3;t=7, \"minute\";r=50;t=60")
        );
        assert_eq!(get(&h, "x-ratelimit-limit"), Some("10"));
        assert_eq!(get(&h, "x-ratelimit-remaining"), Some("3"));
        assert_eq!(get(&h, "x-ratelimit-reset"), Some("7"));
    }

    #[test]
    fn rejection_names_the_limit_and_retry_after_matches_reset() {
        let (cfg, plan) = setup("");
        let outcome = Outcome {
            admitted: false,
            results: vec![
                res(true, 3, 0, 7000),
                res(false, 0, 1200, 1200),
                res(true, 0, 0, 0),
            ],
        };
        let r = too_many_requests(&cfg, &plan, &outcome);
        assert_eq!(r.status, 429);
        assert_eq!(get(&r.headers, "retry-after"), Some("2"));
        assert_eq!(get(&r.headers, "x-ratelimit-reset"), Some("2"));
        assert_eq!(get(&r.headers, "x-ratelimit-limit"), Some("100"));
        assert_eq!(get(&r.headers, "x-ratelimit-remaining"), Some("0"));
        assert_eq!(
            get(&r.headers, "content-type"),
            Some("application/problem+json")
        );
        let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body["status"], 429);
        assert_eq!(body["limits"], json!(["minute"]));
        assert_eq!(body["retryAfter"], 2);
    }

    #[test]
    fn header_sets_are_configurable() {
        let outcome = Outcome {
            admitted: true,
            results: vec![
                res(true, 3, 0, 7000),
                res(true, 50, 0, 59_001),
                res(true, 0, 0, 0),
            ],
        };
        let (cfg, plan) = setup(r#""rateLimitHeaders":["x-ratelimit"],"#);
        let h = rate_limit_headers(&cfg, &plan, &outcome);
        assert!(get(&h, "ratelimit").is_none());
        assert!(get(&h, "x-ratelimit-limit").is_some());
        let (cfg, plan) = setup(r#""rateLimitHeaders":["ietf"],"#);
        let h = rate_limit_headers(&cfg, &plan, &outcome);
        assert!(get(&h, "ratelimit").is_some());
        assert!(get(&h, "x-ratelimit-limit").is_none());
        let (cfg, plan) = setup(r#""rateLimitHeaders":[],"#);
        assert!(rate_limit_headers(&cfg, &plan, &outcome).is_empty());
    }
}
