//! Redis Cluster end to end: three real `redis-server --cluster-enabled`
//! masters, an Envoy running `redis_proxy` over an `envoy.clusters.redis`
//! cluster (envoy/redis-cluster.yaml) in front of them, one Webdis pointed at
//! that proxy, and two filter Envoys sharing it; all on loopback.
//!
//! The filter is unchanged: it still talks to one Webdis, which talks to one
//! RESP endpoint. What must hold is that the guarantees stay exact when the
//! keys of different tenants live on different masters, that no script call
//! crosses slots, and that a master without the script recovers by itself.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use support::*;

const MASTERS: usize = 3;

// ---------------------------------------------------------------------------
// Harness: the cluster, the redis_proxy Envoy, the whole stack.

/// Three empty masters, no replicas, slots split by `redis-cli --cluster create`.
struct RedisCluster {
    /// Ports of the masters, in the order given to `--cluster create`.
    ports: Vec<u16>,
    /// `(first slot, last slot, index into ports)`, from CLUSTER NODES.
    slots: Vec<(u16, u16, usize)>,
    /// Kept until the cluster is dropped (killed before `dir` goes).
    _procs: Vec<Proc>,
    dir: Scratch,
}

impl RedisCluster {
    fn start() -> RedisCluster {
        let dir = Scratch::new("redis-cluster");
        let ports: Vec<u16> = (0..MASTERS).map(|_| free_port()).collect();
        let procs = ports
            .iter()
            .enumerate()
            .map(|(i, port)| {
                // The cluster bus gets a free port of its own: the default,
                // port + 10000, may be taken (or in the ephemeral range).
                let bus = free_port();
                Proc::spawn(
                    "redis-server (cluster)",
                    Command::new("redis-server")
                        .args(["--cluster-enabled", "yes", "--cluster-config-file"])
                        .arg(dir.0.join(format!("nodes-{i}.conf")))
                        .args(["--cluster-port", &bus.to_string()])
                        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                        .args(["--save", "", "--appendonly", "no"])
                        .arg("--dir")
                        .arg(&dir.0)
                        .stdout(Stdio::null()),
                )
            })
            .collect();
        let mut cluster = RedisCluster {
            ports,
            slots: Vec::new(),
            _procs: procs,
            dir,
        };
        for (i, port) in cluster.ports.iter().enumerate() {
            wait_for_port(*port, "redis-server (cluster)", Duration::from_secs(10));
            let start = Instant::now();
            while cluster.try_conn(i).is_err() {
                assert!(start.elapsed() < Duration::from_secs(10), "node {port}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        cluster.create();
        cluster.wait_ok();
        cluster.slots = cluster.read_slots();
        cluster
    }

    /// `redis-cli --cluster create`, bounded: it assigns the slots, makes the
    /// nodes meet and waits until they agree.
    fn create(&self) {
        let log = self.dir.0.join("create.log");
        let out = std::fs::File::create(&log).unwrap();
        let mut child = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(self.ports.iter().map(|p| format!("127.0.0.1:{p}")))
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run redis-cli ({e}); run `make test`"));
        let start = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if start.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "redis-cli --cluster create hung:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            status.success() && text.contains("All 16384 slots covered"),
            "redis-cli --cluster create failed ({status}):\n{text}"
        );
    }

    /// Every node says `cluster_state:ok` and knows every other (bounded).
    fn wait_ok(&self) {
        let start = Instant::now();
        for i in 0..self.ports.len() {
            loop {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut self.conn(i))
                    .unwrap();
                let want = [
                    "cluster_state:ok".to_string(),
                    "cluster_slots_ok:16384".to_string(),
                    format!("cluster_known_nodes:{}", self.ports.len()),
                ];
                if want.iter().all(|w| info.lines().any(|l| l.trim() == w)) {
                    break;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(15),
                    "node {} not ok:\n{info}",
                    self.ports[i]
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// The slot table as every node sees it (they must agree).
    fn read_slots(&self) -> Vec<(u16, u16, usize)> {
        let tables: Vec<Vec<(u16, u16, usize)>> = (0..self.ports.len())
            .map(|i| {
                let nodes: String = redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query(&mut self.conn(i))
                    .unwrap();
                let mut table = Vec::new();
                // <id> <ip:port@cport> <flags> <master> <ping> <pong> <epoch> <link> <slot>...
                for line in nodes.lines() {
                    let f: Vec<&str> = line.split_whitespace().collect();
                    let port: u16 = f[1]
                        .split('@')
                        .next()
                        .unwrap()
                        .rsplit(':')
                        .next()
                        .unwrap()
                        .parse()
                        .unwrap();
                    let node = self.ports.iter().position(|p| *p == port).unwrap();
                    assert!(f[2].contains("master"), "{line}");
                    for range in &f[8..] {
                        let (a, b) = range.split_once('-').unwrap_or((range, range));
                        table.push((a.parse().unwrap(), b.parse().unwrap(), node));
                    }
                }
                table.sort();
                table
            })
            .collect();
        assert!(tables.windows(2).all(|w| w[0] == w[1]), "{tables:?}");
        let table = tables.into_iter().next().unwrap();
        assert_eq!(
            table
                .iter()
                .map(|(a, b, _)| (b - a) as usize + 1)
                .sum::<usize>(),
            16384
        );
        table
    }

    fn try_conn(&self, node: usize) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(format!("redis://127.0.0.1:{}/", self.ports[node]))?.get_connection()
    }

    /// A direct connection to one master (not through the proxy).
    fn conn(&self, node: usize) -> redis::Connection {
        self.try_conn(node).unwrap()
    }

    /// CLUSTER KEYSLOT: CRC16 of the key's hash tag (or of the key), mod 16384.
    fn slot_of(&self, key: &[u8]) -> u16 {
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut self.conn(0))
            .unwrap()
    }

    /// The master that owns `slot`.
    fn owner(&self, slot: u16) -> usize {
        self.slots
            .iter()
            .find(|(a, b, _)| (*a..=*b).contains(&slot))
            .unwrap()
            .2
    }

    /// The master a tenant's keys must live on.
    fn node_of_tenant(&self, tenant: &str) -> usize {
        self.owner(self.slot_of(format!("{{{}}}", tag(tenant)).as_bytes()))
    }

    /// KEYS on one master: only the keys that master holds.
    fn keys_on(&self, node: usize, pattern: &str) -> Vec<Vec<u8>> {
        let mut keys: Vec<Vec<u8>> = redis::cmd("KEYS")
            .arg(pattern)
            .query(&mut self.conn(node))
            .unwrap();
        keys.sort();
        keys
    }

    /// Every key matching `pattern`, per master, after checking that each
    /// lives on the master owning its slot (a key elsewhere would mean a
    /// command was routed by something other than its slot).
    fn keys_by_node(&self, pattern: &str) -> BTreeMap<usize, Vec<Vec<u8>>> {
        let mut out = BTreeMap::new();
        for node in 0..self.ports.len() {
            let keys = self.keys_on(node, pattern);
            for key in &keys {
                let slot = self.slot_of(key);
                assert_eq!(
                    self.owner(slot),
                    node,
                    "{} (slot {slot}) lives on a master that does not own its slot",
                    String::from_utf8_lossy(key)
                );
            }
            if !keys.is_empty() {
                out.insert(node, keys);
            }
        }
        out
    }

    /// First half of a resharding step: `to` imports `slot`, `from` migrates
    /// it. Keys still on `from` are served there; missing ones get ASK.
    fn begin_migration(&self, slot: u16, from: usize, to: usize) {
        let id = |n: usize| -> String {
            redis::cmd("CLUSTER")
                .arg("MYID")
                .query(&mut self.conn(n))
                .unwrap()
        };
        let (from_id, to_id) = (id(from), id(to));
        let setslot = |n: usize, state: &str, id: &str| {
            let ok: String = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(state)
                .arg(id)
                .query(&mut self.conn(n))
                .unwrap();
            assert_eq!(ok, "OK");
        };
        setslot(to, "IMPORTING", &from_id);
        setslot(from, "MIGRATING", &to_id);
    }

    /// Moves every key of `slot` from `from` to `to` (MIGRATE, atomic per call).
    fn move_keys(&self, slot: u16, from: usize, to: usize) {
        let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1000)
            .query(&mut self.conn(from))
            .unwrap();
        assert!(!keys.is_empty(), "slot {slot} has no key to move");
        let ok: String = redis::cmd("MIGRATE")
            .arg("127.0.0.1")
            .arg(self.ports[to])
            .arg("")
            .arg(0)
            .arg(5000)
            .arg("KEYS")
            .arg(&keys)
            .query(&mut self.conn(from))
            .unwrap();
        assert_eq!(ok, "OK");
    }

    /// Last half: every master records `to` as the slot's owner; waits
    /// (bounded) until all of them agree, then rereads the slot table.
    fn finish_migration(&mut self, slot: u16, to: usize) {
        let to_id: String = redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut self.conn(to))
            .unwrap();
        // The new owner first, as the cluster spec asks.
        let order = std::iter::once(to).chain((0..self.ports.len()).filter(|n| *n != to));
        for n in order {
            let ok: String = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("NODE")
                .arg(&to_id)
                .query(&mut self.conn(n))
                .unwrap();
            assert_eq!(ok, "OK");
        }
        self.wait_ok();
        self.slots = self.read_slots();
        assert_eq!(self.owner(slot), to);
    }

    /// SCRIPT FLUSH on every master, directly: the next EVALSHA anywhere
    /// answers NOSCRIPT.
    fn flush_scripts(&self) {
        for node in 0..self.ports.len() {
            let ok: String = redis::cmd("SCRIPT")
                .arg("FLUSH")
                .query(&mut self.conn(node))
                .unwrap();
            assert_eq!(ok, "OK");
        }
    }
}

/// Envoy with only `redis_proxy` (envoy/redis-cluster.yaml): Webdis' Redis.
struct RedisProxy {
    port: u16,
    admin_port: u16,
    _proc: Proc,
    dir: Scratch,
}

impl RedisProxy {
    fn start(cluster: &RedisCluster) -> RedisProxy {
        let dir = Scratch::new("redis-proxy");
        let port = free_port();
        let admin_port = free_port();
        let mut vars = vec![
            ("ADMIN_PORT", admin_port.to_string()),
            ("REDIS_PROXY_PORT", port.to_string()),
        ];
        let names = ["REDIS_NODE_A", "REDIS_NODE_B", "REDIS_NODE_C"];
        for (name, p) in names.iter().zip(&cluster.ports) {
            vars.push((name, p.to_string()));
        }
        let conf = dir.0.join("redis-cluster.yaml");
        std::fs::write(&conf, render("envoy/redis-cluster.yaml", &vars)).unwrap();
        let log = std::fs::File::create(dir.0.join("envoy.log")).unwrap();
        let mut proc = Proc::spawn(
            "envoy (redis_proxy)",
            Command::new(envoy_bin())
                .arg("-c")
                .arg(&conf)
                // One worker is plenty for one Webdis' connections.
                .args(["--concurrency", "1", "--disable-hot-restart", "--log-level"])
                .arg(std::env::var("REDIS_GUARD_ENVOY_LOG").unwrap_or_else(|_| "warn".into()))
                .stdout(log.try_clone().unwrap())
                .stderr(log),
        );
        let start = Instant::now();
        // /ready turns 200 once the cluster's first CLUSTER SLOTS is in.
        loop {
            assert!(
                proc.is_running(),
                "redis_proxy Envoy exited during start-up:\n{}",
                std::fs::read_to_string(dir.0.join("envoy.log")).unwrap_or_default()
            );
            let ready = TcpStream::connect(("127.0.0.1", admin_port)).is_ok()
                && get(&format!("http://127.0.0.1:{admin_port}/ready"), &[]).status == 200
                && TcpStream::connect(("127.0.0.1", port)).is_ok();
            if ready {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "redis_proxy Envoy not ready within 30s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        RedisProxy {
            port,
            admin_port,
            _proc: proc,
            dir,
        }
    }

    /// One stat of this Envoy (`redis.cluster_proxy.…`, `cluster.redis_cluster.…`).
    fn stat(&self, name: &str) -> u64 {
        let r = get(
            &format!(
                "http://127.0.0.1:{}/stats?filter=^{}$",
                self.admin_port,
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

    /// One command in RESP straight to the proxy; returns the reply's first
    /// line (enough for status, error and integer replies).
    fn command(&self, args: &[&str]) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        s.write_all(req.as_bytes()).unwrap();
        let mut out = Vec::new();
        let mut byte = [0u8; 1];
        while !out.ends_with(b"\r\n") {
            assert_eq!(s.read(&mut byte).unwrap(), 1, "proxy closed the connection");
            out.push(byte[0]);
        }
        String::from_utf8_lossy(&out).trim_end().to_string()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("envoy.log")).unwrap_or_default()
    }
}

/// Two filter Envoys → one Webdis → the redis_proxy Envoy → three masters.
/// Fields drop in order: the clients go before what they talk to.
struct ClusterStack {
    envoys: Vec<Envoy>,
    upstream: Upstream,
    _webdis: Webdis,
    proxy: RedisProxy,
    cluster: RedisCluster,
}

impl ClusterStack {
    fn start(filter_config: &str) -> ClusterStack {
        let cluster = RedisCluster::start();
        let proxy = RedisProxy::start(&cluster);
        let webdis = Webdis::start(proxy.port);
        wait_until_the_cluster_answers_through(&webdis);
        let upstream = Upstream::start();
        // Both at once: each spends most of its start-up compiling the wasm.
        let envoys = std::thread::scope(|s| {
            let started: Vec<_> = (0..2)
                .map(|_| s.spawn(|| Envoy::start(filter_config, webdis.port, upstream.port)))
                .collect();
            started.into_iter().map(|h| h.join().unwrap()).collect()
        });
        ClusterStack {
            envoys,
            upstream,
            _webdis: webdis,
            proxy,
            cluster,
        }
    }

    /// A filter counter summed over both Envoys.
    fn counter(&self, name: &str) -> u64 {
        self.envoys.iter().map(|e| e.counter(name)).sum()
    }

    fn executions_of(&self, path: &str) -> u64 {
        let r = get(
            &format!("http://127.0.0.1:{}/__stats", self.upstream.port),
            &[],
        );
        r.json()["byPath"][path].as_u64().unwrap_or(0)
    }

    /// What every scenario must leave behind: no call the filter could not
    /// decide, no CROSSSLOT anywhere, nothing Envoy's splitter refused.
    fn assert_clean(&self) {
        for e in &self.envoys {
            let log = e.log();
            assert!(
                !log.contains("CROSSSLOT"),
                "a script call crossed slots:\n{log}"
            );
            assert_eq!(
                e.counter("redis_guard.redis.errors"),
                0,
                "undecided calls; filter log:\n{log}"
            );
            assert_eq!(e.counter("redis_guard.failure_mode.denied"), 0, "{log}");
            assert_eq!(e.counter("redis_guard.failure_mode.allowed"), 0, "{log}");
        }
        // The proxy's own errors (no host, timeout, a redirection it could
        // not follow): Redis' error replies (NOSCRIPT, CROSSSLOT) are not
        // counted here, they reach the filter as they are.
        for stat in [
            "redis.cluster_proxy.splitter.invalid_request",
            "redis.cluster_proxy.splitter.unsupported_command",
            "redis.cluster_proxy.command.evalsha.error",
            "redis.cluster_proxy.command.eval.error",
            "cluster.redis_cluster.upstream_internal_redirect_failed_total",
        ] {
            assert_eq!(self.proxy.stat(stat), 0, "{stat}:\n{}", self.proxy.log());
        }
    }
}

/// Webdis connects lazily and the proxy needs a moment to connect to the
/// masters; polls one keyed EVAL (Envoy cannot route a call without a key)
/// until the answer comes from Redis (bounded to 10 s). It touches no key.
fn wait_until_the_cluster_answers_through(webdis: &Webdis) {
    let url = format!("http://127.0.0.1:{}/", webdis.port);
    let start = Instant::now();
    loop {
        let r = http("POST", &url, &[], Some(b"EVAL/return%207/1/rg%3Aready.raw"));
        if r.status == 200 && r.body == b":7\r\n" {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the cluster did not answer through webdis and the proxy: {} {:?}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---------------------------------------------------------------------------
// Keys and tenants.

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The hash tag the filter puts in every key of a tenant's requests
/// (`"hashTag":[{"header":"x-tenant"}]`), computed here independently of
/// the crate: the first 8 bytes of SHA-256 of `<len>:<tenant>:`, in hex.
fn tag(tenant: &str) -> String {
    hex(&Sha256::digest(format!("{}:{tenant}:", tenant.len()).as_bytes())[..8])
}

/// The `{…}` of a key.
fn tag_in(key: &[u8]) -> String {
    let text = String::from_utf8_lossy(key);
    let open = text.find('{').unwrap();
    let close = open + text[open..].find('}').unwrap();
    text[open + 1..close].to_string()
}

/// The limit name in `rg:rl:{tag}:<limit>:…`.
fn limit_in(key: &[u8]) -> String {
    let text = String::from_utf8_lossy(key);
    let after = &text[text.find("}:").unwrap() + 2..];
    after.split(':').next().unwrap().to_string()
}

fn tenants(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("tenant-{i:02}")).collect()
}

/// Which master each tenant's keys must be on; asserts the tenants cover
/// every master, so the scenario really spans the cluster.
fn placement(cluster: &RedisCluster, tenants: &[String]) -> BTreeMap<String, usize> {
    let placed: BTreeMap<String, usize> = tenants
        .iter()
        .map(|t| (t.clone(), cluster.node_of_tenant(t)))
        .collect();
    let used: BTreeSet<usize> = placed.values().copied().collect();
    assert_eq!(
        used.len(),
        MASTERS,
        "tenants must span every master: {placed:?}"
    );
    placed
}

fn config(limits: &str, idempotency: &str) -> String {
    format!(
        r#"{{"redis":{{"cluster":"webdis","timeoutMs":3000}},"failureMode":"deny",
            "hashTag":[{{"header":"x-tenant"}}],"limits":{limits},"idempotency":{idempotency}}}"#
    )
}

/// Runs `f` over `jobs` from `threads` threads (each with its own keep-alive
/// client), every job once; bounded to `limit` in time. Results in job order.
fn run_jobs<J: Sync, R: Send>(
    jobs: &[J],
    threads: usize,
    limit: Duration,
    f: impl Fn(&ureq::Agent, usize, &J) -> R + Sync,
) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new((0..jobs.len()).map(|_| None).collect());
    let deadline = Instant::now() + limit;
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let agent = agent();
                while Instant::now() < deadline {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(job) = jobs.get(i) else { return };
                    let r = f(&agent, i, job);
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

#[test]
fn rate_limits_hold_exactly_across_two_envoys_over_the_cluster() {
    const SW: usize = 4;
    const TB: usize = 3;
    const PER_TENANT: usize = 8;
    let cfg = config(
        &format!(
            r#"[{{"name":"sw","match":{{"pathPrefix":"/sw"}},"descriptor":[{{"header":"x-tenant"}}],
                 "slidingWindow":{{"limit":{SW},"windowMs":600000}}}},
                {{"name":"tb","match":{{"pathPrefix":"/tb"}},"descriptor":[{{"header":"x-tenant"}}],
                 "tokenBucket":{{"capacity":{TB},"refill":1,"periodMs":3600000}}}}]"#
        ),
        "[]",
    );
    let stack = ClusterStack::start(&cfg);
    let tenants = tenants(16);
    let placed = placement(&stack.cluster, &tenants);

