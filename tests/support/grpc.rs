//! Real gRPC peers: the grpcio server and client of `tests/fixtures/grpc/`, run with `python3`
//! as subprocesses, and the real `tollgate` binary in front of the server. Without `python3`
//! or grpcio the tests FAIL, they never skip (`./scripts/test` installs grpcio).

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use super::free_port;
use super::gateway::BinaryGateway;

/// `tests/fixtures/grpc/<name>`.
fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/grpc/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// Fail (never skip) when python3 or grpcio is missing.
fn require_grpcio() {
    let ok = Command::new("python3")
        .args(["-c", "import grpc"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "python3 with grpcio is needed: `python3 -m pip install grpcio` (./scripts/test installs it)"
    );
}

/// The grpcio server of `tests/fixtures/grpc/server.py` on a free loopback port; killed on
/// drop (it also exits when its stdin closes).
pub struct GrpcServer {
    /// The process.
    child: Child,
    /// Held open: the server serves until it closes.
    _stdin: Option<ChildStdin>,
    /// The port it serves on.
    pub port: u16,
}

impl GrpcServer {
    /// Start the server with `args` (see server.py) and wait, at most 20 s, for its port.
    pub fn start(args: &[&str]) -> GrpcServer {
        require_grpcio();
        let mut child = Command::new("python3")
            .arg(fixture("server.py"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn python3 server.py");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("server stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the gRPC server did not print its port within 20 s");
        let port = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("the gRPC server did not start (printed {line:?}; its stderr is above)"));
        GrpcServer {
            child,
            _stdin: stdin,
            port,
        }
    }

    /// `127.0.0.1:PORT`, for the client.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// What the server saw (asked directly, not through the gateway): `connections` (client
    /// ports that carried calls), `calls`, `max_in_flight`.
    pub fn stats(&self) -> serde_json::Value {
        grpc_client(&["stats", &self.addr()])
    }
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Run `tests/fixtures/grpc/client.py ARGS` (at most 60 s) and parse the JSON it prints.
pub fn grpc_client(args: &[&str]) -> serde_json::Value {
    require_grpcio();
    let mut child = Command::new("python3")
        .arg(fixture("client.py"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn python3 client.py");
    let done = super::poll::eventually_blocking(Duration::from_secs(60), || matches!(child.try_wait(), Ok(Some(_))));
    if !done {
        let _ = child.kill();
    }
    let out = child.wait_with_output().expect("client output");
    assert!(
        done && out.status.success(),
        "client.py {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "client.py {args:?} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The real `tollgate` binary in front of `upstream_url` with `upstream.protocol: protocol`,
/// the rules `rules`, `upstream_extra` lines under `upstream:` and `extra` at the top level.
/// Its request timeout is 20 s (calls may wait at the server). The config dir lives as long as
/// the returned `TempDir`.
pub fn grpc_gateway(
    upstream_url: &str,
    protocol: &str,
    rules: &str,
    upstream_extra: &str,
) -> (BinaryGateway, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    std::fs::write(dir.path().join("rules.yaml"), rules).unwrap();
    let gw = format!(
        "listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin_port}\nupstream:\n  url: {upstream_url}\n  protocol: {protocol}\n  connect_timeout: 1s\n  request_timeout: 20s\n{upstream_extra}rules_file: rules.yaml\n"
    );
    let p = dir.path().join("gateway.yaml");
    std::fs::write(&p, gw).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    cmd.args(["run", "--config"]).arg(&p).env("RUST_LOG", "info");
    let gw = BinaryGateway::spawn(&mut cmd, dir.path().join("tollgate.log"), &[port, admin_port]);
    (gw, dir)
}
