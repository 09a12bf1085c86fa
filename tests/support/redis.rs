//! Real `redis-server` processes (standalone and a 6-node cluster) on free loopback ports, each
//! in its own temporary directory, killed on drop.
//!
//! Nothing here mocks Redis. If `redis-server` or `redis-cli` is not installed the support code
//! panics (the test fails; it never skips).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;

use super::poll::{eventually_blocking, eventually_some_blocking};
use super::{free_port, loopback};

/// A free port `p` whose cluster-bus port `p + 10000` is free too.
fn free_cluster_port(taken: &[u16]) -> u16 {
    for _ in 0..1000 {
        let l = TcpListener::bind(loopback(0)).expect("bind 127.0.0.1:0");
        let p = l.local_addr().expect("local_addr").port();
        if p >= 55_000 || taken.contains(&p) || taken.contains(&(p + 10_000)) {
            continue;
        }
        if TcpListener::bind(loopback(p + 10_000)).is_ok() {
            return p;
        }
    }
    panic!("no free port pair (p, p + 10000) found");
}

/// Send one inline command over a raw TCP connection and return the first reply line, or
/// `None` if the server does not answer within `timeout`.
fn raw_command(port: u16, cmd: &str, timeout: Duration) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&loopback(port), timeout).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    s.set_write_timeout(Some(timeout)).ok()?;
    s.write_all(format!("{cmd}\r\n").as_bytes()).ok()?;
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    Some(text.lines().next().unwrap_or("").to_owned())
}

/// True when the server on `port` answers PING with PONG.
fn pings(port: u16) -> bool {
    raw_command(port, "PING", Duration::from_millis(200)).as_deref() == Some("+PONG")
}

/// Run `redis-cli -p <port> <args>` and return its stdout, trimmed. Panics if redis-cli is
/// missing; a Redis error reply is returned as text (redis-cli prints it), not a panic.
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli must be installed (the Redis tests never skip)");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// True when the node on `port` has the function library `name` (`FUNCTION LIST`).
pub fn has_library(port: u16, name: &str) -> bool {
    redis_cli(port, &["FUNCTION", "LIST", "LIBRARYNAME", name])
        .lines()
        .any(|l| l == name)
}

/// Calls of `command` (lower case, e.g. `fcall`, `evalsha`) the node on `port` has executed,
/// from `INFO commandstats` (0 when it never ran it).
pub fn command_calls(port: u16, command: &str) -> u64 {
    let want = format!("cmdstat_{command}:calls=");
    redis_cli(port, &["INFO", "commandstats"])
        .lines()
        .find_map(|l| l.strip_prefix(&want))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().expect("a call count"))
}

/// Send a signal with `kill -<sig> <pid>`.
fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{sig} {pid} failed");
}

/// Spawn `redis-server` on `port` in `dir` with extra arguments.
fn spawn_server(port: u16, dir: &std::path::Path, extra: &[String]) -> Child {
    Command::new("redis-server")
        .arg("--port")
        .arg(port.to_string())
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--daemonize", "no", "--protected-mode", "no"])
        .arg("--logfile")
        .arg(format!("redis-{port}.log"))
        .args(extra)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server must be installed (the Redis tests never skip)")
}

/// Wait until `port` answers PING (true), or the child exits or `timeout` passes (false).
fn wait_ping(child: &mut Child, port: u16, timeout: Duration) -> bool {
    let outcome = eventually_some_blocking(timeout, || {
        if let Ok(Some(_)) = child.try_wait() {
            return Some(false);
        }
        pings(port).then_some(true)
    });
    outcome == Some(true)
}

/// A standalone `redis-server` on a free loopback port, in its own temp dir. Killed on drop.
pub struct RedisServer {
    /// The running process (None after `kill`).
    child: Option<Child>,
    /// Its port.
    port: u16,
    /// Its working directory (logs).
    dir: TempDir,
    /// Extra `redis-server` arguments, kept for restarts.
    extra: Vec<String>,
}

impl RedisServer {
    /// Start a server and wait until it answers PING.
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// A server without Redis functions, as Redis 6 is: `FCALL` and `FUNCTION` are disabled
    /// (`rename-command` to nothing), so both answer "unknown command" like a Redis 6 server.
    pub fn start_without_functions() -> RedisServer {
        let s = Self::start_with(&["--rename-command", "FCALL", "", "--rename-command", "FUNCTION", ""]);
        assert!(
            s.cli(&["FCALL", "f", "0"]).starts_with("ERR unknown command"),
            "FCALL is disabled"
        );
        s
    }

