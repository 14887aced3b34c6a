//! Throwaway Redis servers for tests: each [`RedisServer`] is a
//! `redis-server` process on a free loopback port in its own temp dir,
//! killed when dropped; [`RedisCluster`] is three primaries and three
//! replicas. No test depends on a server someone else started.
//!
//! Needs `redis-server` and `redis-cli` on the `PATH` (`scripts/test`
//! installs them).

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` process, killed (and its directory removed) on drop.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: PathBuf,
    extra: Vec<String>,
}

/// A port nothing listens on right now, below Linux's ephemeral range
/// (32768 and up by default). A port from `bind(0)` that is released again
/// can be handed to the next `bind(0)` of a parallel test before
/// `redis-server` takes it (or while a killed server is down); ports below
/// that range are only ever given out here. Each call moves on from a start
/// that depends on the process id, so test binaries run side by side rarely
/// probe the same ports, and one that is taken is skipped.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id().wrapping_mul(2_654_435_761) % SPAN;
    for _ in 0..SPAN {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = u16::try_from(LOW + (start + n) % SPAN).expect("below 32000");
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LOW}..{}", LOW + SPAN)
}

fn temp_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("floodgate-redis-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temp dir");
    dir
}

impl RedisServer {
    /// Start a server on a free port.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Start a server with extra `redis-server` arguments (`--name value`).
    pub fn start_with(extra: &[&str]) -> Self {
        let mut s = Self {
            child: None,
            port: free_port(),
            dir: temp_dir("server"),
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
        };
        s.restart();
        s
    }

    /// Its `redis://` URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kill the process (SIGKILL: no goodbye to clients).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start it again on the same port, empty (nothing is persisted).
    pub fn restart(&mut self) {
        self.kill();
        let mut cmd = Command::new("redis-server");
        cmd.current_dir(&self.dir)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--dir", &self.dir.to_string_lossy()])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = cmd.spawn().expect("redis-server on the PATH (scripts/test installs it)");
        self.child = Some(child);
        wait_for_ping(self.port);
    }

    /// Pause the process (SIGSTOP): it keeps its socket but answers nothing.
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// Resume a paused process (SIGCONT).
    pub fn resume(&self) {
        self.signal("CONT");
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill").args([&format!("-{sig}"), &c.id().to_string()]).status();
        }
    }

    /// Run `redis-cli` against it; its stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.resume();
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `redis-cli -p port args...`; its stdout.
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli on the PATH (scripts/test installs it)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn wait_for_ping(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok() && cli(port, &["PING"]).trim() == "PONG" {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("redis-server on port {port} did not answer PING within 10 s");
}

/// A Redis Cluster on loopback: three primaries, three replicas, a
/// generous node timeout (busy test machines must not cause failovers) and
/// `cluster-replica-validity-factor 0` (a replica may take over however
/// long it was idle, so tests can kill a primary).
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes, primaries first as created (roles change on failover).
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Start the six nodes and join them; returns once every slot is served.
    pub fn start() -> Self {
        let nodes: Vec<RedisServer> = (0..6)
            .map(|_| {
                let bus = free_port().to_string();
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "3000",
                    "--cluster-replica-validity-factor",
                    "0",
                    "--cluster-port",
                    &bus,
                    "--repl-diskless-sync-delay",
                    "0",
                ])
            })
            .collect();
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let mut args = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        args.extend(["--cluster-replicas", "1", "--cluster-yes"]);
        let out = Command::new("redis-cli").args(&args).output().expect("redis-cli");
        assert!(out.status.success(), "redis-cli --cluster create failed: {}", String::from_utf8_lossy(&out.stdout));
        let cluster = Self { nodes };
        cluster.wait_until_ok();
        cluster.wait_for_replicas();
        cluster
    }

    /// Wait (at most 30 s) until every live primary has a replica that has
    /// everything written to it so far (replication is asynchronous).
    pub fn wait_for_replicas(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let caught_up = |info: &str| {
            let field = |name: &str| {
                info.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_owned()).unwrap_or_default()
            };
            if field("role:") != "master" {
                return true;
            }
            let offset = field("master_repl_offset:");
            // slave0:ip=…,port=…,state=online,offset=N,lag=…
            info.lines().filter(|l| l.starts_with("slave")).any(|l| {
                l.contains("state=online") && l.split(',').any(|kv| kv.strip_prefix("offset=") == Some(offset.as_str()))
            })
        };
        while Instant::now() < deadline {
            if self.nodes.iter().filter(|n| n.child.is_some()).all(|n| caught_up(&n.cli(&["INFO", "replication"]))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the cluster's replicas did not catch up within 30 s");
    }

    /// The `redis+cluster://` address of its nodes.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// Wait (at most 30 s) until every live node reports `cluster_state:ok`.
    pub fn wait_until_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let ok = self
                .nodes
                .iter()
                .filter(|n| n.child.is_some())
                .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"));
            if ok {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the Redis Cluster did not reach cluster_state:ok within 30 s");
    }

    /// The index of the node serving `key` as primary now.
    pub fn primary_of(&self, key: &str) -> usize {
        let live = self.nodes.iter().find(|n| n.child.is_some()).expect("a live node");
        let slot: u16 = live.cli(&["CLUSTER", "KEYSLOT", key]).trim().parse().expect("a slot number");
        // Lines: id ip:port@bus flags master-id ping pong epoch state slots...
        for line in live.cli(&["CLUSTER", "NODES"]).lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
                continue;
            }
            let owns = f[8..].iter().any(|r| {
                let (a, b) = r.split_once('-').unwrap_or((r, r));
                matches!((a.parse::<u16>(), b.parse::<u16>()), (Ok(a), Ok(b)) if a <= slot && slot <= b)
            });
            if owns {
                let port: u16 = f[1].split(['@', ':']).nth(1).and_then(|p| p.parse().ok()).expect("a port");
                return self.nodes.iter().position(|n| n.port == port).expect("a node of this cluster");
            }
        }
        panic!("no live primary serves slot {slot}");
    }
}

impl RedisCluster {
    /// The cluster node id of node `i`.
    pub fn node_id(&self, i: usize) -> String {
        self.nodes[i].cli(&["CLUSTER", "MYID"]).trim().to_owned()
    }

    /// Move the slot of `key` from its primary to primary `to`, keys
    /// included, the way `redis-cli --cluster reshard` does (IMPORTING /
    /// MIGRATING, MIGRATE, SETSLOT NODE), so clients see ASK then MOVED.
    pub fn migrate_slot_of(&self, key: &str, to: usize) {
        let from = self.primary_of(key);
        assert_ne!(from, to, "the slot is on node {to} already");
        let slot = self.nodes[from].cli(&["CLUSTER", "KEYSLOT", key]).trim().to_owned();
        let (from_id, to_id) = (self.node_id(from), self.node_id(to));
        let (src, dst) = (&self.nodes[from], &self.nodes[to]);
        dst.cli(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id]);
        src.cli(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id]);
        loop {
            let keys = src.cli(&["CLUSTER", "GETKEYSINSLOT", &slot, "100"]);
            let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
            if keys.is_empty() {
                break;
            }
            let port = dst.port.to_string();
            let mut args = vec!["MIGRATE", "127.0.0.1", port.as_str(), "", "0", "5000", "KEYS"];
            args.extend(keys);
            let out = src.cli(&args);
            assert!(out.contains("OK") || out.contains("NOKEY"), "MIGRATE failed: {out}");
        }
        for n in self.nodes.iter().filter(|n| n.child.is_some()) {
            n.cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]);
        }
        self.wait_until_ok();
    }
}
