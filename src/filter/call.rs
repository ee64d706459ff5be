//! One script call to Redis through Webdis, the only place that writes one:
//! EVALSHA first, EVAL once after a NOSCRIPT, and every answer classified
//! into what the caller can act on. No stage reads HTTP statuses or RESP.

use std::time::Duration;

use crate::batch::Packed;
use crate::config::RedisTarget;
use crate::filter::first_failure;
use crate::filter::handoff::Prefetch;
use crate::filter::{CalloutReply, Counter, ErrorKind, Host};
use crate::scripts::{Args, Script};
use crate::webdis::{parse_reply, Command, Reply};

/// How long each attempt of a call may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// Every attempt (retry, NOSCRIPT fallback) shares one deadline: the
    /// request waits for the decision, and the configured timeout is what
    /// the operator promised it would wait at most.
    Until(Duration),
    /// Each attempt gets the whole timeout (a release nobody waits on).
    Each(Duration),
}

/// Why a call did not produce an answer: its error kind (one stat each) and
/// a line for the log.
pub type Failure = (ErrorKind, String);

/// What a reply to a script call means for its caller.
#[derive(Debug)]
pub enum Answer {
    /// The script ran and answered.
    Ran(Reply),
    /// Redis had lost the script: it went again as EVAL, under this token.
    Resent(u32),
    /// Refused before the script wrote (Webdis' own 503, a cluster's
    /// TRYAGAIN, CLUSTERDOWN or LOADING, a replica's READONLY or
    /// MASTERDOWN): nothing was charged, it may be sent again.
    Refused(Failure),
    /// Failed; the script may or may not have run.
    Failed(Failure),
}

/// How the transport (Webdis, or Envoy on its behalf) answered.
#[derive(Debug)]
pub enum Transport {
    /// HTTP 200: the body is Redis' reply.
    Answered,
    /// The command surely never reached Redis, so it can run again without
    /// charging twice: Webdis' own 503 (e.g. the first call on a pooled
    /// connection to a restarted Redis), or Envoy's 503 for a call that
    /// never left it (see [`never_left_envoy`]). Envoy's 503 for a reset
    /// after sending carries no such promise and is a failure.
    Refused(&'static str),
    Failed(Failure),
}

/// Envoy's reasons for a local 503 that precede any byte sent to an
/// upstream: its local reply says "upstream connect error or
/// disconnect/reset before headers. reset reason: <reason>[, transport
/// failure reason: …]" (reasons as Envoy's `Http::Utility::resetReasonToString`
/// names them), or "no healthy upstream". A connection that was never made
/// (refused, timed out) or a request that never got one (the cluster's
/// pending-request limit) never ran a script. "connection termination" and
/// the other resets are not here: the request may have been written, and run.
const NEVER_SENT: [&str; 4] = [
    "local connection failure",
    "remote connection failure",
    "connection timeout",
    "overflow",
];

/// Whether Envoy's own answer to a callout says the call never left Envoy.
pub fn never_left_envoy(reply: &CalloutReply) -> bool {
    if reply.status != Some(503) || reply.from_webdis {
        return false;
    }
    let Ok(text) = std::str::from_utf8(&reply.body) else {
        return false;
    };
    let reason = text
        .strip_prefix("upstream connect error or disconnect/reset before headers. reset reason: ")
        .and_then(|rest| rest.split(',').next());
    text == "no healthy upstream" || reason.is_some_and(|r| NEVER_SENT.contains(&r))
}

/// Classifies a callout's HTTP outcome, for script calls and lease fetches.
pub fn transport(reply: &CalloutReply) -> Transport {
    match reply.status {
        Some(200) => Transport::Answered,
        Some(503) if reply.from_webdis => {
            Transport::Refused("webdis answered HTTP 503 until the timeout")
        }
        Some(503) if never_left_envoy(reply) => Transport::Refused(
            "envoy could not reach webdis (no connection, no healthy host) until the timeout",
        ),
        // Envoy answers a callout that ran out of time with its own 504.
        Some(504) if !reply.from_webdis => {
            Transport::Failed((ErrorKind::Timeout, "webdis answered HTTP 504".to_string()))
        }
        // Webdis' ACL: no credentials, or not ones it admits. Said plainly,
        // as the one thing to fix; the credentials themselves never.
        Some(s @ (401 | 403)) => Transport::Failed((
            ErrorKind::Auth,
            format!("webdis refused the call (HTTP {s}): the credentials (redis.credentials, or the Authorization header the webdis cluster adds) are missing or not the ones its http_basic_auth admits"),
        )),
        Some(s) => Transport::Failed((ErrorKind::Http, format!("webdis answered HTTP {s}"))),
        None => Transport::Failed((
            ErrorKind::Timeout,
            "redis call failed or timed out".to_string(),
        )),
    }
}

/// One script call, kept for as long as its answer may send it again.
#[derive(Debug, Clone)]
pub struct ScriptCall {
    script: &'static Script,
    keys: Vec<Vec<u8>>,
    argv: Argv,
    eval: bool,
    budget: Budget,
}

/// A call's ARGV: strings (one request's call), or a batch's one packed
/// argument.
#[derive(Debug, Clone)]
enum Argv {
    Strings(Vec<Vec<u8>>),
    Packed(Vec<u8>),
}

impl ScriptCall {
    pub fn new(
        script: &'static Script,
        (keys, argv): (Vec<Vec<u8>>, Vec<Vec<u8>>),
        budget: Budget,
    ) -> ScriptCall {
        ScriptCall {
            script,
            keys,
            argv: Argv::Strings(argv),
            eval: false,
            budget,
        }
    }

