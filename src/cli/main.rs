//! `redis-guard`: the operator's tool for a redis-guard deployment.
//!
//! - `check CONFIG.json`: the filter's own parser over a configuration,
//!   for users' CI before they deploy.
//! - `inspect` / `reset`: one limit's state for given descriptor values.
//! - `override set|show|list|unset`: per-value overrides of a limit.
//! - `plans import|diff|export`: every customer's override at once, from
//!   and to a file.
//! - `idempotency show|forget`: one idempotency record.
//!
//! It reaches Redis directly over RESP (the `redis` crate, Redis Cluster
//! included) and builds every key with the filter's own code
//! (`redis_guard::config`, `keys`, `idempotency`), so a key it names is the
//! key the filter uses. Built only with the `cli` feature, which the wasm
//! build never enables.

mod doctor;
mod output;
mod overrides;
mod plans;
mod select;
mod store;
mod wire;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use output::Out;

/// Exit codes, as docs/src/running/cli.md documents them. Usage errors
/// (unknown flags, a missing argument) exit 2, as clap reports them.
pub mod exit {
    /// Done (for `check`: the configuration is valid; for `plans diff`:
    /// nothing differs).
    pub const OK: u8 = 0;
    /// `plans diff`: the file and the stored plans differ.
    pub const DIFFERS: u8 = 1;
    /// The configuration is invalid, or cannot be read.
    pub const CONFIG: u8 = 3;
    /// No such limit or rule, or a part value missing or malformed (a
    /// plans file's bad line too).
    pub const SELECTION: u8 = 4;
    /// Redis unreachable, refused the credentials, or answered an error.
    pub const REDIS: u8 = 5;
    /// Refused: `reset` without `--yes`, `forget` of a record in progress
    /// without `--force`.
    pub const REFUSED: u8 = 6;
}

/// `--version`: the crate's version and the tz database release compiled
/// in (a calendar quota's windows come from its rules; two releases may
/// place one customer's window differently: the book's calendar-quotas
/// page).
static VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{} (tz database {})",
        env!("CARGO_PKG_VERSION"),
        redis_guard::quota::TZDB_RELEASE
    )
});