    // Tenant by tenant, so the threads race on one tenant's key at a time;
    // consecutive requests alternate between the two Envoys.
    let mut jobs = Vec::new();
    for t in &tenants {
        for path in ["/sw", "/tb"] {
            jobs.extend((0..PER_TENANT).map(|_| (t.as_str(), path)));
        }
    }
    let statuses = run_jobs(&jobs, 8, Duration::from_secs(20), |agent, i, (t, path)| {
        let e = &stack.envoys[i % 2];
        http_with(agent, "GET", &e.url(path), &[("x-tenant", t)], None).status
    });
    let mut per: BTreeMap<(&str, &str), BTreeMap<u16, usize>> = BTreeMap::new();
    for ((t, path), status) in jobs.iter().zip(&statuses) {
        *per.entry((t, path))
            .or_default()
            .entry(*status)
            .or_insert(0) += 1;
    }
    for t in &tenants {
        for (path, limit) in [("/sw", SW), ("/tb", TB)] {
            assert_eq!(
                per[&(t.as_str(), path)],
                BTreeMap::from([(200, limit), (429, PER_TENANT - limit)]),
                "{t} {path}: exactly the limit admitted over both Envoys"
            );
        }
    }
    let admitted = tenants.len() * (SW + TB);
    assert_eq!(stack.upstream.executed(), admitted as u64);
    assert_eq!(
        stack.counter("redis_guard.ratelimit.sw.allowed"),
        (tenants.len() * SW) as u64
    );
    assert_eq!(
        stack.counter("redis_guard.ratelimit.tb.rejected"),
        (tenants.len() * (PER_TENANT - TB)) as u64
    );
    for e in &stack.envoys {
        assert!(
            e.counter("redis_guard.ratelimit.sw.allowed") > 0,
            "both took part"
        );
    }

