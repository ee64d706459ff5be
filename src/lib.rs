//! redis-guard: a proxy-wasm HTTP filter for Envoy that enforces distributed
//! rate limits decided by atomic Redis Lua scripts, reached through Webdis.
//!
//! Everything outside [`filter`] is pure logic with no proxy-wasm import, unit
//! tested natively; [`filter::proxy`] is the only code that talks to the host.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

// Small blocks from free lists by size class (src/small_alloc.rs): about a
// fifth of an admitted request's fuel was dlmalloc's (envoy/cost_gate).
#[cfg(target_arch = "wasm32")]
#[global_allocator]
static ALLOCATOR: small_alloc::Classes = small_alloc::Classes::new();

pub mod access_log;
pub mod batch;
pub mod breaker;
pub mod codec;
pub mod concurrency;
pub mod config;
pub mod deny;
pub mod filter;
pub mod grpc;
pub mod idempotency;
pub mod keys;
pub mod lease;
pub mod local;
pub mod networks;
pub mod offload;
pub mod overlimit;
pub mod overrides;
pub mod quota;
pub mod ratelimit;
pub mod request;
pub mod response;
pub mod scripts;
pub mod sigv4;
pub mod small_alloc;
pub mod statuses;
pub mod usage;
pub mod webdis;
