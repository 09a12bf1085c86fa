//! Hostile client, concurrency limits: a client that tries to have more requests running at the
//! upstream than its limit, by leaving early, switching protocol, spelling the request another
//! way, spreading a burst over the fleet, or riding a reset. Against the real binary, real Redis
//! (standalone, and the 6-node cluster with three gateways where sharing matters) and a real
//! upstream that counts what it works on at once: every test measures at the upstream (a slot is
//! held until the upstream exchange ends: ARCHITECTURE.md, "Concurrency slots are held while the
//! upstream works").
//!
//! | way around the limit | defence | test |
//! |---|---|---|
//! | close the connection (FIN) before the head, or mid-body | the exchange runs in its own task; the slot is held until the upstream is done (at most `request_timeout` after the client left) | `concurrency_penalty.rs`: `a_client_that_leaves_keeps_its_slot_until_the_upstream_is_done` |
//! | reset the connection (RST) mid-flight | the same | `an_rst_mid_flight_keeps_the_slot_until_the_upstream_is_done` |
//! | HTTP/2: reset the stream (RST_STREAM), or open many streams on one connection | each stream is a request with its own slot; a reset one keeps it until the upstream is done | `h2_stream_resets_and_parallel_streams_never_exceed_the_limit` |
//! | `Upgrade: h2c`, a tunnel of many requests on one slot | not an allowed upgrade: forwarded as a plain request, the slot freed with its response | `an_h2c_upgrade_is_plain_and_a_websocket_holds_its_slot_while_open` |
//! | a websocket, held open after its slot is released | the slot is held while the upgraded connection is open | the same |
//! | path spellings (`//`, `./`, `..`, `;params`, escapes, `%2F`, `\`), host spellings (case, trailing dot, absolute-form) and key-header spellings (`_`, twice, a list) | one canonical path and host for rules and upstream; ambiguous spellings get 400 | `spellings_of_path_host_and_key_share_one_slot` |
//! | a burst of clients that leave at once, spread over three gateways on a cluster | slots are taken fleet-wide in the store, `failure: closed` | `a_leaving_burst_over_three_gateways_never_exceeds_the_limit` (also `concurrency_penalty.rs`: `cluster_never_more_than_the_limit_in_flight`) |
//! | `DELETE /keys/{ip}` while slots are held | a reset keeps running requests' slots (they are requests running now) | `a_reset_while_slots_are_held_frees_none_across_the_fleet` (also `leases.rs`: `concurrency_slots_held_survive_a_reset`) |
//! | a gateway that crashes while holding slots | slots expire after `store.concurrency_ttl`, not before | `concurrency_penalty.rs`: `a_crashed_gateways_slots_expire_after_the_ttl` |
//! | a request that runs past the slot's TTL | the slot is renewed while the request runs | `concurrency_penalty.rs`: `a_long_request_keeps_its_slot_past_the_ttl` |

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn store_yaml(kind: &str, urls: &[String]) -> String {
    trusting_store_yaml(kind, urls, "")
}

/// One concurrency rule on every path, per client address, failing closed (a check past the
/// store's deadline on this busy machine is a 503, never an unchecked admission).
fn slots(limit: u32) -> String {
    format!("rules:\n  - {{ name: inflight, match: {{ path: \"/**\" }}, key: ip, algorithm: concurrency, limit: {limit}, failure: closed }}\n")
}

