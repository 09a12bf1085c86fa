//! End-to-end proxying through the real gateway to a real upstream: pass-through, hop-by-hop
//! headers, streaming, 502/504, upgrades, SIGTERM drain.

mod support;

use std::time::{Duration, Instant};

use support::*;

#[tokio::test]
async fn status_body_and_headers_pass_through_and_hop_by_hop_is_dropped() {
    let up = echo().await;
    let gw = gateway(&format!("http://{up}"), "", OPEN_RULES, None).await;
    let c = client();
    let r = c
        .get(format!("{}/status/203?x=1", gw.url))
        .header("X-End-To-End", "kept")
        .header("Connection", "X-Secret-Hop")
        .header("X-Secret-Hop", "dropped")
        .header("Keep-Alive", "timeout=5")
        .header("Proxy-Authorization", "Basic Zm9v")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 203);
    assert_eq!(r.headers()["x-echo"], "1");
    assert!(
        r.headers().get("keep-alive").is_none(),
        "hop-by-hop from upstream must be stripped"
    );
    assert!(r.headers().get("ratelimit").is_some());
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["path"], "/status/203");
    assert_eq!(v["query"], "x=1");
    let h = &v["headers"];
    assert_eq!(h["x-end-to-end"], "kept");
    assert!(h.get("x-secret-hop").is_none(), "{h}");
    assert!(h.get("keep-alive").is_none());
    assert!(h.get("proxy-authorization").is_none());
    assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert!(h["x-forwarded-host"].as_str().unwrap().starts_with("127.0.0.1:"));
    assert!(h["forwarded"].as_str().unwrap().starts_with("for=127.0.0.1;proto=http"));
    gw.stop().await;
}

/// W3C Trace Context: a valid `traceparent` keeps its trace id and flags and gets tollgate's
/// span as the parent upstream, with `tracestate` untouched; without one (or with a malformed
/// one) the gateway starts a trace, and the stale `tracestate` is dropped.
#[tokio::test]
async fn traceparent_is_continued_or_started_and_forwarded() {
    let up = echo().await;
    let gw = gateway(&format!("http://{up}"), "", OPEN_RULES, None).await;
    let c = client();
    let sent_with = |tp: Option<&'static str>| {
        let mut r = c.get(format!("{}/t", gw.url)).header("tracestate", "congo=t61rcWkgMzE");
        if let Some(tp) = tp {
            r = r.header("traceparent", tp);
        }
        async move {
            let v: serde_json::Value = r.send().await.unwrap().json().await.unwrap();
            v["headers"].clone()
        }
    };
    let h = sent_with(Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")).await;
    let tp = h["traceparent"].as_str().unwrap_or_else(|| panic!("{h}"));
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!(
        (parts[0], parts[1], parts[3]),
        ("00", "4bf92f3577b34da6a3ce929d0e0e4736", "01")
    );
    assert_eq!(parts[2].len(), 16);
    assert_ne!(
        parts[2], "00f067aa0ba902b7",
        "the gateway's own span is the upstream's parent"
    );
    assert_eq!(h["tracestate"], "congo=t61rcWkgMzE");
    for tp in [None, Some("00-xyz-00f067aa0ba902b7-01")] {
        let h = sent_with(tp).await;
        let new = h["traceparent"].as_str().unwrap_or_else(|| panic!("{h}"));
        let parts: Vec<&str> = new.split('-').collect();
        assert_eq!(parts.len(), 4, "{new}");
        assert_eq!(parts[1].len(), 32);
        assert!(parts[1].bytes().all(|b| b.is_ascii_hexdigit()) && parts[1] != "0".repeat(32));
        assert!(
            h.get("tracestate").is_none(),
            "a new trace drops the old tracestate: {h}"
        );
    }
    gw.stop().await;
}