    /// A call whose ARGV is one packed argument (a batch, lua/batch.lua).
    pub fn packed(script: &'static Script, packed: Packed, budget: Budget) -> ScriptCall {
        ScriptCall {
            script,
            keys: packed.keys,
            argv: Argv::Packed(packed.body),
            eval: false,
            budget,
        }
    }

    /// Sends the script's source from the start: for a call whose reply
    /// nobody reads, so there is no NOSCRIPT to fall back on.
    pub fn with_source(mut self) -> ScriptCall {
        self.eval = true;
        self
    }

    /// The call's KEYS and ARGV, for a batch to carry instead (a packed
    /// call's ARGV is its one argument).
    pub fn into_args(self) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        match self.argv {
            Argv::Strings(argv) => (self.keys, argv),
            Argv::Packed(body) => (self.keys, vec![body]),
        }
    }

    pub fn budget(&self) -> Budget {
        self.budget
    }

    /// The key Redis Cluster (and `redis_proxy`) routes the call by.
    pub fn first_key(&self) -> Option<&[u8]> {
        self.keys.first().map(Vec::as_slice)
    }

    fn body(&self) -> Command {
        let argv = match &self.argv {
            Argv::Strings(argv) => Args::Strings(argv),
            Argv::Packed(body) => Args::Packed(body),
        };
        self.script.call(self.eval, &self.keys, argv)
    }

    fn timeout<H: Host>(&self, host: &H) -> Result<Duration, Failure> {
        match self.budget {
            Budget::Each(timeout) => Ok(timeout),
            Budget::Until(deadline) => {
                let left = deadline.saturating_sub(host.now());
                if left < Duration::from_millis(1) {
                    return Err((ErrorKind::Timeout, "redis timeout spent".to_string()));
                }
                Ok(left)
            }
        }
    }

    /// Sends the call within its budget; the reply comes with the token.
    pub fn send<H: Host>(&self, host: &mut H, target: &RedisTarget) -> Result<u32, Failure> {
        self.dispatch(host, target, false)
    }

    /// Sends the call as the root context: the stream may be ending, and
    /// its reply is dropped.
    pub fn send_detached<H: Host>(
        &self,
        host: &mut H,
        target: &RedisTarget,
    ) -> Result<u32, Failure> {
        self.dispatch(host, target, true)
    }

    fn dispatch<H: Host>(
        &self,
        host: &mut H,
        target: &RedisTarget,
        detached: bool,
    ) -> Result<u32, Failure> {
        let body = self.body();
        let timeout = self
            .timeout(host)
            .map_err(|failure| noted(target, failure))?;
        host.count(Counter::RedisCalls);
        let sent = if detached {
            host.dispatch_redis_detached(target, &body, timeout)
        } else {
            host.dispatch_redis(target, &body, timeout)
        };
        sent.map_err(|e| noted(target, (ErrorKind::Dispatch, e)))
    }

