//! The docker-compose stack for real: the repository's `Dockerfile` and `docker-compose.yml`
//! built and run by a real Docker engine (`docker-compose up`), then broken across hosts: a
//! killed Redis master, a gateway cut off from the Redis network, a frozen master, a rolling
//! restart under load, a hot reload from the host, the logs.
//!
//! Needs Docker (a running engine and `docker-compose`, or `docker compose`); without it the
//! test fails. Nothing is pulled: `scripts/compose-images` first makes the base images the files
//! name (from Debian's packages) when the engine lacks them, and the `cargo vendor` directory the
//! image build reads its crates from (a build container here cannot reach crates.io).
//!
//! The stack runs as compose project `tollgate-stack-test-<pid>`, with its config directory a
//! copy of `config/` (plus test API keys in `keys.yaml`; the rules are the shipped ones) and its
//! published ports on free loopback ports; it is torn down at the end, pass or fail.
//!
//! Every limit asserted exactly is the shipped `export` rule: a token bucket of 50 units, 10 a
//! call, refilled at 1 unit/s, so a fresh caller gets exactly 5 calls in a burst, whichever
//! gateway serves them (cost 10 is more than a lease may hold, so no gateway decides it alone;
//! docs/leases.md).

mod support;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use support::*;

const REPO: &str = env!("CARGO_MANIFEST_DIR");
/// The shipped `export` rule (config/rules.yaml): calls a fresh caller gets in a burst.
const EXPORT_BURST: usize = 5;
const EXPORT_PATH: &str = "/api/v1/reports/1/export";
/// How long a killed master's shard may take to be exact again (cluster-node-timeout 5 s, the
/// replica's election, the gateways' breaker probe re-reading the slot map).
const FAILOVER_WITHIN: Duration = Duration::from_secs(30);
/// How long a gateway reconnected to the Redis network may take to be exact again.
const RECONNECT_WITHIN: Duration = Duration::from_secs(20);

