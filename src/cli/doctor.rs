//! `redis-guard doctor`: whether a running Envoy's filter is wired right.
//!
//! With the default failure mode (`allow`) a wiring mistake disables every
//! limit without one refused request, so "it runs" says nothing. The doctor
//! reads what Envoy itself knows, from its admin interface: `/config_dump`
//! (is the filter there, what configuration does it hold, does the cluster
//! it names exist, do its calls carry credentials) and `/stats` (the
//! filter's own counters and Envoy's for that cluster: calls, errors by
//! kind, Webdis' 401/403, decisions, the failure mode's answers, which
//! limits rejected). Each problem comes with its fix. Optionally it sends
//! one request through Envoy first (`--request`) and judges the calls that
//! request made, and checks Redis itself (`--redis`).
//!
//! It never prints the filter's configuration: it may hold Webdis'
//! password (`redis.credentials`).

mod admin;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use clap::Args;
use redis_guard::config::{Config, FailureMode};
use redis_guard::filter::ErrorKind;
use serde_json::{json, Value};

use crate::output::Report;
use crate::Failure;
use admin::{admin_base, limit_names_from_stats, read_envoy, send, wiring, Envoy, Wiring};

/// Exit codes of `doctor`, as the book's CLI page documents them.
pub mod code {
    /// Nothing wrong found (warnings and notes may be printed).
    pub const HEALTHY: u8 = 0;
    /// At least one problem found; each is printed with its fix.
    pub const PROBLEMS: u8 = 7;
    /// The admin address did not answer as an Envoy admin interface.
    pub const NO_ADMIN: u8 = 8;
}

#[derive(Args)]
pub struct DoctorArgs {
    /// Envoy's admin address: http://HOST:PORT or HOST:PORT (Envoy's `admin:` listener).
    #[arg(long)]
    admin: String,
    /// Also check Redis itself: redis://[user:password@]host:port.
    #[arg(long)]
    redis: Option<String>,
    /// First send one GET through Envoy to this URL (a path a limit applies to) and judge the Redis calls it made.
    #[arg(long)]
    request: Option<String>,
    /// A header of the --request GET, NAME:VALUE (repeat).
    #[arg(long = "header", value_name = "NAME:VALUE")]
    headers: Vec<String>,
    /// Timeout of each HTTP request and of the Redis connection, in ms.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    Ok,
    Note,
    Warning,
    Problem,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Note => "note",
            Level::Warning => "warning",
            Level::Problem => "problem",
        }
    }
}

struct Finding {
    id: &'static str,
    level: Level,
    message: String,
    fix: Option<String>,
}

/// The filter's counters that the verdicts are drawn from.
#[derive(Clone, Default)]
struct Counts {
    calls: u64,
    errors: BTreeMap<&'static str, u64>,
    reloads: u64,
    decided: u64,
    admitted: u64,
    rejected: u64,
    undecided: u64,
    /// Webdis' 401 and 403 as Envoy counted them on the Redis cluster.
    refused_by_webdis: u64,
}

impl Counts {
    fn read(envoy: &Envoy, limits: &[String], cluster: Option<&str>) -> Counts {
        let mut c = Counts {
            calls: envoy.filter("redis.calls"),
            reloads: envoy.filter("redis.script_reloads"),
            undecided: ["allowed", "denied", "local"]
                .iter()
                .map(|m| envoy.filter(&format!("failure_mode.{m}")))
                .sum(),
            ..Counts::default()
        };
        for kind in ErrorKind::ALL {
            let n = envoy.filter(&format!("redis.errors_by_kind.{}", kind.name()));
            c.errors.insert(kind.name(), n);
        }
        for name in limits {
            c.admitted += envoy.filter(&format!("ratelimit.{name}.allowed"));
            c.rejected += envoy.filter(&format!("ratelimit.{name}.rejected"));
        }
        let idempotency: u64 = ["acquired", "replayed", "conflicted", "mismatched"]
            .iter()
            .map(|s| envoy.filter(&format!("idempotency.{s}")))
            .sum();
        c.decided = c.admitted + c.rejected + idempotency;
        if let Some(cluster) = cluster {
            c.refused_by_webdis = envoy.stat(&format!("cluster.{cluster}.upstream_rq_401"))
                + envoy.stat(&format!("cluster.{cluster}.upstream_rq_403"));
        }
        c
    }

