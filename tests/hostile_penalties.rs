//! Hostile client, the penalty box (after a rule denies a key, the key is denied on every node
//! for the penalty, even once its quota is back): a client that tries to get out early, by
//! spelling the path or its credentials another way, bursting at the moment of the breach,
//! waiting for its window to reset, hoping a gateway's lease or deny cache lags, or riding a
//! reload. Against the real binary, the memory store, real Redis (standalone, and the 6-node
//! cluster with three gateways) and a real upstream that counts what reaches it
//! (ARCHITECTURE.md, "A penalty holds on every node").
//!
//! | way out of the penalty | defence | test |
//! |---|---|---|
//! | path spellings, letter case, method override, `post`, absolute-form | one canonical path and method for rules and upstream; ambiguous spellings get 400 | `spellings_never_escape_a_penalty` |
//! | credential spellings: header case, `X_API_KEY`, the key twice or in a list, a bogus key beside it | one identity or 400; a present but invalid key is 401, never anonymous | the same |
//! | a burst of 60 over three gateways at the moment of the breach | one store call decides each; the breach starts one penalty, written by the same script | `a_parallel_burst_at_the_breach_admits_at_most_the_limit_and_starts_one_penalty` |
//! | wait for the window to reset (straddle) | the penalty is its own key with its own TTL | the same, and `concurrency_penalty.rs`: `*_penalty_holds_on_every_gateway` |
//! | a gateway holding a lease of the key keeps admitting | rules with a penalty never lease | `a_penalty_reaches_every_gateway_at_once_with_leases_on` |
//! | a reload (the rule's limit changed) mid-penalty | the penalty key is the limit key's, kept across reloads | `a_reload_keeps_a_penalty_and_a_reset_lifts_it_on_every_gateway` |
//! | `DELETE /keys/{ip}`: lifted on one gateway, still cached on the others | every node's deny cache drops a lifted penalty within a second | the same |
//! | ask during the penalty to be escalated less | each request reaching the store doubles it up to `max` | `concurrency_penalty.rs`: `penalties_escalate_and_an_admin_lifts_them` |
//! | flood the memory store with fresh keys to evict the penalised one | a penalised entry is never evicted (`make_room`) | `flooding_the_memory_store_never_evicts_a_penalty` |

mod support;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn store_yaml(kind: &str, urls: &[String], extra: &str) -> String {
    trusting_store_yaml(kind, urls, extra)
}

fn addr_of(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

/// Status of one raw `Connection: close` request (0 when none came within 5 s).
async fn raw_status(addr: SocketAddr, req: &str) -> u16 {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(req.as_bytes()).await;
    let mut buf = vec![0u8; 4096];
    match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
        Ok(Ok(n)) => std::str::from_utf8(buf[..n].get(9..12).unwrap_or_default())
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(0),
        _ => 0,
    }
}

fn reached(up: &CountingUpstream) -> usize {
    up.counts.total.load(Ordering::SeqCst)
}

/// Requests until the first 429 (at most `n`): the instant it came.
async fn breach(addr: SocketAddr, req: &str, n: usize) -> Instant {
    for _ in 0..n {
        if raw_status(addr, req).await == 429 {
            return Instant::now();
        }
    }
    panic!("{n} requests never breached the limit");
}

