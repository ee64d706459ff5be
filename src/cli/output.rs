//! What the CLI prints: readable text by default, one JSON document with
//! `--json`. Keys are bytes (client values stay as they are): text shows
//! them with `\xNN` for anything not printable, JSON the same string.

use std::fmt::Write as _;
use std::path::Path;

use redis_guard::config::{Algorithm, Config, Cost, FailureMode, Part, PathMatch};
use redis_guard::idempotency::decode_response_fields;
use redis_guard::keys::push_value;
use serde_json::{json, Value};

use crate::select::{names, LimitTarget, RecordTarget};
use crate::store::{Forgot, Inspection, Raw};
use crate::Failure;

/// One command's result in both forms.
pub struct Report {
    pub text: String,
    pub json: Value,
}

pub struct Out {
    pub json: bool,
}

impl Out {
    pub fn report(&self, report: &Report) {
        if self.json {
            println!("{}", report.json);
        } else {
            print!("{}", report.text);
        }
    }

    /// The message on stderr, and with --json also as a document on stdout.
    pub fn failure(&self, failure: &Failure) {
        eprintln!("redis-guard: {}", failure.message);
        if self.json {
            println!(
                "{}",
                json!({"error": {"kind": failure.kind, "message": failure.message, "exitCode": failure.code}})
            );
        }
    }
}

/// Bytes as text: printable ASCII as it is, `\\` and `\xNN` for the rest.
pub fn printable(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes {
        match b {
            b'\\' => out.push_str("\\\\"),
            0x20..=0x7e => out.push(char::from(b)),
            _ => {
                let _ = write!(out, "\\x{b:02x}");
            }
        }
    }
    out
}

fn kind(algorithm: &Algorithm) -> (String, Value) {
    match *algorithm {
        Algorithm::TokenBucket {
            capacity,
            refill,
            period_ms,
        } => (
            format!("token bucket: capacity {capacity}, refill {refill} per {period_ms} ms"),
            json!({"tokenBucket": {"capacity": capacity, "refill": refill, "periodMs": period_ms}}),
        ),
        Algorithm::SlidingWindow { limit, window_ms } => (
            format!("sliding window: {limit} per {window_ms} ms"),
            json!({"slidingWindow": {"limit": limit, "windowMs": window_ms}}),
        ),
        Algorithm::Gcra {
            rate,
            period_ms,
            burst,
        } => (
            format!("GCRA: rate {rate} per {period_ms} ms, burst {burst}"),
            json!({"gcra": {"rate": rate, "periodMs": period_ms, "burst": burst}}),
        ),
        Algorithm::FixedWindow { limit, window_ms } => (
            format!("fixed window: {limit} per {window_ms} ms (aligned to the epoch)"),
            json!({"fixedWindow": {"limit": limit, "windowMs": window_ms}}),
        ),
        Algorithm::SlidingWindowCounter { limit, window_ms } => (
            format!("sliding-window counter: about {limit} per {window_ms} ms"),
            json!({"slidingWindowCounter": {"limit": limit, "windowMs": window_ms}}),
        ),
        Algorithm::Concurrency { max, lease_ms } => (
            format!("concurrency: at most {max} in flight (slot lease {lease_ms} ms)"),
            json!({"concurrency": {"max": max, "leaseMs": lease_ms}}),
        ),
        Algorithm::Quota { amount, calendar } => {
            let (per, zone) = (calendar.per.name(), calendar.zone.name());
            let anchor = match calendar.per.anchors() {
                Some(_) => format!(", from day {}", calendar.anchor),
                None => String::new(),
            };
            (
                format!("quota: {amount} per {per} in {zone}{anchor}"),
                json!({"quota": {"amount": amount, "per": per, "timeZone": zone,
                                 "anchorDay": calendar.anchor}}),
            )
        }
    }
}

fn mode(mode: FailureMode) -> &'static str {
    match mode {
        FailureMode::Allow => "allow",
        FailureMode::Deny => "deny",
        FailureMode::Local => "local",
    }
}

/// A key's shape with each value by its name: `<x-user>`.
fn parts_pattern(parts: &[Part]) -> String {
    parts
        .iter()
        .map(|p| match p {
            Part::Literal(v) => {
                let mut enc = Vec::new();
                push_value(&mut enc, v.as_bytes());
                printable(&enc)
            }
            other => format!("<{}>", crate::select::part_name(other).unwrap_or_default()),
        })
        .collect::<Vec<_>>()
        .join(":")
}

