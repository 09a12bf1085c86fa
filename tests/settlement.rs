//! Counting by response (`count_when`), cost from the response
//! (`cost_from`, header and trailer) and runtime overrides, on the real gateway, a real
//! upstream, and the memory store, real Redis and a real 6-node cluster.

mod support;

use std::time::{Duration, Instant, SystemTime};

use support::*;

fn store_yaml(kind: &str, urls: &[String]) -> String {
    let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    let store = if kind == "memory" {
        "store:\n  kind: memory\n".to_owned()
    } else {
        format!(
            "store:\n  kind: {kind}\n  urls: [{}]\n  timeout: 200ms\n",
            list.join(", ")
        )
    };
    format!("{store}identity:\n  trusted_proxies: [127.0.0.1/32]\n")
}

async fn send(c: &reqwest::Client, method: reqwest::Method, url: &str, ip: &str) -> u16 {
    let r = c
        .request(method, url)
        .header("X-Forwarded-For", ip)
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    let _ = r.bytes().await;
    s
}

/// `count_when: {status: [401]}`: 50 concurrent wrong passwords give at most 5 upstream 401s,
/// the rest 429; successful logins spend nothing.
async fn only_failed_logins_count(kind: &str, urls: &[String]) {
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: failed-logins, match: { path: "/status/**", methods: [POST] }, key: ip, algorithm: fixed_window, limit: 5, window: 1h, count_when: { status: [401] } }
"#;
    let gw = gateway(&up.url(), &store_yaml(kind, urls), rules, None).await;
    let c = client();
    let url = format!("{}/status/401", gw.url);
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move { send(&c, reqwest::Method::POST, &url, "10.8.0.1").await })
        })
        .collect();
    let (mut unauthorized, mut limited) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            401 => unauthorized += 1,
            429 => limited += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    let reached = up.counts.total.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        unauthorized <= 5 && reached <= 5,
        "{unauthorized} 401s, {reached} reached the upstream"
    );
    assert!(unauthorized >= 1 && unauthorized + limited == 50);
    // Successful logins are refunded: ten in a row from another address all pass.
    let ok_url = format!("{}/status/200", gw.url);
    for i in 0..10 {
        assert_eq!(
            send(&c, reqwest::Method::POST, &ok_url, "10.8.0.2").await,
            200,
            "login {i}"
        );
    }
    // ... and the refunds leave room for exactly 5 failures there.
    let mut fails = 0;
    for _ in 0..8 {
        if send(&c, reqwest::Method::POST, &url, "10.8.0.2").await == 401 {
            fails += 1;
        }
    }
    assert_eq!(fails, 5);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_only_failed_logins_count() {
    only_failed_logins_count("memory", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_only_failed_logins_count() {
    let server = RedisServer::start();
    only_failed_logins_count("redis", &[server.url()]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_only_failed_logins_count() {
    let cluster = RedisCluster::start();
    only_failed_logins_count("redis_cluster", &cluster.seed_urls()).await;
}

/// `cost_from`: the estimate is reserved, then settled from the header or the trailer; a
/// report above the estimate is debited and may take the key below zero.
async fn cost_from_settles(kind: &str, urls: &[String]) {
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: tokens, match: { path: "/**" }, key: ip, algorithm: fixed_window, limit: 100, window: 1h, cost: 10, cost_from: { header: X-Tokens-Used, max: 1000 } }
"#;
    let gw = gateway(&up.url(), &store_yaml(kind, urls), rules, None).await;
    let c = client();
    let ip = "10.8.1.1";
    let remaining = || async {
        let v = get_json(&c, format!("{}/keys/{ip}", gw.admin)).await;
        v["counters"][0]["remaining"].as_u64().unwrap()
    };
    let settles_to =
        |want: u64| async move { eventually(Duration::from_secs(3), || async { remaining().await == want }).await };
    assert_eq!(
        send(&c, reqwest::Method::GET, &format!("{}/cost/50", gw.url), ip).await,
        200
    );
    assert!(
        settles_to(50).await,
        "50 reported: 100 - 50 = 50 left, got {}",
        remaining().await
    );
    assert_eq!(
        send(&c, reqwest::Method::GET, &format!("{}/cost/3", gw.url), ip).await,
        200
    );
    assert!(
        settles_to(47).await,
        "3 reported: 7 of the 10 reserved come back, got {}",
        remaining().await
    );
    assert_eq!(
        send(&c, reqwest::Method::GET, &format!("{}/trailer-cost/40", gw.url), ip).await,
        200
    );
    assert!(
        settles_to(7).await,
        "40 reported in a trailer, got {}",
        remaining().await
    );
    // Below zero: 7 left is under the estimate of 10, so a fresh address goes on.
    let ip2 = "10.8.1.2";
    assert_eq!(
        send(&c, reqwest::Method::GET, &format!("{}/cost/1000", gw.url), ip2).await,
        200
    );
    let denied = eventually(Duration::from_secs(3), || async {
        send(&c, reqwest::Method::GET, &format!("{}/cost/1", gw.url), ip2).await == 429
    })
    .await;
    assert!(denied, "a debit of 990 over a limit of 100 must deny the key");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_cost_from_settles() {
    cost_from_settles("memory", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cost_from_settles() {
    let server = RedisServer::start();
    cost_from_settles("redis", &[server.url()]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_cost_from_settles() {
    let cluster = RedisCluster::start();
    cost_from_settles("redis_cluster", &cluster.seed_urls()).await;
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

const OVERRIDDEN: &str = r#"rules:
  - name: per-ip
    match: { path: "/**" }
    key: ip
    algorithm: fixed_window
    limit: 2
    window: 1h
    overrides:
      "10.8.2.1": { limit: 3 }
"#;

async fn override_source(c: &reqwest::Client, gw: &TestGateway, ip: &str) -> String {
    let v = get_json(c, format!("{}/explain?path=/x&ip={ip}", gw.admin)).await;
    v["matches"][0]["override"]["source"]
        .as_str()
        .unwrap_or("none")
        .to_owned()
}

/// Runtime overrides on three gateways sharing one store: a PUT on one is in force on all
/// within a second, beats the rules file's override, survives a reload, is listed by hash only,
/// and a DELETE (or its expiry) brings the file's override back.
async fn runtime_overrides_reach_the_fleet(kind: &str, urls: &[String]) {
    let up = counting_upstream().await;
    let mut gws = Vec::new();
    for _ in 0..3 {
        gws.push(gateway(&up.url(), &store_yaml(kind, urls), OVERRIDDEN, None).await);
    }
    let c = client();
    let ip = "10.8.2.1";
    assert_eq!(override_source(&c, &gws[1], ip).await, "rules_file");
    let put = c
        .put(format!("{}/overrides/ip/{ip}", gws[0].admin))
        .json(&serde_json::json!({"rule": "per-ip", "limits": [{"limit": 5, "window": "1h"}], "expires_at": unix_now() + 3600}))
        .send()
        .await
        .unwrap();
    let set = Instant::now();
    assert_eq!(put.status(), 200, "{}", put.text().await.unwrap());
    for g in &gws {
        let seen = eventually(Duration::from_millis(1000), || async {
            override_source(&c, g, ip).await == "runtime"
        })
        .await;
        assert!(seen, "a gateway did not see the override within 1 s");
    }
    assert!(set.elapsed() < Duration::from_millis(1500));
    // Five pass across the fleet (the file says 3), the sixth is denied.
    for i in 0..5 {
        assert_eq!(
            send(&c, reqwest::Method::GET, &format!("{}/x", gws[i % 3].url), ip).await,
            200,
            "request {i}"
        );
    }
    assert_eq!(
        send(&c, reqwest::Method::GET, &format!("{}/x", gws[2].url), ip).await,
        429
    );
    // Listed by hash, never by the address.
    let list = get_text(&c, format!("{}/overrides", gws[2].admin)).await;
    assert!(!list.contains(ip), "the raw address is listed: {list}");
    let v: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(v["overrides"][0]["rule"], "per-ip");
    // A reload keeps it.
    let r = c.post(format!("{}/reload", gws[1].admin)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(override_source(&c, &gws[1], ip).await, "runtime");
    // Delete it: the file's override is back everywhere within a second.
    let d = c
        .delete(format!("{}/overrides/ip/{ip}", gws[2].admin))
        .send()
        .await
        .unwrap();
    assert_eq!(d.status(), 200);
    for g in &gws {
        let back = eventually(Duration::from_millis(1000), || async {
            override_source(&c, g, ip).await == "rules_file"
        })
        .await;
        assert!(back, "a gateway kept a deleted override");
    }
    // An override expires by itself.
    let ip2 = "10.8.2.9";
    let put = c
        .put(format!("{}/overrides/ip/{ip2}", gws[0].admin))
        .json(&serde_json::json!({"rule": "per-ip", "limits": [{"limit": 9, "window": "1h"}], "expires_at": unix_now() + 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
    assert_eq!(override_source(&c, &gws[0], ip2).await, "runtime");
    let expired = eventually(Duration::from_secs(5), || async {
        override_source(&c, &gws[1], ip2).await == "none"
    })
    .await;
    assert!(expired, "an expired override still applies");
    for g in gws {
        g.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_runtime_overrides_reach_the_fleet() {
    let server = RedisServer::start();
    runtime_overrides_reach_the_fleet("redis", &[server.url()]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_runtime_overrides_reach_the_fleet() {
    let cluster = RedisCluster::start();
    runtime_overrides_reach_the_fleet("redis_cluster", &cluster.seed_urls()).await;
}

/// On the memory store (one node), and every bad request gets a clear 4xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_runtime_overrides_and_bad_requests() {
    let up = counting_upstream().await;
    let gw = gateway(&up.url(), &store_yaml("memory", &[]), OVERRIDDEN, None).await;
    let c = client();
    let put = |path: &str, body: serde_json::Value| {
        let (c, url) = (c.clone(), format!("{}{path}", gw.admin));
        async move { c.put(url).json(&body).send().await.unwrap() }
    };
    let later = unix_now() + 600;
    for (path, body, why) in [
        (
            "/overrides/ip/10.8.3.1",
            serde_json::json!({"rule": "nope", "limits": [{"limit": 5, "window": "1h"}], "expires_at": later}),
            "no rule",
        ),
        (
            "/overrides/user/bob",
            serde_json::json!({"rule": "per-ip", "limits": [{"limit": 5, "window": "1h"}], "expires_at": later}),
            "keyed by ip",
        ),
        (
            "/overrides/ip/not-an-ip",
            serde_json::json!({"rule": "per-ip", "limits": [{"limit": 5, "window": "1h"}], "expires_at": later}),
            "not an IP",
        ),
        (
            "/overrides/ip/10.8.3.1",
            serde_json::json!({"rule": "per-ip", "limits": [{"rate": "1/s", "capacity": 5}], "expires_at": later}),
            "limits",
        ),
        (
            "/overrides/ip/10.8.3.1",
            serde_json::json!({"rule": "per-ip", "limits": [{"limit": 5, "window": "1h"}], "expires_at": 1000}),
            "future",
        ),
        ("/overrides/ip/10.8.3.1", serde_json::json!({"rule": "per-ip"}), "body"),
    ] {
        let r = put(path, body).await;
        assert_eq!(r.status(), 422, "{why}");
        let text = r.text().await.unwrap();
        assert!(text.contains(why), "{why}: {text}");
    }
    let r = put(
        "/overrides/ip/10.8.3.1",
        serde_json::json!({"rule": "per-ip", "limits": [{"limit": 4, "window": "1h"}], "expires_at": humantime::format_rfc3339_seconds(SystemTime::now() + Duration::from_secs(600)).to_string()}),
    )
    .await;
    assert_eq!(r.status(), 200);
    for _ in 0..4 {
        assert_eq!(
            send(&c, reqwest::Method::GET, &format!("{}/x", gw.url), "10.8.3.1").await,
            200
        );
    }
    assert_eq!(
        send(&c, reqwest::Method::GET, &format!("{}/x", gw.url), "10.8.3.1").await,
        429
    );
    let r = c
        .delete(format!("{}/overrides/ip/10.8.3.7", gw.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404, "deleting an override that does not exist");
    gw.stop().await;
}

/// Calendar windows through the gateway: a daily limit at an offset answers with
/// `X-RateLimit-Reset` at the next local midnight and `Retry-After` counting down to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daily_limit_resets_at_local_midnight() {
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: daily, match: { path: "/**" }, key: ip, algorithm: fixed_window, limit: 1, window: 1d, align: calendar, timezone: "+05:30" }
"#;
    let gw = gateway(&up.url(), &store_yaml("memory", &[]), rules, None).await;
    let c = client();
    assert_eq!(
        send(&c, reqwest::Method::GET, &format!("{}/x", gw.url), "10.8.4.1").await,
        200
    );
    let r = c
        .get(format!("{}/x", gw.url))
        .header("X-Forwarded-For", "10.8.4.1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let now = unix_now();
    let reset: u64 = r.headers()["x-ratelimit-reset"].to_str().unwrap().parse().unwrap();
    let retry: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    // The next midnight at +05:30, in UTC seconds.
    let off = 5 * 3600 + 1800;
    let midnight = ((now + off) / 86_400 + 1) * 86_400 - off;
    assert_eq!(reset, midnight, "X-RateLimit-Reset is the next local midnight");
    assert!(
        retry.abs_diff(midnight - now) <= 1,
        "Retry-After {retry} vs {}",
        midnight - now
    );
    gw.stop().await;
}

/// A request refused on its way upstream (CONNECT, which a reverse proxy does not tunnel) is
/// settled like any other response: a `count_when` rule it does not match gets its units back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connect_gives_back_its_count_when_reservation() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    async fn connect_status(addr: std::net::SocketAddr) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\nX-Forwarded-For: 10.9.0.1\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        String::from_utf8_lossy(&buf[..n])
            .lines()
            .next()
            .unwrap_or("")
            .to_owned()
    }
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: only-ok, match: { path: "/**" }, key: ip, algorithm: fixed_window, limit: 1, window: 1h, count_when: { status: [200] } }
"#;
    let gw = gateway(&up.url(), &store_yaml("memory", &[]), rules, None).await;
    let addr = gw.addr();
    for i in 0..3 {
        // The refund runs in a task of its own, and a CONNECT that races it is denied (and the
        // denial cached, for at most a second): poll. Without the refund the unit stays spent
        // for the hour, and every later CONNECT gets 429.
        let refused = eventually(Duration::from_secs(5), || async move {
            connect_status(addr).await.starts_with("HTTP/1.1 400")
        })
        .await;
        assert!(refused, "CONNECT {i} never got its 400: its quota was not given back");
    }
    // The one unit is still there: the CONNECTs were refunded.
    let c = client();
    let ok = format!("{}/status/200", gw.url);
    let passed = eventually(Duration::from_secs(5), || {
        let (c, ok) = (c.clone(), ok.clone());
        async move { send(&c, reqwest::Method::GET, &ok, "10.9.0.1").await == 200 }
    })
    .await;
    assert!(passed, "the unit the CONNECTs reserved never came back");
    assert_eq!(send(&c, reqwest::Method::GET, &ok, "10.9.0.1").await, 429);
}

/// The counter of rule `rule` (not its in-flight cap) that `/keys/{ip}` shows.
async fn counter(c: &reqwest::Client, admin: &str, ip: &str, rule: &str) -> serde_json::Value {
    let v = get_json(c, format!("{admin}/keys/{ip}")).await;
    v["counters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["rule"] == rule && k["algorithm"] != "concurrency")
        .cloned()
        .unwrap_or_else(|| panic!("no counter of {rule} in {v}"))
}

/// Polls until `ip`'s counter of `rule` has `remaining == want` (within `within`).
async fn remaining_reaches(
    c: &reqwest::Client,
    admin: &str,
    ip: &str,
    rule: &str,
    want: u64,
    within: Duration,
) -> bool {
    eventually(within, || async move {
        counter(c, admin, ip, rule).await["remaining"] == want
    })
    .await
}

const TOKENS: &str = r#"rules:
  - { name: tokens, match: { path: "/**" }, key: ip, algorithm: token_bucket, rate: 1/h, capacity: 10000, cost: 100, cost_from: { header: X-Tokens-Used, max: 5000 } }
"#;

/// A client that leaves before the trailer with the real cost still pays it: the exchange goes
/// on and the trailer is read (4000 charged, not the estimate of 100); and when the trailer does
/// not come within `request_timeout` (2 s) after the client left, `max` (5000) is charged.
async fn leaving_before_the_trailer_is_charged(kind: &str, urls: &[String]) {
    let up = counting_upstream().await;
    let gw = binary(&up.url(), &store_yaml(kind, urls), TOKENS);
    let c = client();
    for (ip, path, want) in [
        ("10.8.5.1", "/busy-stream/300/4000", 6000),
        ("10.8.5.2", "/busy-stream/5000/50", 5000),
    ] {
        let mut r = c
            .get(format!("{}{path}", gw.url))
            .header("X-Forwarded-For", ip)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.chunk().await.unwrap().is_some());
        drop(r);
        assert!(
            remaining_reaches(&c, &gw.admin, ip, "tokens", want, Duration::from_secs(5)).await,
            "{path}: {} left, want {want}",
            counter(&c, &gw.admin, ip, "tokens").await
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_leaving_before_the_trailer_is_charged() {
    leaving_before_the_trailer_is_charged("memory", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_leaving_before_the_trailer_is_charged() {
    let server = RedisServer::start();
    leaving_before_the_trailer_is_charged("redis", &[server.url()]).await;
}

/// Milliseconds since the epoch (the stores' windows are aligned to it).
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A request checked just before a fixed window's end and answered in the next window: its
/// debit lands in the window it is answered in (before, it was dropped, and a key could spend
/// 20 times its quota a window). Limit 10,000 per 2 s, estimate 100, reported 5,000.
async fn a_debit_across_a_window_boundary_lands(kind: &str, urls: &[String]) {
    const W: u64 = 2000;
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: tokens, match: { path: "/**" }, key: ip, algorithm: fixed_window, limit: 10000, window: 2s, cost: 100, cost_from: { header: X-Tokens-Used, max: 5000 } }
"#;
    let gw = binary(&up.url(), &store_yaml(kind, urls), rules);
    let c = client();
    let mut straddled = 0;
    for attempt in 0..3 {
        let ip = format!("10.8.6.{attempt}");
        // Positioning only (not synchronisation): 350 ms before a window's end.
        let into = unix_ms() % W;
        let wait = (W - 350 + W - into) % W;
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let sent = unix_ms();
        let r = c
            .get(format!("{}/busy/700/5000", gw.url))
            .header("X-Forwarded-For", &ip)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await;
        let answered = unix_ms();
        if sent / W + 1 != answered / W || sent % W > W - 150 {
            continue; // the check may not have been in the earlier window: try again
        }
        straddled += 1;
        // The debit (5,000 reported - 100 reserved) counts in the window it was answered in:
        // 10,000 - 4,900 left there (the estimate stayed in the window of the check).
        let left_in_window = W - answered % W;
        let landed = remaining_reaches(
            &c,
            &gw.admin,
            &ip,
            "tokens",
            5100,
            Duration::from_millis(left_in_window.saturating_sub(100)),
        )
        .await;
        assert!(
            landed && unix_ms() / W == answered / W,
            "the debit of a request answered after the boundary did not land: {}",
            counter(&c, &gw.admin, &ip, "tokens").await
        );
        break;
    }
    assert_eq!(straddled, 1, "no request straddled the boundary in three tries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_debit_across_a_window_boundary_lands() {
    a_debit_across_a_window_boundary_lands("memory", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_debit_across_a_window_boundary_lands() {
    let server = RedisServer::start();
    a_debit_across_a_window_boundary_lands("redis", &[server.url()]).await;
}

/// 150 concurrent requests before any settles: capacity 10,000, estimate 100, `max` 5,000 and the
/// default cap of `max(2, 10,000 / 4,900) = 2` requests in flight per key, so the overspend
/// before settlement is at most 2 × 4,900: at most 3 of the 5,000-unit requests pass (before,
/// 100 did), and the upstream never works on more than 2.
async fn a_burst_before_settlement_is_bounded(kind: &str, urls: &[String]) {
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: tokens, match: { path: "/busy/**" }, key: ip, algorithm: token_bucket, rate: 1/h, capacity: 10000, cost: 100, cost_from: { header: X-Tokens-Used, max: 5000 } }
"#;
    let gw = binary(&up.url(), &store_yaml(kind, urls), rules);
    let c = client();
    let url = format!("{}/busy/300/5000", gw.url);
    let tasks: Vec<_> = (0..150)
        .map(|_| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move { send(&c, reqwest::Method::GET, &url, "10.8.7.1").await })
        })
        .collect();
    let mut admitted = 0u64;
    for t in tasks {
        match t.await.unwrap() {
            200 => admitted += 1,
            429 => {}
            other => panic!("unexpected status {other}"),
        }
    }
    let bound = 10_000 + 2 * (5_000 - 100);
    assert!(
        admitted >= 1 && admitted * 5_000 <= bound,
        "{admitted} admitted: {} units against a capacity of 10,000 and a bound of {bound}",
        admitted * 5_000
    );
    assert!(up.max() <= 2, "the upstream worked on {} at once", up.max());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_burst_before_settlement_is_bounded() {
    a_burst_before_settlement_is_bounded("memory", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_burst_before_settlement_is_bounded() {
    let server = RedisServer::start();
    a_burst_before_settlement_is_bounded("redis", &[server.url()]).await;
}

/// A reported cost far above the capacity (999,990 more on a capacity of 1,000 at 1/s) takes the
/// key at most one capacity below zero: its bucket is full again within two full refills
/// (2,000 s), not a thousand (before, a key sat 139 h below zero this way).
async fn a_debit_stops_one_capacity_below_zero(kind: &str, urls: &[String]) {
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: big, match: { path: "/cost/**" }, key: ip, algorithm: token_bucket, rate: 1/s, capacity: 1000, cost: 10, cost_from: { header: X-Tokens-Used, max: 1000000 } }
"#;
    let gw = binary(&up.url(), &store_yaml(kind, urls), rules);
    let c = client();
    let ip = "10.8.7.2";
    assert_eq!(
        send(&c, reqwest::Method::GET, &format!("{}/cost/1000000", gw.url), ip).await,
        200
    );
    let below = eventually(Duration::from_secs(3), || async {
        counter(&c, &gw.admin, ip, "big").await["reset_ms"]
            .as_u64()
            .unwrap_or(0)
            > 1_000_000
    })
    .await;
    let reset = counter(&c, &gw.admin, ip, "big").await["reset_ms"]
        .as_u64()
        .unwrap_or(0);
    assert!(below, "the debit never took the key below zero: reset in {reset} ms");
    assert!(
        reset <= 2_000_000,
        "the key went {reset} ms of refill below full: past one capacity below zero"
    );
    // Denied meanwhile, and told to come back within the floor's time.
    let r = c
        .get(format!("{}/cost/10", gw.url))
        .header("X-Forwarded-For", ip)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(
        retry <= 1_011,
        "Retry-After {retry} s: past one capacity (1,000 s) below zero"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_debit_stops_one_capacity_below_zero() {
    a_debit_stops_one_capacity_below_zero("memory", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_debit_stops_one_capacity_below_zero() {
    let server = RedisServer::start();
    a_debit_stops_one_capacity_below_zero("redis", &[server.url()]).await;
}