    // Exactly one key per tenant and limit, each on the master that owns its
    // slot, which is the master the tenant's tag maps to: all three are used.
    let by_node = stack.cluster.keys_by_node("rg:*");
    let mut seen = BTreeSet::new();
    for (node, keys) in &by_node {
        for key in keys {
            assert!(
                key.starts_with(b"rg:rl:"),
                "{}",
                String::from_utf8_lossy(key)
            );
            let t = tenants
                .iter()
                .find(|t| tag(t) == tag_in(key))
                .unwrap_or_else(|| panic!("unknown tag in {}", String::from_utf8_lossy(key)));
            assert_eq!(
                placed[t], *node,
                "{t}'s keys belong on master {}",
                placed[t]
            );
            assert!(seen.insert((t.clone(), limit_in(key))), "duplicate key");
        }
    }
    assert_eq!(seen.len(), tenants.len() * 2, "{seen:?}");
    assert_eq!(by_node.len(), MASTERS, "keys spread over every master");
    // The sliding window's state is exact too: one member per admitted request.
    for (node, keys) in &by_node {
        for key in keys.iter().filter(|k| limit_in(k) == "sw") {
            let n: usize = redis::cmd("ZCARD")
                .arg(key)
                .query(&mut stack.cluster.conn(*node))
                .unwrap();
            assert_eq!(n, SW);
        }
    }
    stack.assert_clean();
}

#[test]
fn idempotency_holds_over_the_cluster() {
    const CONCURRENT: usize = 8;
    let cfg = config(
        // A limit on the same requests: the acquire call carries two keys
        // (the limit's and the record's) that must share one slot.
        r#"[{"name":"pay-rate","match":{"pathPrefix":"/pay"},"descriptor":[{"header":"x-tenant"}],
             "slidingWindow":{"limit":100,"windowMs":600000}}]"#,
        r#"[{"name":"pay","match":{"pathPrefix":"/pay"},"tenant":[{"header":"x-tenant"}],
             "storeHeaders":["content-type"]}]"#,
    );
    let stack = ClusterStack::start(&cfg);
    let tenants = tenants(9);
    let placed = placement(&stack.cluster, &tenants);

    // Round by round: each tenant's duplicates are spread over the burst and
    // over both Envoys; the upstream holds the first one for 300 ms.
    let jobs: Vec<&str> = (0..CONCURRENT)
        .flat_map(|_| tenants.iter().map(String::as_str))
        .collect();
    let answers = run_jobs(&jobs, 12, Duration::from_secs(20), |agent, i, t| {
        let e = &stack.envoys[i % 2];
        let r = http_with(
            agent,
            "POST",
            &e.url(&format!("/pay/{t}")),
            &[
                ("idempotency-key", "order-1"),
                ("x-tenant", t),
                ("x-upstream-delay-ms", "300"),
            ],
            Some(format!("{{\"tenant\":\"{t}\"}}").as_bytes()),
        );
        let replayed = r.header("idempotent-replayed").map(str::to_string);
        (r.status, replayed, r.body)
    });
    let mut originals = BTreeMap::new();
    for t in &tenants {
        let mine: Vec<_> = jobs
            .iter()
            .zip(&answers)
            .filter(|(j, _)| *j == t)
            .map(|(_, a)| a)
            .collect();
        let first: Vec<_> = mine
            .iter()
            .filter(|(s, rep, _)| *s == 200 && rep.is_none())
            .collect();
        assert_eq!(first.len(), 1, "{t}: one original answer");
        let others = mine
            .iter()
            .filter(|(s, rep, _)| *s == 409 || (*s == 200 && rep.as_deref() == Some("true")))
            .count();
        assert_eq!(others, CONCURRENT - 1, "{t}: the rest are 409s or replays");
        originals.insert(t.clone(), first[0].2.clone());
        assert_eq!(stack.executions_of(&format!("/pay/{t}")), 1, "{t}");
    }
    // Every later retry, on either Envoy, replays the stored answer.
    for t in &tenants {
        for e in &stack.envoys {
            let r = http(
                "POST",
                &e.url(&format!("/pay/{t}")),
                &[("idempotency-key", "order-1"), ("x-tenant", t)],
                Some(format!("{{\"tenant\":\"{t}\"}}").as_bytes()),
            );
            assert_eq!(r.status, 200, "{t}");
            assert_eq!(r.header("idempotent-replayed"), Some("true"), "{t}");
            assert_eq!(r.header("content-type"), Some("application/json"));
            assert_eq!(r.body, originals[t], "{t}: byte-identical replay");
        }
        assert_eq!(stack.executions_of(&format!("/pay/{t}")), 1, "{t}");
    }
    assert_eq!(stack.upstream.executed(), tenants.len() as u64);
    assert_eq!(
        stack.counter("redis_guard.idempotency.stored"),
        tenants.len() as u64
    );

    // One COMPLETED record per tenant, next to the tenant's limit key, on
    // the master owning the tenant's slot; the records span the cluster.
    let records = stack.cluster.keys_by_node("rg:idem:*");
    let mut found = BTreeSet::new();
    for (node, keys) in &records {
        for key in keys {
            let t = tenants.iter().find(|t| tag(t) == tag_in(key)).unwrap();
            assert_eq!(placed[t], *node, "{t}");
            let state: Option<String> = redis::cmd("HGET")
                .arg(key)
                .arg("s")
                .query(&mut stack.cluster.conn(*node))
                .unwrap();
            assert_eq!(state.as_deref(), Some("C"), "{t}: completed, not locked");
            assert!(found.insert(t.clone()), "{t}: one record");
            let limit_keys = stack
                .cluster
                .keys_on(*node, &format!("rg:rl:{{{}}}:*", tag(t)));
            assert_eq!(limit_keys.len(), 1, "{t}: its limit key on the same master");
        }
    }
    assert_eq!(found.len(), tenants.len());
    assert_eq!(records.len(), MASTERS, "records spread over every master");
    stack.assert_clean();
}