fn tag_pattern(config: &Config) -> String {
    match &config.static_tag {
        Some(tag) => tag.clone(),
        None => format!("<hash of {}>", names(&config.hash_tag).join(", ")),
    }
}

fn match_summary(m: &redis_guard::config::Matcher) -> String {
    let mut out = Vec::new();
    match &m.path {
        PathMatch::Any => {}
        PathMatch::Prefix(p) => out.push(format!("path prefix {p}")),
        PathMatch::Exact(p) => out.push(format!("path {p}")),
    }
    if !m.methods.is_empty() {
        out.push(format!("methods {}", m.methods.join(",")));
    }
    if let Some(h) = &m.host {
        out.push(format!("host {h}"));
    }
    let conditions = m.headers.len() + m.values.len();
    if conditions > 0 {
        out.push(format!("{conditions} header/value condition(s)"));
    }
    if out.is_empty() {
        "every request".to_string()
    } else {
        out.join("; ")
    }
}

/// A limit's or rule's key pattern and the value names it needs.
fn key_and_values(text: &mut String, key: &str, what: &str, values: &[String]) {
    let values = if values.is_empty() {
        "none".to_string()
    } else {
        values.join(", ")
    };
    let _ = writeln!(text, "    key: {key}\n    {what}: {values}");
}

/// `check`: what the configuration asks of the filter.
pub fn summary(path: &Path, config: &Config) -> Report {
    let mut text = format!("{}: valid\n", path.display());
    let tag = tag_pattern(config);
    let _ = writeln!(
        text,
        "redis: Envoy cluster `{}`, timeout {} ms, credentials {}",
        config.redis.cluster,
        config.redis.timeout.as_millis(),
        if config.redis.auth.is_some() {
            "set"
        } else {
            "none"
        }
    );
    let _ = writeln!(text, "keys: prefix `{}`, hash tag {tag}", config.key_prefix);
    let _ = writeln!(text, "limits: {}", config.limits.len());
    let mut limits = Vec::new();
    for limit in &config.limits {
        let (desc, params) = kind(&limit.algorithm);
        let key = format!(
            "{}:rl:{{{tag}}}{}{}",
            config.key_prefix,
            limit.key_infix,
            parts_pattern(&limit.descriptor)
        );
        let cost = match &limit.cost {
            Cost::Fixed(c) => c.to_string(),
            Cost::Header { name, default, max } => {
                format!("header {name} (1..{max}, default {default})")
            }
        };
        let values = names(&limit.descriptor);
        let _ = writeln!(text, "  {}: {desc}", limit.name);
        let _ = writeln!(
            text,
            "    applies to: {}; cost {cost}{}{}; failure mode {}",
            match_summary(&limit.matcher),
            if limit.usage.is_some() {
                ", settled by usage"
            } else {
                ""
            },
            if limit.shadow { "; shadow" } else { "" },
            mode(limit.failure_mode)
        );
        key_and_values(&mut text, &key, "values", &values);
        limits.push(json!({
            "name": limit.name,
            "kind": params,
            "shadow": limit.shadow,
            "failureMode": mode(limit.failure_mode),
            "keyPattern": key,
            "values": values,
        }));
    }
    let _ = writeln!(text, "idempotency rules: {}", config.idempotency.len());
    let mut rules = Vec::new();
    for rule in &config.idempotency {
        let key = format!(
            "{}:idem:{{{tag}}}:{}:{}:<key>",
            config.key_prefix,
            rule.name,
            parts_pattern(&rule.tenant)
        );
        let values = names(&rule.tenant);
        let _ = writeln!(
            text,
            "  {}: header {}{}, applies to: {}; lock {} ms, record {} ms; failure mode {}",
            rule.name,
            rule.header,
            if rule.required { " (required)" } else { "" },
            match_summary(&rule.matcher),
            rule.lock_ttl_ms,
            rule.record_ttl_ms,
            mode(rule.failure_mode)
        );
        key_and_values(&mut text, &key, "tenant values", &values);
        rules.push(json!({
            "name": rule.name,
            "header": rule.header,
            "required": rule.required,
            "lockTtlMs": rule.lock_ttl_ms,
            "recordTtlMs": rule.record_ttl_ms,
            "keyPattern": key,
            "tenantValues": values,
        }));
    }
    Report {
        text,
        json: json!({
            "valid": true,
            "config": path.display().to_string(),
            "keyPrefix": config.key_prefix,
            "limits": limits,
            "idempotency": rules,
        }),
    }
}

