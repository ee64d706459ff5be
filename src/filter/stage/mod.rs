//! One stage per feature. Each owns its state and the replies it sends; the
//! lifecycle in [`crate::filter::flow`] hands each the data it needs, so no
//! stage reads another's state. Calls go through [`crate::filter::call`],
//! shared-data updates through [`crate::filter::cas`].

pub mod access_log;
pub mod batch;
pub mod concurrency;
pub mod decision;
pub mod deny;
pub mod fallback;
pub mod idempotency;
pub mod lease;
pub mod overlimit;
pub mod quota;
pub mod ratelimit;
pub mod usage;