    /// Hands the call to the root context, which sends it on its next tick
    /// (a background lease fetch outlives the stream that asked for it).
    pub fn send_prefetch<H: Host>(
        &self,
        host: &mut H,
        target: &RedisTarget,
        note: Prefetch,
    ) -> Result<(), String> {
        let body = self.body();
        let timeout = self.timeout(host).map_err(|(_, why)| why)?;
        host.count(Counter::RedisCalls);
        host.dispatch_prefetch(target, &body, timeout, note)
    }

    /// What `reply` (to this call) means. A NOSCRIPT sends the call again
    /// as EVAL, once: scripts vanish when Redis restarts or a cluster node
    /// is new, and EVAL both runs and caches the script.
    pub fn answer<H: Host>(
        &mut self,
        host: &mut H,
        target: &RedisTarget,
        reply: &CalloutReply,
    ) -> Answer {
        match transport(reply) {
            Transport::Answered => {}
            Transport::Refused(why) => return Answer::Refused((ErrorKind::Http, why.to_string())),
            Transport::Failed(failure) => return failed(target, failure),
        }
        let parsed = match parse_reply(&reply.body) {
            Ok(r) => r,
            Err(e) => return failed(target, (ErrorKind::Reply, format!("unreadable reply: {e}"))),
        };
        let Reply::Error(msg) = &parsed else {
            return Answer::Ran(parsed);
        };
        match parsed.error_kind() {
            Some("NOSCRIPT") if !self.eval => {
                host.count(Counter::ScriptReloads);
                self.eval = true;
                match self.send(host, target) {
                    Ok(token) => Answer::Resent(token),
                    Err(failure) => Answer::Failed(failure),
                }
            }
            // EVAL carries the script's source, so Redis itself never
            // answers it NOSCRIPT: something between Webdis and Redis does.
            Some("NOSCRIPT") => failed(
                target,
                (
                    ErrorKind::Redis,
                    format!("NOSCRIPT even to EVAL, which carries the script: what stands between Webdis and Redis answers for Redis: {msg}"),
                ),
            ),
            // Redis Cluster refuses these before the script runs (keys split
            // while a slot migrates, no quorum, a node still loading):
            // nothing was charged, and the condition passes in milliseconds.
            // A replica (a primary demoted by a failover, still holding
            // Webdis' connection) answers READONLY at the script's first
            // write, which aborts it before any write: nothing was charged
            // either, and the call may land once Webdis reaches the new
            // primary (found by make soak: a completed key's store given up
            // at a failover, the key then run again). MASTERDOWN: a replica
            // that serves no stale data refuses before running.
            Some("TRYAGAIN" | "CLUSTERDOWN" | "LOADING" | "READONLY" | "MASTERDOWN") => Answer::Refused((
                ErrorKind::Redis,
                format!("redis refused the call until the timeout: {msg}"),
            )),
            // The server's ACL: refused before the script ran (NOPERM), or a
            // command inside it (an ERR that says so: Redis' words, then
            // Valkey's).
            _ if msg.starts_with("NOPERM")
                || msg.contains("user executing the script can't")
                || msg.starts_with("ERR ACL failure in script") =>
            {
                failed(
                    target,
                    (
                        ErrorKind::Auth,
                        format!("the Redis user Webdis connects as may not do this: {msg}"),
                    ),
                )
            }
            // Webdis never authenticated to Redis (or to redis_proxy): its
            // redis_auth is missing or wrong. Webdis does not check its
            // AUTH's answer, so every command comes back NOAUTH.
            _ if msg.starts_with("NOAUTH") || msg.starts_with("WRONGPASS") => failed(
                target,
                (
                    ErrorKind::Auth,
                    format!("webdis is not authenticated to Redis (its redis_auth): {msg}"),
                ),
            ),
            _ => failed(target, (ErrorKind::Redis, format!("redis error: {msg}"))),
        }
    }
}

/// A failure, after logging it if it is the first of its kind (failure
/// branches only: the success path never gets here).
fn noted(target: &RedisTarget, failure: Failure) -> Failure {
    first_failure::note(target, failure.0, &failure.1);
    failure
}

fn failed(target: &RedisTarget, failure: Failure) -> Answer {
    Answer::Failed(noted(target, failure))
}