fn raw_json(raw: &Raw) -> Value {
    let entries: Vec<Value> = raw
        .entries
        .iter()
        .map(|(k, v)| json!([printable(k), printable(v)]))
        .collect();
    json!({"type": raw.kind, "pttlMs": raw.pttl_ms, "entries": entries, "members": raw.members})
}

fn raw_text(raw: &Raw) -> String {
    if raw.kind == "none" {
        return "none (no key: the limit is whole)".to_string();
    }
    let entries: Vec<String> = raw
        .entries
        .iter()
        .map(|(k, v)| match (raw.kind.as_str(), k.is_empty()) {
            ("string", _) | (_, true) => printable(v),
            ("zset", _) => format!("{} @{}", printable(k), printable(v)),
            _ => format!("{}={}", printable(k), printable(v)),
        })
        .collect();
    let count = raw
        .members
        .map(|n| format!(" ({n} members, the oldest first)"))
        .unwrap_or_default();
    format!("{}{count}: {}", raw.kind, entries.join(" "))
}

/// `inspect`.
pub fn inspection(target: &LimitTarget, cost: u64, s: &Inspection) -> Report {
    let (desc, params) = kind(&target.limit.algorithm);
    let key = printable(&target.key);
    let verdict = if s.allowed {
        format!("a request of cost {cost} would be admitted")
    } else if let Some(ms) = s.blocked_ms {
        format!("blocked: every request is rejected (429) for {ms} ms more")
    } else {
        format!("a request of cost {cost} would be rejected (429)")
    };
    let mut text = String::new();
    let _ = writeln!(text, "limit:      {} ({desc})", target.limit.name);
    let _ = writeln!(text, "key:        {key}");
    let _ = writeln!(text, "now:        {verdict}");
    let _ = writeln!(text, "remaining:  {}", s.remaining);
    let _ = writeln!(text, "retry in:   {} ms", s.retry_ms);
    let _ = writeln!(text, "reset in:   {} ms", s.reset_ms);
    let _ = writeln!(
        text,
        "ttl:        {}",
        match s.raw.pttl_ms {
            -2 => "no key".to_string(),
            -1 => "none".to_string(),
            ms => format!("{ms} ms"),
        }
    );
    let _ = writeln!(text, "state:      {}", raw_text(&s.raw));
    let _ = writeln!(text, "redis time: {} ms", s.redis_time_ms);
    if let Some(q) = &s.quota {
        let _ = writeln!(text, "window:     from {}", q.start);
        let _ = writeln!(text, "used:       {} of {}", q.used, q.amount);
        let _ = writeln!(text, "left:       {}", q.left);
        let _ = writeln!(text, "renews:     {}", q.renewal);
    }
    let quota = s.quota.as_ref().map(|q| {
        json!({"windowStartMs": q.start_ms, "windowStart": q.start, "used": q.used,
               "amount": q.amount, "left": q.left, "renewalMs": q.renewal_ms,
               "renewal": q.renewal})
    });
    Report {
        text,
        json: json!({
            "quota": quota,
            "limit": target.limit.name,
            "kind": params,
            "key": key,
            "cost": cost,
            "allowed": s.allowed,
            "remaining": s.remaining,
            "retryMs": s.retry_ms,
            "resetMs": s.reset_ms,
            "redisTimeMs": s.redis_time_ms,
            "blockedMs": s.blocked_ms,
            "state": raw_json(&s.raw),
        }),
    }
}

/// `reset`.
pub fn reset(target: &LimitTarget, deleted: bool, unblocked: bool) -> Report {
    let key = printable(&target.key);
    let mut text = if unblocked {
        format!(
            "reset `{}`: lifted its block and deleted {key}; its whole budget is back\n",
            target.limit.name
        )
    } else if deleted {
        format!(
            "reset `{}`: deleted {key}; its whole budget is back\n",
            target.limit.name
        )
    } else {
        format!(
            "reset `{}`: no state at {key} (the limit was already whole)\n",
            target.limit.name
        )
    };
    text.push_str("note: an Envoy that cached a rejection of this key answers 429 until that rejection's Retry-After (at most 1 s); tokens already leased to an Envoy stay its own until their lease ends\n");
    Report {
        text,
        json: json!({"limit": target.limit.name, "key": key, "deleted": deleted, "unblocked": unblocked}),
    }
}