/// One sliding window of `limit` per tenant, ten minutes long.
fn window_per_tenant(limit: usize) -> String {
    config(
        &format!(
            r#"[{{"name":"w","descriptor":[{{"header":"x-tenant"}}],
                 "slidingWindow":{{"limit":{limit},"windowMs":600000}}}}]"#
        ),
        "[]",
    )
}

#[test]
fn noscript_is_handled_per_node() {
    const LIMIT: usize = 6;
    let cfg = window_per_tenant(LIMIT);
    let stack = ClusterStack::start(&cfg);
    let tenants = tenants(12);
    placement(&stack.cluster, &tenants);
    let reloads = || stack.counter("redis_guard.redis.script_reloads");
    // One request at a time, alternating Envoys: every tenant spends one.
    let one_each = |round: usize| {
        for (i, t) in tenants.iter().enumerate() {
            let e = &stack.envoys[(i + round) % 2];
            let r = get(&e.url("/x"), &[("x-tenant", t)]);
            assert_eq!(r.status, 200, "{t} round {round}");
            assert_eq!(
                r.header("x-ratelimit-remaining"),
                Some((LIMIT - 1 - round).to_string().as_str()),
                "{t} round {round}"
            );
        }
    };

    // Sequential requests are deterministic: with one call in flight at a
    // time, the first EVALSHA a master sees answers NOSCRIPT, the EVAL that
    // follows goes to the same master (same first key) and caches the script
    // there, and no later call to that master misses it. So the reloads are
    // exactly the masters (a fresh cluster has no script anywhere, and the
    // tenants span all three), whichever Envoy or worker sent the call.
    one_each(0);
    assert_eq!(
        reloads(),
        MASTERS as u64,
        "a fresh cluster: one load per master"
    );
    one_each(1);
    assert_eq!(reloads(), MASTERS as u64, "cached on every master now");
    stack.cluster.flush_scripts();
    one_each(2);
    assert_eq!(
        reloads(),
        2 * MASTERS as u64,
        "after SCRIPT FLUSH each master needs its own reload"
    );

    // Concurrent requests: several EVALSHAs can reach a flushed master
    // before the first EVAL has cached the script there, and each of those
    // reloads. The count then depends on the interleaving: what is certain
    // is at least one reload per master (each got traffic and had no script)
    // and at most one per request. The limits stay exact either way.
    stack.cluster.flush_scripts();
    let before = reloads();
    let per_tenant = 6;
    let jobs: Vec<&str> = (0..per_tenant)
        .flat_map(|_| tenants.iter().map(String::as_str))
        .collect();
    let statuses = run_jobs(&jobs, 8, Duration::from_secs(20), |agent, i, t| {
        let e = &stack.envoys[i % 2];
        http_with(agent, "GET", &e.url("/x"), &[("x-tenant", t)], None).status
    });
    for t in &tenants {
        let mut counts = BTreeMap::new();
        for (_, s) in jobs.iter().zip(&statuses).filter(|(j, _)| *j == t) {
            *counts.entry(*s).or_insert(0) += 1;
        }
        let left = LIMIT - 3;
        assert_eq!(
            counts,
            BTreeMap::from([(200, left), (429, per_tenant - left)]),
            "{t}: exactly what was left of the window, no 5xx"
        );
    }
    let grew = reloads() - before;
    assert!(
        (MASTERS as u64..=jobs.len() as u64).contains(&grew),
        "reloads after the second flush: {grew}"
    );
    assert_eq!(
        stack.upstream.executed(),
        (tenants.len() * LIMIT) as u64,
        "every admitted request and nothing else"
    );
    // The scripts are cached on every master again.
    for node in 0..MASTERS {
        let cached: Vec<bool> = redis::cmd("SCRIPT")
            .arg("EXISTS")
            .arg(redis_guard::scripts::RATELIMIT.sha1.as_str())
            .query(&mut stack.cluster.conn(node))
            .unwrap();
        assert_eq!(cached, [true], "master {node}");
    }
    stack.assert_clean();
}