    /// What happened between `before` and `self`.
    fn since(&self, before: &Counts) -> Counts {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        Counts {
            calls: d(self.calls, before.calls),
            errors: self
                .errors
                .iter()
                .map(|(k, v)| (*k, d(*v, before.errors.get(k).copied().unwrap_or(0))))
                .collect(),
            reloads: d(self.reloads, before.reloads),
            decided: d(self.decided, before.decided),
            admitted: d(self.admitted, before.admitted),
            rejected: d(self.rejected, before.rejected),
            undecided: d(self.undecided, before.undecided),
            refused_by_webdis: d(self.refused_by_webdis, before.refused_by_webdis),
        }
    }

    fn failed(&self) -> u64 {
        self.errors.values().sum()
    }
}

pub fn run(args: &DoctorArgs) -> Result<(Report, u8), Failure> {
    let admin = admin_base(&args.admin);
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_millis(args.timeout_ms))
        .build();
    let unreachable = |why: String| Failure {
        code: code::NO_ADMIN,
        kind: "admin",
        message: format!("Envoy's admin at {admin} does not answer as one: {why}"),
    };
    let mut envoy = read_envoy(&agent, &admin).map_err(unreachable)?;
    let wiring = envoy.dump.as_ref().map(wiring);
    let mut findings = Vec::new();
    let config = wiring.as_ref().and_then(|w| w.config.as_ref());
    let parsed = match config {
        Some(Ok(c)) => Some(c),
        _ => None,
    };
    let limits: Vec<String> = parsed.map_or_else(
        || limit_names_from_stats(&envoy),
        |c| c.limits.iter().map(|l| l.name.clone()).collect(),
    );
    let cluster = parsed.map(|c| c.redis.cluster.clone());
    let loaded = filter_findings(&envoy, wiring.as_ref(), &mut findings);
    if let (Some(c), Some(w)) = (parsed, wiring.as_ref()) {
        wiring_findings(c, w, &mut findings);
    }
    let mut request = None;
    if let Some(url) = &args.request {
        let before = Counts::read(&envoy, &limits, cluster.as_deref());
        match send(&agent, url, &args.headers)? {
            Ok(status) => {
                envoy = read_envoy(&agent, &admin).map_err(unreachable)?;
                let after = Counts::read(&envoy, &limits, cluster.as_deref());
                let delta = after.since(&before);
                request = Some(json!({"url": url, "status": status, "calls": delta.calls,
                                      "failed": delta.failed()}));
                judge(&delta, parsed, Some((url, status)), &mut findings);
            }
            Err(why) => findings.push(Finding {
                id: "request",
                level: Level::Problem,
                message: format!("the request to {url} got no answer from Envoy: {why}"),
                fix: Some("give --request a URL of one of this Envoy's listeners".into()),
            }),
        }
    } else if loaded {
        let counts = Counts::read(&envoy, &limits, cluster.as_deref());
        judge(&counts, parsed, None, &mut findings);
    }
    if loaded {
        circuit_and_limits(&envoy, &limits, &mut findings);
    }
    if let Some(url) = &args.redis {
        findings.push(check_redis(url, args.timeout_ms));
    }
    Ok(report(&admin, &findings, request))
}

/// Whether the filter is loaded; says so, or what is missing.
fn filter_findings(envoy: &Envoy, wiring: Option<&Wiring>, out: &mut Vec<Finding>) -> bool {
    let has_stats = envoy
        .stats
        .contains_key("wasmcustom.redis_guard.redis.calls");
    let config = wiring.and_then(|w| w.config.as_ref());
    match (config, has_stats) {
        (Some(Err(e)), _) => out.push(Finding {
            id: "filter",
            level: Level::Problem,
            message: format!("Envoy holds a redis-guard configuration the filter refuses: {e}"),
            fix: Some("correct that field (`redis-guard check CONFIG.json` runs the same parser); Envoy's log at start names it too".into()),
        }),
        (Some(Ok(c)), true) => out.push(Finding {
            id: "filter",
            level: Level::Ok,
            message: format!(
                "the filter is loaded: redis.cluster `{}`, timeoutMs {}, {} limit(s), {} idempotency rule(s)",
                c.redis.cluster,
                c.redis.timeout.as_millis(),
                c.limits.len(),
                c.idempotency.len()
            ),
            fix: None,
        }),
        (Some(Ok(_)), false) => out.push(Finding {
            id: "filter",
            level: Level::Problem,
            message: "Envoy holds the filter's configuration but the filter defined no stats: its VM did not start".into(),
            fix: Some("read Envoy's log from its start (a wasm file it cannot load, a runtime it lacks: envoy.wasm.runtime.v8)".into()),
        }),
        (None, true) => out.push(Finding {
            id: "filter",
            level: Level::Ok,
            message: "the filter is loaded (its stats are there; /config_dump was not readable, so its wiring is not checked)".into(),
            fix: None,
        }),
        (None, false) => out.push(Finding {
            id: "filter",
            level: Level::Problem,
            message: "no redis-guard filter in this Envoy: neither its configuration nor its stats".into(),
            fix: Some("add the envoy.filters.http.wasm filter (root_id redis_guard) to the HTTP connection manager's http_filters, before the router: envoy/examples/minimal.yaml is a complete example".into()),
        }),
    }
    has_stats
}

