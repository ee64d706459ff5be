//! `redis-guard override set|show|list|unset`: per-value overrides of a
//! limit that takes them (`"overrides": {"redis": true}`), at the key the
//! filter's script reads (src/keys.rs `override_key`), in the text it parses
//! (src/overrides.rs). Setting one changes the next decision of that key on
//! every Envoy (an Envoy's over-limit cache may answer up to a second more).

use clap::{Args, Subcommand};
use redis_guard::keys::override_key;
use redis_guard::overrides::Override;
use serde_json::json;

use crate::output::{printable, Report};
use crate::select::{self, LimitTarget};
use crate::{store, Failure, LimitArgs};

/// A plan is configuration, not state: it lasts until `unset` (or until
/// `--expires` days, when the operator asks for that). State keys carry a
/// TTL so that an idle customer costs nothing; a plan's key is one per
/// customer who has a plan (`list --count`), whatever their traffic.
const DAY_MS: u64 = 86_400_000;

#[derive(Subcommand)]
pub enum OverrideCommand {
    /// Store an override for one value: a token bucket's --capacity and --refill, a window's --quota, a concurrency limit's --max.
    Set {
        #[command(flatten)]
        limit: LimitArgs,
        #[command(flatten)]
        figures: Figures,
        /// Days until the override expires; without it, it lasts until `unset`
        /// (`--ttl-days` is the same, kept for scripts written for it).
        #[arg(long, alias = "ttl-days", value_name = "DAYS")]
        expires: Option<u64>,
    },
    /// Show the override stored for one value, and whether the filter can read it.
    Show(LimitArgs),
    /// Delete the override for one value: the configured numbers apply again.
    Unset(LimitArgs),
    /// Every override of a limit (one Redis server: SCAN of its override keys).
    List {
        /// The limit's name.
        #[arg(long)]
        limit: String,
        /// Only how many there are (what bounds their memory).
        #[arg(long)]
        count: bool,
        #[command(flatten)]
        selection: crate::Selection,
    },
}

#[derive(Args)]
pub struct Figures {
    /// A token bucket's capacity (tokens).
    #[arg(long)]
    capacity: Option<u64>,
    /// A token bucket's refill (tokens per configured period).
    #[arg(long)]
    refill: Option<u64>,
    /// A window's limit (units per configured window), a calendar quota's
    /// amount, or (as --max) a concurrency limit's maximum in flight.
    #[arg(long, visible_alias = "max")]
    quota: Option<u64>,
    /// A calendar quota's anchor day for this value (with --quota): a
    /// month's day (1-31) or a week's ISO weekday (1-7); its windows renew
    /// on it.
    #[arg(long)]
    anchor_day: Option<u8>,
}

fn target<'a>(
    config: &'a redis_guard::config::Config,
    args: &LimitArgs,
) -> Result<(LimitTarget<'a>, Vec<u8>), Failure> {
    let target = select::limit(config, &args.limit, &args.selection.values)?;
    if !target.limit.overrides.redis {
        return Err(Failure::selection(format!(
            "limit `{}` takes no overrides: add \"overrides\": {{\"redis\": true}} to it",
            target.limit.name
        )));
    }
    let key = override_key(&target.key)
        .ok_or_else(|| Failure::selection("the limit's key has no override key"))?;
    Ok((target, key))
}

/// What an override says, for text and JSON.
fn described(
    o: &Override,
    algorithm: &redis_guard::config::Algorithm,
) -> (String, serde_json::Value) {
    match *o {
        Override::Limit(n)
            if matches!(
                algorithm,
                redis_guard::config::Algorithm::Concurrency { .. }
            ) =>
        {
            (format!("at most {n} in flight"), json!({"quota": n}))
        }
        Override::TokenBucket { capacity, refill } => (
            format!("capacity {capacity}, refill {refill} per period"),
            json!({"capacity": capacity, "refill": refill}),
        ),
        Override::Limit(n) => (format!("limit {n} per window"), json!({"quota": n})),
        Override::Quota { amount, anchor } => (
            format!("quota {amount} per window from day {anchor}"),
            json!({"quota": amount, "anchorDay": anchor}),
        ),
    }
}