/// Waits until `d` has passed since `t` (polling, never longer than 10 s).
async fn past(t: Instant, d: Duration) {
    assert!(eventually(Duration::from_secs(10), || async { t.elapsed() >= d }).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spellings_never_escape_a_penalty() {
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: login, match: { path: /api/v1/login, methods: [POST], ignore_case: true }, key: ip, algorithm: fixed_window, limit: 2, window: 1s, penalty: 30s }
  - { name: per-key, match: { path: "/k/**" }, key: user, algorithm: fixed_window, limit: 1, window: 1s, penalty: 30s }
  - { name: open, match: { path: "/**" }, key: global, algorithm: fixed_window, limit: 1000000, window: 1h }
"#;
    let dir = tempfile::tempdir().unwrap();
    let key = "k-pen-aaaa";
    let sha = tollgate::identity::keys::hash_key(key);
    std::fs::write(
        dir.path().join("keys.yaml"),
        format!("keys:\n  - {{ id: cust_p, sha256: {sha}, tier: free }}\n"),
    )
    .unwrap();
    let extra = format!(
        "keys_file: {}\n{}",
        dir.path().join("keys.yaml").display(),
        store_yaml("memory", &[], "")
    );
    let gw = binary(&up.url(), &extra, rules);
    let a = addr_of(&gw.url);
    let req = |method: &str, target: &str, extra: &str| {
        format!("{method} {target} HTTP/1.1\r\nHost: api.example\r\nX-Forwarded-For: 10.35.0.1\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n")
    };
    let login = breach(a, &req("POST", "/api/v1/login", ""), 10).await;
    let with_key = format!("X-API-Key: {key}\r\n");
    let keyed = breach(a, &req("GET", "/k/x", &with_key), 10).await;
    // Both windows have reset since: only the penalties deny now.
    past(login.max(keyed), Duration::from_millis(1200)).await;
    let before = reached(&up);
    let mut got = Vec::new();
    for (method, target, extra) in [
        ("POST", "/api/v1/login", String::new()),
        ("POST", "/API/V1/LOGIN", String::new()),
        ("POST", "//api/v1/./login", String::new()),
        ("POST", "/api/v1/x/../login", String::new()),
        ("POST", "/api/v1/login;x", String::new()),
        ("POST", "/api/v1/log%69n", String::new()),
        ("POST", "/api%2Fv1%2Flogin", String::new()),
        ("POST", "/api/v1/login/", String::new()),
        ("POST", "http://other.example/api/v1/login", String::new()),
        ("GET", "/api/v1/login", "X-HTTP-Method-Override: POST\r\n".into()),
        ("post", "/api/v1/login", String::new()),
        ("GET", "/k/x", format!("x-api-key: {key}\r\n")),
        ("GET", "/k/x", format!("X_API_KEY: {key}\r\n")),
        ("GET", "/k/x", format!("X-API-Key: bogus\r\nX-API-Key: {key}\r\n")),
        ("GET", "/k/x", format!("X-API-Key: {key}, bogus\r\n")),
        ("GET", "/k/x", "X-API-Key: bogus\r\n".into()),
    ] {
        got.push((
            method,
            target,
            extra.clone(),
            raw_status(a, &req(method, target, &extra)).await,
        ));
    }
    for g in &got {
        assert!(
            [400, 401, 429].contains(&g.3),
            "a spelling escaped the penalty: {g:?}\nall: {got:?}"
        );
    }
    assert_eq!(reached(&up), before, "a spelling reached the upstream: {got:?}");
}

/// 60 requests at once over three gateways on the cluster, limit 5 a 2 s window, penalty 4 s:
/// at most 5 pass, the breach starts one penalty, and it holds on every gateway past the
/// window's reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parallel_burst_at_the_breach_admits_at_most_the_limit_and_starts_one_penalty() {
    let cluster = RedisCluster::start();
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: burst, match: { path: "/**" }, key: ip, algorithm: fixed_window, limit: 5, window: 2s, penalty: 4s, failure: closed }
"#;
    let store = store_yaml("redis_cluster", &cluster.seed_urls(), "");
    let gws: Vec<_> = (0..3).map(|_| binary(&up.url(), &store, rules)).collect();
    let c = client();
    let ip = "10.35.1.1";
    let tasks: Vec<_> = (0..60)
        .map(|i| {
            let (c, url) = (c.clone(), format!("{}/x", gws[i % 3].url));
            tokio::spawn(async move {
                let r = c.get(url).header("x-forwarded-for", ip).send().await.unwrap();
                let retry: u64 = r
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(0);
                (r.status().as_u16(), retry)
            })
        })
        .collect();
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap());
    }
    let burst_end = Instant::now();
    let admitted = got.iter().filter(|g| g.0 == 200).count();
    assert!(got.iter().all(|g| [200, 429, 503].contains(&g.0)), "{got:?}");
    assert!((1..=5).contains(&admitted), "{admitted} admitted (limit 5): {got:?}");
    assert!(reached(&up) <= 5);
    assert!(
        got.iter().filter(|g| g.0 == 429).all(|g| (1..=4).contains(&g.1)),
        "Retry-After outside the penalty: {got:?}"
    );
    let mut started = 0.0;
    for g in &gws {
        started += metric_value(
            &c,
            &g.admin,
            "tollgate_penalties_total{rule=\"burst\",event=\"started\"}",
        )
        .await;
    }
    assert_eq!(started, 1.0, "one breach, one penalty");
    // Past the window's reset, every gateway still denies (the penalty ends 4 s after the breach,
    // which came before the burst ended).
    past(burst_end, Duration::from_millis(2100)).await;
    let mut late = Vec::new();
    for (i, g) in gws.iter().enumerate().cycle().take(6) {
        let r = c
            .get(format!("{}/x", g.url))
            .header("x-forwarded-for", ip)
            .send()
            .await
            .unwrap();
        late.push((i, r.status().as_u16()));
    }
    assert!(
        burst_end.elapsed() < Duration::from_millis(3800),
        "the checks came too late to see the penalty ({:?})",
        burst_end.elapsed()
    );
    assert!(
        late.iter().all(|l| l.1 == 429 || l.1 == 503),
        "a gateway let the penalised key through: {late:?}"
    );
    assert!(reached(&up) <= 5);
}

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// 24 clients from `ip` round-robin over `urls` until `until` (unix µs): every request as
/// (sent, answered, status).
async fn hammer(urls: Vec<String>, ip: &str, until: u64) -> Vec<(u64, u64, u16)> {
    let c = client();
    let urls = Arc::new(urls);
    let next = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..24)
        .map(|_| {
            let (c, urls, next, stop, ip) = (c.clone(), urls.clone(), next.clone(), stop.clone(), ip.to_owned());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !stop.load(Ordering::Relaxed) && unix_us() < until {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let t = unix_us();
                    let r = c
                        .get(&urls[n % urls.len()])
                        .header("x-forwarded-for", &ip)
                        .send()
                        .await
                        .unwrap();
                    let s = r.status().as_u16();
                    let _ = r.bytes().await;
                    seen.push((t, unix_us(), s));
                }
                seen
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// A hot key with a penalty on three gateways that lease hot keys: once any gateway has
/// answered the breach, no request sent after it is admitted anywhere, though the 2 s window
/// resets meanwhile (a gateway spending a lease would go on admitting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_penalty_reaches_every_gateway_at_once_with_leases_on() {
    let cluster = RedisCluster::start();
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: hot, match: { path: "/**" }, key: ip, algorithm: fixed_window, limit: 300, window: 2s, penalty: 10s, failure: closed }
"#;
    let store = store_yaml(
        "redis_cluster",
        &cluster.seed_urls(),
        "  leases: { min_rate: 20/s, ttl: 250ms, max_share: 0.1 }\n",
    );
    let gws: Vec<_> = (0..3).map(|_| binary(&up.url(), &store, rules)).collect();
    let urls = gws.iter().map(|g| format!("{}/hot", g.url)).collect();
    let seen = hammer(urls, "10.35.2.1", unix_us() + 3_500_000).await;
    assert!(seen.iter().all(|s| [200, 429, 503].contains(&s.2)));
    let first_denial = seen
        .iter()
        .filter(|s| s.2 == 429)
        .map(|s| s.1)
        .min()
        .expect("the limit was never reached");
    let admitted = seen.iter().filter(|s| s.2 == 200).count();
    let after: Vec<_> = seen.iter().filter(|s| s.2 == 200 && s.0 > first_denial).collect();
    let c = client();
    let mut taken = 0.0;
    for g in &gws {
        taken += metric_value(&c, &g.admin, "tollgate_leases_taken_total").await;
    }
    println!(
        "{admitted} admitted of {} requests, {} after the breach, {taken} leases",
        seen.len(),
        after.len()
    );
    // The run may start late in a window that never reaches the limit: at most two windows'
    // worth before the breach (the breach then holds for the rest of the run).
    assert!(
        admitted <= 600,
        "{admitted} admitted (limit 300 in each of at most two windows)"
    );
    assert!(
        after.is_empty(),
        "{} admitted after the breach was answered",
        after.len()
    );
    assert_eq!(taken, 0.0, "a rule with a penalty was leased");
    // The requests went on past the window's reset.
    let last = seen.iter().map(|s| s.0).max().unwrap_or(0);
    assert!(last > first_denial + 2_000_000, "the run ended before the window reset");
}