fn addr_of(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

fn status_of(resp: &[u8]) -> u16 {
    std::str::from_utf8(resp.get(9..12).unwrap_or_default())
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// Send `req` on a fresh connection and return the status of the first answer within `wait`
/// (0 when none came).
async fn raw_status(addr: SocketAddr, req: &str, wait: Duration) -> u16 {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(req.as_bytes()).await;
    let mut buf = vec![0u8; 4096];
    match tokio::time::timeout(wait, s.read(&mut buf)).await {
        Ok(Ok(n)) => status_of(&buf[..n]),
        _ => 0,
    }
}

/// In flight for `ip` as `/keys` reports it (99 when it reports none).
async fn in_flight(c: &reqwest::Client, admin: &str, ip: &str) -> u64 {
    let v = get_json(c, format!("{admin}/keys/{ip}")).await;
    v["counters"][0]["in_flight"].as_u64().unwrap_or(99)
}

/// A client that sends its request, waits `after` for an answer and then resets the connection
/// (`SO_LINGER` 0: the close is an RST, not a FIN). The status, if one came in time.
async fn rst_after(addr: SocketAddr, req: &str, after: Duration) -> Option<u16> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let got = tokio::time::timeout(after, s.read(&mut buf)).await;
    s.set_zero_linger().unwrap();
    drop(s);
    match got {
        Ok(Ok(n)) if n >= 12 => Some(status_of(&buf[..n])),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rst_mid_flight_keeps_the_slot_until_the_upstream_is_done() {
    let server = RedisServer::start();
    let up = counting_upstream().await;
    let gw = binary(&up.url(), &store_yaml("redis", &[server.url()]), &slots(2));
    let a = addr_of(&gw.url);
    let req = "GET /busy/1000 HTTP/1.1\r\nHost: api.example\r\nX-Forwarded-For: 10.31.0.1\r\n\r\n";
    let mut answered = Vec::new();
    for _ in 0..12 {
        if let Some(s) = rst_after(a, req, Duration::from_millis(80)).await {
            answered.push(s);
        }
    }
    // The ones answered in time were denied: the admitted ones were still running.
    assert!(answered.iter().all(|&s| s == 429 || s == 503), "{answered:?}");
    assert!(up.max() <= 2, "the upstream worked on {} at once (limit 2)", up.max());
    assert!(
        up.counts.total.load(Ordering::SeqCst) >= 2,
        "no request ever reached the upstream"
    );
    // Once the upstream is done, the slots are free.
    let c = client();
    let freed = eventually(Duration::from_secs(4), || async {
        in_flight(&c, &gw.admin, "10.31.0.1").await == 0
    })
    .await;
    assert!(freed, "slots still held after the upstream was done");
    assert_eq!(up.current(), 0);
}

/// One HTTP/2 (h2c, prior knowledge) request; `reset_after` resets its stream (CANCEL) if no
/// head came by then. The status, if one came.
async fn h2_request(
    h2: &mut h2::client::SendRequest<bytes::Bytes>,
    url: &str,
    ip: &str,
    reset_after: Option<Duration>,
) -> Option<u16> {
    let req = http::Request::get(url).header("x-forwarded-for", ip).body(()).unwrap();
    let (resp, mut stream) = h2.send_request(req, true).unwrap();
    match reset_after {
        Some(after) => match tokio::time::timeout(after, resp).await {
            Ok(Ok(r)) => Some(r.status().as_u16()),
            Ok(Err(e)) => panic!("h2 request failed: {e}"),
            Err(_) => {
                stream.send_reset(h2::Reason::CANCEL);
                None
            }
        },
        None => {
            let r = resp.await.unwrap();
            let status = r.status().as_u16();
            let mut body = r.into_body();
            while let Some(chunk) = body.data().await {
                let chunk = chunk.unwrap();
                let _ = body.flow_control().release_capacity(chunk.len());
            }
            Some(status)
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_stream_resets_and_parallel_streams_never_exceed_the_limit() {
    let server = RedisServer::start();
    let up = counting_upstream().await;
    let gw = binary(&up.url(), &store_yaml("redis", &[server.url()]), &slots(2));
    let a = addr_of(&gw.url);
    let s = TcpStream::connect(a).await.unwrap();
    let (h2, conn) = h2::client::handshake(s).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut h2 = h2.ready().await.unwrap();
    let url = format!("http://{a}/busy/1000");
    // Streams reset 80 ms in, one after another on one connection.
    let mut answered = Vec::new();
    for _ in 0..10 {
        if let Some(s) = h2_request(&mut h2, &url, "10.31.1.1", Some(Duration::from_millis(80))).await {
            answered.push(s);
        }
        h2 = h2.ready().await.unwrap();
    }
    assert!(answered.iter().all(|&s| s == 429 || s == 503), "{answered:?}");
    assert!(
        up.max() <= 2,
        "reset streams: the upstream worked on {} at once (limit 2)",
        up.max()
    );
    assert!(eventually(Duration::from_secs(4), || async { up.current() == 0 }).await);
    // 20 streams at once on the same connection, from another address.
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let (h2, url) = (h2.clone(), url.clone());
            tokio::spawn(async move {
                let mut h2 = h2.ready().await.unwrap();
                h2_request(&mut h2, &url, "10.31.1.2", None).await
            })
        })
        .collect();
    let mut codes = Vec::new();
    for t in tasks {
        codes.push(t.await.unwrap().unwrap_or(0));
    }
    assert!(
        up.max() <= 2,
        "parallel streams: the upstream worked on {} at once",
        up.max()
    );
    let ok = codes.iter().filter(|&&s| s == 200).count();
    assert!(
        (1..=2).contains(&ok) && codes.iter().all(|&s| s == 200 || s == 429),
        "{codes:?}"
    );
}

/// A raw HTTP/1.1 upstream that switches to any protocol a request asks for (as Go's h2c
/// handler or a websocket server would) and then echoes what comes through the tunnel,
/// counting tunnels open now; anything else gets `200 ok`. It records every request head.
struct SwitchingUpstream {
    addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
    tunnels: Arc<AtomicUsize>,
}

impl SwitchingUpstream {
    async fn start() -> SwitchingUpstream {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let tunnels = Arc::new(AtomicUsize::new(0));
        let (h2, t2) = (heads.clone(), tunnels.clone());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let (heads, tunnels) = (h2.clone(), t2.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = vec![0u8; 16 * 1024];
                    loop {
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                            buf.drain(..end + 4);
                            let lower = head.to_ascii_lowercase();
                            let proto = lower
                                .lines()
                                .find_map(|l| l.strip_prefix("upgrade:"))
                                .map(|p| p.trim().to_owned());
                            heads.lock().unwrap().push(head);
                            if let Some(p) = proto {
                                let resp = format!("HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: {p}\r\nsec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n");
                                let _ = s.write_all(resp.as_bytes()).await;
                                tunnels.fetch_add(1, Ordering::SeqCst);
                                loop {
                                    match s.read(&mut chunk).await {
                                        Ok(0) | Err(_) => break,
                                        Ok(n) => {
                                            let _ = s.write_all(&chunk[..n]).await;
                                        }
                                    }
                                }
                                tunnels.fetch_sub(1, Ordering::SeqCst);
                                return;
                            }
                            let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
                        }
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                });
            }
        });
        SwitchingUpstream { addr, heads, tunnels }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_upgrade_is_plain_and_a_websocket_holds_its_slot_while_open() {
    let up = SwitchingUpstream::start().await;
    let gw = binary(&format!("http://{}", up.addr), &store_yaml("memory", &[]), &slots(1));
    let a = addr_of(&gw.url);
    let ip = "10.31.2.1";
    let plain = format!("GET /x HTTP/1.1\r\nHost: api.example\r\nX-Forwarded-For: {ip}\r\nConnection: close\r\n\r\n");
    // `curl --http2` on cleartext: the upgrade is dropped, the request is plain, and its slot is
    // freed with its response (a tunnel would hold one slot for any number of requests).
    let h2c = format!("GET /tunnel HTTP/1.1\r\nHost: api.example\r\nX-Forwarded-For: {ip}\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n");
    let mut s = TcpStream::connect(a).await.unwrap();
    s.write_all(h2c.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status_of(&buf[..n]), 200, "{}", String::from_utf8_lossy(&buf[..n]));
    assert_eq!(up.tunnels.load(Ordering::SeqCst), 0, "a tunnel was opened");
    assert!(
        !up.heads.lock().unwrap()[0]
            .to_ascii_lowercase()
            .contains("upgrade: h2c"),
        "the h2c upgrade reached the upstream"
    );
    // The h2c request's slot is free (its connection is still open): another request passes.
    assert_eq!(raw_status(a, &plain, Duration::from_secs(5)).await, 200);
    drop(s);

    // A websocket holds its slot while it is open... (asked again on a 429: the client can read
    // the plain request's whole response a moment before the gateway drops its body and frees
    // the slot)
    let ws = format!("GET /ws HTTP/1.1\r\nHost: api.example\r\nX-Forwarded-For: {ip}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n");
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let (mut s, n) = loop {
        let mut s = TcpStream::connect(a).await.unwrap();
        s.write_all(ws.as_bytes()).await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        if status_of(&buf[..n]) != 429 || std::time::Instant::now() > deadline {
            break (s, n);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status_of(&buf[..n]), 101, "{}", String::from_utf8_lossy(&buf[..n]));
    s.write_all(b"frame").await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&buf[..n], b"frame", "the tunnel does not carry data");
    for _ in 0..3 {
        assert_eq!(
            raw_status(a, &plain, Duration::from_secs(5)).await,
            429,
            "a request passed while the websocket held the only slot"
        );
    }
    // ... and frees it when it closes.
    drop(s);
    let freed = eventually(Duration::from_secs(4), || async {
        raw_status(a, &plain, Duration::from_secs(5)).await == 200
    })
    .await;
    assert!(freed, "the closed websocket kept its slot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spellings_of_path_host_and_key_share_one_slot() {
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: exports, match: { path: "/busy/**", host: a.example }, key: "header:X-Tenant", algorithm: concurrency, limit: 1, failure: closed }
"#;
    let gw = binary(&up.url(), &store_yaml("memory", &[]), rules);
    let a = addr_of(&gw.url);
    let c = client();
    // Hold the tenant's one slot for 1.8 s (within the 2 s `request_timeout`).
    let holder = {
        let url = format!("{}/busy/1800", gw.url);
        let c = c.clone();
        tokio::spawn(async move {
            c.get(url)
                .header("host", "a.example")
                .header("x-tenant", "acme")
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        })
    };
    assert!(eventually(Duration::from_secs(3), || async { up.current() == 1 }).await);
    let started = Instant::now();
    let mut got = Vec::new();
    for (target, host, tenant) in [
        ("/busy/3000", "a.example", "X-Tenant: acme"),
        ("//busy/3000", "a.example", "X-Tenant: acme"),
        ("/./busy/3000", "a.example", "X-Tenant: acme"),
        ("/x/../busy/3000", "a.example", "X-Tenant: acme"),
        ("/busy/3000;jsessionid=1", "a.example", "X-Tenant: acme"),
        ("/busy/%33000", "a.example", "X-Tenant: acme"),
        ("/b%75sy/3000", "a.example", "X-Tenant: acme"),
        ("/busy%2F3000", "a.example", "X-Tenant: acme"),
        ("/busy\\3000", "a.example", "X-Tenant: acme"),
        ("/busy/3000", "A.EXAMPLE", "X-Tenant: acme"),
        ("/busy/3000", "a.example.", "X-Tenant: acme"),
        ("/busy/3000", "a.example:80", "X-Tenant: acme"),
        ("http://a.example/busy/3000", "b.example", "X-Tenant: acme"),
        ("/busy/3000", "a.example", "x-tenant: acme"),
        ("/busy/3000", "a.example", "X_Tenant: acme"),
        ("/busy/3000", "a.example", "X-Tenant: decoy\r\nX-Tenant: acme"),
        ("/busy/3000", "a.example", "X-Tenant: acme, decoy"),
        ("/busy/3000", "a.example", "X-Tenant: decoy, acme"),
    ] {
        let req = format!("GET {target} HTTP/1.1\r\nHost: {host}\r\n{tenant}\r\nConnection: close\r\n\r\n");
        let code = raw_status(a, &req, Duration::from_secs(5)).await;
        got.push((target, host, tenant, code));
    }
    assert!(
        started.elapsed() < Duration::from_millis(1600),
        "the spellings ran after the holder ended ({:?}): the test saw nothing",
        started.elapsed()
    );
    for g in &got {
        assert!(
            g.3 == 400 || g.3 == 429,
            "a spelling took a second slot: {g:?}\nall: {got:?}"
        );
    }
    assert!(up.max() <= 1, "the upstream worked on {} at once (limit 1)", up.max());
    assert_eq!(
        up.counts.total.load(Ordering::SeqCst),
        1,
        "a spelling reached the upstream"
    );
    assert_eq!(holder.await.unwrap(), 200);
}

/// A burst of 60 clients over three gateways on the cluster, two thirds of them giving up 60 or
/// 150 ms into a 600 ms request: the upstream never works on more than the limit (3) at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaving_burst_over_three_gateways_never_exceeds_the_limit() {
    let cluster = RedisCluster::start();
    let up = counting_upstream().await;
    let store = store_yaml("redis_cluster", &cluster.seed_urls());
    let gws: Vec<_> = (0..3).map(|_| binary(&up.url(), &store, &slots(3))).collect();
    let c = client();
    let tasks: Vec<_> = (0..60)
        .map(|i| {
            let url = format!("{}/busy/600", gws[i % 3].url);
            let c = c.clone();
            tokio::spawn(async move {
                let mut r = c.get(url).header("x-forwarded-for", "10.31.3.1");
                if i % 3 != 0 {
                    r = r.timeout(Duration::from_millis(if i % 3 == 1 { 60 } else { 150 }));
                }
                match r.send().await {
                    Ok(r) => r.status().as_u16(),
                    Err(e) if e.is_timeout() => 0,
                    Err(e) => panic!("{e}"),
                }
            })
        })
        .collect();
    let mut codes = Vec::new();
    for t in tasks {
        codes.push(t.await.unwrap());
    }
    assert!(codes.iter().all(|s| [0, 200, 429, 503].contains(s)), "{codes:?}");
    assert!(up.max() <= 3, "the upstream worked on {} at once (limit 3)", up.max());
    assert!(up.counts.total.load(Ordering::SeqCst) >= 3, "{codes:?}");
    let freed = eventually(Duration::from_secs(4), || async {
        in_flight(&c, &gws[1].admin, "10.31.3.1").await == 0
    })
    .await;
    assert!(freed, "slots still held after every upstream exchange ended");
}

/// Two requests hold both slots through gateway 0; `DELETE /keys` on gateway 1 resets the key:
/// no gateway admits a third while they run, and the slots free when they end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_while_slots_are_held_frees_none_across_the_fleet() {
    let cluster = RedisCluster::start();
    let up = counting_upstream().await;
    let store = store_yaml("redis_cluster", &cluster.seed_urls());
    let gws: Vec<_> = (0..3).map(|_| binary(&up.url(), &store, &slots(2))).collect();
    let c = client();
    let ip = "10.31.4.1";
    let holders: Vec<_> = (0..2)
        .map(|_| {
            let (c, url) = (c.clone(), format!("{}/busy/1800", gws[0].url));
            tokio::spawn(async move {
                c.get(url)
                    .header("x-forwarded-for", ip)
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            })
        })
        .collect();
    assert!(
        eventually(Duration::from_secs(3), || async { up.current() == 2 }).await,
        "the two holders never both reached the upstream"
    );
    let started = Instant::now();
    let r = c.delete(format!("{}/keys/{ip}", gws[1].admin)).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let mut codes = Vec::new();
    for i in 0..9 {
        let r = c
            .get(format!("{}/busy/100", gws[i % 3].url))
            .header("x-forwarded-for", ip)
            .send()
            .await
            .unwrap();
        codes.push(r.status().as_u16());
    }
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "the checks ran after the holders ended ({:?}): the test saw nothing",
        started.elapsed()
    );
    assert!(
        codes.iter().all(|&s| s == 429 || s == 503),
        "a request passed while both slots were held after the reset: {codes:?}"
    );
    assert!(up.max() <= 2, "the upstream worked on {} at once (limit 2)", up.max());
    for h in holders {
        assert_eq!(h.await.unwrap(), 200);
    }
    let freed = eventually(Duration::from_secs(3), || async {
        c.get(format!("{}/x", gws[2].url))
            .header("x-forwarded-for", ip)
            .send()
            .await
            .unwrap()
            .status()
            == 200
    })
    .await;
    assert!(freed, "the slots never came free after the holders ended");
}
