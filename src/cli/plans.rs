//! `redis-guard plans import|diff|export`: every customer's plan at once,
//! for a billing system that keeps thousands of them. A plan is what
//! `override set` stores (src/cli/overrides.rs), at the same key and in the
//! same text, checked the same way; a file holds one per line (the format:
//! src/cli/plans/file.rs). The book: docs/src/running/cli.md#bulk-plans.
//!
//! Safe on a live fleet: every line is checked before anything is written
//! (a bad one stops the import, naming it); plans are written with MSET,
//! [`BATCH`] to a round trip, over the plan stored before (never a delete
//! then a set, so no request finds a customer without their plan); only
//! plans that differ are written; `--prune`'s deletions come last.

mod file;
mod stored;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use clap::{Args, Subcommand};
use redis_guard::config::{Config, Cost};
use redis_guard::keys::override_key;
use redis_guard::overrides::Override;
use serde_json::{json, Value};

use crate::output::{printable, Report};
use crate::store::Store;
use crate::{exit, select, store, Failure};
use file::Who;
use stored::{cluster_node, key_parts, scan, stored, stored_line, BATCH};

#[derive(Subcommand)]
pub enum PlansCommand {
    /// Apply a file of plans (JSON lines, or CSV with a header row): add and change plans, say what changed.
    Import(FileArgs),
    /// What `import` of the file would change, writing nothing. Exit 0 when nothing differs, 1 when something does.
    Diff(FileArgs),
    /// The stored plans as JSON lines, in the canonical form `import` reads (one server: SCAN).
    Export {
        /// Only this limit's plans (repeat); without it, every limit that takes overrides.
        #[arg(long)]
        limit: Vec<String>,
        /// The filter's JSON configuration.
        #[arg(long)]
        config: PathBuf,
        #[command(flatten)]
        redis: crate::RedisArgs,
    },
}

#[derive(Args)]
pub struct FileArgs {
    /// The plans: one per line, {"limit", "values" or "key", and the figures: "capacity" and "refill", or "quota" with an optional "anchorDay"}.
    file: PathBuf,
    /// Also delete the stored plans the file lacks, of each --limit or else of the limits the file names.
    #[arg(long)]
    prune: bool,
    /// Only this limit (repeat): a line of another limit is an error.
    #[arg(long)]
    limit: Vec<String>,
    /// The filter's JSON configuration.
    #[arg(long)]
    config: PathBuf,
    #[command(flatten)]
    redis: crate::RedisArgs,
}

/// One line of the file, checked.
struct Plan {
    limit: usize,
    key: Vec<u8>,
    who: Who,
    plan: Override,
}

/// What an import does to one plan.
struct Change {
    kind: &'static str,
    limit: String,
    /// The plan's canonical line (the file's, or the stored one removed).
    line: String,
    /// The stored plan it replaces, or a removed one the filter ignores.
    was: Option<Value>,
}

pub fn run(command: PlansCommand) -> Result<(Report, u8), Failure> {
    match command {
        PlansCommand::Import(args) => apply(&args, true),
        PlansCommand::Diff(args) => apply(&args, false),
        PlansCommand::Export {
            limit,
            config,
            redis,
        } => export(&limit, &config, &redis),
    }
}

/// The limits `names` name, each one that takes overrides.
fn limits(config: &Config, names: &[String]) -> Result<Vec<usize>, Failure> {
    names
        .iter()
        .map(|name| {
            let at = config.limits.iter().position(|l| &l.name == name);
            let at = at.ok_or_else(|| Failure::selection(no_limit(config, name)))?;
            match config.limits.get(at) {
                Some(l) if l.overrides.redis => Ok(at),
                _ => Err(Failure::selection(no_overrides(name))),
            }
        })
        .collect()
}

fn no_limit(config: &Config, name: &str) -> String {
    let known: Vec<&str> = config.limits.iter().map(|l| l.name.as_str()).collect();
    format!(
        "no limit named `{name}` (the configuration has: {})",
        known.join(", ")
    )
}

fn no_overrides(name: &str) -> String {
    format!("limit `{name}` takes no overrides: add \"overrides\": {{\"redis\": true}} to it")
}

