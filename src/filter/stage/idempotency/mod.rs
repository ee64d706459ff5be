//! The idempotency stages: intake (the key and the fingerprint), record (the
//! lock and the stored response), upload (large bodies to the object store)
//! and replay (what a retry gets).

pub mod intake;
pub mod record;
pub mod replay;
pub mod upload;