#[tokio::test]
async fn eight_mib_body_streams_intact_both_ways() {
    let up = echo().await;
    let gw = gateway(&format!("http://{up}"), "", OPEN_RULES, None).await;
    let body: Vec<u8> = (0..8 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    // Chunked upload (a stream, no Content-Length).
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = body.chunks(64 * 1024).map(|c| Ok(c.to_vec())).collect();
    let stream = futures_util::stream::iter(chunks);
    let r = client()
        .post(format!("{}/upload", gw.url))
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let got = r.bytes().await.unwrap();
    assert_eq!(got.len(), body.len());
    assert!(got.as_ref() == body.as_slice(), "body corrupted");
    gw.stop().await;
}

#[tokio::test]
async fn upstream_down_is_502_and_slow_is_504() {
    let dead = format!("http://127.0.0.1:{}", free_port());
    let gw = gateway(&dead, "", OPEN_RULES, None).await;
    let r = client().get(format!("{}/x", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 502);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"], "bad_gateway");
    gw.stop().await;

    let up = echo().await;
    let gw = gateway(&format!("http://{up}"), "", OPEN_RULES, None).await;
    let started = Instant::now();
    let r = client().get(format!("{}/slow/5000", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 504);
    assert!(started.elapsed() < Duration::from_secs(4), "request_timeout is 2s");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"], "gateway_timeout");
    gw.stop().await;
}

#[tokio::test]
async fn websocket_style_upgrade_passes_through() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = echo().await;
    let gw = gateway(&format!("http://{up}"), "", OPEN_RULES, None).await;
    let mut s = tokio::net::TcpStream::connect(gw.running.addr).await.unwrap();
    s.write_all(b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 1024];
    let n = s.read(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).to_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("upgrade: websocket"), "{head}");
    s.write_all(b"ping through the tunnel").await.unwrap();
    let mut got = vec![0u8; 23];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&got, b"ping through the tunnel");
    gw.stop().await;
}

#[tokio::test]
async fn http2_cleartext_is_served() {
    let up = echo().await;
    let gw = gateway(&format!("http://{up}"), "", OPEN_RULES, None).await;
    let c = reqwest::Client::builder().http2_prior_knowledge().build().unwrap();
    let r = c.get(format!("{}/h2", gw.url)).send().await.unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["path"], "/h2");
    gw.stop().await;
}

/// An HTTP/2 connection gives its read and write buffers back each time it goes idle (the
/// patched h2, docs/h2.md) and takes new ones for the next request: on one
/// connection, bodies larger than both buffers go up and come back whole, request after request,
/// and the per-response rate-limit headers (never HPACK-indexed) read right every time.
#[tokio::test]
async fn an_http2_connection_idles_between_requests_and_streams_whole_bodies_after() {
    let up = echo().await;
    let rules = "rules:\n  - { name: h2, match: { path: \"/**\" }, key: global, algorithm: fixed_window, limit: 100, window: 1h }\n";
    let gw = gateway(&format!("http://{up}"), "", rules, None).await;
    let c = reqwest::Client::builder().http2_prior_knowledge().build().unwrap();
    let body: Vec<u8> = (0..300 * 1024u32).map(|i| (i % 251) as u8).collect();
    for n in 0..4u64 {
        let r = if n % 2 == 0 {
            c.post(format!("{}/up", gw.url))
                .body(body.clone())
                .send()
                .await
                .unwrap()
        } else {
            c.get(format!("{}/down", gw.url)).send().await.unwrap()
        };
        assert_eq!(r.version(), reqwest::Version::HTTP_2);
        assert_eq!(r.status(), 200, "request {n}");
        assert_eq!(r.headers()["x-ratelimit-limit"], "100");
        assert_eq!(
            r.headers()["x-ratelimit-remaining"],
            (99 - n).to_string().as_str(),
            "request {n}"
        );
        assert!(r.headers()["ratelimit"]
            .to_str()
            .unwrap()
            .contains(&format!(";r={}", 99 - n)));
        let got = r.bytes().await.unwrap();
        if n % 2 == 0 {
            assert!(
                got[..] == body[..],
                "request {n}: {} bytes back of {}",
                got.len(),
                body.len()
            );
        } else {
            assert!(got.starts_with(b"{"), "request {n}: the echo's JSON");
        }
    }
    gw.stop().await;
}

#[tokio::test]
async fn the_protocol_is_told_apart_even_when_the_first_bytes_trickle_in() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = echo().await;
    let gw = gateway(&format!("http://{up}"), "", OPEN_RULES, None).await;
    // "P" and "PR" could still be the HTTP/2 preface ("PRI * HTTP/2.0..."): the gateway waits
    // for the byte that decides, then serves HTTP/1.
    for (first, rest) in [("P", "OST /t1 HTTP/1.1\r\n"), ("PR", "OPFIND /t2 HTTP/1.1\r\n")] {
        let mut s = tokio::net::TcpStream::connect(gw.running.addr).await.unwrap();
        s.write_all(first.as_bytes()).await.unwrap();
        // Not synchronisation: the pause is what is tested (the deciding byte comes later).
        tokio::time::sleep(Duration::from_millis(30)).await;
        s.write_all(rest.as_bytes()).await.unwrap();
        s.write_all(b"Host: a\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
            .await
            .unwrap()
            .unwrap();
        let out = String::from_utf8_lossy(&out);
        assert!(out.starts_with("HTTP/1.1 200"), "{first}+{rest}: {out}");
    }
    // The HTTP/2 preface split in two: still HTTP/2 (the server's SETTINGS frame comes back,
    // not an HTTP/1 400).
    let mut s = tokio::net::TcpStream::connect(gw.running.addr).await.unwrap();
    s.write_all(b"PRI * HTTP/2").await.unwrap();
    // Not synchronisation: the pause is what is tested (the preface arrives in two parts).
    tokio::time::sleep(Duration::from_millis(30)).await;
    s.write_all(b".0\r\n\r\nSM\r\n\r\n").await.unwrap();
    s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap(); // an empty SETTINGS frame
    let mut head = [0u8; 9];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut head))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(head[3], 4, "a SETTINGS frame (type 4) first: {head:?}");
    gw.stop().await;
}

