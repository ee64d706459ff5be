//! The CLI's Redis: one server or a Redis Cluster, over RESP with the
//! `redis` crate. Every operation is one command or one script on one key,
//! so a cluster routes it to the master that owns the key's slot.

use std::time::Duration;

use redis::{ConnectionLike, Value};
use redis_guard::config::Algorithm;
use redis_guard::overrides::Override;
use redis_guard::ratelimit::kind_args;
use redis_guard::scripts::{IDEM_FORGET, INSPECT};

use crate::select::LimitTarget;
use crate::{Failure, RedisArgs};

pub struct Store {
    conn: Box<dyn ConnectionLike>,
}

/// A limit's figures as lua/inspect.lua computes them, and its raw state.
pub struct Inspection {
    pub allowed: bool,
    pub remaining: i64,
    pub retry_ms: i64,
    pub reset_ms: i64,
    pub redis_time_ms: i64,
    pub raw: Raw,
    /// A blocking limit's block: ms left, if the key is blocked.
    pub blocked_ms: Option<i64>,
    /// A quota's window at Redis' clock.
    pub quota: Option<QuotaWindow>,
}

/// The window a quota is in by Redis' clock, and what it has used.
pub struct QuotaWindow {
    pub start_ms: i64,
    pub renewal_ms: i64,
    /// Units counted in the window (a usage debt may take it past the amount).
    pub used: i64,
    /// The amount that applies: a valid stored override's, else the
    /// configured one (the script's rule).
    pub amount: u64,
    /// What is left of it (0 when used up or in debt).
    pub left: u64,
    /// The window's start and its renewal on the quota's zone's clock.
    pub start: String,
    pub renewal: String,
}

/// A key's type, TTL and contents as Redis holds them.
pub struct Raw {
    /// `none` when the key does not exist.
    pub kind: String,
    /// -2 no key, -1 no TTL (never set by the filter).
    pub pttl_ms: i64,
    /// Hash fields, a string's value, or a sorted set's first members
    /// (oldest first) with their scores.
    pub entries: Vec<(Vec<u8>, Vec<u8>)>,
    /// A sorted set's member count (entries shows at most RAW_MEMBERS).
    pub members: Option<i64>,
}

/// A token bucket's string (lua/token_bucket.lua) as the fields `c`
/// (credits) and `t` (ms of the last update), in figures an operator can
/// read; anything else as it is.
fn bucket_fields(entries: Vec<(Vec<u8>, Vec<u8>)>) -> Vec<(Vec<u8>, Vec<u8>)> {
    match entries.as_slice() {
        [(name, v)] if name.is_empty() => match redis_guard::keys::decode_bucket(v) {
            Some((c, t)) => vec![
                (b"c".to_vec(), c.to_string().into_bytes()),
                (b"t".to_vec(), t.to_string().into_bytes()),
            ],
            None => entries,
        },
        _ => entries,
    }
}

/// Sorted-set members shown (a sliding window may hold a million).
const RAW_MEMBERS: isize = 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forgot {
    Deleted,
    Absent,
    Refused,
}

pub fn connect(args: &RedisArgs) -> Result<Store, Failure> {
    let timeout = Duration::from_millis(args.timeout_ms.max(1));
    let unreachable = |e: redis::RedisError| {
        Failure::redis(format!(
            "cannot reach Redis at {}: {e}",
            args.urls
                .iter()
                .map(|u| redacted(u))
                .collect::<Vec<_>>()
                .join(", ")
        ))
    };
    let conn: Box<dyn ConnectionLike> = if args.cluster {
        let client = redis::cluster::ClusterClientBuilder::new(args.urls.clone())
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .build()
            .map_err(unreachable)?;
        Box::new(client.get_connection().map_err(unreachable)?)
    } else {
        let [url] = args.urls.as_slice() else {
            return Err(Failure::redis(
                "several --redis URLs seed a cluster: add --cluster, or give one URL",
            ));
        };
        let client = redis::Client::open(url.as_str()).map_err(unreachable)?;
        let conn = client
            .get_connection_with_timeout(timeout)
            .map_err(unreachable)?;
        conn.set_read_timeout(Some(timeout)).map_err(unreachable)?;
        conn.set_write_timeout(Some(timeout)).map_err(unreachable)?;
        Box::new(conn)
    };
    Ok(Store { conn })
}

