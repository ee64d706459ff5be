//! What `doctor` reads from Envoy's admin interface: `/stats` (every
//! integer stat) and `/config_dump` (the filter's configuration, through the
//! filter's own parser, and every cluster with whether it adds an
//! `Authorization` header), and the one request `--request` sends.

use std::collections::BTreeMap;
use std::io::Read;

use redis_guard::config::Config;
use serde_json::Value;

use crate::Failure;

/// What the doctor learns from Envoy.
pub(super) struct Envoy {
    /// Every integer stat of `/stats`, by its full name.
    pub(super) stats: BTreeMap<String, u64>,
    /// `/config_dump`, when the admin serves it.
    pub(super) dump: Option<Value>,
}

impl Envoy {
    pub(super) fn stat(&self, name: &str) -> u64 {
        self.stats.get(name).copied().unwrap_or(0)
    }

    /// One of the filter's counters (Envoy shows them under `wasmcustom.`).
    pub(super) fn filter(&self, name: &str) -> u64 {
        self.stat(&format!("wasmcustom.redis_guard.{name}"))
    }
}

/// The filter as Envoy holds it: its configuration, parsed by the filter's
/// own parser, and whether the cluster it names exists and adds credentials.
pub(super) struct Wiring {
    /// `None`: no redis-guard filter in `/config_dump`.
    pub(super) config: Option<Result<Config, String>>,
    /// Every cluster Envoy has, with whether it adds an Authorization header.
    pub(super) clusters: BTreeMap<String, bool>,
}

/// `http://host:port` from either that or `host:port`, without a trailing `/`.
pub(super) fn admin_base(admin: &str) -> String {
    let base = admin.trim_end_matches('/');
    if base.contains("://") {
        base.to_string()
    } else {
        format!("http://{base}")
    }
}

fn get(agent: &ureq::Agent, url: &str) -> Result<(u16, String), String> {
    let response = match agent.get(url).call() {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => return Err(e.to_string()),
    };
    let status = response.status();
    let mut body = String::new();
    response
        .into_reader()
        .read_to_string(&mut body)
        .map_err(|e| e.to_string())?;
    Ok((status, body))
}

/// Envoy's stats and configuration, or why `admin` is no Envoy admin.
pub(super) fn read_envoy(agent: &ureq::Agent, admin: &str) -> Result<Envoy, String> {
    let (status, text) = get(agent, &format!("{admin}/stats"))?;
    if status != 200 {
        return Err(format!("GET /stats answered HTTP {status}"));
    }
    // `name: value` lines; histograms (`name: P0(…) …`) are left out.
    let stats: BTreeMap<String, u64> = text
        .lines()
        .filter_map(|l| l.split_once(": "))
        .filter_map(|(n, v)| Some((n.to_string(), v.trim().parse().ok()?)))
        .collect();
    if !stats.keys().any(|k| k.starts_with("server.")) {
        return Err("its /stats has no server.* stat".to_string());
    }
    let dump = match get(agent, &format!("{admin}/config_dump")) {
        Ok((200, body)) => serde_json::from_str(&body).ok(),
        _ => None,
    };
    Ok(Envoy { stats, dump })
}

/// Sends the `--request` GET: its status (any status is an answer), or
/// why none came; a malformed `--header` is a usage error.
pub(super) fn send(
    agent: &ureq::Agent,
    url: &str,
    headers: &[String],
) -> Result<Result<u16, String>, Failure> {
    let mut req = agent.get(url);
    for h in headers {
        let Some((name, value)) = h.split_once(':') else {
            return Err(Failure::selection(format!(
                "--header `{h}` is not NAME:VALUE"
            )));
        };
        req = req.set(name.trim(), value.trim());
    }
    Ok(match req.call() {
        Ok(r) => Ok(r.status()),
        Err(ureq::Error::Status(s, _)) => Ok(s),
        Err(e) => Err(e.to_string()),
    })
}

/// Every object of `value` (depth first) whose `@type` ends with `ty`.
fn typed<'a>(value: &'a Value, ty: &str, out: &mut Vec<&'a Value>) {
    match value {
        Value::Object(map) => {
            if map
                .get("@type")
                .and_then(Value::as_str)
                .is_some_and(|t| t.ends_with(ty))
            {
                out.push(value);
            }
            map.values().for_each(|v| typed(v, ty, out));
        }
        Value::Array(items) => items.iter().for_each(|v| typed(v, ty, out)),
        _ => {}
    }
}

/// Whether `value` holds a header named `authorization` to add.
fn adds_authorization(value: &Value) -> bool {
    match value {
        Value::Object(map) => {
            map.get("key")
                .and_then(Value::as_str)
                .is_some_and(|k| k.eq_ignore_ascii_case("authorization"))
                || map.values().any(adds_authorization)
        }
        Value::Array(items) => items.iter().any(adds_authorization),
        _ => false,
    }
}

pub(super) fn wiring(dump: &Value) -> Wiring {
    let mut filters = Vec::new();
    typed(
        dump,
        "envoy.extensions.filters.http.wasm.v3.Wasm",
        &mut filters,
    );
    let ours = filters.iter().find_map(|f| {
        let config = &f["config"];
        let text = config["configuration"]["value"].as_str().unwrap_or("");
        let is_ours = config["root_id"].as_str() == Some("redis_guard")
            || serde_json::from_str::<Value>(text).is_ok_and(|v| v["redis"]["cluster"].is_string());
        // fromEnvironment credentials are read from Envoy's environment,
        // which the doctor cannot see: taken as set.
        is_ours.then(|| {
            Config::parse_with_env(text.as_bytes(), &|_| Some("set".to_string()))
                .map_err(|e| e.to_string())
        })
    });
    let mut clusters = Vec::new();
    typed(dump, "envoy.config.cluster.v3.Cluster", &mut clusters);
    Wiring {
        config: ours,
        clusters: clusters
            .iter()
            .filter_map(|c| Some((c["name"].as_str()?.to_string(), adds_authorization(c))))
            .collect(),
    }
}

pub(super) fn limit_names_from_stats(envoy: &Envoy) -> Vec<String> {
    let mut names: Vec<String> = envoy
        .stats
        .keys()
        .filter_map(|k| k.strip_prefix("wasmcustom.redis_guard.ratelimit."))
        .filter_map(|k| k.strip_suffix(".checked"))
        .map(String::from)
        .collect();
    names.dedup();
    names
}