pub fn run(command: OverrideCommand) -> Result<Report, Failure> {
    match command {
        OverrideCommand::Set {
            limit,
            figures,
            expires,
        } => {
            let config = select::load(&limit.selection.config)?;
            let (target, key) = target(&config, &limit)?;
            let algorithm = &target.limit.algorithm;
            // The largest cost a request of the limit may have must fit.
            let most = match &target.limit.cost {
                redis_guard::config::Cost::Fixed(c) => *c,
                redis_guard::config::Cost::Header { max, .. } => *max,
            };
            let o = Override::new(algorithm, figures.capacity, figures.refill, figures.quota)
                .and_then(|o| match figures.anchor_day {
                    Some(day) => o.with_anchor(algorithm, day),
                    None => Ok(o),
                })
                .and_then(|o| o.fits(most))
                .map_err(|why| {
                    Failure::selection(format!("limit `{}`: {why}", target.limit.name))
                })?;
            let ttl_ms = match expires {
                None => None,
                Some(days) => Some(
                    days.checked_mul(DAY_MS)
                        .filter(|ms| *ms > 0 && *ms < 1 << 53)
                        .ok_or_else(|| {
                            Failure::selection("--expires must be from 1 to a few thousand days")
                        })?,
                ),
            };
            let mut redis = store::connect(&limit.selection.redis)?;
            // One SET either way: a plan set again without --expires loses
            // the TTL an earlier --expires gave it.
            let mut set = redis::cmd("SET");
            set.arg(&key).arg(o.text(algorithm));
            if let Some(ms) = ttl_ms {
                set.arg("PX").arg(ms);
            }
            redis.query::<()>(&set)?;
            let (text, figures) = described(&o, algorithm);
            let lasts = match expires {
                Some(days) => format!("expires in {days} days"),
                None => "until unset".to_string(),
            };
            Ok(Report {
                text: format!(
                    "override `{}` at {}: {text} ({lasts})\n",
                    target.limit.name,
                    printable(&key)
                ),
                json: json!({"limit": target.limit.name, "key": printable(&key), "override": figures, "ttlMs": ttl_ms.map_or(-1, |ms| ms as i64)}),
            })
        }
        OverrideCommand::Show(limit) => {
            let config = select::load(&limit.selection.config)?;
            let (target, key) = target(&config, &limit)?;
            let mut redis = store::connect(&limit.selection.redis)?;
            // Another type at the key: the script ignores it too. Any error
            // (Redis gone, a command refused) is reported as such.
            let kind: String = redis.query(redis::cmd("TYPE").arg(&key))?;
            let stored: Option<Vec<u8>> = match kind.as_str() {
                "string" | "none" => redis.query(redis::cmd("GET").arg(&key))?,
                _ => Some(b"(not a string)".to_vec()),
            };
            let pttl: i64 = redis.query(redis::cmd("PTTL").arg(&key))?;
            Ok(show(&target, &key, stored.as_deref(), pttl))
        }
        OverrideCommand::Unset(limit) => {
            let config = select::load(&limit.selection.config)?;
            let (target, key) = target(&config, &limit)?;
            let mut redis = store::connect(&limit.selection.redis)?;
            let n: i64 = redis.query(redis::cmd("DEL").arg(&key))?;
            let text = if n > 0 {
                format!(
                    "unset the override of `{}` at {}: the configured numbers apply\n",
                    target.limit.name,
                    printable(&key)
                )
            } else {
                format!(
                    "no override of `{}` at {}\n",
                    target.limit.name,
                    printable(&key)
                )
            };
            Ok(Report {
                text,
                json: json!({"limit": target.limit.name, "key": printable(&key), "deleted": n > 0}),
            })
        }
        OverrideCommand::List {
            limit,
            count,
            selection,
        } => {
            if selection.redis.cluster {
                return Err(Failure::selection(
                    "list scans one server: run it against each master's URL without --cluster",
                ));
            }
            let config = select::load(&selection.config)?;
            let Some(l) = config.limits.iter().find(|l| l.name == limit) else {
                return Err(Failure::selection(format!("no limit `{limit}`")));
            };
            let pattern = format!("{}:ov:{{*}}:{}:*", config.key_prefix, l.name);
            let mut redis = store::connect(&selection.redis)?;
            let mut cursor = 0u64;
            let mut rows = Vec::new();
            loop {
                let (next, keys): (u64, Vec<Vec<u8>>) = redis.query(
                    redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(1000),
                )?;
                for key in keys {
                    if count {
                        rows.push((String::new(), String::new()));
                        continue;
                    }
                    let stored: Option<Vec<u8>> =
                        redis.query(redis::cmd("GET").arg(&key)).unwrap_or(None);
                    let text = stored
                        .as_deref()
                        .map(String::from_utf8_lossy)
                        .unwrap_or_default()
                        .to_string();
                    rows.push((printable(&key), text));
                }
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
            if count {
                return Ok(Report {
                    text: format!("{}\n", rows.len()),
                    json: json!({"limit": l.name, "count": rows.len()}),
                });
            }
            rows.sort();
            let mut text = format!("{} override(s) of `{}`\n", rows.len(), l.name);
            for (key, value) in &rows {
                text.push_str(&format!("{key}  {value}\n"));
            }
            let json_rows: Vec<_> = rows
                .iter()
                .map(|(k, v)| json!({"key": k, "stored": v}))
                .collect();
            Ok(Report {
                text,
                json: json!({"limit": l.name, "overrides": json_rows}),
            })
        }
    }
}

fn show(target: &LimitTarget, key: &[u8], stored: Option<&[u8]>, pttl: i64) -> Report {
    let name = &target.limit.name;
    let Some(stored) = stored else {
        return Report {
            text: format!(
                "no override of `{name}` at {}: the configured numbers apply\n",
                printable(key)
            ),
            json: json!({"limit": name, "key": printable(key), "override": null}),
        };
    };
    match Override::parse(stored, &target.limit.algorithm) {
        Ok(o) => {
            let (text, figures) = described(&o, &target.limit.algorithm);
            Report {
                text: format!(
                    "override `{name}` at {}: {text} ({})\n",
                    printable(key),
                    if pttl < 0 { "until unset".to_string() } else { format!("expires in {pttl} ms") }
                ),
                json: json!({"limit": name, "key": printable(key), "override": figures, "ttlMs": pttl, "valid": true}),
            }
        }
        Err(why) => Report {
            text: format!(
                "override `{name}` at {} is not valid ({why}): the filter ignores it and applies the configured numbers (stat override_invalid)\n",
                printable(key)
            ),
            json: json!({"limit": name, "key": printable(key), "stored": String::from_utf8_lossy(stored), "valid": false, "why": why}),
        },
    }
}
