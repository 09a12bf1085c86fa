//! Heap allocations per request on the gateway's own thread.
//!
//! The gateway runs in this process on a current-thread runtime of its own thread, as the
//! binary does with `TOKIO_WORKER_THREADS=1`, on the memory store. A counting allocator (over
//! mimalloc, the binary's allocator) counts only what that thread allocates; the upstream (a
//! fixed `200 ok` over raw TCP) and the keep-alive client run on other threads and are not
//! counted. Two workloads, each warmed up and then measured over `ALLOC_REQUESTS` requests:
//! - `allow`: a `global` fixed-window rule no request reaches, so every request is proxied;
//! - `deny`: a limit of 1 per day, so every measured request is answered 429 locally.
//!
//! Run with `cargo bench --bench allocs`; it prints allocations and bytes per request.

// A bench binary: no public API to document.
#![allow(missing_docs)]
// A counting `GlobalAlloc` is unsafe by definition; it only forwards to mimalloc.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;

use mimalloc::MiMalloc;
use tollgate::config::{EnvOverrides, GatewayConfig};

/// Counts allocations made on threads that turned counting on, then defers to mimalloc.
struct Counting;

thread_local! {
    /// Whether this thread's allocations are counted (the gateway's thread only).
    static COUNTED: Cell<bool> = const { Cell::new(false) };
}

/// Allocations (and reallocations) counted so far.
static ALLOCS: AtomicU64 = AtomicU64::new(0);
/// Bytes asked for by them.
static BYTES: AtomicU64 = AtomicU64::new(0);
/// Allocations by size: bucket `k` counts sizes in `[2^k, 2^(k+1))`.
static SIZES: [AtomicU64; 24] = [const { AtomicU64::new(0) }; 24];

/// `ALLOC_TRACE=<bytes>`: print a backtrace of the first allocations at least this large.
static TRACE_MIN: AtomicU64 = AtomicU64::new(u64::MAX);
/// How many backtraces are printed (per workload).
const TRACE_COUNT: u64 = 40;
/// Backtraces printed so far.
static TRACED: AtomicU64 = AtomicU64::new(0);

