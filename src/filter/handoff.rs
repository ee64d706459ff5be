//! What a stream hands its worker's root to send for it, as the [`Host`]
//! trait names them: a decision that rides a batch ([`Member`], sent by
//! `stage::batch`) and a background lease fetch ([`Prefetch`], sent by
//! [`call`]). They sit below the stages that make them and the call
//! mechanism that sends them, so neither imports the other for them.
//!
//! [`Host`]: crate::filter::Host
//! [`call`]: crate::filter::call

use std::time::Duration;

use crate::ratelimit::ScriptArgs;

/// One request waiting for its decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its hash tag: only requests of one tag share a call.
    pub tag: String,
    /// Its own KEYS and ARGV for lua/ratelimit.lua.
    pub args: ScriptArgs,
    /// When its decision must be in.
    pub deadline: Duration,
}

/// A background lease fetch in flight: where its grant goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prefetch {
    pub limit_key: Vec<u8>,
    /// The limit's index in the configuration.
    pub limit: usize,
    pub ttl: Duration,
    pub sent_at: Duration,
    /// The lease's batch: an Envoy never holds more.
    pub batch: u64,
}