#[test]
fn sigterm_drains_in_flight_requests_then_exits_zero() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(echo());
    let mut gw = binary(&format!("http://{up}"), "", OPEN_RULES);
    let url = format!("{}/slow/800", gw.url);
    let inflight = rt.spawn(async move { client().get(url).send().await.map(|r| r.status().as_u16()) });
    // SIGTERM once the request is in flight: the gateway has counted it (it is past the limit
    // check, on its way to the slow upstream).
    let admin = gw.admin.clone();
    let admitted = rt.block_on(eventually(Duration::from_secs(5), || async {
        metric_value(
            &client(),
            &admin,
            "tollgate_requests_total{rule=\"open\",decision=\"allowed\"}",
        )
        .await
            >= 1.0
    }));
    assert!(admitted, "the slow request never reached the gateway");
    let pid = gw.child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let status = rt.block_on(inflight).unwrap().unwrap();
    assert_eq!(status, 200, "the in-flight request finished");
    let code = eventually_some_blocking(Duration::from_secs(10), || gw.child.try_wait().unwrap());
    let code = code.expect("did not exit after SIGTERM");
    assert!(code.success(), "exit {code:?}");
    // New connections are refused once it stopped.
    assert!(std::net::TcpStream::connect(gw.url.trim_start_matches("http://")).is_err());
}

/// `server.runtime: thread_per_core` (the default) with two workers: two single-threaded
/// runtimes, each with its own `SO_REUSEPORT` listener. Connections land on both, one limit
/// holds across them exactly, and SIGTERM drains both and exits 0.
#[test]
fn thread_per_core_workers_share_one_limit_and_drain_on_sigterm() {
    two_workers_share_one_limit("thread_per_core", "ThreadPerCore");
}

/// `server.runtime: work_stealing` with two workers: one multi-threaded runtime on one
/// listener. The same limit holds exactly and SIGTERM exits 0.
#[test]
fn work_stealing_workers_share_one_limit_and_drain_on_sigterm() {
    two_workers_share_one_limit("work_stealing", "WorkStealing");
}

/// Run the binary with `server.runtime: <runtime>` and two workers, send 1,008 requests on new
/// connections against a limit of 300, then SIGTERM it.
fn two_workers_share_one_limit(runtime: &str, logged: &str) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(echo());
    let rules = "rules:\n  - { name: tpc, match: { path: \"/**\" }, key: global, algorithm: fixed_window, limit: 300, window: 1h }\n";
    let mut gw = binary_env(
        &format!("http://{up}"),
        &format!("server:\n  runtime: {runtime}\n"),
        rules,
        &[("TOKIO_WORKER_THREADS", "2")],
    );
    let pid = gw.child.id();
    // The ports accept connections as soon as they are bound, a moment before the start is
    // logged (and, with thread-per-core, before the second worker's thread exists).
    assert!(
        eventually_blocking(Duration::from_secs(10), || gw.log().contains("tollgate listening")),
        "no start line: {}",
        gw.log()
    );
    // Thread-per-core: the second worker is a thread of its own. A new thread names itself
    // once it runs, so a busy machine may show it unnamed for a moment: look for a while.
    let per_core = runtime == "thread_per_core";
    let find_worker = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter_map(|t| t.ok())
            .find(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with("tollgate-worker")))
            .map(|t| t.path())
    };
    let worker_tid = if per_core {
        eventually_some_blocking(Duration::from_secs(5), find_worker)
    } else {
        find_worker()
    };
    assert_eq!(worker_tid.is_some(), per_core, "tollgate-worker thread: {}", gw.log());
    assert!(gw.log().contains(runtime) || gw.log().contains(logged), "{}", gw.log());
    // 1,000 requests, each on a new connection, 16 at a time: the kernel spreads the
    // connections over both listeners.
    let url = format!("{}/x", gw.url);
    let (ok, limited) = rt.block_on(async {
        let mut ok = 0;
        let mut limited = 0;
        for _ in 0..(1000 / 16 + 1) {
            let mut batch = Vec::new();
            for _ in 0..16 {
                let url = url.clone();
                batch.push(tokio::spawn(async move {
                    let c = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
                    c.get(url).send().await.map(|r| r.status().as_u16()).unwrap_or(0)
                }));
            }
            for b in batch {
                match b.await.unwrap() {
                    200 => ok += 1,
                    429 => limited += 1,
                    other => panic!("status {other}"),
                }
            }
        }
        (ok, limited)
    });
    assert_eq!(ok, 300, "exactly the limit was admitted across both workers");
    assert_eq!(ok + limited, 1008);
    if let Some(worker_tid) = worker_tid {
        // The worker thread served some of them: it used CPU (utime + stime, in clock ticks).
        let stat = std::fs::read_to_string(worker_tid.join("stat")).unwrap();
        let after_comm = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<&str> = after_comm.split_whitespace().collect();
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        assert!(ticks > 0, "the second worker served nothing: {stat}");
    }
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let code = eventually_some_blocking(Duration::from_secs(10), || gw.child.try_wait().unwrap());
    let code = code.unwrap_or_else(|| panic!("did not exit after SIGTERM: {}", gw.log()));
    assert!(code.success(), "exit {code:?}: {}", gw.log());
}