fn compose_cmd() -> Vec<String> {
    let works = |prog: &str, args: &[&str]| Command::new(prog).args(args).output().is_ok_and(|o| o.status.success());
    if works("docker-compose", &["version"]) {
        vec!["docker-compose".into()]
    } else if works("docker", &["compose", "version"]) {
        vec!["docker".into(), "compose".into()]
    } else {
        panic!("this test needs Docker Compose: neither `docker-compose` nor `docker compose` runs")
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `docker ARGS`, stdout; panics with the output when it fails.
fn docker(args: &[&str]) -> String {
    let o = Command::new("docker")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("docker {args:?}: {e}"));
    assert!(o.status.success(), "docker {args:?} failed:\n{}", text(&o));
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

/// Stacks of earlier runs of this test whose process is gone (killed before its guard ran):
/// their networks would clash with this run's fixed subnets.
fn remove_stale_stacks(compose: &[String]) {
    let out = docker(&[
        "ps",
        "-a",
        "--filter",
        "label=com.docker.compose.project",
        "--format",
        "{{.Label \"com.docker.compose.project\"}}",
    ]);
    let nets = docker(&[
        "network",
        "ls",
        "--filter",
        "label=com.docker.compose.project",
        "--format",
        "{{.Label \"com.docker.compose.project\"}}",
    ]);
    let mut projects: Vec<&str> = out.lines().chain(nets.lines()).collect();
    projects.sort();
    projects.dedup();
    for p in projects {
        let Some(pid) = p.strip_prefix("tollgate-stack-test-") else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        eprintln!("compose_stack: removing the stale stack {p}");
        let _ = Command::new(&compose[0])
            .args(&compose[1..])
            .args([
                "-p",
                p,
                "-f",
                &format!("{REPO}/docker-compose.yml"),
                "down",
                "-v",
                "-t",
                "1",
            ])
            .env("TOLLGATE_ADMIN_TOKEN", "stale")
            .output();
    }
}

/// A Redis master that serves slots: its node number (redis-N) and slot ranges.
struct Master {
    node: usize,
    slots: Vec<(u16, u16)>,
}

/// The running stack; `docker-compose down` on drop (after printing the logs when the test
/// failed).
struct Stack {
    compose: Vec<String>,
    project: String,
    env: Vec<(String, String)>,
    config: tempfile::TempDir,
    /// `http://127.0.0.1:port` of tollgate-1 and tollgate-2: proxy, admin.
    proxy: [String; 2],
    admin: [String; 2],
    prometheus: String,
}

impl Stack {
    fn run(&self, args: &[&str]) -> Output {
        Command::new(&self.compose[0])
            .args(&self.compose[1..])
            .args(["-p", &self.project, "-f", &format!("{REPO}/docker-compose.yml")])
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env_remove("DOCKER_BUILDKIT")
            .current_dir(REPO)
            .output()
            .unwrap_or_else(|e| panic!("{:?} {args:?}: {e}", self.compose))
    }

    /// `docker-compose ARGS`, stdout; panics with the output when it fails.
    fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(o.status.success(), "docker-compose {args:?} failed:\n{}", text(&o));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    /// The container id of `service`.
    fn container(&self, service: &str) -> String {
        let id = self.ok(&["ps", "-q", service]);
        assert!(!id.is_empty(), "no container for {service}");
        id
    }

    /// `redis-cli ARGS` in the first Redis container that runs (not killed, not paused).
    fn redis_cli(&self, args: &[&str]) -> String {
        for n in 1..=6 {
            let c = self.container(&format!("redis-{n}"));
            let mut a = vec!["exec", c.as_str(), "redis-cli", "-h", "127.0.0.1"];
            a.extend_from_slice(args);
            if let Ok(o) = Command::new("docker").args(&a).output() {
                if o.status.success() {
                    return String::from_utf8_lossy(&o.stdout).to_string();
                }
            }
        }
        panic!("no Redis container answers redis-cli {args:?}")
    }

    /// The masters that serve slots.
    fn masters(&self) -> Vec<Master> {
        let nodes = self.redis_cli(&["cluster", "nodes"]);
        let mut out = vec![];
        for line in nodes.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
                continue;
            }
            let ip = f[1].split(':').next().unwrap_or("").to_string();
            let n: usize = ip
                .rsplit('.')
                .next()
                .and_then(|s| s.parse().ok())
                .map_or(0, |x: usize| x - 10);
            let ranges = f[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .map(|s| {
                    let (a, b) = s.split_once('-').unwrap_or((s, s));
                    (a.parse().unwrap(), b.parse().unwrap())
                })
                .collect::<Vec<(u16, u16)>>();
            if !ranges.is_empty() {
                out.push(Master { node: n, slots: ranges });
            }
        }
        out
    }

    /// The Redis node number (1..=6) serving `slot` now.
    fn node_of_slot(&self, slot: u16) -> usize {
        self.masters()
            .into_iter()
            .find(|m| m.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
            .map(|m| m.node)
            .unwrap_or_else(|| {
                panic!(
                    "no master serves slot {slot}:\n{}",
                    self.redis_cli(&["cluster", "nodes"])
                )
            })
    }

    fn cluster_ok(&self) -> bool {
        self.redis_cli(&["cluster", "info"]).contains("cluster_state:ok") && self.masters().len() == 3
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let o = self.run(&["ps"]);
            eprintln!("---- docker-compose ps\n{}", text(&o));
            let o = self.run(&["logs", "--no-color", "--tail", "40"]);
            eprintln!("---- docker-compose logs --tail 40\n{}", text(&o));
        }
        let o = self.run(&["down", "-v", "--remove-orphans", "-t", "10"]);
        if !o.status.success() {
            eprintln!("docker-compose down failed:\n{}", text(&o));
        }
    }
}

/// Redis Cluster's key slot (CRC16/XMODEM of the hash tag, mod 16384).
fn key_slot(key: &str) -> u16 {
    let k = key.as_bytes();
    let tag = match k.iter().position(|&b| b == b'{') {
        Some(s) => match k[s + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &k[s + 1..s + 1 + len],
            _ => k,
        },
        None => k,
    };
    let mut crc: u16 = 0;
    for &b in tag {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

fn sha256_hex(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A test caller: an API key (free tier, its own org) and the slot of its counters.
#[derive(Clone)]
struct Caller {
    key: String,
    slot: u16,
}

/// Fresh callers, each used for one exact count.
struct Callers(Mutex<Vec<Caller>>);

impl Callers {
    /// A fresh caller whose counters live on Redis node `node` (or anywhere).
    fn take(&self, stack: &Stack, node: Option<usize>) -> Caller {
        let mut v = self.0.lock().unwrap();
        let i = match node {
            None => 0,
            Some(n) => v
                .iter()
                .position(|c| stack.node_of_slot(c.slot) == n)
                .unwrap_or_else(|| panic!("no fresh test caller left on redis-{n}")),
        };
        v.remove(i)
    }
}

/// GET `path` as `key` (None: anonymous) through gateway `gw` (0 or 1); the status, or the
/// transport error.
async fn get(c: &reqwest::Client, stack: &Stack, gw: usize, path: &str, key: Option<&str>) -> Result<u16, String> {
    let mut r = c
        .get(format!("{}{path}", stack.proxy[gw]))
        .timeout(Duration::from_secs(10));
    if let Some(k) = key {
        r = r.header("x-api-key", k);
    }
    r.send()
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| format!("{e:?}"))
}

/// `n` calls of the `export` rule as `caller`, through the gateways in `gws` in turn; the
/// statuses, counted.
async fn burst(c: &reqwest::Client, stack: &Stack, gws: &[usize], caller: &Caller, n: usize) -> BTreeMap<u16, usize> {
    let mut seen = BTreeMap::new();
    for i in 0..n {
        let s = get(c, stack, gws[i % gws.len()], EXPORT_PATH, Some(&caller.key))
            .await
            .unwrap_or_else(|e| panic!("export call {i} through tollgate-{}: {e}", gws[i % gws.len()] + 1));
        *seen.entry(s).or_default() += 1;
    }
    seen
}

fn admitted(seen: &BTreeMap<u16, usize>) -> usize {
    seen.get(&200).copied().unwrap_or(0)
}

/// The `store_key`s `/explain` shows for the chosen rule `rule`.
fn store_keys(explain: &serde_json::Value, rule: &str, out: &mut Vec<String>) {
    match explain {
        serde_json::Value::Object(m) => {
            if m.get("rule").and_then(|r| r.as_str()) == Some(rule) {
                if let Some(ls) = m.get("limits").and_then(|l| l.as_array()) {
                    out.extend(ls.iter().filter_map(|l| l["store_key"].as_str().map(String::from)));
                }
            }
            m.values().for_each(|v| store_keys(v, rule, out));
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| store_keys(v, rule, out)),
        _ => {}
    }
}

/// Polls, one attempt a second, until a fresh caller (on Redis node `node`, when given) gets
/// exactly [`EXPORT_BURST`] of 8 calls across both gateways: the time that took, or `None` after
/// `within`; and what the attempts that were not exact saw.
async fn exact_again(
    c: &reqwest::Client,
    stack: &Stack,
    callers: &Callers,
    node: Option<usize>,
    within: Duration,
) -> (Option<Duration>, Vec<BTreeMap<u16, usize>>) {
    let t = Instant::now();
    let last = std::cell::Cell::new(None::<Instant>);
    let misses = std::cell::RefCell::new(vec![]);
    let (lr, mr) = (&last, &misses);
    let hit = eventually_some(within, || async move {
        if lr.get().is_some_and(|l| l.elapsed() < Duration::from_secs(1)) {
            return None;
        }
        lr.set(Some(Instant::now()));
        let s = burst(c, stack, &[0, 1], &callers.take(stack, node), 8).await;
        if admitted(&s) == EXPORT_BURST && s.get(&429) == Some(&(8 - EXPORT_BURST)) {
            Some(t.elapsed())
        } else {
            mr.borrow_mut().push(s);
            None
        }
    })
    .await;
    (hit, misses.into_inner())
}

/// The sum of `tollgate_store_errors_total` (every kind) on the admin listener `admin`.
async fn store_errors(c: &reqwest::Client, admin: &str) -> f64 {
    get_text(c, format!("{admin}/metrics"))
        .await
        .lines()
        .filter(|l| l.starts_with("tollgate_store_errors_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn ready_store(c: &reqwest::Client, admin: &str) -> bool {
    c.get(format!("{admin}/readyz?store=1"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .is_ok_and(|r| r.status() == 200)
}

async fn ready(c: &reqwest::Client, admin: &str) -> bool {
    c.get(format!("{admin}/readyz"))
        .timeout(Duration::from_millis(500))
        .send()
        .await
        .is_ok_and(|r| r.status() == 200)
}

/// Copies `config/` to a temp dir the containers' user (uid 10001) can read, with test API keys
/// added to keys.yaml.
fn config_copy(free: &[String], pro: &[String]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["gateway.cluster.yaml", "rules.yaml", "keys.yaml"] {
        std::fs::copy(Path::new(REPO).join("config").join(f), dir.path().join(f)).unwrap();
    }
    let shipped = std::fs::read_to_string(dir.path().join("keys.yaml")).unwrap();
    // The shipped free key's hash, as keys.yaml stores it: the test's keys are hashed the same way.
    assert!(
        shipped.contains(&sha256_hex("globex-free-0c1d2e3f")),
        "keys.yaml hashes keys with SHA-256"
    );
    let mut keys = shipped.trim_end().to_string();
    keys.push_str("\n  # added by tests/compose_stack.rs\n");
    for (i, k) in free.iter().enumerate() {
        keys.push_str(&format!(
            "  - {{ id: compose_free_{i}, sha256: {}, tier: free, org: compose_org_{i} }}\n",
            sha256_hex(k)
        ));
    }
    for (i, k) in pro.iter().enumerate() {
        keys.push_str(&format!(
            "  - {{ id: compose_pro_{i}, sha256: {}, tier: pro, org: compose_pro_org_{i} }}\n",
            sha256_hex(k)
        ));
    }
    std::fs::write(dir.path().join("keys.yaml"), keys).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    for f in ["gateway.cluster.yaml", "rules.yaml", "keys.yaml"] {
        std::fs::set_permissions(dir.path().join(f), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    dir
}

/// A balancer in front of both gateways, as an operator would run one: it sends a request only
/// to a gateway whose `/readyz` answered 200 at its last check (every 100 ms), and it retries
/// nothing. Counts what its clients see.
#[derive(Default)]
struct Load {
    stop: AtomicBool,
    in_rotation: [AtomicBool; 2],
    served: [AtomicU64; 2],
    limited: AtomicU64,
    failed: Mutex<Vec<String>>,
}

async fn run_load(load: Arc<Load>, proxy: [String; 2], admin: [String; 2], key: String, workers: usize) {
    let health = {
        let load = load.clone();
        tokio::spawn(async move {
            let c = reqwest::Client::new();
            while !load.stop.load(Ordering::Relaxed) {
                for (i, a) in admin.iter().enumerate() {
                    load.in_rotation[i].store(ready(&c, a).await, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let mut tasks = vec![];
    for w in 0..workers {
        let (load, proxy, key) = (load.clone(), proxy.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let c = client();
            let mut n = w;
            while !load.stop.load(Ordering::Relaxed) {
                n += 1;
                let gw = if load.in_rotation[n % 2].load(Ordering::Relaxed) {
                    n % 2
                } else {
                    (n + 1) % 2
                };
                if !load.in_rotation[gw].load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                let r = c
                    .get(format!("{}/anything/{n}", proxy[gw]))
                    .header("x-api-key", &key)
                    .timeout(Duration::from_secs(10))
                    .send()
                    .await;
                match r.map(|r| r.status().as_u16()) {
                    Ok(200) => {
                        load.served[gw].fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(429) => {
                        load.limited.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(s) => load
                        .failed
                        .lock()
                        .unwrap()
                        .push(format!("tollgate-{}: status {s}", gw + 1)),
                    Err(e) => load.failed.lock().unwrap().push(format!("tollgate-{}: {e:?}", gw + 1)),
                }
                // ~15 requests/s per worker: well under the shipped any-per-ip limit (3000/min)
                tokio::time::sleep(Duration::from_millis(60)).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    health.await.unwrap();
}

fn step(t0: Instant, what: &str) {
    eprintln!("compose_stack: [{:>5.1} s] {what}", t0.elapsed().as_secs_f64());
}

#[test]
fn the_compose_stack_builds_runs_and_survives_faults_between_hosts() {
    let t0 = Instant::now();
    // Docker is required: no engine, no pass.
    let info = Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output();
    match &info {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "this test needs a running Docker engine: `docker info` failed:\n{}",
            text(o)
        ),
        Err(e) => panic!("this test needs Docker: `docker` cannot run: {e}"),
    }
    let compose = compose_cmd();
    remove_stale_stacks(&compose);

    // 1. The base images the files name (made from Debian's packages when missing), and the
    //    vendored crates.
    let o = Command::new(format!("{REPO}/scripts/compose-images"))
        .current_dir(REPO)
        .output()
        .unwrap();
    assert!(o.status.success(), "scripts/compose-images failed:\n{}", text(&o));
    step(t0, "base images ready (scripts/compose-images)");

    let free_keys: Vec<String> = (0..100)
        .map(|i| format!("compose-free-{i}-{:08x}", rand::random::<u32>()))
        .collect();
    let pro_keys: Vec<String> = (0..2)
        .map(|i| format!("compose-pro-{i}-{:08x}", rand::random::<u32>()))
        .collect();
    let config = config_copy(&free_keys, &pro_keys);
    let token = format!(
        "compose-test-{:016x}{:016x}",
        rand::random::<u64>(),
        rand::random::<u64>()
    );
    let ports: Vec<u16> = (0..5).map(|_| free_port()).collect();
    let env: Vec<(String, String)> = [
        ("TOLLGATE_ADMIN_TOKEN", token.clone()),
        ("TOLLGATE_CONFIG_DIR", config.path().display().to_string()),
        ("CARGO_VENDOR_DIR", "target/compose-cache/vendor".to_string()),
        ("TOLLGATE_1_PORT", ports[0].to_string()),
        ("TOLLGATE_1_ADMIN_PORT", ports[1].to_string()),
        ("TOLLGATE_2_PORT", ports[2].to_string()),
        ("TOLLGATE_2_ADMIN_PORT", ports[3].to_string()),
        ("PROMETHEUS_PORT", ports[4].to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let url = |p: u16| format!("http://127.0.0.1:{p}");
    let stack = Stack {
        compose,
        project: format!("tollgate-stack-test-{}", std::process::id()),
        env,
        config,
        proxy: [url(ports[0]), url(ports[2])],
        admin: [url(ports[1]), url(ports[3])],
        prometheus: url(ports[4]),
    };

    // 2. The image: the repository's Dockerfile, as docker-compose.yml builds it.
    stack.ok(&["build"]);
    step(t0, "docker-compose build");
    let size: f64 = docker(&["image", "inspect", "-f", "{{.Size}}", "tollgate:local"])
        .parse()
        .unwrap();
    eprintln!("compose_stack: image tollgate:local is {:.1} MB", size / 1e6);
    assert!(size < 250e6, "tollgate:local is {:.0} MB", size / 1e6);
    assert_eq!(
        docker(&["image", "inspect", "-f", "{{.Config.User}}", "tollgate:local"]),
        "10001:10001"
    );

    // 3. The whole stack: six Redis nodes, the one-shot cluster init, two upstreams, two
    //    gateways, Prometheus.
    stack.ok(&["up", "-d"]);
    step(t0, "docker-compose up -d");
    let init = stack.ok(&["ps", "-a", "-q", "redis-cluster-init"]);
    assert_eq!(
        docker(&["inspect", "-f", "{{.State.ExitCode}}", &init]),
        "0",
        "redis-cluster-init failed"
    );
    let services = stack.ok(&["ps", "--services", "--filter", "status=running"]);
    for s in [
        "redis-1",
        "redis-2",
        "redis-3",
        "redis-4",
        "redis-5",
        "redis-6",
        "upstream",
        "upstream-2",
        "tollgate-1",
        "tollgate-2",
        "prometheus",
    ] {
        assert!(services.lines().any(|l| l == s), "{s} is not running: {services}");
    }
    assert!(
        stack.cluster_ok(),
        "the cluster is not ok:\n{}",
        stack.redis_cli(&["cluster", "nodes"])
    );

    let rt = tokio::runtime::Runtime::new().unwrap();
    let c = client();
    let tg = [stack.container("tollgate-1"), stack.container("tollgate-2")];
    rt.block_on(async {
        for (i, a) in stack.admin.iter().enumerate() {
            assert!(
                eventually(Duration::from_secs(30), || ready_store(&c, a)).await,
                "tollgate-{} not ready with its store",
                i + 1
            );
        }
    });
    // Non-root, and Docker's own HEALTHCHECK (curl /healthz inside the container) passes.
    for (i, id) in tg.iter().enumerate() {
        assert_eq!(docker(&["exec", id, "id", "-u"]), "10001", "tollgate-{} runs as", i + 1);
        let healthy = eventually_blocking(Duration::from_secs(60), || {
            docker(&["inspect", "-f", "{{.State.Health.Status}}", id]) == "healthy"
        });
        assert!(
            healthy,
            "tollgate-{} HEALTHCHECK: {}",
            i + 1,
            docker(&["inspect", "-f", "{{json .State.Health}}", id])
        );
    }
    step(t0, "both gateways ready and healthy (HEALTHCHECK), non-root");

    // Each caller's slot, from /explain (the store keys a request of theirs would use).
    let mut callers = vec![];
    let mut first_key = String::new();
    rt.block_on(async {
        for k in &free_keys {
            let v = c
                .get(format!("{}/explain?method=GET&path={EXPORT_PATH}", stack.admin[0]))
                .bearer_auth(&token)
                .header("x-api-key", k)
                .send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap();
            let mut keys = vec![];
            store_keys(&v, "export", &mut keys);
            assert_eq!(keys.len(), 1, "/explain shows one store key for export: {v}");
            if first_key.is_empty() {
                first_key = keys[0].clone();
            }
            callers.push(Caller {
                key: k.clone(),
                slot: key_slot(&keys[0]),
            });
        }
    });
    // the slot computed here is Redis's own
    assert_eq!(
        key_slot(&first_key),
        stack
            .redis_cli(&["cluster", "keyslot", &first_key])
            .trim()
            .parse::<u16>()
            .unwrap(),
        "{first_key}"
    );
    let callers = Callers(Mutex::new(callers));

    // 4. Each gateway answers, and the two share one count.
    rt.block_on(async {
        for gw in 0..2 {
            let r = c
                .get(format!("{}/anything", stack.proxy[gw]))
                .header("x-api-key", &free_keys[0])
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "tollgate-{} proxies", gw + 1);
            let body: serde_json::Value = r.json().await.unwrap();
            assert_eq!(body["path"], "/anything", "the echo upstream answered: {body}");
        }
        let who = callers.take(&stack, None);
        let seen = burst(&c, &stack, &[0, 1], &who, 12).await;
        assert_eq!(admitted(&seen), EXPORT_BURST, "two gateways, one count: {seen:?}");
        assert_eq!(seen.get(&429), Some(&(12 - EXPORT_BURST)), "{seen:?}");
        // Anonymous callers: `anonymous-per-ip`, 60 a minute per IP, across both gateways.
        let mut ok = 0;
        for i in 0..70 {
            if get(&c, &stack, i % 2, "/api/v1/search", None).await.unwrap() == 200 {
                ok += 1;
            }
        }
        assert!(
            (54..=60).contains(&ok),
            "anonymous per IP across two gateways: {ok} of 70 admitted, limit 60"
        );
        eprintln!("compose_stack: anonymous-per-ip across both gateways admitted {ok} of 70 (limit 60)");
    });
    // Prometheus scrapes both gateways.
    rt.block_on(async {
        let up = eventually(Duration::from_secs(30), || async {
            let Ok(r) = c.get(format!("{}/api/v1/targets", stack.prometheus)).send().await else {
                return false;
            };
            let Ok(v) = r.json::<serde_json::Value>().await else {
                return false;
            };
            let t = v["data"]["activeTargets"].as_array().cloned().unwrap_or_default();
            t.len() == 2 && t.iter().all(|t| t["health"] == "up")
        })
        .await;
        assert!(up, "Prometheus does not scrape both gateways");
    });
    step(t0, "both gateways answer, one shared count; Prometheus scrapes both");

    // 5. `docker pause` of one master (frozen, TCP open): only that shard's limits fail open.
    rt.block_on(async {
        let masters = stack.masters();
        let frozen_node = masters[0].node;
        let other_node = masters[1].node;
        let on_frozen = callers.take(&stack, Some(frozen_node));
        let elsewhere = callers.take(&stack, Some(other_node));
        let frozen = stack.container(&format!("redis-{frozen_node}"));
        docker(&["pause", &frozen]);
        let t = Instant::now();
        let a = burst(&c, &stack, &[0, 1], &on_frozen, 8).await;
        let b = burst(&c, &stack, &[0, 1], &elsewhere, 8).await;
        let took = t.elapsed();
        docker(&["unpause", &frozen]);
        assert!(took < Duration::from_secs(4), "the checks took {took:?}: the replica may have taken over");
        assert_eq!(admitted(&a), 8, "a caller on the frozen redis-{frozen_node}: export fails open: {a:?}");
        assert_eq!(admitted(&b), EXPORT_BURST, "a caller on redis-{other_node}: still exact: {b:?}");
        assert!(eventually_blocking(Duration::from_secs(30), || stack.cluster_ok()), "cluster not ok after the pause");
        let node = stack.node_of_slot(on_frozen.slot);
        let (hit, misses) = exact_again(&c, &stack, &callers, Some(node), Duration::from_secs(30)).await;
        let Some(after) = hit else { panic!("redis-{frozen_node}'s shard not exact 30 s after unpausing: {misses:?}") };
        eprintln!(
            "compose_stack: paused redis-{frozen_node} for {:.1} s: its callers 8 of 8 admitted, redis-{other_node}'s exactly {EXPORT_BURST}; exact again {:.1} s after unpausing (not exact before: {misses:?})",
            took.as_secs_f64(),
            after.as_secs_f64()
        );
    });
    step(
        t0,
        "docker pause of a master: only its shard failed open; exact again after unpause",
    );

    // 6. `docker kill` of a master: its replica takes over, exact again within FAILOVER_WITHIN.
    rt.block_on(async {
        let victim = callers.take(&stack, None);
        let node = stack.node_of_slot(victim.slot);
        let killed = stack.container(&format!("redis-{node}"));
        docker(&["kill", &killed]);
        let t = Instant::now();
        let promoted = eventually_some_blocking(FAILOVER_WITHIN, || {
            let n = stack.node_of_slot_opt(victim.slot)?;
            (n != node && stack.cluster_ok()).then_some(n)
        });
        let Some(new_node) = promoted else { panic!("no replica took over redis-{node}'s slots within {FAILOVER_WITHIN:?}") };
        let promoted_after = t.elapsed();
        let (hit, misses) = exact_again(&c, &stack, &callers, Some(new_node), FAILOVER_WITHIN.saturating_sub(t.elapsed())).await;
        assert!(hit.is_some(), "redis-{new_node} (the promoted replica) not exact {FAILOVER_WITHIN:?} after killing redis-{node}: {misses:?}");
        let recovered = t.elapsed();
        eprintln!(
            "compose_stack: killed redis-{node}: redis-{new_node} promoted after {:.1} s, limits exact again after {:.1} s (stated: {} s; not exact before: {misses:?})",
            promoted_after.as_secs_f64(),
            recovered.as_secs_f64(),
            FAILOVER_WITHIN.as_secs()
        );
        // The killed node comes back as a replica.
        docker(&["start", &killed]);
        assert!(
            eventually_blocking(Duration::from_secs(30), || stack.cluster_ok()
                && stack.redis_cli(&["cluster", "nodes"]).lines().filter(|l| l.contains("slave") && !l.contains("fail")).count() == 3),
            "redis-{node} did not rejoin as a replica:\n{}",
            stack.redis_cli(&["cluster", "nodes"])
        );
    });
    step(t0, "docker kill of a master: replica promoted, exact again");

    // 7. `docker network disconnect` of tollgate-1 from the Redis network: its rules follow their
    //    failure policies, tollgate-2 is unaffected, exact again after reconnecting.
    rt.block_on(async {
        let net = format!("{}_redis", stack.project);
        let errors_before = [store_errors(&c, &stack.admin[0]).await, store_errors(&c, &stack.admin[1]).await];
        docker(&["network", "disconnect", &net, &tg[0]]);
        let cut_at = Instant::now();
        // open (export): everything passes on tollgate-1
        let cut = burst(&c, &stack, &[0], &callers.take(&stack, None), 8).await;
        // tollgate-2, meanwhile: exact
        let fine = burst(&c, &stack, &[1], &callers.take(&stack, None), 8).await;
        // closed (login-per-ip): refused on tollgate-1 only
        let login = |gw: usize| {
            let c = c.clone();
            let url = format!("{}/api/v1/login", stack.proxy[gw]);
            async move { c.post(url).body("{}").send().await.unwrap().status().as_u16() }
        };
        let login_cut = login(0).await;
        let login_fine = login(1).await;
        // local (pro-user, local_share 3): tollgate-1 enforces a third of the bucket on its own
        let mut pro = BTreeMap::new();
        for _ in 0..150 {
            *pro.entry(get(&c, &stack, 0, "/api/v1/items", Some(&pro_keys[0])).await.unwrap()).or_insert(0usize) += 1;
        }
        let breaker: f64 = metric(&get_text(&c, format!("{}/metrics", stack.admin[0])).await, "tollgate_store_breaker_open")
            .map_or(-1.0, |v| v.parse().unwrap());
        let errors_during = [
            store_errors(&c, &stack.admin[0]).await - errors_before[0],
            store_errors(&c, &stack.admin[1]).await - errors_before[1],
        ];
        docker(&["network", "connect", "--ip", "172.30.46.41", &net, &tg[0]]);
        let cut_for = cut_at.elapsed();
        assert!(errors_during[0] > 0.0, "tollgate-1 counted no store failure while cut off");
        // The breaker gauge is read at the scrape: the shards tollgate-1 failed on show open.
        assert!(breaker >= 1.0, "tollgate-1 cut off: tollgate_store_breaker_open {breaker}, not at least 1");
        assert_eq!(errors_during[1], 0.0, "tollgate-2 counted store failures while tollgate-1 was cut off");
        assert_eq!(admitted(&cut), 8, "tollgate-1 cut off: export (failure: open) admits all: {cut:?}");
        assert_eq!(admitted(&fine), EXPORT_BURST, "tollgate-2 unaffected: {fine:?}");
        assert_eq!(login_cut, 503, "tollgate-1 cut off: login-per-ip (failure: closed) refuses");
        assert_eq!(login_fine, 200, "tollgate-2: login-per-ip admits");
        let pro_ok = pro.get(&200).copied().unwrap_or(0);
        assert!(
            (40..150).contains(&pro_ok),
            "tollgate-1 cut off: pro-user (failure: local, a third of 200 + refill) limits locally: {pro:?}"
        );
        eprintln!(
            "compose_stack: tollgate-1 cut off from Redis for {:.1} s: export 8/8, login 503, pro-user local {pro:?}, store failures counted {errors_during:?}, tollgate_store_breaker_open {breaker}",
            cut_for.as_secs_f64()
        );
        let (hit, misses) = exact_again(&c, &stack, &callers, None, RECONNECT_WITHIN).await;
        let Some(after) = hit else { panic!("not exact {RECONNECT_WITHIN:?} after reconnecting tollgate-1: {misses:?}") };
        eprintln!(
            "compose_stack: exact again {:.1} s after reconnecting tollgate-1 (stated: {} s; not exact before: {misses:?})",
            after.as_secs_f64(),
            RECONNECT_WITHIN.as_secs()
        );
    });
    step(
        t0,
        "network disconnect of tollgate-1: failure policies there, tollgate-2 exact; exact after reconnect",
    );

    // 8. An edit to rules.yaml on the host reloads in both containers.
    rt.block_on(async {
        let rules = stack.config.path().join("rules.yaml");
        let mut text = std::fs::read_to_string(&rules).unwrap();
        text.push_str(
            "\n  - name: compose-reload-probe        # added by tests/compose_stack.rs\n    match: { path: /compose/reload-probe }\n    key: user\n    limit: 3\n    window: 1m\n",
        );
        atomic_write(&rules, &text);
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&rules, std::fs::Permissions::from_mode(0o644)).unwrap();
        for (i, a) in stack.admin.iter().enumerate() {
            let seen = eventually(Duration::from_secs(15), || async {
                let r = c.get(format!("{a}/rules")).bearer_auth(&token).send().await;
                match r {
                    Ok(r) => r.text().await.is_ok_and(|t| t.contains("compose-reload-probe")),
                    Err(_) => false,
                }
            })
            .await;
            assert!(seen, "tollgate-{} did not reload rules.yaml", i + 1);
        }
        let who = callers.take(&stack, None);
        let mut ok = 0;
        for i in 0..6 {
            if get(&c, &stack, i % 2, "/compose/reload-probe", Some(&who.key)).await.unwrap() == 200 {
                ok += 1;
            }
        }
        assert_eq!(ok, 3, "the reloaded rule, limit 3, across both gateways");
    });
    step(
        t0,
        "rules.yaml edited on the host: both containers reloaded, the new rule shared",
    );

    // 9. A rolling restart under load, one gateway at a time: no request fails.
    let load = Arc::new(Load::default());
    let driver = rt.spawn(run_load(
        load.clone(),
        stack.proxy.clone(),
        stack.admin.clone(),
        free_keys[1].clone(),
        2,
    ));
    let wait_serving = |gw: usize, since: u64| {
        let load = load.clone();
        eventually_blocking(Duration::from_secs(60), move || {
            load.served[gw].load(Ordering::Relaxed) > since + 20
        })
    };
    assert!(
        wait_serving(0, 0) && wait_serving(1, 0),
        "the load does not reach both gateways"
    );
    let mut restarts = vec![];
    for (gw, service) in ["tollgate-1", "tollgate-2"].iter().enumerate() {
        let t = Instant::now();
        stack.ok(&["restart", service]);
        let took = t.elapsed();
        let before = load.served[gw].load(Ordering::Relaxed);
        assert!(
            wait_serving(gw, before),
            "{service} does not serve again after its restart"
        );
        restarts.push(format!("{service} restarted in {:.1} s", took.as_secs_f64()));
    }
    load.stop.store(true, Ordering::Relaxed);
    rt.block_on(driver).unwrap();
    let failed = load.failed.lock().unwrap().clone();
    let served = [
        load.served[0].load(Ordering::Relaxed),
        load.served[1].load(Ordering::Relaxed),
    ];
    eprintln!(
        "compose_stack: rolling restart ({}): served {served:?}, limited {}, failed {}",
        restarts.join(", "),
        load.limited.load(Ordering::Relaxed),
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "requests failed during the rolling restart: {failed:?}"
    );
    assert_eq!(
        load.limited.load(Ordering::Relaxed),
        0,
        "the load stays under its limits"
    );
    step(t0, "rolling restart under load: 0 failed requests");

    // 10. The logs: one JSON object per line, no secrets.
    let logs = stack.ok(&["logs", "--no-color", "--no-log-prefix", "tollgate-1"]);
    // (docker-compose v1 prints its own "Attaching to <container>" first)
    let lines: Vec<&str> = logs
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with("Attaching to "))
        .collect();
    assert!(lines.len() >= 3, "tollgate-1 logged {} lines", lines.len());
    let mut messages: HashMap<String, usize> = HashMap::new();
    for l in &lines {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"));
        assert!(v.is_object(), "not a JSON object: {l}");
        let m = v
            .get("fields")
            .and_then(|f| f.get("message"))
            .or_else(|| v.get("message"))
            .and_then(|m| m.as_str())
            .unwrap_or("");
        *messages.entry(m.chars().take(60).collect()).or_default() += 1;
    }
    assert!(!logs.contains(&token), "the admin token appears in the logs");
    assert!(!logs.contains(&free_keys[1]), "an API key appears in the logs");
    assert!(
        logs.to_lowercase().contains("reload"),
        "the reload is not in tollgate-1's logs: {messages:?}"
    );
    eprintln!("compose_stack: tollgate-1 logged {} JSON lines", lines.len());
    step(t0, "logs: JSON lines, no secrets");
}

impl Stack {
    fn node_of_slot_opt(&self, slot: u16) -> Option<usize> {
        self.masters()
            .into_iter()
            .find(|m| m.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
            .map(|m| m.node)
    }
}