/// The cluster `redis.cluster` names, and the credentials its calls carry.
fn wiring_findings(config: &Config, wiring: &Wiring, out: &mut Vec<Finding>) {
    let name = &config.redis.cluster;
    let Some(&adds_auth) = wiring.clusters.get(name) else {
        let known: Vec<&str> = wiring.clusters.keys().map(String::as_str).collect();
        out.push(Finding {
            id: "cluster",
            level: Level::Problem,
            message: format!("redis.cluster is `{name}`, and Envoy has no cluster of that name: every call is refused before it leaves Envoy"),
            fix: Some(format!(
                "set redis.cluster to the Envoy cluster in front of Webdis, or add that cluster (envoy/examples/minimal.yaml's `webdis`); Envoy's clusters: {}",
                known.join(", ")
            )),
        });
        return;
    };
    out.push(Finding {
        id: "cluster",
        level: Level::Ok,
        message: format!("the cluster `{name}` exists"),
        fix: None,
    });
    let (level, message, fix) = if config.redis.auth.is_some() {
        (
            Level::Ok,
            "calls carry Webdis credentials from redis.credentials".to_string(),
            None,
        )
    } else if adds_auth {
        (
            Level::Ok,
            format!("the cluster `{name}` adds an Authorization header to the calls"),
            None,
        )
    } else {
        (
            Level::Warning,
            format!("calls carry no credentials: no redis.credentials, and the cluster `{name}` adds no Authorization header; a Webdis with http_basic_auth (envoy/webdis.json ships one) refuses them"),
            Some(format!("{ADD_CREDENTIALS} (unless your Webdis admits calls without credentials)")),
        )
    };
    out.push(Finding {
        id: "credentials",
        level,
        message,
        fix,
    });
}

const ADD_CREDENTIALS: &str = "copy the header_mutation upstream filter of envoy/envoy.yaml's `webdis` cluster (it adds REDIS_GUARD_WEBDIS_AUTHORIZATION from Envoy's environment, `Basic ` and base64 of user:password), or set redis.credentials";

/// What one error kind means, and its fix.
fn error_fix(kind: &str, counts: &Counts, config: Option<&Config>) -> (String, String) {
    let cluster = config.map_or("webdis".to_string(), |c| c.redis.cluster.clone());
    match kind {
        "dispatch" => (
            format!("Envoy refused to send them (a cluster `{cluster}` missing, or out of capacity)"),
            format!("redis.cluster must name the Envoy cluster in front of Webdis (now `{cluster}`)"),
        ),
        "auth" if counts.refused_by_webdis > 0 => match config {
            Some(c) if c.redis.auth.is_some() => (
                format!("Webdis refused the credentials in redis.credentials (HTTP 401/403 on the cluster `{cluster}`: {})", counts.refused_by_webdis),
                "set redis.credentials to the user and password Webdis' http_basic_auth admits (envoy/webdis.json)".to_string(),
            ),
            _ => (
                format!("Webdis refused them for their credentials (HTTP 401/403 on the cluster `{cluster}`: {}): none sent, or not the ones it admits", counts.refused_by_webdis),
                format!("{ADD_CREDENTIALS}; if the cluster already adds the header, REDIS_GUARD_WEBDIS_AUTHORIZATION must be set in Envoy's environment (unset, Envoy sends `-`)"),
            ),
        },
        "auth" => (
            "Redis refused them: NOAUTH or WRONGPASS (Webdis' redis_auth) or NOPERM (the Redis user's ACL); Envoy's log quotes Redis".to_string(),
            "give Webdis the Redis password (redis_auth in its configuration) of a user envoy/redis.acl's rules admit, for the filter's keyPrefix".to_string(),
        ),
        "timeout" => (
            format!("no answer within redis.timeoutMs ({} ms)", config.map_or(0, |c| c.redis.timeout.as_millis())),
            format!("check that Webdis listens where the cluster `{cluster}` points and reaches Redis; raise timeoutMs if the calls' round trip is longer"),
        ),
        "http" => (
            "Webdis or Envoy answered an HTTP error (503: Webdis cannot reach Redis, or no healthy Webdis)".to_string(),
            format!("check that Webdis runs where the cluster `{cluster}` points and that Redis is up (--redis checks it)"),
        ),
        "redis" => (
            "Redis answered an error (Envoy's log quotes it: OOM, CROSSSLOT, a script error)".to_string(),
            "read the error in Envoy's log; for OOM give Redis memory or a maxmemory policy that keeps the filter's keys".to_string(),
        ),
        _ => (
            "a reply the filter cannot read".to_string(),
            format!("the cluster `{cluster}` must point at Webdis (envoy/webdis.json), with nothing in between rewriting its answers"),
        ),
    }
}