fn field<'a>(raw: &'a Raw, name: &str) -> Option<&'a [u8]> {
    raw.entries
        .iter()
        .find(|(k, _)| k == name.as_bytes())
        .map(|(_, v)| v.as_slice())
}

fn text_of(v: Option<&[u8]>) -> Option<String> {
    v.map(|b| String::from_utf8_lossy(b).into_owned())
}

/// `idempotency show`.
pub fn record(target: &RecordTarget, raw: &Raw) -> Report {
    let key = printable(&target.key);
    let state = match field(raw, "s") {
        None => "absent",
        Some(b"P") => "in progress",
        Some(b"C") => "completed",
        Some(_) => "unknown",
    };
    let status = text_of(field(raw, "st")).and_then(|s| s.parse::<u32>().ok());
    let object = field(raw, "ok").map(|k| {
        json!({
            "key": printable(k),
            "sha256": text_of(field(raw, "oc")),
            "length": text_of(field(raw, "ol")).and_then(|l| l.parse::<u64>().ok()),
        })
    });
    let body_bytes = match (&object, field(raw, "b")) {
        (Some(o), _) => o["length"].as_u64(),
        (None, Some(b)) => Some(b.len() as u64),
        (None, None) => None,
    };
    let stored = field(raw, "h").and_then(|h| decode_response_fields(h).ok());
    let header_names: Vec<String> = stored
        .iter()
        .flat_map(|(h, t)| h.iter().chain(t.iter()).map(|(n, _)| n.clone()))
        .collect();
    let mut text = String::new();
    let _ = writeln!(text, "rule:     {}", target.rule.name);
    let _ = writeln!(text, "key:      {key}");
    let _ = writeln!(text, "state:    {state}");
    if raw.kind != "none" {
        let _ = writeln!(text, "ttl:      {} ms", raw.pttl_ms);
    }
    if let Some(status) = status {
        let _ = writeln!(text, "status:   {status}");
    }
    if let Some(n) = body_bytes {
        let _ = writeln!(text, "body:     {n} bytes");
    }
    if !header_names.is_empty() {
        let _ = writeln!(text, "headers:  {}", header_names.join(", "));
    }
    if let Some(o) = &object {
        let _ = writeln!(
            text,
            "object:   {} (sha256 {}, {} bytes)",
            o["key"].as_str().unwrap_or_default(),
            o["sha256"].as_str().unwrap_or_default(),
            o["length"]
        );
    }
    if let Some(f) = text_of(field(raw, "f")) {
        let _ = writeln!(text, "request fingerprint: {f}");
    }
    Report {
        text,
        json: json!({
            "rule": target.rule.name,
            "key": key,
            "state": state,
            "pttlMs": if raw.kind == "none" { Value::Null } else { json!(raw.pttl_ms) },
            "status": status,
            "bodyBytes": body_bytes,
            "headers": header_names,
            "object": object,
            "fingerprint": text_of(field(raw, "f")),
        }),
    }
}

/// `idempotency forget`.
pub fn forgot(target: &RecordTarget, outcome: Forgot) -> Report {
    let key = printable(&target.key);
    let forgotten = outcome == Forgot::Deleted;
    let text = if forgotten {
        format!("forgot {key}: the key runs again on its next request\n")
    } else {
        format!("no record at {key} (never used, or expired)\n")
    };
    Report {
        text,
        json: json!({"rule": target.rule.name, "key": key, "forgotten": forgotten}),
    }
}

/// `wire`: what was written.
pub fn wire(calls: u64, members: usize, bytes: u64) -> Report {
    let requests = calls.saturating_mul(members as u64);
    Report {
        text: format!(
            "wrote {calls} calls ({requests} requests, {bytes} bytes of path and body, {:.1} per request)\n",
            bytes as f64 / requests.max(1) as f64
        ),
        json: json!({"calls": calls, "requests": requests, "wireBytes": bytes}),
    }
}
