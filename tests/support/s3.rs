//! A real S3-compatible server that verifies AWS Signature V4: moto_server
//! (PyPI `moto[server]`, installed into .venv by `make s3-dep`) with IAM
//! access control on, plus an independent client (`envoy/s3ctl.py`,
//! boto3) to look at and change objects behind the filter's back.
//!
//! What moto checks, measured on 5.2.5 (see tests/s3_server.rs):
//! - the signature over the method, path, query and the headers named in
//!   SignedHeaders (others, such as Envoy's x-forwarded-proto or x-request-id,
//!   are ignored): wrong secret, tampered signed header or path → 403
//!   `SignatureDoesNotMatch`; unknown key id → 403 `InvalidAccessKeyId`;
//! - not the body: the canonical request takes x-amz-content-sha256 as sent,
//!   so a body that does not match it is stored anyway;
//! - not the clock: an old x-amz-date is accepted;
//! - headers botocore never signs (user-agent, expect, connection, te,
//!   transfer-encoding, …) are dropped before it recomputes, so a client that
//!   signs one of them gets `SignatureDoesNotMatch` here (AWS would accept);
//! - an unsigned request: 403 with an empty body on an existing object,
//!   500 otherwise.
//!
//! A missing object is 404 `NoSuchKey`; DELETE of a missing object is 204.

use super::{free_port, require, root, Proc, Scratch};
use std::io::Write;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// IAM calls `s3ctl.py bootstrap` makes unsigned (CreateUser, PutUserPolicy,
/// CreateAccessKey): moto's INITIAL_NO_AUTH_ACTION_COUNT. Must equal
/// `NO_AUTH_ACTIONS` in envoy/s3ctl.py.
pub const NO_AUTH_ACTIONS: u32 = 3;
pub const BUCKET: &str = "redis-guard";
pub const REGION: &str = "us-east-1";

pub struct S3 {
    pub port: u16,
    pub bucket: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    /// Seeds moto's id generator before bootstrap, so a restart issues the
    /// same access key.
    seed: u16,
    proc: Proc,
    dir: Scratch,
}

fn venv_bin(name: &str) -> PathBuf {
    require(
        &root().join(".venv/bin").join(name),
        &format!("{name} (moto[server] in .venv, `make s3-dep`)"),
    )
}

impl S3 {
    /// moto_server on a free loopback port with IAM auth on, bootstrapped:
    /// one IAM user allowed `s3:*`, its access key, and the bucket `redis-guard`.
    pub fn start() -> S3 {
        let dir = Scratch::new("s3");
        let port = free_port();
        let proc = Self::spawn(port, &dir);
        let mut s3 = S3 {
            port,
            bucket: BUCKET.to_string(),
            access_key_id: String::new(),
            secret_access_key: String::new(),
            seed: port,
            proc,
            dir,
        };
        s3.wait_ready();
        (s3.access_key_id, s3.secret_access_key) = s3.bootstrap();
        s3
    }

    fn spawn(port: u16, dir: &Scratch) -> Proc {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.0.join("moto.log"))
            .unwrap();
        Proc::spawn(
            "moto_server",
            Command::new(venv_bin("moto_server"))
                .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .env("INITIAL_NO_AUTH_ACTION_COUNT", NO_AUTH_ACTIONS.to_string())
                .stdout(log.try_clone().unwrap())
                .stderr(log),
        )
    }

    /// Waits for the listening socket only: any HTTP request to S3 or IAM
    /// would use up one of the unsigned bootstrap actions.
    fn wait_ready(&mut self) {
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                self.proc.is_running(),
                "moto_server exited during start-up:\n{}",
                self.log()
            );
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "moto_server did not listen on 127.0.0.1:{} within 30s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn bootstrap(&self) -> (String, String) {
        let out = self.ctl("bootstrap", &[&self.seed.to_string()], None);
        assert!(out.status.success(), "s3ctl bootstrap: {}", describe(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (
            v["accessKeyId"].as_str().unwrap().to_string(),
            v["secretAccessKey"].as_str().unwrap().to_string(),
        )
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// moto's request log (one line per request, and tracebacks).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("moto.log")).unwrap_or_default()
    }

    /// Runs `s3ctl.py CMD PORT BUCKET ARGS…` (see its docstring) as is, for
    /// tests that need its exit status: 0 ok, 2 S3 error, 3 NoSuchKey.
    pub fn ctl(&self, cmd: &str, args: &[&str], stdin: Option<&[u8]>) -> Output {
        let mut child = Command::new(venv_bin("python"))
            .arg(root().join("envoy/s3ctl.py"))
            .args([cmd, &self.port.to_string(), &self.bucket])
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run s3ctl.py: {e}; run `make test`"));
        if let Some(body) = stdin {
            // An error before s3ctl reads stdin shows in its output below.
            let _ = child.stdin.take().unwrap().write_all(body);
        }
        child.wait_with_output().unwrap()
    }

    /// `ctl` signed with this server's key; panics on any failure but `ok`.
    fn signed(&self, cmd: &str, key: Option<&str>, stdin: Option<&[u8]>, ok: &[i32]) -> Output {
        let mut args: Vec<&str> = key.into_iter().collect();
        args.extend([self.access_key_id.as_str(), &self.secret_access_key]);
        let out = self.ctl(cmd, &args, stdin);
        let code = out.status.code().unwrap_or(-1);
        assert!(
            code == 0 || ok.contains(&code),
            "s3ctl {cmd} {key:?}: {}",
            describe(&out)
        );
        out
    }

    /// Every object in the bucket: (key, size in bytes), sorted by key.
    pub fn keys(&self) -> Vec<(String, u64)> {
        let out = self.signed("list", None, None, &[]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .map(|o| {
                let key = o["key"].as_str().unwrap().to_string();
                (key, o["size"].as_u64().unwrap())
            })
            .collect()
    }

    /// The object's bytes; None when S3 answers NoSuchKey.
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        let out = self.signed("get", Some(key), None, &[3]);
        out.status.success().then_some(out.stdout)
    }

    pub fn delete(&self, key: &str) {
        self.signed("delete", Some(key), None, &[]);
    }

    /// Writes (or overwrites) an object.
    pub fn put(&self, key: &str, body: &[u8]) {
        self.signed("put", Some(key), Some(body), &[]);
    }

    /// Puts a lifecycle rule expiring objects under `prefix` after `days`
    /// and returns the configuration read back. moto stores it; it never
    /// expires anything.
    pub fn lifecycle(&self, days: u32, prefix: &str) -> serde_json::Value {
        let mut args = vec![self.access_key_id.as_str(), &self.secret_access_key];
        let days = days.to_string();
        args.extend([days.as_str(), prefix]);
        let out = self.ctl("lifecycle", &args, None);
        assert!(out.status.success(), "s3ctl lifecycle: {}", describe(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Kills the server: connections are refused until `restart`.
    pub fn stop(&mut self) {
        self.proc.kill();
    }

    /// Starts again on the same port, empty (moto keeps nothing), and
    /// bootstraps it again: same bucket, same access key and secret.
    pub fn restart(&mut self) {
        self.proc.kill();
        self.proc = Self::spawn(self.port, &self.dir);
        self.wait_ready();
        let creds = self.bootstrap();
        assert_eq!(
            creds,
            (self.access_key_id.clone(), self.secret_access_key.clone()),
            "moto issued another access key after a restart"
        );
    }
}

fn describe(out: &Output) -> String {
    format!(
        "{} {}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        if out.stdout.len() < 2000 {
            String::from_utf8_lossy(&out.stdout).to_string()
        } else {
            String::new()
        }
    )
}