fn count(size: usize) {
    if COUNTED.try_with(Cell::get).unwrap_or(false) {
        if size as u64 >= TRACE_MIN.load(Ordering::Relaxed) && TRACED.fetch_add(1, Ordering::Relaxed) < TRACE_COUNT {
            // Not counted, and not traced again, while the backtrace allocates.
            COUNTED.with(|c| c.set(false));
            eprintln!(
                "allocation of {size} bytes:\n{}",
                std::backtrace::Backtrace::force_capture()
            );
            COUNTED.with(|c| c.set(true));
        }
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(size as u64, Ordering::Relaxed);
        let bucket = (usize::BITS - 1).saturating_sub(size.max(1).leading_zeros()) as usize;
        SIZES[bucket.min(SIZES.len() - 1)].fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is passed on unchanged to mimalloc, a correct allocator; counting
// allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { MiMalloc.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { MiMalloc.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { MiMalloc.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: the caller's contract, passed on.
        unsafe { MiMalloc.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// An upstream that answers every request on a keep-alive connection with `200 ok`.
fn upstream() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind upstream");
    let addr = l.local_addr().expect("upstream address");
    std::thread::spawn(move || {
        for conn in l.incoming().flatten() {
            std::thread::spawn(move || serve_ok(conn));
        }
    });
    addr
}

fn serve_ok(mut c: TcpStream) {
    let _ = c.set_nodelay(true);
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        while let Some(end) = find(&buf, b"\r\n\r\n") {
            buf.drain(..end + 4);
            if c.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok")
                .is_err()
            {
                return;
            }
        }
        match c.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The decimal number in `s`, spaces and `\r` skipped.
fn number(s: &[u8]) -> u16 {
    s.iter()
        .filter(|b| b.is_ascii_digit())
        .fold(0u16, |n, b| n.saturating_mul(10).saturating_add(u16::from(b - b'0')))
}

/// A keep-alive client connection to the gateway.
fn connect(addr: SocketAddr) -> TcpStream {
    let c = TcpStream::connect(addr).expect("connect to the gateway");
    let _ = c.set_nodelay(true);
    c
}

/// Send `n` requests over `c`, one at a time; returns the status of the last one.
fn drive(c: &mut TcpStream, n: usize) -> u16 {
    let mut buf = Vec::with_capacity(8192);
    let mut chunk = [0u8; 8192];
    let mut status = 0;
    for _ in 0..n {
        c.write_all(b"GET /bench/item HTTP/1.1\r\nhost: bench\r\nuser-agent: allocs\r\naccept: */*\r\n\r\n")
            .expect("send a request");
        loop {
            if let Some(end) = find(&buf, b"\r\n\r\n") {
                // Parsed in place: the client allocates nothing per request.
                let head = &buf[..end];
                status = number(head.get(9..12).unwrap_or_default());
                let len = head
                    .split(|&b| b == b'\n')
                    .find_map(|l| {
                        let colon = l.iter().position(|&b| b == b':')?;
                        l[..colon]
                            .eq_ignore_ascii_case(b"content-length")
                            .then(|| number(&l[colon + 1..]) as usize)
                    })
                    .unwrap_or(0);
                if buf.len() >= end + 4 + len {
                    buf.drain(..end + 4 + len);
                    break;
                }
            }
            let k = c.read(&mut chunk).expect("read a response");
            assert!(k > 0, "the gateway closed the connection");
            buf.extend_from_slice(&chunk[..k]);
        }
    }
    status
}

/// Start a gateway with `rules` on its own counted thread; returns its address.
fn gateway(dir: &Path, name: &str, up: SocketAddr, rules: &str) -> SocketAddr {
    let rules_path = dir.join(format!("{name}-rules.yaml"));
    std::fs::write(&rules_path, rules).expect("write rules");
    let cfg_path = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &cfg_path,
        format!(
            // `work_stealing`: one listener, served by this runtime alone (thread-per-core would
            // start uncounted worker threads for the other cores).
            "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nserver:\n  runtime: work_stealing\nupstream:\n  url: http://{up}\nrules_file: {}\n",
            rules_path.display()
        ),
    )
    .expect("write config");
    let cfg = GatewayConfig::load(&cfg_path, &EnvOverrides::default()).expect("bench config");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        COUNTED.with(|c| c.set(true));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let running = tollgate::server::start(cfg).await.expect("start the gateway");
            tx.send(running.addr).expect("report the address");
            std::future::pending::<()>().await;
        });
    });
    rx.recv().expect("gateway address")
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without it,
    // as a quick smoke test of both paths.
    let benching = std::env::args().any(|a| a == "--bench");
    let n: usize = std::env::var("ALLOC_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if benching { 20_000 } else { 300 });
    if let Some(min) = std::env::var("ALLOC_TRACE").ok().and_then(|v| v.parse().ok()) {
        TRACE_MIN.store(min, Ordering::Relaxed);
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let up = upstream();
    let workloads = [
        (
            "allow",
            200,
            "rules:\n  - { name: bench-allow, match: { path: \"/**\" }, key: global, algorithm: fixed_window, limit: 1000000000, window: 1h }\n",
        ),
        (
            "deny",
            429,
            "rules:\n  - { name: bench-deny, match: { path: \"/**\" }, key: global, algorithm: fixed_window, limit: 1, window: 1d }\n",
        ),
    ];
    println!("{:<8} {:>14} {:>14}", "path", "allocs/req", "bytes/req");
    for (name, want, rules) in workloads {
        let addr = gateway(dir.path(), name, up, rules);
        // The same connection warms up and is measured: its set-up is not counted.
        let mut c = connect(addr);
        drive(&mut c, n / 10 + 100);
        TRACED.store(0, Ordering::Relaxed);
        let (a0, b0) = (ALLOCS.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed));
        let s0: Vec<u64> = SIZES.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        let status = drive(&mut c, n);
        let (a1, b1) = (ALLOCS.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed));
        let sizes: Vec<String> = SIZES
            .iter()
            .zip(&s0)
            .enumerate()
            .filter_map(|(k, (c, before))| {
                let per = (c.load(Ordering::Relaxed) - before) as f64 / n as f64;
                (per >= 0.01).then(|| format!("{}B:{per:.2}", 1u64 << k))
            })
            .collect();
        assert_eq!(status, want, "{name}: unexpected status");
        println!(
            "{:<8} {:>14.2} {:>14.1}",
            name,
            (a1 - a0) as f64 / n as f64,
            (b1 - b0) as f64 / n as f64
        );
        println!("         by size (from, per request): {}", sizes.join(" "));
    }
}