/// The calls and decisions: since Envoy started, or the `--request`'s.
fn judge(
    c: &Counts,
    config: Option<&Config>,
    request: Option<(&str, u16)>,
    out: &mut Vec<Finding>,
) {
    let scope = match request {
        Some((url, status)) => format!("the request to {url} (answered {status})"),
        None => "since Envoy started".to_string(),
    };
    if c.calls == 0 && c.undecided == 0 && c.decided == 0 {
        out.push(Finding {
            id: "calls",
            level: if request.is_some() { Level::Warning } else { Level::Note },
            message: format!("{scope}: no Redis call, no decision"),
            fix: Some("send a request that a limit or an idempotency rule applies to (--request URL sends one and judges it)".into()),
        });
        return;
    }
    // A failure every request met is a wiring problem; a few among many
    // decisions are an outage that passed (a restart), worth a warning.
    let level = if c.decided == 0 || request.is_some() {
        Level::Problem
    } else {
        Level::Warning
    };
    for (kind, n) in c.errors.iter().filter(|(_, n)| **n > 0) {
        let (what, fix) = error_fix(kind, c, config);
        out.push(Finding {
            id: "errors",
            level,
            message: format!("{scope}: {n} failed Redis call(s) of kind `{kind}`: {what}"),
            fix: Some(fix),
        });
    }
    if c.calls >= 10 && c.reloads * 2 >= c.calls {
        out.push(Finding {
            id: "scripts",
            level: Level::Warning,
            message: format!("{scope}: {} of {} calls needed EVAL after NOSCRIPT: Redis keeps losing the scripts", c.reloads, c.calls),
            fix: Some("one Redis (or Redis Cluster behind redis_proxy) per Webdis; nothing running SCRIPT FLUSH; Redis not restarting".into()),
        });
    }
    let modes = failure_modes(config);
    if c.decided > 0 {
        out.push(Finding {
            id: "decisions",
            level: Level::Ok,
            message: format!(
                "{scope}: Redis decided {} request(s) ({} admitted and {} rejected by limits); the failure mode answered {}",
                c.decided, c.admitted, c.rejected, c.undecided
            ),
            fix: None,
        });
    } else if c.undecided > 0 {
        out.push(Finding {
            id: "decisions",
            level: Level::Problem,
            message: format!("{scope}: no request decided by Redis; the failure mode answered {} ({modes})", c.undecided),
            fix: Some("fix the failed calls above: until then, allow forwards every request unlimited, deny answers 503, local decides on each Envoy's own budget".into()),
        });
    }
}

/// The failure modes the configuration's limits and rules use.
fn failure_modes(config: Option<&Config>) -> String {
    let Some(c) = config else {
        return "failure mode unknown".into();
    };
    let name = |m: FailureMode| match m {
        FailureMode::Allow => "allow",
        FailureMode::Deny => "deny",
        FailureMode::Local => "local",
    };
    let mut modes: Vec<&str> = c
        .limits
        .iter()
        .map(|l| name(l.failure_mode))
        .chain(c.idempotency.iter().map(|r| name(r.failure_mode)))
        .collect();
    modes.sort_unstable();
    modes.dedup();
    format!("failure mode {}", modes.join(", "))
}