#[test]
fn calls_with_several_keys_never_cross_slots() {
    let cfg = config(
        r#"[{"name":"tenant","descriptor":[{"header":"x-tenant"}],
             "slidingWindow":{"limit":50,"windowMs":600000}},
            {"name":"user","match":{"pathPrefix":"/x"},
             "descriptor":[{"header":"x-tenant"},{"header":"x-user"}],
             "tokenBucket":{"capacity":2,"refill":1,"periodMs":3600000}},
            {"name":"method","descriptor":[{"header":"x-tenant"},"method"],
             "slidingWindow":{"limit":50,"windowMs":600000}}]"#,
        r#"[{"name":"pay","match":{"pathPrefix":"/pay"},"tenant":[{"header":"x-tenant"}]}]"#,
    );
    let stack = ClusterStack::start(&cfg);

    // The proxy does not hide CROSSSLOT: two keys of different slots in one
    // call reach a master and come back as its error. So the filter never
    // seeing one (assert_clean) means its keys always shared a slot.
    assert!(
        stack
            .proxy
            .command(&["EVAL", "return 1", "2", "rg:a", "rg:b"])
            .starts_with("-CROSSSLOT"),
        "a cross-slot call is refused by the master"
    );

    let tenants = tenants(12);
    let placed = placement(&stack.cluster, &tenants);
    for (i, t) in tenants.iter().enumerate() {
        // Three keys per call: tenant, user and method limits.
        let statuses: Vec<u16> = (0..3)
            .map(|k| {
                let e = &stack.envoys[(i + k) % 2];
                get(&e.url("/x"), &[("x-tenant", t), ("x-user", "u")]).status
            })
            .collect();
        assert_eq!(statuses, [200, 200, 429], "{t}");
        // Three keys again: tenant and method limits plus the record.
        let pay = |e: &Envoy| {
            http(
                "POST",
                &e.url("/pay"),
                &[("x-tenant", t), ("idempotency-key", "k")],
                Some(b"{}"),
            )
        };
        let first = pay(&stack.envoys[i % 2]);
        assert_eq!(first.status, 200, "{t}");
        let again = pay(&stack.envoys[(i + 1) % 2]);
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{t}");
    }

    // Every key of a tenant sits in one slot on the tenant's master: the
    // three limit keys and the record.
    let by_node = stack.cluster.keys_by_node("rg:*");
    let mut per_tenant: BTreeMap<String, BTreeSet<(usize, u16)>> = BTreeMap::new();
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    for (node, keys) in &by_node {
        for key in keys {
            let t = tenants.iter().find(|t| tag(t) == tag_in(key)).unwrap();
            per_tenant
                .entry(t.clone())
                .or_default()
                .insert((*node, stack.cluster.slot_of(key)));
            *count.entry(t.clone()).or_insert(0) += 1;
        }
    }
    for t in &tenants {
        let places = &per_tenant[t];
        assert_eq!(places.len(), 1, "{t}: one slot, one master: {places:?}");
        assert_eq!(places.iter().next().unwrap().0, placed[t], "{t}");
        // tenant, user, method (GET), method (POST), the record.
        assert_eq!(count[t], 5, "{t}");
    }
    assert_eq!(by_node.len(), MASTERS);
    assert_eq!(
        stack
            .proxy
            .stat("redis.cluster_proxy.splitter.invalid_request"),
        0
    );
    stack.assert_clean();
}