    /// Start a server with extra `redis-server` arguments and wait until it answers PING.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let extra: Vec<String> = extra.iter().map(|a| (*a).to_owned()).collect();
        for _ in 0..5 {
            let port = free_port();
            let mut child = spawn_server(port, dir.path(), &extra);
            if wait_ping(&mut child, port, Duration::from_secs(5)) {
                return RedisServer {
                    child: Some(child),
                    port,
                    dir,
                    extra,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("redis-server did not start (see logs in {:?})", dir.path());
    }

    /// `redis://127.0.0.1:<port>/`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The process id (None when killed).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Run redis-cli against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port, args)
    }

    /// SIGKILL the server (no shutdown, connections reset).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP: the server freezes with its sockets open.
    pub fn stop(&self) {
        if let Some(pid) = self.pid() {
            signal(pid, "STOP");
        }
    }

    /// SIGCONT after `stop`.
    pub fn cont(&self) {
        if let Some(pid) = self.pid() {
            signal(pid, "CONT");
        }
    }

    /// Kill the server if it runs, and start a fresh one (empty, no scripts) on the same port
    /// (retried until the killed server's port is free again).
    pub fn restart(&mut self) {
        self.kill();
        let (port, dir) = (self.port, self.dir.path().to_owned());
        let child = eventually_some_blocking(Duration::from_secs(10), || {
            let mut child = spawn_server(port, &dir, &self.extra);
            if wait_ping(&mut child, port, Duration::from_secs(5)) {
                return Some(child);
            }
            let _ = child.kill();
            let _ = child.wait();
            None
        });
        self.child = Some(child.unwrap_or_else(|| panic!("redis-server did not restart on port {port}")));
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One node of a [`RedisCluster`].
struct Node {
    /// Client port (the bus port is `port + 10000`).
    port: u16,
    /// The process (None after `kill_node`).
    child: Option<Child>,
}

/// A 6-node Redis Cluster (3 masters, 3 replicas) on loopback, with
/// `cluster-node-timeout 2000`. Killed on drop.
pub struct RedisCluster {
    /// The nodes, in creation order.
    nodes: Vec<Node>,
    /// Working directory (nodes-*.conf, logs).
    dir: TempDir,
}

impl RedisCluster {
    /// Start 6 nodes, create the cluster with `redis-cli --cluster create`, and wait until
    /// every node reports `cluster_state:ok` with all slots covered and every replica's link
    /// to its master is up.
    pub fn start() -> RedisCluster {
        let mut last = String::new();
        for _ in 0..3 {
            match Self::try_start() {
                Ok(c) => return c,
                Err(e) => last = e,
            }
        }
        panic!("could not start a Redis Cluster: {last}");
    }

    fn try_start() -> Result<RedisCluster, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let mut ports = Vec::new();
        while ports.len() < 6 {
            let p = free_cluster_port(&ports);
            ports.push(p);
        }
        let mut cluster = RedisCluster { nodes: Vec::new(), dir };
        for &p in &ports {
            let child = spawn_server(p, cluster.dir.path(), &Self::node_args(p));
            cluster.nodes.push(Node {
                port: p,
                child: Some(child),
            });
        }
        for n in &mut cluster.nodes {
            let child = n.child.as_mut().ok_or("no child")?;
            if !wait_ping(child, n.port, Duration::from_secs(5)) {
                return Err(format!("node {} did not start", n.port));
            }
        }
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli must be installed (the Redis tests never skip)");
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
            ));
        }
        if !eventually_blocking(Duration::from_secs(20), || cluster.is_healthy()) {
            return Err("cluster did not become healthy in 20 s".into());
        }
        Ok(cluster)
    }

    fn node_args(port: u16) -> Vec<String> {
        [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            &format!("nodes-{port}.conf"),
            "--cluster-node-timeout",
            "2000",
            // A replica may always take over, however long its link was down.
            "--cluster-replica-validity-factor",
            "0",
            // A shard that is down (master and replica) leaves the others serving: the
            // per-shard failure tests freeze one whole shard.
            "--cluster-require-full-coverage",
            "no",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
    }

    /// Every live node says `cluster_state:ok` with 16384 slots ok, and every replica's
    /// master link is up.
    fn is_healthy(&self) -> bool {
        self.live_ports().iter().all(|&p| {
            let info = redis_cli(p, &["CLUSTER", "INFO"]);
            if !(info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")) {
                return false;
            }
            let repl = redis_cli(p, &["INFO", "replication"]);
            !repl.contains("role:slave") || repl.contains("master_link_status:up")
        })
    }

    /// Ports of the nodes that were not killed.
    fn live_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| n.port)
            .collect()
    }

    /// Make the node at `port` announce `via` as its client port (a proxy in front of it), and
    /// wait until every live node's slot map says so: clients then reach it only through `via`.
    pub fn announce_via(&self, port: u16, via: u16) {
        let bus = (port + 10000).to_string();
        redis_cli(port, &["CONFIG", "SET", "cluster-announce-bus-port", &bus]);
        redis_cli(port, &["CONFIG", "SET", "cluster-announce-port", &via.to_string()]);
        let needle = format!("127.0.0.1:{via}@");
        let seen = eventually_blocking(Duration::from_secs(15), || {
            self.live_ports()
                .iter()
                .all(|&p| redis_cli(p, &["CLUSTER", "NODES"]).contains(&needle))
        });
        assert!(seen, "the cluster never announced {port} as {via}");
    }

    /// `redis://127.0.0.1:<port>/` for every node (the store's seed list).
    pub fn seed_urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}/", n.port))
            .collect()
    }

    /// Parsed `CLUSTER NODES` as seen by a live, responsive node.
    fn topology(&self) -> Vec<NodeInfo> {
        for p in self.live_ports() {
            if raw_command(p, "PING", Duration::from_millis(100)).as_deref() != Some("+PONG") {
                continue; // stopped (SIGSTOP) nodes do not answer
            }
            let text = redis_cli(p, &["CLUSTER", "NODES"]);
            if text.is_empty() {
                continue;
            }
            return text.lines().filter_map(parse_node_line).collect();
        }
        Vec::new()
    }

    /// Ports of the current masters (not failed).
    pub fn masters(&self) -> Vec<u16> {
        let mut m: Vec<u16> = self
            .topology()
            .into_iter()
            .filter(|n| n.master && !n.slots.is_empty())
            .map(|n| n.port)
            .collect();
        m.sort_unstable();
        m
    }

    /// The slot of `key` (`CLUSTER KEYSLOT`).
    pub fn keyslot(&self, key: &str) -> u16 {
        let p = *self.live_ports().first().expect("a live node");
        redis_cli(p, &["CLUSTER", "KEYSLOT", key])
            .parse()
            .expect("CLUSTER KEYSLOT reply")
    }

    /// The port of the master serving `slot`, per the first responsive node's view.
    fn master_for_slot(&self, slot: u16) -> Option<u16> {
        self.topology()
            .into_iter()
            .find(|n| n.master && n.slots.iter().any(|&(a, b)| a <= slot && slot <= b))
            .map(|n| n.port)
    }

    /// The first slot master `port` serves (one `CLUSTER NODES` call; prefer this to scanning
    /// `master_for_slot` over all 16384 slots, which runs redis-cli once per slot).
    pub fn first_slot_of(&self, port: u16) -> Option<u16> {
        self.topology()
            .into_iter()
            .find(|n| n.port == port && n.master)
            .and_then(|n| n.slots.first().map(|&(a, _)| a))
    }

    /// The port of the master serving `key`.
    pub fn master_for_key(&self, key: &str) -> u16 {
        let slot = self.keyslot(key);
        self.master_for_slot(slot)
            .unwrap_or_else(|| panic!("no master serves slot {slot}"))
    }

    /// A hash tag (the part inside `{}`) whose slot is served by master `port`, built from
    /// `base` plus a counter.
    pub fn tag_on(&self, port: u16, base: &str) -> String {
        for i in 0..10_000 {
            let tag = format!("{base}{i}");
            if self.master_for_key(&format!("{{{tag}}}")) == port {
                return tag;
            }
        }
        panic!("no tag for master {port}");
    }

    /// Ports of the replicas of master `port`.
    pub fn replicas_of(&self, port: u16) -> Vec<u16> {
        let nodes = self.topology();
        let Some(id) = nodes.iter().find(|n| n.port == port).map(|n| n.id.clone()) else {
            return Vec::new();
        };
        nodes
            .iter()
            .filter(|n| n.master_id.as_deref() == Some(id.as_str()))
            .map(|n| n.port)
            .collect()
    }

    /// The node id of `port` (`CLUSTER MYID`).
    fn node_id(&self, port: u16) -> String {
        redis_cli(port, &["CLUSTER", "MYID"])
    }

    /// Move `slot` (and its keys) from master `from` to master `to`, the way resharding does
    /// (IMPORTING / MIGRATING / MIGRATE / SETSLOT NODE). Clients holding the old slot map get
    /// `MOVED` afterwards.
    pub fn move_slot(&self, slot: u16, from: u16, to: u16) {
        let s = slot.to_string();
        let (from_id, to_id) = (self.node_id(from), self.node_id(to));
        assert_eq!(redis_cli(to, &["CLUSTER", "SETSLOT", &s, "IMPORTING", &from_id]), "OK");
        assert_eq!(redis_cli(from, &["CLUSTER", "SETSLOT", &s, "MIGRATING", &to_id]), "OK");
        loop {
            let keys = redis_cli(from, &["CLUSTER", "GETKEYSINSLOT", &s, "100"]);
            if keys.is_empty() {
                break;
            }
            let to_port = to.to_string();
            let mut args = vec!["MIGRATE", "127.0.0.1", &to_port, "", "0", "5000", "KEYS"];
            args.extend(keys.lines());
            assert_eq!(redis_cli(from, &args), "OK");
        }
        for p in self.masters() {
            redis_cli(p, &["CLUSTER", "SETSLOT", &s, "NODE", &to_id]);
        }
        // Both sides agree before returning.
        let moved = eventually_blocking(Duration::from_secs(5), || self.master_for_slot(slot) == Some(to));
        assert!(moved, "slot {slot} did not move to {to}");
    }

    /// Run redis-cli on `SCRIPT FLUSH` for every live node.
    pub fn script_flush_all(&self) {
        for p in self.live_ports() {
            redis_cli(p, &["SCRIPT", "FLUSH"]);
        }
    }

    /// `FUNCTION FLUSH` on every master (a replica refuses it, and gets its master's flush by
    /// replication).
    pub fn function_flush_all(&self) {
        for p in self.masters() {
            assert_eq!(redis_cli(p, &["FUNCTION", "FLUSH"]), "OK", "FUNCTION FLUSH on {p}");
        }
    }

    fn node(&mut self, port: u16) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("no node on port {port}"))
    }

    /// SIGKILL node `port`.
    pub fn kill_node(&mut self, port: u16) {
        if let Some(mut c) = self.node(port).child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP node `port` (frozen with its sockets open).
    pub fn stop_node(&mut self, port: u16) {
        if let Some(c) = &self.node(port).child {
            signal(c.id(), "STOP");
        }
    }

    /// SIGCONT node `port`.
    pub fn cont_node(&mut self, port: u16) {
        if let Some(c) = &self.node(port).child {
            signal(c.id(), "CONT");
        }
    }

    /// Wait until `slot` is served by a master other than `old` (a replica took over) and the
    /// surviving nodes report `cluster_state:ok`. Returns the new master's port.
    pub fn wait_failover(&self, slot: u16, old: u16, timeout: Duration) -> Option<u16> {
        eventually_some_blocking(timeout, || {
            let m = self.master_for_slot(slot)?;
            if m == old {
                return None;
            }
            let ok = self
                .live_ports()
                .into_iter()
                .filter(|&p| p != old)
                .all(|p| redis_cli(p, &["CLUSTER", "INFO"]).contains("cluster_state:ok"));
            ok.then_some(m)
        })
    }
}

/// One line of `CLUSTER NODES`.
struct NodeInfo {
    /// Node id.
    id: String,
    /// The id of its master, for a replica.
    master_id: Option<String>,
    /// Client port.
    port: u16,
    /// A master not flagged `fail`.
    master: bool,
    /// Slot ranges it serves (inclusive).
    slots: Vec<(u16, u16)>,
}

/// Parse one `CLUSTER NODES` line.
fn parse_node_line(line: &str) -> Option<NodeInfo> {
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() < 8 {
        return None;
    }
    // addr is ip:port@busport
    let port: u16 = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
    let flags = f[2];
    let master = flags.contains("master") && !flags.contains("fail");
    let slots = f[8..]
        .iter()
        .filter(|s| !s.starts_with('['))
        .filter_map(|s| match s.split_once('-') {
            Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
            None => s.parse().ok().map(|v| (v, v)),
        })
        .collect();
    let master_id = (f[3] != "-").then(|| f[3].to_owned());
    Some(NodeInfo {
        id: f[0].to_owned(),
        master_id,
        port,
        master,
        slots,
    })
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