/// A line's plan, checked as `override set` checks one; `Err` says why not.
fn plan_of(config: &Config, only: &[usize], row: file::Row) -> Result<Plan, String> {
    let found = config
        .limits
        .iter()
        .enumerate()
        .find(|(_, l)| l.name == row.limit);
    let Some((at, limit)) = found else {
        return Err(no_limit(config, &row.limit));
    };
    if !only.is_empty() && !only.contains(&at) {
        return Err(format!("limit `{}` is not one of --limit", limit.name));
    }
    if !limit.overrides.redis {
        return Err(no_overrides(&limit.name));
    }
    let (key, who) = match row.key {
        Some(_) if !row.values.is_empty() => {
            return Err("a line gives values or a key, not both".to_string())
        }
        Some(text) => {
            let key = file::unprintable(&text)
                .filter(|k| key_parts(config, limit, k).is_some())
                .ok_or_else(|| {
                    format!("`{text}` is not an override key of limit `{}`", limit.name)
                })?;
            (key.clone(), Who::Key(key))
        }
        None => {
            if let Some(name) = row.values.keys().find(|n| n.contains('=')) {
                return Err(format!("`{name}`: a part's name has no `=`"));
            }
            let given: Vec<String> = row.values.iter().map(|(n, v)| format!("{n}={v}")).collect();
            let target = select::limit(config, &limit.name, &given).map_err(|f| f.message)?;
            let key = override_key(&target.key)
                .ok_or_else(|| "the limit's key has no override key".to_string())?;
            (key, Who::Values(row.values))
        }
    };
    // As `override set`: the largest cost a request of the limit may have
    // must fit, or the plan would reject every such request for good.
    let most = match &limit.cost {
        Cost::Fixed(c) => *c,
        Cost::Header { max, .. } => *max,
    };
    let algorithm = &limit.algorithm;
    let plan = Override::new(algorithm, row.capacity, row.refill, row.quota)
        .and_then(|o| match row.anchor_day {
            Some(day) => o.with_anchor(algorithm, day),
            None => Ok(o),
        })
        .and_then(|o| o.fits(most))
        .map_err(|why| format!("limit `{}`: {why}", limit.name))?;
    Ok(Plan {
        limit: at,
        key,
        who,
        plan,
    })
}

/// Every line of the file checked, or the first bad one (and how many
/// more): nothing is written unless every line is good.
fn read_plans(config: &Config, only: &[usize], args: &FileArgs) -> Result<Vec<Plan>, Failure> {
    let name = args.file.display();
    let text = std::fs::read_to_string(&args.file)
        .map_err(|e| Failure::selection(format!("cannot read {name}: {e}")))?;
    let rows = file::rows(&text)
        .map_err(|(n, why)| Failure::selection(format!("{name} line {n}: {why}")))?;
    let mut plans = Vec::with_capacity(rows.len());
    let mut bad: Vec<(usize, String)> = Vec::new();
    let mut seen: HashMap<Vec<u8>, usize> = HashMap::with_capacity(rows.len());
    for (n, row) in rows {
        match row.and_then(|row| plan_of(config, only, row)) {
            Ok(plan) => match seen.insert(plan.key.clone(), n) {
                Some(first) => bad.push((n, format!("the same plan's key as line {first}"))),
                None => plans.push(plan),
            },
            Err(why) => bad.push((n, why)),
        }
    }
    let Some((n, why)) = bad.first() else {
        return Ok(plans);
    };
    let more = match bad.get(1..) {
        Some(rest) if !rest.is_empty() => {
            let lines: Vec<String> = rest.iter().take(10).map(|(n, _)| n.to_string()).collect();
            let etc = if rest.len() > 10 { ", …" } else { "" };
            format!(
                "; {} more bad line(s): {}{etc}",
                rest.len(),
                lines.join(", ")
            )
        }
        _ => String::new(),
    };
    Err(Failure::selection(format!(
        "{name} line {n}: {why}{more}; nothing was written"
    )))
}

fn one_server(args: &crate::RedisArgs, what: &str) -> Result<(), Failure> {
    if args.cluster {
        return Err(Failure::selection(format!(
            "{what} scans one server: run it against each master's URL without --cluster"
        )));
    }
    Ok(())
}

/// A plan's figures as JSON (`{"capacity", "refill"}` or `{"quota"}`).
fn figures_json(plan: &Override) -> Value {
    let fields = file::figures(plan);
    serde_json::from_str(&format!("{{{}}}", fields.trim_start_matches(','))).unwrap_or_default()
}

