//! Gateway harness shared by the end-to-end tests: the real echo upstream, the real gateway
//! (library, on port 0) or the real `tollgate` binary, config written to a temp dir.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tollgate::config::{EnvOverrides, GatewayConfig};
use tollgate::server::Running;

/// A gateway serving on loopback with its config directory.
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
    /// Path of a file in the config dir.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Replace the rules file atomically (write + rename, as editors do).
    pub fn write_rules(&self, yaml: &str) {
        atomic_write(&self.path("rules.yaml"), yaml);
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

/// Start the gateway library on loopback.
pub async fn gateway(upstream: &str, extra: &str, rules: &str, keys: Option<&str>) -> TestGateway {
    let dir = tempfile::tempdir().unwrap();
    let p = write_config(dir.path(), upstream, extra, rules, keys);
    let cfg = GatewayConfig::load(&p, &EnvOverrides::default()).unwrap_or_else(|e| panic!("{e}"));
    let running = tollgate::server::start(cfg).await.unwrap();
    let url = format!("http://{}", running.addr);
    let admin = format!("http://{}", running.admin_addr);
    TestGateway {
        running,
        dir,
        url,
        admin,
    }
}

/// A free loopback port (bound then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The real `tollgate` binary, running `run --config` on fixed ports.
pub struct BinaryGateway {
    /// The child process.
    pub child: Child,
    /// Proxy URL.
    pub url: String,
    /// Admin URL.
    pub admin: String,
    /// Config dir.
    pub dir: tempfile::TempDir,
}

impl Drop for BinaryGateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawn the binary with a config; waits until `/healthz` answers.
pub fn binary(upstream: &str, extra: &str, rules: &str) -> BinaryGateway {
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let p = write_config(dir.path(), upstream, extra, rules, None);
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0",
        &format!("listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin_port}"),
    );
    std::fs::write(&p, text).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["run", "--config"])
        .arg(&p)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let g = BinaryGateway {
        child,
        url: format!("http://127.0.0.1:{port}"),
        admin: format!("http://127.0.0.1:{admin_port}"),
        dir,
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", admin_port)).is_ok()
            && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        {
            return g;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("tollgate binary did not start");
}

/// A plain HTTP client (no pooling surprises: one client per test).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder().pool_max_idle_per_host(64).build().unwrap()
}

/// Send raw bytes on a fresh connection and return everything read until close or timeout.
pub async fn raw(addr: SocketAddr, bytes: &[u8], wait: Duration) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(wait, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Rules with one rule that never limits (so requests go upstream with headers).
pub const OPEN_RULES: &str = "rules:\n  - { name: open, match: { path: \"/**\" }, key: global, algorithm: fixed_window, limit: 1000000000, window: 1h }\n";

/// GET `url` and return the body as text (admin `/metrics`, for instance).
pub async fn get_text(c: &reqwest::Client, url: impl reqwest::IntoUrl) -> String {
    c.get(url).send().await.unwrap().text().await.unwrap()
}

/// GET `url` and parse the body as JSON (admin `/rules`, `/keys/…`, `/explain`).
pub async fn get_json(c: &reqwest::Client, url: impl reqwest::IntoUrl) -> serde_json::Value {
    c.get(url).send().await.unwrap().json().await.unwrap()
}
