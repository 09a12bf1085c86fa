//! A real OTLP/HTTP traces receiver: `otlp_receiver.py` (Python, decoding with the PyPI package
//! `opentelemetry-proto`) as a subprocess, writing each span it receives as a JSON line.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::poll::eventually_some_blocking;

/// The receiver process, killed on drop.
pub struct OtlpReceiver {
    child: Child,
    /// Its traces URL, `http://127.0.0.1:PORT/v1/traces`.
    pub endpoint: String,
    /// Where the spans are written.
    out: PathBuf,
    _dir: tempfile::TempDir,
}

impl OtlpReceiver {
    /// Start it; waits until it listens (panics after 10 s).
    pub fn start() -> OtlpReceiver {
        let dir = tempfile::tempdir().unwrap();
        let (port_file, out) = (dir.path().join("port"), dir.path().join("spans.jsonl"));
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/otlp_receiver.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg("--port-file")
            .arg(&port_file)
            .arg("--out")
            .arg(&out)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("receiver.log")).unwrap())
            .spawn()
            .unwrap();
        let port = eventually_some_blocking(Duration::from_secs(10), || {
            if let Ok(Some(s)) = child.try_wait() {
                let log = std::fs::read_to_string(dir.path().join("receiver.log")).unwrap_or_default();
                panic!("otlp_receiver.py exited ({s}): {log}");
            }
            std::fs::read_to_string(&port_file).ok()?.trim().parse::<u16>().ok()
        })
        .expect("otlp_receiver.py did not start in 10 s");
        OtlpReceiver {
            child,
            endpoint: format!("http://127.0.0.1:{port}/v1/traces"),
            out,
            _dir: dir,
        }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