/// A URL as it may be printed: without its password.
fn redacted(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

fn failed(e: redis::RedisError) -> Failure {
    Failure::redis(format!("Redis answered an error: {e}"))
}

impl Store {
    /// One command on the key it names (a cluster routes it by that key).
    pub fn query<T: redis::FromRedisValue>(&mut self, cmd: &redis::Cmd) -> Result<T, Failure> {
        cmd.query(self.conn.as_mut()).map_err(failed)
    }

    /// A quota's window at Redis' clock (the one its scripts read), with
    /// the edges a decision would send and the window's key.
    pub fn quota_window(
        &mut self,
        target: &LimitTarget,
    ) -> Result<Option<(Vec<u8>, String, QuotaWindow)>, Failure> {
        let Algorithm::Quota { amount, calendar } = target.limit.algorithm else {
            return Ok(None);
        };
        // A stored override the script would apply replaces the amount,
        // and its anchor day the configured one.
        let (mut amount, mut calendar) = (amount, calendar);
        if target.limit.overrides.redis {
            if let Some(okey) = redis_guard::keys::override_key(&target.key) {
                let text: Option<Vec<u8>> = redis::cmd("GET")
                    .arg(okey)
                    .query(self.conn.as_mut())
                    .unwrap_or(None);
                let stored = text.map(|t| Override::parse(&t, &target.limit.algorithm));
                match stored {
                    Some(Ok(Override::Limit(n))) => amount = n,
                    Some(Ok(Override::Quota { amount: n, anchor })) => {
                        amount = n;
                        calendar.anchor = anchor;
                    }
                    _ => {}
                }
            }
        }
        let (s, us): (i64, i64) = redis::cmd("TIME")
            .query(self.conn.as_mut())
            .map_err(failed)?;
        let now = s.saturating_mul(1000).saturating_add(us / 1000);
        let out_of_range =
            || Failure::redis(format!("Redis' clock ({now} ms) is outside any window"));
        let edges = calendar.edges(now).ok_or_else(out_of_range)?;
        let (start_ms, renewal_ms) = (edges[1], edges[2]);
        let key = redis_guard::keys::quota_window_key(&target.key, start_ms);
        let used: Option<String> = redis::cmd("GET")
            .arg(&key)
            .query(self.conn.as_mut())
            .map_err(failed)?;
        let used: i64 = used.and_then(|u| u.parse().ok()).unwrap_or(0);
        let window = QuotaWindow {
            start_ms,
            renewal_ms,
            used,
            amount,
            left: amount.saturating_sub(u64::try_from(used).unwrap_or(0)),
            start: calendar.format(start_ms).ok_or_else(out_of_range)?,
            renewal: calendar.format(renewal_ms).ok_or_else(out_of_range)?,
        };
        let edges =
            String::from_utf8_lossy(&redis_guard::ratelimit::edges_arg(Some(edges))).into_owned();
        Ok(Some((key, edges, window)))
    }

    pub fn inspect(&mut self, target: &LimitTarget, cost: u64) -> Result<Inspection, Failure> {
        let (alg, a, b, c) = kind_args(&target.limit.algorithm);
        let quota = self.quota_window(target)?;
        // A quota's amount is a stored override's, as the script's.
        let a = quota.as_ref().map_or(a, |(_, _, w)| w.amount);
        // A concurrency limit's third value is a slot id: any valid one
        // (nothing is taken); a quota's, its window edges.
        let c = match (&target.limit.algorithm, &quota) {
            (Algorithm::Concurrency { .. }, _) => "0".to_string(),
            (_, Some((_, edges, _))) => edges.clone(),
            _ => c.to_string(),
        };
        let state_key = match &quota {
            Some((key, _, _)) => key.clone(),
            None => target.key.clone(),
        };
        let quota = quota.map(|(_, _, w)| w);
        let reply: Vec<Value> = redis::Script::new(&INSPECT.source)
            .key(target.key.as_slice())
            .arg(alg)
            .arg(a)
            .arg(b)
            .arg(c)
            .arg(cost)
            .invoke(self.conn.as_mut())
            .map_err(failed)?;
        let num = |i: usize| -> Result<i64, Failure> {
            match reply.get(i) {
                Some(Value::Int(n)) => Ok(*n),
                // lua/wire.lua hands large figures over as strings.
                Some(Value::BulkString(b)) => std::str::from_utf8(b)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| Failure::redis("inspect: a figure is not a number")),
                _ => Err(Failure::redis(format!(
                    "inspect: unexpected reply {reply:?}"
                ))),
            }
        };
        // The block is checked before the state, as the filter's script does.
        let blocked_ms = match target.limit.block_ms {
            None => None,
            Some(_) => {
                let ms: i64 = redis::cmd("PTTL")
                    .arg(redis_guard::keys::block_key(&target.key))
                    .query(self.conn.as_mut())
                    .map_err(failed)?;
                (ms > 0).then_some(ms)
            }
        };
        if let Some(ms) = blocked_ms {
            return Ok(Inspection {
                allowed: false,
                remaining: 0,
                retry_ms: ms,
                reset_ms: ms,
                redis_time_ms: num(4)?,
                raw: self.raw(&state_key)?,
                blocked_ms,
                quota,
            });
        }
        let mut raw = self.raw(&state_key)?;
        if let Algorithm::TokenBucket { .. } = target.limit.algorithm {
            raw.entries = bucket_fields(raw.entries);
        }
        // A bucket without its string is decided from an older filter's
        // hash during a rolling upgrade: show the state the figures came from.
        if raw.kind == "none" {
            if let Some(older) = redis_guard::keys::older_bucket_key(&target.key) {
                let hash = self.raw(&older)?;
                if hash.kind != "none" {
                    raw = hash;
                }
            }
        }
        Ok(Inspection {
            blocked_ms,
            allowed: num(0)? == 1,
            remaining: num(1)?,
            retry_ms: num(2)?,
            reset_ms: num(3)?,
            redis_time_ms: num(4)?,
            raw,
            quota,
        })
    }

    /// The key's type, TTL and contents.
    pub fn raw(&mut self, key: &[u8]) -> Result<Raw, Failure> {
        let kind: String = redis::cmd("TYPE")
            .arg(key)
            .query(self.conn.as_mut())
            .map_err(failed)?;
        let pttl_ms: i64 = redis::cmd("PTTL")
            .arg(key)
            .query(self.conn.as_mut())
            .map_err(failed)?;
        let mut members = None;
        let entries: Vec<(Vec<u8>, Vec<u8>)> = match kind.as_str() {
            "hash" => redis::cmd("HGETALL")
                .arg(key)
                .query(self.conn.as_mut())
                .map_err(failed)?,
            "string" => {
                let v: Vec<u8> = redis::cmd("GET")
                    .arg(key)
                    .query(self.conn.as_mut())
                    .map_err(failed)?;
                vec![(Vec::new(), v)]
            }
            "zset" => {
                members = Some(
                    redis::cmd("ZCARD")
                        .arg(key)
                        .query(self.conn.as_mut())
                        .map_err(failed)?,
                );
                let pairs: Vec<(Vec<u8>, String)> = redis::cmd("ZRANGE")
                    .arg(key)
                    .arg(0)
                    .arg(RAW_MEMBERS - 1)
                    .arg("WITHSCORES")
                    .query(self.conn.as_mut())
                    .map_err(failed)?;
                pairs
                    .into_iter()
                    .map(|(m, s)| (m, s.into_bytes()))
                    .collect()
            }
            _ => Vec::new(),
        };
        Ok(Raw {
            kind,
            pttl_ms,
            entries,
            members,
        })
    }

    /// DEL; whether there was a key.
    pub fn delete(&mut self, key: &[u8]) -> Result<bool, Failure> {
        let n: i64 = redis::cmd("DEL")
            .arg(key)
            .query(self.conn.as_mut())
            .map_err(failed)?;
        Ok(n > 0)
    }

    /// Restarts a leased bucket's give-back record after Redis' current ms
    /// (keys::restarted_give_back_record), if there is one: the tuples of
    /// grants made before the reset then give nothing back into the fresh
    /// bucket. Read the clock, then write: a grant between the two at the
    /// clock's ms is refused too (under-admission, one ms), one after it
    /// is the fresh bucket's. Whether a record was there.
    pub fn restart_give_back_record(&mut self, state_key: &[u8]) -> Result<bool, Failure> {
        let key = redis_guard::keys::give_back_key(state_key);
        // The clock of the node that owns the key (a Redis Cluster routes
        // an EVAL by its key; a bare TIME goes to any node).
        let (s, us): (u64, u64) = redis::cmd("EVAL")
            .arg("return redis.call('TIME')")
            .arg(1)
            .arg(&key)
            .query(self.conn.as_mut())
            .map_err(failed)?;
        let since = s
            .saturating_mul(1000)
            .saturating_add(us / 1000)
            .saturating_add(1);
        let set: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(redis_guard::keys::restarted_give_back_record(since))
            .arg("PX")
            .arg(redis_guard::keys::GIVE_BACK_RECORD_TTL_MS)
            .arg("XX")
            .query(self.conn.as_mut())
            .map_err(failed)?;
        Ok(set.is_some())
    }

    pub fn record(&mut self, key: &[u8]) -> Result<Raw, Failure> {
        self.raw(key)
    }

    pub fn forget(&mut self, key: &[u8], force: bool) -> Result<Forgot, Failure> {
        let n: i64 = redis::Script::new(&IDEM_FORGET.source)
            .key(key)
            .arg(if force { "1" } else { "0" })
            .invoke(self.conn.as_mut())
            .map_err(failed)?;
        Ok(match n {
            1 => Forgot::Deleted,
            0 => Forgot::Absent,
            _ => Forgot::Refused,
        })
    }
}
