//! A Redis Cluster on loopback for the cluster end-to-end tests
//! (tests/e2e_cluster.rs, tests/e2e_failover.rs): three real
//! `redis-server --cluster-enabled` masters (each with one replica for the
//! failover test), an Envoy running `redis_proxy` over an
//! `envoy.clusters.redis` cluster (envoy/redis-cluster.yaml) in front of
//! them, one Webdis pointed at that proxy, and two filter Envoys sharing it.
//! Built from the same parts as the single-Redis [`Stack`]: [`Proc`],
//! [`Scratch`], [`render`], [`Envoy`].
//!
//! Only the Envoys reach Redis: every node runs with envoy/redis.acl's users
//! (no open default user) and one more, [`PROXY_USER`], that the
//! `redis_proxy` Envoy connects as ([`node_acl`]); Webdis authenticates to
//! that Envoy with the default user's password; the harness's own
//! connections (cluster creation, slot moves, inspection) are `admin`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::{
    admin_stat, envoy_log, free_port, hex, on_path, redis_acl, render, run_to_exit, start_envoy,
    wait_for_port, Envoy, Proc, Scratch, Upstream, Webdis, REDIS_ADMIN_PASSWORD, REDIS_PASSWORD,
};

/// Masters in the cluster: enough for the tenants of a test to spread over
/// several, few enough for two cores.
pub const MASTERS: usize = 3;

/// `cluster-node-timeout` of a cluster with replicas: how long a master may
/// be unreachable before the others flag it as failing. Redis' default is
/// 15 s; at 1 s a killed master's replica takes over within a few seconds
/// (the flag, then 0.5-1 s of election delay, then the vote), which keeps
/// the failover test short. Loopback never stalls that long otherwise.
pub const NODE_TIMEOUT_MS: u64 = 1000;

/// The Redis user the `redis_proxy` Envoy connects to the nodes as
/// (envoy/redis-cluster.yaml's `auth_username`), and its password.
pub const PROXY_USER: &str = "redis-proxy";
pub const REDIS_PROXY_PASSWORD: &str = "test-redis-proxy-password";

/// What the proxy sends the nodes beyond the scripts' commands, found by
/// running Envoy 1.40 against nodes that refused them: `CLUSTER SLOTS`, its
/// topology discovery (which authenticates with the cluster's protocol
/// options, as commands do), and `ASKING`, sent before a command it follows
/// an ASK redirection with (refused, the target answers MOVED back to the
/// source, which answers ASK again: Envoy loops until its client leaves).
/// Nothing else: [`ClusterStack::assert_clean`] checks that no node's ACL
/// refused anything ([`RedisCluster::acl_refusals`]).
pub const PROXY_EXTRA_COMMANDS: &str = "+cluster|slots +asking";

/// The nodes' ACL file: envoy/redis.acl's users as every test Redis has them
/// (`default` limited to the scripts' commands on `rg:` keys, with
/// [`REDIS_PASSWORD`]; `admin`), and [`PROXY_USER`]: the default user's
/// line (so a command a script gains reaches it too) with its own password
/// and [`PROXY_EXTRA_COMMANDS`].
///
/// A user of its own rather than those two commands added to the default
/// user in envoy/redis.acl: a single Redis (the demo, compose, every other
/// test) has no use for them, and the file's `default` stays exactly the
/// scripts' commands, on the nodes as everywhere. Webdis' password opens
/// nothing more on a node than on a single Redis; the proxy's own password
/// lives only in its Envoy's configuration.
pub fn node_acl() -> String {
    let users = redis_acl(REDIS_PASSWORD);
    let proxy = redis_acl(REDIS_PROXY_PASSWORD)
        .lines()
        .find_map(|l| l.strip_prefix("user default "))
        .map(|rest| format!("user {PROXY_USER} {rest} {PROXY_EXTRA_COMMANDS}"))
        .expect("envoy/redis.acl has a default user");
    format!("{}\n{proxy}\n", users.trim_end())
}

/// A connection to the node on `port` as its `admin`.
pub fn admin_conn(port: u16) -> redis::Connection {
    try_admin_conn(port).unwrap()
}

