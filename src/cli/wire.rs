//! `redis-guard wire` (hidden; `make bench-tier` runs it): the Webdis calls
//! the filter sends for a configuration and a stream of requests, written to
//! a file for a load generator. Every byte comes from the filter's own code:
//! the plan and its keys (`Plan::build`), the call's arguments
//! (`Plan::script_args`), a worker's packed batch (`batch::pack`) and the
//! request (`Script::call`), so what is measured is what the filter sends.
//!
//! The file holds one record per call: a line `<method> <path> <length>`
//! (`POST /` for a lone request, `PUT /EVALSHA/…` for a batch), then that
//! many bytes of body.

use std::io::Write;
use std::path::Path;

use redis_guard::batch::pack;
use redis_guard::concurrency::Slots;
use redis_guard::config::Config;
use redis_guard::idempotency::fingerprint;
use redis_guard::ratelimit::{IdemArgs, ScriptArgs};
use redis_guard::scripts::{Args, BATCH, RATELIMIT};

use crate::{select, Failure};

pub struct Wire<'a> {
    pub config: &'a Config,
    /// `NAME=VALUE` pairs; `{i}` in a value is the request's number modulo
    /// `distinct`, so the requests spread over that many keys.
    pub values: &'a [String],
    pub distinct: u64,
    /// `{c}` in a value is the request's call number modulo `tenants`: the
    /// members of one batch share it (the filter batches one hash tag).
    pub tenants: u64,
    /// Members per call: 1 is a worker's lone request (lua/ratelimit.lua),
    /// more a batch (lua/batch.lua), as the filter sends them.
    pub members: usize,
    pub calls: u64,
    /// An idempotency rule: every request carries a fresh key under it.
    pub rule: Option<&'a str>,
}

/// One request's arguments as the filter builds them.
fn request(w: &Wire, n: u64) -> Result<ScriptArgs, Failure> {
    let i = (n % w.distinct.max(1)).to_string();
    let c = ((n / w.members.max(1) as u64) % w.tenants.max(1)).to_string();
    let values: Vec<String> = w
        .values
        .iter()
        .map(|v| v.replace("{i}", &i).replace("{c}", &c))
        .collect();
    let (mut plan, line) = select::plan(w.config, &values)?;
    // Quotas' window edges at this machine's clock, as an Envoy's.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    plan.set_clock(w.config, now);
    if plan.checks.is_empty() && w.rule.is_none() {
        return Err(Failure::selection(
            "no limit applies to these values (give path= and the descriptor parts)",
        ));
    }
    // Unique per request, as the host's tokens are.
    let token = format!("{n:016x}{:016x}", n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let slots = Slots::of_plan(w.config, &plan, || token.clone());
    let idem = match w.rule {
        None => None,
        Some(name) => {
            // The record's selection takes its tenant parts' values only.
            let tenant: Vec<String> = match w.config.idempotency.iter().find(|r| r.name == name) {
                Some(rule) => {
                    let names = select::names(&rule.tenant);
                    values
                        .iter()
                        .filter(|v| names.iter().any(|n| v.starts_with(&format!("{n}="))))
                        .cloned()
                        .collect()
                }
                None => Vec::new(),
            };
            let target = select::record(w.config, name, &format!("key-{n}"), &tenant)?;
            Some(IdemArgs {
                key: target.key,
                owner: token.clone(),
                fingerprint: fingerprint(&line.method, &line.path, b""),
                lock_ttl_ms: target.rule.lock_ttl_ms,
            })
        }
    };
    Ok(plan.script_args(
        w.config,
        idem.as_ref(),
        slots.as_ref().map(|s| s.id.as_str()),
    ))
}

/// Writes the scripts the calls name (by SHA-1) to `dir`, for the load
/// generator to load into Redis first: the composed sources, as EVAL would
/// send them.
pub fn write_scripts(dir: &Path) -> Result<(), Failure> {
    for (name, script) in [("ratelimit", &*RATELIMIT), ("batch", &*BATCH)] {
        let path = dir.join(format!("{name}.lua"));
        std::fs::write(&path, &script.source)
            .map_err(|e| Failure::selection(format!("{}: {e}", path.display())))?;
    }
    Ok(())
}

/// Writes `w.calls` calls to `out`; returns their bytes on the wire (a
/// PUT's path and every body).
pub fn write(w: &Wire, out: &Path) -> Result<u64, Failure> {
    let file = std::fs::File::create(out)
        .map_err(|e| Failure::selection(format!("{}: {e}", out.display())))?;
    let mut file = std::io::BufWriter::new(file);
    let mut n = 0;
    let mut bytes = 0;
    for _ in 0..w.calls {
        let mut members = Vec::with_capacity(w.members);
        for _ in 0..w.members.max(1) {
            members.push(request(w, n)?);
            n += 1;
        }
        let command = if members.len() == 1 {
            let (keys, argv) = members.remove(0);
            RATELIMIT.call(false, &keys, Args::Strings(&argv))
        } else {
            let packed = pack(&members).map_err(Failure::selection)?;
            BATCH.call(false, &packed.keys, Args::Packed(&packed.body))
        };
        bytes += command.wire_len() as u64;
        let (method, path) = command.method_path();
        writeln!(file, "{method} {path} {}", command.body.len())
            .and_then(|_| file.write_all(&command.body))
            .map_err(|e| Failure::selection(format!("{}: {e}", out.display())))?;
    }
    file.flush()
        .map_err(|e| Failure::selection(format!("{}: {e}", out.display())))?;
    Ok(bytes)
}
