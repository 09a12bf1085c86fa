//! Shutdown without dropping a request, against the real binary: SIGTERM under keep-alive load,
//! and a rolling restart of two gateways behind a balancer. The clients are raw HTTP/1.1
//! keep-alive connections that never retry: a request whose connection closes under it is a
//! failure, as it is for Python's `http.client` (`RemoteDisconnected`) or a browser.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the keep-alive clients saw.
#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    /// A request sent on an open connection that got no (complete) response.
    failed: AtomicU64,
    /// Connections closed by `Connection: close` (the drain's way to move a client).
    closes: AtomicU64,
}

/// Read one response (head + `Content-Length` body) from `s`; `Some(close)` when complete.
async fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<bool> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                buf.drain(..end + 4 + len);
                if !head.starts_with("http/1.1 200") {
                    return None;
                }
                return Some(head.contains("\nconnection: close"));
            }
        }
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return None,
        }
    }
}

/// One keep-alive client: requests back to back on one connection to whatever `target()`
/// names, a new connection when the server said `Connection: close`, until `stop`.
async fn client_loop(target: Arc<dyn Fn() -> SocketAddr + Send + Sync>, stop: Arc<AtomicBool>, tally: Arc<Tally>) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut s) = TcpStream::connect(target()).await else {
            // Nothing listens any more: not a dropped request (none was sent).
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        let mut buf = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            if s.write_all(b"GET /x HTTP/1.1\r\nHost: api.example\r\n\r\n")
                .await
                .is_err()
            {
                tally.failed.fetch_add(1, Ordering::Relaxed);
                break;
            }
            match read_response(&mut s, &mut buf).await {
                Some(close) => {
                    tally.ok.fetch_add(1, Ordering::Relaxed);
                    if close {
                        tally.closes.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
                None => {
                    tally.failed.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
    }
}

fn sigterm(gw: &BinaryGateway) {
    let pid = gw.child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
}

fn addr_of(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

fn status_of(url: &str) -> u16 {
    std::process::Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", url])
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).parse().ok())
        .unwrap_or(0)
}

const RULES: &str = "rules:\n  - { name: open, match: { path: \"/**\" }, key: global, algorithm: fixed_window, limit: 1000000000, window: 1h }\n";

#[test]
fn sigterm_under_keep_alive_load_drops_no_request() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(echo());
    let mut gw = binary(&format!("http://{up}"), "server:\n  drain: 3s\n", RULES);
    let target = addr_of(&gw.url);
    let (stop, tally) = (Arc::new(AtomicBool::new(false)), Arc::new(Tally::default()));
    let clients: Vec<_> = (0..16)
        .map(|_| rt.spawn(client_loop(Arc::new(move || target), stop.clone(), tally.clone())))
        .collect();
    assert!(rt.block_on(eventually(Duration::from_secs(5), || async {
        tally.ok.load(Ordering::Relaxed) > 500
    })));
    sigterm(&gw);
    // The drain window: /readyz fails, /metrics still answers, requests are still served.
    let not_ready = eventually_blocking(Duration::from_secs(2), || {
        status_of(&format!("{}/readyz", gw.admin)) == 503
    });
    assert!(not_ready, "/readyz kept passing in the drain window: {}", gw.log());
    assert_eq!(status_of(&format!("{}/metrics", gw.admin)), 200);
    let at_term = tally.ok.load(Ordering::Relaxed);
    assert!(rt.block_on(eventually(Duration::from_secs(2), || async {
        tally.ok.load(Ordering::Relaxed) > at_term + 200
    })));
    // The balancer has taken the gateway out by now: the clients stop, the gateway exits.
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        rt.block_on(c).unwrap();
    }
    let code = eventually_some_blocking(Duration::from_secs(10), || gw.child.try_wait().unwrap());
    assert!(code.is_some_and(|c| c.success()), "{}", gw.log());
    let (ok, failed, closes) = (
        tally.ok.load(Ordering::Relaxed),
        tally.failed.load(Ordering::Relaxed),
        tally.closes.load(Ordering::Relaxed),
    );
    println!(
        "SIGTERM under keep-alive load: {ok} ok, {failed} failed, {closes} connections moved by Connection: close"
    );
    assert_eq!(failed, 0, "{ok} ok; {}", gw.log());
    assert!(closes >= 16, "every keep-alive connection was told to close: {closes}");
    let log = gw.log();
    assert!(log.contains("draining") && log.contains("drain window over"), "{log}");
}

/// A TCP balancer on loopback: each client connection goes to the first backend in `live`
/// (tried in order; one that refuses is skipped), and stays pinned to it, as kube-proxy and
/// cloud balancers keep existing connections on a terminating pod.
async fn balancer(live: Arc<Mutex<Vec<SocketAddr>>>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            let backends = live.lock().unwrap().clone();
            tokio::spawn(async move {
                for b in backends {
                    if let Ok(mut s) = TcpStream::connect(b).await {
                        let _ = tokio::io::copy_bidirectional(&mut c, &mut s).await;
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[test]
fn a_rolling_restart_of_two_gateways_behind_a_balancer_drops_no_request() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(echo());
    let start = || binary(&format!("http://{up}"), "server:\n  drain: 2s\n", RULES);
    let mut gws = vec![start(), start()];
    let live = Arc::new(Mutex::new(gws.iter().map(|g| addr_of(&g.url)).collect::<Vec<_>>()));
    let lb = rt.block_on(balancer(live.clone()));
    let (stop, tally) = (Arc::new(AtomicBool::new(false)), Arc::new(Tally::default()));
    let clients: Vec<_> = (0..16)
        .map(|_| rt.spawn(client_loop(Arc::new(move || lb), stop.clone(), tally.clone())))
        .collect();
    assert!(rt.block_on(eventually(Duration::from_secs(5), || async {
        tally.ok.load(Ordering::Relaxed) > 500
    })));
    let began = Instant::now();
    for i in 0..2 {
        // Out of the balancer first (new connections go elsewhere), then SIGTERM: the
        // connections it holds stay pinned to it until it tells them to close.
        let old = gws.remove(0);
        live.lock().unwrap().retain(|a| *a != addr_of(&old.url));
        sigterm(&old);
        let mut old = old;
        let code = eventually_some_blocking(Duration::from_secs(15), || old.child.try_wait().unwrap());
        assert!(code.is_some_and(|c| c.success()), "gateway {i}: {}", old.log());
        let fresh = start();
        live.lock().unwrap().push(addr_of(&fresh.url));
        gws.push(fresh);
        let now = tally.ok.load(Ordering::Relaxed);
        assert!(rt.block_on(eventually(Duration::from_secs(5), || async {
            tally.ok.load(Ordering::Relaxed) > now + 200
        })));
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        rt.block_on(c).unwrap();
    }
    let (ok, failed) = (tally.ok.load(Ordering::Relaxed), tally.failed.load(Ordering::Relaxed));
    println!(
        "rolling restart of 2 gateways in {:?}: {ok} ok, {failed} failed",
        began.elapsed()
    );
    assert_eq!(failed, 0, "{ok} ok");
}