/// The breaker, and which limits have rejected requests.
fn circuit_and_limits(envoy: &Envoy, limits: &[String], out: &mut Vec<Finding>) {
    let open = envoy.filter("circuit.open_workers");
    if open > 0 {
        out.push(Finding {
            id: "circuit",
            level: Level::Problem,
            message: format!("the circuit breaker is open on {open} worker(s): their requests go to the failure mode without a call"),
            fix: Some("it closes by itself once a probe call succeeds: fix the failed calls above".into()),
        });
    }
    let mut fired = Vec::new();
    for name in limits {
        let rejected = envoy.filter(&format!("ratelimit.{name}.rejected"));
        let shadow = envoy.filter(&format!("ratelimit.{name}.shadow_rejected"));
        let checked = envoy.filter(&format!("ratelimit.{name}.checked"));
        if rejected > 0 {
            fired.push(format!("{name} rejected {rejected} of {checked}"));
        }
        if shadow > 0 {
            fired.push(format!(
                "{name} (shadow) would have rejected {shadow} of {checked}"
            ));
        }
    }
    out.push(Finding {
        id: "limits",
        level: Level::Note,
        message: if fired.is_empty() {
            "no limit has rejected a request since Envoy started".into()
        } else {
            format!(
                "limits that fired since Envoy started: {}",
                fired.join("; ")
            )
        },
        fix: None,
    });
}

fn check_redis(url: &str, timeout_ms: u64) -> Finding {
    let timeout = Duration::from_millis(timeout_ms);
    let fail = |why: String| Finding {
        id: "redis",
        level: Level::Problem,
        message: format!("Redis at the --redis URL: {why}"),
        fix: Some("start Redis, or correct the URL and its user and password".into()),
    };
    let client = match redis::Client::open(url) {
        Ok(c) => c,
        Err(e) => return fail(format!("not a Redis URL ({e})")),
    };
    let mut con = match client.get_connection_with_timeout(timeout) {
        Ok(c) => c,
        Err(e) => return fail(format!("cannot connect: {e}")),
    };
    let _ = con.set_read_timeout(Some(timeout));
    // The filter's user may run only its scripts' commands: a NOPERM to
    // PING still proves Redis answers and took the password.
    match redis::cmd("PING").query::<String>(&mut con) {
        Ok(_) => {}
        Err(e) if e.code() == Some("NOPERM") => {}
        Err(e) => return fail(format!("PING failed: {e}")),
    }
    let sha = &redis_guard::scripts::RATELIMIT.sha1;
    let cached: redis::RedisResult<Vec<i64>> =
        redis::cmd("SCRIPT").arg("EXISTS").arg(sha).query(&mut con);
    let message = match cached.as_deref() {
        Ok([1]) => format!("Redis answers, and holds the decision script of this version (EVALSHA {}…): calls reached it", &sha[..12]),
        Ok(_) => format!("Redis answers; it does not hold the decision script of this version (EVALSHA {}…): no call of a filter of this version reached it since it started", &sha[..12]),
        Err(_) => "Redis answers (this user may not run SCRIPT EXISTS)".to_string(),
    };
    Finding {
        id: "redis",
        level: Level::Ok,
        message,
        fix: None,
    }
}

fn report(admin: &str, findings: &[Finding], request: Option<Value>) -> (Report, u8) {
    let problems = findings
        .iter()
        .filter(|f| f.level == Level::Problem)
        .count();
    let mut text = format!("redis-guard doctor: Envoy admin {admin}\n");
    for f in findings {
        let _ = writeln!(text, "{:<8} {}", f.level.name(), f.message);
        if let Some(fix) = &f.fix {
            let _ = writeln!(text, "         fix: {fix}");
        }
    }
    let _ = match problems {
        0 => writeln!(text, "no problem found"),
        n => writeln!(text, "{n} problem(s) found"),
    };
    let code = if problems == 0 {
        code::HEALTHY
    } else {
        code::PROBLEMS
    };
    let json = json!({
        "admin": admin,
        "problems": problems,
        "exitCode": code,
        "request": request,
        "findings": findings.iter().map(|f| json!({
            "id": f.id, "level": f.level.name(), "message": f.message, "fix": f.fix,
        })).collect::<Vec<_>>(),
    });
    (Report { text, json }, code)
}