fn apply(args: &FileArgs, write: bool) -> Result<(Report, u8), Failure> {
    let config = select::load(&args.config)?;
    let only = limits(&config, &args.limit)?;
    let plans = read_plans(&config, &only, args)?;
    if args.prune {
        one_server(&args.redis, "--prune")?;
    }
    let mut redis = store::connect(&args.redis)?;
    // Plans of many slots: one node of a cluster holds only some of them.
    if !args.redis.cluster && cluster_node(&mut redis)? {
        return Err(Failure::selection(
            "this Redis is a node of a Redis Cluster: add --cluster (with the nodes as --redis)",
        ));
    }
    let keys: Vec<&[u8]> = plans.iter().map(|p| p.key.as_slice()).collect();
    let before = stored(&mut redis, &keys, false)?;
    let mut changes = Vec::new();
    let mut sets: Vec<(&[u8], String)> = Vec::new();
    let mut unchanged = 0usize;
    for (plan, before) in plans.iter().zip(before) {
        let Some(limit) = config.limits.get(plan.limit) else {
            continue;
        };
        let was = before.map(|text| match Override::parse(&text, &limit.algorithm) {
            Ok(o) if o == plan.plan => None,
            Ok(o) => Some(figures_json(&o)),
            Err(why) => Some(json!({"stored": printable(&text), "why": why})),
        });
        let kind = match was {
            Some(None) => {
                unchanged += 1;
                continue;
            }
            Some(Some(_)) => "changed",
            None => "added",
        };
        sets.push((&plan.key, plan.plan.text(&limit.algorithm)));
        changes.push(Change {
            kind,
            limit: limit.name.clone(),
            line: file::canonical(&limit.name, &plan.who, &plan.plan),
            was: was.flatten(),
        });
    }
    let mut deletes: Vec<Vec<u8>> = Vec::new();
    if args.prune {
        let scope: Vec<usize> = if only.is_empty() {
            plans
                .iter()
                .map(|p| p.limit)
                .collect::<HashSet<_>>()
                .into_iter()
                .collect()
        } else {
            only
        };
        let in_file: HashSet<&[u8]> = keys.iter().copied().collect();
        for limit in scope.iter().filter_map(|&i| config.limits.get(i)) {
            let absent: Vec<Vec<u8>> = scan(&mut redis, &config, limit)?
                .into_iter()
                .filter(|k| !in_file.contains(k.as_slice()))
                .collect();
            let refs: Vec<&[u8]> = absent.iter().map(Vec::as_slice).collect();
            for (key, text) in absent.iter().zip(stored(&mut redis, &refs, false)?) {
                // Gone since the SCAN, or of another type: nothing to remove.
                let Some(text) = text else { continue };
                let (line, was) = match stored_line(&config, limit, key, &text) {
                    Ok(line) => (line, None),
                    Err(why) => {
                        let line = file::canonical_key(&limit.name, key);
                        (line, Some(json!({"stored": printable(&text), "why": why})))
                    }
                };
                changes.push(Change {
                    kind: "removed",
                    limit: limit.name.clone(),
                    line,
                    was,
                });
                deletes.push(key.clone());
            }
        }
    }
    changes.sort_by(|a, b| (&a.limit, &a.line).cmp(&(&b.limit, &b.line)));
    let trips = if write {
        written(&mut redis, &sets, &deletes)?
    } else {
        0
    };
    let report = summary(args, write, &changes, plans.len(), unchanged, trips);
    let code = if !write && !changes.is_empty() {
        exit::DIFFERS
    } else {
        exit::OK
    };
    Ok((report, code))
}

/// The sets, then the deletions, [`BATCH`] keys to a round trip; how many
/// round trips. MSET replaces a plan in place (and drops a TTL an earlier
/// `--expires` gave it, as `override set` does).
fn written(
    redis: &mut Store,
    sets: &[(&[u8], String)],
    deletes: &[Vec<u8>],
) -> Result<usize, Failure> {
    let total = sets.len() + deletes.len();
    let mut done = 0;
    let mut trips = 0;
    // A failure part-way leaves the plans written so far: the import is
    // idempotent, so running it again finishes it.
    let partial = |f: Failure, done: usize| Failure {
        message: format!(
            "{} (after {done} of {total} writes; run the import again to finish it)",
            f.message
        ),
        ..f
    };
    for chunk in sets.chunks(BATCH) {
        let mut mset = redis::cmd("MSET");
        for (key, text) in chunk {
            mset.arg(*key).arg(text.as_str());
        }
        redis.query::<()>(&mset).map_err(|f| partial(f, done))?;
        done += chunk.len();
        trips += 1;
    }
    for chunk in deletes.chunks(BATCH) {
        let mut del = redis::cmd("DEL");
        for key in chunk {
            del.arg(key.as_slice());
        }
        redis.query::<i64>(&del).map_err(|f| partial(f, done))?;
        done += chunk.len();
        trips += 1;
    }
    Ok(trips)
}