fn try_admin_conn(port: u16) -> redis::RedisResult<redis::Connection> {
    let url = format!("redis://admin:{REDIS_ADMIN_PASSWORD}@127.0.0.1:{port}/");
    redis::Client::open(url)?.get_connection()
}

/// A connection to the node on `port` as `user` with `password`, to check
/// what that user may do.
pub fn conn_as(port: u16, user: &str, password: &str) -> redis::Connection {
    redis::Client::open(format!("redis://{user}:{password}@127.0.0.1:{port}/"))
        .unwrap()
        .get_connection()
        .unwrap()
}

/// Waits (bounded to 10 s each) until `port` listens and its admin gets an
/// answer to PING (the default user may not PING).
fn wait_for_node(port: u16) {
    let what = "redis-server (cluster)";
    wait_for_port(port, what, Duration::from_secs(10));
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if let Ok(mut c) = try_admin_conn(port) {
            if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{what} on {port} did not answer its admin's PING");
}

/// Three masters with their slots split by `redis-cli --cluster create`:
/// no replicas ([`RedisCluster::start`]) or one each
/// ([`RedisCluster::start_with_replicas`]).
pub struct RedisCluster {
    /// Ports of the masters, in the order given to `--cluster create`. After
    /// a failover ([`RedisCluster::wait_failover`]) the promoted replica
    /// takes its master's place, so an index keeps naming the same slots.
    pub ports: Vec<u16>,
    /// Each replica's port and its master's, while neither was promoted.
    replicas: Vec<(u16, u16)>,
    /// `(first slot, last slot, index into ports)`, from CLUSTER NODES.
    slots: Vec<(u16, u16, usize)>,
    /// How many nodes were started: a killed node stays known to the others.
    started: usize,
    /// Every live node's process by port, kept until the cluster is dropped
    /// (killed before `dir` goes); [`RedisCluster::kill_master`] takes one out.
    procs: Vec<(u16, Proc)>,
    dir: Scratch,
}

impl RedisCluster {
    /// Three empty masters, no replicas.
    pub fn start() -> RedisCluster {
        RedisCluster::start_nodes(0)
    }

    /// Three empty masters with one replica each (six nodes), every replica
    /// in sync with its master before this returns. Like [`start`], no
    /// persistence (`--save '' --appendonly no`): the failover test never
    /// restarts a node, so a file would change nothing it measures; what a
    /// promoted replica has is what replication delivered before the kill.
    ///
    /// [`start`]: RedisCluster::start
    pub fn start_with_replicas() -> RedisCluster {
        RedisCluster::start_nodes(1)
    }

    fn start_nodes(replicas_per_master: usize) -> RedisCluster {
        let dir = Scratch::new("redis-cluster");
        let acl = dir.0.join("users.acl");
        std::fs::write(&acl, node_acl()).unwrap();
        let started = MASTERS * (1 + replicas_per_master);
        let ports: Vec<u16> = (0..started).map(|_| free_port()).collect();
        let procs = ports
            .iter()
            .enumerate()
            .map(|(i, port)| {
                // The cluster bus gets a free port of its own: the default,
                // port + 10000, may be taken (or in the ephemeral range).
                let bus = free_port();
                let mut cmd = Command::new(super::server::binary());
                cmd.args(["--cluster-enabled", "yes", "--cluster-config-file"])
                    .arg(dir.0.join(format!("nodes-{i}.conf")))
                    .args(["--cluster-port", &bus.to_string()])
                    .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                    .args(["--save", "", "--appendonly", "no"])
                    // A master that fails takes only its own slots down:
                    // by default (yes) every master refuses every slot
                    // until the failover is over, so every tenant fails.
                    .args(["--cluster-require-full-coverage", "no"])
                    .arg("--aclfile")
                    .arg(&acl);
                if replicas_per_master > 0 {
                    // A replica syncs from its master as a client of it
                    // (PSYNC, REPLCONF): as admin, the default user may not.
                    cmd.args([
                        "--masteruser",
                        "admin",
                        "--masterauth",
                        REDIS_ADMIN_PASSWORD,
                    ])
                    .args(["--cluster-node-timeout", &NODE_TIMEOUT_MS.to_string()])
                    // A replica may take over however long ago it last
                    // heard from its master (by default not past about
                    // ten node timeouts): a failover always completes.
                    .args(["--cluster-replica-validity-factor", "0"])
                    // The first full sync starts at once, not after
                    // Redis' default 5 s wait for more replicas.
                    .args(["--repl-diskless-sync-delay", "0"]);
                }
                let proc = Proc::spawn(
                    "redis-server (cluster)",
                    cmd.arg("--dir").arg(&dir.0).stdout(Stdio::null()),
                );
                (*port, proc)
            })
            .collect();
        let mut cluster = RedisCluster {
            ports: ports.clone(),
            replicas: Vec::new(),
            slots: Vec::new(),
            started,
            procs,
            dir,
        };
        for port in &ports {
            wait_for_node(*port);
        }
        cluster.create(replicas_per_master);
        cluster.read_roles(&ports, replicas_per_master);
        cluster.wait_ok();
        cluster.wait_replicas_in_sync();
        cluster.slots = cluster.read_slots();
        cluster
    }

    /// Which nodes `--cluster create` made masters and which replicas (it
    /// picks, and pairs replicas with masters as it likes on one host):
    /// every node's own `INFO replication`.
    fn read_roles(&mut self, all: &[u16], replicas_per_master: usize) {
        let mut masters = Vec::new();
        let mut replicas = Vec::new();
        for port in all {
            let info = info(*port, "replication");
            match field(&info, "role").as_str() {
                "master" => masters.push(*port),
                "slave" => replicas.push((*port, field(&info, "master_port").parse().unwrap())),
                other => panic!("node {port}: role {other}"),
            }
        }
        assert_eq!(masters.len(), MASTERS, "{all:?}: masters {masters:?}");
        for m in &masters {
            let mine = replicas.iter().filter(|(_, of)| of == m).count();
            assert_eq!(mine, replicas_per_master, "replicas of {m}: {replicas:?}");
        }
        self.ports = masters;
        self.replicas = replicas;
    }

    /// Every replica's link to its master is up and its first sync done
    /// (bounded): from then on it receives each write as its master makes it.
    fn wait_replicas_in_sync(&self) {
        let start = Instant::now();
        for (port, _) in &self.replicas {
            loop {
                let info = info(*port, "replication");
                if field(&info, "master_link_status") == "up"
                    && field(&info, "master_sync_in_progress") == "0"
                {
                    break;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(15),
                    "replica {port} not in sync:\n{info}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// The port of the replica of master `node` (not yet promoted).
    pub fn replica_of(&self, node: usize) -> u16 {
        let master = self.ports[node];
        self.replicas
            .iter()
            .find(|(_, of)| *of == master)
            .unwrap_or_else(|| panic!("master {master} has no replica: {:?}", self.replicas))
            .0
    }

    /// Kills master `node` with SIGKILL (nothing flushed, no goodbye to the
    /// cluster); returns the moment just before the signal went.
    pub fn kill_master(&mut self, node: usize) -> Instant {
        let port = self.ports[node];
        let at = self
            .procs
            .iter()
            .position(|(p, _)| *p == port)
            .unwrap_or_else(|| panic!("master {port} was killed already"));
        let (_, mut proc) = self.procs.remove(at);
        let now = Instant::now();
        proc.kill();
        now
    }

    /// Waits, polling every 20 ms within `limit`, until the replica of the
    /// killed master `node` calls itself a master and every surviving node
    /// says `cluster_state:ok` with all 16384 slots served; then the replica
    /// takes `node`'s place in [`RedisCluster::ports`] and the slot table is
    /// read again. Returns the promoted replica's port.
    pub fn wait_failover(&mut self, node: usize, limit: Duration) -> u16 {
        let dead = self.ports[node];
        assert!(
            self.procs.iter().all(|(p, _)| *p != dead),
            "master {dead} is alive: kill it first"
        );
        let replica = self.replica_of(node);
        let start = Instant::now();
        loop {
            let promoted = field(&info(replica, "replication"), "role") == "master";
            if promoted && self.procs.iter().all(|(p, _)| cluster_ok(*p)) {
                break;
            }
            assert!(
                start.elapsed() < limit,
                "no failover of {dead} to {replica} within {limit:?}:\n{}",
                cluster_info(replica)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.ports[node] = replica;
        self.replicas.retain(|(p, _)| *p != replica);
        self.wait_ok();
        self.slots = self.read_slots();
        replica
    }

    /// `redis-cli --cluster create` as admin (its password in the
    /// environment, not on the command line), bounded: it assigns the slots,
    /// makes the nodes meet and waits until they agree.
    fn create(&self, replicas_per_master: usize) {
        let (status, text) = run_to_exit(
            "redis-cli --cluster create",
            Command::new(on_path("redis-cli"))
                .env("REDISCLI_AUTH", REDIS_ADMIN_PASSWORD)
                .args(["--user", "admin", "--cluster"])
                .arg("create")
                .args(self.ports.iter().map(|p| format!("127.0.0.1:{p}")))
                .args(["--cluster-replicas", &replicas_per_master.to_string()])
                .arg("--cluster-yes"),
            &self.dir.0.join("create.log"),
            Duration::from_secs(20),
        );
        assert!(
            status.success() && text.contains("All 16384 slots covered"),
            "redis-cli --cluster create failed ({status}):\n{text}"
        );
    }

    /// Every live node says `cluster_state:ok` and knows every node started,
    /// a killed one included (bounded).
    fn wait_ok(&self) {
        let start = Instant::now();
        for (port, _) in &self.procs {
            loop {
                let info = cluster_info(*port);
                let want = [
                    "cluster_state:ok".to_string(),
                    "cluster_slots_ok:16384".to_string(),
                    format!("cluster_known_nodes:{}", self.started),
                ];
                if want.iter().all(|w| info.lines().any(|l| l.trim() == w)) {
                    break;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(15),
                    "node {port} not ok:\n{info}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// The slot table as every master sees it (they must agree). Replicas
    /// and a failed master own no slot: their lines carry none.
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
                    if f.len() <= 8 {
                        continue;
                    }
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
                    assert!(f[2].contains("master") && !f[2].contains("fail"), "{line}");
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

    /// A direct connection to one master (not through the proxy), as admin.
    pub fn conn(&self, node: usize) -> redis::Connection {
        admin_conn(self.ports[node])
    }

    /// Every live node's ACL LOG entries (`(port, entry)`, each entry's
    /// fields as `name=value` text): what some user was refused. Empty after
    /// a scenario: neither the proxy nor Webdis needed more than their users
    /// have.
    pub fn acl_refusals(&self) -> Vec<(u16, String)> {
        let mut out = Vec::new();
        for (port, _) in &self.procs {
            let entries: Vec<Vec<redis::Value>> = redis::cmd("ACL")
                .arg("LOG")
                .query(&mut admin_conn(*port))
                .unwrap();
            for entry in entries {
                let text: Vec<String> = entry
                    .chunks(2)
                    .map(|kv| match kv {
                        [k, v] => format!("{}={}", value_text(k), value_text(v)),
                        _ => String::new(),
                    })
                    .collect();
                out.push((*port, text.join(" ")));
            }
        }
        out
    }

    /// CLUSTER KEYSLOT: CRC16 of the key's hash tag (or of the key), mod 16384.
    pub fn slot_of(&self, key: &[u8]) -> u16 {
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut self.conn(0))
            .unwrap()
    }

    /// The master that owns `slot`.
    pub fn owner(&self, slot: u16) -> usize {
        self.slots
            .iter()
            .find(|(a, b, _)| (*a..=*b).contains(&slot))
            .unwrap()
            .2
    }

    /// The master a tenant's keys must live on.
    pub fn node_of_tenant(&self, tenant: &str) -> usize {
        self.owner(self.slot_of(format!("{{{}}}", tag(tenant)).as_bytes()))
    }

    /// KEYS on one master: only the keys that master holds.
    pub fn keys_on(&self, node: usize, pattern: &str) -> Vec<Vec<u8>> {
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
    pub fn keys_by_node(&self, pattern: &str) -> BTreeMap<usize, Vec<Vec<u8>>> {
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
    pub fn begin_migration(&self, slot: u16, from: usize, to: usize) {
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
    pub fn move_keys(&self, slot: u16, from: usize, to: usize) {
        let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1000)
            .query(&mut self.conn(from))
            .unwrap();
        assert!(!keys.is_empty(), "slot {slot} has no key to move");
        // MIGRATE connects to the target as a client of it: as its admin.
        let ok: String = redis::cmd("MIGRATE")
            .arg("127.0.0.1")
            .arg(self.ports[to])
            .arg("")
            .arg(0)
            .arg(5000)
            .arg("AUTH2")
            .arg("admin")
            .arg(REDIS_ADMIN_PASSWORD)
            .arg("KEYS")
            .arg(&keys)
            .query(&mut self.conn(from))
            .unwrap();
        assert_eq!(ok, "OK");
    }

    /// Last half: every master records `to` as the slot's owner; waits
    /// (bounded) until all of them agree, then rereads the slot table.
    pub fn finish_migration(&mut self, slot: u16, to: usize) {
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
    pub fn flush_scripts(&self) {
        for node in 0..self.ports.len() {
            let ok: String = redis::cmd("SCRIPT")
                .arg("FLUSH")
                .query(&mut self.conn(node))
                .unwrap();
            assert_eq!(ok, "OK");
        }
    }
}

/// One section of a node's INFO.
fn info(port: u16, section: &str) -> String {
    redis::cmd("INFO")
        .arg(section)
        .query(&mut admin_conn(port))
        .unwrap()
}

/// A node's CLUSTER INFO.
fn cluster_info(port: u16) -> String {
    redis::cmd("CLUSTER")
        .arg("INFO")
        .query(&mut admin_conn(port))
        .unwrap()
}

/// A RESP value as text (ACL LOG's fields are strings and numbers).
fn value_text(v: &redis::Value) -> String {
    match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        redis::Value::Int(i) => i.to_string(),
        other => format!("{other:?}"),
    }
}

/// Whether a node says the cluster is up with every slot served.
fn cluster_ok(port: u16) -> bool {
    let info = cluster_info(port);
    field(&info, "cluster_state") == "ok" && field(&info, "cluster_slots_ok") == "16384"
}

/// The value of `name:value` in INFO-style text ("" if absent).
fn field(info: &str, name: &str) -> String {
    info.lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{name}:")))
        .unwrap_or_default()
        .to_string()
}

/// Envoy with only `redis_proxy` (envoy/redis-cluster.yaml): Webdis' Redis.
pub struct RedisProxy {
    pub port: u16,
    admin_port: u16,
    _proc: Proc,
    dir: Scratch,
}

impl RedisProxy {
    pub fn start(cluster: &RedisCluster) -> RedisProxy {
        let dir = Scratch::new("redis-proxy");
        let port = free_port();
        let admin_port = free_port();
        let mut vars = vec![
            ("ADMIN_PORT", admin_port.to_string()),
            ("REDIS_PROXY_PORT", port.to_string()),
            // What Webdis sends (Webdis::start): a JSON string, as
            // webdis.json's redis_auth takes it.
            ("REDIS_AUTH", serde_json::to_string(REDIS_PASSWORD).unwrap()),
            ("REDIS_PROXY_PASSWORD", REDIS_PROXY_PASSWORD.to_string()),
        ];
        let names = ["REDIS_NODE_A", "REDIS_NODE_B", "REDIS_NODE_C"];
        for (name, p) in names.iter().zip(&cluster.ports) {
            vars.push((name, p.to_string()));
        }
        let conf = dir.0.join("redis-cluster.yaml");
        std::fs::write(&conf, render("envoy/redis-cluster.yaml", &vars)).unwrap();
        // One worker is plenty for one Webdis' connections.
        let proc = start_envoy(
            "envoy (redis_proxy)",
            &dir,
            &conf,
            1,
            &[],
            (admin_port, port),
        );
        RedisProxy {
            port,
            admin_port,
            _proc: proc,
            dir,
        }
    }

    /// One stat of this Envoy (`redis.cluster_proxy.…`, `cluster.redis_cluster.…`).
    pub fn stat(&self, name: &str) -> u64 {
        admin_stat(self.admin_port, name)
    }

    /// One command in RESP straight to the proxy, after the AUTH Webdis
    /// sends; returns the reply's first line (enough for status, error and
    /// integer replies).
    pub fn command(&self, args: &[&str]) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let auth = resp_line(&mut s, &["AUTH", REDIS_PASSWORD]);
        assert_eq!(auth, "+OK", "the proxy refused Webdis' password");
        resp_line(&mut s, args)
    }

    pub fn log(&self) -> String {
        envoy_log(&self.dir)
    }

    /// Its admin /config_dump.
    pub fn config_dump(&self) -> String {
        let r = super::get(
            &format!("http://127.0.0.1:{}/config_dump", self.admin_port),
            &[],
        );
        String::from_utf8_lossy(&r.body).into_owned()
    }
}

/// Sends one command in RESP on `s`; returns the reply's first line.
fn resp_line(s: &mut TcpStream, args: &[&str]) -> String {
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

/// Two filter Envoys → one Webdis → the redis_proxy Envoy → three masters
/// (and their replicas).
/// Fields drop in order: the clients go before what they talk to.
pub struct ClusterStack {
    pub envoys: Vec<Envoy>,
    pub upstream: Upstream,
    _webdis: Webdis,
    pub proxy: RedisProxy,
    pub cluster: RedisCluster,
}

impl ClusterStack {
    pub fn start(filter_config: &str) -> ClusterStack {
        ClusterStack::on(RedisCluster::start(), filter_config)
    }

    /// The same over three masters with one replica each.
    pub fn start_with_replicas(filter_config: &str) -> ClusterStack {
        ClusterStack::on(RedisCluster::start_with_replicas(), filter_config)
    }

    fn on(cluster: RedisCluster, filter_config: &str) -> ClusterStack {
        let proxy = RedisProxy::start(&cluster);
        // As in front of a single Redis: the default user's password,
        // which the proxy checks itself (downstream_auth_passwords).
        let webdis = Webdis::start(proxy.port);
        webdis.wait_until_redis_answers();
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
    pub fn counter(&self, name: &str) -> u64 {
        self.envoys.iter().map(|e| e.counter(name)).sum()
    }

    /// What every scenario must leave behind: no call the filter could not
    /// decide, no CROSSSLOT anywhere, nothing Envoy's splitter refused.
    pub fn assert_clean(&self) {
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
        // Nothing the proxy sent (discovery, redirections, scripts) was
        // refused by a node's ACL.
        let refused = self.cluster.acl_refusals();
        assert!(
            refused.is_empty(),
            "refused by the nodes' ACL: {refused:#?}"
        );
    }
}

// ---------------------------------------------------------------------------
// Keys and tenants.

/// The hash tag the filter puts in every key of a tenant's requests
/// (`"hashTag":[{"header":"x-tenant"}]`), computed here independently of
/// the crate: the first 8 bytes of SHA-256 of `<len>:<tenant>:`, in hex.
pub fn tag(tenant: &str) -> String {
    hex(&Sha256::digest(format!("{}:{tenant}:", tenant.len()).as_bytes())[..8])
}

/// The `{…}` of a key.
pub fn tag_in(key: &[u8]) -> String {
    let text = String::from_utf8_lossy(key);
    let open = text.find('{').unwrap();
    let close = open + text[open..].find('}').unwrap();
    text[open + 1..close].to_string()
}

/// The limit name in `rg:rl:{tag}:<limit>:…`.
pub fn limit_in(key: &[u8]) -> String {
    let text = String::from_utf8_lossy(key);
    let after = &text[text.find("}:").unwrap() + 2..];
    after.split(':').next().unwrap().to_string()
}

pub fn tenants(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("tenant-{i:02}")).collect()
}

/// Which master each tenant's keys must be on; asserts the tenants cover
/// every master, so the scenario really spans the cluster.
pub fn placement(cluster: &RedisCluster, tenants: &[String]) -> BTreeMap<String, usize> {
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