#[derive(Parser)]
#[command(
    name = "redis-guard",
    version = VERSION.as_str(),
    about = "Operator's tool for redis-guard: check a filter configuration, inspect and reset limits, show and forget idempotency records",
    after_help = "Exit codes: 0 done, 2 usage, 3 invalid configuration, 4 unknown limit/rule or missing part value, 5 Redis error, 6 refused (reset without --yes, forget in progress without --force); plans diff: 1 differs; doctor: 0 no problem found, 7 problems found, 8 no Envoy admin at --admin."
)]
struct Cli {
    /// Print one JSON document on stdout instead of text (errors included).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Parse a filter configuration as the filter does; print a summary or the error Envoy would log.
    Check {
        /// The filter's JSON configuration (Envoy's `configuration` value or Istio's pluginConfig).
        config: PathBuf,
        /// Treat every fromEnvironment credential as set (a CI job that has no secrets).
        #[arg(long)]
        assume_env: bool,
    },
    /// Show one limit's state for given part values: key, remaining, reset and retry, raw state. Spends nothing.
    Inspect {
        #[command(flatten)]
        limit: LimitArgs,
        /// The cost of the request asked about (default 1).
        #[arg(long, default_value_t = 1)]
        cost: u64,
    },
    /// Delete one limit's state, restoring its whole budget.
    Reset {
        #[command(flatten)]
        limit: LimitArgs,
        /// Confirms the reset (without it nothing is deleted).
        #[arg(long)]
        yes: bool,
    },
    /// Set, show, list or unset per-value overrides of a limit (e.g. one customer's quota).
    Override {
        #[command(subcommand)]
        command: overrides::OverrideCommand,
    },
    /// Check a running Envoy's filter: loaded, its calls reaching Redis through Webdis and authorised, decisions made or the failure mode answering, which limits fired; prints the fix for each problem.
    Doctor(doctor::DoctorArgs),
    /// Import, diff or export every plan (override) of a file at once: JSON lines or CSV.
    Plans {
        #[command(subcommand)]
        command: plans::PlansCommand,
    },
    /// Show or forget one idempotency record.
    Idempotency {
        #[command(subcommand)]
        command: IdemCommand,
    },
    /// For `make bench-tier`: write the Webdis calls the filter sends for requests with these values.
    #[command(hide = true)]
    Wire {
        /// The filter's JSON configuration.
        #[arg(long)]
        config: PathBuf,
        /// A part value, NAME=VALUE; `{i}` in VALUE is the request's number modulo --distinct,
        /// `{c}` its call's number modulo --tenants (a batch's members share their call's).
        #[arg(long = "value", value_name = "NAME=VALUE")]
        values: Vec<String>,
        /// How many different values `{i}` takes (keys the requests spread over).
        #[arg(long, default_value_t = 10_000)]
        distinct: u64,
        /// How many different values `{c}` takes (e.g. tenants, one hash tag each).
        #[arg(long, default_value_t = 1)]
        tenants: u64,
        /// Requests per call: 1 as a lone request, more as a worker's batch.
        #[arg(long, default_value_t = 1)]
        members: usize,
        /// How many calls to write.
        #[arg(long, default_value_t = 1000)]
        calls: u64,
        /// An idempotency rule: every request carries a fresh key under it.
        #[arg(long)]
        rule: Option<String>,
        /// The file of calls to write.
        #[arg(long)]
        out: PathBuf,
        /// A folder to write the scripts' sources to (ratelimit.lua, batch.lua).
        #[arg(long)]
        scripts: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum IdemCommand {
    /// The record's state, TTL, stored status, body size and object-store reference.
    Show(IdemArgs),
    /// Delete the record so the key runs again; refused while it is in progress unless --force.
    Forget {
        #[command(flatten)]
        record: IdemArgs,
        /// Forget a record that is in progress too (its request's response is then not stored).
        #[arg(long)]
        force: bool,
    },
}

/// Where Redis is.
#[derive(Args)]
struct RedisArgs {
    /// Redis URL (redis://[user:password@]host:port); repeat to seed a cluster.
    #[arg(long = "redis", default_value = "redis://127.0.0.1:6379")]
    urls: Vec<String>,
    /// Talk to a Redis Cluster (slot routing, MOVED/ASK) through the --redis seed nodes.
    #[arg(long)]
    cluster: bool,
    /// Connect and reply timeout in ms.
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
}

/// A part value by the name `check` lists: a header name (`x-user`),
/// `query:NAME`, a metadata path after its namespace (`payload.sub`), an
/// attribute (`source.principal`), `clientAddress`, `path`, `method`,
/// `grpcService`, `grpcMethod`.
#[derive(Args)]
struct Selection {
    /// The filter's JSON configuration.
    #[arg(long)]
    config: PathBuf,
    /// A part value, NAME=VALUE (repeat for each part).
    #[arg(long = "value", value_name = "NAME=VALUE")]
    values: Vec<String>,
    #[command(flatten)]
    redis: RedisArgs,
}

#[derive(Args)]
struct LimitArgs {
    /// The limit's name.
    #[arg(long)]
    limit: String,
    #[command(flatten)]
    selection: Selection,
}

#[derive(Args)]
struct IdemArgs {
    /// The idempotency rule's name.
    #[arg(long)]
    rule: String,
    /// The Idempotency-Key value.
    #[arg(long)]
    key: String,
    #[command(flatten)]
    selection: Selection,
}

/// Why a command failed, and its exit code.
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    /// `config`, `selection`, `redis`, `refused`: the JSON error's kind.
    pub kind: &'static str,
    pub message: String,
}

impl Failure {
    pub fn config(message: impl Into<String>) -> Failure {
        Failure {
            code: exit::CONFIG,
            kind: "config",
            message: message.into(),
        }
    }
    pub fn selection(message: impl Into<String>) -> Failure {
        Failure {
            code: exit::SELECTION,
            kind: "selection",
            message: message.into(),
        }
    }
    pub fn redis(message: impl Into<String>) -> Failure {
        Failure {
            code: exit::REDIS,
            kind: "redis",
            message: message.into(),
        }
    }
    pub fn refused(message: impl Into<String>) -> Failure {
        Failure {
            code: exit::REFUSED,
            kind: "refused",
            message: message.into(),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let out = Out { json: cli.json };
    // The doctor's exit code says what it found, even when it ran through.
    let result = match cli.command {
        Command::Doctor(args) => doctor::run(&args),
        Command::Plans { command } => plans::run(command),
        command => run(command).map(|report| (report, exit::OK)),
    };
    match result {
        Ok((report, code)) => {
            out.report(&report);
            ExitCode::from(code)
        }
        Err(failure) => {
            out.failure(&failure);
            ExitCode::from(failure.code)
        }
    }
}

fn run(command: Command) -> Result<output::Report, Failure> {
    match command {
        Command::Check { config, assume_env } => {
            let parsed = select::load_with(&config, assume_env)?;
            Ok(output::summary(&config, &parsed))
        }
        Command::Inspect { limit, cost } => {
            let config = select::load(&limit.selection.config)?;
            let target = select::limit(&config, &limit.limit, &limit.selection.values)?;
            if cost == 0 || cost > target.limit.algorithm.quota() {
                return Err(Failure::selection(format!(
                    "--cost must be between 1 and {} (the limit's quota)",
                    target.limit.algorithm.quota()
                )));
            }
            let mut redis = store::connect(&limit.selection.redis)?;
            let state = redis.inspect(&target, cost)?;
            Ok(output::inspection(&target, cost, &state))
        }
        Command::Reset { limit, yes } => {
            let config = select::load(&limit.selection.config)?;
            let target = select::limit(&config, &limit.limit, &limit.selection.values)?;
            if !yes {
                return Err(Failure::refused(format!(
                    "not resetting `{}` at {} without --yes",
                    target.limit.name,
                    output::printable(&target.key)
                )));
            }
            let mut redis = store::connect(&limit.selection.redis)?;
            let mut deleted = redis.delete(&target.key)?;
            // A quota's count is in its current window's key (by Redis'
            // clock): deleting it gives the whole amount back now.
            if let Some((key, _, _)) = redis.quota_window(&target)? {
                deleted |= redis.delete(&key)?;
            }
            // And every other key of its state (src/keys.rs): an older
            // filter's hash of the bucket, which the scripts read for a
            // bucket without its string (a rolling upgrade).
            for key in redis_guard::keys::state_keys_beside(&target.key) {
                deleted |= redis.delete(&key)?;
            }
            // A leased bucket's give-back record starts again after this
            // ms, so tokens leased before the reset never come back into
            // the fresh bucket (deleting it would let a grant in this very
            // ms start one their tuples pass: lua/lease_return.lua).
            deleted |= redis.restart_give_back_record(&target.key)?;
            // A blocking limit's block goes too: a reset makes the key whole.
            let unblocked = match target.limit.block_ms {
                Some(_) => redis.delete(&redis_guard::keys::block_key(&target.key))?,
                None => false,
            };
            Ok(output::reset(&target, deleted, unblocked))
        }
        Command::Wire {
            config,
            values,
            distinct,
            tenants,
            members,
            calls,
            rule,
            out,
            scripts,
        } => {
            let parsed = select::load_with(&config, true)?;
            let w = wire::Wire {
                config: &parsed,
                values: &values,
                distinct,
                tenants,
                members,
                calls,
                rule: rule.as_deref(),
            };
            if let Some(dir) = scripts {
                wire::write_scripts(&dir)?;
            }
            let bytes = wire::write(&w, &out)?;
            Ok(output::wire(calls, members, bytes))
        }
        Command::Override { command } => overrides::run(command),
        Command::Doctor(args) => doctor::run(&args).map(|(report, _)| report),
        Command::Plans { command } => plans::run(command).map(|(report, _)| report),
        Command::Idempotency { command } => {
            let (args, force, forget) = match command {
                IdemCommand::Show(args) => (args, false, false),
                IdemCommand::Forget { record, force } => (record, force, true),
            };
            let config = select::load(&args.selection.config)?;
            let target = select::record(&config, &args.rule, &args.key, &args.selection.values)?;
            let mut redis = store::connect(&args.selection.redis)?;
            if forget {
                let outcome = redis.forget(&target.key, force)?;
                if outcome == store::Forgot::Refused {
                    return Err(Failure::refused(format!(
                        "the record {} is in progress (its request is running or its Envoy died holding the lock, which expires by itself): not forgetting it without --force",
                        output::printable(&target.key)
                    )));
                }
                Ok(output::forgot(&target, outcome))
            } else {
                let record = redis.record(&target.key)?;
                Ok(output::record(&target, &record))
            }
        }
    }
}