/// [`binary`] with the config directory kept, so its rules can be rewritten.
fn binary_in(upstream: &str, extra: &str, rules: &str) -> (BinaryGateway, tempfile::TempDir, PathBuf) {
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
    let gw = BinaryGateway::spawn(&mut cmd, dir.path().join("tollgate.log"), &[port, admin_port]);
    let rules_file = dir.path().join("rules.yaml");
    (gw, dir, rules_file)
}

/// Limit 5 a second, penalty 20 s, three gateways on one Redis. After the breach every gateway
/// denies (each has the denial cached); a reload that changes the limit keeps the penalty; a
/// `DELETE /keys` on one gateway lifts it, and every gateway admits again within 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_a_penalty_and_a_reset_lifts_it_on_every_gateway() {
    let server = RedisServer::start();
    let up = counting_upstream().await;
    let rules = |limit: u32| {
        format!("rules:\n  - {{ name: login, match: {{ path: \"/**\" }}, key: ip, algorithm: fixed_window, limit: {limit}, window: 1s, penalty: 20s }}\n")
    };
    let store = store_yaml("redis", &[server.url()], "");
    let g0 = binary(&up.url(), &store, &rules(5));
    let (g1, _dir, rules_file) = binary_in(&up.url(), &store, &rules(5));
    let g2 = binary(&up.url(), &store, &rules(5));
    let gws = [&g0, &g1, &g2];
    let c = client();
    let ip = "10.35.3.1";
    let status = |g: &BinaryGateway| {
        let (c, url) = (c.clone(), format!("{}/x", g.url));
        async move {
            c.get(url)
                .header("x-forwarded-for", ip)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    let req = format!("GET /x HTTP/1.1\r\nHost: api.example\r\nX-Forwarded-For: {ip}\r\nConnection: close\r\n\r\n");
    let breached = breach(addr_of(&g0.url), &req, 20).await;
    for g in gws {
        assert_eq!(status(g).await, 429);
    }
    atomic_write(&rules_file, &rules(6));
    let r = c.post(format!("{}/reload", g1.admin)).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    past(breached, Duration::from_millis(1200)).await;
    for g in gws {
        assert_eq!(
            status(g).await,
            429,
            "the penalty did not hold (across the reload on g1)"
        );
    }
    let lifted = Instant::now();
    let r = c.delete(format!("{}/keys/{ip}", g2.admin)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(body["penalties_lifted"].as_u64().unwrap_or(0) >= 1, "{body}");
    for (i, g) in gws.into_iter().enumerate() {
        let back = eventually(Duration::from_secs(2), || async { status(g).await == 200 }).await;
        assert!(
            back,
            "gateway {i} still denied {:?} after the penalty was lifted",
            lifted.elapsed()
        );
    }
    assert!(lifted.elapsed() < Duration::from_secs(3));
}

/// The memory store bounded to 640 keys: a client in its penalty (its 1 s window long reset)
/// floods the store with 2,100 fresh keys (a header rule, a new `X-Junk` each). Its penalised
/// entry is never evicted, so it stays denied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flooding_the_memory_store_never_evicts_a_penalty() {
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: login, match: { path: /login }, key: ip, algorithm: fixed_window, limit: 1, window: 1s, penalty: 1h }
  - { name: junk, match: { path: "/junk" }, key: "header:X-Junk", algorithm: fixed_window, limit: 1, window: 24h }
"#;
    let extra = store_yaml("memory", &[], "").replace(
        "store:\n  kind: memory\n",
        "store:\n  kind: memory\n  memory_max_keys: 640\n",
    );
    let gw = binary(&up.url(), &extra, rules);
    let a = addr_of(&gw.url);
    let ip = "10.35.4.1";
    let req = format!("GET /login HTTP/1.1\r\nHost: api.example\r\nX-Forwarded-For: {ip}\r\nConnection: close\r\n\r\n");
    let breached = breach(a, &req, 10).await;
    past(breached, Duration::from_millis(1200)).await;
    let c = client();
    let next = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (c, url, next) = (c.clone(), format!("{}/junk", gw.url), next.clone());
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= 2100 {
                        break;
                    }
                    let r = c
                        .get(&url)
                        .header("x-forwarded-for", "10.35.4.2")
                        .header("x-junk", format!("junk-{n}"))
                        .send()
                        .await
                        .unwrap();
                    let _ = r.bytes().await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let evicted = metric_value(&c, &gw.admin, "tollgate_memory_evictions_total{kind=\"live\"}").await
        + metric_value(&c, &gw.admin, "tollgate_memory_evictions_total{kind=\"refused\"}").await;
    assert!(
        evicted > 0.0,
        "the flood never filled the store: {}",
        get_text(&c, format!("{}/metrics", gw.admin))
            .await
            .lines()
            .filter(|l| l.contains("memory"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(raw_status(a, &req).await, 429, "the flood evicted the penalised key");
}
