//! The Envoy rate-limit service under test: the real `tollgate rls` binary on a config
//! directory of envoyproxy/ratelimit files, and a client independent of tollgate
//! (`tests/fixtures/rls/client.py`: Python grpcio with messages compiled from Envoy's own
//! `.proto` files by grpcio-tools). Without python3, grpcio or grpcio-tools the tests FAIL,
//! they never skip (`./scripts/test` installs them).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use super::free_port;
use super::gateway::{atomic_write, BinaryGateway, OPEN_RULES};

/// One client process; commands go one line at a time (see client.py).
pub struct RlsClient {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl RlsClient {
    /// Start client.py and wait (at most 60 s: it compiles the protos) for it to be ready.
    pub fn start() -> RlsClient {
        let ok = Command::new("python3")
            .args(["-c", "import grpc, grpc_tools"])
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(
            ok,
            "python3 with grpcio and grpcio-tools is needed: `python3 -m pip install grpcio grpcio-tools` (./scripts/test installs them)"
        );
        let mut child = Command::new("python3")
            .arg(format!("{}/tests/fixtures/rls/client.py", env!("CARGO_MANIFEST_DIR")))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn python3 client.py");
        let stdin = child.stdin.take().expect("client stdin");
        let stdout = BufReader::new(child.stdout.take().expect("client stdout"));
        let mut c = RlsClient { child, stdin, stdout };
        let ready = c.read();
        assert_eq!(ready["ready"], true, "client.py did not start: {ready}");
        c
    }

    fn read(&mut self) -> Value {
        let mut line = String::new();
        let _ = self.stdout.read_line(&mut line);
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("client.py printed {line:?} ({e})"))
    }

    /// Send one command, return its answer.
    pub fn send(&mut self, cmd: Value) -> Value {
        writeln!(self.stdin, "{cmd}").expect("write to client.py");
        self.stdin.flush().expect("flush client.py");
        let out = self.read();
        assert!(out.get("exception").is_none(), "client.py failed on {cmd}: {out}");
        out
    }

    /// `ShouldRateLimit(domain, descriptors)` at `addr`; each descriptor is a list of
    /// (key, value) entries.
    pub fn call(&mut self, addr: &str, domain: &str, descriptors: &[&[(&str, &str)]]) -> Value {
        self.send(json!({"op": "call", "addr": addr, "domain": domain, "descriptors": descriptors_json(descriptors)}))
    }
}

/// Descriptors as client.py reads them.
pub fn descriptors_json(descriptors: &[&[(&str, &str)]]) -> Value {
    Value::Array(
        descriptors
            .iter()
            .map(|d| json!({"entries": d.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>()}))
            .collect(),
    )
}

impl Drop for RlsClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A real `tollgate rls` process and its directories.
pub struct RlsNode {
    /// The process (admin URL in `gw.admin`).
    pub gw: BinaryGateway,
    /// `127.0.0.1:PORT` of the rate-limit service.
    pub addr: String,
    /// The envoyproxy/ratelimit config directory (`<root>/ratelimit/config`).
    pub config_dir: PathBuf,
    /// The gateway.yaml.
    pub gateway_file: PathBuf,
    _dir: tempfile::TempDir,
}

impl RlsNode {
    /// The admin listener's `/metrics` exposition (headers included).
    pub fn metrics(&self) -> String {
        use std::io::Read;
        let addr = self.gw.admin.trim_start_matches("http://");
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: tollgate\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    /// Write (atomically) the domain file `name` of the config directory.
    pub fn write_domain(&self, name: &str, yaml: &str) {
        atomic_write(&self.config_dir.join(name), yaml);
    }
}

/// Start `tollgate rls` with `store` (a `store:` section, or "" for memory), `rls_extra` lines
/// under `rls:`, and the domain files `domains` (file name, YAML).
pub fn rls_node(store: &str, rls_extra: &str, domains: &[(&str, &str)]) -> RlsNode {
    let dir = tempfile::tempdir().unwrap();
    let config_dir = dir.path().join("ratelimit").join("config");
    std::fs::create_dir_all(&config_dir).unwrap();
    for (name, yaml) in domains {
        std::fs::write(config_dir.join(name), yaml).unwrap();
    }
    let (port, admin_port) = (free_port(), free_port());
    std::fs::write(dir.path().join("rules.yaml"), OPEN_RULES).unwrap();
    let gw = format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:{admin_port}\nupstream:\n  url: http://127.0.0.1:9\nrules_file: rules.yaml\n{store}rls:\n  listen: 127.0.0.1:{port}\n  config_dir: ratelimit/config\n{rls_extra}"
    );
    let gateway_file = dir.path().join("gateway.yaml");
    std::fs::write(&gateway_file, gw).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    cmd.args(["rls", "--config"]).arg(&gateway_file).env("RUST_LOG", "info");
    let gw = BinaryGateway::spawn(&mut cmd, dir.path().join("tollgate.log"), &[port, admin_port]);
    RlsNode {
        gw,
        addr: format!("127.0.0.1:{port}"),
        config_dir,
        gateway_file,
        _dir: dir,
    }
}

/// Run `tollgate check --config F`: (success, stdout + stderr).
pub fn tollgate_check(gateway_file: &Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "--config"])
        .arg(gateway_file)
        .output()
        .expect("run tollgate check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Block until the wall clock is in the first `within` of a second, so a burst of calls on a
/// per-second limit is not split by a window boundary (polled with a deadline).
pub fn start_of_second(within: Duration) {
    within_second(Duration::ZERO, within);
}

/// Block until the wall clock's fraction of a second is in `from..to` (polled with a deadline;
/// the poll never sleeps more than 50 ms, so a span of 100 ms or more is always met). Returns
/// the whole second it is in.
pub fn within_second(from: Duration, to: Duration) -> u64 {
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
    };
    let ok = super::poll::eventually_blocking(Duration::from_secs(3), || {
        let f = now().subsec_nanos();
        f >= from.as_nanos() as u32 && f < to.as_nanos() as u32
    });
    assert!(ok, "the clock never reached {from:?}..{to:?} of a second");
    now().as_secs()
}