/// An upstream that closes every connection after one response (as servers do with idle
/// keep-alive connections): pooled connections go stale, and no request may fail for it.
#[tokio::test]
async fn stale_pooled_connections_never_fail_a_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { return };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
                // No `Connection: close`: the proxy learns it only from the closed socket.
            });
        }
    });
    let gw = gateway(&format!("http://{up}"), "", OPEN_RULES, None).await;
    let c = client();
    for i in 0..20 {
        let r = c.get(format!("{}/n{i}", gw.url)).send().await.unwrap();
        assert_eq!(r.status(), 200, "request {i}");
        assert_eq!(r.text().await.unwrap(), "ok");
        if i % 2 == 0 {
            // Not synchronisation: every other request comes after a pause, so the pool holds
            // connections the upstream has closed both before and after the proxy saw the FIN.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    gw.stop().await;
}

/// Upstream connections are driven by the requests that use them and go back to the pool when
/// the response body ends: sequential requests of every kind of body share one connection,
/// and a body the client abandons closes its connection without leaking the request.
#[tokio::test]
async fn one_pooled_connection_serves_sequential_requests_of_every_body_kind() {
    use std::sync::atomic::Ordering;
    let up = counting_upstream().await;
    let gw = gateway(&up.url(), "", OPEN_RULES, None).await;
    let c = client();
    for i in 0..20 {
        let r = c.get(format!("{}/n{i}", gw.url)).send().await.unwrap();
        assert_eq!(r.status(), 200, "GET {i}");
        assert_eq!(r.text().await.unwrap(), "chunk\n");
        // A body the server never polls (HEAD), a header-only exchange.
        let r = c.head(format!("{}/h{i}", gw.url)).send().await.unwrap();
        assert_eq!(r.status(), 200, "HEAD {i}");
    }
    let r = c.get(format!("{}/trailer-cost/3", gw.url)).send().await.unwrap();
    assert_eq!(r.text().await.unwrap(), "chunk\nchunk\n");
    let r = c.get(format!("{}/cost/2", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "chunk\n");
    assert_eq!(up.counts.total.load(Ordering::SeqCst), 42);
    assert_eq!(
        up.counts.connections.load(Ordering::SeqCst),
        1,
        "every sequential request reused the one pooled connection"
    );

    // A streaming body the client leaves after one chunk: its connection closes with it (the
    // rest of the body is never read), and the next request opens a new one.
    let mut r = c.get(format!("{}/stream", gw.url)).send().await.unwrap();
    assert!(r.chunk().await.unwrap().is_some());
    drop(r);
    let released = eventually(Duration::from_secs(5), || async { up.current() == 0 }).await;
    assert!(released, "the abandoned exchange is still open at the upstream");
    let r = c.get(format!("{}/after", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(up.counts.connections.load(Ordering::SeqCst), 2);
    gw.stop().await;
}

/// A `TestGateway` stops on drop: without `stop()`, its proxy and admin listeners close.
#[tokio::test]
async fn a_dropped_test_gateway_stops_listening() {
    use tokio::net::TcpStream;
    let up = echo().await;
    let gw = gateway(&format!("http://{up}"), "", OPEN_RULES, None).await;
    let (addr, admin) = (gw.addr(), gw.running.admin_addr);
    assert!(TcpStream::connect(addr).await.is_ok());
    assert!(TcpStream::connect(admin).await.is_ok());
    drop(gw);
    let closed = eventually(Duration::from_secs(5), || async {
        TcpStream::connect(addr).await.is_err() && TcpStream::connect(admin).await.is_err()
    })
    .await;
    assert!(closed, "a dropped gateway still accepts connections");
}
