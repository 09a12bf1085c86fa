//! The gateway under test: the library on port 0 ([`TestGateway`], stopped on drop) or the real
//! `tollgate` binary ([`BinaryGateway`], killed on drop), the real echo upstream, and config
//! written to a temp dir.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tollgate::config::{EnvOverrides, GatewayConfig};
use tollgate::server::Running;

use super::free_port;
use super::poll::eventually_blocking;

/// A gateway (the library) serving on loopback, with its config directory. Dropping it sends
/// the shutdown signal, so its listeners, watcher and probe end even when a test panics;
/// [`TestGateway::stop`] also waits for the drain.
pub struct TestGateway {
    /// The running gateway.
    pub running: Running,
    /// The config directory (rules.yaml, keys.yaml, gateway.yaml).
    pub dir: tempfile::TempDir,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// `http://127.0.0.1:ADMIN_PORT`.
    pub admin: String,
}

impl TestGateway {
    /// Wrap a gateway started from a config in `dir`.
    pub fn new(running: Running, dir: tempfile::TempDir) -> TestGateway {
        let url = format!("http://{}", running.addr);
        let admin = format!("http://{}", running.admin_addr);
        TestGateway {
            running,
            dir,
            url,
            admin,
        }
    }

    /// The proxy's bound address.
    pub fn addr(&self) -> SocketAddr {
        self.running.addr
    }

    /// Path of a file in the config dir.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Replace the rules file atomically (write + rename, as editors do).
    pub fn write_rules(&self, yaml: &str) {
        atomic_write(&self.path("rules.yaml"), yaml);
    }

    /// Begin graceful shutdown and wait until the proxy has drained.
    pub async fn stop(mut self) {
        let _ = self.running.shutdown.send(true);
        let _ = (&mut self.running.done).await;
    }
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        // Every task of the gateway (proxy and admin accept loops, reload watcher, store probe)
        // ends on this signal.
        let _ = self.running.shutdown.send(true);
    }
}

/// Write `text` to `path` via a temp file and rename.
pub fn atomic_write(path: &Path, text: &str) {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Start the echo upstream on a free port.
pub async fn echo() -> SocketAddr {
    tollgate::demo::start_echo().await.unwrap()
}

/// Rules with one rule that never limits (so requests go upstream with headers).
pub const OPEN_RULES: &str = "rules:\n  - { name: open, match: { path: \"/**\" }, key: global, algorithm: fixed_window, limit: 1000000000, window: 1h }\n";

/// Write a config dir and return the gateway.yaml path.
pub fn write_config(dir: &Path, upstream: &str, extra: &str, rules: &str, keys: Option<&str>) -> PathBuf {
    let keys_line = if let Some(k) = keys {
        std::fs::write(dir.join("keys.yaml"), k).unwrap();
        "keys_file: keys.yaml\n"
    } else {
        ""
    };
    std::fs::write(dir.join("rules.yaml"), rules).unwrap();
    let gw = format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nupstream:\n  url: {upstream}\n  connect_timeout: 500ms\n  request_timeout: 2s\nrules_file: rules.yaml\n{keys_line}{extra}"
    );
    let p = dir.join("gateway.yaml");
    std::fs::write(&p, gw).unwrap();
    p
}

/// Start the gateway library from the config file `path` inside `dir`.
pub async fn gateway_from(path: &Path, dir: tempfile::TempDir) -> TestGateway {
    let cfg = GatewayConfig::load(path, &EnvOverrides::default()).unwrap_or_else(|e| panic!("{e}"));
    TestGateway::new(tollgate::server::start(cfg).await.unwrap(), dir)
}

/// Start the gateway library on loopback.
pub async fn gateway(upstream: &str, extra: &str, rules: &str, keys: Option<&str>) -> TestGateway {
    let dir = tempfile::tempdir().unwrap();
    let p = write_config(dir.path(), upstream, extra, rules, keys);
    gateway_from(&p, dir).await
}

/// A real `tollgate` process (any sub-command that listens) with its log (stderr) in a file.
/// Killed on drop.
pub struct BinaryGateway {
    /// The child process.
    pub child: Child,
    /// Proxy URL (`http://127.0.0.1:PORT`; unused for processes without a proxy listener).
    pub url: String,
    /// Admin URL.
    pub admin: String,
    /// The log file.
    log: PathBuf,
    /// The config dir, when the support code made it.
    dir: Option<tempfile::TempDir>,
}

impl BinaryGateway {
    /// Spawn `cmd` (stdin and stdout null, stderr to `log`) and wait until every port in
    /// `ports` accepts connections; panics with the log if it exits first or takes over 10 s.
    /// `ports[0]` is the proxy port and the last one the admin port.
    pub fn spawn(cmd: &mut Command, log: PathBuf, ports: &[u16]) -> BinaryGateway {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let port_url = |p: Option<&u16>| p.map(|p| format!("http://127.0.0.1:{p}")).unwrap_or_default();
        let mut gw = BinaryGateway {
            child,
            url: port_url(ports.first()),
            admin: port_url(ports.last()),
            log,
            dir: None,
        };
        let up = eventually_blocking(Duration::from_secs(10), || {
            if let Ok(Some(s)) = gw.child.try_wait() {
                panic!("tollgate exited early ({s}): {}", gw.log());
            }
            ports
                .iter()
                .all(|&p| std::net::TcpStream::connect(("127.0.0.1", p)).is_ok())
        });
        assert!(up, "tollgate did not start: {}", gw.log());
        gw
    }

    /// The config dir the support code made (`binary`, `binary_env`).
    pub fn config_dir(&self) -> PathBuf {
        self.dir.as_ref().map(|d| d.path().to_path_buf()).unwrap_or_default()
    }

    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for BinaryGateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawn the binary (`run --config`) with a config on free ports; waits until both listen.
pub fn binary(upstream: &str, extra: &str, rules: &str) -> BinaryGateway {
    binary_env(upstream, extra, rules, &[])
}

/// [`binary`], with `env` set for the process.
pub fn binary_env(upstream: &str, extra: &str, rules: &str, env: &[(&str, &str)]) -> BinaryGateway {
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let p = write_config(dir.path(), upstream, extra, rules, None);
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0",
        &format!("listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin_port}"),
    );
    std::fs::write(&p, text).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    cmd.args(["run", "--config"]).arg(&p).env("RUST_LOG", "info");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut gw = BinaryGateway::spawn(&mut cmd, dir.path().join("tollgate.log"), &[port, admin_port]);
    gw.dir = Some(dir);
    gw
}

/// The `store:` section for `kind` on `urls` (a 300 ms timeout and a 100 ms probe, then `extra`,
/// for Redis kinds), and an `identity:` that believes X-Forwarded-For from loopback: what the
/// hostile-client tests run, so each client can be its own address.
pub fn trusting_store_yaml(kind: &str, urls: &[String], extra: &str) -> String {
    let store = if kind == "memory" {
        "store:\n  kind: memory\n".to_owned()
    } else {
        let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
        format!(
            "store:\n  kind: {kind}\n  urls: [{}]\n  timeout: 300ms\n  probe_interval: 100ms\n{extra}",
            list.join(", ")
        )
    };
    format!("{store}identity:\n  trusted_proxies: [127.0.0.1/32]\n")
}