fn summary(
    args: &FileArgs,
    write: bool,
    changes: &[Change],
    plans: usize,
    unchanged: usize,
    trips: usize,
) -> Report {
    let count = |kind: &str| changes.iter().filter(|c| c.kind == kind).count();
    let (added, changed, removed) = (count("added"), count("changed"), count("removed"));
    let mut text = String::new();
    for c in changes {
        let mark = match c.kind {
            "added" => '+',
            "changed" => '~',
            _ => '-',
        };
        let was = match &c.was {
            Some(v) if v.get("why").is_some() => format!(
                " (was `{}`, which the filter ignores)",
                v["stored"].as_str().unwrap_or_default()
            ),
            Some(v) => format!(" (was {v})"),
            None => String::new(),
        };
        text.push_str(&format!("{mark} {}{was}\n", c.line));
    }
    let file = args.file.display();
    let figures =
        format!("{added} added, {changed} changed, {unchanged} unchanged, {removed} removed");
    text.push_str(&if write {
        format!("{file}: {plans} plan(s): {figures} ({trips} write round trip(s))\n")
    } else if changes.is_empty() {
        format!("{file}: {plans} plan(s): {figures}: nothing differs\n")
    } else {
        format!("{file}: {plans} plan(s): would be {figures}: differs (nothing written)\n")
    });
    let rows: Vec<Value> = changes
        .iter()
        .map(|c| {
            let plan: Value = serde_json::from_str(&c.line).unwrap_or_default();
            json!({"change": c.kind, "plan": plan, "was": c.was})
        })
        .collect();
    Report {
        text,
        json: json!({
            "file": file.to_string(), "applied": write, "differs": !changes.is_empty(),
            "plans": plans, "added": added, "changed": changed, "unchanged": unchanged,
            "removed": removed, "writeRoundTrips": trips, "changes": rows,
        }),
    }
}

fn export(
    names: &[String],
    config: &std::path::Path,
    redis_args: &crate::RedisArgs,
) -> Result<(Report, u8), Failure> {
    one_server(redis_args, "export")?;
    let config = select::load(config)?;
    let scope: Vec<usize> = if names.is_empty() {
        (0..config.limits.len())
            .filter(|&i| config.limits.get(i).is_some_and(|l| l.overrides.redis))
            .collect()
    } else {
        limits(&config, names)?
    };
    let mut redis = store::connect(redis_args)?;
    let per_slot = cluster_node(&mut redis)?;
    let mut lines: Vec<(String, String)> = Vec::new();
    let mut ignored = Vec::new();
    for limit in scope.iter().filter_map(|&i| config.limits.get(i)) {
        let keys = scan(&mut redis, &config, limit)?;
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        for (key, text) in keys.iter().zip(stored(&mut redis, &refs, per_slot)?) {
            let Some(text) = text else { continue };
            match stored_line(&config, limit, key, &text) {
                Ok(line) => lines.push((limit.name.clone(), line)),
                Err(why) => ignored.push(json!({"limit": limit.name, "key": printable(key),
                                                "stored": printable(&text), "why": why})),
            }
        }
    }
    lines.sort();
    lines.dedup();
    // Plans the filter ignores have no line to import: named on stderr,
    // so that stdout stays the file.
    for i in &ignored {
        eprintln!(
            "redis-guard: left out {} (`{}`): the filter ignores it ({})",
            i["key"].as_str().unwrap_or_default(),
            i["stored"].as_str().unwrap_or_default(),
            i["why"].as_str().unwrap_or_default()
        );
    }
    let mut text = String::new();
    for (_, line) in &lines {
        text.push_str(line);
        text.push('\n');
    }
    let plans: Vec<Value> = lines
        .iter()
        .map(|(_, l)| serde_json::from_str(l).unwrap_or_default())
        .collect();
    Ok((
        Report {
            text,
            json: json!({"plans": plans, "leftOut": ignored}),
        },
        exit::OK,
    ))
}