#[test]
fn a_tenant_whose_slot_moves_to_another_master_keeps_its_exact_budget() {
    const LIMIT: usize = 6;
    let cfg = window_per_tenant(LIMIT);
    let mut stack = ClusterStack::start(&cfg);
    let t = "tenant-moving";
    let slot = stack.cluster.slot_of(format!("{{{}}}", tag(t)).as_bytes());
    let from = stack.cluster.owner(slot);
    let to = (from + 1) % MASTERS;
    let mut n = 0;
    let mut send = |stack: &ClusterStack| {
        n += 1;
        get(&stack.envoys[n % 2].url("/x"), &[("x-tenant", t)]).status
    };
    let redirects = |stack: &ClusterStack| {
        stack
            .proxy
            .stat("cluster.redis_cluster.upstream_internal_redirect_succeeded_total")
    };
    let window_on = |stack: &ClusterStack, node: usize| -> Vec<usize> {
        stack
            .cluster
            .keys_on(node, "rg:rl:*")
            .iter()
            .map(|k| {
                // ASKING: the target of a migration answers for an importing
                // slot only to a client that says it was sent there.
                let mut con = stack.cluster.conn(node);
                let _: () = redis::cmd("ASKING").query(&mut con).unwrap();
                redis::cmd("ZCARD").arg(k).query(&mut con).unwrap()
            })
            .collect()
    };

    assert_eq!([send(&stack), send(&stack)], [200, 200]);
    assert_eq!(window_on(&stack, from), [2]);
    // Slot migrating, key not moved yet: the source still serves it.
    stack.cluster.begin_migration(slot, from, to);
    assert_eq!(send(&stack), 200);
    assert_eq!(window_on(&stack, from), [3]);
    // Key moved, slot not handed over: the source answers ASK, Envoy follows
    // it to the target, where the window goes on from the moved state.
    stack.cluster.move_keys(slot, from, to);
    let before = redirects(&stack);
    assert_eq!(send(&stack), 200);
    assert!(redirects(&stack) > before, "the call was redirected (ASK)");
    assert_eq!(window_on(&stack, from), Vec::<usize>::new());
    assert_eq!(window_on(&stack, to), [4]);
    // Slot handed over: Envoy's slot table is stale until its next refresh,
    // so calls meet MOVED (followed) or go straight to the new owner.
    stack.cluster.finish_migration(slot, to);
    let rest: Vec<u16> = (0..4).map(|_| send(&stack)).collect();
    assert_eq!(rest, [200, 200, 429, 429], "exactly {LIMIT} in all");
    assert_eq!(window_on(&stack, to), [LIMIT]);
    assert_eq!(stack.upstream.executed(), LIMIT as u64);
    let by_node = stack.cluster.keys_by_node("rg:*");
    assert_eq!(by_node.keys().copied().collect::<Vec<_>>(), [to]);
    stack.assert_clean();
}
