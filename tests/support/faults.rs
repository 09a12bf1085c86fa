//! A fault-injecting TCP proxy for the store-fault tests: it sits between the gateway and one
//! Redis node and can add latency to what the node sends back, stop forwarding altogether
//! (a black hole: connections stay open, nothing arrives), or reset connections at random.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the proxy does to traffic now; change it at any time.
#[derive(Debug, Default)]
pub struct Faults {
    /// Delay added to every chunk the node sends back, milliseconds.
    pub latency_ms: AtomicU64,
    /// Forward nothing in either direction while set.
    pub blackhole: AtomicBool,
    /// Chance, per chunk in either direction, of resetting the connection (per mille).
    pub reset_permille: AtomicU32,
    /// Connections reset so far.
    pub resets: AtomicU64,
}

/// The proxy: where it listens and its fault switches. Runs until the test ends.
pub struct FaultProxy {
    /// The proxy's port on 127.0.0.1.
    pub port: u16,
    /// Its switches.
    pub faults: Arc<Faults>,
}

impl FaultProxy {
    /// Proxy a free loopback port to `127.0.0.1:target`.
    pub async fn start(target: u16) -> FaultProxy {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let faults = Arc::new(Faults::default());
        let f = faults.clone();
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = l.accept().await else { continue };
                let f = f.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(SocketAddr::from(([127, 0, 0, 1], target))).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let up = pump(cr, sw, f.clone(), false);
                    let down = pump(sr, cw, f.clone(), true);
                    tokio::select! { _ = up => {}, _ = down => {} }
                });
            }
        });
        FaultProxy { port, faults }
    }

    /// Add `ms` of latency to the node's replies.
    pub fn latency(&self, ms: u64) {
        self.faults.latency_ms.store(ms, Ordering::SeqCst);
    }

    /// Stop (or resume) forwarding.
    pub fn blackhole(&self, on: bool) {
        self.faults.blackhole.store(on, Ordering::SeqCst);
    }

    /// Reset connections on `permille` of chunks.
    pub fn resets(&self, permille: u32) {
        self.faults.reset_permille.store(permille, Ordering::SeqCst);
    }
}

/// Copy `from` to `to` chunk by chunk, applying the faults; returns when either side closes or
/// a reset is injected (dropping both halves; with linger 0 the peer sees a reset).
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    f: Arc<Faults>,
    reply: bool,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while f.blackhole.load(Ordering::SeqCst) {
            // Hold the data: nothing arrives while the link is down.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let p = f.reset_permille.load(Ordering::SeqCst);
        if p > 0 && rand::thread_rng().gen_range(0..1000) < p {
            f.resets.fetch_add(1, Ordering::SeqCst);
            return;
        }
        let ms = f.latency_ms.load(Ordering::SeqCst);
        if reply && ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
